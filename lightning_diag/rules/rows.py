"""The machinery of the ``lightning-diag report`` checklist rows that live beside their rules: :class:`Check` (one
row), the registries of measure and replay functions (:func:`measure`, :func:`replay`), the run they read
(:class:`LoggedRun`) and the helpers more than one row uses.

A rule module that declares a row's :class:`~lightning_diag.core.registry.CheckSpec` also holds the row's
``@measure(id)`` function (its measured value from the logged series) and, where its pure rules can be re-run over
those series, its ``@replay(id)`` function. The registries are filled when :mod:`lightning_diag.rules.catalog`
imports the rule modules; :mod:`lightning_diag.report.checks` looks the functions up by check id. A row with no
check (an "Other" row of one rule) is looked up by its rule id. Imports only the standard library and
:mod:`lightning_diag.core` (no torch, no Lightning, no report).

Example:
    >>> check = Check("nonfinite", "Training", "No NaN/Inf in loss or gradients", ("nonfinite_loss",))
    >>> check.status
    'not measured'
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal, Protocol

from lightning_diag.core.record import Alert
from lightning_diag.core.registry import OWNERS, default
from lightning_diag.core.tags import grad_layer, prefix

__all__ = [
    "CHECKLIST_LAYERS",
    "MEASURES",
    "REPLAYS",
    "Check",
    "LayerPoints",
    "LoggedRun",
    "Measure",
    "Replay",
    "Series",
    "Status",
    "band_threshold",
    "finite_family",
    "finite_values",
    "fmt",
    "is_attached",
    "json_safe",
    "last_point",
    "layer_series",
    "measure",
    "per_layer_series",
    "replay",
    "run_setting",
    "run_threshold",
    "serious_alerts",
    "updates_by_step",
    "values_by_step",
    "worst_point",
]

Status = Literal["pass", "fail", "not measured"]
CHECKLIST_LAYERS = ("Data", "Model", "Training", "Deployment")

#: One logged scalar series: ``(step, value)`` points.
Series = list[tuple[int, float]]
#: Per layer (or module), its ``(step, value)`` points of one tag family.
LayerPoints = dict[str, Series]


class LoggedRun(Protocol):
    """What the rows read of a run (:class:`lightning_diag.report.load.RunData` has it)."""

    #: Tag -> its logged points.
    scalars: dict[str, Series]
    #: The run's alert log.
    alerts: list[Alert]
    #: The thresholds and settings in effect (``diag/thresholds.json``).
    thresholds: dict[str, float]
    #: Callback name -> its thresholds, for each callback attached to the run.
    callbacks: dict[str, dict[str, float]]
    #: The user's metric names (``val_loss`` -> the logged name).
    mapping: dict[str, str]

    def tags(self, prefix: str) -> list[str]:
        """Scalar tags starting with ``prefix``, sorted."""
        ...

    def diag_json(self, name: str) -> Any:
        """The JSON file ``diag/<name>`` of the run (raises ``OSError`` or ``ValueError`` when unreadable)."""
        ...


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
    """``obj`` with its non-finite floats as strings, dict keys as strings and tuples as lists."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else str(obj)
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


# -- registries of measure and replay functions -----------------------------------------------------------

#: Fills a check's measured value from the logged series; returns whether the series was measured.
Measure = Callable[[LoggedRun, Check], bool]
#: Check id (the rule id for a rule without a check) -> its measure function.
MEASURES: dict[str, Measure] = {}
#: Re-runs a check's pure rules over the logged series; returns the alerts they raise.
Replay = Callable[[LoggedRun], list[Alert]]
#: Check id -> its replay function.
REPLAYS: dict[str, Replay] = {}


def measure(check_id: str) -> Callable[[Measure], Measure]:
    """Register the measure function of a checklist row."""

    def decorate(fn: Measure) -> Measure:
        MEASURES[check_id] = fn
        return fn

    return decorate


def replay(check_id: str) -> Callable[[Replay], Replay]:
    """Register the replay function of a checklist row."""

    def decorate(fn: Replay) -> Replay:
        REPLAYS[check_id] = fn
        return fn

    return decorate


# -- helpers ----------------------------------------------------------------------------------------------


def fmt(x: float) -> str:
    """A number in three significant digits (``inf``/``nan`` as such)."""
    return f"{x:.3g}" if math.isfinite(x) else str(x)


def finite_values(points: Iterable[tuple[int, float]]) -> list[float]:
    """The finite values of a series."""
    return [v for _, v in points if math.isfinite(v)]


def serious_alerts(alerts: Iterable[Alert], rules: Sequence[str]) -> list[Alert]:
    """The warning and critical alerts of ``rules``."""
    return [a for a in alerts if a.rule in rules and a.severity != "info"]


def run_threshold(run: LoggedRun, key: str) -> float | None:
    """A threshold or setting the run logged (``None`` when it did not)."""
    value = run.thresholds.get(key)
    return None if value is None else float(value)


def run_setting(run: LoggedRun, key: str) -> float:
    """A threshold or setting in effect for replaying: the run's, else the registry's default."""
    value = run.thresholds.get(key)
    return float(value) if value is not None else default(key)


def is_attached(run: LoggedRun, rules: Sequence[str]) -> bool:
    """Whether a callback owning one of ``rules`` was attached to the run."""
    return any(OWNERS.get(r) in run.callbacks for r in rules)


def band_threshold(check: Check, run: LoggedRun, low_rule: str, high_rule: str) -> tuple[float | None, float | None]:
    """The run's thresholds of a band's two rules, also set as the check's ``low`` / ``high`` threshold values."""
    low, high = run_threshold(run, low_rule), run_threshold(run, high_rule)
    check.threshold_value = {k: v for k, v in (("low", low), ("high", high)) if v is not None}
    return low, high


def per_layer_series(run: LoggedRun) -> dict[str, Series]:
    """``diag/grad_norm/<layer>`` series by layer (the raw L2 norms)."""
    return {layer: run.scalars[t] for t in run.tags(prefix("grad_norm")) if (layer := grad_layer(t)) is not None}


def layer_series(run: LoggedRun, family: str) -> dict[str, Series]:
    """``diag/<family>/<layer>`` series by layer (``grad_rms``, ``grad_relative``)."""
    head = prefix(family)
    return {t[len(head) :]: run.scalars[t] for t in run.tags(head)}


def values_by_step(series: Iterable[tuple[str, Series]]) -> dict[int, dict[str, float]]:
    """``(name, points)`` pairs regrouped as step -> name -> value, by step."""
    out: dict[int, dict[str, float]] = {}
    for name, points in series:
        for step, v in points:
            out.setdefault(step, {})[name] = v
    return dict(sorted(out.items()))


def updates_by_step(run: LoggedRun) -> dict[int, dict[str, float]]:
    """``diag/update_ratio/<layer>`` by measured step: the gradient rules read the update of a measured step at the
    next measurement, as in the run (a replay judges them as ``Measures(update_ratios=...)`` after the step's
    gradients, as the live monitor feeds them)."""
    return values_by_step(layer_series(run, "update_ratio").items())


def finite_family(run: LoggedRun, tag_of: Callable[[str], str]) -> LayerPoints:
    """The finite points of every ``tag_of(<layer>)`` series of the run, by layer."""
    probe = "layer"
    head = tag_of(probe)[: -len(probe)]
    out: LayerPoints = {}
    for name, points in run.scalars.items():
        if name.startswith(head) and len(name) > len(head):
            finite = [(s, v) for s, v in points if math.isfinite(v)]
            if finite:
                out[name[len(head) :]] = finite
    return out


def worst_point(series: LayerPoints, lowest: bool = False) -> tuple[str, int, float]:
    """The layer, step and value of the largest point (the smallest with ``lowest``)."""
    sign = -1.0 if lowest else 1.0
    layer, (step, value) = max(
        ((name, point) for name, points in series.items() for point in points), key=lambda lp: sign * lp[1][1]
    )
    return layer, step, value


def last_point(series: LayerPoints) -> tuple[str, float]:
    """The worst layer's (largest) value at each layer's last measurement."""
    layer = max(series, key=lambda k: series[k][-1][1])
    return layer, series[layer][-1][1]
