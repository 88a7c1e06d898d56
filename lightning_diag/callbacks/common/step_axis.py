"""The user's step axis (:class:`StepAxis`): one per trainer, held by its driver and shared by every lightning_diag
callback on it."""

from __future__ import annotations

import collections
from typing import Any

import pytorch_lightning as pl

__all__ = ["STEP_AXIS_KEY", "StepAxis"]

#: Top-level checkpoint key of the step axis (:class:`StepAxis`), shared by every lightning_diag callback.
STEP_AXIS_KEY = "lightning_diag_step_axis"


class StepAxis:
    """The user's step axis: the number of training batches that stepped, as Lightning's ``self.log`` counts them.

    Lightning logs ``self.log`` values, ``LearningRateMonitor`` and ``DeviceStatsMonitor`` at the number of
    batches whose optimizer stepped (one per batch under manual optimization, whatever the number of optimizers;
    one per ``accumulate_grad_batches`` batches, and the last of an epoch, under automatic optimization), not at
    ``trainer.global_step``, which counts ``optimizer.step()`` calls (two per batch in a two-optimizer GAN). This
    counts those batches from public hooks and attributes only: :meth:`batch_started` is called by the trainer's
    driver from the first lightning_diag callback's ``on_train_batch_start`` (once per batch, whatever the number of
    callbacks).

    :attr:`step` is what a series written now is logged at: during a batch, the number of stepping batches
    before it (the step Lightning logs that batch's ``self.log`` values at); between batches (validation, epoch
    end), that of the last batch; from an epoch's start (:meth:`epoch_started`), the count including the last
    batch, as Lightning's. Its state travels in the checkpoint (:data:`STEP_AXIS_KEY`).
    """

    _HISTORY = 256

    def __init__(self) -> None:
        self.stepped = 0  # stepping batches before the current one
        self.pending = False  # whether the current batch steps (counted when the next one starts)
        self._batch: int | tuple[int, int, int] | None = None
        self._rule: _EpochRule | None = None
        self._global_steps: collections.deque[tuple[int, int]] = collections.deque(maxlen=self._HISTORY)
        #: The global step the current (or last) training batch started at, as :meth:`batch_started` read it.
        self.started_at = 0

    @property
    def step(self) -> int:
        """The step on the user's axis of what is written now."""
        return self.stepped

    @property
    def cadence_step(self) -> int:
        """The count Lightning's logging interval divides: ``step + 1``.

        Lightning writes a batch's ``self.log`` values when ``(stepped + 1) % log_every_n_steps == 0`` (its
        ``should_update_logs``, checked before the count moves past the batch) on a batch whose optimizer steps,
        at :attr:`step`. A measurement taken while ``cadence_step % every == 0`` is written on a step the user's
        metrics use: every micro-batch of such an optimizer step has it (a gradient is measured on the last).
        """
        return self.stepped + 1

    def logs(self, every: int) -> bool:
        """Whether the current batch is one Lightning writes the user's step metrics at, for the interval
        ``every``: it steps (:attr:`pending`) and :attr:`cadence_step` is a multiple of ``every``."""
        return self.pending and self.cadence_step % every == 0

    def batch_started(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch_idx: int) -> bool:
        """A training batch starts (idempotent within one batch: a second call in the batch costs one comparison).
        Called by the trainer's driver (:meth:`Driver.batch_started
        <lightning_diag.callbacks.common.driver.Driver.batch_started>`), once per batch.

        Returns:
            Whether the call counted a new batch (``False``: the batch was counted already).

        Runs on every batch, after the optimizer step has pushed the callbacks' code and data out of the caches,
        where each Lightning property in a chain costs about a microsecond: what does not change within an epoch
        (:class:`_EpochRule`) is read at its first batch, and the rest from plain attributes.
        """
        try:  # the fit loop's count of batches made ready: moved just before `on_train_batch_start`
            key: int | tuple[int, int, int] = trainer.fit_loop.epoch_loop.batch_progress.total.ready
        except AttributeError:
            key = (trainer.current_epoch, batch_idx, trainer.global_step)
        if key == self._batch:
            return False
        self._batch = key
        if self.pending:
            self.stepped += 1
        rule = self._rule
        if rule is None:
            rule = self._rule = _EpochRule(trainer, pl_module)
        # Lightning's rule for counting a batch as stepped
        ready = batch_idx + 1
        self.pending = not rule.automatic or ready % rule.accumulate == 0 or (rule.final_steps and ready == rule.total)
        counter = rule.step_counter
        global_step = self.started_at = counter.completed if counter is not None else trainer.global_step
        self._global_steps.append((global_step, self.stepped))
        return True

    def epoch_started(self, trainer: pl.Trainer) -> None:
        """A training epoch starts: the last batch of the previous one is counted now (Lightning's count has
        moved past it)."""
        if self.pending:
            self.stepped += 1
            self.pending = False
        self._rule = None  # read again at the epoch's first batch (a scheduler may change the accumulation)
        self._global_steps.append((trainer.global_step, self.stepped))

    def user_step(self, global_step: int) -> int:
        """The user-axis step of a series a callback writes at ``global_step`` (``trainer.global_step`` or the
        step just measured): the current step, or that of the recent batch during which ``global_step`` was
        current."""
        for started_at, step in reversed(self._global_steps):
            if started_at <= global_step:
                return step
        return self.stepped

    def state_dict(self) -> dict[str, int]:
        """``{"stepped": n}``: the stepping batches so far, the current one included."""
        return {"stepped": self.stepped + int(self.pending)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume the count."""
        self.stepped = int(state["stepped"])
        self.pending = False
        self._batch = None
        self._rule = None
        self._global_steps.clear()


class _EpochRule:
    """What decides, within one epoch, whether a batch steps and what the global step is: read at the epoch's first
    batch (after every ``on_train_epoch_start``, where a ``GradientAccumulationScheduler`` sets the accumulation).

    ``step_counter`` is the loop's own count of optimizer steps (the object ``trainer.global_step`` reads through
    four properties), used only when it reads the same as ``trainer.global_step`` now; else ``None`` (read the
    property).
    """

    __slots__ = ("accumulate", "automatic", "final_steps", "step_counter", "total")

    def __init__(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.automatic = bool(pl_module.automatic_optimization)
        self.accumulate = max(int(trainer.accumulate_grad_batches), 1)
        total = trainer.num_training_batches
        self.total = total if isinstance(total, int) else -1
        self.final_steps = not trainer.strategy.handles_gradient_accumulation
        self.step_counter: Any = None
        try:
            loop = trainer.fit_loop.epoch_loop
            counter = (
                loop.automatic_optimization.optim_progress.optimizer.step.total
                if self.automatic
                else loop.manual_optimization.optim_step_progress.total
            )
            if isinstance(counter.completed, int) and counter.completed == trainer.global_step:
                self.step_counter = counter
        except AttributeError:
            pass
