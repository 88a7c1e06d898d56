"""AnomalyAlarm's quiet batches: the batches whose end has nothing to do but keep the loss.

On such a batch the alarm's ``on_train_batch_end`` is switched off (Lightning then skips it) and the loss is kept
at ``on_before_backward`` instead, by reference, and handed on to the trends later, the same value at the same
global step; while such batches follow one another, their start takes a short path. :class:`QuietLossKeeping` is
that part of the alarm: the decision, the backward's short path, the hand-on, and the fall-back to the batch end
for anything they do not handle.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytorch_lightning as pl
import torch

from lightning_diag.callbacks.anomaly_alarm.nonfinite_guard import NonFiniteGuard
from lightning_diag.callbacks.anomaly_alarm.nonfinite_recovery import NonFiniteRecovery
from lightning_diag.callbacks.anomaly_alarm.runtime_checks import RuntimeChecks
from lightning_diag.callbacks.common.base import DiagCallback, extract_loss
from lightning_diag.stats.loss_sums import LossSums

__all__ = ["HAND_ON_EVERY", "QuietLossKeeping"]

#: The most quiet batches' losses held before they are handed on (whatever the logging interval).
HAND_ON_EVERY = 64


class QuietLossKeeping(DiagCallback):
    """A :class:`~lightning_diag.callbacks.common.base.DiagCallback` (the alarm) whose quiet batches keep their loss at
    ``on_before_backward``: the loss sums and ``loss_outlier`` get what the batch end would have given them, in
    the same order, by :meth:`_hand_on`.

    The subclass sets what is declared below (its helpers, and the batch's state its ``on_train_batch_start``
    finds) and calls :meth:`_decide_quiet` at the end of its full batch start; its short start of a batch that
    follows a quiet one (written there: it runs on most batches, one call fewer) sets ``_start_step``,
    ``_kept_step`` and ``_kept = False`` as :meth:`_decide_quiet` would.
    """

    #: Off on quiet batches (:meth:`quiet_batch`): the loss is kept at ``on_before_backward`` then.
    batch_hooks = ("on_train_batch_end",)

    # The subclass's helpers and fit settings.
    guard: NonFiniteGuard
    recovery: NonFiniteRecovery
    runtime: RuntimeChecks
    loss_sums: LossSums
    _note_loss: Callable[[Any], torch.Tensor | None]
    _keep_loss: Callable[[torch.Tensor, int], None]
    _due: float  # the global step from which the batch end has more to do (the step window, ...)
    _private_losses: bool  # automatic optimization: the hooks get Lightning's own loss
    _several_ranks: bool
    _no_session: bool
    # The current batch, as the subclass's `on_train_batch_start` found it.
    _log_batch: bool  # one of the user's logging batches
    _watched: bool  # the recovery compares the RNG state at its end
    _runtime_end: bool  # the run-time checks' batch end is due
    _start_step: float  # the global step it started at (``inf`` before a fit's first batch)

    def _init_quiet(self) -> None:
        """The quiet-batch state: whether a quiet batch may keep its loss at ``on_before_backward`` (found at every
        fit's start, :meth:`_keeps_at_backward`), whether the current batch's state is known (the base asks
        :meth:`quiet_batch` before the batch start has found it), whether a quiet batch's loss was kept, and the
        global step it is kept at."""
        self._loss_at_backward = False
        self._batch_known = False
        self._kept = True
        self._kept_step = 0
        # The quiet batches' losses (times the accumulation) and the global steps they are kept at, handed on to
        # the loss sums and `loss_outlier` at the next full batch start or before anything reads them (`_hand_on`)
        self._deferred: list[tuple[torch.Tensor, int]] = []

    def _hand_on(self) -> None:
        """Hand the quiet batches' losses kept since the last full batch start to the loss sums and
        ``loss_outlier``'s pending losses, in their order: what their batch ends would have done. Called at every
        full batch start and before anything reads those (an epoch's or a validation's end, a failing step's
        decision, the checkpoint's state, the fit's end)."""
        deferred = self._deferred
        if deferred:
            add, keep = self.loss_sums.add, self._keep_loss
            for loss, step in deferred:
                keep(add(loss, False), step)
            deferred.clear()

    def state_dict(self) -> dict[str, Any]:
        """The declared state, with the quiet batches' losses handed on first."""
        self._hand_on()
        return super().state_dict()

    def _start_quiet(self, trainer: pl.Trainer) -> None:
        """A fit's training starts (after the subclass set its fit settings)."""
        self._start_step = math.inf
        self._loss_at_backward = self._keeps_at_backward(trainer)
        self._kept = True

    def _keeps_at_backward(self, trainer: pl.Trainer) -> bool:
        """Whether a quiet batch's loss can be kept at ``on_before_backward``, the same value and step as its batch
        end would keep: automatic optimization (Lightning's ``closure_loss``, the loss divided by the accumulation,
        is what it hands the batch end as ``outputs["loss"]``), no gradient scaler (the hook would get the scaled
        loss), an optimizer that runs its closure once per step (not L-BFGS), one rank without rollback, a session
        (its step axis tells whether the batch steps) and a known number of batches the fit loop steps by."""
        return (
            self._private_losses
            and not self._several_ranks
            and not self.recovery.rollback_enabled
            and not self._no_session
            and getattr(trainer.precision_plugin, "scaler", None) is None
            and not any(isinstance(o, torch.optim.LBFGS) for o in trainer.optimizers)
            and not trainer.strategy.handles_gradient_accumulation
            and isinstance(trainer.num_training_batches, int)
        )

    def _decide_quiet(self, trainer: pl.Trainer) -> None:
        """The end of the full batch start: switch the batch end off for a quiet batch, back on for the others
        (nothing when :attr:`batch_hooks` is emptied: the batch end then runs on every batch)."""
        if not self.batch_hooks:
            return
        self._batch_known = True
        off = self.quiet_batch(trainer)
        if off is not self._hooks_off:
            self.switch_batch_hooks(off=off)
        self._kept = not off

    def quiet_batch(self, trainer: pl.Trainer) -> bool:
        """Whether the batch end has nothing to do but keep the loss (kept at ``on_before_backward`` instead): the
        loss can be kept there (:meth:`_keeps_at_backward`), the batch logs nothing, the step window is not due at
        its end, the recovery does not watch it, and the run-time checks' batch end is not due. Decided at the end
        of the batch start (the base's earlier question leaves the hooks as they are)."""
        if not self._batch_known:
            return self._hooks_off
        return (
            self._loss_at_backward
            and not self._log_batch
            and not self._watched
            and not self._runtime_end
            and self._start_step + 1 < self._due
        )

    def _missed_loss(self, trainer: pl.Trainer) -> None:
        """A quiet batch ran no backward (``training_step`` returned None): tell it as its batch end would have."""
        self._kept = True
        _, problem = extract_loss({})
        if problem is not None:
            self.notice(trainer, "loss:" + problem.split(":")[0], problem)

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        """Remember this micro-batch's loss for the check at the optimizer step (a reference, or a copy of the
        user's own loss under manual optimization); on a quiet batch also keep it for the loss sums and
        ``loss_outlier``, as its batch end would have."""
        if not self._kept and type(loss) is torch.Tensor and loss.dtype is torch.float32 and not loss.dim():
            # a quiet batch's first backward: Lightning's own `closure_loss` (see `_keeps_at_backward`), kept by
            # reference for the guard (its `.data`) and, for the trends, handed on later (`_hand_on`)
            self._kept = True
            held = loss.data
            self.guard.held.append(held)
            accumulate = trainer.accumulate_grad_batches
            deferred = self._deferred
            deferred.append((held * accumulate if accumulate > 1 else held, self._kept_step))
            if len(deferred) >= HAND_ON_EVERY:  # a long quiet run (a large logging interval) holds few at a time
                self._hand_on()
            return
        kept = self._note_loss(loss)
        if self._hooks_off:
            self._keep_backward_loss(trainer, kept)

    def _keep_backward_loss(self, trainer: pl.Trainer, loss: torch.Tensor | None) -> None:
        """Keep a quiet batch's loss that :meth:`on_before_backward`'s short path did not: the guard's reference
        to Lightning's ``closure_loss`` (its ``.data``: no copy, nothing writes it again) times the accumulation, at
        the global step of the batch's end. Any other form, or a second backward in the batch, switches the batch
        end back on (for the rest of the fit: it handles those)."""
        if self._kept or loss is None or loss.dtype is not torch.float32:
            self._loss_at_backward = False
            if not self._kept:  # this batch's end keeps it
                self.switch_batch_hooks(off=False)
                self._kept = True
            return
        self._kept = True
        value = loss
        accumulate = trainer.accumulate_grad_batches
        if accumulate > 1:
            value = value * accumulate  # the batch end's scale
        self._deferred.append((value, self._kept_step))
        if len(self._deferred) >= HAND_ON_EVERY:
            self._hand_on()
