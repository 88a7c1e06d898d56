"""How SystemMonitor times the diagnostics' own hooks: the trainer's driver calls each lightning_diag callback's
hook through a timer (:meth:`HookTimer.part_wrap`, handed to
:meth:`Driver.time_parts <lightning_diag.callbacks.common.driver.Driver.time_parts>`), and the attention recorders
the callbacks create wrap their methods in one. Nothing is assigned on any object for the timing: no Lightning
object, no user callback, no class, no callback instance (the trainer's checkpointing and logging are timed through
Lightning's profiler interface, :mod:`lightning_diag.callbacks.system_monitor.profiler`)."""

from __future__ import annotations

import dataclasses
import functools
import math
import random
import statistics
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from lightning_diag.callbacks.common.batch_hooks import DISPATCHED_HOOKS, TRAIN_BATCH_HOOKS, TRAIN_EPOCH_HOOKS
from lightning_diag.callbacks.common.driver import PartWrap

__all__ = [
    "BATCH_HOOKS",
    "RECORDER_TIMING",
    "TOTAL",
    "HookTimer",
    "Taken",
]


# -- the diagnostics' own cost ------------------------------------------------------------------------------
#: Hooks whose time is counted: every per-step, per-epoch and validation hook a callback may override (those the
#: driver dispatches), and the checkpoint's.
TIMED_HOOKS = (*DISPATCHED_HOOKS, "on_save_checkpoint")

#: The hooks inside the training steps (not validation, not checkpoint saving): their time is the diagnostics'
#: share of a step's time (:attr:`HookTimer.step_wall_seconds`).
STEP_HOOKS = frozenset((*TRAIN_BATCH_HOOKS, *TRAIN_EPOCH_HOOKS))
#: The hooks Lightning calls once per training batch: timed on sampled batches only (:class:`HookTimer`).
BATCH_HOOKS = frozenset(TRAIN_BATCH_HOOKS)

#: The attribute of a callback that creates attention recorders (it reads the driver's
#: :attr:`~lightning_diag.callbacks.common.driver.Driver.recorder_timing`).
RECORDER_TIMING = "recorder_timing"
#: The most one wrapper call's own time outside its window counts (a call the scheduler interrupted is not the
#: timing's cost).
OUTSIDE_CAP_S = 50e-6


#: The key of the summed standard error in :attr:`Taken.stderr`.
TOTAL = "total"
#: Sampled batches kept across intervals, for an interval with fewer than two samples of its own.
RECENT = 32
#: A quiet batch whose hooks took more than this many seconds beyond 4x the usual is *heavy* (scheduled work, a
#: garbage collection): counted on its own, never extrapolated from, nor left to the sample to find.
HEAVY_S = 200e-6


@dataclasses.dataclass
class Taken:
    """What the timed hooks took since the previous :meth:`HookTimer.take`.

    Attributes:
        seconds: Seconds by name: measured on the timed batches, plus the untimed quiet batches' extrapolated from
            the sampled ones (their mean times their number).
        stderr: The sampling standard error of each estimate by name, and of their sum under :data:`TOTAL`: 0 when
            every batch was timed, NaN when fewer than two batches were sampled.
        timer_seconds: What the timing itself cost: the timed calls times the measured per-call cost, plus the
            untimed calls times the wrapper's cost.
        batches: Training batches closed in the interval.
        timed: How many of them had their per-batch hooks timed.
    """

    seconds: dict[str, float]
    stderr: dict[str, float]
    timer_seconds: float
    batches: int
    timed: int


def _estimate(own: list[float], pool: list[float], quiet: int) -> tuple[float, float]:
    """The total over ``quiet`` batches and its standard error, from the per-batch values of the batches sampled
    among them (``own``) and of the last sampled batches (``pool``, ``own`` included).

    The mean is the interval's own sample's (the pool's when it has none); the spread is the pool's, steadier
    than a few batches' (a cost on one batch in seven is missed by six samples four times in ten, whose own
    spread would then say zero). The finite-population correction applies to an interval's own sample."""
    if quiet == 0:
        return 0.0, 0.0
    sample = own or pool
    if not sample:
        return 0.0, math.nan
    total = quiet * math.fsum(sample) / len(sample)
    if len(pool) < 2:
        return total, math.nan
    correction = max(0.0, 1.0 - len(own) / quiet) if own else 1.0
    return total, quiet * statistics.stdev(pool) / math.sqrt(len(sample)) * math.sqrt(correction)


class HookTimer:
    """Time spent inside the hooks of given callbacks, and in the attention recorder, by name.

    :meth:`part_wrap` names the callbacks and returns what the trainer's driver calls each of their hooks through
    (:meth:`Driver.time_parts <lightning_diag.callbacks.common.driver.Driver.time_parts>`: the driver keeps the
    timed callables, nothing is set on an instance); :meth:`recorder_timed` wraps an attention recorder's methods
    (on each recorder instance, :class:`~lightning_diag.instrument.attention_record.AttentionRecorder`'s ``timed``).
    No class is changed: two trainers in one process have timers of their own.
    Nested calls (a recorder call inside a callback's hook) count once, for the innermost owner only.

    Reading ``clock`` is what timing costs, so the per-batch hooks (:data:`BATCH_HOOKS` and the recorder) are
    timed on a sample of the batches only: every batch :meth:`next_batch` is told is *exact* (the batches around a
    logging step, where the callbacks do their measuring and writing), and one *quiet* batch in each block of
    ``sample_every``, at a random position (a private generator: the run's random state is not touched), so
    that work on any schedule is sampled without bias. :meth:`take` extrapolates the quiet batches from the
    sampled ones and states the standard error. Epoch, validation and checkpoint hooks are always timed.

    ``clock`` is the training thread's CPU time on CPU (:class:`SystemMonitor` passes ``TimeSource.thread``):
    what a hook adds to the run there, unaffected by other processes taking the CPU away in the middle of a hook
    (wall time charges that preemption to whichever hook it lands in, and a hook that writes a file or reads
    ``/proc`` is rescheduled behind the other processes). It is the host wall time on CUDA, where kernels the
    hooks launch run asynchronously and are not counted.

    Args:
        clock: Seconds of the clock the hooks are timed with.
        sample_every: Time one quiet batch in each block of this many (1: every batch).
        seed: Seed of the sampling generator.
    """

    RECORDER = "AttentionRecorder"

    def __init__(
        self,
        clock: Callable[[], float] = time.perf_counter,
        sample_every: int = 1,
        seed: int = 0,
        wall: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.clock = clock
        self.wall = wall
        self.sample_every = max(1, int(sample_every))
        self._rng = random.Random(seed)
        #: Seconds by name of the exact batches' hooks and of the hooks always timed, since the last :meth:`take`.
        self.seconds: dict[str, float] = {}
        #: Wall seconds (:attr:`wall` clock) spent in the :data:`STEP_HOOKS` of the timed callbacks and in the
        #: attention recorder since the start (never reset; every batch, the untimed ones read with the cheap clock):
        #: the time the diagnostics add to the training steps, which the step-time rules leave out (the recorder's
        #: calls in a validation forward land on the step after validation, which has a known cause). Wall time, as
        #: the step is measured: their writing, blocked on a file or a writer thread, costs the step all the same.
        self.step_wall_seconds = 0.0
        #: Whether the current batch's per-batch hooks are timed.
        self.active = True
        #: Whether the current batch is a sampled quiet batch (its seconds are a sample, not a measured total).
        self.sampled = False
        #: Timed and untimed wrapper calls since the last :meth:`take` (what the timing itself costs).
        self.calls = 0
        self.skipped = 0
        #: What the timing costs (:meth:`calibrate`; 0 until then): seconds of the clock's reads inside a timed
        #: call's window, outside it, and of an untimed call's wrapper.
        self.in_window = 0.0
        self.per_call = 0.0
        self.per_skip = 0.0
        #: Wall seconds the wrappers spent outside their windows since the last :meth:`take`, measured in the fit
        #: (where a first touch after the step's compute costs several times the calibration's warm loop).
        self.outside = 0.0
        self._stack: list[list[float]] = []
        self._current: dict[str, float] = {}
        self._samples: list[dict[str, float]] = []
        self._recent: deque[dict[str, float]] = deque(maxlen=RECENT)
        self._quiet = 0
        self._batches = 0
        self._timed_batches = 0
        self._block_pos = 0
        self._pick = 0
        # untimed batches: the hooks' wall seconds by name (cheap clock), and the batch's CPU and wall marks
        self._walls: dict[str, float] = {}
        self._in_skip = False
        self._light = 0.0  # the usual hooks' seconds of a sampled quiet batch (moving mean)
        self._cpu_mark: float | None = None
        self._wall_mark = 0.0
        self._training: deque[float] = deque(maxlen=RECENT)  # CPU seconds of light batches outside the hooks
        self._batch_reads = 0

    def timed(self, name: str, fn: Callable[..., Any], step: bool = False, batch: bool = False) -> Callable[..., Any]:
        """``fn`` wrapped so that its time on :attr:`clock` (less nested timed calls) is counted under ``name``
        (and, with ``step`` and outside any other timed call, its wall time in :attr:`step_wall_seconds`); with
        ``batch`` only on the batches :meth:`next_batch` picks."""
        seconds = self.seconds
        stack = self._stack
        wall = self.clock
        cheap = self.wall
        timer = self

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            entered = cheap()  # the wrapper's own time outside the window: measured in the fit (cold caches)
            if batch and not timer.active:
                # untimed: only the cheap wall clock, so that a heavy batch is still seen
                timer.skipped += 1
                if timer._in_skip:
                    return fn(*args, **kwargs)
                timer._in_skip = True
                begin = cheap()
                try:
                    return fn(*args, **kwargs)
                finally:
                    timer._in_skip = False
                    done = cheap()
                    walls = timer._walls
                    walls[name] = walls.get(name, 0.0) + done - begin
                    if step and not stack:
                        timer.step_wall_seconds += done - begin
                    timer.outside += min(cheap() - entered - (done - begin), OUTSIDE_CAP_S)
            timer.calls += 1
            inner = [0.0]
            stack.append(inner)
            start = wall()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = wall() - start
                stack.pop()
                # the clock's own cost inside the window is the timing's (SystemMonitor's), not the hook's
                into = timer._current if batch and timer.sampled else seconds
                into[name] = into.get(name, 0.0) + elapsed - inner[0] - timer.in_window
                left = cheap()
                if stack:
                    stack[-1][0] += elapsed + timer.per_call
                elif step:
                    timer.step_wall_seconds += left - entered
                timer.outside += min(max(left - entered - elapsed, 0.0), OUTSIDE_CAP_S)

        return wrapper

    @property
    def busy(self) -> bool:
        """Whether a timed hook is running (a logger written to from inside it is the diagnostics' work)."""
        return bool(self._stack) or self._in_skip

    def next_batch(self, exact: bool) -> None:
        """Close the current training batch; time the next one's per-batch hooks if ``exact``, else if it is the
        quiet batch its block of :attr:`sample_every` picked."""
        self._batches += 1
        if self.active:
            self._timed_batches += 1
        if self.sample_every > 1:
            self._close_quiet()
        if exact or self.sample_every == 1:
            self.active, self.sampled = True, False
            return
        if self._block_pos == 0:
            self._pick = self._rng.randrange(self.sample_every)
        self.active = self.sampled = self._block_pos == self._pick
        self._block_pos = (self._block_pos + 1) % self.sample_every

    def _close_quiet(self) -> None:
        """Count a quiet batch: light ones into the sample (sampled) or the extrapolated number (untimed); heavy
        ones on their own. An untimed batch is heavy when its hooks' wall time is above the limit and either
        that wall time less all of the batch's time off the CPU (a lower bound of the hooks' CPU time) or the
        batch's CPU time beyond the training's usual (the median of the last light batches', plus three median
        deviations) is above it too; it is counted by the larger of the two, at most its hooks' wall time: time
        another process took inside a hook is not CPU time of this thread, so not counted."""
        cpu, wall = self.clock(), self.wall()
        self._batch_reads += 1
        batch_cpu = 0.0 if self._cpu_mark is None else cpu - self._cpu_mark
        off_cpu = 0.0 if self._cpu_mark is None else max(0.0, wall - self._wall_mark - batch_cpu)
        self._cpu_mark, self._wall_mark = cpu, wall
        limit = 4 * self._light + HEAVY_S
        if self.sampled:
            sample, self._current = self._current, {}
            total = math.fsum(sample.values())
            if total > limit and self._recent:  # heavy (the first sample sets what is usual)
                for name, value in sample.items():
                    self.seconds[name] = self.seconds.get(name, 0.0) + value
                return
            self._samples.append(sample)
            self._recent.append(sample)
            self._training.append(batch_cpu - total)
            self._light = total if len(self._recent) == 1 else 0.9 * self._light + 0.1 * total
            self._quiet += 1
        elif not self.active:
            walls, self._walls = self._walls, {}
            total = math.fsum(walls.values())
            if total <= limit or not self._training:
                self._quiet += 1
                if self._recent:
                    self._training.append(batch_cpu - self._light)
                return
            # heavy by the wall clock: by the CPU clock too? (a light batch that another process interrupted is
            # not; the training's own spread from batch to batch is not the hooks')
            usual = statistics.median(self._training)
            spread = statistics.median(abs(t - usual) for t in self._training)
            excess = batch_cpu - usual
            at_least = total - off_cpu
            if excess <= limit + 3 * spread and at_least <= limit:
                self._quiet += 1
                self._training.append(batch_cpu - self._light)
                return
            hooks = min(total, max(at_least, excess))
            for name, value in walls.items():
                self.seconds[name] = self.seconds.get(name, 0.0) + value * hooks / total

    def part_wrap(self, callbacks: Iterable[Any], skip: Iterable[tuple[Any, str]] = ()) -> PartWrap:
        """Name ``callbacks`` (the class name, ``_2``, ``_3``... for a second one of a class) and return the driver's
        wrap of their parts: each :data:`TIMED_HOOKS` part of one of them is timed under its name, but the
        ``(callback, hook)`` pairs in ``skip``; the attention recorder's name is counted when one of them creates
        recorders (an attribute :data:`RECORDER_TIMING`)."""
        names: dict[int, str] = {}
        for cb in callbacks:
            base = type(cb).__name__
            name, n = base, 2
            while name in names.values():
                name, n = f"{base}_{n}", n + 1
            names[id(cb)] = name
            self.seconds.setdefault(name, 0.0)
            if hasattr(cb, RECORDER_TIMING):
                self.seconds.setdefault(self.RECORDER, 0.0)
        skipped = {(id(cb), hook) for cb, hook in skip}

        def wrap(callback: Any, hook: str, part: Callable[..., Any]) -> Callable[..., Any]:
            name = names.get(id(callback))
            if name is None or hook not in TIMED_HOOKS or (id(callback), hook) in skipped:
                return part
            return self.timed(name, part, step=hook in STEP_HOOKS, batch=hook in BATCH_HOOKS)

        return wrap

    def recorder_timed(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` (an attention recorder's method) timed under :attr:`RECORDER`, as a per-batch step hook."""
        return self.timed(self.RECORDER, fn, step=True, batch=True)

    def take(self) -> Taken:
        """The seconds since the last call by name, the quiet batches extrapolated (:class:`Taken`); then start
        counting afresh."""
        own, pool, quiet = self._samples, list(self._recent), self._quiet
        names = list(self.seconds) + sorted({n for s in pool for n in s} - set(self.seconds))
        estimates: dict[str, float] = {}
        stderr: dict[str, float] = {}
        for name in names:
            extra, err = _estimate([s.get(name, 0.0) for s in own], [s.get(name, 0.0) for s in pool], quiet)
            estimates[name] = self.seconds.get(name, 0.0) + extra
            stderr[name] = err
        stderr[TOTAL] = _estimate([math.fsum(s.values()) for s in own], [math.fsum(s.values()) for s in pool], quiet)[1]
        taken = Taken(
            estimates,
            stderr,
            # the wrappers' time outside their windows, measured; the clock's cost inside a timed window (a timed
            # call reads the clock twice, a batch's close once), calibrated
            self.outside
            + (self.calls + self._batch_reads / 2) * self.in_window
            + self._batch_reads / 2 * self.per_call,
            self._batches,
            self._timed_batches,
        )
        for key in self.seconds:
            self.seconds[key] = 0.0
        self.calls = self.skipped = self._quiet = self._batches = self._timed_batches = self._batch_reads = 0
        self.outside = 0.0
        self._samples = []
        return taken

    def calibrate(self, repeats: int = 200) -> None:
        """Measure :attr:`in_window`, :attr:`per_call` and :attr:`per_skip` on wrapped no-ops: the median of a
        few batches of ``repeats`` calls each; 0 when the clock does not move (a test's fake clock)."""
        probe = HookTimer(self.clock, sample_every=2, wall=self.wall)
        clock = self.clock

        def noop() -> None:
            return None

        timed = probe.timed("probe", noop, batch=True)
        in_window, per_call, per_skip = [], [], []
        for _ in range(5):
            probe.active = True
            start = clock()
            for _ in range(repeats):
                timed()
            elapsed, windows = clock() - start, probe.take().seconds["probe"]
            in_window.append(windows / repeats)
            per_call.append((elapsed - windows) / repeats)
            probe.active = False
            start = clock()
            for _ in range(repeats):
                timed()
            middle = clock()
            for _ in range(repeats):
                noop()
            per_skip.append(((middle - start) - (clock() - middle)) / repeats)
        self.in_window = max(0.0, statistics.median(in_window))
        self.per_call = max(0.0, statistics.median(per_call))
        self.per_skip = max(0.0, statistics.median(per_skip))
