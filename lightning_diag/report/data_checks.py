"""The checklist's two Data rows (seed 000 §7.1), measured and replayed from what DataDiagnostics logged.

* ``data_label_balance`` ("label distribution standard deviation < 0.1"): the latest ``diag/data/<split>/label_std``
of each split against ``label_imbalance``. * ``data_train_test_overlap`` ("train/test Jaccard similarity < 0.15"):
the latest ``diag/data/leaked_fraction`` (the Jaccard containment of the validation set in the training set,
docs/data_diagnostics.md) against ``data_leakage``.

Both rows are replayed with :class:`~lightning_diag.rules.data_sample.DataRules`, the code the callback runs.
Registered on import by :mod:`lightning_diag.report.checks` (the row machinery comes from
:mod:`lightning_diag.report.rows`). Imports neither torch nor Lightning.
"""

from __future__ import annotations

import math

from lightning_diag.core.alerts import Alert
from lightning_diag.core.tags import family_tag
from lightning_diag.report.load import RunData
from lightning_diag.report.replay import replay, run_setting
from lightning_diag.report.rows import Check, measure
from lightning_diag.rules.base import StepContext
from lightning_diag.rules.data_sample import DATA_LEAKAGE, LABEL_IMBALANCE, DataMeasurement, DataRules
from lightning_diag.rules.measures import Measures

__all__: list[str] = []

_SPLITS = ("train", "val")


def _latest(run: RunData, *parts: str) -> tuple[int, float] | None:
    points = [(s, v) for s, v in run.scalars.get(family_tag("data", *parts), []) if math.isfinite(v)]
    return points[-1] if points else None


def _label_std(run: RunData) -> dict[str, tuple[int, float]]:
    return {split: p for split in _SPLITS if (p := _latest(run, split, "label_std")) is not None}


@measure("data_label_balance")
def _measure_label_balance(run: RunData, check: Check) -> bool:
    limit = run_setting(run, LABEL_IMBALANCE)
    check.threshold = f"std of class proportions <= {limit:.3g}"
    check.threshold_value = {"value": limit}
    stds = _label_std(run)
    if stds:
        check.measured = "std of class proportions: " + ", ".join(f"{k} {v:.3g}" for k, (_, v) in stds.items())
        check.measured_value = {k: v for k, (_, v) in stds.items()}
    return bool(stds)


@measure("data_train_test_overlap")
def _measure_overlap(run: RunData, check: Check) -> bool:
    limit = run_setting(run, DATA_LEAKAGE)
    check.threshold = f"share of validation samples copying a training sample < {limit:.3g}"
    check.threshold_value = {"value": limit}
    leaked = _latest(run, "leaked_fraction")
    if leaked is not None:
        extra = [
            (name, p[1]) for name in ("exact_copies", "near_copies", "train_coverage") if (p := _latest(run, name))
        ]
        check.measured = f"{leaked[1]:.1%} of validation samples" + (
            " (" + ", ".join(f"{n.replace('_', ' ')} {v:.1%}" for n, v in extra) + ")" if extra else ""
        )
        check.measured_value = {"value": leaked[1], **dict(extra)}
    return leaked is not None


def _rules(run: RunData) -> DataRules:
    return DataRules.from_settings(run.thresholds)


@replay("data_label_balance")
def _replay_label_balance(run: RunData) -> list[Alert]:
    stds = _label_std(run)
    if not stds:
        return []
    step = max(s for s, _ in stds.values())
    m = DataMeasurement(label_std={k: v for k, (_, v) in stds.items()})
    return [a for a in _rules(run).judge(StepContext(0, step), Measures(data=m)) if a.rule == LABEL_IMBALANCE]


@replay("data_train_test_overlap")
def _replay_overlap(run: RunData) -> list[Alert]:
    leaked = _latest(run, "leaked_fraction")
    if leaked is None:
        return []
    m = DataMeasurement(leaked_fraction=leaked[1], leaked=1 if leaked[1] > 0 else 0)
    return [a for a in _rules(run).judge(StepContext(0, leaked[0]), Measures(data=m)) if a.rule == DATA_LEAKAGE]
