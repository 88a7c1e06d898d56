"""The verdicts of the non-finite policy and of the rollback policy, and what they are decided from
(framework-free).

:class:`~lightning_diag.rules.nonfinite.NonFinitePolicy` (``nonfinite_loss``, ``nonfinite_grad``) and
:class:`~lightning_diag.rules.rollback.RollbackRule` (``nonfinite_rollback``) do more than alert: they decide what
:class:`~lightning_diag.AnomalyAlarm` does with a step. The guard and the recovery that carry those decisions out
(:mod:`lightning_diag.callbacks.anomaly_alarm.nonfinite_guard`, ``nonfinite_recovery``) exchange these records
with them: what a step showed (:class:`StepFindings`, :class:`NonFiniteDetails`: measurements, as a
:class:`~lightning_diag.rules.measures.Measures` field is) and the answer (:class:`Decision` with its
:class:`Verdict`, :class:`RollbackChoice`). They sit here, beside the measurements, so that a part carrying out a
verdict imports the records it exchanges and nothing named after a rule.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping, Sequence

from lightning_diag.core.record import Alert

__all__ = ["Decision", "NonFiniteDetails", "RollbackChoice", "StepFindings", "Verdict"]


class Verdict(str, enum.Enum):
    """What the callback does with the optimizer step it asked about."""

    #: Let the optimizer apply the update (nothing wrong, the scaler's own overflow, or ``"warn"``).
    APPLY = "apply"
    #: Drop this step's gradients (no parameter or optimizer state changes) and go on.
    SKIP = "skip"
    #: Drop the gradients and stop training (``trainer.should_stop``).
    STOP = "stop"
    #: Drop the gradients and raise ``NonFiniteError`` carrying :attr:`Decision.error`.
    RAISE = "raise"
    #: Drop the gradients and restore a snapshot (``on_nonfinite="rollback"``); the callback's rollback rule
    #: decides which one, or turns it into a stop when none is left. :attr:`Decision.error` is the critical
    #: alert the stop would write.
    ROLLBACK = "rollback"


@dataclasses.dataclass(frozen=True)
class StepFindings:
    """What one optimizer step looked like, agreed over all ranks.

    Attributes:
        loss_bad: A micro-batch loss since the previous optimizer step was NaN/Inf (on any rank).
        grad_bad: A gradient about to be applied is NaN/Inf (on any rank).
        scaler_active: An AMP ``GradScaler`` manages the step (it skips overflow steps by itself).
    """

    loss_bad: bool
    grad_bad: bool
    scaler_active: bool = False

    @property
    def bad(self) -> bool:
        """Whether anything was non-finite."""
        return self.loss_bad or self.grad_bad


@dataclasses.dataclass(frozen=True)
class NonFiniteDetails:
    """What an alert tells about a bad step; gathered by the callback only when there is one.

    Attributes:
        learning_rates: ``"<Optimizer>/group_<j>" -> lr``.
        bad_parameters: Names of parameters with a non-finite gradient (a few, then ``"..."``).
        last_finite_loss: The last finite training loss seen (``nan`` if none).
        source: Where the first non-finite value appeared (``"input"``, a module's qualified name, ``"loss"``), or
            ``""`` when not localised (the alert then says ``loss`` or ``gradients``).
        located: What the localisation found, one sentence for the message (``""`` if nothing).
    """

    learning_rates: Mapping[str, float] = dataclasses.field(default_factory=dict)
    bad_parameters: Sequence[str] = ()
    last_finite_loss: float = float("nan")
    source: str = ""
    located: str = ""


@dataclasses.dataclass(frozen=True)
class Decision:
    """The policy's answer for one step.

    Attributes:
        verdict: What to do with the update.
        alerts: The alerts to record (already latched: an episode alerts once where the action says so).
        error: With :attr:`Verdict.RAISE`, the alert the exception carries.
    """

    verdict: Verdict
    alerts: tuple[Alert, ...] = ()
    error: Alert | None = None


@dataclasses.dataclass(frozen=True)
class RollbackChoice:
    """The answer of :meth:`~lightning_diag.rules.rollback.RollbackRule.choose`.

    Attributes:
        step: The snapshot step to restore, or ``None`` to stop training.
        drop_after: Snapshots taken after this step are discarded (``None``: keep all).
        reason: Why this snapshot (or why none), for the alert message.
    """

    step: int | None
    drop_after: int | None
    reason: str
