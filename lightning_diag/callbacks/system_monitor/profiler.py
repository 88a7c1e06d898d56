"""SystemProfiler: what Lightning itself does around the training batches, told to SystemMonitor through
Lightning's own profiler interface (``Trainer(profiler=...)``), so that nothing of the trainer's is wrapped.

Lightning opens a profiler action around every callback hook, every ``LightningModule`` hook, the fetch of each
training batch (``[_TrainingEpochLoop].train_dataloader_next``) and ``trainer.save_checkpoint``
(``save_checkpoint``). With this profiler on the trainer,
:class:`~lightning_diag.callbacks.system_monitor.monitor.SystemMonitor` learns from those actions:

* the end of a batch's callback hooks (the start of the ``LightningModule``'s ``on_train_batch_end``, which
  Lightning calls after every callback's): the step ends there, whatever the callbacks' order;
* the fetch of the next batch: the data waiting is exactly that; the rest of the time between two batches (the
  loggers' writes of the user's ``self.log`` values, the other callbacks' hooks) is the trainer's scheduled work;
* ``trainer.save_checkpoint``: checkpoint saving, exactly.

Without it ``SystemMonitor`` ends the step at its own ``on_train_batch_end`` and counts checkpoint saving from its
own ``on_save_checkpoint`` (docs/system_monitor.md says what that leaves out).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

from pytorch_lightning.profilers import Profiler

__all__ = ["ProfilerListener", "SystemProfiler"]

#: Lightning's action around ``trainer.save_checkpoint``.
SAVE_CHECKPOINT = "save_checkpoint"
#: The end of Lightning's action name around the fetch of a training batch.
FETCH = ".train_dataloader_next"
#: The start and end of Lightning's action name around the ``LightningModule``'s ``on_train_batch_end``.
MODULE_HOOK = "[LightningModule]"
BATCH_END = ".on_train_batch_end"


class ProfilerListener(Protocol):
    """What :class:`SystemProfiler` tells (``SystemMonitor``'s side)."""

    def batch_hooks_done(self) -> None:
        """Every callback's ``on_train_batch_end`` has run."""

    def fetched(self, seconds: float) -> None:
        """The next training batch took ``seconds`` to fetch."""

    def checkpoint_saved(self, seconds: float) -> None:
        """``trainer.save_checkpoint`` took ``seconds``."""


class SystemProfiler(Profiler):
    """A Lightning profiler that tells :class:`~lightning_diag.callbacks.system_monitor.monitor.SystemMonitor` where the
    trainer's own time goes: ``Trainer(profiler=SystemProfiler(), callbacks=[SystemMonitor(), ...])``.

    It records nothing of its own (an empty summary) and forwards every action to ``inner``, a profiler of the
    user's (``SimpleProfiler()``, ...), when given. One per trainer.

    Args:
        inner: A profiler to forward every call to, or ``None``.
        clock: Seconds of a wall clock (``time.perf_counter``; ``SystemMonitor`` passes its time source's).

    Raises:
        TypeError: If ``inner`` is not a Lightning ``Profiler``.
    """

    def __init__(self, inner: Profiler | None = None, clock: Callable[[], float] = time.perf_counter) -> None:
        super().__init__()
        self.inner = None
        if inner is not None and not isinstance(inner, Profiler):
            raise TypeError(f"Expected argument `inner` to be a pytorch_lightning Profiler or None, but got {inner!r}")
        self.inner = inner
        self.clock = clock
        self._listener: ProfilerListener | None = None
        self._open: dict[str, float] = {}

    def listen(self, listener: ProfilerListener | None, clock: Callable[[], float] | None = None) -> None:
        """Tell ``listener`` from now on (``None``: nobody), reading ``clock``."""
        self._listener = listener
        self._open = {}
        if clock is not None:
            self.clock = clock

    def start(self, action_name: str) -> None:
        """Lightning starts ``action_name``."""
        if self.inner is not None:
            self.inner.start(action_name)
        listener = self._listener
        if listener is None:
            return
        if action_name == SAVE_CHECKPOINT or action_name.endswith(FETCH):
            self._open[action_name] = self.clock()
        elif action_name.endswith(BATCH_END) and action_name.startswith(MODULE_HOOK):
            listener.batch_hooks_done()

    def stop(self, action_name: str) -> None:
        """Lightning ends ``action_name``."""
        started = self._open.pop(action_name, None) if self._open else None
        if started is not None and self._listener is not None:
            elapsed = self.clock() - started
            if action_name == SAVE_CHECKPOINT:
                self._listener.checkpoint_saved(elapsed)
            else:
                self._listener.fetched(elapsed)
        if self.inner is not None:
            self.inner.stop(action_name)

    def summary(self) -> str:
        """The inner profiler's summary (``""`` without one)."""
        return self.inner.summary() if self.inner is not None else ""

    def setup(self, stage: str, local_rank: int | None = None, log_dir: str | None = None) -> None:
        """Lightning's set-up, forwarded to the inner profiler."""
        super().setup(stage, local_rank, log_dir)
        if self.inner is not None:
            self.inner.setup(stage, local_rank, log_dir)

    def teardown(self, stage: str | None) -> None:
        """Lightning's tear-down, forwarded to the inner profiler."""
        super().teardown(stage)
        if self.inner is not None:
            self.inner.teardown(stage)
