"""Clocks for step timing: host ``perf_counter`` marks, or CUDA events read once per interval."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["CudaClock", "HostClock"]


class HostClock:
    """Marks are ``time.perf_counter()`` readings; durations are ready at once."""

    def mark(self) -> Any:
        """A point in time."""
        return time.perf_counter()

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
