"""CPU pressure: how much of the time some runnable task waited for a CPU (Linux pressure stall information).

The kernel's ``/proc/pressure/cpu`` counts, in microseconds, the time during which at least one runnable task
had to wait for a CPU (its ``some`` line). On a machine the run has to itself that time is a few percent of the
wall time; when more tasks want to run than there are CPUs (other jobs, more dataloader workers than cores) it
grows towards the whole of it. :class:`~lightning_diag.SystemMonitor` reads it once per logging interval to tell
a step time that moves with the machine's load from one that moves with the run.
"""

from __future__ import annotations

__all__ = ["PRESSURE_FILE", "CpuPressure"]

#: The kernel's CPU pressure file (Linux 4.20 and later, with PSI enabled).
PRESSURE_FILE = "/proc/pressure/cpu"


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
