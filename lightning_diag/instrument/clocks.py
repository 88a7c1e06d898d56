"""Clocks for step timing: host ``perf_counter`` marks, or CUDA events read once per interval."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import torch

from lightning_diag.instrument.cpu_pressure import CpuPressure, OtherCpu

__all__ = ["CudaClock", "HostClock", "TimeSource"]


class TimeSource:
    """Where host time comes from: ``wall()`` (``time.perf_counter``), ``cpu()`` (``time.process_time``) and
    ``pressure()`` (the machine's CPU pressure, :class:`~lightning_diag.instrument.cpu_pressure.CpuPressure`) and
    ``other_cpu()`` (the CPU time of the machine's other processes,
    :class:`~lightning_diag.instrument.cpu_pressure.OtherCpu`).

    The injection point of :class:`~lightning_diag.callbacks.system_monitor.monitor.SystemMonitor`'s clocks: tests set
    ``monitor.time_source`` to a fake whose readings they advance themselves, so that what is timed is exact.

    Example:
        >>> source = TimeSource()
        >>> source.wall() <= source.wall()
        True
    """

    def __init__(self) -> None:
        self._pressure = CpuPressure()
        self._other = OtherCpu()

    def wall(self) -> float:
        """Seconds of a monotonic wall clock."""
        return time.perf_counter()

    def cpu(self) -> float:
        """Seconds of CPU time of this process."""
        return time.process_time()

    def thread(self) -> float:
        """Seconds of CPU time of the calling thread (the training loop's, when it calls)."""
        return time.thread_time()

    def pressure(self) -> float | None:
        """Seconds during which some runnable task of the machine waited for a CPU, since boot (``None``: the
        system keeps no such count)."""
        return self._pressure.read()

    def other_cpu(self) -> float | None:
        """CPU seconds the machine's other processes (not this one, its threads or its children) used since boot
        (``None``: the system keeps no such count)."""
        return self._other.read()


class HostClock:
    """Marks are wall-clock readings (``time.perf_counter()``, or ``source.wall()``); durations are ready at once.

    Args:
        source: The time source (:class:`TimeSource` by default).
    """

    def __init__(self, source: TimeSource | None = None) -> None:
        self.source = source or TimeSource()

    def mark(self) -> Any:
        """A point in time."""
        return self.source.wall()

    def durations(self, pairs: list[tuple[Any, Any]]) -> list[float]:
        """Seconds between each ``(start, end)`` pair."""
        return [float(end - start) for start, end in pairs]


class CudaClock:
    """Marks are CUDA events recorded on the current stream: nothing waits for the device until
    :meth:`durations`, called on logging steps only, synchronises on the last event.

    Args:
        event_factory: Makes a timing event (``torch.cuda.Event(enable_timing=True)`` by default; tests pass a
            fake with ``record()``, ``synchronize()`` and ``elapsed_time(other)`` in milliseconds).
    """

    def __init__(self, event_factory: Callable[[], Any] | None = None) -> None:
        self.event_factory = event_factory or functools.partial(torch.cuda.Event, enable_timing=True)

    def mark(self) -> Any:
        """Record an event on the current stream."""
        event = self.event_factory()
        event.record()
        return event

    def durations(self, pairs: list[tuple[Any, Any]]) -> list[float]:
        """Seconds between each ``(start, end)`` pair of events (one host synchronisation)."""
        if not pairs:
            return []
        pairs[-1][1].synchronize()
        return [float(start.elapsed_time(end)) / 1e3 for start, end in pairs]
