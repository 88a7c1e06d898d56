"""The non-finite policy of :class:`~lightning_diag.AnomalyAlarm`: a pure state machine, no torch, no Lightning.

The callback finds out what happened on an optimizer step (:class:`StepFindings`: a NaN/Inf in the loss, in a
gradient, whether an AMP ``GradScaler`` manages the step), agreed over all ranks, and asks
:meth:`NonFinitePolicy.decide` what to do. The answer is a :class:`Decision`: a :class:`Verdict` the callback
carries out (apply the update, skip it, stop training, raise) and the alerts to record. The policy keeps the
counts that outlive a step (skipped steps, consecutive scaler overflows) and the latch that makes each episode
alert once; all of it is in :meth:`~NonFinitePolicy.state_dict`.

Exact behaviour of each action (also in ``docs/anomaly_alarm.md``):

* ``"stop"``: a bad step gets :attr:`Verdict.STOP` and a critical alert, every time.
* ``"raise"``: :attr:`Verdict.RAISE`; :attr:`Decision.error` is the alert the exception carries.
* ``"skip"``: :attr:`Verdict.SKIP` (the alert once per episode) until more than ``max_skips`` steps were
  skipped in the fit, then :attr:`Verdict.STOP` with a ``skip_limit`` alert.
* ``"warn"``: :attr:`Verdict.APPLY` and the alert once per episode.
* With a GradScaler, a step whose loss is finite but whose gradients overflow is the scaler's business (it
  skips the step and lowers its scale): only the ``max_scaler_overflows``-th consecutive one is a fault.

Extending it: a new action adds a :class:`Verdict` member (in :mod:`lightning_diag.rules.verdicts`), its settings
and counters (declared in :attr:`NonFinitePolicy.state_keys`), a branch in :meth:`NonFinitePolicy.decide` and a line of
``ACTION_TEXT``; the callback adds the handler that performs the verdict.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from lightning_diag.core.record import Alert, NonFiniteAction, Severity
from lightning_diag.core.registry import COUNT, STEPS, RuleSpec, register
from lightning_diag.rules.base import FromSettings, Latch, StepContext
from lightning_diag.rules.verdicts import Decision, NonFiniteDetails, StepFindings, Verdict

__all__ = [
    "ACTION_TEXT",
    "DEFAULT_MAX_SCALER_OVERFLOWS",
    "DEFAULT_MAX_SKIPS",
    "NONFINITE_ACTIONS",
    "NONFINITE_GRAD",
    "NONFINITE_GRAD_SPEC",
    "NONFINITE_LOSS",
    "NONFINITE_LOSS_MAX_SKIPS_KEY",
    "NONFINITE_LOSS_SPEC",
    "NonFinitePolicy",
]

# -- declarations (one per rule id; the docs' thresholds table and the report read them) -----------------------
NONFINITE_LOSS_SPEC = register(RuleSpec(
    "nonfinite_loss", "AnomalyAlarm", "critical", None, "NaN/Inf in the loss",
    settings={"max_skips": 5}, check="nonfinite", source="seed 000 §4.2", limits={"max_skips": STEPS},
))
NONFINITE_GRAD_SPEC = register(RuleSpec(
    "nonfinite_grad", "AnomalyAlarm", "critical", None, "NaN/Inf in a gradient before the optimizer step",
    settings={"max_scaler_overflows": 5}, check="nonfinite", source="seed 000 §4.2",
    limits={"max_scaler_overflows": COUNT},
))
NONFINITE_LOSS = NONFINITE_LOSS_SPEC.rule_id
NONFINITE_GRAD = NONFINITE_GRAD_SPEC.rule_id
#: ``thresholds()`` key of ``nonfinite_loss``'s skip budget (read by AnomalyAlarm).
NONFINITE_LOSS_MAX_SKIPS_KEY = NONFINITE_LOSS_SPEC.key("max_skips")

#: ``on_nonfinite="skip"``: skipped optimizer steps allowed in one fit before the alarm stops training (both
#: non-finite rules; the setting ``nonfinite_loss.max_skips``).
DEFAULT_MAX_SKIPS = int(NONFINITE_LOSS_SPEC.settings["max_skips"])
#: With a GradScaler (``16-mixed``), consecutive overflow steps with a finite loss before ``nonfinite_grad``.
DEFAULT_MAX_SCALER_OVERFLOWS = int(NONFINITE_GRAD_SPEC.settings["max_scaler_overflows"])
NONFINITE_ACTIONS: tuple[str, ...] = ("stop", "raise", "skip", "warn", "rollback")
#: What happened to the update, per action, as the alert message says it.
ACTION_TEXT: dict[str, str] = {
    "stop": "the update was not applied and training stops",
    "raise": "the update was not applied; raising NonFiniteError",
    "skip": "the update was skipped",
    "warn": "the update was applied (on_nonfinite='warn')",
    "rollback": "the update was not applied",
}


_APPLY = Decision(Verdict.APPLY)


class NonFinitePolicy(FromSettings):
    """Decides what a non-finite step leads to, and keeps the counts and latch that span steps.

    Args:
        action: ``"stop"``, ``"raise"``, ``"skip"`` or ``"warn"`` (see the module docstring).
        max_skips: With ``"skip"``, skipped steps allowed in one fit.
        max_scaler_overflows: Consecutive GradScaler overflow steps (finite loss) before ``nonfinite_grad``.

    Example:
        >>> policy = NonFinitePolicy("skip", max_skips=1)
        >>> nan = StepFindings(loss_bad=True, grad_bad=True)
        >>> [policy.decide(nan, StepContext(0, s)).verdict.value for s in range(3)]
        ['skip', 'stop', 'stop']
        >>> policy.decide(StepFindings(False, False), StepContext(0, 3)).verdict.value
        'apply'
    """

    #: The declarations of the rule ids it raises.
    specs: ClassVar[tuple[RuleSpec, ...]] = (NONFINITE_LOSS_SPEC, NONFINITE_GRAD_SPEC)
    #: Counters saved by :meth:`state_dict` (besides the latch).
    state_keys: ClassVar[tuple[str, ...]] = ("skips", "scaler_overflows")

    def __init__(
        self,
        action: NonFiniteAction = "stop",
        max_skips: int = DEFAULT_MAX_SKIPS,
        max_scaler_overflows: int = DEFAULT_MAX_SCALER_OVERFLOWS,
    ) -> None:
        if action not in NONFINITE_ACTIONS:
            raise ValueError(f"Expected argument `action` to be one of {NONFINITE_ACTIONS}, but got {action!r}")
        self.action = action
        self.max_skips = max_skips
        self.max_scaler_overflows = max_scaler_overflows
        self.latch = Latch()
        self.skips = 0
        self.scaler_overflows = 0

    def decide(
        self,
        findings: StepFindings,
        ctx: StepContext,
        details: Callable[[], NonFiniteDetails] = NonFiniteDetails,
    ) -> Decision:
        """The verdict and alerts for one optimizer step.

        Args:
            findings: What the step looked like, over all ranks.
            ctx: Epoch and global step, for the alerts.
            details: Called only for a bad step that alerts: what the alert message tells.
        """
        if not findings.bad:
            self.clear()
            return _APPLY
        if not findings.loss_bad and findings.scaler_active:
            # GradScaler skips overflow steps and lowers its scale by design: only a run of them is a fault.
            self.scaler_overflows += 1
            if self.scaler_overflows < self.max_scaler_overflows:
                return _APPLY
        alert = self.alert(findings.loss_bad, ctx, details())
        # The episode latch is per kind (loss / gradients), whatever the localised source, so clear() clears it.
        latched = (alert,) if self.latch.update(_kind(findings.loss_bad), True) else ()
        if self.action == "rollback":
            return Decision(Verdict.ROLLBACK, (), error=alert)
        if self.action == "raise":
            return Decision(Verdict.RAISE, (alert,), error=alert)
        if self.action == "stop":
            return Decision(Verdict.STOP, (alert,))
        if self.action == "warn":
            return Decision(Verdict.APPLY, latched)
        self.skips += 1
        if self.skips <= self.max_skips:
            return Decision(Verdict.SKIP, latched)
        limit = Alert(
            rule=alert.rule,
            severity=Severity.CRITICAL,
            message=f"{self.skips} optimizer steps had non-finite values, more than max_skips={self.max_skips}: "
            "training stopped before applying this one",
            epoch=alert.epoch,
            global_step=alert.global_step,
            value=float(self.skips),
            threshold=float(self.max_skips),
            source="skip_limit",
        )
        return Decision(Verdict.STOP, (*latched, limit))

    def decide_deferred(
        self,
        first_loss_step: int | None,
        first_grad_step: int | None,
        ctx: StepContext,
        details: Callable[[], NonFiniteDetails] = NonFiniteDetails,
    ) -> list[Alert]:
        """``"warn"`` mode's read-back: the first bad steps (over all ranks) since the last one, or ``None``.

        The updates were applied already; this only latches and alerts, naming the first bad step.
        """
        if first_loss_step is None and first_grad_step is None:
            self.clear()
            return []
        loss_bad = first_loss_step is not None
        step = first_loss_step if first_loss_step is not None else first_grad_step
        alert = self.alert(loss_bad, StepContext(ctx.epoch, ctx.global_step if step is None else step), details())
        return [alert] if self.latch.update(_kind(loss_bad), True) else []

    def clear(self) -> None:
        """A clean step: the episode is over and the scaler-overflow run is broken."""
        self.latch.update("loss", False)
        self.latch.update("gradients", False)
        self.scaler_overflows = 0

    def alert(self, loss_bad: bool, ctx: StepContext, details: NonFiniteDetails) -> Alert:
        """The critical ``nonfinite_loss`` (``loss_bad``) or ``nonfinite_grad`` alert for a step."""
        lr_text = ", ".join(f"{k}={v:.3g}" for k, v in details.learning_rates.items()) or "none"
        params_text = ", ".join(details.bad_parameters) or "none (the gradients are finite)"
        what = "the training loss is non-finite" if loss_bad else "a gradient is non-finite"
        message = (
            f"{what} at epoch {ctx.epoch}, global step {ctx.global_step}: {ACTION_TEXT[self.action]}. "
            f"Learning rates: {lr_text}. Non-finite gradients in: {params_text}. "
            f"Last finite loss: {float(details.last_finite_loss):.6g}."
        )
        if details.located:
            message += f" First non-finite value: {details.located}."
        return Alert(
            rule=NONFINITE_LOSS if loss_bad else NONFINITE_GRAD,
            severity=Severity.CRITICAL,
            message=message,
            epoch=ctx.epoch,
            global_step=ctx.global_step,
            value=None,
            threshold=None,
            source=details.source or _kind(loss_bad),
        )

    def state_dict(self) -> dict[str, Any]:
        """The counters of :attr:`state_keys` and the latch."""
        return {**{k: getattr(self, k) for k in self.state_keys}, "latch": self.latch.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output.

        Raises:
            KeyError: If a key is missing; the message names every missing key.
        """
        missing = [k for k in (*self.state_keys, "latch") if k not in state]
        if missing:
            raise KeyError(f"{type(self).__name__}.load_state_dict: missing state keys {missing}")
        for key in self.state_keys:
            setattr(self, key, int(state[key]))
        self.latch.load_state_dict(state["latch"])


def _kind(loss_bad: bool) -> str:
    return "loss" if loss_bad else "gradients"
