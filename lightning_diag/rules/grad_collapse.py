"""``grad_collapse`` (framework-free): the blocks' gradient norm collapses against its early baseline, fed by
:class:`~lightning_diag.GradientFlowMonitor`.

The seed's number is applied to a quantity where it detects faults rather than architecture (the measurements
behind the choice are in ``docs/gradient_flow.md``).

``grad_collapse``: the L2 norm of the blocks' weight-matrix gradients below ``collapse_ratio`` times its
baseline (median of the first ``baseline_measurements``), on ``patience`` consecutive measurements. With the
loss known, the verdict names the cause: loss at most ``converged_fraction`` of its initial value: the model
**converged** (an ``info``); loss not 10% below its initial value: a **dead network** (a warning: typically a
learning rate far too high or dead ReLUs); otherwise the gradients **vanished** while the loss is far from its
floor (a warning). Its margin (:attr:`Rule.peaks`) is that of the warning: the limit over the largest norm of the
latest ``patience`` measurements where the verdict is not **converged** (0 where it is, or while the model is
still learning), so a converged run's ``info`` does not count.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections.abc import Mapping
from typing import ClassVar

from lightning_diag.core.record import Alert, Severity
from lightning_diag.core.registry import COUNT, FRACTION, CheckSpec, RuleSpec, default, register
from lightning_diag.core.tags import grad_blocks_tag, grad_total_tag, loss_tag
from lightning_diag.rules.base import Latch, Rule, StepContext, excess
from lightning_diag.rules.grad_frozen import GRAD_PATIENCE_SETTING, GRADIENT_FLOW
from lightning_diag.rules.grad_settings import DEFAULT_GRAD_PATIENCE
from lightning_diag.rules.measures import Measure, Measures
from lightning_diag.rules.rows import (
    Check,
    LoggedRun,
    finite_values,
    fmt,
    measure,
    replay,
    run_setting,
    run_threshold,
    updates_by_step,
)

__all__ = [
    "DEFAULT_COLLAPSE_BASELINE_MEASUREMENTS",
    "DEFAULT_COLLAPSE_CONVERGED_FRACTION",
    "DEFAULT_COLLAPSE_THRESHOLD",
    "GRAD_COLLAPSE",
    "GRAD_COLLAPSE_BASELINE_KEY",
    "GRAD_COLLAPSE_CHECK",
    "GRAD_COLLAPSE_SPEC",
    "GradCollapseRule",
]

GRAD_COLLAPSE_SPEC = register(
    RuleSpec(
        "grad_collapse",
        GRADIENT_FLOW,
        "warning",
        0.01,
        "blocks' gradient norm below {threshold:g} of its early baseline (converged: info; dead or vanished: warning)",
        settings={"baseline_measurements": 5, "converged_fraction": 0.1},
        check="grad_collapse",
        source="seed 001 §1.2",
        limits={"threshold": FRACTION, "baseline_measurements": COUNT, "converged_fraction": FRACTION},
    )
)
GRAD_COLLAPSE = GRAD_COLLAPSE_SPEC.rule_id
#: Its row of the ``lightning-diag report`` checklist (registered in report order by
#: :mod:`lightning_diag.rules.catalog`).
GRAD_COLLAPSE_CHECK = CheckSpec(GRAD_COLLAPSE, "Model",
                                "Blocks' gradient norm above {grad_collapse:g} of its early baseline")
#: ``thresholds()`` key of ``grad_collapse``'s baseline length (read back by the report).
GRAD_COLLAPSE_BASELINE_KEY = GRAD_COLLAPSE_SPEC.key("baseline_measurements")

#: ``grad_collapse``: blocks' gradient norm below this fraction of its baseline (seed 001 §1.2).
DEFAULT_COLLAPSE_THRESHOLD = default(GRAD_COLLAPSE)
#: ``grad_collapse``: measurements whose median is the baseline (and whose median loss is the initial loss).
DEFAULT_COLLAPSE_BASELINE_MEASUREMENTS = int(default(GRAD_COLLAPSE_SPEC.key("baseline_measurements")))
#: ``grad_collapse``: a loss at most this fraction of its initial value is a converged model (``info``).
DEFAULT_COLLAPSE_CONVERGED_FRACTION = default(GRAD_COLLAPSE_SPEC.key("converged_fraction"))
#: ``grad_collapse``: a loss that has not fallen this fraction below its initial value is stuck (dead network).
_STUCK_FALL = 0.1


class GradCollapseRule(Rule):
    """``grad_collapse``: the blocks' gradient norm falls below ``collapse_ratio`` times its early baseline;
    the loss tells converged (``info``) from dead or vanished (warnings).

    Example:
        >>> rule = GradCollapseRule(patience=1, baseline_measurements=2)
        >>> [len(rule.judge(StepContext(0, i), Measures(grad_norm=n))) for i, n in enumerate([1.0, 1.2, 0.5, 0.001])]
        [0, 0, 0, 1]
        >>> rule = GradCollapseRule(patience=1, baseline_measurements=1)
        >>> rule.judge(StepContext(0, 0), Measures(grad_norm=1.0, loss=2.0))
        []
        >>> [a.severity.value for a in rule.judge(StepContext(0, 1), Measures(grad_norm=1e-3, loss=0.05))]
        ['info']
    """

    specs = (GRAD_COLLAPSE_SPEC,)
    setting_keys: ClassVar[Mapping[str, str]] = {"collapse_ratio": GRAD_COLLAPSE, "patience": GRAD_PATIENCE_SETTING.key}
    # the blocks' gradient norm is judged (with the loss); the update ratios of a measured step are noted
    optional = frozenset({Measure.GRAD_NORM, Measure.LOSS, Measure.UPDATE_RATIOS})
    state_keys = (
        "early", "baseline", "streak", "early_losses", "initial_loss", "recent_losses", "early_updates",
        "update_baseline", "update_level",
    )  # fmt: skip

    def __init__(
        self,
        collapse_ratio: float = DEFAULT_COLLAPSE_THRESHOLD,
        patience: int = DEFAULT_GRAD_PATIENCE,
        baseline_measurements: int = DEFAULT_COLLAPSE_BASELINE_MEASUREMENTS,
        converged_fraction: float = DEFAULT_COLLAPSE_CONVERGED_FRACTION,
    ) -> None:
        super().__init__()
        self.collapse_ratio = collapse_ratio
        self.patience = patience
        self.latch = Latch.for_patience(patience)
        self.baseline_measurements = baseline_measurements
        self.converged_fraction = converged_fraction
        self.early: list[float] = []
        self.baseline: float | None = None
        self.streak = 0
        self.early_losses: list[float] = []
        self.initial_loss: float | None = None
        self.recent_losses: list[float] = []
        #: The model's update level (median over its layers of ``||ΔW|| / ||W||``) at the first measured steps,
        #: their median (the update baseline), and the level at the last measured step (``None``: unknown).
        self.early_updates: list[float] = []
        self.update_baseline: float | None = None
        self.update_level: float | None = None

    def _observe_updates(self, ratios: Mapping[str, float]) -> None:
        """Note the relative update ``||ΔW|| / ||W||`` of each layer at the last measured optimizer step; their
        median is the model's update level, whose baseline is the median of the first ``baseline_measurements``."""
        values = [float(v) for v in ratios.values() if math.isfinite(v)]
        if not values:
            return
        self.update_level = statistics.median(values)
        if self.update_baseline is None:
            self.early_updates.append(self.update_level)
            if len(self.early_updates) >= self.baseline_measurements:
                self.update_baseline = statistics.median(self.early_updates)

    def still_learning(self) -> bool:
        """Whether the model's parameters still move: its update level is at least ``collapse_ratio`` times its
        baseline (``False`` when either is not known)."""
        if self.update_level is None or self.update_baseline is None or self.update_baseline <= 0:
            return False
        return self.update_level >= self.collapse_ratio * self.update_baseline

    def verdict(self, loss: float | None) -> str:
        """``"converged"``, ``"dead"`` or ``"vanished"`` for a collapse at this loss (``"vanished"`` without one)."""
        if loss is None or self.initial_loss is None or not math.isfinite(loss) or self.initial_loss <= 0:
            return "vanished"
        if loss <= self.converged_fraction * self.initial_loss:
            return "converged"
        if loss >= (1.0 - _STUCK_FALL) * self.initial_loss:
            return "dead"
        return "vanished"

    def judge(self, ctx: StepContext, m: Measures) -> list[Alert]:
        """Judge one measurement of the blocks' gradient norm (and the training loss, when known). The update
        ratios of a measured step (``m.update_ratios``) are noted first (:meth:`_observe_updates`); measures without
        ``grad_norm`` raise nothing and leave the loss unread."""
        if m.update_ratios is not None:
            self._observe_updates(m.update_ratios)
        if m.grad_norm is None:
            return []
        norm, loss = m.grad_norm, m.loss
        if loss is not None and math.isfinite(loss):
            if self.initial_loss is None:
                self.early_losses.append(loss)
                if len(self.early_losses) >= self.baseline_measurements:
                    self.initial_loss = statistics.median(self.early_losses)
            self.recent_losses = ([*self.recent_losses, loss])[-self.patience :]
        if not math.isfinite(norm):
            return []
        if self.baseline is None:
            self.early.append(norm)
            if len(self.early) >= self.baseline_measurements:
                self.baseline = statistics.median(self.early)
            return []
        limit = self.collapse_ratio * self.baseline
        self.streak = self.streak + 1 if norm < limit else 0
        recent = statistics.mean(self.recent_losses) if self.recent_losses and loss is not None else None
        kind = self.verdict(recent)
        # The loss has fallen and the model's parameters still move at a rate comparable with its early one: the
        # blocks' gradient shrank (a gated branch, attention that settled), the model did not stop learning.
        # Waits (the streak goes on) until the updates collapse too or the loss says otherwise. A collapse already
        # reported stays one (a dead network's loss may dip below 90% of its initial value while the optimizer's
        # weight decay keeps the weights moving).
        learning = kind == "vanished" and recent is not None and self.still_learning()
        collapsed = self.streak >= self.patience and (not learning or "global" in self.latch.active)
        # the margin of the warning: the largest norm of the latest `patience` against the limit, where the loss
        # says neither converged (an info) nor still learning
        warns = kind != "converged" and (not learning or "global" in self.latch.active)
        self.observe_held("global", excess(norm, limit, above=False), self.patience, math.inf if warns else 0.0)
        if not self.latch.update("global", collapsed, excess(norm, limit, above=False)):
            return []
        initial = self.initial_loss
        if kind == "converged":
            cause = (
                f"the model converged: the loss {recent:.3g} is at most {self.converged_fraction:g} of its initial "
                f"{initial:.3g}; nothing is wrong (consider stopping earlier)"
            )
        elif kind == "dead":
            cause = (
                f"dead network: the loss {recent:.3g} is stuck at its initial {initial:.3g} while every block's "
                "gradient is ~0; typical after a learning rate far too high, or units that died (ReLU)"
            )
        else:
            where = f" ({recent:.3g}, initial {initial:.3g})" if recent is not None and initial is not None else ""
            moved = ""
            if self.update_level is not None and self.update_baseline:
                moved = (
                    f", and the model's updates ||ΔW||/||W|| (median over its layers) are at "
                    f"{self.update_level / self.update_baseline:.3g} of their early level"
                )
            cause = (
                f"the gradients vanished while the loss is still far from its floor{where}{moved}: saturated "
                "activations, dead units or a cut graph"
            )
        return [
            self._alert(
                ctx,
                f"gradient norm of the blocks' weight matrices {norm:.3g} is below {self.collapse_ratio:g} x its "
                f"baseline {self.baseline:.3g} on {self.patience} consecutive measurements: {cause}",
                source="global",
                value=norm / self.baseline if self.baseline > 0 else norm,
                threshold=self.collapse_ratio,
                severity=Severity.INFO if kind == "converged" else None,
            )
        ]


# -- the report's grad_collapse row ----------------------------------------------------------------------------


@measure(GRAD_COLLAPSE)
def _measure_grad_collapse(run: LoggedRun, check: Check) -> bool:
    ratio = run_threshold(run, GRAD_COLLAPSE)
    n = int(run_setting(run, GRAD_COLLAPSE_BASELINE_KEY))
    check.threshold = f"norm / baseline >= {fmt(ratio)}" if ratio is not None else "not logged"
    check.threshold_value = {"value": ratio} if ratio is not None else {}
    series = run.scalars.get(grad_blocks_tag()) or run.scalars.get(grad_total_tag(), [])
    totals = [v for v in finite_values(series) if v >= 0]
    if len(totals) > n:
        baseline = statistics.median(totals[:n])
        lowest = min(totals[n:]) / baseline if baseline > 0 else math.nan
        check.measured = f"lowest norm / baseline {fmt(lowest)} (baseline {fmt(baseline)})"
        check.measured_value = {"min": lowest, "baseline": baseline}
        return True
    if totals:
        check.add_note(f"needs more than {n} measurements of the blocks' norm, the run has {len(totals)}")
    return False


@replay(GRAD_COLLAPSE)
def _replay_grad_collapse(run: LoggedRun) -> list[Alert]:
    rule = GradCollapseRule.from_settings(run.thresholds)
    losses = sorted(run.scalars.get(loss_tag("train_step"), []))
    steps = [step for step, _ in losses]
    updates = updates_by_step(run)
    alerts: list[Alert] = []
    for step, norm in run.scalars.get(grad_blocks_tag(), []):
        # the training loss of the measured step, or the last one logged before it (a logger's own cadence)
        at = bisect.bisect_right(steps, step) - 1
        alerts += rule.judge(StepContext(0, step), Measures(grad_norm=norm, loss=losses[at][1] if at >= 0 else None))
        if step in updates:
            alerts += rule.judge(StepContext(0, step), Measures(update_ratios=updates[step]))
    return alerts
