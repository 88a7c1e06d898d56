"""CPU pressure: how much of the time some runnable task waited for a CPU (Linux pressure stall information).

The kernel's ``/proc/pressure/cpu`` counts, in microseconds, the time during which at least one runnable task
had to wait for a CPU (its ``some`` line). On a machine the run has to itself that time is a few percent of the
wall time; when more tasks want to run than there are CPUs (other jobs, more dataloader workers than cores) it
grows towards the whole of it. :class:`~lightning_diag.SystemMonitor` reads it once per logging interval to tell
a step time that moves with the machine's load from one that moves with the run.

The pressure does not say whose tasks waited: the run's own dataloader workers, more of them than cores or started
afresh every epoch, make it just as well as another job does. :class:`OtherCpu` reads the CPU time the machine's
other processes used (the machine's busy time, ``/proc/stat``, less this process's and its children's), so that
the pressure is blamed on the machine only when something else was running.
"""

from __future__ import annotations

import os
import resource

__all__ = ["PRESSURE_FILE", "STAT_FILE", "CpuPressure", "OtherCpu"]

#: The kernel's CPU pressure file (Linux 4.20 and later, with PSI enabled).
PRESSURE_FILE = "/proc/pressure/cpu"
#: The kernel's CPU time counters (the machine's busy time is the first line's).
STAT_FILE = "/proc/stat"


class CpuPressure:
    """Reads the cumulative ``some`` stall time of :data:`PRESSURE_FILE`; ``None`` where the system has none.

    A read that fails once (no such file: another OS, an older kernel, PSI disabled) is not tried again.

    Args:
        path: The pressure file (tests pass a file of their own).

    Example:
        >>> import tempfile, os
        >>> with tempfile.NamedTemporaryFile("w", suffix=".psi", delete=False) as fh:
        ...     _ = fh.write("some avg10=1.00 avg60=2.00 avg300=3.00 total=2500000\\n")
        >>> CpuPressure(fh.name).read()
        2.5
        >>> os.unlink(fh.name); CpuPressure(fh.name).read() is None
        True
    """

    def __init__(self, path: str = PRESSURE_FILE) -> None:
        self.path = path
        self._failed = False

    def read(self) -> float | None:
        """Seconds during which some runnable task waited for a CPU since boot, or ``None``."""
        if self._failed:
            return None
        try:
            with open(self.path, encoding="ascii") as fh:
                line = fh.readline()
            fields = dict(part.split("=", 1) for part in line.split()[1:] if "=" in part)
            if not line.startswith("some") or "total" not in fields:
                raise ValueError(f"unexpected line {line!r}")
            return int(fields["total"]) / 1e6
        except (OSError, ValueError):
            self._failed = True
            return None


class OtherCpu:
    """Reads the CPU seconds the machine's other processes used since boot: the machine's busy time (``user``,
    ``nice``, ``system``, ``irq``, ``softirq`` and ``steal`` of :data:`STAT_FILE`'s ``cpu`` line: ``steal`` is
    the time the hypervisor gave this machine's CPUs to another) less this process tree's (its own threads and its
    children, dataloader workers included, alive or finished). ``None`` where the system keeps no such counters.

    The counters tick at ``SC_CLK_TCK`` (100 Hz): a difference over an interval is exact to a few hundredths of a
    CPU-second, so read it over spans of a second or more.

    Args:
        stat: The CPU counters file (tests pass one of their own).
        proc: The process directory whose children are this process's (``/proc``).

    Example:
        >>> other = OtherCpu()
        >>> first = other.read()
        >>> first is None or first >= 0.0
        True
    """

    def __init__(self, stat: str = STAT_FILE, proc: str = "/proc") -> None:
        self.stat = stat
        self.proc = proc
        self._tick = float(os.sysconf("SC_CLK_TCK")) if hasattr(os, "sysconf") else 100.0
        self._failed = False

    def machine_busy(self) -> float:
        """CPU seconds the machine's CPUs were busy since boot (all processes, and time stolen by a hypervisor)."""
        with open(self.stat, encoding="ascii") as fh:
            fields = fh.readline().split()
        if not fields or fields[0] != "cpu" or len(fields) < 9:
            raise ValueError(f"unexpected first line of {self.stat}: {' '.join(fields)!r}")
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[1:9])
        return (user + nice + system + irq + softirq + steal) / self._tick

    def _children_seconds(self) -> float:
        """CPU seconds of this process's live children (and of the children they finished), from their stat."""
        total = 0.0
        tasks = os.path.join(self.proc, str(os.getpid()), "task")
        for tid in os.listdir(tasks):
            try:
                with open(os.path.join(tasks, tid, "children"), encoding="ascii") as fh:
                    pids = fh.read().split()
            except OSError:
                continue
            for pid in pids:
                try:
                    with open(os.path.join(self.proc, pid, "stat"), encoding="ascii") as fh:
                        rest = fh.read().rsplit(")", 1)[1].split()
                except (OSError, IndexError):
                    continue  # a child that ended meanwhile: its time is in RUSAGE_CHILDREN once reaped
                total += sum(int(v) for v in rest[11:15]) / self._tick  # utime, stime, cutime, cstime
        return total

    def tree_seconds(self) -> float:
        """CPU seconds of this process (every thread), its finished children and its live ones."""
        own = resource.getrusage(resource.RUSAGE_SELF)
        done = resource.getrusage(resource.RUSAGE_CHILDREN)
        return own.ru_utime + own.ru_stime + done.ru_utime + done.ru_stime + self._children_seconds()

    def read(self) -> float | None:
        """CPU seconds the machine's other processes used since boot (a cumulative count: take differences), or
        ``None``."""
        if self._failed:
            return None
        try:
            return self.machine_busy() - self.tree_seconds()
        except (OSError, ValueError):
            self._failed = True
            return None
