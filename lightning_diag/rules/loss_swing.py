"""``loss_swing`` (framework-free): the training loss (and the validation loss) swings, fed by
:class:`~lightning_diag.AnomalyAlarm`.

Exact definition (also in ``docs/anomaly_alarm.md``):

For consecutive loss points ``L[k-1], L[k]`` (epoch means, or means over windows of steps),
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
"""

from __future__ import annotations

import itertools
import math
import statistics

from lightning_diag.core.record import Alert
from lightning_diag.core.registry import COUNT, POSITIVE, CheckSpec, Limit, RuleSpec, default, register
from lightning_diag.core.tags import loss_tag
from lightning_diag.rules.base import Latch, Rule, StepContext
from lightning_diag.rules.loss_stagnant import STAGNANT_BASELINE_STEPS_KEY
from lightning_diag.rules.measures import LossWindow, Measure, Measures, Validation
from lightning_diag.rules.rows import Check, LoggedRun, Series, finite_values, fmt, measure, replay, run_threshold
from lightning_diag.stats.trend import relative_change

__all__ = [
    "DEFAULT_SWING_LR_RATIO",
    "DEFAULT_SWING_MIN_DELTA",
    "DEFAULT_SWING_PATIENCE",
    "DEFAULT_SWING_THRESHOLD",
    "DEFAULT_SWING_Z",
    "LOSS_SWING",
    "LOSS_SWING_CHECK",
    "LOSS_SWING_PATIENCE_KEY",
    "LOSS_SWING_SPEC",
    "LOSS_SWING_WINDOW_STEPS_KEY",
    "LossSwingRule",
    "normal_deviate",
    "welch_z",
]

_ALARM = "AnomalyAlarm"
LOSS_SWING_SPEC = register(RuleSpec(
    "loss_swing", _ALARM, "warning", 0.10,
    "training loss swings by more than {threshold:.0%} on {patience:g} consecutive epochs",
    settings={"patience": 3, "min_delta": 1e-3, "z": 2.0, "lr_ratio": 10.0}, check="loss_swing",
    source="seed 001 §1.2",
    limits={"threshold": POSITIVE, "patience": COUNT, "z": POSITIVE, "lr_ratio": Limit(low=1.0, low_inclusive=True)},
))
LOSS_SWING = LOSS_SWING_SPEC.rule_id
#: Its row of the ``lightning-diag report`` checklist (registered in report order by
#: :mod:`lightning_diag.rules.catalog`).
LOSS_SWING_CHECK = CheckSpec(
    LOSS_SWING, "Training",
    "Training loss does not swing by more than {loss_swing:.0%} on {loss_swing__patience:g} consecutive points",
)
#: ``thresholds()`` key the report reads back from a run.
LOSS_SWING_PATIENCE_KEY = LOSS_SWING_SPEC.key("patience")
#: Key AnomalyAlarm writes beside the settings (not a setting: how it was configured): the swing window in steps
#: when ``swing_window`` is an int.
LOSS_SWING_WINDOW_STEPS_KEY = f"{LOSS_SWING}.window_steps"

#: ``loss_swing``: relative change that counts as a swing (seed 001 §1.2: 10%).
DEFAULT_SWING_THRESHOLD = default(LOSS_SWING)
#: ``loss_swing``: consecutive swinging epochs (or windows) before the rule fires (seed 001 §1.2: 3).
DEFAULT_SWING_PATIENCE = int(default(LOSS_SWING_PATIENCE_KEY))
#: ``loss_swing``: absolute change below which a point never swings (keeps near-zero losses quiet).
DEFAULT_SWING_MIN_DELTA = default(LOSS_SWING_SPEC.key("min_delta"))
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
        source: The alert's ``source``.
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
        z: float = DEFAULT_SWING_Z,
        lr_ratio: float = DEFAULT_SWING_LR_RATIO,
    ) -> None:
        super().__init__()
        self.threshold = threshold
        self.patience = patience
        self.latch = Latch.for_patience(patience)
        self.min_delta = min_delta
        self.unit = unit
        self.source = source
        self.z = z
        self.lr_ratio = lr_ratio
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
        loss (``m.validation``, where it is a loss: :meth:`judge_validation`); return the alerts raised."""
        alerts = self.judge_window(ctx, m.loss_window) if m.loss_window is not None else []
        if m.validation is not None and m.validation.is_loss:
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


# -- the report's loss_swing row -------------------------------------------------------------------------------


@measure(LOSS_SWING)
def _measure_loss_swing(run: LoggedRun, check: Check) -> bool:
    threshold = run_threshold(run, LOSS_SWING)
    patience = run_threshold(run, LOSS_SWING_PATIENCE_KEY)
    check.threshold = (
        f"rise > {fmt(threshold * 100)}% on {int(patience) if patience else '?'} consecutive points"
        if threshold is not None
        else "not logged"
    )
    check.threshold_value = {"value": threshold} if threshold is not None else {}
    if patience:
        check.threshold_value["patience"] = patience
    swings = finite_values(run.scalars.get(loss_tag("swing"), []))
    if swings:
        check.measured = f"relative change of the mean loss {min(swings):+.1%} .. {max(swings):+.1%}"
        check.measured_value = {"max": max(swings), "min": min(swings)}
    elif run.scalars.get(loss_tag("train_epoch")):
        check.add_note("needs at least two epochs (or step windows) of training loss")
    return bool(swings)


def _loss_points(run: LoggedRun) -> Series:
    return run.scalars.get(loss_tag("train_epoch")) or run.scalars.get(loss_tag("train_window")) or []


@replay(LOSS_SWING)
def _replay_loss_swing(run: LoggedRun) -> list[Alert]:
    rule = LossSwingRule.from_settings(run.thresholds)
    alerts: list[Alert] = []
    spread = dict(run.scalars.get(loss_tag("train_spread"), []))
    previous = 0
    for step, v in _loss_points(run):
        sd = spread.get(step)  # the step losses' spread (a run from before it was logged: pooled from the points)
        variance = sd * sd if sd is not None and math.isfinite(sd) else None
        window = LossWindow(v, steps=max(step - previous, 1), variance=variance)
        alerts += rule.judge(StepContext(0, step), Measures(loss_window=window))
        previous = step
    # the validation view, where the run logged the standard errors it judged the validation loss with (a run from
    # before them is replayed on the training points alone, as it was judged)
    se = dict(run.scalars.get(loss_tag("val_se"), []))
    if se:
        monitor = run.mapping.get("val_loss", "val_loss")
        # the scale a rise must end above: the untrained model's loss, from the first logged training losses (the
        # alarm takes the mean of the first steps, of which the logging steps are a sample)
        baseline = int(run_threshold(run, STAGNANT_BASELINE_STEPS_KEY) or 1)
        logged = [v for _, v in run.scalars.get(loss_tag("train_step"), []) if math.isfinite(v)]
        early = [v for step, v in run.scalars.get(loss_tag("train_step"), []) if step < baseline and math.isfinite(v)]
        sample = early or logged[:1]
        scale = sum(sample) / len(sample) if sample else None
        for step, v in run.scalars.get(loss_tag("val"), []):
            judged = Validation(v, noise_se=se.get(step), baseline=scale, metric=monitor)
            alerts += rule.judge(StepContext(0, step), Measures(validation=judged))
    return sorted(alerts, key=lambda a: a.global_step)
