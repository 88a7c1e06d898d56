"""``val_decline`` (framework-free): the validation metric worsens run after run, fed by
:class:`~lightning_diag.AnomalyAlarm`.

Exact definition (also in ``docs/anomaly_alarm.md``):

A validation value is *worse* than the one before it when it is larger by more than
``min_delta`` (mode ``"min"``) or smaller by more than ``min_delta`` (mode ``"max"``). Fires when
``patience`` consecutive validation runs are worse and, where the values' standard errors are known, the whole
worsening of the streak is more than ``z`` standard errors of that difference.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from typing import ClassVar, Literal

from lightning_diag.core.record import Alert
from lightning_diag.core.registry import COUNT, POSITIVE, STEPS, CheckSpec, RuleSpec, default, register
from lightning_diag.core.tags import loss_tag
from lightning_diag.rules.base import Latch, Rule, StepContext
from lightning_diag.rules.measures import Measure, Measures, Validation
from lightning_diag.rules.rows import Check, LoggedRun, finite_values, measure, replay, run_threshold

__all__ = [
    "DEFAULT_VAL_DECLINE_MIN_DELTA",
    "DEFAULT_VAL_DECLINE_MIN_STEPS",
    "DEFAULT_VAL_DECLINE_THRESHOLD",
    "DEFAULT_VAL_DECLINE_Z",
    "VAL_DECLINE",
    "VAL_DECLINE_CHECK",
    "VAL_DECLINE_HIGHER_IS_BETTER_KEY",
    "VAL_DECLINE_MIN_DELTA_KEY",
    "VAL_DECLINE_SPEC",
    "ValDeclineRule",
]

_ALARM = "AnomalyAlarm"
VAL_DECLINE_SPEC = register(RuleSpec(
    "val_decline", _ALARM, "warning", 5.0, "validation metric worsens on {threshold:g} consecutive validation runs",
    settings={"min_delta": 0.0, "min_steps": 20, "z": 2.0}, check="val_decline", source="seed 001 §1.2",
    limits={"threshold": COUNT, "min_steps": STEPS, "z": POSITIVE},
))
VAL_DECLINE = VAL_DECLINE_SPEC.rule_id
#: Its row of the ``lightning-diag report`` checklist (registered in report order by
#: :mod:`lightning_diag.rules.catalog`).
VAL_DECLINE_CHECK = CheckSpec(VAL_DECLINE, "Training",
                              "Validation metric does not worsen on {val_decline:g} consecutive runs")
#: ``thresholds()`` key the report reads back from a run.
VAL_DECLINE_MIN_DELTA_KEY = VAL_DECLINE_SPEC.key("min_delta")
#: Key AnomalyAlarm writes beside the settings (not a setting: how it was configured): the validation metric's
#: direction (1 when higher is better).
VAL_DECLINE_HIGHER_IS_BETTER_KEY = f"{VAL_DECLINE}.higher_is_better"

#: ``val_decline``: consecutive worsening validation runs before the rule fires (seed 001 §1.2: 5).
DEFAULT_VAL_DECLINE_THRESHOLD = int(default(VAL_DECLINE))
#: ``val_decline``: change that counts as worse.
DEFAULT_VAL_DECLINE_MIN_DELTA = default(VAL_DECLINE_MIN_DELTA_KEY)
#: ``val_decline``: standard errors of the validation means the streak's whole worsening must exceed.
DEFAULT_VAL_DECLINE_Z = default(VAL_DECLINE_SPEC.key("z"))
#: ``val_decline``: optimizer steps the worsening streak must span.
DEFAULT_VAL_DECLINE_MIN_STEPS = int(default(VAL_DECLINE_SPEC.key("min_steps")))


class ValDeclineRule(Rule):
    """``val_decline``: the monitored validation value worsens on ``patience`` consecutive runs.

    When the standard error of each validation value is known (``se``: the spread of its batches' values, see
    :meth:`~lightning_diag.callbacks.anomaly_alarm.loss_trend.LossTrend.on_validation_batch_end`), the streak's whole
    worsening, from the run it worsens from to the last, must also exceed ``z`` standard errors of that difference
    (``sqrt(se_start^2 + se^2)``): a validation loss worse by 0.15% over five runs on thousands of samples is the
    validation set's noise, not a decline. Without it (a metric logged only at the epoch's end), any worsening
    counts, as before.

    Args:
        monitor: Name of the metric, for messages and the alert's ``source``.
        mode: ``"min"`` if lower is better, ``"max"`` if higher is better.
        patience: Consecutive worsening runs before the rule fires (the rule's threshold).
        min_delta: Change that counts as worse.
        min_steps: Optimizer steps the streak must span (``val_decline.min_steps``).
        z: Standard errors of the difference the streak's worsening must exceed (``val_decline.z``).

    Example:
        >>> from lightning_diag.rules.measures import Validation
        >>> rule = ValDeclineRule(patience=2)
        >>> ms = [Measures(validation=Validation(v)) for v in (1.0, 1.1, 1.2, 1.3)]
        >>> [len(rule.judge(StepContext(i, 10 * i), m)) for i, m in enumerate(ms)]
        [0, 0, 1, 0]
    """

    needs = frozenset({Measure.VALIDATION})
    specs = (VAL_DECLINE_SPEC,)
    setting_keys: ClassVar[Mapping[str, str]] = {"patience": VAL_DECLINE}
    state_keys = ("previous", "streak", "history", "streak_start", "train_start", "start", "previous_se")

    def __init__(
        self,
        monitor: str = "val_loss",
        mode: Literal["min", "max"] = "min",
        patience: int = DEFAULT_VAL_DECLINE_THRESHOLD,
        min_delta: float = DEFAULT_VAL_DECLINE_MIN_DELTA,
        min_steps: int = DEFAULT_VAL_DECLINE_MIN_STEPS,
        z: float = DEFAULT_VAL_DECLINE_Z,
    ) -> None:
        super().__init__()
        self.monitor = monitor
        self.mode = mode
        self.patience = patience
        self.latch = Latch.for_patience(patience)
        self.min_delta = min_delta
        self.previous: float | None = None
        self.streak = 0
        self.history: list[float] = []
        #: Optimizer steps the worsening streak must span (``val_decline.min_steps``): with one-batch epochs,
        #: ``patience`` validation runs are a handful of steps.
        self.min_steps = min_steps
        #: The global step of the run the current streak worsens from.
        self.streak_start = 0
        #: The mean training loss before that run (``None``: not known).
        self.train_start: float | None = None
        #: ``[value, standard error or None]`` of the run the current streak worsens from.
        self.start: list[float | None] = []
        #: The standard error of the previous value (``None``: unknown).
        self.previous_se: float | None = None
        #: Standard errors the streak's worsening must exceed (``val_decline.z``).
        self.z = z
        #: The last streak's worsening over its standard error (``nan``: unknown).
        self.last_z = math.nan

    def significance(self, value: float, se: float | None) -> float:
        """The worsening from the streak's start to ``value`` over its standard error (``inf`` when either
        standard error is unknown: the test is not made)."""
        if len(self.start) < 2 or self.start[1] is None or se is None:
            return math.inf
        first = float(self.start[0] or 0.0)
        worse = value - first if self.mode == "min" else first - value
        noise = math.sqrt(float(self.start[1]) ** 2 + se * se)
        return worse / noise if noise > 0 else (math.inf if worse > 0 else 0.0)

    def judge(self, ctx: StepContext, m: Measures) -> list[Alert]:
        """Judge the next validation value (and the mean training loss since the previous run, when known);
        return the alerts it raises.

        With ``train`` given, a streak over which the training loss rose too is a schedule (a KL weight warming
        up raises both), not overfitting: the rule stays quiet while the training loss is above its value at the
        run the streak worsens from. ``se`` is the value's standard error (``None``: unknown).
        """
        assert m.validation is not None  # checked against `needs`
        value, train, se = m.validation.value, m.validation.train, m.validation.se
        if not math.isfinite(value):
            return []
        se = float(se) if se is not None and math.isfinite(se) and se >= 0 else None
        self.history = [*self.history[-self.patience :], value]
        if self.previous is not None:
            worse = (
                value > self.previous + self.min_delta if self.mode == "min" else value < self.previous - self.min_delta
            )
            self.streak = self.streak + 1 if worse else 0
        train = train if train is not None and math.isfinite(train) else None
        if self.streak == 0:
            self.streak_start = ctx.global_step
            self.train_start = train
            self.start = [value, se]
        self.previous, self.previous_se = value, se
        spanned = ctx.global_step - self.streak_start
        scheduled = train is not None and self.train_start is not None and train > self.train_start
        self.last_z = self.significance(value, se) if self.streak else math.nan
        significant = not self.last_z <= self.z  # nan (no streak) is judged by the streak
        if not scheduled and spanned >= self.min_steps:
            streak_part = self.streak / self.patience
            self.observe(min(streak_part, self.last_z / self.z) if self.streak else 0.0, 1.0)
        active = self.streak >= self.patience and spanned >= self.min_steps and not scheduled and significant
        if not self.latch.update(self.monitor, active):
            return []
        points = ", ".join(f"{v:.4g}" for v in self.history)
        return [
            self._alert(
                ctx,
                f"`{self.monitor}` got worse on {self.streak} consecutive validation runs over {spanned} steps "
                f"({points}): "
                "the model is likely overfitting; consider early stopping, more data or regularisation",
                source=self.monitor,
                value=float(self.streak),
                threshold=float(self.patience),
            )
        ]


# -- the report's val_decline row ------------------------------------------------------------------------------


@measure(VAL_DECLINE)
def _measure_val_decline(run: LoggedRun, check: Check) -> bool:
    patience = run_threshold(run, VAL_DECLINE)
    min_delta = run_threshold(run, VAL_DECLINE_MIN_DELTA_KEY) or 0.0
    higher = bool(run_threshold(run, VAL_DECLINE_HIGHER_IS_BETTER_KEY))
    check.threshold = f"fewer than {int(patience)} consecutive worse runs" if patience is not None else "not logged"
    check.threshold_value = {"value": patience} if patience is not None else {}
    values = finite_values(run.scalars.get(loss_tag("val"), []))
    longest = streak = 0
    for prev, cur in itertools.pairwise(values):
        worse = (cur < prev - min_delta) if higher else (cur > prev + min_delta)
        streak = streak + 1 if worse else 0
        longest = max(longest, streak)
    if values:
        check.measured = f"longest run of worse validations: {longest} (of {len(values)} validations)"
        check.measured_value = {"max": float(longest)}
    return bool(values)


@replay(VAL_DECLINE)
def _replay_val_decline(run: LoggedRun) -> list[Alert]:
    mode: Literal["min", "max"] = "max" if run_threshold(run, VAL_DECLINE_HIGHER_IS_BETTER_KEY) else "min"
    rule = ValDeclineRule.from_settings(run.thresholds, mode=mode)
    alerts: list[Alert] = []
    for step, v in run.scalars.get(loss_tag("val"), []):
        if math.isfinite(v):
            alerts += rule.judge(StepContext(0, step), Measures(validation=Validation(v)))
    return alerts
