"""``memory_growth`` (framework-free), fed by :class:`~lightning_diag.SystemMonitor` at its logging steps.

Exact meaning: a memory series (host RSS, CUDA allocated) that grew by more than ``threshold`` of its first value
over the last ``window`` intervals (Theil–Sen slope), rising on at least ``rising_fraction`` of them.
"""

from __future__ import annotations

import math

from lightning_diag.core.record import Alert
from lightning_diag.core.registry import POSITIVE, Limit, RuleSpec, default, register
from lightning_diag.rules.base import Rule, StepContext, excess
from lightning_diag.rules.measures import Measure, Measures
from lightning_diag.stats.timing import growth

__all__ = [
    "DEFAULT_MEMORY_GROWTH_RISING_FRACTION",
    "DEFAULT_MEMORY_GROWTH_THRESHOLD",
    "DEFAULT_MEMORY_GROWTH_WINDOW",
    "MEMORY_GROWTH",
    "MEMORY_GROWTH_SPEC",
    "MemoryGrowthRule",
]

_SYSTEM = "SystemMonitor"
MEMORY_GROWTH_SPEC = register(RuleSpec(
    "memory_growth", _SYSTEM, "warning", 0.1,
    "host or device memory growing by more than {threshold:.0%} over {window:g} intervals",
    settings={"window": 8, "rising_fraction": 0.7},
    limits={"threshold": POSITIVE, "window": Limit(low=3, integer=True),
            "rising_fraction": Limit(low=0.0, high=1.0)},
))
MEMORY_GROWTH = MEMORY_GROWTH_SPEC.rule_id
#: ``memory_growth``: growth above this fraction of the window's first value.
DEFAULT_MEMORY_GROWTH_THRESHOLD = default(MEMORY_GROWTH)
#: ``memory_growth``: logging intervals the growth is measured over.
DEFAULT_MEMORY_GROWTH_WINDOW = int(default(MEMORY_GROWTH_SPEC.key("window")))
#: ``memory_growth``: fraction of the intervals that must rise.
DEFAULT_MEMORY_GROWTH_RISING_FRACTION = default(MEMORY_GROWTH_SPEC.key("rising_fraction"))


class MemoryGrowthRule(Rule):
    """``memory_growth``: fed once per logging interval with each memory series' current value (bytes)."""

    specs = (MEMORY_GROWTH_SPEC,)
    state_keys = ("history",)
    needs = frozenset({Measure.MEMORY})

    def __init__(
        self,
        threshold: float = DEFAULT_MEMORY_GROWTH_THRESHOLD,
        window: int = DEFAULT_MEMORY_GROWTH_WINDOW,
        rising_fraction: float = DEFAULT_MEMORY_GROWTH_RISING_FRACTION,
    ) -> None:
        super().__init__()
        self.threshold = threshold
        self.window = window
        self.rising_fraction = rising_fraction
        self.history: dict[str, list[float]] = {}

    def judge(self, ctx: StepContext, m: Measures) -> list[Alert]:
        """Judge the latest value of each series (``m.memory``: ``{"host_rss": bytes, ...}``)."""
        values = m.memory or {}
        alerts = []
        for source, value in values.items():
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                continue
            series = self.history.setdefault(source, [])
            series.append(float(value))
            del series[: -self.window]
            if len(series) < self.window:
                continue
            rel, rising = growth(series)
            self.observe(min(excess(rel, self.threshold), excess(rising, self.rising_fraction)), 1.0)
            active = rel > self.threshold and rising >= self.rising_fraction
            if self.latch.update(source, active):
                mib = (series[-1] - series[0]) / 2**20
                alerts.append(
                    self._alert(
                        ctx,
                        f"{source} grew by {rel:.0%} ({mib:+.0f} MiB) over the last {len(series)} intervals, rising on"
                        f" {rising:.0%} of them: a leak (tensors kept with their graph, e.g. `losses.append(loss)`"
                        " instead of `loss.item()`/`loss.detach()`, or a cache that never evicts)",
                        source,
                        rel,
                        self.threshold,
                    )
                )
        return alerts
