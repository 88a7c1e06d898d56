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
* the run's own loss agrees that the model is not learning: the median loss of the last ``grad.patience``
  measurements has fallen less than ``loss_fall`` below the median of the first ``grad.patience`` (the initial
  loss); judged from the ``2 x grad.patience``-th measurement with a loss on (the two windows apart). Without a
  loss (none reached the monitor) nothing is judged.

Margin (:attr:`Rule.peaks`): the threshold over the largest median of the latest ``grad.patience`` measurements
while the other conditions hold (0 where one does not): above 1 exactly where the rule fires.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from typing import Any

from lightning_diag.core.record import Alert
from lightning_diag.core.registry import FRACTION, POSITIVE, RuleSpec, default, register
from lightning_diag.rules.base import Latch, Rule, StepContext, excess, name_layers
from lightning_diag.rules.grad_frozen import GRAD_PATIENCE_SETTING, GRADIENT_FLOW
from lightning_diag.rules.loss_windows import LossWindows

__all__ = [
    "DEFAULT_UPDATE_LOSS_FALL",
    "DEFAULT_UPDATE_TOO_SMALL_THRESHOLD",
    "GROWTH",
    "UPDATE_TOO_SMALL",
    "UPDATE_TOO_SMALL_SPEC",
    "UpdateSizeRule",
]

UPDATE_TOO_SMALL_SPEC = register(RuleSpec(
    "update_too_small", GRADIENT_FLOW, "warning", 1e-5,
    "median over layers of ||ΔW||/||W|| below {threshold:g} on {patience:g} consecutive measurements and at "
    "every one since the fit began, while the loss has fallen less than {loss_fall:.0%} below its initial value",
    settings={"loss_fall": 0.1}, source="AUTOTRAINER (ICSE'21); the 1e-3 rule of thumb",
    limits={"threshold": POSITIVE, "loss_fall": FRACTION},
))
UPDATE_TOO_SMALL = UPDATE_TOO_SMALL_SPEC.rule_id

#: ``update_too_small``: the median update ratio below this (two orders of magnitude under the healthy 1e-3).
DEFAULT_UPDATE_TOO_SMALL_THRESHOLD = default(UPDATE_TOO_SMALL)
#: ``update_too_small``: the loss must have fallen less than this fraction below its initial value.
DEFAULT_UPDATE_LOSS_FALL = default(UPDATE_TOO_SMALL_SPEC.key("loss_fall"))
#: A streak whose last median is more than this times its first is a growing learning rate (a warm-up): not judged.
GROWTH = 2.0
_PATIENCE = int(GRAD_PATIENCE_SETTING.default)


class UpdateSizeRule(Rule):
    """``update_too_small``: the optimizer's steps are orders of magnitude too small while the loss does not fall.

    Example:
        >>> rule = UpdateSizeRule(patience=2)
        >>> tiny = {"fc1": 1e-7, "fc2": 2e-7}
        >>> [a.rule for i in range(5) for a in rule.update(tiny, StepContext(0, i), loss=0.69)]
        ['update_too_small']
        >>> healthy = UpdateSizeRule(patience=2)
        >>> [a for r in (1e-3, 1e-7, 1e-7, 1e-7) for a in healthy.update({"fc": r}, StepContext(0, 0), loss=0.69)]
        []
    """

    specs = (UPDATE_TOO_SMALL_SPEC,)
    state_keys = ("streak", "moved", "streak_start")

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
        #: The first and latest ``patience`` training losses (the loss's own verdict).
        self.losses = LossWindows(patience)
        #: The median ratio at the first measurement of the current streak.
        self.streak_start: float | None = None

    @classmethod
    def from_settings(cls, thresholds: Mapping[str, float | None]) -> UpdateSizeRule:
        """The rule with the thresholds in effect (see :meth:`Rule.from_settings`)."""
        return cls(
            UPDATE_TOO_SMALL_SPEC.value(thresholds),
            UPDATE_TOO_SMALL_SPEC.value(thresholds, "loss_fall"),
            int(GRAD_PATIENCE_SETTING.value(thresholds)),
        )

    def state_dict(self) -> dict[str, Any]:
        """The declared state, the latch and the loss windows."""
        return {**super().state_dict(), "losses": self.losses.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output.

        Raises:
            KeyError: If a key is missing; the message names every missing key.
        """
        if "losses" not in state:
            raise KeyError(f"{type(self).__name__}.load_state_dict: missing state keys ['losses']")
        super().load_state_dict(state)
        self.losses.load_state_dict(state["losses"])

    def update(self, ratios: Mapping[str, float], ctx: StepContext, loss: float | None = None) -> list[Alert]:
        """Feed the update ratios ``{layer: ||ΔW||/||W||}`` of one measured step and its training loss; return the
        alerts raised."""
        self.losses.add(loss)
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
        gates = not self.moved and not growing and self.losses.not_learning(self.loss_fall)
        # the margin: the largest median of the streak against the threshold, while the other conditions hold
        self.observe_held(
            "model", excess(median, self.threshold, above=False), self.patience, math.inf if gates else 0.0
        )
        tripped = small and self.streak >= self.patience and gates
        if not self.latch.update("model", tripped):
            return []
        initial, recent = self.losses.initial, self.losses.latest
        return [
            self._alert(
                ctx,
                f"updates far too small: the median update ||ΔW||/||W|| over {len(moving)} layers is {median:.3g}, "
                f"below {self.threshold:g} (healthy: around 1e-3) on {self.streak} consecutive measurements and at "
                f"every one since the fit began, while the loss is not falling ({recent:.4g}, initial "
                f"{initial:.4g}); smallest: {name_layers(moving, worst_first=False)}. The learning rate is far too "
                "small (or the gradients are): raise it, check the scheduler's start value and the optimizer's "
                "parameter groups",
                source="model",
                value=median,
                threshold=self.threshold,
            )
        ]
