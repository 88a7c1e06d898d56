"""One row of the ``lightning-diag report`` checklist: :class:`Check`, the registry of measure functions
(:func:`measure`) and the helpers the row modules (``measures.py``, ``data_checks.py``, ``probe_checks.py``,
``silent_checks.py``, ``problem_checks.py``) share.

:mod:`lightning_diag.report.checks` imports the row modules and judges the rows; the row modules import this
module, never ``checks``, so the import graph has no cycle. Imports neither torch nor Lightning.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal

from lightning_diag.core.alerts import Alert
from lightning_diag.report.load import RunData
from lightning_diag.rules.catalog import ALL_RULES

__all__ = [
    "CHECKLIST_LAYERS",
    "MEASURES",
    "Check",
    "Measure",
    "Status",
    "finite_values",
    "fmt",
    "is_attached",
    "json_safe",
    "measure",
    "run_threshold",
    "serious_alerts",
]

Status = Literal["pass", "fail", "not measured"]
CHECKLIST_LAYERS = ("Data", "Model", "Training", "Deployment")


@dataclasses.dataclass
class Check:
    """One line of the checklist.

    Attributes:
        id: Stable identifier (``grad_norm_band``, ``nonfinite``, ...; a rule id for rules without a check).
        layer: ``Data``, ``Model``, ``Training``, ``Deployment`` or ``Other``.
        title: What is checked, with the thresholds in effect (from the rule registry).
        rules: The rule ids that decide it.
        status: ``pass``, ``fail`` or ``not measured``.
        measured: The measured value in words (``None`` when not measured).
        measured_value: The same as numbers (``{"min": ..., "max": ...}`` or ``{"value": ...}``).
        threshold: The threshold in words.
        threshold_value: The same as numbers.
        alerts: Warning and critical alerts of its rules in the run's alert log.
        first_alert_step: Global step of the first of them (or of the first replayed one).
        replayed: Warning and critical alerts its rules raise when replayed over the logged series.
        note: Why it is not measured, or what else the reader should know.
        severity: The worst severity (``"warning"`` or ``"critical"``) of the alerts that fail it, logged or
            replayed; ``""`` when it does not fail. ``lightning-diag report --fail-on`` gates on it.
    """

    id: str
    layer: str
    title: str
    rules: tuple[str, ...]
    status: Status = "not measured"
    measured: str | None = None
    measured_value: dict[str, float] = dataclasses.field(default_factory=dict)
    threshold: str = ""
    threshold_value: dict[str, float] = dataclasses.field(default_factory=dict)
    alerts: int = 0
    first_alert_step: int | None = None
    replayed: int = 0
    note: str = ""
    severity: str = ""

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (non-finite numbers as strings)."""
        return json_safe(dataclasses.asdict(self))

    def add_note(self, text: str) -> None:
        """Append a sentence to :attr:`note`."""
        self.note = f"{self.note} {text}".strip() if self.note else text


def json_safe(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else str(obj)
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


# -- registries of measure and replay functions -----------------------------------------------------------

#: Fills a check's measured value from the logged series; returns whether the series was measured.
Measure = Callable[[RunData, Check], bool]
#: Check id -> its measure function.
MEASURES: dict[str, Measure] = {}


def measure(check_id: str) -> Callable[[Measure], Measure]:
    """Register the measure function of a checklist row."""

    def decorate(fn: Measure) -> Measure:
        MEASURES[check_id] = fn
        return fn

    return decorate


# -- helpers ----------------------------------------------------------------------------------------------


def fmt(x: float) -> str:
    return f"{x:.3g}" if math.isfinite(x) else str(x)


def finite_values(points: Iterable[tuple[int, float]]) -> list[float]:
    return [v for _, v in points if math.isfinite(v)]


def serious_alerts(alerts: Iterable[Alert], rules: Sequence[str]) -> list[Alert]:
    return [a for a in alerts if a.rule in rules and a.severity != "info"]


def run_threshold(run: RunData, key: str) -> float | None:
    value = run.thresholds.get(key)
    return None if value is None else float(value)


def is_attached(run: RunData, rules: Sequence[str]) -> bool:
    return any(ALL_RULES.get(r) in run.callbacks for r in rules)
