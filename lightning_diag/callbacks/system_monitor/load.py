"""The machine's load over each logging interval of :class:`~lightning_diag.SystemMonitor`: the CPU pressure, and
the CPUs the machine's other processes used (who made the pressure).

:class:`MachineLoad` keeps the cumulative readings of its time source between two reports and turns them into the
interval's figures; :func:`~lightning_diag.rules.contention.machine_pressure` then decides whether the pressure is
the machine's (other processes busy) or the run's own (its dataloader workers).
"""

from __future__ import annotations

from typing import Protocol

__all__ = ["FIRST_SPAN_S", "OTHER_SPAN_S", "LoadSource", "MachineLoad"]

#: Seconds of wall time, at least, over which the other processes' CPU use is measured: the kernel counts CPU time
#: in hundredths of a second, so a span of a second reads it to about 0.02 CPUs; shorter intervals reuse the last
#: span's figure.
OTHER_SPAN_S = 1.0
#: Until the fit's first full span, the other processes' CPUs are read over the span so far once it is this long
#: (to about 0.1 CPUs); before, they are not known.
FIRST_SPAN_S = 0.2


class LoadSource(Protocol):
    """What :class:`MachineLoad` reads (:class:`~lightning_diag.instrument.clocks.TimeSource`, or a test's fake)."""

    def wall(self) -> float:
        """Seconds of a monotonic wall clock."""

    def pressure(self) -> float | None:
        """Cumulative seconds with some runnable task waiting for a CPU (``None``: not kept)."""

    def other_cpu(self) -> float | None:
        """Cumulative CPU seconds of the machine's other processes (``None``: not kept)."""


class MachineLoad:
    """The CPU pressure and the other processes' CPUs of each interval between two :meth:`take` calls.

    Args:
        source: Where the readings come from.

    Example:
        >>> class Fixed:
        ...     now = 0.0
        ...     def wall(self): return self.now
        ...     def pressure(self): return 0.1 * self.now  # some task waited 10% of the time
        ...     def other_cpu(self): return 0.5 * self.now  # other processes used half a CPU
        >>> source = Fixed(); load = MachineLoad(source)
        >>> source.now = 2.0; load.take()
        (0.1, 0.5)
    """

    def __init__(self, source: LoadSource) -> None:
        self.source = source
        wall = source.wall()
        self._pressure_mark = (wall, source.pressure())
        self._other_mark = (wall, source.other_cpu())
        self._other_cpus = -1.0
        self._read_at = wall  # the other processes' CPU time is read at most every FIRST_SPAN_S (files of /proc)
        self._full = False  # whether a full span was read

    @property
    def counts_others(self) -> bool:
        """Whether the source keeps the other processes' CPU time (a -1 from :meth:`take` then means: not read
        yet, in a fit's first :data:`FIRST_SPAN_S`)."""
        return self._other_mark[1] is not None

    def take(self) -> tuple[float, float]:
        """``(pressure, other_cpus)`` since the last call: the share of the wall time during which some runnable
        task waited for a CPU, and the CPUs the machine's other processes used over the last span of at least
        :data:`OTHER_SPAN_S` (over the span so far during a fit's first second, from :data:`FIRST_SPAN_S` on;
        each -1 where not known). The other processes' CPU time is read at most every :data:`FIRST_SPAN_S`."""
        wall, stall = self.source.wall(), self.source.pressure()
        (wall_then, stall_then), self._pressure_mark = self._pressure_mark, (wall, stall)
        pressure = -1.0
        if stall is not None and stall_then is not None and wall > wall_then:
            pressure = min(1.0, max(0.0, (stall - stall_then) / (wall - wall_then)))
        other_wall, other_then = self._other_mark
        if other_then is None or wall - self._read_at < FIRST_SPAN_S:
            return pressure, self._other_cpus
        self._read_at, other = wall, self.source.other_cpu()
        if other is None:
            self._other_mark, self._other_cpus = (wall, None), -1.0
        elif wall - other_wall >= OTHER_SPAN_S:  # a full span: its figure stands until the next one
            self._other_cpus, self._full = max(0.0, (other - other_then) / (wall - other_wall)), True
            self._other_mark = (wall, other)
        elif not self._full:  # the fit's first second: the span so far
            self._other_cpus = max(0.0, (other - other_then) / (wall - other_wall))
        return pressure, self._other_cpus
