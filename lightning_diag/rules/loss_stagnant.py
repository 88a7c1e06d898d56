"""``loss_stagnant`` (framework-free): the training loss does not fall below its initial level, fed by
:class:`~lightning_diag.AnomalyAlarm`.

Exact definition (also in ``docs/anomaly_alarm.md``):

The *initial loss* is the mean training loss of the first ``baseline_steps`` optimizer steps,
the loss of the untrained model: for a classifier this is the chance level (about ``ln C`` for ``C`` balanced
classes). After ``patience`` loss points (epoch or window means, as for ``loss_swing``), the rule fires while
the best point so far is not below ``(1 - min_drop)`` times the initial loss: the model is not learning (a
label/target bug, inputs and targets out of step, a dead optimizer). It clears when the loss falls below that
level. A positive initial loss is needed; with zero or negative losses the rule stays quiet.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from typing import ClassVar, Literal

from lightning_diag.core.record import Alert
from lightning_diag.core.registry import COUNT, FRACTION, STEPS, Limit, RuleSpec, default, register
from lightning_diag.rules.base import Rule, StepContext
from lightning_diag.rules.measures import Measure, Measures
from lightning_diag.stats.trend import mann_kendall, mann_kendall_min_points, mann_kendall_z_p, theil_sen_slope

__all__ = [
    "DEFAULT_STAGNANT_ALPHA",
    "DEFAULT_STAGNANT_BASELINE_STEPS",
    "DEFAULT_STAGNANT_MIN_STEPS",
    "DEFAULT_STAGNANT_MIN_TREND",
    "DEFAULT_STAGNANT_PATIENCE",
    "DEFAULT_STAGNANT_THRESHOLD",
    "LOSS_STAGNANT",
    "LOSS_STAGNANT_SPEC",
    "STAGNANT_BASELINE_STEPS_KEY",
    "LossStagnantRule",
]

_ALARM = "AnomalyAlarm"
LOSS_STAGNANT_SPEC = register(RuleSpec(
    "loss_stagnant", _ALARM, "warning", 0.10,
    "training loss has not fallen {threshold:.0%} below its initial value after {patience:g} points",
    settings={"patience": 4, "baseline_steps": 5, "min_steps": 50, "alpha": 0.05, "min_trend": 0.02},
    limits={"threshold": Limit(low=0.0, high=1.0, low_inclusive=True, high_inclusive=False), "patience": COUNT,
            "baseline_steps": COUNT, "min_steps": STEPS, "alpha": FRACTION,
            "min_trend": Limit(low=0.0, low_inclusive=True)},
))
LOSS_STAGNANT = LOSS_STAGNANT_SPEC.rule_id
#: ``thresholds()`` key of ``loss_stagnant``'s baseline (read by the loss trend's sums).
STAGNANT_BASELINE_STEPS_KEY = LOSS_STAGNANT_SPEC.key("baseline_steps")

#: ``loss_stagnant``: fraction of the initial loss the training loss must have fallen by.
DEFAULT_STAGNANT_THRESHOLD = default(LOSS_STAGNANT)
#: ``loss_stagnant``: loss points (epochs or windows) the training loss has to get there.
DEFAULT_STAGNANT_PATIENCE = int(default(LOSS_STAGNANT_SPEC.key("patience")))
#: ``loss_stagnant``: first optimizer steps whose mean loss is the initial loss.
DEFAULT_STAGNANT_BASELINE_STEPS = int(default(STAGNANT_BASELINE_STEPS_KEY))
#: ``loss_stagnant``: optimizer steps before a verdict (with at least the trend test's fewest points).
DEFAULT_STAGNANT_MIN_STEPS = int(default(LOSS_STAGNANT_SPEC.key("min_steps")))
#: ``loss_stagnant``: significance level of the Mann-Kendall test that the loss falls.
DEFAULT_STAGNANT_ALPHA = default(LOSS_STAGNANT_SPEC.key("alpha"))
#: ``loss_stagnant``: the Theil-Sen fall over the points, as a fraction of the loss's level, that is progress.
DEFAULT_STAGNANT_MIN_TREND = default(LOSS_STAGNANT_SPEC.key("min_trend"))
#: ``loss_stagnant``: the points its trend test reads, at most (beyond, pairs are averaged: the whole run stays).
_TREND_POINTS = 256


class _KeptTrend:
    """:func:`~lightning_diag.stats.trend.mann_kendall` and :func:`~lightning_diag.stats.trend.theil_sen_slope` of a
    growing series, from sums kept between calls: Mann-Kendall's ``S`` (an integer), the counts of equal values and
    their ties' sum (integers), and the pairwise slopes, sorted. A point appended adds its pairs with the points
    before it (``n`` comparisons and slopes, one merge) instead of all ``n^2 / 2`` pairs again; the numbers are
    the functions' own (the same integers, the same slopes as IEEE divisions, the same median). A series that is
    not the last one extended by a point (the first call, a state load, pairs averaged past the points kept) is
    summed afresh; one with a non-finite value is left to the functions.

    Example:
        >>> kept, series = _KeptTrend(), [5.0, 4.0, 4.0, 2.0, 3.0, 0.5]
        >>> [kept.of(series[:n]) == (*mann_kendall(series[:n]), theil_sen_slope(series[:n])) for n in (5, 6)]
        [True, True]
    """

    def __init__(self) -> None:
        self.values: list[float] = []
        self.s = 0
        self.counts: dict[float, int] = {}
        self.ties = 0
        self.slopes: list[float] = []

    def of(self, series: list[float]) -> tuple[float, float, float]:
        """``(*mann_kendall(series), theil_sen_slope(series))``."""
        if not all(map(math.isfinite, series)) or len(series) < 3:
            return (*mann_kendall(series), theil_sen_slope(series))
        if self.values != series:
            if len(self.values) + 1 == len(series) and self.values == series[:-1]:
                self._append(series[-1])
            else:
                self._rebuild(series)
        n = len(self.values)
        z, p = mann_kendall_z_p(float(self.s), n, float(self.ties))
        slopes, mid = self.slopes, len(self.slopes) // 2
        slope = slopes[mid] if len(slopes) % 2 else (slopes[mid - 1] + slopes[mid]) / 2  # np.median's arithmetic
        return z, p, slope

    def _append(self, v: float) -> None:
        n = len(self.values)
        self.s += sum((v > u) - (v < u) for u in self.values)
        count = self.counts.get(v, 0)
        self.counts[v] = count + 1
        self.ties += _tie_term(count + 1) - _tie_term(count)
        self.slopes += sorted([(v - u) / (n - i) for i, u in enumerate(self.values)])
        self.slopes.sort()  # two sorted runs: a merge (equal slopes keep the order they came in, as in one sort)
        self.values.append(v)

    def _rebuild(self, series: list[float]) -> None:
        self.values, self.s, self.counts, self.ties, self.slopes = [], 0, {}, 0, []
        for v in series:
            self._append(v)


def _tie_term(count: int) -> int:
    """A group of ``count`` equal values' share of Mann-Kendall's variance (times 18)."""
    return count * (count - 1) * (2 * count + 5)


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

    # the loss points (`loss_window`, with the initial loss once) and the validation values it tells learning from
    # memorising by (`validation`): whichever is given
    optional = frozenset({Measure.LOSS_WINDOW, Measure.VALIDATION})
    specs = (LOSS_STAGNANT_SPEC,)
    setting_keys: ClassVar[Mapping[str, str]] = {"min_drop": LOSS_STAGNANT}
    state_keys = ("baseline", "points", "best", "history", "settled", "validation")

    def __init__(
        self,
        min_drop: float = DEFAULT_STAGNANT_THRESHOLD,
        patience: int = DEFAULT_STAGNANT_PATIENCE,
        unit: str = "epoch",
        source: str = "train_loss",
        min_steps: int = DEFAULT_STAGNANT_MIN_STEPS,
        alpha: float = DEFAULT_STAGNANT_ALPHA,
        min_trend: float = DEFAULT_STAGNANT_MIN_TREND,
    ) -> None:
        super().__init__()
        self.min_drop = min_drop
        self.patience = patience
        self.unit = unit
        self.source = source
        self.min_steps = min_steps
        self.alpha = alpha
        self.min_trend = min_trend
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
        # the trend test's sums over `history`, kept as it grows (not state: rebuilt from `history` when it differs)
        self._trend = _KeptTrend()

    def set_baseline(self, initial_loss: float) -> None:
        """Set the initial loss once (later calls, and non-finite values, are ignored)."""
        if self.baseline is None and math.isfinite(initial_loss):
            self.baseline = float(initial_loss)

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
        """Note a validation value (``m.validation``, oriented by its ``higher_is_better``:
        :meth:`observe_validation`), and judge the next loss point (``m.loss_window``: its mean, after taking its
        ``initial`` loss as the baseline, :meth:`set_baseline`); return the alerts the point raises."""
        if m.validation is not None:
            self.observe_validation(m.validation.value, "max" if m.validation.higher_is_better else "min")
        window = m.loss_window
        if window is None:
            return []
        if window.initial is not None:
            self.set_baseline(window.initial)
        value = window.mean
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
        _, self.last_p, slope = self._trend.of(self.history)
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
