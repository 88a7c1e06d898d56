"""The checklist of ``lightning-diag report``: one row per :class:`~lightning_diag.rules.registry.CheckSpec`.

Each row is judged twice and the two must agree: by the run's own alerts (``diag/alerts.jsonl``) and by
**replaying the library's pure rules** (``lightning_diag.rules``) over the series the run logged, the way
SageMaker Debugger runs its rules offline over stored tensors. A row fails when either raised a warning or a
critical alert, so the checklist cannot say PASS beside a measurement its own rule rejects. Replayed rows:
``grad_norm_band``, ``grad_spread``, ``grad_collapse`` (the first optimizer's global norm),
``attn_entropy_band`` (with the logged ``uniform`` reference; special-token shares are not logged, so
``attn_sink`` is judged by its alerts and measured value), ``loss_swing`` and ``val_decline``.
``val_fluctuation`` compares the two fluctuations the alarm logged.

Adding a row (issues adding callbacks):

1. declare it in :mod:`lightning_diag.rules.registry` with ``register_check(CheckSpec(id, layer, title))``
   (or reuse one of the seed's rows: ``data_label_balance``, ``data_train_test_overlap``,
   ``deploy_quantization_error``, ``deploy_latency_fluctuation``);
2. join your rules to it with ``RuleSpec(..., check=id)``. That alone gives a working row: it fails on a
   warning/critical alert of its rules, passes when its callback logged thresholds and raised none, and shows
   each rule's described threshold and its last alert's value;
3. where the row can show a measured value from the logged series, add one function here decorated with
   ``@measure(id)``: it fills ``check.measured`` / ``measured_value`` (and ``threshold`` /
   ``threshold_value`` if the generic text is not enough) and returns whether the series was measured. A
   ``@replay(id)`` function in :mod:`lightning_diag.report.replay` may also re-run the row's pure rules.

Example:
    >>> check = Check("nonfinite", "Training", "No NaN/Inf in loss or gradients", ("nonfinite_loss",))
    >>> check.status
    'not measured'
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import statistics
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal

from lightning_diag.alerts import ALL_RULES, Alert
from lightning_diag.report.load import RunData
from lightning_diag.report.replay import REPLAYS, _by_step, _per_layer, _setting, replay
from lightning_diag.rules.registry import CHECKS, RULES, CheckSpec
from lightning_diag.tags import attn_head, attn_mean, family_tag, grad_total_tag, loss_tag, prefix

__all__ = ["MEASURES", "REPLAYS", "Check", "RunReport", "Status", "diagnose", "measure", "replay"]

Status = Literal["pass", "fail", "not measured"]
_LAYERS = ("Data", "Model", "Training", "Deployment")


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

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (non-finite numbers as strings)."""
        return _json_safe(dataclasses.asdict(self))

    def add_note(self, text: str) -> None:
        """Append a sentence to :attr:`note`."""
        self.note = f"{self.note} {text}".strip() if self.note else text


@dataclasses.dataclass
class RunReport:
    """The diagnosis of one run: its checklist, alert timeline and plots."""

    run: RunData
    checks: list[Check]
    plots: list[Any] = dataclasses.field(default_factory=list)
    plot_note: str = ""

    @property
    def counts(self) -> dict[str, int]:
        """How many checks pass, fail and are not measured."""
        out = {"pass": 0, "fail": 0, "not measured": 0}
        for c in self.checks:
            out[c.status] += 1
        return out

    @property
    def timeline(self) -> list[Alert]:
        """Every alert of the run, oldest first."""
        return [a for _, a in sorted(enumerate(self.run.alerts), key=lambda ia: (ia[1].global_step, ia[0]))]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return {
            "run": str(self.run.path),
            "summary": self.counts,
            "threshold_source": self.run.threshold_source,
            "callbacks": sorted(self.run.callbacks),
            "thresholds": _json_safe(self.run.thresholds),
            "dashboard_layout": self.run.has_layout,
            "checks": [c.to_dict() for c in self.checks],
            "alerts": [a.to_dict() for a in self.timeline],
            "plots": [str(p) for p in self.plots],
            "problems": list(self.run.problems) + ([self.plot_note] if self.plot_note else []),
        }


def _json_safe(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else str(obj)
    if isinstance(obj, dict):
        return {str(k): _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
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


def _fmt(x: float) -> str:
    return f"{x:.3g}" if math.isfinite(x) else str(x)


def _finite(points: Iterable[tuple[int, float]]) -> list[float]:
    return [v for _, v in points if math.isfinite(v)]


def _serious(alerts: Iterable[Alert], rules: Sequence[str]) -> list[Alert]:
    return [a for a in alerts if a.rule in rules and a.severity != "info"]


def _threshold(run: RunData, key: str) -> float | None:
    value = run.thresholds.get(key)
    return None if value is None else float(value)


def _attached(run: RunData, rules: Sequence[str]) -> bool:
    return any(ALL_RULES.get(r) in run.callbacks for r in rules)


# -- measures ---------------------------------------------------------------------------------------------


def _band_threshold(check: Check, run: RunData, low_rule: str, high_rule: str) -> tuple[float | None, float | None]:
    low, high = _threshold(run, low_rule), _threshold(run, high_rule)
    check.threshold_value = {k: v for k, v in (("low", low), ("high", high)) if v is not None}
    return low, high


@measure("grad_norm_band")
def _measure_grad_band(run: RunData, check: Check) -> bool:
    low, high = _band_threshold(check, run, "grad_vanish", "grad_explode")
    check.threshold = "; ".join(RULES[r].describe(run.thresholds) for r in check.rules)
    layers = _per_layer(run)
    values = [v for series in layers.values() for v in _finite(series)]
    if values:
        lo, hi = min(values), max(values)
        check.measured = f"layer norms {_fmt(lo)} .. {_fmt(hi)} over {len(layers)} layers"
        check.measured_value = {"min": lo, "max": hi}
        outside = sum(1 for v in values if (low is not None and v < low) or (high is not None and v > high))
        if outside:
            check.add_note(
                f"{outside} of {len(values)} layer measurements were outside the band; grad_vanish needs "
                f"{_fmt(_setting(run, 'grad.patience'))} consecutive ones and the layer 100x below the global norm"
            )
    return bool(values)


@measure("grad_spread")
def _measure_grad_spread(run: RunData, check: Check) -> bool:
    ratio = _threshold(run, "grad_layer_spread")
    check.threshold = f"largest / smallest <= {_fmt(ratio)}" if ratio is not None else "not logged"
    check.threshold_value = {"value": ratio} if ratio is not None else {}
    spreads = [
        max(vs) / min(vs)
        for norms in _by_step(_per_layer(run).items()).values()
        if len(vs := [v for v in norms.values() if math.isfinite(v) and v > 0]) > 1
    ]
    if spreads:
        check.measured = f"largest / smallest up to {_fmt(max(spreads))}"
        check.measured_value = {"max": max(spreads)}
    return bool(spreads)


@measure("grad_collapse")
def _measure_grad_collapse(run: RunData, check: Check) -> bool:
    ratio = _threshold(run, "grad_collapse")
    n = int(_setting(run, "grad_collapse.baseline_measurements"))
    check.threshold = f"norm / baseline >= {_fmt(ratio)}" if ratio is not None else "not logged"
    check.threshold_value = {"value": ratio} if ratio is not None else {}
    totals = [v for v in _finite(run.scalars.get(grad_total_tag(), [])) if v >= 0]
    if len(totals) > n:
        baseline = statistics.median(totals[:n])
        lowest = min(totals[n:]) / baseline if baseline > 0 else math.nan
        check.measured = f"lowest norm / baseline {_fmt(lowest)} (baseline {_fmt(baseline)})"
        check.measured_value = {"min": lowest, "baseline": baseline}
        return True
    if totals:
        check.add_note(f"needs more than {n} measurements of the global norm, the run has {len(totals)}")
    return False


@measure("attn_entropy_band")
def _measure_attn_band(run: RunData, check: Check) -> bool:
    low, high = _band_threshold(check, run, "attn_entropy_low", "attn_entropy_high")
    check.threshold = "; ".join(RULES[r].describe(run.thresholds) for r in check.rules)
    heads = [t for t in run.scalars if attn_head(t)] or [t for t in run.scalars if attn_mean(t)]
    values = [v for t in heads for v in _finite(run.scalars[t])]
    if values:
        what = "heads" if attn_head(heads[0]) else "layer means"
        check.measured = f"entropy {_fmt(min(values))} .. {_fmt(max(values))} nats over {len(heads)} {what}"
        check.measured_value = {"min": min(values), "max": max(values)}
        above = sum(1 for v in values if high is not None and v > high)
        if above and high is not None:
            check.add_note(
                f"{above} measurements above {_fmt(high)} nats (attn_entropy_high): an info hint at most, and only "
                "when near uniform after warm-up, since diffuse attention can be a learned solution"
            )
    missing = [rule for rule, v in (("attn_entropy_low", low), ("attn_entropy_high", high)) if v is None]
    if values and missing:
        check.add_note(f"the run logged no {' or '.join(missing)} threshold")
    return bool(values)


@measure("attn_sink")
def _measure_attn_sink(run: RunData, check: Check) -> bool:
    mass = _threshold(run, "attn_sink")
    check.threshold = f"smallest head's special-token mass <= {_fmt(mass)}" if mass is not None else "not logged"
    check.threshold_value = {"value": mass} if mass is not None else {}
    values = [v for t in run.tags(prefix("attn_sink")) for v in _finite(run.scalars[t])]
    if values:
        check.measured = f"special-token mass up to {_fmt(max(values))}"
        check.measured_value = {"max": max(values)}
    return bool(values)


@measure("nonfinite")
def _measure_nonfinite(run: RunData, check: Check) -> bool:
    check.threshold = "no non-finite value"
    check.threshold_value = {"value": 0.0}
    alerts = _serious(run.alerts, check.rules)
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
        rolled = [f"step {a.global_step} ({a.source})" for a in alerts if a.rule == "nonfinite_rollback"]
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
    return _attached(run, check.rules) or bool(run.tags(prefix("loss"))) or bool(run.tags(prefix("grad_norm")))


@measure("loss_swing")
def _measure_loss_swing(run: RunData, check: Check) -> bool:
    threshold = _threshold(run, "loss_swing")
    patience = _threshold(run, "loss_swing.patience")
    check.threshold = (
        f"rise > {_fmt(threshold * 100)}% on {int(patience) if patience else '?'} consecutive points"
        if threshold is not None
        else "not logged"
    )
    check.threshold_value = {"value": threshold} if threshold is not None else {}
    if patience:
        check.threshold_value["patience"] = patience
    swings = _finite(run.scalars.get(loss_tag("swing"), []))
    if swings:
        check.measured = f"relative change of the mean loss {min(swings):+.1%} .. {max(swings):+.1%}"
        check.measured_value = {"max": max(swings), "min": min(swings)}
    elif run.scalars.get(loss_tag("train_epoch")):
        check.add_note("needs at least two epochs (or step windows) of training loss")
    return bool(swings)


@measure("val_decline")
def _measure_val_decline(run: RunData, check: Check) -> bool:
    patience = _threshold(run, "val_decline")
    min_delta = _threshold(run, "val_decline.min_delta") or 0.0
    higher = bool(_threshold(run, "val_decline.higher_is_better"))
    check.threshold = f"fewer than {int(patience)} consecutive worse runs" if patience is not None else "not logged"
    check.threshold_value = {"value": patience} if patience is not None else {}
    values = _finite(run.scalars.get(loss_tag("val"), []))
    longest = streak = 0
    for prev, cur in itertools.pairwise(values):
        worse = (cur < prev - min_delta) if higher else (cur > prev + min_delta)
        streak = streak + 1 if worse else 0
        longest = max(longest, streak)
    if values:
        check.measured = f"longest run of worse validations: {longest} (of {len(values)} validations)"
        check.measured_value = {"max": float(longest)}
    return bool(values)


@measure("val_fluctuation")
def _measure_val_fluctuation(run: RunData, check: Check) -> bool:
    ratio = _threshold(run, "val_fluctuation")
    check.threshold = f"val / train fluctuation <= {_fmt(ratio)}" if ratio is not None else "not logged"
    check.threshold_value = {"value": ratio} if ratio is not None else {}
    train = dict(run.scalars.get(loss_tag("train_fluctuation"), []))
    ratios = [
        v / train[s]
        for s, v in run.scalars.get(loss_tag("val_fluctuation"), [])
        if s in train and train[s] > 0 and math.isfinite(v / train[s])
    ]
    if ratios:
        check.measured = f"val / train fluctuation up to {_fmt(max(ratios))}"
        check.measured_value = {"max": max(ratios)}
    elif run.scalars.get(loss_tag("val")):
        window = _threshold(run, "val_fluctuation.window")
        check.add_note(f"needs {int(window) if window else 'more'} validation runs")
    return bool(ratios)


@measure("deploy_latency_fluctuation")
def _measure_latency(run: RunData, check: Check) -> bool:
    # SystemMonitor's step-time fluctuation (relative MAD of block medians), judged by its rule's patience
    values = _finite(run.scalars.get(family_tag("system", "step_time_fluctuation"), []))
    limit = _threshold(run, "step_time_fluctuation")
    check.threshold = f"step-time fluctuation <= {_fmt(limit)}" if limit is not None else "not logged"
    check.threshold_value = {"value": limit} if limit is not None else {}
    if values:
        check.measured = f"step-time fluctuation up to {_fmt(max(values))} (last {_fmt(values[-1])})"
        check.measured_value = {"max": max(values), "last": values[-1]}
        if limit is not None and max(values) > limit:
            check.add_note("above the threshold on fewer consecutive checks than step_time_fluctuation's patience")
    return bool(values)


def _measure_generic(run: RunData, check: Check) -> bool:
    """A row with rules but no measure function: each rule's described threshold and its last alert's value."""
    numbers = {r: run.thresholds[r] for r in check.rules if r in run.thresholds}
    check.threshold = "; ".join(RULES[r].describe(run.thresholds) if r in RULES else r for r in check.rules)
    if len(numbers) == 1:
        check.threshold_value = {"value": next(iter(numbers.values()))}
    elif numbers:
        check.threshold_value = dict(numbers)
    alerts = _serious(run.alerts, check.rules)
    if alerts:
        last = alerts[-1]
        check.measured = f"{_fmt(last.value) if last.value is not None else '-'} at step {last.global_step}"
    return any(r in run.thresholds for r in check.rules) or _attached(run, check.rules)


# -- judging ----------------------------------------------------------------------------------------------


def _finish(check: Check, run: RunData, measured: bool, replayed: list[Alert]) -> Check:
    """The status from the run's alerts, the replayed rules' alerts and whether the series was measured."""
    logged = _serious(run.alerts, check.rules)
    again = _serious(replayed, check.rules)
    check.alerts, check.replayed = len(logged), len(again)
    first = min([*logged, *again], key=lambda a: a.global_step, default=None)
    if first is not None:
        check.status = "fail"
        check.first_alert_step = first.global_step
        if check.measured is None:
            check.measured = f"{first.rule} at step {first.global_step} ({first.source})"
        if again and not logged:
            a = min(again, key=lambda x: x.global_step)
            check.add_note(
                f"the alert log has no {a.rule} alert, but replaying the rule over the logged series raises one at "
                f"step {a.global_step} ({a.source}): the run used other thresholds, or lost its alert log"
            )
    elif check.status != "fail":
        check.status = "pass" if measured else "not measured"
    hints = sorted({a.rule for a in replayed if a.severity == "info"} - {a.rule for a in run.alerts})
    if hints:
        check.add_note(f"replayed info hints: {', '.join(hints)}")
    if check.status == "not measured":
        check.measured = None
        owners = {ALL_RULES[r] for r in check.rules if r in ALL_RULES}
        missing = sorted(owners - set(run.callbacks))
        if missing and len(missing) == len(owners):
            check.add_note(f"{', '.join(missing)} was not attached to the run")
    return check


def _evaluate(spec: CheckSpec, run: RunData) -> Check:
    check = Check(spec.check_id, spec.layer, spec.describe(run.thresholds), spec.rules)
    fn = MEASURES.get(spec.check_id)
    if fn is None and not check.rules:
        check.threshold = spec.threshold
        check.threshold_value = {"value": spec.threshold_value} if spec.threshold_value is not None else {}
        check.note = "outside what a training callback sees; no lightning_diag callback measures it"
        return check
    measured = (fn or _measure_generic)(run, check)
    replay_fn = REPLAYS.get(spec.check_id)
    replayed = replay_fn(run) if replay_fn is not None and measured else []
    return _finish(check, run, measured, replayed)


def diagnose(run: RunData) -> RunReport:
    """The checklist of one run (seed 000 §7.1, layer by layer, plus the training-process checks).

    Rows come from the registry's :data:`~lightning_diag.rules.registry.CHECKS` (grouped by layer, in
    declaration order); rules without a row are listed under "Other", judged by their alerts and threshold.
    """
    specs = sorted(CHECKS.values(), key=lambda s: _LAYERS.index(s.layer))
    checks = [_evaluate(spec, run) for spec in specs]
    covered = {r for c in checks for r in c.rules}
    logged_rules = {k for k in run.thresholds if "." not in k and k in ALL_RULES}
    for rule in sorted(({a.rule for a in run.alerts} | logged_rules) - covered):
        title = RULES[rule].describe(run.thresholds) if rule in RULES else f"Rule {rule}"
        check = Check(rule, "Other", title[:1].upper() + title[1:], (rule,))
        threshold = _threshold(run, rule)
        check.threshold = _fmt(threshold) if threshold is not None else "not logged"
        check.threshold_value = {"value": threshold} if threshold is not None else {}
        alerts = _serious(run.alerts, (rule,))
        if alerts:
            last = alerts[-1]
            check.measured = f"{_fmt(last.value) if last.value is not None else '-'} at step {last.global_step}"
        checks.append(_finish(check, run, rule in run.thresholds, []))
    return RunReport(run, checks)


# rows registered by their own modules (imported last: they use `measure` and `Check` from here)
from lightning_diag.report import data_checks as _data_checks  # noqa: E402,F401  (registers the Data rows)
from lightning_diag.report import probe_checks as _probe_checks  # noqa: E402,F401  (registers the probes' rows)
