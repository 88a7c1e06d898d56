"""The report's "Attention range" row: which heads read far and which purely locally (seed 001 §2.1: long-range
dependency detection), from ``diag/attn_distance[_relative]/<module>/head_<h>``. Imports neither torch nor
Lightning."""

from __future__ import annotations

from lightning_diag.core.tags import prefix
from lightning_diag.rules.rows import Check, LoggedRun, measure

__all__ = ["LOCAL_TOKENS", "LONG_RANGE_SHARE", "head_ranges"]

#: A head whose mean attention distance is at least this share of the sequence length reads long-range.
LONG_RANGE_SHARE = 0.25
#: A head whose mean attention distance is below this many tokens is purely local (itself and its neighbours).
LOCAL_TOKENS = 1.5
_SHOWN = 6


def _last(run: LoggedRun, family: str) -> dict[str, float]:
    out = {}
    for tag in run.tags(prefix(family)):
        points = run.scalars[tag]
        if points:
            out[tag[len(prefix(family)) :]] = points[-1][1]
    return out


def head_ranges(run: LoggedRun) -> tuple[dict[str, float], dict[str, float]]:
    """``(long_range, local)``: ``module/head_<h>`` -> its last relative (long-range) or absolute (local) mean
    attention distance."""
    relative, absolute = _last(run, "attn_distance_relative"), _last(run, "attn_distance")
    long_range = {h: v for h, v in relative.items() if v >= LONG_RANGE_SHARE}
    local = {h: v for h, v in absolute.items() if v < LOCAL_TOKENS}
    return long_range, local


def _names(heads: dict[str, float], unit: str) -> str:
    order = sorted(heads, key=heads.__getitem__, reverse=unit == "of the sequence")
    shown = ", ".join(f"`{h}` {heads[h]:.2g}" for h in order[:_SHOWN])
    more = f" and {len(order) - _SHOWN} more" if len(order) > _SHOWN else ""
    return f"{len(order)} ({shown}{more})" if order else "none"


@measure("attn_range")
def _measure_attention_range(run: LoggedRun, check: Check) -> bool:
    """Informational: names the long-range and the purely local heads; it never fails."""
    if not run.tags(prefix("attn_distance")):
        return False
    long_range, local = head_ranges(run)
    total = len(run.tags(prefix("attn_distance")))
    check.threshold = (
        f"long-range: mean distance >= {LONG_RANGE_SHARE:.0%} of the sequence; local: < {LOCAL_TOKENS:g} tokens"
    )
    check.measured = (
        f"{total} heads; long-range {_names(long_range, 'of the sequence')}; local {_names(local, 'tokens')}"
    )
    check.measured_value = {"heads": total, "long_range": len(long_range), "local": len(local)}
    return True
