"""``lightning-diag report``: a run's diagnosis from its TensorBoard event files and alert log.

A *run* is a directory holding ``diag/`` tags in event files (read with TensorBoard's own
:class:`~tensorboard.backend.event_processing.event_accumulator.EventAccumulator`), a ``diag/alerts.jsonl`` or
a ``diag/thresholds.json``. Every run under the log directory is reported, one after another, with:

* the layered checklist of seed 000 §7.1 (data, model, training, deployment), each check ``pass``, ``fail``
  or ``not measured`` with the measured value beside its threshold. A check fails when one of its rules raised
  a warning or critical alert; it passes when its series was measured and no such alert was raised;
* the alert timeline;
* optionally PNG plots (:mod:`lightning_diag.plots`, needs matplotlib).

Thresholds come from what the run logged: ``diag/thresholds.json``, else the ``diag/thresholds`` text in the
event file, else the ``threshold`` of the run's alerts, else the library's defaults (marked as such).

Example:
    >>> check = Check("nonfinite", "Training", "No NaN/Inf in loss or gradients", ("nonfinite_loss",))
    >>> check.status
    'not measured'
"""

from __future__ import annotations

import base64
import dataclasses
import html
import itertools
import json
import math
import os
import statistics
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Literal

from lightning_diag.alerts import (
    ALL_RULES,
    ATTN_ENTROPY_HIGH,
    ATTN_ENTROPY_LOW,
    ATTN_SINK,
    GRAD_COLLAPSE,
    GRAD_EXPLODE,
    GRAD_LAYER_SPREAD,
    GRAD_VANISH,
    LOSS_SWING,
    NONFINITE_GRAD,
    NONFINITE_LOSS,
    VAL_DECLINE,
    VAL_FLUCTUATION,
    Alert,
    read_alerts,
)
from lightning_diag.tags import attn_head, attn_mean, grad_layer

__all__ = [
    "FORMATS",
    "Check",
    "NoDiagnosticsError",
    "RunData",
    "RunReport",
    "build_report",
    "diagnose",
    "find_runs",
    "load_run",
    "render",
]

Status = Literal["pass", "fail", "not measured"]
Format = Literal["md", "json", "html"]
FORMATS: tuple[str, ...] = ("md", "json", "html")

ALERTS_FILE = "alerts.jsonl"
THRESHOLDS_FILE = "thresholds.json"
_EVENT_PREFIX = "events.out.tfevents"
_LAYOUT_TAG = "custom_scalars__config__"
# Which callback measures which tags, for runs that logged no thresholds.json.
_TAG_OWNERS = {
    "diag/grad_norm/": "GradientFlowMonitor",
    "diag/loss/": "AnomalyAlarm",
    "diag/lr/": "AnomalyAlarm",
    "diag/attn_entropy/": "AttentionEntropyMonitor",
}


class NoDiagnosticsError(ValueError):
    """Raised when a log directory holds no lightning_diag diagnostics."""


Series = list[tuple[int, float]]


@dataclasses.dataclass
class RunData:
    """What one run logged.

    Attributes:
        path: The run directory (``trainer.log_dir``).
        scalars: ``diag/`` scalar tag -> ``(step, value)`` points in step order.
        alerts: The alerts of ``diag/alerts.jsonl``, in file order.
        thresholds: Rule id (or ``"<rule>.<setting>"``) -> value, as the run logged them.
        callbacks: The lightning_diag callbacks the run had, with their thresholds (empty if unknown).
        threshold_source: Where :attr:`thresholds` came from.
        has_layout: Whether the event files hold a custom-scalars dashboard layout.
        problems: Files that could not be read, with the reason.
    """

    path: Path
    scalars: dict[str, Series] = dataclasses.field(default_factory=dict)
    alerts: list[Alert] = dataclasses.field(default_factory=list)
    thresholds: dict[str, float] = dataclasses.field(default_factory=dict)
    callbacks: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)
    threshold_source: str = "none"
    has_layout: bool = False
    problems: list[str] = dataclasses.field(default_factory=list)

    @property
    def has_diagnostics(self) -> bool:
        """Whether anything lightning_diag writes is in this run."""
        return bool(self.scalars or self.alerts or self.callbacks)

    def tags(self, prefix: str) -> list[str]:
        """Scalar tags starting with ``prefix``, sorted."""
        return sorted(t for t in self.scalars if t.startswith(prefix))


@dataclasses.dataclass
class Check:
    """One line of the checklist.

    Attributes:
        id: Stable identifier (``grad_norm_band``, ``nonfinite``, ...; a rule id for rules without a check).
        layer: ``Data``, ``Model``, ``Training``, ``Deployment`` or ``Other``.
        title: What is checked, with the seed's criterion.
        rules: The rule ids that decide it.
        status: ``pass``, ``fail`` or ``not measured``.
        measured: The measured value in words (``None`` when not measured).
        measured_value: The same as numbers (``{"min": ..., "max": ...}`` or ``{"value": ...}``).
        threshold: The threshold in words.
        threshold_value: The same as numbers.
        alerts: Warning and critical alerts of its rules.
        first_alert_step: Global step of the first of them.
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
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (non-finite numbers as strings)."""
        return _json_safe(dataclasses.asdict(self))


@dataclasses.dataclass
class RunReport:
    """The diagnosis of one run: its checklist, alert timeline and plots."""

    run: RunData
    checks: list[Check]
    plots: list[Path] = dataclasses.field(default_factory=list)
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


# -- finding and loading runs ---------------------------------------------------------------------------


def find_runs(logdir: str | os.PathLike[str]) -> list[Path]:
    """Run directories under ``logdir`` (itself included), sorted by path.

    A directory is a run when it holds event files, or a ``diag/`` folder with ``alerts.jsonl`` or
    ``thresholds.json``. Event files inside a ``diag/`` folder (the library's own writer, used when the trainer
    has no TensorBoard logger) belong to the folder's parent.
    """
    root = Path(logdir)
    runs: set[Path] = set()
    for dirpath, _dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        has_events = any(f.startswith(_EVENT_PREFIX) for f in filenames)
        has_diag_files = here.name == "diag" and (ALERTS_FILE in filenames or THRESHOLDS_FILE in filenames)
        if has_diag_files or (has_events and here.name == "diag" and here != root):
            runs.add(here.parent)
        elif has_events:
            runs.add(here)
    return sorted(runs)


def _read_events(directory: Path, run: RunData) -> list[tuple[str, str]]:
    """Add the ``diag/`` scalars of the event files in ``directory`` to ``run``; return its text entries."""
    from tensorboard.backend.event_processing import event_accumulator as ea

    guidance = {ea.SCALARS: 0, ea.TENSORS: 0, ea.HISTOGRAMS: 1, ea.IMAGES: 1, ea.AUDIO: 1, ea.COMPRESSED_HISTOGRAMS: 1}
    acc = ea.EventAccumulator(str(directory), size_guidance=guidance)
    acc.Reload()
    tags = acc.Tags()
    for name in tags.get(ea.SCALARS, []):
        if name.startswith("diag/"):
            points = [(int(e.step), float(e.value)) for e in acc.Scalars(name)]
            run.scalars[name] = sorted(run.scalars.get(name, []) + points, key=lambda p: p[0])
    texts = []
    for name in tags.get(ea.TENSORS, []):
        if name == _LAYOUT_TAG:
            run.has_layout = True
        elif name.startswith("diag/thresholds"):
            for event in acc.Tensors(name):
                for raw in event.tensor_proto.string_val:
                    texts.append((name, raw.decode("utf-8", "replace")))
    return texts


def _thresholds_from_text(text: str) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3:
            continue
        try:
            value = float(cells[2])
        except ValueError:
            continue
        out.setdefault(cells[0], {})[cells[1]] = value
    return out


def _library_defaults() -> dict[str, float]:
    from lightning_diag.rules import anomaly, grad

    return {
        GRAD_VANISH: grad.DEFAULT_VANISH_THRESHOLD,
        GRAD_EXPLODE: grad.DEFAULT_EXPLODE_THRESHOLD,
        GRAD_LAYER_SPREAD: grad.DEFAULT_SPREAD_RATIO,
        GRAD_COLLAPSE: grad.DEFAULT_COLLAPSE_RATIO,
        f"{GRAD_COLLAPSE}.baseline_measurements": float(grad.DEFAULT_BASELINE_MEASUREMENTS),
        "grad.patience": float(grad.DEFAULT_GRAD_PATIENCE),
        LOSS_SWING: anomaly.DEFAULT_SWING_THRESHOLD,
        f"{LOSS_SWING}.patience": float(anomaly.DEFAULT_SWING_PATIENCE),
        VAL_DECLINE: float(anomaly.DEFAULT_VAL_DECLINE_PATIENCE),
        f"{VAL_DECLINE}.min_delta": anomaly.DEFAULT_VAL_DECLINE_MIN_DELTA,
        VAL_FLUCTUATION: anomaly.DEFAULT_VAL_FLUCTUATION_RATIO,
    }


def load_run(path: str | os.PathLike[str]) -> RunData:
    """Read one run: the event files in ``path`` and ``path/diag``, the alert log and the thresholds."""
    run = RunData(Path(path))
    diag = run.path / "diag"
    texts: list[tuple[str, str]] = []
    for directory in (run.path, diag):
        if directory.is_dir() and any(f.name.startswith(_EVENT_PREFIX) for f in directory.iterdir()):
            try:
                texts += _read_events(directory, run)
            except Exception as err:  # a damaged file is reported, never a traceback
                run.problems.append(f"could not read the event files in {directory}: {err}")
    if (diag / ALERTS_FILE).is_file():
        run.alerts = read_alerts(diag / ALERTS_FILE)
    if (diag / THRESHOLDS_FILE).is_file():
        try:
            logged = json.loads((diag / THRESHOLDS_FILE).read_text(encoding="utf-8"))
            run.callbacks = {str(k): {str(r): float(v) for r, v in d.items()} for k, d in logged["callbacks"].items()}
            run.threshold_source = f"diag/{THRESHOLDS_FILE}"
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            run.problems.append(f"could not read diag/{THRESHOLDS_FILE}: {err}")
    if not run.callbacks and texts:
        for _name, text in texts:
            run.callbacks.update(_thresholds_from_text(text))
        if run.callbacks:
            run.threshold_source = "diag/thresholds text in the event file"
    for values in run.callbacks.values():
        run.thresholds.update(values)
    for alert in run.alerts:  # a callback that logged no thresholds still put them in its alerts
        if alert.threshold is not None and run.callbacks and alert.rule not in run.thresholds:
            run.thresholds[alert.rule] = alert.threshold
    if not run.callbacks:
        owners = {owner for prefix, owner in _TAG_OWNERS.items() if run.tags(prefix)}
        owners |= {ALL_RULES[a.rule] for a in run.alerts if a.rule in ALL_RULES}
        run.callbacks = {owner: {} for owner in sorted(owners)}
        from_alerts = {a.rule: a.threshold for a in run.alerts if a.threshold is not None}
        run.thresholds = {**_library_defaults(), **from_alerts}
        run.threshold_source = "not logged: alert thresholds and the library's current defaults"
    return run


# -- the checklist ---------------------------------------------------------------------------------------


def _fmt(x: float) -> str:
    return f"{x:.3g}" if math.isfinite(x) else str(x)


def _band(low: float | None, high: float | None, unit: str = "") -> str:
    if low is None and high is None:
        return "not logged"
    low_text = _fmt(low) if low is not None else "not logged"
    high_text = _fmt(high) if high is not None else "not logged"
    return f"{low_text} .. {high_text}{unit}"


def _finite(points: Iterable[tuple[int, float]]) -> list[float]:
    return [v for _, v in points if math.isfinite(v)]


def _serious(run: RunData, rules: Sequence[str]) -> list[Alert]:
    return [a for a in run.alerts if a.rule in rules and a.severity != "info"]


def _attached(run: RunData, rules: Sequence[str]) -> bool:
    return any(ALL_RULES.get(r) in run.callbacks for r in rules)


def _finish(check: Check, run: RunData, measured: bool) -> Check:
    """Set the status from the alerts of the check's rules and whether its series was measured."""
    alerts = _serious(run, check.rules)
    check.alerts = len(alerts)
    if alerts:
        check.status = "fail"
        check.first_alert_step = min(a.global_step for a in alerts)
        first = min(alerts, key=lambda a: a.global_step)
        if check.measured is None:
            check.measured = f"{first.rule} at step {first.global_step} ({first.source})"
    elif measured:
        check.status = "pass"
    else:
        check.status = "not measured"
        check.measured = None
        owners = sorted({ALL_RULES[r] for r in check.rules if r in ALL_RULES} - set(run.callbacks))
        if owners and len(owners) == len({ALL_RULES[r] for r in check.rules if r in ALL_RULES}):
            check.note = f"{', '.join(owners)} was not attached to the run"
    return check


def _threshold(run: RunData, key: str) -> float | None:
    value = run.thresholds.get(key)
    return None if value is None else float(value)


def _per_layer(run: RunData) -> dict[str, Series]:
    return {t: run.scalars[t] for t in run.tags("diag/grad_norm/") if grad_layer(t) is not None}


def _check_grad_band(run: RunData) -> Check:
    low, high = _threshold(run, GRAD_VANISH), _threshold(run, GRAD_EXPLODE)
    check = Check(
        "grad_norm_band", "Model", "Gradient norm of every layer within 1e-3 .. 1e1", (GRAD_VANISH, GRAD_EXPLODE)
    )
    check.threshold = _band(low, high)
    check.threshold_value = {k: v for k, v in (("low", low), ("high", high)) if v is not None}
    layers = _per_layer(run)
    values = [v for series in layers.values() for v in _finite(series)]
    if values:
        lo, hi = min(values), max(values)
        check.measured = f"layer norms {_fmt(lo)} .. {_fmt(hi)} over {len(layers)} layers"
        check.measured_value = {"min": lo, "max": hi}
        outside = sum(1 for v in values if (low is not None and v < low) or (high is not None and v > high))
        if outside and not _serious(run, check.rules):
            check.note = (
                f"{outside} of {len(values)} layer measurements were outside the band, but never long enough for "
                "the rules (patience; grad_vanish also needs the layer 100x below the global norm)"
            )
    return _finish(check, run, bool(values))


def _check_grad_spread(run: RunData) -> Check:
    ratio = _threshold(run, GRAD_LAYER_SPREAD)
    check = Check("grad_spread", "Model", "Layer gradient norms within two orders of magnitude", (GRAD_LAYER_SPREAD,))
    check.threshold = f"largest / smallest <= {_fmt(ratio)}" if ratio is not None else "not logged"
    check.threshold_value = {"value": ratio} if ratio is not None else {}
    by_step: dict[int, list[float]] = {}
    for series in _per_layer(run).values():
        for step, v in series:
            if math.isfinite(v) and v > 0:
                by_step.setdefault(step, []).append(v)
    spreads = [max(vs) / min(vs) for vs in by_step.values() if len(vs) > 1]
    if spreads:
        worst = max(spreads)
        check.measured = f"largest / smallest up to {_fmt(worst)}"
        check.measured_value = {"max": worst}
    return _finish(check, run, bool(spreads))


def _check_grad_collapse(run: RunData) -> Check:
    ratio = _threshold(run, GRAD_COLLAPSE)
    n = int(_threshold(run, f"{GRAD_COLLAPSE}.baseline_measurements") or 5)
    check = Check("grad_collapse", "Model", "Global gradient norm above 1/100 of its early baseline", (GRAD_COLLAPSE,))
    check.threshold = f"norm / baseline >= {_fmt(ratio)}" if ratio is not None else "not logged"
    check.threshold_value = {"value": ratio} if ratio is not None else {}
    totals = [v for v in _finite(run.scalars.get("diag/grad_norm/total", [])) if v >= 0]
    measured = len(totals) > n
    if measured:
        baseline = statistics.median(totals[:n])
        lowest = min(totals[n:]) / baseline if baseline > 0 else math.nan
        check.measured = f"lowest norm / baseline {_fmt(lowest)} (baseline {_fmt(baseline)})"
        check.measured_value = {"min": lowest, "baseline": baseline}
    elif totals:
        check.note = f"needs more than {n} measurements of the global norm, the run has {len(totals)}"
    return _finish(check, run, measured)


def _check_attn_band(run: RunData) -> Check:
    low, high = _threshold(run, ATTN_ENTROPY_LOW), _threshold(run, ATTN_ENTROPY_HIGH)
    check = Check(
        "attn_entropy_band",
        "Model",
        "Attention entropy of every head within 0.5 .. 2.5 nats",
        (ATTN_ENTROPY_LOW, ATTN_ENTROPY_HIGH),
    )
    check.threshold = _band(low, high, " nats")
    check.threshold_value = {k: v for k, v in (("low", low), ("high", high)) if v is not None}
    heads = [t for t in run.scalars if attn_head(t)] or [t for t in run.scalars if attn_mean(t)]
    values = [v for t in heads for v in _finite(run.scalars[t])]
    if values:
        what = "heads" if attn_head(heads[0]) else "layer means"
        check.measured = f"entropy {_fmt(min(values))} .. {_fmt(max(values))} nats over {len(heads)} {what}"
        check.measured_value = {"min": min(values), "max": max(values)}
    missing = [rule for rule, v in ((ATTN_ENTROPY_LOW, low), (ATTN_ENTROPY_HIGH, high)) if v is None]
    if values and missing:
        check.note = f"the run logged no {' or '.join(missing)} threshold"
    return _finish(check, run, bool(values))


def _check_attn_sink(run: RunData) -> Check:
    mass = _threshold(run, ATTN_SINK)
    check = Check("attn_sink", "Model", "No layer whose every head attends mostly to [CLS]/[SEP]", (ATTN_SINK,))
    check.threshold = f"smallest head's special-token mass <= {_fmt(mass)}" if mass is not None else "not logged"
    check.threshold_value = {"value": mass} if mass is not None else {}
    values = [v for t in run.tags("diag/attn_sink/") for v in _finite(run.scalars[t])]
    if values:
        check.measured = f"special-token mass up to {_fmt(max(values))}"
        check.measured_value = {"max": max(values)}
    return _finish(check, run, bool(values))


def _check_nonfinite(run: RunData) -> Check:
    rules = (NONFINITE_LOSS, NONFINITE_GRAD)
    check = Check("nonfinite", "Training", "No NaN/Inf in the loss or the gradients", rules)
    check.threshold = "no non-finite value"
    check.threshold_value = {"value": 0.0}
    alerts = _serious(run, rules)
    bad_points = [
        (t, step)
        for t in (*run.tags("diag/loss/"), *run.tags("diag/grad_norm/"))
        for step, v in run.scalars[t]
        if not math.isfinite(v)
    ]
    if alerts:
        first = min(alerts, key=lambda a: a.global_step)
        check.measured = f"{len(alerts)} non-finite alert(s); first: {first.rule} at step {first.global_step}"
        check.measured_value = {"count": float(len(alerts)), "first_step": float(first.global_step)}
    elif bad_points:
        tag, step = min(bad_points, key=lambda p: p[1])
        check.measured = f"{len(bad_points)} non-finite logged values; first: {tag} at step {step}"
        check.measured_value = {"count": float(len(bad_points)), "first_step": float(step)}
    else:
        check.measured = "none"
        check.measured_value = {"count": 0.0}
    measured = _attached(run, rules) or bool(run.tags("diag/loss/")) or bool(run.tags("diag/grad_norm/"))
    _finish(check, run, measured)
    if bad_points and not alerts:
        check.status = "fail"
        check.note = "non-finite values were logged but no AnomalyAlarm alert was raised (is AnomalyAlarm attached?)"
    return check


def _check_loss_swing(run: RunData) -> Check:
    threshold = _threshold(run, LOSS_SWING)
    patience = _threshold(run, f"{LOSS_SWING}.patience")
    title = "Training loss does not swing by >10% on 3 consecutive epochs"
    check = Check("loss_swing", "Training", title, (LOSS_SWING,))
    check.threshold = (
        f"rise > {_fmt(threshold * 100)}% on {int(patience) if patience else '?'} consecutive points"
        if threshold is not None
        else "not logged"
    )
    check.threshold_value = {"value": threshold} if threshold is not None else {}
    if patience:
        check.threshold_value["patience"] = patience
    swings = _finite(run.scalars.get("diag/loss/swing", []))
    if swings:
        check.measured = f"relative change of the mean loss {min(swings):+.1%} .. {max(swings):+.1%}"
        check.measured_value = {"max": max(swings), "min": min(swings)}
    elif run.scalars.get("diag/loss/train_epoch"):
        check.note = "needs at least two epochs (or step windows) of training loss"
    return _finish(check, run, bool(swings))


def _check_val_decline(run: RunData) -> Check:
    patience = _threshold(run, VAL_DECLINE)
    min_delta = _threshold(run, f"{VAL_DECLINE}.min_delta") or 0.0
    higher = bool(_threshold(run, f"{VAL_DECLINE}.higher_is_better"))
    check = Check("val_decline", "Training", "Validation metric does not worsen on 5 consecutive runs", (VAL_DECLINE,))
    check.threshold = f"fewer than {int(patience)} consecutive worse runs" if patience is not None else "not logged"
    check.threshold_value = {"value": patience} if patience is not None else {}
    values = _finite(run.scalars.get("diag/loss/val", []))
    longest = streak = 0
    for prev, cur in itertools.pairwise(values):
        worse = (cur < prev - min_delta) if higher else (cur > prev + min_delta)
        streak = streak + 1 if worse else 0
        longest = max(longest, streak)
    if values:
        check.measured = f"longest run of worse validations: {longest} (of {len(values)} validations)"
        check.measured_value = {"max": float(longest)}
    return _finish(check, run, bool(values))


def _check_val_fluctuation(run: RunData) -> Check:
    ratio = _threshold(run, VAL_FLUCTUATION)
    check = Check(
        "val_fluctuation", "Training", "Validation fluctuation at most 2x the training fluctuation", (VAL_FLUCTUATION,)
    )
    check.threshold = f"val / train fluctuation <= {_fmt(ratio)}" if ratio is not None else "not logged"
    check.threshold_value = {"value": ratio} if ratio is not None else {}
    train = dict(run.scalars.get("diag/loss/train_fluctuation", []))
    ratios = [
        v / train[s]
        for s, v in run.scalars.get("diag/loss/val_fluctuation", [])
        if s in train and train[s] > 0 and math.isfinite(v / train[s])
    ]
    if ratios:
        check.measured = f"val / train fluctuation up to {_fmt(max(ratios))}"
        check.measured_value = {"max": max(ratios)}
    elif run.scalars.get("diag/loss/val"):
        window = _threshold(run, f"{VAL_FLUCTUATION}.window")
        check.note = f"needs {int(window) if window else 'more'} validation runs"
    return _finish(check, run, bool(ratios))


def _not_measured(check_id: str, layer: str, title: str, threshold: str, value: float) -> Check:
    return Check(
        check_id,
        layer,
        title,
        (),
        threshold=threshold,
        threshold_value={"value": value},
        note="outside what a training callback sees; no lightning_diag callback measures it",
    )


def diagnose(run: RunData) -> RunReport:
    """The checklist of one run (seed 000 §7.1, layer by layer, plus the training-process checks)."""
    checks = [
        _not_measured("data_label_balance", "Data", "Label distribution standard deviation < 0.1", "< 0.1", 0.1),
        _not_measured("data_train_test_overlap", "Data", "Train/test Jaccard similarity < 0.15", "< 0.15", 0.15),
        _check_grad_band(run),
        _check_grad_spread(run),
        _check_grad_collapse(run),
        _check_attn_band(run),
        _check_attn_sink(run),
        _check_nonfinite(run),
        _check_loss_swing(run),
        _check_val_decline(run),
        _check_val_fluctuation(run),
        _not_measured("deploy_quantization_error", "Deployment", "Quantization error < 5%", "< 5%", 0.05),
        _not_measured("deploy_latency_fluctuation", "Deployment", "Latency fluctuation < 15%", "< 15%", 0.15),
    ]
    covered = {r for c in checks for r in c.rules}
    # Rules without a check of their own (new callbacks): judged by their alerts and logged threshold.
    logged_rules = {k for k in run.thresholds if "." not in k and k in ALL_RULES}
    for rule in sorted(({a.rule for a in run.alerts} | logged_rules) - covered):
        threshold = _threshold(run, rule)
        check = Check(rule, "Other", f"Rule {rule}", (rule,))
        check.threshold = _fmt(threshold) if threshold is not None else "not logged"
        check.threshold_value = {"value": threshold} if threshold is not None else {}
        alerts = _serious(run, (rule,))
        if alerts:
            last = alerts[-1]
            check.measured = f"{_fmt(last.value) if last.value is not None else '-'} at step {last.global_step}"
        _finish(check, run, rule in run.thresholds)
        checks.append(check)
    return RunReport(run, checks)


# -- rendering --------------------------------------------------------------------------------------------


def _json_safe(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else str(obj)
    if isinstance(obj, dict):
        return {str(k): _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj


_MARK = {"pass": "PASS", "fail": "FAIL", "not measured": "not measured"}


def _md_cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _render_md(reports: Sequence[RunReport], plot_base: Path | None) -> str:
    out = ["# lightning-diag report", ""]
    for rep in reports:
        run = rep.run
        c = rep.counts
        out += [
            f"## Run `{run.path}`",
            "",
            f"{c['fail']} fail, {c['pass']} pass, {c['not measured']} not measured. "
            f"Callbacks: {', '.join(sorted(run.callbacks)) or 'unknown'}. Thresholds: {run.threshold_source}. "
            f"Dashboard layout: {'yes' if run.has_layout else 'no'}.",
            "",
            "### Checklist",
            "",
            "| layer | check | status | measured | threshold | alerts | note |",
            "|---|---|---|---|---|---|---|",
        ]
        for ch in rep.checks:
            alerts = f"{ch.alerts} (first at step {ch.first_alert_step})" if ch.alerts else "0"
            out.append(
                f"| {ch.layer} | {_md_cell(ch.title)} | **{_MARK[ch.status]}** | {_md_cell(ch.measured or '-')} "
                f"| {_md_cell(ch.threshold)} | {alerts} | {_md_cell(ch.note)} |"
            )
        out += ["", "### Alert timeline", ""]
        timeline = rep.timeline
        if not timeline:
            out.append("No alerts.")
        else:
            out += [
                "| step | epoch | severity | rule | source | value | threshold | message |",
                "|---|---|---|---|---|---|---|---|",
            ]
            for a in timeline:
                value = "" if a.value is None else _fmt(a.value)
                threshold = "" if a.threshold is None else _fmt(a.threshold)
                out.append(
                    f"| {a.global_step} | {a.epoch} | {a.severity.value} | {a.rule} | {_md_cell(a.source)} "
                    f"| {value} | {threshold} | {_md_cell(a.message)} |"
                )
        if rep.plots:
            out += ["", "### Plots", ""]
            for p in rep.plots:
                target = os.path.relpath(p, plot_base) if plot_base is not None else str(p)
                out.append(f"![{p.stem}]({target})")
        for problem in [*run.problems, *([rep.plot_note] if rep.plot_note else [])]:
            out += ["", f"> {problem}"]
        out.append("")
    return "\n".join(out)


_CSS = """body{font-family:sans-serif;margin:2em;max-width:1200px}table{border-collapse:collapse;margin:1em 0}
td,th{border:1px solid #ccc;padding:4px 8px;text-align:left;vertical-align:top;font-size:14px}
.pass{background:#e6f4ea}.fail{background:#fce8e6;font-weight:bold}.not-measured{color:#777}
img{max-width:100%;border:1px solid #ddd;margin:0.5em 0}"""


def _img_src(path: Path, base: Path | None) -> str:
    if base is not None:
        return html.escape(os.path.relpath(path, base))
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    return f"data:image/png;base64,{data}"


def _render_html(reports: Sequence[RunReport], plot_base: Path | None) -> str:
    e = html.escape
    out = [
        "<!doctype html><html><head><meta charset='utf-8'><title>lightning-diag report</title>",
        f"<style>{_CSS}</style></head><body><h1>lightning-diag report</h1>",
    ]
    for rep in reports:
        run, c = rep.run, rep.counts
        out.append(f"<h2>Run <code>{e(str(run.path))}</code></h2>")
        out.append(
            f"<p>{c['fail']} fail, {c['pass']} pass, {c['not measured']} not measured. Callbacks: "
            f"{e(', '.join(sorted(run.callbacks)) or 'unknown')}. Thresholds: {e(run.threshold_source)}.</p>"
        )
        out.append("<h3>Checklist</h3><table><tr><th>layer</th><th>check</th><th>status</th><th>measured</th>")
        out.append("<th>threshold</th><th>alerts</th><th>note</th></tr>")
        for ch in rep.checks:
            cls = ch.status.replace(" ", "-")
            alerts = f"{ch.alerts} (first at step {ch.first_alert_step})" if ch.alerts else "0"
            out.append(
                f"<tr class='{cls}'><td>{e(ch.layer)}</td><td>{e(ch.title)}</td><td>{e(_MARK[ch.status])}</td>"
                f"<td>{e(ch.measured or '-')}</td><td>{e(ch.threshold)}</td><td>{alerts}</td><td>{e(ch.note)}</td></tr>"
            )
        out.append("</table><h3>Alert timeline</h3>")
        if not rep.timeline:
            out.append("<p>No alerts.</p>")
        else:
            out.append("<table><tr><th>step</th><th>epoch</th><th>severity</th><th>rule</th><th>source</th>")
            out.append("<th>value</th><th>threshold</th><th>message</th></tr>")
            for a in rep.timeline:
                value = "" if a.value is None else _fmt(a.value)
                threshold = "" if a.threshold is None else _fmt(a.threshold)
                out.append(
                    f"<tr><td>{a.global_step}</td><td>{a.epoch}</td><td>{e(a.severity.value)}</td><td>{e(a.rule)}</td>"
                    f"<td>{e(a.source)}</td><td>{value}</td><td>{threshold}</td><td>{e(a.message)}</td></tr>"
                )
            out.append("</table>")
        if rep.plots:
            out.append("<h3>Plots</h3>")
            out += [f"<img alt='{e(p.stem)}' src='{_img_src(p, plot_base)}'>" for p in rep.plots]
        for problem in [*run.problems, *([rep.plot_note] if rep.plot_note else [])]:
            out.append(f"<p><em>{e(problem)}</em></p>")
    out.append("</body></html>")
    return "\n".join(out)


def render(reports: Sequence[RunReport], fmt: Format, plot_base: Path | None = None) -> str:
    """The reports as markdown, JSON or HTML.

    Args:
        reports: One report per run.
        fmt: ``"md"``, ``"json"`` or ``"html"``.
        plot_base: Directory the report file is written to; plot links are made relative to it. ``None``
            embeds the plots in HTML (data URIs) and links them by absolute path in markdown.
    """
    if fmt == "json":
        return json.dumps({"runs": [r.to_dict() for r in reports]}, indent=2, allow_nan=False)
    if fmt == "html":
        return _render_html(reports, plot_base)
    return _render_md(reports, plot_base)


def _slug(run: Path, root: Path) -> str:
    try:
        rel = run.resolve().relative_to(root.resolve())
    except ValueError:
        rel = Path(run.name)
    return "__".join(rel.parts) or "run"


def build_report(logdir: str | os.PathLike[str], plot_dir: str | os.PathLike[str] | None = None) -> list[RunReport]:
    """Load and diagnose every run under ``logdir``; with ``plot_dir``, draw each run's PNG plots there.

    Raises:
        FileNotFoundError: If ``logdir`` is not a directory.
        NoDiagnosticsError: If no run under it holds lightning_diag diagnostics.
    """
    root = Path(logdir)
    if not root.is_dir():
        raise FileNotFoundError(f"{logdir} is not a directory")
    runs = [load_run(p) for p in find_runs(root)]
    with_diag = [r for r in runs if r.has_diagnostics]
    if not with_diag:
        raise NoDiagnosticsError(
            f"no lightning_diag diagnostics under {logdir}: no diag/ tags in event files and no "
            "diag/alerts.jsonl or diag/thresholds.json. Attach GradientFlowMonitor or AnomalyAlarm to the Trainer "
            "and point the report at its log directory."
        )
    reports = [diagnose(r) for r in with_diag]
    if plot_dir is not None:
        try:
            from lightning_diag import plots
        except ImportError:  # pragma: no cover - depends on the environment
            for rep in reports:
                rep.plot_note = "plots skipped: matplotlib is not installed (pip install 'lightning-diag[plots]')"
            return reports
        for rep in reports:
            rep.plots = plots.draw_run(rep.run, Path(plot_dir) / _slug(rep.run.path, root))
    return reports
