"""Diagnosing a plain Lightning run: one trained without lightning_diag callbacks, from its own logged losses.

Such a run has only what the user logged (TensorBoard event files or a ``CSVLogger``'s ``metrics.csv``): the
training loss (per step, or its epoch mean), the validation loss, ``LearningRateMonitor``'s learning rates and the
epoch. :func:`map_plain_run` finds them (:func:`~lightning_diag.report.tag_map.auto_map`, or the user's
``--map ROLE=TAG``; the series and the points judged: :mod:`lightning_diag.report.plain_series`) and
:func:`diagnose_plain` replays the library's rules that need only those series, built with ``Rule.from_settings``
over the library's default thresholds as the rows' replays do (:mod:`lightning_diag.rules.rows`):

* ``nonfinite`` (``nonfinite_loss``): a NaN/Inf logged training or validation loss (the non-finite policy's latch:
  one alert per episode);
* ``loss_swing`` and ``loss_stagnant``: over the training loss's epoch means when logged (``train_loss_epoch``,
  what AnomalyAlarm feeds them), else over means of windows of logged steps: for ``loss_swing`` windows long
  enough that one logged step's noise (a single batch's loss) cannot make a swing (:func:`step_noise`), for
  ``loss_stagnant`` (whose trend test weighs the noise itself) of :data:`WINDOW_POINTS` steps;
  ``loss_stagnant``'s initial loss is the mean of the losses logged in the first ``loss_stagnant.baseline_steps``
  steps (not measured when none were);
* ``val_decline`` and ``val_fluctuation``: over the validation loss, with the mean logged training loss since the
  previous validation;
* ``loss_outlier``: over the logged per-step training losses.

The replay is a preset (:data:`PRESET`, the detector classes it builds): what it measures from the log (a loss
point, a validation value, the logged step losses) is fed to every detector it feeds (:func:`feed`, the
measurement names of :mod:`lightning_diag.rules.measures`), as AnomalyAlarm feeds its own. Their alerts are the
run's findings (its alert timeline). Every other row is ``not measured``, naming the callback that measures it.
Imports neither torch nor Lightning.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import math
import statistics
from collections.abc import Iterable, Mapping

from lightning_diag.core.alerts import Alert
from lightning_diag.core.registry import CHECKS, RULES, default_thresholds
from lightning_diag.core.tags import loss_tag
from lightning_diag.report.checks import RunReport, finish_check
from lightning_diag.report.load import RunData, Series
from lightning_diag.report.plain_series import (
    PLAIN_SOURCE,
    WINDOW_POINTS,
    PlainSeries,
    loss_points,
    map_plain_run,
    spreads,
    step_noise,
    swing_window_points,
)
from lightning_diag.rules.base import Rule, StepContext
from lightning_diag.rules.catalog import (
    ALL_RULES,
    LOSS_OUTLIER,
    LOSS_STAGNANT,
    LOSS_SWING,
    NONFINITE_GRAD,
    NONFINITE_LOSS,
    VAL_DECLINE,
    VAL_FLUCTUATION,
)
from lightning_diag.rules.loss_outlier import LossOutlierRule
from lightning_diag.rules.loss_stagnant import STAGNANT_BASELINE_STEPS_KEY, LossStagnantRule
from lightning_diag.rules.loss_swing import LossSwingRule
from lightning_diag.rules.measures import LossWindow, Measures, StepLosses, Validation, fed_by
from lightning_diag.rules.nonfinite import NonFinitePolicy
from lightning_diag.rules.rows import CHECKLIST_LAYERS, Check, fmt
from lightning_diag.rules.val_decline import ValDeclineRule
from lightning_diag.rules.val_fluctuation import ValFluctuationRule
from lightning_diag.rules.verdicts import StepFindings

__all__ = ["PLAIN_SOURCE", "PRESET", "WINDOW_POINTS", "diagnose_plain", "feed", "map_plain_run", "step_noise"]

#: The detectors a plain run's logged losses feed (the replay's preset), in the order AnomalyAlarm's preset judges
#: them; each raises the rule id of its row.
PRESET: tuple[type[Rule], ...] = (
    ValDeclineRule, ValFluctuationRule, LossSwingRule, LossStagnantRule, LossOutlierRule
)

_NONFINITE = "nonfinite"
#: The checklist rows a plain run measures, and the "Other" rows it adds.
_MEASURED_ROWS = (_NONFINITE, LOSS_SWING, VAL_DECLINE, VAL_FLUCTUATION)
_OTHER_RULES = (LOSS_STAGNANT, LOSS_OUTLIER)


def feed(detectors: Iterable[Rule], ctx: StepContext, m: Measures) -> dict[str, list[Alert]]:
    """Judge ``m`` with every one of ``detectors`` it feeds (all it needs, or for one that needs none, one it
    reads: :func:`~lightning_diag.rules.measures.fed_by`), in their order: ``{rule id: its alerts}``.

    Example:
        >>> from lightning_diag.rules.measures import LossWindow
        >>> swing, decline = LossSwingRule(), ValDeclineRule()
        >>> list(feed((decline, swing), StepContext(0, 10), Measures(loss_window=LossWindow(1.0))))
        ['loss_swing']
    """
    present = m.present()
    return {
        detector.rule_id: detector.judge(ctx, m)
        for detector in detectors
        if fed_by(detector.needs, detector.optional, present)
    }


@dataclasses.dataclass
class _Found:
    """What the replay found: alerts per check row, and the measured text of each row."""

    alerts: dict[str, list[Alert]] = dataclasses.field(default_factory=dict)
    measured: dict[str, str] = dataclasses.field(default_factory=dict)
    notes: dict[str, str] = dataclasses.field(default_factory=dict)

    def add(self, row: str, alerts: list[Alert]) -> None:
        self.alerts.setdefault(row, []).extend(alerts)

    def fed(self, judged: Mapping[str, list[Alert]]) -> None:
        """Add what :func:`feed` returned (each detector's row is its rule id)."""
        for row, alerts in judged.items():
            self.add(row, alerts)


def _nonfinite(run: RunData, s: PlainSeries, found: _Found) -> None:
    thresholds = run.thresholds
    bad: list[str] = []
    for role, series in (("train_loss", s.train), ("train_loss_epoch", s.train_epoch), ("val_loss", s.val)):
        tag = run.mapping.get(role, "")
        policy = NonFinitePolicy.from_settings(thresholds, action="warn")  # decides and latches: one per episode
        last = math.nan
        for step, v in series:
            if math.isfinite(v):
                last = v
                policy.decide(StepFindings(False, False), StepContext(s.epoch_at(step), step))
                continue
            bad.append(f"{tag} at step {step}")
            decision = policy.decide(StepFindings(True, False), StepContext(s.epoch_at(step), step))
            lr = s.lr_at(step)
            found.add(
                _NONFINITE,
                [
                    dataclasses.replace(
                        a,
                        source=tag,
                        message=f"the logged loss `{tag}` ({role}) is {v} at step {step} (epoch {a.epoch}); last "
                        f"finite value {last:.6g}"
                        + (f"; learning rate {lr:.3g}" if lr is not None else "")
                        + ". Attach AnomalyAlarm to stop (or skip) such a step and to find the first non-finite "
                        "value",
                    )
                    for a in decision.alerts
                ],
            )
    first = f"; first: {bad[0]}" if bad else ""
    found.measured[_NONFINITE] = f"{len(bad)} non-finite logged loss value(s){first}"
    found.notes[_NONFINITE] = f"gradients are not logged: {ALL_RULES[NONFINITE_GRAD]} checks them at every step"


def _trend(run: RunData, s: PlainSeries, found: _Found) -> None:
    """``loss_swing``, ``loss_stagnant``, ``val_decline`` and ``val_fluctuation`` in step order."""
    points, unit = loss_points(s)
    detectors = _trend_detectors(run, unit)
    swing, stagnant = detectors[LossSwingRule], detectors[LossStagnantRule]
    decline, fluctuation = detectors[ValDeclineRule], detectors[ValFluctuationRule]
    assert isinstance(swing, LossSwingRule) and isinstance(stagnant, LossStagnantRule)
    assert isinstance(fluctuation, ValFluctuationRule)
    swing_points, swing.unit, swing_note = swing_window_points(s, swing.threshold)
    baseline_steps = int(run.thresholds[STAGNANT_BASELINE_STEPS_KEY])
    early = [v for step, v in s.train if step < baseline_steps and math.isfinite(v)]
    # the initial loss, handed with the loss points until loss_stagnant holds it (as AnomalyAlarm hands it)
    initial = statistics.fmean(early) if early else None
    if initial is not None and not math.isfinite(initial):
        initial = None
    judging = list(detectors.values())
    # the swing's points and the stagnant rule's are one series where the run logged epoch means; else each is
    # fed its own (the swing's windows are sized to the step noise)
    apart = swing_points != points
    by_kind = ((swing,), (stagnant,)) if apart else (tuple(judging), ())
    train_steps = [step for step, _ in s.train]
    finite_train = [p for p in s.train if math.isfinite(p[1])]
    changes: list[float] = []
    longest = 0
    ratios: list[float] = []
    previous_val = -1
    # validation after the loss point of the same step: the point closes the period the validation follows
    events = sorted(
        [(step, 0, v) for step, v in swing_points]
        + [(step, 1, v) for step, v in points]
        + [(step, 2, v) for step, v in s.val if math.isfinite(v)]
    )
    spread = dict(zip((step for step, _ in swing_points), spreads(swing_points, finite_train), strict=True))
    for step, kind, v in events:
        ctx = StepContext(s.epoch_at(step), step)
        if kind == 0:
            count, variance = spread[step]
            window = LossWindow(v, max(count, 1), variance, initial=initial if stagnant.baseline is None else None)
            found.fed(feed(by_kind[0], ctx, Measures(loss_window=window)))
            change = getattr(swing, "last_change", math.nan)
            if math.isfinite(change) and (not changes or changes[-1] != change):
                changes.append(change)
            continue
        if kind == 1:
            window = LossWindow(v, initial=initial if stagnant.baseline is None else None)
            found.fed(feed(by_kind[1], ctx, Measures(loss_window=window)))
            continue
        lo, hi = bisect.bisect_right(train_steps, previous_val), bisect.bisect_right(train_steps, step)
        since = [x for _, x in s.train[lo:hi] if math.isfinite(x)]
        train_mean = statistics.fmean(since) if since else None
        previous_val = step
        # val_fluctuation judges nothing without the training loss since the last run (train None)
        found.fed(feed(judging, ctx, Measures(validation=Validation(v, train=train_mean, is_loss=False))))
        longest = max(longest, int(getattr(decline, "streak", 0)))
        ratio = getattr(fluctuation, "last_ratio", math.nan)
        if train_mean is not None and math.isfinite(ratio):
            ratios.append(ratio)
    if changes:
        found.measured[LOSS_SWING] = (
            f"relative change between {swing.unit}s {min(changes):+.1%} .. {max(changes):+.1%} over "
            f"{len(swing_points)} points"
        )
    else:
        found.notes[LOSS_SWING] = f"needs at least two points ({swing.unit}s); " + (
            f"the run has {len(swing_points)}" if swing_points else f"the run logged {len(s.train)} training losses"
        )
    if swing_note:
        found.notes[LOSS_SWING] = f"{found.notes.get(LOSS_SWING, '')} {swing_note}".strip()
    if s.val:
        found.measured[VAL_DECLINE] = f"longest run of worse validations: {longest} (of {len(s.val)} validations)"
    else:
        found.notes[VAL_DECLINE] = "no validation loss was logged (map one with --map val_loss=TAG)"
    if ratios:
        found.measured[VAL_FLUCTUATION] = f"val / train fluctuation up to {fmt(max(ratios))}"
    else:
        found.notes[VAL_FLUCTUATION] = (
            f"needs {fluctuation.window} validation runs spanning {fluctuation.min_steps} steps, with the training "
            "loss logged between them"
        )
    if initial is None:
        found.notes[LOSS_STAGNANT] = (
            f"needs the training loss of the first {baseline_steps} steps (the untrained model's level); the first "
            f"logged is at step {s.train[0][0]}: log with log_every_n_steps=1, or attach AnomalyAlarm"
            if s.train
            else "no per-step training loss was logged"
        )
    elif math.isfinite(level := getattr(stagnant, "level", math.nan)) and stagnant.baseline:
        found.measured[LOSS_STAGNANT] = (
            f"level {fmt(level)}, {1 - level / stagnant.baseline:.1%} below the initial {fmt(stagnant.baseline)}"
        )
    else:
        found.notes[LOSS_STAGNANT] = f"needs {stagnant.patience} points over {stagnant.min_steps} steps"


def _trend_detectors(run: RunData, unit: str) -> dict[type[Rule], Rule]:
    """:data:`PRESET` but ``loss_outlier`` (fed apart, by :func:`_outliers`), built from the run's thresholds with
    the sources of the run's mapped series; ``unit``: what one of ``loss_stagnant``'s points is."""
    source = run.mapping.get("train_loss_epoch") or run.mapping.get("train_loss", "train_loss")
    monitor = run.mapping.get("val_loss", "val_loss")
    context: dict[type[Rule], dict[str, str]] = {
        LossSwingRule: {"source": source},
        LossStagnantRule: {"source": source, "unit": unit},
        ValDeclineRule: {"monitor": monitor},
        ValFluctuationRule: {"monitor": monitor},
    }
    return {rule: rule.from_settings(run.thresholds, **context[rule]) for rule in PRESET if rule in context}


def _outliers(run: RunData, s: PlainSeries, found: _Found) -> None:
    rule = LossOutlierRule.from_settings(run.thresholds)
    if len(s.train) < rule.window // 2 + 1:
        found.notes[LOSS_OUTLIER] = (
            f"needs more than {rule.window // 2} logged training losses, the run has {len(s.train)}"
        )
        return
    chunk: Series = []
    for i, (step, v) in enumerate(s.train):  # an epoch's logged steps at a time, as the alarm feeds its pending losses
        chunk.append((step, v))
        if i + 1 == len(s.train) or s.epoch_at(s.train[i + 1][0]) != s.epoch_at(step):
            ctx = StepContext(s.epoch_at(step), step)
            losses = StepLosses([x for _, x in chunk], [t for t, _ in chunk])
            found.fed(feed((rule,), ctx, Measures(step_losses=losses)))
            chunk = []
    found.measured[LOSS_OUTLIER] = (
        f"{len(found.alerts.get(LOSS_OUTLIER, []))} outlier alert(s) over {len(s.train)} logged training losses"
    )


def _not_measured(check: Check) -> Check:
    owners = sorted({ALL_RULES[r] for r in check.rules if r in ALL_RULES})
    if owners:
        check.add_note(f"not logged by a plain Lightning run: {', '.join(owners)} measures it")
    else:
        check.add_note("outside what a training callback sees; no lightning_diag callback measures it")
    return check


@functools.lru_cache(maxsize=1)
def _checklist() -> tuple[Check, ...]:
    """The rows of every plain run, before judging: titles and thresholds from the registry's defaults (the same
    for every plain run, so described once), the rows a plain run cannot measure already marked."""
    thresholds = default_thresholds()
    specs = sorted(CHECKS.values(), key=lambda spec: CHECKLIST_LAYERS.index(spec.layer))
    checks = [Check(spec.check_id, spec.layer, spec.describe(thresholds), spec.rules) for spec in specs]
    checks += [
        Check(rule, "Other", (t := RULES[rule].describe(thresholds))[:1].upper() + t[1:], (rule,))
        for rule in _OTHER_RULES
    ]
    for check in checks:
        if check.id not in _MEASURED_ROWS and check.id not in _OTHER_RULES:
            _not_measured(check)
            continue
        check.threshold = "; ".join(RULES[r].describe(thresholds) for r in check.rules if r in RULES)
        if check.id == _NONFINITE:
            check.threshold = "no non-finite value"
            check.rules = (NONFINITE_LOSS,)
    return tuple(checks)


def diagnose_plain(run: RunData) -> RunReport:
    """The checklist of a plain run (:func:`map_plain_run` first): the loss rows replayed, the rest not measured.

    The replayed rules' warning and critical alerts become the run's alerts (its timeline and ``--fail-on``), and
    the mapped losses its ``diag/loss/*`` series (the report's loss plot).
    """
    s = PlainSeries.of(run)
    found = _Found()
    _nonfinite(run, s, found)
    _trend(run, s, found)
    _outliers(run, s, found)
    run.alerts = sorted((a for alerts in found.alerts.values() for a in alerts), key=lambda a: a.global_step)
    # the judged series under the tags the report's loss plot draws (a plain run has no diag/ series of its own)
    for tag, points in (
        (loss_tag("train_step"), s.train),
        (loss_tag("train_epoch"), s.train_epoch),
        (loss_tag("val"), s.val),
    ):
        if points:
            run.scalars[tag] = points
    out: list[Check] = []
    for template in _checklist():
        check = dataclasses.replace(template, measured_value={}, threshold_value=dict(template.threshold_value))
        row = check.id
        if row not in _MEASURED_ROWS and row not in _OTHER_RULES:
            out.append(check)
            continue
        check.measured = found.measured.get(row)
        if row in found.notes:
            check.add_note(found.notes[row])
        measured = row in found.measured
        out.append(finish_check(check, run, measured, [], name_owners=False))
        if not measured and check.status == "not measured":
            check.measured = None
    return RunReport(run, out)
