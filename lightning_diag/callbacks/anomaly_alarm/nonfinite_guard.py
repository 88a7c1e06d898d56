"""The Lightning side of the non-finite policy: find what an optimizer step looks like, carry out the verdict.

:class:`NonFiniteGuard` turns the micro-batch losses and the gradients about to be applied into
:class:`~lightning_diag.rules.verdicts.StepFindings` agreed over all ranks (one exact fused pass, one
1-element read and, with several ranks, one collective per optimizer step), asks the policy
(:mod:`lightning_diag.rules.nonfinite`) and performs its :class:`~lightning_diag.rules.verdicts.Decision`
(:meth:`NonFiniteGuard.perform`). In ``"warn"`` mode it keeps
the first bad steps on the device until a logging step reads them back (:meth:`NonFiniteGuard.read_back`).
:class:`~lightning_diag.AnomalyAlarm` owns one and calls it from its hooks.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

import pytorch_lightning as pl
import torch

from lightning_diag.callbacks.anomaly_alarm.guard_pass import OptimizerPass
from lightning_diag.callbacks.anomaly_alarm.lr_logging import learning_rates
from lightning_diag.callbacks.common.reduction import Reduced, reduce_state
from lightning_diag.core.alerts import Alert
from lightning_diag.rules.base import StepContext
from lightning_diag.rules.measures import Measures, Rollback
from lightning_diag.rules.verdicts import Decision, NonFiniteDetails, StepFindings, Verdict
from lightning_diag.stats.grad import local_tensor
from lightning_diag.stats.loss_sums import LossSums
from lightning_diag.stats.norms import finite_probe, nonfinite_flag
from lightning_diag.stats.reduced import ReducedState, Reduction

if TYPE_CHECKING:
    from lightning_diag.callbacks.anomaly_alarm.nonfinite_recovery import NonFiniteRecovery
    from lightning_diag.callbacks.common.base import DiagCallback

__all__ = [
    "NO_STEP",
    "DeferredFindings",
    "NonFiniteError",
    "NonFiniteGuard",
    "VerdictPolicy",
    "drop_gradients",
    "is_finite",
    "nonfinite_details",
]

#: "No bad step seen": the identity of the MIN over ranks of warn mode's first bad steps.
NO_STEP = 2**62
_SHOWN_PARAMS = 5
#: Micro-batch losses held between two optimizer steps before they are folded into one flag value.
_MAX_HELD_LOSSES = 64
#: What :meth:`NonFiniteGuard.check_step` returns for a step found clean (the quiet path builds nothing).
_CLEAN = StepFindings(loss_bad=False, grad_bad=False)
#: This rank's findings of a clean step.
_NOTHING_LOCAL = (False, False)


class VerdictPolicy(Protocol):
    """What the guard asks of its owner's non-finite detector (``nonfinite_loss`` / ``nonfinite_grad``'s, a
    detector of the owner's preset), whose verdicts it carries out."""

    @property
    def action(self) -> str:
        """The ``on_nonfinite`` action the verdicts follow."""

    def decide(
        self, findings: StepFindings, ctx: StepContext, details: Callable[[], NonFiniteDetails] = ...
    ) -> Decision:
        """The verdict and alerts for one optimizer step that showed ``findings``."""

    def decide_deferred(
        self,
        first_loss_step: int | None,
        first_grad_step: int | None,
        ctx: StepContext,
        details: Callable[[], NonFiniteDetails] = ...,
    ) -> list[Alert]:
        """``"warn"`` mode's alerts for the first bad steps since the last read-back."""

    def clear(self) -> None:
        """A clean step: the episode is over."""


class NonFiniteError(RuntimeError):
    """Raised by :class:`~lightning_diag.AnomalyAlarm` with ``on_nonfinite="raise"`` instead of applying a
    non-finite update.

    Attributes:
        alert: The critical alert that was written before raising.
    """

    def __init__(self, alert: Alert) -> None:
        super().__init__(alert.message)
        self.alert = alert


class DeferredFindings(ReducedState):
    """``"warn"`` mode's findings, kept on the device between read-backs: the first bad ``loss_step`` and
    ``grad_step`` since the last read-back, declared with ``MIN`` (:data:`NO_STEP`: none; device tensors between
    read-backs), and :attr:`steps`, the steps checked since then (the same count on every rank).

    Declared on the alarm (``add_state``): saved merged over every rank, restored at a resume.

    Example:
        >>> found = DeferredFindings()
        >>> found.defer(6, torch.tensor(True), torch.tensor(False))
        >>> found.defer(7, None, torch.tensor(True))
        >>> found.state_dict()
        {'loss_step': 6.0, 'grad_step': 7.0, 'steps': 2}
    """

    def __init__(self) -> None:
        super().__init__()
        self.add_state("loss_step", NO_STEP, Reduction.MIN)
        self.add_state("grad_step", NO_STEP, Reduction.MIN)
        self.steps = 0

    def defer(self, step: int, loss_bad: torch.Tensor | None, grad_bad: torch.Tensor) -> None:
        """Fold one checked step's flags in (``None``: no loss to test), on the device."""
        self.steps += 1
        for name, bad in (("loss_step", loss_bad), ("grad_step", grad_bad)):
            if bad is None:
                continue
            current = self[name]
            if isinstance(current, torch.Tensor):
                current = current.to(bad.device)
            else:  # a number before the first step or after a restore: a fill on the device, no host copy
                current = torch.full((), int(current), dtype=torch.long, device=bad.device)
            self[name] = torch.where(bad, current.clamp(max=step), current)

    def read(
        self, trainer: pl.Trainer, device: torch.device, reduced: Reduced | None = None
    ) -> tuple[int | None, int | None] | None:
        """The first bad loss and gradient steps over all ranks since the last read-back.

        ``None`` when no step was checked since then (no news); otherwise ``(loss_step, grad_step)``, each
        ``None`` if there was none. Every rank calls this at the same steps (it is a collective), unless the driver
        reduced them already with every callback's values at this point (``reduced``, by ``(id(state), names)``).
        """
        if not self.steps:
            return None
        self.steps = 0
        first = reduced.get((id(self), tuple(self))) if reduced else None
        if first is None:
            first = reduce_state(trainer, self, device=device)
        # Back to "none" as device tensors: the next steps update them without a copy from the host.
        for name in ("loss_step", "grad_step"):
            self[name] = torch.full((), NO_STEP, dtype=torch.long, device=device)
        return _step_or_none(first["loss_step"]), _step_or_none(first["grad_step"])

    def state_dict(self) -> dict[str, Any]:
        """The first bad steps (floats; :data:`NO_STEP`: none) and ``steps``."""
        return {**super().state_dict(), "steps": self.steps}

    def load_state_dict(self, state: Mapping[str, Any], strict: bool = True) -> None:
        """Restore :meth:`state_dict` output.

        Raises:
            KeyError: If a key is missing; the message names every missing one.
        """
        if "steps" not in state:
            raise KeyError(f"{type(self).__name__}.load_state_dict: missing state keys ['steps']")
        super().load_state_dict(state, strict)
        self.steps = int(state["steps"])


class NonFiniteGuard:
    """Finds the non-finite steps, asks the policy and carries out its decisions for a callback.

    Args:
        owner: The callback whose ``record``, ``writer`` and ``context`` the guard uses.
        policy: The decisions (and the counts and latch that span steps).

    Attributes:
        halted: Set by a ``STOP`` verdict: every later step of the fit is dropped.
        deferred: ``"warn"`` mode's findings not read back yet.
    """

    def __init__(
        self,
        owner: DiagCallback,
        policy: VerdictPolicy,
        recovery: NonFiniteRecovery | None = None,
        losses: LossSums | None = None,
        deferred: DeferredFindings | None = None,
    ) -> None:
        self.owner = owner
        self.policy = policy
        #: Localisation (replay) and rollback, when the callback has them.
        self.recovery = recovery
        #: The training losses, whose last finite one the alerts tell (their own record when none is given).
        self.losses = losses if losses is not None else LossSums(baseline_steps=0)
        #: This rank's own (loss_bad, grad_bad) of the step being checked, before the agreement over ranks.
        self.local_findings = (False, False)
        self.halted = False
        #: The micro-batch losses since the last step, detached (0-d; a larger loss as 0 or NaN): their finiteness
        #: is tested with the gradients' in one pass at the optimizer step. The same list for the guard's life
        #: (emptied in place): an owner may append a 0-d floating loss it keeps by reference, as :meth:`note_loss`
        #: does under :attr:`keep_references`.
        self.held: list[torch.Tensor] = []
        #: Called before a step that fails the quiet path is decided (the owner hands on what it deferred).
        self.before_decide: Callable[[], None] = _nothing
        #: Keep the loss handed to :meth:`note_loss` by reference instead of copying it: set by the owner under
        #: Lightning's automatic optimization, where that loss is Lightning's own ``training_step`` output divided by
        #: the accumulation (computed eagerly, so never in a compiled model's CUDA-graph memory, and read by nothing
        #: after its backward). The user's own loss (manual optimization) is copied.
        self.keep_references = False
        self.deferred = deferred if deferred is not None else DeferredFindings()
        # Whether the policy may hold a latch or an overflow run that a clean step clears (a bad step was decided,
        # or a checkpoint restored them): a clean step otherwise leaves it alone.
        self._policy_dirty = True
        # Per optimizer (by id): its parameters, gathered from its groups while their lists stay the same.
        # Per optimizer (by id): its parameters and the pass's flag (reused while it stays 0, zeroed after a step
        # that set it).
        self._params: dict[int, OptimizerPass] = {}
        # Whether one process trains (found at the first check: the same for the whole fit, this guard's life).
        self._single: bool | None = None
        # "warn" mode: the findings stay on the device (the policy's action is fixed for the guard's life).
        self._defer = policy.action == "warn"
        # The optimizers (by id) whose steps take the quiet path of `before_optimizer_step`: one process, a guarding
        # mode, parameters that are not sharded (entered by `check_step`).
        self._quick: dict[int, OptimizerPass] = {}

    def note_loss(self, loss: Any) -> torch.Tensor | None:
        """Remember a micro-batch loss (a reference under :attr:`keep_references`, else a 0-d copy): it is tested
        for NaN/Inf with the gradients at the optimizer step. Anything but a tensor is ignored.

        Returns:
            The tensor kept for a 0-d floating loss (its ``.data`` or the copy), else ``None``.
        """
        kept: torch.Tensor | None = None
        if type(loss) is torch.Tensor and loss.dim() == 0 and loss.is_floating_point():  # the usual loss
            # `.data`: the same memory without autograd and with a version counter of its own: the CPU check, which
            # writes every value back unchanged (x 1.0), can neither bump the loss's version nor record a graph.
            # Otherwise a copy: the user's tensor is not written, and with accumulation a compiled model's next
            # forward can overwrite its output memory before the step (CUDA graphs).
            kept = loss.data if self.keep_references else loss.detach().clone()
            self.held.append(kept)
        elif not isinstance(loss, torch.Tensor):
            return None
        else:
            loss = local_tensor(loss.detach())
            if loss.dim() != 0:  # finite exactly when every element is
                loss = torch.where(torch.isfinite(loss).all(), 0.0, math.nan)
            elif not loss.is_floating_point():  # an integer is finite; the fused check reads floating dtypes
                loss = loss.float()
            else:
                loss = loss.clone()
            self.held.append(loss)
        if len(self.held) > _MAX_HELD_LOSSES:  # many backward passes without a step (manual optimization)
            self.held[:] = [torch.where(_any_nonfinite(self.held), math.nan, 0.0)]
        return kept

    @property
    def last_finite_loss(self) -> torch.Tensor | float:
        """The last finite training loss (of :attr:`losses`: a 0-d device tensor once one was seen, else nan)."""
        return self.losses.last_finite

    @last_finite_loss.setter
    def last_finite_loss(self, value: torch.Tensor | float) -> None:
        self.losses.last_finite = value

    def details(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> NonFiniteDetails:
        """What an alert about the current step tells (read only on the failure path).

        With a recovery that localises, the failing step is replayed here (on one rank, a collective: every rank
        calls this at the same step, as the policy asks for details of agreed findings only).
        """
        details = nonfinite_details(trainer, pl_module, float(self.last_finite_loss))
        if self.recovery is None:
            return details
        found = self.recovery.localise(trainer, pl_module, *self.local_findings)
        if not found.found:
            return details
        return dataclasses.replace(details, source=found.source, located=found.detail)

    def before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        """Check the step ``optimizer`` is about to take and carry out the policy's verdict.

        Raises:
            NonFiniteError: If the verdict is ``RAISE``.
        """
        # The quiet path: the pass over the gradients and the losses, its one read, nothing else. Anything else (no
        # gradient, a changed parameter list, a failing pass, a halted fit) takes the path below, which finds out
        # what it is (a failing pass is then run again: the reused flag, still set, makes it fail again).
        params = self._quick.get(id(optimizer))
        if params is not None and params.matches(optimizer.param_groups):
            losses = self.held
            # on a step where they are requested the gradients' squared norms are the driver's, measured once for
            # every reader (whichever reads first): one read of the gradients per step
            known = self.owner.shared_gradient_squares(trainer, optimizer)
            clean = params.clean_measured(losses, known) if known is not None else None
            if clean if clean is not None else params.clean(losses):
                if losses:
                    losses.clear()
                if self._policy_dirty:
                    self.local_findings = _NOTHING_LOCAL
                    self.policy.clear()
                    self._policy_dirty = False
                if self.recovery is not None:
                    self.recovery.on_step_checked()
                return
        if self.halted:
            self.held.clear()
            drop_gradients(optimizer)
            return
        self.before_decide()
        try:
            findings = self.check_step(trainer, optimizer, self._defer)
            if findings is _CLEAN:
                if self._policy_dirty:  # what `decide` does for a clean step, without building its context
                    self.policy.clear()
                    self._policy_dirty = False
            elif findings is not None:
                self._policy_dirty = True
                decision = self.policy.decide(
                    findings, self.owner.context(trainer), lambda: self.details(trainer, pl_module)
                )
                if decision.verdict is Verdict.ROLLBACK:
                    decision = self.roll_back(decision, findings, trainer, pl_module)
                self.perform(decision, trainer, optimizer)
        finally:
            if self.recovery is not None:
                self.recovery.on_step_checked()

    def roll_back(
        self, decision: Decision, findings: StepFindings, trainer: pl.Trainer, pl_module: pl.LightningModule
    ) -> Decision:
        """Carry out a ``ROLLBACK`` verdict on a step that showed ``findings``: restore a snapshot (the
        ``nonfinite_rollback`` warning), or, when the rollback rule has none left, turn it into a ``STOP`` with a
        ``rollback_limit`` critical alert."""
        alert = decision.error
        if self.recovery is None or alert is None:  # pragma: no cover - the alarm always wires both
            return Decision(Verdict.STOP, decision.alerts)
        for opt in trainer.optimizers:
            drop_gradients(opt)
        choice = self.recovery.rollback(trainer, pl_module)
        if choice.step is None:
            limit = dataclasses.replace(
                alert,
                message=f"{alert.message} No rollback: {choice.reason}; training stops.",
                source="rollback_limit",
                value=float(self.recovery.rule.rollbacks),
                threshold=float(self.recovery.rule.max_rollbacks),
            )
            return Decision(Verdict.STOP, (limit,))
        what = "NaN/Inf in the loss" if findings.loss_bad else "NaN/Inf in a gradient"  # as the policy's alert
        located = alert.message.split(" First non-finite value: ", 1)
        if len(located) == 2:
            what += "; " + located[1].rstrip(".")
        made = Rollback(choice.step, what, alert.source, choice.reason)  # the owner's preset judges the rollback
        return Decision(Verdict.SKIP, tuple(self.owner.feed(self.owner.context(trainer), Measures(rollback=made))))

    def perform(self, decision: Decision, trainer: pl.Trainer, optimizer: torch.optim.Optimizer) -> None:
        """Carry out a verdict on the step ``optimizer`` is about to take, and record the decision's alerts.

        Raises:
            NonFiniteError: If the verdict is ``RAISE`` (after the alerts are recorded and flushed).
        """
        if decision.verdict is Verdict.RAISE:
            self.owner.record(decision.alerts)
            self.owner.writer.flush()
            raise NonFiniteError(decision.error or decision.alerts[0])
        if decision.verdict is not Verdict.APPLY:
            drop_gradients(optimizer)
        if decision.verdict is Verdict.STOP:
            self.halted = True
            self._quick.clear()  # every later step takes the halted path
            trainer.should_stop = True
            for opt in trainer.optimizers:
                drop_gradients(opt)
        self.owner.record(decision.alerts)

    def read_back(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        reduced: Reduced | None = None,
    ) -> None:
        """``"warn"`` mode: read the deferred findings back (over all ranks: ``reduced``, the driver's values of
        this point, or reduced here) and record what the policy makes of them."""
        found = self.deferred.read(trainer, pl_module.device, reduced)
        if found is not None:
            self._policy_dirty = True
            details = lambda: self.details(trainer, pl_module)  # noqa: E731
            self.owner.record(self.policy.decide_deferred(*found, self.owner.context(trainer), details))

    def check_step(self, trainer: pl.Trainer, optimizer: torch.optim.Optimizer, defer: bool) -> StepFindings | None:
        """The findings of the step ``optimizer`` is about to take, over all ranks.

        With ``defer`` (``"warn"`` mode) nothing is read back: the first bad steps stay on the device in
        :attr:`pending` and this returns ``None``. It also returns ``None`` when there is nothing to check.
        """
        losses = list(self.held)
        self.held.clear()
        params = self._params.get(id(optimizer))
        if params is None or not params.matches(optimizer.param_groups):
            params = self._parameters(optimizer)
        grads = params.gradients()
        if params.sharded:
            grads = [local_tensor(g) for g in grads]  # under sharded training: this rank's own shards
        if not grads:
            if not losses:
                return None
            found = torch.zeros(1, device=losses[0].device)
        else:
            found = params.found
        if defer:
            # warn mode reads nothing back per step: the exact flags stay on the device
            device = found.device
            grad_bad = nonfinite_flag(grads, torch.zeros(1, device=device)).reshape(()) > 0
            loss_bad = _any_nonfinite([loss.to(device) for loss in losses]) if losses else None
            self.deferred.defer(trainer.global_step, loss_bad, grad_bad)
            return None
        # One fast pass over the gradients and the losses together, 0 only if all are finite, and, to decide on
        # the host whether to apply the update, one read of one number per optimizer step.
        probe = finite_probe(grads + losses if losses else grads, found, params.sums if grads else None)
        single = self._single
        if single is None:
            single = self._single = trainer.world_size <= 1
        if single and not params.sharded:
            self._quick[id(optimizer)] = params
        if not (probe.item() != 0 if single else _agree(trainer, probe != 0)[1][0]):
            self.local_findings = _NOTHING_LOCAL
            return _CLEAN
        scaler = getattr(trainer.precision_plugin, "scaler", None) is not None
        # Some rank's pass failed (every rank sees the same agreed flag and takes this path): a NaN/Inf, or an L2
        # norm that overflowed. Which part, exactly (the losses' own test, the exact check of the gradients), with
        # one more collective. The reused flag is zeroed here only: a clean step leaves it at 0.
        found.zero_()
        device = found.device
        loss_bad = _any_nonfinite([loss.to(device) for loss in losses]) if losses else torch.zeros((), dtype=torch.bool)
        grad_bad = nonfinite_flag(grads, torch.zeros(1, device=device)).reshape(()) > 0
        local, agreed = _agree(trainer, torch.stack([loss_bad.to(device), grad_bad]))
        self.local_findings = (local[0], local[1])
        return StepFindings(loss_bad=agreed[0], grad_bad=agreed[1], scaler_active=scaler)

    def _parameters(self, optimizer: torch.optim.Optimizer) -> OptimizerPass:
        """``optimizer``'s parameters, found again only when its groups' parameter lists change."""
        lists = optimizer.param_groups
        known = self._params.get(id(optimizer))
        if known is None or not known.matches(lists):
            known = self._params[id(optimizer)] = OptimizerPass(lists)
        return known


def _nothing() -> None:
    pass


def _agree(trainer: pl.Trainer, flags: torch.Tensor) -> tuple[list[bool], list[bool]]:
    """This rank's boolean ``flags`` and their OR over all ranks, in one host read (and one collective: a SUM every
    strategy supports, on the device, when there are several ranks)."""
    if trainer.world_size <= 1:
        local = [bool(v) for v in flags.tolist()]
        return local, local
    counts = flags.to(device=trainer.strategy.root_device, dtype=torch.float32)
    agreed = trainer.strategy.reduce(counts, reduce_op="sum") > 0
    both = [bool(v) for v in torch.cat([flags.to(agreed.device), agreed]).tolist()]
    return both[: len(flags)], both[len(flags) :]


def is_finite(values: torch.Tensor) -> torch.Tensor:
    """``torch.isfinite(values)`` for a floating tensor in two kernels (``torch.isfinite`` runs four): ``x * 0`` is
    0 for every finite ``x`` and NaN for NaN and +-Inf.

    Example:
        >>> is_finite(torch.tensor([1.0, float("nan"), float("-inf"), 3e38])).tolist()
        [True, False, False, True]
    """
    return (values * 0) == 0


def _nonfinite(values: torch.Tensor) -> torch.Tensor:
    """``~torch.isfinite(values)`` in two kernels (see :func:`is_finite`)."""
    return (values * 0) != 0


def _any_nonfinite(losses: list[torch.Tensor]) -> torch.Tensor:
    """A 0-d boolean tensor: whether any of the 0-d ``losses`` is NaN/Inf."""
    return _nonfinite(torch.stack(losses)).any()


def _step_or_none(value: float) -> int | None:
    return None if value >= NO_STEP else int(value)


def drop_gradients(optimizer: torch.optim.Optimizer) -> None:
    """Set every ``.grad`` of ``optimizer`` to ``None``.

    torch optimizers skip parameters whose ``.grad`` is ``None``: no parameter, moment or step count changes.
    """
    for group in optimizer.param_groups:
        for p in group["params"]:
            p.grad = None


def nonfinite_details(trainer: pl.Trainer, pl_module: pl.LightningModule, last_finite_loss: float) -> NonFiniteDetails:
    """What a non-finite alert tells: learning rates, parameters with a non-finite gradient, the last finite loss."""
    # Only on the failure path: a per-parameter loop here is fine.
    bad: list[str] = []
    for name, p in pl_module.named_parameters():
        # under sharded training: this rank's own shards
        if p.grad is not None and not bool(torch.isfinite(local_tensor(p.grad)).all()):
            bad.append(name)
            if len(bad) >= _SHOWN_PARAMS:
                bad.append("...")
                break
    return NonFiniteDetails(learning_rates(trainer), tuple(bad), float(last_finite_loss))
