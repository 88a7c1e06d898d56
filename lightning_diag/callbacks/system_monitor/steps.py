"""What SystemMonitor records during the steps: the clock marks of each optimizer step, its data waiting, CPU
time and checkpoint saving, whether it has a known one-time cause, and the interval's sums.

:class:`~lightning_diag.callbacks.system_monitor.monitor.SystemMonitor` calls these from its hooks; at a logging step
:meth:`StepRecorder.take` hands over the interval (resolved by
:func:`~lightning_diag.callbacks.system_monitor.interval.resolve_steps`), which the callback judges and logs.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from lightning_diag.callbacks.system_monitor.interval import HEADER, Mark, Step, resolve_steps
from lightning_diag.instrument.batches import batch_size_and_tokens
from lightning_diag.instrument.clocks import CudaClock, HostClock, TimeSource

__all__ = ["Interval", "StepRecorder"]


@dataclasses.dataclass
class Interval:
    """The optimizer steps closed since the last logging step.

    Attributes:
        steps: The seconds of each step (:data:`~lightning_diag.callbacks.system_monitor.interval.Step`).
        explained: Per step, whether it has a known one-time cause (the run's first step, an epoch's first step,
            the step after a validation run, a step that saved a checkpoint).
        wait_explained: Per step, whether that cause lies in its data waiting only (an epoch's first step: a
            fresh dataloader iterator and the epoch-start hooks of the callbacks after ``SystemMonitor``; the step
            after a validation run: the validation-end hooks of the callbacks after it): its compute is still the
            step's own.
        mid_validation: Per step, whether its wait spans the end of a validation run inside an epoch (the one
            that ends an epoch is no step's): it holds the validation-end hooks of the callbacks after
            ``SystemMonitor``, not only data waiting.
        sums: The interval's :data:`~lightning_diag.callbacks.system_monitor.interval.HEADER` numbers so far
            (validation, checkpoint, samples, tokens; the caller adds the rest).
        wall: Wall seconds since the previous interval.
        diagnostics: Per step, the wall seconds spent in the lightning_diag callbacks' step hooks (their cost,
            not the training's: left out of the step times the step-time rules judge).
        logging: Per step, the wall seconds of scheduled work between its batch and the previous one, left out of
            the step's data waiting: the lightning_diag callbacks' hooks that ran there (after ``SystemMonitor``'s
            end of the batch, or before its start), and with
            :class:`~lightning_diag.callbacks.system_monitor.profiler.SystemProfiler` everything Lightning did there
            but fetch the batch (its loggers' writes, the other callbacks' hooks).
    """

    steps: list[Step]
    explained: list[bool]
    sums: dict[str, float]
    wall: float
    diagnostics: list[float]
    logging: list[float] = dataclasses.field(default_factory=list)
    wait_explained: list[bool] = dataclasses.field(default_factory=list)
    mid_validation: list[bool] = dataclasses.field(default_factory=list)


class StepRecorder:
    """The per-step marks of one fit: fed by the callback's hooks, emptied by :meth:`take` at each logging step.

    Data waiting runs from the end of one training batch to the start of the next, without the validation and
    checkpoint seconds in between; an epoch's first batch waits from the epoch's start (what happened between
    the epochs belongs to no step). The compute marks come from ``clock`` (host readings, or CUDA events read only
    in :meth:`take`).
    """

    def __init__(self, time_source: TimeSource, clock: HostClock | CudaClock | None = None) -> None:
        self.time_source = time_source
        self.reset(clock if clock is not None else HostClock(time_source))

    def reset(self, clock: HostClock | CudaClock) -> None:
        """Forget everything of the current run; use ``clock`` for the compute marks."""
        self.clock = clock
        self._prev_end: float | None = None
        self._outside = 0.0  # validation + checkpoint seconds since the last batch end
        self._logging = 0.0  # scheduled work since the last batch end (the diagnostics' hooks)
        self._fetched: float | None = None  # the profiler's batch fetching since the last batch end (None: unknown)
        self._ckpt_mark: float | None = None  # SystemMonitor's on_save_checkpoint, without the profiler
        self._after_validation = False
        self._first_of_run = False
        self._epoch_start = False
        self._step_at_start = -1
        self._batch_start: Any = None
        self._before_opt: Any = None
        self._val_start: float | None = None
        self._pending: list[Mark] = []  # (start, end, "fb" | "opt") marks of the interval
        self._step_pending: list[int] = []  # index into _pending where each step of the interval ends
        self._step_waits: list[float] = []
        self._step_cpu: list[float] = []
        self._step_ckpt: list[float] = []  # checkpoint seconds inside each step's batch
        self._step_flags: list[bool] = []
        self._step_wait_flags: list[bool] = []
        self._step_val_flags: list[bool] = []
        self._step_diag: list[float] = []
        self._step_logging: list[float] = []
        self._cur_logging = 0.0
        self._cur_diag = 0.0
        self._cur_cpu = 0.0
        self._cpu_start = 0.0
        self._cur_wait = 0.0
        self._sums = dict.fromkeys(HEADER, 0.0)
        self._tokens_dev: torch.Tensor | None = None
        self._wall_start = self.time_source.wall()

    @property
    def in_batch(self) -> bool:
        """Whether a training batch has started and not ended."""
        return self._batch_start is not None

    # -- the hooks -------------------------------------------------------------------------------------------
    def batch_start(self, global_step: int, batch: Any) -> None:
        """Close the data wait; mark the start of the batch's compute; count its samples and tokens."""
        now = self.time_source.wall()
        self._settle_checkpoint(now)
        if self._prev_end is None:
            self._first_of_run = True  # no previous batch end: the wait is unknown, the step is left out
        else:
            rest = max(0.0, now - self._prev_end - self._outside - self._logging)
            if self._fetched is not None:  # the profiler said how long the fetch took: the rest is scheduled work
                wait = min(rest, self._fetched)
                self._logging += rest - wait
                rest = wait
            self._cur_wait += rest
            self._cur_logging += self._logging
        self._outside = self._logging = 0.0
        self._fetched = None
        if self._step_at_start < 0:
            self._step_at_start = global_step
        size, tokens = batch_size_and_tokens(batch)
        self._sums["samples"] += size
        if isinstance(tokens, torch.Tensor):
            self._tokens_dev = tokens.float() if self._tokens_dev is None else self._tokens_dev + tokens
        elif tokens is not None:
            self._sums["tokens"] += tokens
        self._cpu_start = self.time_source.cpu()
        self._batch_start = self.clock.mark()
        self._before_opt = None

    def before_optimizer_step(self) -> None:
        """Mark the end of forward + backward."""
        if self._batch_start is not None:
            self._before_opt = self.clock.mark()

    def batch_end(self, global_step: int, diagnostics_s: float = 0.0) -> bool:
        """Mark the end of the batch (``diagnostics_s``: seconds the diagnostics' hooks took since the last
        :meth:`resume`); whether it closed an optimizer step (then call :meth:`resume` after reporting, so the
        reporting is not the next step's data waiting)."""
        if self._batch_start is None:
            return False
        end = self.clock.mark()
        if self._ckpt_mark is not None:
            self._settle_checkpoint(self.time_source.wall())
        in_batch, self._outside = self._outside, 0.0  # checkpoint saving inside the batch's hooks
        self._cur_cpu += self.time_source.cpu() - self._cpu_start
        self._cur_diag += max(0.0, diagnostics_s)
        self._cur_logging += self._logging
        self._logging = 0.0
        if self._before_opt is not None:
            self._pending.append((self._batch_start, self._before_opt, "fb"))
            self._pending.append((self._before_opt, end, "opt"))
        else:
            self._pending.append((self._batch_start, end, "fb"))
        self._batch_start = None
        if global_step == self._step_at_start:
            return False
        self._step_at_start = global_step
        self._step_pending.append(len(self._pending))
        self._step_waits.append(self._cur_wait)
        self._step_cpu.append(self._cur_cpu)
        self._step_ckpt.append(in_batch)
        at_boundary = self._after_validation or self._epoch_start
        self._step_flags.append(at_boundary or self._first_of_run or in_batch > 0)
        self._step_wait_flags.append(at_boundary and not self._first_of_run and in_batch == 0)
        self._step_val_flags.append(self._step_wait_flags[-1] and not self._epoch_start)
        self._step_diag.append(self._cur_diag)
        self._step_logging.append(self._cur_logging)
        self._cur_cpu = self._cur_wait = self._cur_diag = self._cur_logging = 0.0
        self._after_validation = self._first_of_run = self._epoch_start = False
        return True

    def resume(self) -> None:
        """The data wait of the next batch starts now."""
        self._prev_end = self.time_source.wall()

    def epoch_start(self) -> None:
        """A training epoch starts: the data wait of its first batch runs from here.

        The time since the last batch's end (validation, every callback's and Lightning's epoch-end work,
        checkpoint saving) is no step's: Lightning creates the epoch's dataloader iterator after the epoch-start
        hooks, so what follows is the first batch's waiting. That wait (a fresh iterator: worker start-up) is a
        known cause."""
        now = self.time_source.wall()
        self._settle_checkpoint(now)
        if self._prev_end is not None:
            self._prev_end = now
        self._outside = self._logging = 0.0
        self._fetched = None
        self._epoch_start = True

    def validation_start(self) -> None:
        """Start timing validation (its time is not data waiting)."""
        self._val_start = self.time_source.wall()
        self._settle_checkpoint(self._val_start)

    def validation_end(self, sanity_checking: bool) -> None:
        """Stop timing validation; the next step has a known cause."""
        start, self._val_start = self._val_start, None
        if start is None or sanity_checking:
            return
        elapsed = self.time_source.wall() - start
        self._outside += elapsed
        self._sums["validation"] += elapsed
        self._after_validation = True

    def add_work(self, elapsed: float) -> None:
        """``elapsed`` wall seconds of scheduled work since the last batch end (the diagnostics' hooks): not data
        waiting, and the next step's known work (:attr:`Interval.logging`)."""
        if elapsed > 0.0 and self._val_start is None:  # a validation run's is in its own time already
            self._logging += elapsed

    def add_fetch(self, elapsed: float) -> None:
        """Lightning fetched the next training batch for ``elapsed`` seconds (its profiler's
        ``train_dataloader_next``): with it, that is the data waiting, and the rest of the gap scheduled work."""
        self._fetched = (self._fetched or 0.0) + max(0.0, elapsed)

    def add_checkpoint(self, elapsed: float) -> None:
        """``trainer.save_checkpoint`` took ``elapsed`` seconds (not data waiting)."""
        self._outside += elapsed
        self._sums["checkpoint"] += elapsed

    def checkpoint_mark(self) -> None:
        """A checkpoint is being saved (``SystemMonitor``'s ``on_save_checkpoint``, without the profiler): the time
        from now to the next of the recorder's marks (a batch's start or end, a validation run's start) is
        checkpoint saving: the writing of the file, which Lightning does after the callbacks' hooks, and what
        follows it until then."""
        if self._ckpt_mark is None:
            self._ckpt_mark = self.time_source.wall()

    def _settle_checkpoint(self, now: float) -> None:
        if self._ckpt_mark is not None:
            mark, self._ckpt_mark = self._ckpt_mark, None
            self.add_checkpoint(max(0.0, now - mark))

    # -- the interval ----------------------------------------------------------------------------------------
    def take(self) -> Interval | None:
        """The steps closed since the last call (reads the CUDA events: one synchronisation), or ``None``."""
        steps, self._pending = resolve_steps(
            self.clock, self._pending, self._step_pending, self._step_waits, self._step_cpu, self._step_ckpt
        )
        self._step_waits, self._step_pending, self._step_cpu, self._step_ckpt = [], [], [], []
        flags, self._step_flags = self._step_flags, []
        wait_flags, self._step_wait_flags = self._step_wait_flags, []
        val_flags, self._step_val_flags = self._step_val_flags, []
        diag, self._step_diag = self._step_diag, []
        logging, self._step_logging = self._step_logging, []
        if not steps:
            return None
        sums, self._sums = self._sums, dict.fromkeys(HEADER, 0.0)
        if self._tokens_dev is not None:
            sums["tokens"] += float(self._tokens_dev.item())
            self._tokens_dev = None
        now = self.time_source.wall()
        wall, self._wall_start = now - self._wall_start, now
        return Interval(steps, flags, sums, wall, diag, logging, wait_flags, val_flags)
