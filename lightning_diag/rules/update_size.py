"""``update_too_small`` (framework-free): a learning rate far too small to matter.

Fed by :class:`~lightning_diag.GradientFlowMonitor` after each measured optimizer step with the update-to-weight
ratio ``||W_after - W_before|| / ||W_before||`` of every measured layer (``diag/update_ratio/<layer>``, written
with ``log_weight_norms=True``, the default) and the step's training loss. Around 1e-3 is the healthy rule of
thumb (Adam at 1e-3 on weights of RMS 0.05..0.1 moves them 1e-2); orders of magnitude below, the optimizer does
not move the model.

Exact meaning (warning): the median over the layers of their update ratio (layers whose ratio is exactly 0 left
out: a learning rate of 0 or a part kept still on purpose, ``update_none`` / ``grad_frozen``'s business) is below
``threshold`` on ``grad.patience`` consecutive measurements, and

* it has been below ``threshold`` at every measurement since the fit began: a run whose updates were healthy and
  then decayed (the end of a cosine schedule, a model that converged) is never judged;
* it is not growing: the last of those measurements is at most :data:`GROWTH` times the first of the streak (a
  learning-rate warm-up from 0 grows it step by step);
* the run's own loss agrees that the model is not learning: the Theil-Sen line (the median of the pairwise
  slopes, robust to one odd batch) of the losses measured since the fit began (the latest :data:`TREND_POINTS`)
  falls by less than ``loss_fall`` of its value at the first of them over ``grad.patience`` measurements, or over
  all of them when there are more (the horizon of the former test: the medians of the first and latest
  ``grad.patience`` losses, ``grad.patience`` measurements apart). Judged from the ``grad.patience``-th measurement
  (and at least :data:`MIN_TREND_POINTS` losses): the first eligible one, where the ratios' streak is complete.
  Without a loss (none reached the monitor) nothing is judged.

Margin (:attr:`Rule.peaks`): the threshold over the largest median of the latest ``grad.patience`` measurements
while the other conditions hold (0 where one does not): above 1 exactly where the rule fires.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from typing import ClassVar

from lightning_diag.core.record import Alert
from lightning_diag.core.registry import FRACTION, POSITIVE, RULES, CheckSpec, RuleSpec, default, register
from lightning_diag.core.tags import update_ratio_tag
from lightning_diag.rules.base import Latch, Rule, StepContext, excess, name_layers
from lightning_diag.rules.grad_frozen import GRAD_PATIENCE_SETTING, GRADIENT_FLOW
from lightning_diag.rules.measures import Measure, Measures
from lightning_diag.rules.rows import Check, LoggedRun, finite_family, fmt, measure, run_setting, worst_point
from lightning_diag.stats.trend import theil_sen_slope

__all__ = [
    "DEFAULT_UPDATE_LOSS_FALL",
    "DEFAULT_UPDATE_TOO_SMALL_THRESHOLD",
    "GROWTH",
    "MIN_TREND_POINTS",
    "TREND_POINTS",
    "UPDATE_SIZE_CHECK",
    "UPDATE_TOO_SMALL",
    "UPDATE_TOO_SMALL_SPEC",
    "UpdateSizeRule",
]

UPDATE_TOO_SMALL_SPEC = register(RuleSpec(
    "update_too_small", GRADIENT_FLOW, "warning", 1e-5,
    "median over layers of ||ΔW||/||W|| below {threshold:g} on {patience:g} consecutive measurements and at "
    "every one since the fit began, while the loss has fallen less than {loss_fall:.0%} below its initial value",
    settings={"loss_fall": 0.1}, source="AUTOTRAINER (ICSE'21); the 1e-3 rule of thumb",
    limits={"threshold": POSITIVE, "loss_fall": FRACTION}, check="update_size",
))
UPDATE_TOO_SMALL = UPDATE_TOO_SMALL_SPEC.rule_id
#: The rule's row of the ``lightning-diag report`` checklist (registered by :mod:`lightning_diag.rules.catalog`).
UPDATE_SIZE_CHECK = CheckSpec(
    "update_size", "Training", "Updates large enough to matter: median ||ΔW||/||W|| above {update_too_small:g}"
)

#: ``update_too_small``: the median update ratio below this (two orders of magnitude under the healthy 1e-3).
DEFAULT_UPDATE_TOO_SMALL_THRESHOLD = default(UPDATE_TOO_SMALL)
#: ``update_too_small``: the loss must have fallen less than this fraction below its initial value.
DEFAULT_UPDATE_LOSS_FALL = default(UPDATE_TOO_SMALL_SPEC.key("loss_fall"))
#: A streak whose last median is more than this times its first is a growing learning rate (a warm-up): not judged.
GROWTH = 2.0
#: The latest measured losses whose trend confirms (a run this long whose updates were always too small is judged on
#: its recent trend).
TREND_POINTS = 64
#: The fewest measured losses whose trend is judged (two points are one batch against another).
MIN_TREND_POINTS = 3
_PATIENCE = int(GRAD_PATIENCE_SETTING.default)


class UpdateSizeRule(Rule):
    """``update_too_small``: the optimizer's steps are orders of magnitude too small while the loss does not fall.

    Example:
        >>> rule = UpdateSizeRule(patience=2)
        >>> tiny = {"fc1": 1e-7, "fc2": 2e-7}
        >>> [a.rule for i in range(5) for a in rule.judge(StepContext(0, i), Measures(update_ratios=tiny, loss=0.69))]
        ['update_too_small']
        >>> healthy = UpdateSizeRule(patience=2)
        >>> ms = [Measures(update_ratios={"fc": r}, loss=0.69) for r in (1e-3, 1e-7, 1e-7, 1e-7)]
        >>> [a for m in ms for a in healthy.judge(StepContext(0, 0), m)]
        []
    """

    specs = (UPDATE_TOO_SMALL_SPEC,)
    setting_keys: ClassVar[Mapping[str, str]] = {"patience": GRAD_PATIENCE_SETTING.key}
    state_keys = ("streak", "moved", "streak_start", "trend")
    needs = frozenset({Measure.UPDATE_RATIOS})
    optional = frozenset({Measure.LOSS})

    def __init__(
        self,
        threshold: float = DEFAULT_UPDATE_TOO_SMALL_THRESHOLD,
        loss_fall: float = DEFAULT_UPDATE_LOSS_FALL,
        patience: int = _PATIENCE,
    ) -> None:
        super().__init__()
        self.threshold = threshold
        self.loss_fall = loss_fall
        self.patience = patience
        self.latch = Latch.for_patience(patience)
        self.streak = 0
        #: Whether the median ratio has been at or above ``threshold`` at some measurement of this fit.
        self.moved = False
        #: The measured training losses since the fit began (the latest :data:`TREND_POINTS`): the loss's verdict.
        self.trend: list[float] = []
        #: The median ratio at the first measurement of the current streak.
        self.streak_start: float | None = None

    def trend_ends(self) -> tuple[float, float]:
        """The Theil-Sen line of the measured losses at their first and last point (``nan`` without two)."""
        slope = theil_sen_slope(self.trend)
        if not math.isfinite(slope):
            return math.nan, math.nan
        start = statistics.median(v - slope * i for i, v in enumerate(self.trend))
        return start, start + slope * (len(self.trend) - 1)

    def not_learning(self) -> bool:
        """Whether the loss's trend over the measured losses (``patience`` of them at least) has fallen less than
        ``loss_fall`` of its start (``False`` before)."""
        if len(self.trend) < max(self.patience, MIN_TREND_POINTS):
            return False
        slope = theil_sen_slope(self.trend)
        start, _ = self.trend_ends()
        # the fall over `patience` measurements at least, as the two windows of the first and latest `patience`
        # losses (their medians `patience` measurements apart) judged it from the `2 x patience`-th measurement
        horizon = max(len(self.trend) - 1, self.patience)
        return start > 0 and -slope * horizon < self.loss_fall * start

    def judge(self, ctx: StepContext, m: Measures) -> list[Alert]:
        """Judge the update ratios ``{layer: ||ΔW||/||W||}`` of one measured step and its training loss; return the
        alerts raised."""
        ratios, loss = m.update_ratios or {}, m.loss
        if loss is not None and math.isfinite(loss):
            self.trend = [*self.trend, float(loss)][-TREND_POINTS:]
        moving = {k: float(v) for k, v in ratios.items() if math.isfinite(v) and v > 0}
        if not moving:
            return []
        median = statistics.median(moving.values())
        small = median < self.threshold
        if not small:
            self.moved = True
        if small:
            self.streak += 1
            if self.streak == 1:
                self.streak_start = median
        else:
            self.streak, self.streak_start = 0, None
        start = self.streak_start or median
        growing = median > GROWTH * start
        gates = not self.moved and not growing and self.not_learning()
        # the margin: the largest median of the streak against the threshold, while the other conditions hold
        self.observe_held(
            "model", excess(median, self.threshold, above=False), self.patience, math.inf if gates else 0.0
        )
        tripped = small and self.streak >= self.patience and gates
        if not self.latch.update("model", tripped):
            return []
        start, recent = self.trend_ends()
        return [
            self._alert(
                ctx,
                f"updates far too small: the median update ||ΔW||/||W|| over {len(moving)} layers is {median:.3g}, "
                f"below {self.threshold:g} (healthy: around 1e-3) on {self.streak} consecutive measurements and at "
                f"every one since the fit began, while the loss is not falling (its trend over {len(self.trend)} "
                f"measurements: {recent:.4g}, from {start:.4g}); smallest: {name_layers(moving, worst_first=False)}. "
                "The learning rate is far too small (or the gradients are): raise it, check the scheduler's start "
                "value and the optimizer's parameter groups",
                source="model",
                value=median,
                threshold=self.threshold,
            )
        ]


# -- the report's update_size row ------------------------------------------------------------------------------
# GradientFlowMonitor's ``diag/update_ratio/<layer>``. The row passes or fails on the rule's alerts: the rule also
# judges the measurements since the start, which the series do not hold, so nothing is replayed.


@measure("update_size")
def _measure_update_size(run: LoggedRun, check: Check) -> bool:
    check.threshold = RULES[UPDATE_TOO_SMALL].describe(run.thresholds)
    check.threshold_value = {"value": run_setting(run, UPDATE_TOO_SMALL)}
    ratios = finite_family(run, update_ratio_tag)
    by_step: dict[int, list[float]] = {}
    for points in ratios.values():
        for step, value in points:
            by_step.setdefault(step, []).append(value)
    if not by_step:
        return False
    medians = {step: statistics.median(values) for step, values in sorted(by_step.items())}
    low_step = min(medians, key=medians.__getitem__)
    last_step = max(medians)
    layer, step, lowest = worst_point(ratios, lowest=True)
    check.measured = (
        f"lowest median ||ΔW||/||W|| over layers {fmt(medians[low_step])} (step {low_step}), {fmt(medians[last_step])}"
        f" at the last of {len(medians)} measurements; lowest layer {fmt(lowest)} (`{layer}`, step {step})"
    )
    check.measured_value = {"min_median": medians[low_step], "last_median": medians[last_step], "min_layer": lowest}
    return True
