"""The measured value of the checklist rows that belong to no single rule module: ``nonfinite`` (its rules are
declared in ``rules/nonfinite.py`` and ``rules/rollback.py``, its row in :mod:`lightning_diag.rules.catalog`).

The rows of one rule module are measured (and replayed) in that module (:mod:`lightning_diag.rules.rows`); the
attention range row, which no rule decides, in :mod:`~lightning_diag.report.attention_range`. Registered on import by
:mod:`lightning_diag.report.checks`. Imports neither torch nor Lightning.
"""

from __future__ import annotations

import math

from lightning_diag.core.tags import prefix
from lightning_diag.rules.catalog import NONFINITE_ROLLBACK
from lightning_diag.rules.rows import Check, LoggedRun, is_attached, measure, serious_alerts

__all__: list[str] = []


@measure("nonfinite")
def _measure_nonfinite(run: LoggedRun, check: Check) -> bool:
    check.threshold = "no non-finite value"
    check.threshold_value = {"value": 0.0}
    alerts = serious_alerts(run.alerts, check.rules)
    bad_points = [
        (t, step)
        for t in (*run.tags(prefix("loss")), *run.tags(prefix("grad_norm")))
        for step, v in run.scalars[t]
        if not math.isfinite(v)
    ]
    if alerts:
        first = min(alerts, key=lambda a: a.global_step)
        check.measured = (
            f"{len(alerts)} non-finite alert(s); first: {first.rule} at step {first.global_step} ({first.source})"
        )
        check.measured_value = {"count": float(len(alerts)), "first_step": float(first.global_step)}
        rolled = [f"step {a.global_step} ({a.source})" for a in alerts if a.rule == NONFINITE_ROLLBACK]
        if rolled:
            end = "the rollback limit stopped training" if any(a.source == "rollback_limit" for a in alerts) else ""
            check.add_note(f"{len(rolled)} rollback(s) at {', '.join(rolled)}; {end or 'training went on'}")
    elif bad_points:
        name, step = min(bad_points, key=lambda p: p[1])
        check.measured = f"{len(bad_points)} non-finite logged values; first: {name} at step {step}"
        check.measured_value = {"count": float(len(bad_points)), "first_step": float(step)}
        check.status = "fail"
        check.add_note("non-finite values were logged but no AnomalyAlarm alert was raised (is AnomalyAlarm attached?)")
    else:
        check.measured = "none"
        check.measured_value = {"count": 0.0}
    return is_attached(run, check.rules) or bool(run.tags(prefix("loss"))) or bool(run.tags(prefix("grad_norm")))
