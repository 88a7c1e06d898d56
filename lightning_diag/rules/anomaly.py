"""Loss and validation trend rules used by :class:`~lightning_diag.AnomalyAlarm`.

Exact definitions (also in ``docs/anomaly_alarm.md``):

* ``loss_swing``: for consecutive loss points ``L[k-1], L[k]`` (epoch means, or means over windows of steps),
  the relative change is ``r = (L[k] - L[k-1]) / |L[k-1]|``. A point *swings* when ``|r| > threshold``,
  ``|L[k] - L[k-1]| > min_delta``, the change is more than ``z`` standard errors of the two points' step-loss noise
  (Welch; one-step points pool the run's recent noise) and it is not a move with the learning rate by a factor of
  at most ``lr_ratio`` (the user's schedule), and it is either a rise (``r > 0``) or a fall that reverses a swinging
  rise just before it. Falls that follow falls never swing, so a loss that drops steadily, however fast,
  is healthy; between one-step points (single samples) a rise does not swing right after a swinging rise either.
  A point with more than 1.25 times the previous point's steps is a mean over a larger training set (a curriculum
  that adds examples): its change is a level shift of the data and never swings.
  The rule fires when ``patience`` consecutive points swing. The validation loss (the same samples at every run) is
  judged as a second series (:meth:`LossSwingRule.judge_validation`): each change must also be significant against
  the two runs' standard errors (pooled over the recent runs), and a rise must end above the loss's scale (the
  initial training loss); the rule fires when ``patience`` consecutive changes swing and one of them is a fall.
* ``val_decline``: a validation value is *worse* than the one before it when it is larger by more than
  ``min_delta`` (mode ``"min"``) or smaller by more than ``min_delta`` (mode ``"max"``). Fires when
  ``patience`` consecutive validation runs are worse and, where the values' standard errors are known, the whole
  worsening of the streak is more than ``z`` standard errors of that difference.
* ``val_fluctuation``: over the last ``window`` validation runs, the fluctuation of a series is the RMS of its
  residuals around a least-squares line or parabola fitted to its logarithm
  (:func:`~lightning_diag.stats.fluctuation`). A window is judged at the run after it. Fires when the validation
  fluctuation exceeds ``ratio`` times the training-loss fluctuation (the larger of the training periods' before
  and after the window's runs), is itself above ``min_fluctuation`` and the range of the
  validation window (loss units) is above ``min_range``, **and** the validation value's rises over the window (the
  sum of its increases from one run to the next) are above ``min_rise`` of its *scale*, the first validation value
  of the fit (the loss at the start of training), **and** it rises at least twice (once for a window of 3): a rise
  counts when it is at least a quarter of the window's largest rise (the validation fluctuation: the part its runs'
  standard errors do not explain, :func:`noise_fluctuation`). Relative fluctuations blow up near zero: a
  converged fine-tune whose validation loss wanders 0.097 -> 0.167 -> 0.024 reads 50% in log units against 7% for
  its training loss, yet it rises once, by 0.07, 7% of its initial 0.96 (a bump, not a fluctuation); a validation
  loss that zig-zags by 40% of its level rises twice, by 150% of it.
* ``loss_stagnant``: the *initial loss* is the mean training loss of the first ``baseline_steps`` optimizer steps,
  the loss of the untrained model: for a classifier this is the chance level (about ``ln C`` for ``C`` balanced
  classes). After ``patience`` loss points (epoch or window means, as for ``loss_swing``), the rule fires while
  the best point so far is not below ``(1 - min_drop)`` times the initial loss: the model is not learning (a
  label/target bug, inputs and targets out of step, a dead optimizer). It clears when the loss falls below that
  level. A positive initial loss is needed; with zero or negative losses the rule stays quiet.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections import deque
from collections.abc import Mapping
from typing import Any, Literal

from lightning_diag.core.record import Alert
from lightning_diag.core.registry import COUNT, FRACTION, POSITIVE, STEPS, CheckSpec, Limit, RuleSpec, default, register
from lightning_diag.rules.base import Latch, Rule, StepContext, excess
from lightning_diag.rules.measures import LossWindow, Measure, Measures, Validation
from lightning_diag.stats.trend import (
    fluctuation,
    mann_kendall,
    mann_kendall_min_points,
    relative_change,
    theil_sen_slope,
)

__all__ = [
    "DEFAULT_STAGNANT_ALPHA",
    "DEFAULT_STAGNANT_BASELINE_STEPS",
    "DEFAULT_STAGNANT_MIN_STEPS",
    "DEFAULT_STAGNANT_MIN_TREND",
    "DEFAULT_STAGNANT_PATIENCE",
    "DEFAULT_STAGNANT_THRESHOLD",
    "DEFAULT_SWING_LR_RATIO",
    "DEFAULT_SWING_MIN_DELTA",
    "DEFAULT_SWING_PATIENCE",
    "DEFAULT_SWING_THRESHOLD",
    "DEFAULT_SWING_Z",
    "DEFAULT_VAL_DECLINE_MIN_DELTA",
    "DEFAULT_VAL_DECLINE_MIN_STEPS",
    "DEFAULT_VAL_DECLINE_THRESHOLD",
    "DEFAULT_VAL_DECLINE_Z",
    "DEFAULT_VAL_FLUCTUATION_MIN",
    "DEFAULT_VAL_FLUCTUATION_MIN_RANGE",
    "DEFAULT_VAL_FLUCTUATION_MIN_RISE",
    "DEFAULT_VAL_FLUCTUATION_MIN_STEPS",
    "DEFAULT_VAL_FLUCTUATION_THRESHOLD",
    "DEFAULT_VAL_FLUCTUATION_WINDOW",
    "LOSS_STAGNANT",
    "LOSS_STAGNANT_SPEC",
    "LOSS_SWING",
    "LOSS_SWING_CHECK",
    "LOSS_SWING_PATIENCE_KEY",
    "LOSS_SWING_SPEC",
    "LOSS_SWING_WINDOW_STEPS_KEY",
    "STAGNANT_BASELINE_STEPS_KEY",
    "VAL_DECLINE",
    "VAL_DECLINE_CHECK",
    "VAL_DECLINE_HIGHER_IS_BETTER_KEY",
    "VAL_DECLINE_MIN_DELTA_KEY",
    "VAL_DECLINE_SPEC",
    "VAL_FLUCTUATION",
    "VAL_FLUCTUATION_CHECK",
    "VAL_FLUCTUATION_SPEC",
    "VAL_FLUCTUATION_WINDOW_KEY",
    "LossStagnantRule",
    "LossSwingRule",
    "ValDeclineRule",
    "ValFluctuationRule",
    "normal_deviate",
    "welch_z",
]

# -- declarations (one per rule id; the docs' thresholds table and the report read them) -----------------------
_ALARM = "AnomalyAlarm"
LOSS_SWING_SPEC = register(RuleSpec(
    "loss_swing", _ALARM, "warning", 0.10,
    "training loss swings by more than {threshold:.0%} on {patience:g} consecutive epochs",
    settings={"patience": 3, "min_delta": 1e-3, "z": 2.0, "lr_ratio": 10.0}, check="loss_swing",
    source="seed 001 §1.2",
    limits={"threshold": POSITIVE, "patience": COUNT, "z": POSITIVE, "lr_ratio": Limit(low=1.0, low_inclusive=True)},
))
VAL_DECLINE_SPEC = register(RuleSpec(
    "val_decline", _ALARM, "warning", 5.0, "validation metric worsens on {threshold:g} consecutive validation runs",
    settings={"min_delta": 0.0, "min_steps": 20, "z": 2.0}, check="val_decline", source="seed 001 §1.2",
    limits={"threshold": COUNT, "min_steps": STEPS, "z": POSITIVE},
))
VAL_FLUCTUATION_SPEC = register(RuleSpec(
    "val_fluctuation", _ALARM, "warning", 2.0,
    "validation-loss fluctuation above {threshold:g}x the training-loss fluctuation",
    settings={"window": 5, "min": 0.15, "min_range": 0.01, "min_rise": 0.1, "min_steps": 20}, check="val_fluctuation",
    source="seed 000 §4.1",
    limits={"threshold": POSITIVE, "window": Limit(low=3, integer=True), "min_steps": STEPS},
))
LOSS_STAGNANT_SPEC = register(RuleSpec(
    "loss_stagnant", _ALARM, "warning", 0.10,
    "training loss has not fallen {threshold:.0%} below its initial value after {patience:g} points",
    settings={"patience": 4, "baseline_steps": 5, "min_steps": 50, "alpha": 0.05, "min_trend": 0.02},
    limits={"threshold": Limit(low=0.0, high=1.0, low_inclusive=True, high_inclusive=False), "patience": COUNT,
            "baseline_steps": COUNT, "min_steps": STEPS, "alpha": FRACTION,
            "min_trend": Limit(low=0.0, low_inclusive=True)},
))
LOSS_SWING = LOSS_SWING_SPEC.rule_id
VAL_DECLINE = VAL_DECLINE_SPEC.rule_id
VAL_FLUCTUATION = VAL_FLUCTUATION_SPEC.rule_id
LOSS_STAGNANT = LOSS_STAGNANT_SPEC.rule_id
#: Their rows of the ``lightning-diag report`` checklist (registered in report order by
#: :mod:`lightning_diag.rules.catalog`).
LOSS_SWING_CHECK = CheckSpec(
    LOSS_SWING, "Training",
    "Training loss does not swing by more than {loss_swing:.0%} on {loss_swing__patience:g} consecutive points",
)
VAL_DECLINE_CHECK = CheckSpec(VAL_DECLINE, "Training",
                              "Validation metric does not worsen on {val_decline:g} consecutive runs")
VAL_FLUCTUATION_CHECK = CheckSpec(
    VAL_FLUCTUATION, "Training", "Validation fluctuation at most {val_fluctuation:g}x the training fluctuation"
)
#: ``thresholds()`` key of ``loss_stagnant``'s baseline (read by the loss trend's sums).
STAGNANT_BASELINE_STEPS_KEY = LOSS_STAGNANT_SPEC.key("baseline_steps")
#: ``thresholds()`` keys the report reads back from a run.
LOSS_SWING_PATIENCE_KEY = LOSS_SWING_SPEC.key("patience")
VAL_DECLINE_MIN_DELTA_KEY = VAL_DECLINE_SPEC.key("min_delta")
VAL_FLUCTUATION_WINDOW_KEY = VAL_FLUCTUATION_SPEC.key("window")
#: Keys AnomalyAlarm writes beside the settings (not settings: how it was configured): the validation metric's
#: direction (1 when higher is better), and the swing window in steps when ``swing_window`` is an int.
VAL_DECLINE_HIGHER_IS_BETTER_KEY = f"{VAL_DECLINE}.higher_is_better"
LOSS_SWING_WINDOW_STEPS_KEY = f"{LOSS_SWING}.window_steps"

#: ``loss_swing``: relative change that counts as a swing (seed 001 §1.2: 10%).
DEFAULT_SWING_THRESHOLD = default(LOSS_SWING)
#: ``loss_swing``: consecutive swinging epochs (or windows) before the rule fires (seed 001 §1.2: 3).
DEFAULT_SWING_PATIENCE = int(default(LOSS_SWING_PATIENCE_KEY))
#: ``loss_swing``: absolute change below which a point never swings (keeps near-zero losses quiet).
DEFAULT_SWING_MIN_DELTA = default(LOSS_SWING_SPEC.key("min_delta"))
#: ``val_decline``: consecutive worsening validation runs before the rule fires (seed 001 §1.2: 5).
DEFAULT_VAL_DECLINE_THRESHOLD = int(default(VAL_DECLINE))
#: ``val_decline``: change that counts as worse.
DEFAULT_VAL_DECLINE_MIN_DELTA = default(VAL_DECLINE_MIN_DELTA_KEY)
#: ``val_fluctuation``: validation fluctuation above this multiple of the training one (seed 000 §4.1: 2x).
DEFAULT_VAL_FLUCTUATION_THRESHOLD = default(VAL_FLUCTUATION)
#: ``val_fluctuation``: validation runs in the window.
DEFAULT_VAL_FLUCTUATION_WINDOW = int(default(VAL_FLUCTUATION_WINDOW_KEY))
#: ``val_fluctuation``: validation fluctuation (relative to its level) below which the rule never fires.
DEFAULT_VAL_FLUCTUATION_MIN = default(VAL_FLUCTUATION_SPEC.key("min"))
#: ``val_fluctuation``: range (max - min, loss units) of the validation window below which it never fires.
DEFAULT_VAL_FLUCTUATION_MIN_RANGE = default(VAL_FLUCTUATION_SPEC.key("min_range"))
#: ``val_fluctuation``: the window's rises, as a fraction of the first validation value, below which it never fires.
DEFAULT_VAL_FLUCTUATION_MIN_RISE = default(VAL_FLUCTUATION_SPEC.key("min_rise"))

#: ``loss_stagnant``: fraction of the initial loss the training loss must have fallen by.
DEFAULT_STAGNANT_THRESHOLD = default(LOSS_STAGNANT)
#: ``loss_stagnant``: loss points (epochs or windows) the training loss has to get there.
DEFAULT_STAGNANT_PATIENCE = int(default(LOSS_STAGNANT_SPEC.key("patience")))
#: ``val_fluctuation``: validation runs kept, at most (the window, and earlier runs its ``min_steps`` needs).
_VAL_RUNS_KEPT = 64
#: ``loss_stagnant``: the points its trend test reads, at most (beyond, pairs are averaged: the whole run stays).
_TREND_POINTS = 256
#: ``loss_stagnant``: first optimizer steps whose mean loss is the initial loss.
DEFAULT_STAGNANT_BASELINE_STEPS = int(default(STAGNANT_BASELINE_STEPS_KEY))
#: ``loss_stagnant``: optimizer steps before a verdict (with at least the trend test's fewest points).
DEFAULT_STAGNANT_MIN_STEPS = int(default(LOSS_STAGNANT_SPEC.key("min_steps")))
#: ``loss_stagnant``: significance level of the Mann-Kendall test that the loss falls.
DEFAULT_STAGNANT_ALPHA = default(LOSS_STAGNANT_SPEC.key("alpha"))
#: ``loss_stagnant``: the Theil-Sen fall over the points, as a fraction of the loss's level, that is progress.
DEFAULT_STAGNANT_MIN_TREND = default(LOSS_STAGNANT_SPEC.key("min_trend"))
#: ``loss_swing``: standard errors of the step losses' noise a change must exceed to swing.
DEFAULT_SWING_Z = default(LOSS_SWING_SPEC.key("z"))
#: ``loss_swing``: the largest learning-rate factor between two points that is the user's schedule.
DEFAULT_SWING_LR_RATIO = default(LOSS_SWING_SPEC.key("lr_ratio"))
#: ``loss_swing``: the recent points whose step-to-step differences pool the noise of one-step points.
_POOL_POINTS = 16
#: ``loss_swing``: the fewest successive differences the pooled noise is taken from.
_POOL_MIN_PAIRS = 4
#: ``loss_swing``: the degrees of freedom the validation view pools the standard errors of recent runs up to.
_VAL_POOL_DF = 30.0
#: ``loss_swing``: a learning rate that changes by less than this fraction did not move.
_LR_MOVES = 0.01
#: ``loss_swing``: a point with more than this factor of the previous point's steps is a mean over a larger training
#: set (a curriculum that adds examples): its change is the data's, not a swing. (Fewer steps are no evidence: an
#: epoch cut short by a stop or by non-finite losses left out has fewer.)
_DATA_CHANGE = 1.25
#: ``val_decline``: standard errors of the validation means the streak's whole worsening must exceed.
DEFAULT_VAL_DECLINE_Z = default(VAL_DECLINE_SPEC.key("z"))
#: ``val_decline``: optimizer steps the worsening streak must span.
DEFAULT_VAL_DECLINE_MIN_STEPS = int(default(VAL_DECLINE_SPEC.key("min_steps")))
#: ``val_fluctuation``: optimizer steps the window must span.
DEFAULT_VAL_FLUCTUATION_MIN_STEPS = int(default(VAL_FLUCTUATION_SPEC.key("min_steps")))


def _pct(x: float) -> str:
    return f"{x * 100:+.1f}%"


def welch_z(delta: float, first: list[float] | None, second: list[float] | None) -> float:
    """A difference of two means over its standard error (Welch's ``t``), as a standard normal deviate.

    ``first`` and ``second`` are ``[variance of the mean, degrees of freedom]``; the degrees of freedom of the
    difference are Welch-Satterthwaite's, and ``t`` becomes the normal deviate of the same tail probability by
    ``z = t (1 - 1 / (4 df)) / sqrt(1 + t^2 / (2 df))`` (so a bound on ``z`` means the same significance for
    epochs of 4 steps or of 4000). ``nan`` when a noise is unknown; ``inf`` for a change against no noise at all.

    Example:
        >>> round(welch_z(1.0, [0.1, 1000.0], [0.1, 1000.0]), 2), round(welch_z(1.0, [0.1, 3.0], [0.1, 3.0]), 2)
        (2.23, 1.8)
    """
    if first is None or second is None:
        return math.nan
    (v1, df1), (v2, df2) = first, second
    variance = v1 + v2
    if not math.isfinite(variance):
        return 0.0 if math.isinf(variance) else math.nan
    if variance <= 0:
        return math.inf if delta > 0 else math.nan
    t = delta / math.sqrt(variance)
    denominator = (v1 * v1 / max(df1, 1.0) if v1 > 0 else 0.0) + (v2 * v2 / max(df2, 1.0) if v2 > 0 else 0.0)
    return normal_deviate(t, variance * variance / denominator if denominator > 0 else math.inf)


def normal_deviate(t: float, df: float) -> float:
    """Student's ``t`` with ``df`` degrees of freedom as the standard normal deviate of about the same tail
    probability: ``z = t (1 - 1 / (4 df)) / sqrt(1 + t^2 / (2 df))`` (``t`` itself for infinite ``df``).

    Example:
        >>> round(normal_deviate(3.0, 4.0), 2), normal_deviate(2.0, math.inf)
        (1.93, 2.0)
    """
    if math.isinf(df) or not math.isfinite(t):
        return t
    df = max(df, 1.0)
    return t * (1.0 - 1.0 / (4.0 * df)) / math.sqrt(1.0 + t * t / (2.0 * df))


class LossSwingRule(Rule):
    """``loss_swing``: the training loss swings by more than ``threshold`` on ``patience`` consecutive points.

    A point is the mean step loss of an epoch (or window). Its change from the point before swings when it is
    above ``threshold`` (relative) and ``min_delta`` (absolute) **and** significant against the noise of the two
    points: ``|L[k] - L[k-1]|`` over ``sqrt(s[k-1]^2 / n[k-1] + s[k]^2 / n[k])`` above ``z`` (Welch's statistic as a
    normal deviate, :func:`welch_z`; ``s^2``: the noise variance of a point's ``n`` step losses, passed as
    ``variance`` and ``steps``). A point of one step (one-batch epochs) has no spread of its own: its step
    variance is pooled, from the recent multi-step points' variances or, when there are none, from the step-to-step
    differences of the last :data:`_POOL_POINTS` points (half the mean squared
    successive difference, which a smooth trend barely moves); with fewer than 4 such differences no change is
    significant. Two one-step points are judged against the pool as it stands at the second, with its degrees of
    freedom, and, being single samples (two outlying batches in a row rise, rise and fall back), swing only
    up-and-down: a rise there does not count right after a swinging rise.

    A change in the direction the learning rate moved between the two points (``lr``: the period's mean rate) is
    the user's schedule, not a swing, when the rate changed by a factor of at most ``lr_ratio`` (cyclic rates,
    one-cycle, warm restarts: the loss rises with the rate); a larger factor between two consecutive points is
    no schedule people train with (an oscillating or mis-set rate): a change that comes with it is the rate's
    doing rather than chance, and is significant from ``z / 2`` standard errors on. A point with more than
    :data:`_DATA_CHANGE` times the previous point's steps is a mean over a larger training set (a curriculum that
    adds examples): its change is the data's level shift and never swings (:meth:`resized`).

    Args:
        threshold: Relative change that counts as a swing.
        patience: Consecutive swinging points before the rule fires.
        min_delta: Absolute change below which a point never swings.
        unit: What one point is, for messages (``"epoch"`` or ``"window of N steps"``).

    Attributes:
        z: Standard errors of the change a swing must exceed (``loss_swing.z``).
        lr_ratio: Largest learning-rate factor between two points that is a schedule (``loss_swing.lr_ratio``).

    Example:
        >>> from lightning_diag.rules.measures import LossWindow
        >>> rule = LossSwingRule()
        >>> points = [1.0, 0.8, 1.0, 0.8, 1.0]  # epochs of 16 steps whose losses spread by 0.05
        >>> ms = [Measures(loss_window=LossWindow(v, steps=16, variance=0.05**2)) for v in points]
        >>> [len(rule.judge(StepContext(e, 16 * e), m)) for e, m in enumerate(ms)]
        [0, 0, 0, 0, 1]
        >>> rule = LossSwingRule()  # the same means, but the step losses spread by 0.5: noise
        >>> ms = [Measures(loss_window=LossWindow(v, steps=16, variance=0.5**2)) for v in points]
        >>> [len(rule.judge(StepContext(e, 16 * e), m)) for e, m in enumerate(ms)]
        [0, 0, 0, 0, 0]
    """

    # the training view, the loss points (`loss_window`), or the validation view (`validation`): whichever is given
    optional = frozenset({Measure.LOSS_WINDOW, Measure.VALIDATION})
    specs = (LOSS_SWING_SPEC,)
    state_keys = ("previous", "previous_rise", "streak", "last_change", "history", "previous_noise", "previous_lr",
                  "recent", "excesses", "val_previous", "val_rise", "val_streak", "val_history", "val_excesses",
                  "val_noise", "val_first")

    def __init__(
        self,
        threshold: float = DEFAULT_SWING_THRESHOLD,
        patience: int = DEFAULT_SWING_PATIENCE,
        min_delta: float = DEFAULT_SWING_MIN_DELTA,
        unit: str = "epoch",
        source: str = "train_loss",
    ) -> None:
        super().__init__()
        self.threshold = threshold
        self.patience = patience
        self.latch = Latch.for_patience(patience)
        self.min_delta = min_delta
        self.unit = unit
        self.source = source
        self.z = DEFAULT_SWING_Z
        self.lr_ratio = DEFAULT_SWING_LR_RATIO
        self.previous: float | None = None
        self.previous_rise = False
        self.streak = 0
        self.last_change = math.nan
        #: The last change over its standard error (``nan`` before two points).
        self.last_t = math.nan
        self.history: list[float] = []
        #: ``[variance of the previous point's mean, its degrees of freedom]`` (``None``: unknown).
        self.previous_noise: list[float] | None = None
        #: The previous point's learning rate (``None``: unknown).
        self.previous_lr: float | None = None
        #: ``[value, steps, step variance or None]`` of the last points, for the pooled noise of one-step points.
        self.recent: list[list[float | None]] = []
        #: How close each of the last ``patience`` points came to swinging (``min(|r| / threshold, t / z)``, 0 for
        #: one that cannot), for :meth:`Rule.observe`.
        self.excesses: list[float] = []
        #: The validation view (:meth:`judge_validation`): ``[value, variance of the value, its degrees of freedom,
        #: learning rate or nan]`` of the previous validation run (``None``: none yet).
        self.val_previous: list[float] | None = None
        #: The last validation change: 2 a swinging rise, 1 a rise that does not swing, 0 neither.
        self.val_rise = 0
        #: ``[consecutive swinging validation changes, how many of them are falls]``.
        self.val_streak: list[int] = [0, 0]
        #: The last validation values, for messages.
        self.val_history: list[float] = []
        #: ``[how close, is a fall]`` of each of the last ``patience`` validation changes, for the margin.
        self.val_excesses: list[list[float]] = []
        #: The last validation change over its standard error (``nan``: not judged).
        self.val_last_z = math.nan
        #: ``[squared standard error, degrees of freedom]`` of the last validation runs whose standard error was
        #: known, newest last (pooled by :meth:`pooled_val_variance`).
        self.val_noise: list[list[float]] = []
        #: The first validation value (the scale of the changes when the initial training loss is not known).
        self.val_first: float | None = None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output; a checkpoint from before the noise test loads with the previous
        point's noise and rate unknown."""
        defaults: dict[str, Any] = {
            "previous_noise": None, "previous_lr": None, "recent": [], "excesses": [], "val_previous": None,
            "val_rise": 0, "val_streak": [0, 0], "val_history": [], "val_excesses": [], "val_noise": [],
            "val_first": None,
        }
        super().load_state_dict({**defaults, **state})

    @classmethod
    def from_settings(
        cls, thresholds: Mapping[str, float | None], *, unit: str = "epoch", source: str = "train_loss"
    ) -> LossSwingRule:
        """The rule with the thresholds in effect (see :meth:`Rule.from_settings`); ``unit`` and ``source`` as
        for the constructor."""
        spec = LOSS_SWING_SPEC
        rule = cls(
            spec.value(thresholds), int(spec.value(thresholds, "patience")), spec.value(thresholds, "min_delta"),
            unit=unit, source=source,
        )
        rule.z = spec.value(thresholds, "z")
        rule.lr_ratio = spec.value(thresholds, "lr_ratio")
        return rule

    def pooled_step_variance(self) -> tuple[float, float]:
        """The step variance of a point without its own spread, with its degrees of freedom: the median of the
        recent points' own step variances (the fewest steps among them, less one), else half the mean squared
        successive difference of the recent points scaled by their steps (one per difference); ``inf`` (no change
        significant) with neither."""
        own = [(float(v), float(n or 1.0)) for _, n, v in self.recent if v is not None]
        if own:
            return statistics.median(v for v, _ in own), min(n for _, n in own) - 1.0
        pairs = [
            (float(b[0] or 0.0) - float(a[0] or 0.0)) ** 2 / (1.0 / float(a[1] or 1.0) + 1.0 / float(b[1] or 1.0))
            for a, b in itertools.pairwise(self.recent)
        ]
        if len(pairs) < _POOL_MIN_PAIRS:
            return math.inf, 1.0
        return sum(pairs) / len(pairs), float(len(pairs))

    def pooled_val_variance(self) -> tuple[float, float]:
        """The squared standard error of a validation value, pooled over the newest runs until they hold
        :data:`_VAL_POOL_DF` degrees of freedom (at most :data:`_POOL_POINTS` runs), weighted by them: with a few
        training steps between two runs (one-batch or 4-step epochs), one run's estimate of the noise is too
        uncertain to judge a change by. ``(inf, 1)`` when none is known."""
        total, weighted = 0.0, 0.0
        for variance, df in reversed(self.val_noise):
            if math.isinf(df):
                return (variance, df) if total == 0 else (weighted / total, total)
            total, weighted = total + df, weighted + df * variance
            if total >= _VAL_POOL_DF:
                break
        return (weighted / total, total) if total > 0 else (math.inf, 1.0)

    def scheduled(self, change: float, lr: float | None, previous: float | None = math.nan) -> bool:
        """Whether a change moves with the learning rate by a factor of at most ``lr_ratio`` (the schedule), from
        ``previous`` (the previous point's rate when left out)."""
        before = self.previous_lr if previous is not None and math.isnan(previous) else previous
        if lr is None or before is None or not (lr > 0 and before > 0):
            return False
        factor = lr / before
        if max(factor, 1.0 / factor) < 1.0 + _LR_MOVES:
            return False  # the rate did not move
        return (factor > 1.0) == (change > 0) and max(factor, 1.0 / factor) <= self.lr_ratio

    def resized(self, count: float) -> bool:
        """Whether the newest point (``count`` step losses) is a mean over a larger training set than the point
        before: more than :data:`_DATA_CHANGE` times its steps (a curriculum that adds examples), so the two means
        are not of one training set and their change is the data's (a level shift), not a swing. Fewer steps are
        not: an epoch cut short (a stop, non-finite losses left out) is still the same data, and its change is
        judged. Called after the point joined ``recent``."""
        if len(self.recent) < 2:
            return False
        return count > _DATA_CHANGE * float(self.recent[-2][1] or 1.0)

    def lr_jump(self, lr: float | None, previous: float | None = math.nan) -> bool:
        """Whether the learning rate changed by more than ``lr_ratio`` since ``previous`` (the previous point's rate
        when left out): no schedule's step, so a change of the loss with it is the rate's doing, not chance (judged
        against half of ``z``)."""
        before = self.previous_lr if previous is not None and math.isnan(previous) else previous
        if lr is None or before is None or not (lr > 0 and before > 0):
            return False
        return max(lr / before, before / lr) > self.lr_ratio

    def judge(self, ctx: StepContext, m: Measures) -> list[Alert]:
        """Judge the next training loss point (``m.loss_window``, :meth:`judge_window`) and/or the next validation
        loss (``m.validation``, :meth:`judge_validation`); return the alerts raised."""
        alerts = self.judge_window(ctx, m.loss_window) if m.loss_window is not None else []
        if m.validation is not None:
            alerts += self.judge_validation(ctx, m.validation)
        return alerts

    def judge_window(self, ctx: StepContext, window: LossWindow) -> list[Alert]:
        """The training view: judge the next loss point; return the alerts it raises.

        Its parts: ``mean``, the point (mean step loss of the epoch or window); ``steps``, the step losses it is
        the mean of; ``variance``, their sample variance (``None`` or ``nan``: unknown, or one step: pooled);
        ``lr``, the point's learning rate (``None`` or ``nan``: unknown, no change is a schedule). ``ctx`` is where
        it closed.
        """
        value, steps, variance, lr = window.mean, window.steps, window.variance, window.lr
        if not math.isfinite(value):
            return []  # non-finite losses are AnomalyAlarm's nonfinite_loss, not a trend
        count = max(float(steps), 1.0) if math.isfinite(steps) else 1.0
        own = float(variance) if variance is not None and count >= 2 and math.isfinite(variance) else None
        self.recent = [*self.recent[-(_POOL_POINTS - 1) :], [float(value), count, own]]
        step_variance, df = (own, count - 1.0) if own is not None else self.pooled_step_variance()
        noise = [step_variance / count, df]
        lr = float(lr) if lr is not None and math.isfinite(lr) else None
        self.history = [*self.history[-(self.patience) :], value]
        if self.previous is None:
            self.previous, self.previous_noise, self.previous_lr = value, noise, lr
            return []
        change = relative_change(self.previous, value)
        delta = abs(value - self.previous)
        single = own is None and len(self.recent) >= 2 and self.recent[-2][2] is None
        if single:
            # two points without their own spread: one yardstick for both, the run's pooled noise as it stands now
            # (this change in it), with that estimate's degrees of freedom
            spread = math.sqrt(step_variance / float(self.recent[-2][1] or 1.0) + step_variance / count)
            self.last_t = normal_deviate(delta / spread, df) if spread > 0 else math.inf
        else:
            self.last_t = welch_z(delta, self.previous_noise, noise)
        large = math.isfinite(change) and abs(change) > self.threshold and delta > self.min_delta
        bound = self.z / 2.0 if self.lr_jump(lr) else self.z
        significant = large and self.last_t > bound
        excused = self.scheduled(change, lr) or self.resized(count)
        swing = significant and not excused
        # one-step points are single samples: two outlying batches in a row rise, rise and fall back; only an
        # up-and-down of the loss swings there (a rise counts after a fall, not after a swinging rise)
        turns = not (single and self.previous_rise)
        rise = swing and change > 0 and turns
        reversal = swing and change < 0 and self.previous_rise
        counts = (
            math.isfinite(change) and ((change > 0 and turns) or (change < 0 and self.previous_rise)) and not excused
        )
        near = min(abs(change) / self.threshold, self.last_t / bound) if counts and math.isfinite(self.last_t) else 0.0
        self.excesses = [*self.excesses[-(self.patience - 1) :], near]
        if len(self.excesses) >= self.patience:
            self.observe(min(self.excesses), 1.0)
        self.streak = self.streak + 1 if (rise or reversal) else 0
        self.previous_rise = rise
        self.previous, self.previous_noise, self.previous_lr = value, noise, lr
        self.last_change = change
        active = self.streak >= self.patience
        if not self.latch.update(self.source, active):
            return []
        points = ", ".join(f"{v:.4g}" for v in self.history)
        return [
            self._alert(
                ctx,
                f"training loss swung by more than {self.threshold:.0%} on {self.streak} consecutive "
                f"{self.unit}s (last change {_pct(change)}, {self.last_t:.1f} standard errors of the step losses' "
                f"noise; recent values {points}): the learning rate may be too high or the data order unstable",
                source=self.source,
                value=change,
                threshold=self.threshold,
            )
        ]

    def judge_validation(self, ctx: StepContext, run: Validation) -> list[Alert]:
        """The validation view: judge the next validation loss (the same samples at every run); return the alerts it
        raises.

        The change between two consecutive runs swings when it is above ``threshold`` (relative) and
        ``min_delta``, more than ``z`` standard errors of the difference (``sqrt(se[k-1]^2 + se[k]^2)``, each
        pooled over the recent runs by :meth:`pooled_val_variance`, Welch's degrees of freedom; ``z / 2`` after a
        rate jump of more than ``lr_ratio``), not the schedule, and a rise to above the loss's scale (``baseline``:
        the initial training loss, the untrained model's; else the first validation value) or a fall that reverses
        a swinging rise. The rule fires when ``patience`` consecutive changes swing **and at least one of them is a
        fall**: an oscillation. A validation loss that only climbs is ``val_decline``'s, not a swing.

        ``run``'s parts read: ``value``; ``noise_se``, its standard error (else ``se``; ``None`` or ``nan``:
        unknown, no change is significant) with ``df`` degrees of freedom (``inf``: known exactly, not pooled with
        earlier runs); ``lr`` (``None`` or ``nan``: unknown); ``baseline`` (``None``: the first validation value is
        the scale); ``metric``, the alert's source.
        """
        value, df, lr, scale, source = run.value, run.df, run.lr, run.baseline, run.metric
        se = run.noise_se if run.noise_se is not None else run.se
        if not math.isfinite(value):
            return []
        if se is not None and math.isfinite(se):
            self.val_noise = [*self.val_noise[-(_POOL_POINTS - 1) :], [float(se) ** 2, max(float(df), 1.0)]]
        variance, pooled_df = self.pooled_val_variance() if se is not None and math.isfinite(se) else (math.inf, 1.0)
        rate = float(lr) if lr is not None and math.isfinite(lr) else math.nan
        previous, self.val_previous = self.val_previous, [float(value), variance, pooled_df, rate]
        if self.val_first is None:
            self.val_first = float(value)
        level = abs(float(scale)) if scale is not None and math.isfinite(scale) and scale != 0 else abs(self.val_first)
        self.val_history = [*self.val_history[-self.patience :], float(value)]
        if previous is None:
            return []
        before, before_variance, before_df, before_rate = previous
        change = relative_change(before, value)
        delta = abs(value - before)
        prior = None if math.isnan(before_rate) else before_rate
        now = None if math.isnan(rate) else rate
        self.val_last_z = welch_z(delta, [before_variance, before_df], [variance, pooled_df])
        bound = self.z / 2.0 if self.lr_jump(now, prior) else self.z
        large = math.isfinite(change) and abs(change) > self.threshold and delta > self.min_delta
        excused = self.scheduled(change, now, prior)
        # a rise counts; a fall counts after a rise (for the margin), and swings after a swinging rise. A rise swings
        # only to above the loss's scale, the untrained model's loss: a model that learns jumps below it (a small
        # batch's steps, a spike after convergence); one driven past it at every other run oscillates
        counts = math.isfinite(change) and (change > 0 or self.val_rise > 0) and not excused
        height = value / level if change > 0 and level > 0 else math.inf
        swing = counts and large and self.val_last_z > bound and (height > 1.0 if change > 0 else self.val_rise > 1)
        judged = counts and not math.isnan(self.val_last_z)
        near = min(abs(change) / self.threshold, self.val_last_z / bound, height) if judged else 0.0
        fall = change < 0
        self.val_excesses = [*self.val_excesses[-(self.patience - 1) :], [near if math.isfinite(near) else 0.0,
                                                                          float(fall and counts)]]
        if len(self.val_excesses) >= self.patience:  # an oscillation needs a fall among them
            fell = any(f for _, f in self.val_excesses)
            self.observe(min(x for x, _ in self.val_excesses) if fell else 0.0, 1.0)
        streak, falls = self.val_streak
        self.val_streak = [streak + 1, falls + int(fall)] if swing else [0, 0]
        self.val_rise = (2 if swing else 1) if counts and change > 0 else 0
        active = self.val_streak[0] >= self.patience and self.val_streak[1] > 0
        if not self.latch.update(source, active):
            return []
        values = ", ".join(f"{v:.4g}" for v in self.val_history)
        return [
            self._alert(
                ctx,
                f"validation loss `{source}` swung up and down by more than {self.threshold:.0%} on "
                f"{self.val_streak[0]} consecutive validation runs (last change {_pct(change)}, "
                f"{self.val_last_z:.1f} standard errors; recent values {values}): the model jumps between "
                "validations, the learning rate may be too high for the batch size (momentum, batch size 1)",
                source=source,
                value=change,
                threshold=self.threshold,
            )
        ]


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
        patience: Consecutive worsening runs before the rule fires.
        min_delta: Change that counts as worse.

    Example:
        >>> from lightning_diag.rules.measures import Validation
        >>> rule = ValDeclineRule(patience=2)
        >>> ms = [Measures(validation=Validation(v)) for v in (1.0, 1.1, 1.2, 1.3)]
        >>> [len(rule.judge(StepContext(i, 10 * i), m)) for i, m in enumerate(ms)]
        [0, 0, 1, 0]
    """

    needs = frozenset({Measure.VALIDATION})
    specs = (VAL_DECLINE_SPEC,)
    state_keys = ("previous", "streak", "history", "streak_start", "train_start", "start", "previous_se")

    def __init__(
        self,
        monitor: str = "val_loss",
        mode: Literal["min", "max"] = "min",
        patience: int = DEFAULT_VAL_DECLINE_THRESHOLD,
        min_delta: float = DEFAULT_VAL_DECLINE_MIN_DELTA,
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
        self.min_steps = DEFAULT_VAL_DECLINE_MIN_STEPS
        #: The global step of the run the current streak worsens from.
        self.streak_start = 0
        #: The mean training loss before that run (``None``: not known).
        self.train_start: float | None = None
        #: ``[value, standard error or None]`` of the run the current streak worsens from.
        self.start: list[float | None] = []
        #: The standard error of the previous value (``None``: unknown).
        self.previous_se: float | None = None
        #: Standard errors the streak's worsening must exceed (``val_decline.z``).
        self.z = DEFAULT_VAL_DECLINE_Z
        #: The last streak's worsening over its standard error (``nan``: unknown).
        self.last_z = math.nan

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output; a checkpoint from before ``min_steps`` loads with the streak
        starting at step 0."""
        super().load_state_dict({"streak_start": 0, "train_start": None, "start": [], "previous_se": None, **state})

    @classmethod
    def from_settings(
        cls, thresholds: Mapping[str, float | None], *, monitor: str = "val_loss", mode: Literal["min", "max"] = "min"
    ) -> ValDeclineRule:
        """The rule with the thresholds in effect (see :meth:`Rule.from_settings`); ``monitor`` and ``mode`` as
        for the constructor."""
        spec = VAL_DECLINE_SPEC
        rule = cls(monitor, mode, int(spec.value(thresholds)), spec.value(thresholds, "min_delta"))
        rule.min_steps = int(spec.value(thresholds, "min_steps"))
        rule.z = spec.value(thresholds, "z")
        return rule

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


def repeated_rises(steps_up: list[float]) -> int:
    """How many of a window's rises count for ``val_fluctuation``: those at least a quarter of its largest rise.

    Example:
        >>> repeated_rises([0.5, 0.6]), repeated_rises([0.07]), repeated_rises([0.6, 0.01]), repeated_rises([])
        (2, 1, 1, 0)
    """
    if not steps_up:
        return 0
    largest = max(steps_up)
    return sum(1 for rise in steps_up if rise >= 0.25 * largest)


def noise_fluctuation(values: list[float], ses: list[float]) -> float:
    """The fluctuation (:func:`~lightning_diag.stats.trend.fluctuation`) that independent sampling errors alone
    leave in ``values`` around their fit: ``sqrt(mean((se / value)^2) (n - p) / n)`` in log units for positive
    values (``mean(se^2) (n - p) / n`` over the mean absolute level otherwise), ``p`` the fit's coefficients (2
    below 5 values, 3 from 5 on). ``nan`` when a standard error is unknown.

    Example:
        >>> round(noise_fluctuation([1.0, 1.0, 1.0, 1.0, 1.0], [0.1] * 5), 4)
        0.0632
    """
    n = len(values)
    if n < 3 or len(ses) != n or not all(math.isfinite(e) for e in ses):
        return math.nan
    kept = (n - (2 if n < 5 else 3)) / n
    if all(v > 0 for v in values):
        return math.sqrt(sum((e / v) ** 2 for e, v in zip(ses, values, strict=True)) / n * kept)
    level = sum(abs(v) for v in values) / n
    return math.sqrt(sum(e * e for e in ses) / n * kept) / level if level > 0 else math.nan


class ValFluctuationRule(Rule):
    """``val_fluctuation``: validation-loss fluctuation above ``ratio`` times the training-loss fluctuation.

    Args:
        ratio: Multiple of the training fluctuation the validation fluctuation must exceed.
        window: Validation runs in the window (at least 3).
        min_fluctuation: Validation fluctuation (relative to its level) below which the rule never fires.
        min_range: Range (max - min) of the validation window below which the rule never fires.
        monitor: Name of the validation metric, for messages and the alert's ``source``.
        min_rise: The window's rises (sum of increases between consecutive runs), as a fraction of the first
            validation value, below which the rule never fires.

    The validation fluctuation judged is the part the validation set's own sampling noise does not explain: with
    ``se`` (each run's standard error, :meth:`update`) known, the residual mean square of the fit, in log units,
    less what independent errors of relative size ``se / value`` leave in it (their mean square over the window
    times ``(n - p) / n`` for ``n`` runs and a fit of ``p`` coefficients), floored at 0, under the square root
    (:func:`noise_fluctuation`). A validation set of two batches wanders by its standard error from run to run: that
    is the set's noise, not a model that fluctuates.

    Example:
        >>> from lightning_diag.rules.measures import Validation
        >>> rule = ValFluctuationRule()
        >>> train = [1.29, 0.52, 0.19, 0.10, 0.079, 0.041]  # a converged fine-tune (corpus BERT at lr 2e-3)
        >>> val = [0.964, 0.237, 0.097, 0.167, 0.024, 0.025]
        >>> ms = [Measures(validation=Validation(v, train=t)) for t, v in zip(train, val)]
        >>> [len(rule.judge(StepContext(i, 10 * i), m)) for i, m in enumerate(ms)]
        [0, 0, 0, 0, 0, 0]
        >>> round(rule.last_rise, 3)
        0.073
    """

    needs = frozenset({Measure.VALIDATION})
    specs = (VAL_FLUCTUATION_SPEC,)
    state_keys = ("train", "val", "last_ratio", "scale", "steps", "ses")

    def __init__(
        self,
        ratio: float = DEFAULT_VAL_FLUCTUATION_THRESHOLD,
        window: int = DEFAULT_VAL_FLUCTUATION_WINDOW,
        min_fluctuation: float = DEFAULT_VAL_FLUCTUATION_MIN,
        monitor: str = "val_loss",
        min_range: float = DEFAULT_VAL_FLUCTUATION_MIN_RANGE,
        min_rise: float = DEFAULT_VAL_FLUCTUATION_MIN_RISE,
    ) -> None:
        super().__init__()
        self.latch = Latch(clear_after=2)  # one calm validation run between two fluctuating ones: one event
        self.min_range = min_range
        self.min_rise = min_rise
        self.scale: float | None = None
        self.last_rise = math.nan
        self.last_rises = 0
        self.ratio = ratio
        self.window = window
        self.min_fluctuation = min_fluctuation
        self.monitor = monitor
        self.train: list[float] = []
        self.val: list[float] = []
        #: The global step of each run of ``train`` / ``val`` (the runs kept: the window and those before it that
        #: ``min_steps`` needs).
        self.steps: list[int] = []
        #: The standard error of each run of ``val`` (``nan``: unknown).
        self.ses: list[float] = []
        #: The validation fluctuation the window's standard errors explain (``nan``: unknown, judged as 0).
        self.last_noise = math.nan
        #: Optimizer steps the window must span (``val_fluctuation.min_steps``): with short epochs the window
        #: takes in earlier runs until it does.
        self.min_steps = DEFAULT_VAL_FLUCTUATION_MIN_STEPS
        self.last_ratio = math.nan

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output; a checkpoint from before ``min_steps`` loads with its runs' steps
        unknown (read as far apart)."""
        runs = len(state.get("val", []))
        super().load_state_dict(
            {"steps": [-self.min_steps * (runs - i) for i in range(runs)], "ses": [math.nan] * runs, **state}
        )

    def window_runs(self) -> int:
        """Runs in the judged window, which ends at the run before the newest (whose following training period is
        only now known): the last ``window`` of them, and earlier ones until it spans ``min_steps`` steps."""
        judged = len(self.val) - 1
        count = min(self.window, max(judged, 0))
        while count < judged and self.steps[-2] - self.steps[-1 - count] < self.min_steps:
            count += 1
        return count

    @classmethod
    def from_settings(cls, thresholds: Mapping[str, float | None], *, monitor: str = "val_loss") -> ValFluctuationRule:
        """The rule with the thresholds in effect (see :meth:`Rule.from_settings`); ``monitor`` as for the
        constructor."""
        spec = VAL_FLUCTUATION_SPEC
        rule = cls(
            spec.value(thresholds), int(spec.value(thresholds, "window")), spec.value(thresholds, "min"),
            monitor=monitor, min_range=spec.value(thresholds, "min_range"), min_rise=spec.value(thresholds, "min_rise"),
        )
        rule.min_steps = int(spec.value(thresholds, "min_steps"))
        return rule

    def measures(self) -> tuple[float, float]:
        """``(train_fluctuation, val_fluctuation)`` over the judged window (``nan`` until it is full: ``window``
        runs spanning ``min_steps`` steps, and the run after them).

        The training fluctuation is the larger of the training loss's over the periods that end at the window's
        validation runs and over those that start at them: a validation run is a snapshot of the model between
        the two, and with short epochs the model moves a lot within one (a training spike the validation follows
        shows in the period after it)."""
        count = self.window_runs()
        if count < self.window or self.steps[-2] - self.steps[-1 - count] < self.min_steps:
            return math.nan, math.nan
        before, after = self.train[-1 - count : -1], self.train[-count:]
        finite = [f for f in (fluctuation(before), fluctuation(after)) if math.isfinite(f)]
        return max(finite) if finite else math.nan, fluctuation(self.val[-1 - count : -1])

    def judge(self, ctx: StepContext, m: Measures) -> list[Alert]:
        """Judge the mean training loss since the last validation run and the validation value (with its standard
        error when known: ``noise_se``, else ``se``, the spread of its batches' values)."""
        assert m.validation is not None  # checked against `needs`
        v = m.validation
        train_loss = math.nan if v.train is None else v.train
        val_loss, se = v.value, v.se if v.noise_se is None else v.noise_se
        if not (math.isfinite(train_loss) and math.isfinite(val_loss)):
            return []
        if self.scale is None:
            self.scale = abs(float(val_loss))  # the validation loss at the start of training
        keep = max(self.window, _VAL_RUNS_KEPT) + 1  # the judged window, and the run after it
        self.train = list(deque([*self.train, train_loss], maxlen=keep))
        self.val = list(deque([*self.val, val_loss], maxlen=keep))
        self.steps = list(deque([*self.steps, ctx.global_step], maxlen=keep))
        error = float(se) if se is not None and math.isfinite(se) and se >= 0 else math.nan
        self.ses = list(deque([*self.ses, error], maxlen=keep))
        train_f, raw_f = self.measures()
        if not (math.isfinite(train_f) and math.isfinite(raw_f)):
            return []
        count = self.window_runs()
        window = self.val[-1 - count : -1]
        self.last_noise = noise_fluctuation(window, self.ses[-1 - count : -1])
        noise = self.last_noise if math.isfinite(self.last_noise) else 0.0
        val_f = math.sqrt(max(raw_f * raw_f - noise * noise, 0.0))  # the part the validation set's noise leaves
        self.last_ratio = val_f / train_f if train_f > 0 else math.inf
        val_abs = max(window) - min(window)
        steps_up = [b - a for a, b in itertools.pairwise(window) if b > a]
        self.last_rise = sum(steps_up) / self.scale if self.scale > 0 else math.inf
        self.last_rises = repeated_rises(steps_up)
        rises_needed = min(2, len(window) // 2)
        # the other conditions; the margin is the ratio's excess where they hold (0 where one does not)
        gates = (
            val_f > self.min_fluctuation
            and val_abs > self.min_range
            and self.last_rise > self.min_rise
            and self.last_rises >= rises_needed
        )
        self.observe(excess(self.last_ratio, self.ratio) if gates else 0.0, 1.0)
        active = gates and val_f > self.ratio * train_f
        if not self.latch.update(self.monitor, active, excess(self.last_ratio, self.ratio)):
            return []
        return [
            self._alert(
                ctx,
                f"`{self.monitor}` fluctuates {val_f:.1%} around its trend over the last {len(window)} "
                f"validation runs, more than {self.ratio:g}x the training loss ({train_f:.1%}), rising by "
                f"{self.last_rise:.0%} of its initial {self.scale:.4g} over the window: the validation set may be "
                "too small or unrepresentative, or the model unstable",
                source=self.monitor,
                value=self.last_ratio if math.isfinite(self.last_ratio) else val_f,
                threshold=self.ratio,
            )
        ]


class LossStagnantRule(Rule):
    """``loss_stagnant``: the training loss does not move against its own noise and is not below its initial level.

    **Evidence.** The rule may fire once it has ``patience`` points (epoch or window means), at least as many as
    the trend test needs to be able to find a trend at all (5 at ``alpha`` 0.05,
    :func:`~lightning_diag.stats.trend.mann_kendall_min_points`), **and** the run has had ``min_steps``
    optimizer steps (read from the ``StepContext``): one-batch epochs give points quickly, not evidence.

    **Verdict.** The Mann-Kendall test of the points so far (:func:`~lightning_diag.stats.trend.mann_kendall`)
    says whether the loss moves against its own noise; the move counts when it is significant at ``alpha`` and
    its Theil-Sen size over the points is at least ``min_trend`` of their level. Then:

    * a loss that **rises** moves by a schedule (a KL weight warming up): not stagnant, the rule is settled;
    * a loss that **falls** is learning, whatever its floor (a VAE's ELBO falling 8% in 300 steps): settled, unless
      it is still above ``(1 - min_drop)`` times the initial loss *and* the validation value
      (:meth:`observe_validation`) has not improved by ``min_trend`` on its first run: a training loss that
      creeps down while validation does not is memorising, not learning (shuffled labels);
    * a loss that does **not move** and is not ``min_drop`` below its initial value is stagnant.

    No verdict (settled or stagnant) is taken before the evidence is there: a chance "trend" among a few noisy
    points settles nothing. Before ``min_steps`` only the memorising verdict is taken, once the validation value
    has been noted (:meth:`observe_validation`) on as many runs as the trend test needs points. A positive initial
    loss is needed; with zero or negative losses the rule stays quiet.
    It clears when the loss moves or falls below the level. The points cover the whole run: beyond 256, pairs are
    averaged.

    Args:
        min_drop: Fraction of the initial loss below which the loss is never stagnant (0.1: 10% below).
        patience: Loss points (epochs or windows) before the rule can fire.
        unit: What one point is, for messages.
        source: The alert's ``source``.

    Attributes:
        min_steps: Optimizer steps before the rule can fire (``loss_stagnant.min_steps``).
        alpha: Significance level of the trend test (``loss_stagnant.alpha``).
        min_trend: The least movement that counts, relative to the level (``loss_stagnant.min_trend``, 2%): for
            the training trend (Theil-Sen size over the points) and the validation improvement alike.

    Example:
        >>> from lightning_diag.rules.measures import LossWindow
        >>> rule = LossStagnantRule(patience=2)
        >>> rule.set_baseline(1.39)
        >>> losses = [1.38, 1.39, 1.37, 1.38, 1.37, 0.9]
        >>> [len(rule.judge(StepContext(e, 20 * e), Measures(loss_window=LossWindow(v)))) for e, v in enumerate(losses)]
        [0, 0, 0, 0, 1, 0]
    """

    needs = frozenset({Measure.LOSS_WINDOW})
    specs = (LOSS_STAGNANT_SPEC,)
    state_keys = ("baseline", "points", "best", "history", "settled", "validation")

    def __init__(
        self,
        min_drop: float = DEFAULT_STAGNANT_THRESHOLD,
        patience: int = DEFAULT_STAGNANT_PATIENCE,
        unit: str = "epoch",
        source: str = "train_loss",
    ) -> None:
        super().__init__()
        self.min_drop = min_drop
        self.patience = patience
        self.unit = unit
        self.source = source
        self.min_steps = DEFAULT_STAGNANT_MIN_STEPS
        self.alpha = DEFAULT_STAGNANT_ALPHA
        self.min_trend = DEFAULT_STAGNANT_MIN_TREND
        self.baseline: float | None = None
        self.points = 0
        self.best = math.inf
        self.history: list[float] = []
        self.settled = False
        #: ``[first, best, runs]``: the first and best validation values, oriented so that lower is better, and
        #: how many were noted (empty before the first run; a checkpoint's ``[first, best]`` counts as 2 runs).
        self.validation: list[float] = []
        self.last_p = math.nan
        self.last_trend = math.nan
        self.level = math.nan

    @classmethod
    def from_settings(
        cls, thresholds: Mapping[str, float | None], *, unit: str = "epoch", source: str = "train_loss"
    ) -> LossStagnantRule:
        """The rule with the thresholds in effect (see :meth:`Rule.from_settings`); ``unit`` and ``source`` as
        for the constructor. ``loss_stagnant.baseline_steps`` is the owner's (it averages the first losses)."""
        spec = LOSS_STAGNANT_SPEC
        rule = cls(spec.value(thresholds), int(spec.value(thresholds, "patience")), unit=unit, source=source)
        rule.min_steps = int(spec.value(thresholds, "min_steps"))
        rule.alpha = spec.value(thresholds, "alpha")
        rule.min_trend = spec.value(thresholds, "min_trend")
        return rule

    def set_baseline(self, initial_loss: float) -> None:
        """Set the initial loss once (later calls, and non-finite values, are ignored)."""
        if self.baseline is None and math.isfinite(initial_loss):
            self.baseline = float(initial_loss)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output; a checkpoint from before the trend test loads with no history."""
        super().load_state_dict({"history": [], "settled": False, "validation": [], **state})

    def observe_validation(self, value: float, mode: Literal["min", "max"] = "min") -> None:
        """Note a validation value (``mode="max"``: higher is better), for telling learning from memorising."""
        if not math.isfinite(value):
            return
        oriented = value if mode == "min" else -value
        first, best, runs = [*self.validation, 2.0][:3] if self.validation else (oriented, oriented, 0.0)
        self.validation = [first, min(best, oriented), runs + 1.0]

    def validation_improved(self) -> bool | None:
        """Whether the best validation value is ``min_trend`` (of its first value) better than the first;
        ``None`` before two runs."""
        if len(self.validation) < 2:
            return None
        first, best = self.validation[:2]
        return first - best > self.min_trend * abs(first)

    def validation_runs(self) -> int:
        """The validation values noted so far (:meth:`observe_validation`)."""
        return int(self.validation[2]) if len(self.validation) > 2 else len(self.validation)

    def judge(self, ctx: StepContext, m: Measures) -> list[Alert]:
        """Judge the next loss point (the window's mean); return the alerts it raises."""
        assert m.loss_window is not None  # checked against `needs`
        value = m.loss_window.mean
        if not math.isfinite(value):
            return []
        self.points += 1
        self.best = min(self.best, value)
        self.history = [*self.history, value]
        if len(self.history) > _TREND_POINTS:  # halve the resolution, keep the whole run (its start matters)
            pairs = self.history[: len(self.history) // 2 * 2]
            self.history = [(a + b) / 2 for a, b in zip(pairs[::2], pairs[1::2], strict=True)] + self.history[
                len(pairs) :
            ]
        if self.baseline is None or self.baseline <= 0:
            return []
        needed = max(self.patience, mann_kendall_min_points(self.alpha))  # "no trend" only where one could show
        if len(self.history) < needed:
            return []  # no verdict either way without the evidence (a chance "trend" in 5 noisy points settles nothing)
        _, self.last_p = mann_kendall(self.history)
        slope = theil_sen_slope(self.history)
        mean = sum(abs(v) for v in self.history) / len(self.history)
        self.last_trend = slope * (len(self.history) - 1) / mean if mean > 0 else 0.0
        # where the loss is now: the Theil-Sen line at the last point (the best point of one-batch epochs is one
        # lucky batch, not a level)
        self.level = statistics.median(v - slope * i for i, v in enumerate(self.history)) + slope * (
            len(self.history) - 1
        )
        limit = (1.0 - self.min_drop) * self.baseline
        above = self.level > limit
        moves = self.last_p < self.alpha and abs(self.last_trend) >= self.min_trend
        memorising = moves and self.last_trend < 0 and above and self.validation_improved() is False
        if ctx.global_step < self.min_steps and not (memorising and self.validation_runs() >= needed):
            # a flat loss, or a trend that settles it, is judged once the model had min_steps to learn; before, only
            # a memorising loss is, once validation has not improved over as many runs as the trend has points
            return []
        if moves and not memorising:
            self.settled = True  # the loss moves with the parameters: learning, or a schedule; not stagnation
        if not above:
            self.settled = True  # the level is well below the initial loss: it learned
        active = not self.settled and above
        if not self.latch.update(self.source, active):
            return []
        drop = 1.0 - self.level / self.baseline
        if memorising:
            verdict = (
                f"falls only {-self.last_trend:.1%} over them while the validation value has not improved on its "
                "first run: the model memorises the training set without learning"
            )
        else:
            verdict = f"is flat (no trend against its noise: Mann-Kendall p={self.last_p:.2f})"
        return [
            self._alert(
                ctx,
                f"after {self.points} {self.unit}s ({ctx.global_step} steps) the training loss {verdict}, and is "
                f"at {self.level:.4g}, only {drop:.1%} below its initial {self.baseline:.4g}: the model "
                "is not learning; check that targets match their inputs (shuffling, label mapping), the loss, and "
                "that the optimizer updates the parameters",
                source=self.source,
                value=drop,
                threshold=self.min_drop,
            )
        ]
