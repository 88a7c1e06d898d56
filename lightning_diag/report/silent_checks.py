"""Checklist rows of the silent-error rules: ``updates_applied`` (GradientFlowMonitor's ``diag/updates/<layer>``)
and ``replicas_agree`` (AnomalyAlarm's ``diag/replicas/...``): measured values from the logged series. The rows
pass or fail on the rules' alerts (``update_none``, ``update_stale``; ``ddp_desync``), which need what the series
do not hold (parameter dtypes, optimizer membership, every rank's checksums), so nothing is replayed. Registered on
import by :mod:`lightning_diag.report.checks` (machinery: :mod:`~lightning_diag.report.rows`)."""

from __future__ import annotations

from lightning_diag.core.registry import RULES
from lightning_diag.core.tags import replicas_tag, updates_layer
from lightning_diag.report.load import RunData
from lightning_diag.report.replay import run_setting
from lightning_diag.report.rows import Check, finite_values, fmt, measure
from lightning_diag.rules.catalog import DDP_DESYNC, UPDATE_STALE

__all__: list[str] = []


@measure("updates_applied")
def _measure_updates(run: RunData, check: Check) -> bool:
    check.threshold = RULES[UPDATE_STALE].describe(run.thresholds)
    check.threshold_value = {"stale_fraction": run_setting(run, UPDATE_STALE)}
    worst: dict[str, float] = {}
    measurements = 0
    for name, points in run.scalars.items():
        layer = updates_layer(name)
        values = finite_values(points) if layer is not None else []
        if values:
            worst[layer] = max(values)  # type: ignore[index]
            measurements = max(measurements, len(values))
    if not worst:
        return False
    top = max(worst, key=worst.__getitem__)
    check.measured = (
        f"largest share of sampled elements left unchanged by a step: {worst[top]:.1%} (`{top}`), over "
        f"{len(worst)} layers and {measurements} measured steps"
    )
    check.measured_value = {"max": worst[top], "layers": float(len(worst))}
    return True


@measure("replicas_agree")
def _measure_replicas(run: RunData, check: Check) -> bool:
    check.threshold = RULES[DDP_DESYNC].describe(run.thresholds)
    check.threshold_value = {"value": run_setting(run, DDP_DESYNC)}
    diffs = finite_values(run.scalars.get(replicas_tag("max_rel_diff"), []))
    if not diffs:
        return False
    check.measured = f"largest relative checksum difference across ranks {fmt(max(diffs))} over {len(diffs)} checks"
    check.measured_value = {"max": max(diffs), "checks": float(len(diffs))}
    return True
