"""How SystemMonitor times the trainer without private attributes: hook timers around every callback's hooks,
a wrapper that closes each step at its ``on_train_batch_end`` boundary, and a timer around checkpoint saving."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable
from typing import Any

import pytorch_lightning as pl

__all__ = ["HookTimer", "time_save_checkpoint", "untime_save_checkpoint", "unwrap_batch_end", "wrap_batch_end"]


# -- the diagnostics' own cost ------------------------------------------------------------------------------
#: Hooks whose time is counted: every per-step, per-epoch and validation hook a callback may override.
TIMED_HOOKS = (
    "on_train_batch_start",
    "on_train_batch_end",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_before_zero_grad",
    "on_train_epoch_start",
    "on_train_epoch_end",
    "on_validation_start",
    "on_validation_end",
    "on_validation_epoch_start",
    "on_validation_epoch_end",
    "on_validation_batch_start",
    "on_validation_batch_end",
    "on_save_checkpoint",
)

#: The hooks inside the training steps (not validation, not checkpoint saving): their time is the diagnostics'
#: share of a step's time (:attr:`HookTimer.step_seconds`).
STEP_HOOKS = frozenset(TIMED_HOOKS[:8])

_RECORDER_METHODS = ("add", "add_probabilities", "mha_pre_hook")


class HookTimer:
    """Time spent inside the hooks of given callbacks, and in the attention recorder, by name.

    :meth:`attach` puts a timing wrapper on each instance (an instance attribute shadowing the class's hook, so
    Lightning's ``getattr(callback, hook)`` finds it) and on the methods of
    :class:`~lightning_diag.instrument.attention_record.AttentionRecorder`; :meth:`detach` removes them all.
    Nested calls (a recorder call inside a callback's hook) count once, for the innermost owner only.

    ``clock`` is the process's CPU time on CPU (:class:`SystemMonitor` passes ``TimeSource.cpu``): what a hook
    adds to the run there, unaffected by other processes taking the CPU away in the middle of a hook (wall time
    charges that preemption to whichever hook it lands in, and a hook that writes a file or reads ``/proc`` is
    rescheduled behind the other processes). It is the host wall time on CUDA, where kernels the hooks launch run
    asynchronously and are not counted.
    """

    RECORDER = "AttentionRecorder"

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.seconds: dict[str, float] = {}
        #: Seconds spent in the :data:`STEP_HOOKS` of the timed callbacks and in the attention recorder since the
        #: start (never reset): the time the diagnostics add to the training steps (the recorder's calls in a
        #: validation forward land on the step after validation, which has a known cause anyway).
        self.step_seconds = 0.0
        self._wrapped: list[tuple[Any, str]] = []
        self._recorder_patch: dict[str, Any] = {}
        self._stack: list[list[float]] = []
        #: Timed calls since the last :meth:`take` (their clock reads are a cost no window holds whole).
        self.calls = 0

    def timed(self, name: str, fn: Callable[..., Any], step: bool = False) -> Callable[..., Any]:
        """``fn`` wrapped so that its time on :attr:`clock` (less nested timed calls) is counted under ``name``
        (and, with ``step`` and outside any other timed call, in :attr:`step_seconds`)."""
        seconds = self.seconds
        stack = self._stack
        wall = self.clock
        timer = self

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            timer.calls += 1
            inner = [0.0]
            stack.append(inner)
            start = wall()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = wall() - start
                stack.pop()
                seconds[name] = seconds.get(name, 0.0) + elapsed - inner[0]
                if stack:
                    stack[-1][0] += elapsed
                elif step:
                    timer.step_seconds += elapsed

        return wrapper

    def attach(self, callbacks: Iterable[pl.Callback], recorder: bool = True) -> list[str]:
        """Wrap the overridden hooks of ``callbacks``; returns the names they are counted under."""
        names: list[str] = []
        for cb in callbacks:
            base = type(cb).__name__
            name, n = base, 2
            while name in names:
                name, n = f"{base}_{n}", n + 1
            names.append(name)
            self.seconds.setdefault(name, 0.0)
            for hook in TIMED_HOOKS:
                impl = getattr(type(cb), hook, None)
                if impl is None or impl is getattr(pl.Callback, hook) or hook in vars(cb):
                    continue
                setattr(cb, hook, self.timed(name, getattr(cb, hook), step=hook in STEP_HOOKS))
                self._wrapped.append((cb, hook))
        if recorder:
            self._patch_recorder()
        return names

    def _patch_recorder(self) -> None:
        from lightning_diag.instrument.attention_record import AttentionRecorder

        self.seconds.setdefault(self.RECORDER, 0.0)
        for method in _RECORDER_METHODS:
            original = vars(AttentionRecorder).get(method)
            if original is None or getattr(original, "_diag_timed", False):
                continue
            self._recorder_patch[method] = original
            if method == "mha_pre_hook":
                def make_hook(rec: Any, name: str, _orig: Any = original, _timed: Any = self.timed) -> Any:
                    return _timed(HookTimer.RECORDER, _orig(rec, name), step=True)

                patched: Any = make_hook
            else:
                patched = self.timed(self.RECORDER, original, step=True)
            patched._diag_timed = True
            setattr(AttentionRecorder, method, patched)

    def detach(self) -> None:
        """Remove every wrapper."""
        for cb, hook in self._wrapped:
            vars(cb).pop(hook, None)
        self._wrapped = []
        if self._recorder_patch:
            from lightning_diag.instrument.attention_record import AttentionRecorder

            for method, original in self._recorder_patch.items():
                setattr(AttentionRecorder, method, original)
            self._recorder_patch = {}

    def take(self) -> dict[str, float]:
        """The seconds counted since the last call, by name (then reset to zero, with :attr:`calls`)."""
        taken = dict(self.seconds)
        for key in self.seconds:
            self.seconds[key] = 0.0
        self.calls = 0
        return taken

    def per_call_cost(self, repeats: int = 200) -> float:
        """Seconds one timed call costs beyond what its window counts (the wrapper and the clock reads outside
        it), measured on a wrapped no-op: the median of a few batches of ``repeats`` calls, 0 when the clock does
        not move (a test's fake clock)."""
        probe = HookTimer(self.clock)
        noop = probe.timed("probe", lambda: None)
        costs = []
        for _ in range(5):
            start = self.clock()
            for _ in range(repeats):
                noop()
            costs.append((self.clock() - start - probe.take()["probe"]) / repeats)
        costs.sort()
        return max(0.0, costs[len(costs) // 2])


# -- the trainer's step boundary and checkpoint saving --------------------------------------------------------
def wrap_batch_end(trainer: pl.Trainer, close: Callable[[pl.Trainer], None]) -> tuple[Any, Any]:
    """Call ``close(trainer)`` after the last callback's ``on_train_batch_end``; returns the handle for
    :func:`unwrap_batch_end`.

    Lightning runs the callbacks' hooks in list order, so the time other callbacks spend there is the step's,
    not data waiting.
    """
    last = trainer.callbacks[-1]  # type: ignore[attr-defined]
    previous = vars(last).get("on_train_batch_end")
    inner = last.on_train_batch_end

    def on_train_batch_end(trainer: pl.Trainer, *args: Any, **kwargs: Any) -> Any:
        try:
            return inner(trainer, *args, **kwargs)
        finally:
            close(trainer)

    last.on_train_batch_end = on_train_batch_end
    return last, previous


def unwrap_batch_end(boundary: tuple[Any, Any] | None) -> None:
    """Undo :func:`wrap_batch_end` (``None``: nothing to undo)."""
    if boundary is not None:
        last, previous = boundary
        if previous is None:
            vars(last).pop("on_train_batch_end", None)
        else:
            last.on_train_batch_end = previous


def time_save_checkpoint(
    trainer: pl.Trainer, add: Callable[[float], None], wall: Callable[[], float] = time.perf_counter
) -> Callable[..., Any] | None:
    """Pass the seconds of every ``trainer.save_checkpoint`` call to ``add``.

    The timer is an instance attribute of the trainer; it returns it (for :func:`untime_save_checkpoint`), or
    ``None`` when the trainer's ``save_checkpoint`` is already replaced on the instance by someone else, which is
    then left as it is.
    """
    if "save_checkpoint" in vars(trainer):
        return None
    original = trainer.save_checkpoint

    def save_checkpoint(*args: Any, **kwargs: Any) -> Any:
        start = wall()
        try:
            return original(*args, **kwargs)
        finally:
            add(wall() - start)

    trainer.save_checkpoint = save_checkpoint  # type: ignore[method-assign]
    return save_checkpoint


def untime_save_checkpoint(trainer: pl.Trainer, timer: Callable[..., Any] | None) -> None:
    """Remove the timer :func:`time_save_checkpoint` installed, and nothing else."""
    if timer is not None and vars(trainer).get("save_checkpoint") is timer:
        del vars(trainer)["save_checkpoint"]
