"""The measurements the driver computes once a step for every callback that reads them (issue 43).

A callback names what it needs from the closed set :class:`Shared` (its class attribute ``shared_requests``): the
driver asks for them on the steps of that callback's logging cadence (:meth:`SharedMeasurements.decide`, from
:meth:`~lightning_diag.callbacks.common.driver.Driver.batch_started`). On such a step the first reader, whichever
callback's part runs first in ``trainer.callbacks`` order, computes them (:meth:`SharedMeasurements.gradient_squares`)
and every reader of the step gets the same object; on a step where nothing is requested a reader gets ``None`` and
measures what it needs itself (one set lookup: the quiet step does no more work).

The set holds what several callbacks read on one step today: the squared norms of an optimizer's gradients
(``GradientFlowMonitor``'s layer norms, and the non-finite guard's check of every gradient, which reads them in place of
its own pass) and of its parameters (``GradientFlowMonitor``'s relative gradients and update ratios), computed together
in one fused pass when both are requested; and the step's training loss on the host (``STEP_LOSS``:
``GradientFlowMonitor``'s measurement copies it to the host with its norms, for ``grad_collapse``; ``AnomalyAlarm``
logs it as ``diag/loss/train_step`` at the batch's end), read once when both read the same quantity
(:meth:`SharedMeasurements.offer_loss`).

The driver also owns the forward hooks of a hooked step (:attr:`SharedMeasurements.hooks`, a
:class:`~lightning_diag.instrument.forward_hooks.ForwardHooks`): the watches that read the model's forward
(``GradientFlowMonitor``'s activation watch: the modules' inputs; ``AnomalyAlarm``'s ``zero_output`` and
``output_collapse`` watches: the modules' outputs, on the same cadence steps) ask it for the modules they read, and each
module gets at most one pre-hook and one forward hook, dispatching to every watch that asked; the hooks come off when
the watches leave after the step's forward (none on a quiet step).
"""

from __future__ import annotations

import enum
from typing import Any

import torch

from lightning_diag.instrument.forward_hooks import ForwardHooks
from lightning_diag.instrument.grad_measure import GradientSquares

__all__ = ["NOTHING", "Shared", "SharedMeasurements", "step_loss_shared"]


class Shared(enum.Enum):
    """The closed set of measurements a callback may request from the driver."""

    #: The squared L2 norm of each gradient of an optimizer's parameters (a
    #: :class:`~lightning_diag.instrument.grad_measure.GradientSquares`).
    GRADIENT_SQUARES = "gradient_squares"
    #: The squared L2 norm of each of those parameters, in the same record (its ``weights``); measured with the
    #: gradients' in one pass, so it implies :attr:`GRADIENT_SQUARES`.
    WEIGHT_SQUARES = "weight_squares"
    #: The training loss of the batch on the host, as a ``float``: the first reader whose host copy carries it offers
    #: it (:meth:`SharedMeasurements.offer_loss`), the later readers of the batch take it
    #: (:meth:`SharedMeasurements.step_loss`) in place of their own read.
    STEP_LOSS = "step_loss"


#: No measurement requested.
NOTHING: frozenset[Shared] = frozenset()

#: What the memo holds for an optimizer whose gradients could not be measured (no gradient, sharded parameters).
_UNMEASURED = object()


class SharedMeasurements:
    """The driver's requested measurements of the current training batch and its memo of the values computed.

    Attributes:
        requested: What the callbacks on their cadence in the current batch requested (:meth:`decide`).
        loss_shared: Whether the fit's step loss is one quantity for every reader (:func:`step_loss_shared`, set by
            the driver at the fit's start): else no loss is offered, each reader reads its own.
        hooks: The forward hooks of the trainer's hooked steps: one pre-hook and one forward hook per module at
            most, shared by every watch of the step.
    """

    def __init__(self) -> None:
        self.requested: frozenset[Shared] = NOTHING
        self.loss_shared = False
        self.hooks = ForwardHooks()
        self._step: int | None = None
        self._values: dict[int, Any] = {}  # id(optimizer) -> its GradientSquares (or _UNMEASURED) at `_step`
        self._loss: tuple[int, float] | None = None  # (the driver's batch count, the loss read in that batch)

    def decide(self, requested: frozenset[Shared]) -> None:
        """The requests of a new training batch (the union of those of the callbacks on their cadence)."""
        self.requested = requested

    def clear(self) -> None:
        """Drop the requests and every value computed, and any forward hook left (a new fit)."""
        self.requested = NOTHING
        self.hooks.clear()
        self._step = None
        self._values = {}
        self._loss = None

    def offer_loss(self, batch: int, value: float) -> None:
        """The host value of the training loss of the driver's ``batch`` (its count of decided batches), read by a
        callback in a host copy it made anyway: kept for the batch's later readers when :attr:`Shared.STEP_LOSS` is
        requested in the batch and the fit's loss is one quantity for every reader (:attr:`loss_shared`).

        The offerer guarantees ``value`` is the batch's one micro-batch loss, as Lightning hands the hooks a
        ``float32`` 0-d tensor, on this rank, converted to ``float`` exactly (``float(loss)``'s value)."""
        if self.loss_shared and Shared.STEP_LOSS in self.requested:
            self._loss = (batch, value)

    def step_loss(self, batch: int) -> float | None:
        """The training loss of the driver's ``batch`` that a reader offered (:meth:`offer_loss`), or ``None``: the
        caller reads its own (no loss offered in that batch, or several quantities). A loss that was not finite is
        offered as it was read (``nan`` or ``inf``, the value ``float(loss)`` gives)."""
        loss = self._loss
        return loss[1] if loss is not None and loss[0] == batch else None

    def gradient_squares(self, optimizer: torch.optim.Optimizer, step: int) -> GradientSquares | None:
        """The squared norms of ``optimizer``'s gradients at global ``step`` (with its parameters' when
        :attr:`Shared.WEIGHT_SQUARES` is requested), computed at the step's first call and the same object at the
        others. ``None`` when not requested in this batch, or when they cannot be measured (no gradient, sharded
        parameters): the caller measures its own.

        A reader checks that the record still describes its gradients (``GradientSquares.covers`` /
        ``rows_of``: a gradient dropped or changed in place since is not in it)."""
        requested = self.requested
        if Shared.GRADIENT_SQUARES not in requested and Shared.WEIGHT_SQUARES not in requested:
            return None
        if step != self._step:
            self._step = step
            self._values = {}
        found = self._values.get(id(optimizer))
        if found is None:
            params = [p for group in optimizer.param_groups for p in group["params"]]
            found = GradientSquares.measure(params, weights=Shared.WEIGHT_SQUARES in requested)
            self._values[id(optimizer)] = _UNMEASURED if found is None else found
        return None if found is _UNMEASURED else found


def step_loss_shared(trainer: Any) -> bool:
    """Whether a fit's step loss is one quantity for the callbacks that read it on the host: the loss
    ``on_before_backward`` gets is the one Lightning hands ``on_train_batch_end`` (``outputs["loss"]``, its detached
    clone), on one rank. That needs automatic optimization (Lightning's own ``closure_loss``), no gradient
    accumulation (the batch end's loss is the last micro-batch's, the measurement's their sum), no gradient scaler
    (``on_before_backward`` would get the scaled loss) and one process (the measurement's loss is the mean over the
    ranks, the logged one this rank's).

    Args:
        trainer: The fitting trainer.
    """
    module = trainer.lightning_module
    return (
        module is not None
        and bool(module.automatic_optimization)
        and trainer.accumulate_grad_batches == 1
        and trainer.world_size == 1
        and getattr(trainer.precision_plugin, "scaler", None) is None
    )
