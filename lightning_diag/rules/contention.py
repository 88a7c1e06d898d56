"""The CPU-pressure helpers of the three wall-clock rules (``dataloader_bound``, ``step_time_periodic``,
``step_time_fluctuation``), framework-free.

On a machine where more tasks want to run than there are CPUs, when some runnable task waited for a CPU during more
than :data:`CONTENDED_PRESSURE` of the wall time judged (Linux CPU pressure, ``/proc/pressure/cpu``; the busiest
rank's under DDP; the step-time window's mean for the step-time rules, the mean over every step since the fit's
start when ``step_time_periodic`` judges those during the warm-up, the interval's for ``dataloader_bound``), the
timings measure the machine's load as much as the run, so the alert is an ``info`` naming that pressure
(when other processes used at least :data:`OTHER_CPUS_BUSY` CPUs meanwhile, :func:`machine_pressure`: the
pressure that the run's own dataloader workers make is the run's)
(:func:`contention_note`; source ``step_time_contended``, ``dataloader_contended``) instead of a warning. A
condition that persists once the machine is no longer contended is then a warning of its own (source
``step_time``, ``dataloader``). Where the system keeps no CPU pressure (another OS, an older kernel) the rules judge
as they would on a free machine. :func:`format_seconds` words a duration in their messages.
"""

from __future__ import annotations

import math

from lightning_diag.rules.base import Latch

__all__ = [
    "CONTENDED_PRESSURE",
    "OTHER_CPUS_BUSY",
    "contended",
    "contention_note",
    "format_seconds",
    "judged_once",
    "machine_pressure",
]
#: The wall-clock rules: a share of the wall time with some runnable task waiting for a CPU above this makes the
#: machine contended (an ``info``, not a warning). A run alone on this 2-core VM reads 0.1-3%; two single-threaded
#: training processes on its two cores 4-10% (the calibration harness at ``--jobs 2``), and that already moved the
#: step times of healthy runs by 20%; three CPU-bound processes, near 50%.
CONTENDED_PRESSURE = 0.05
#: The CPUs other processes must have used on average (their CPU seconds per second of wall time, over a span of a
#: second or more) for the CPU pressure to be the machine's: below, the tasks that waited were the run's own (its
#: dataloader workers: two non-persistent workers restarting every 4 steps made 5.9% alone on this VM). This VM's
#: background alone uses 0.00-0.02 CPUs; one other single-threaded fit, 1.0.
OTHER_CPUS_BUSY = 0.25


def machine_pressure(pressure: float, other_cpus: float) -> float:
    """The CPU pressure the wall-clock rules blame on the machine: ``pressure`` (a share; negative: not known) when
    other processes used at least :data:`OTHER_CPUS_BUSY` CPUs (``other_cpus``; negative: not known, then the
    pressure counts as it is), ``0`` when the run had the CPUs to itself and its own tasks made the pressure.

    Example:
        >>> machine_pressure(0.3, 1.0), machine_pressure(0.3, 0.01), machine_pressure(0.3, -1.0)
        (0.3, 0.0, 0.3)
    """
    if pressure < 0 or other_cpus < 0 or other_cpus >= OTHER_CPUS_BUSY:
        return pressure
    return 0.0


def contended(pressure: float | None) -> bool:
    """Whether a CPU pressure (:attr:`~lightning_diag.rules.measures.Measures.cpu_pressure`, ``None``: not known)
    makes the machine contended (above :data:`CONTENDED_PRESSURE`)."""
    return pressure is not None and math.isfinite(pressure) and pressure > CONTENDED_PRESSURE


def judged_once(latch: Latch, source: str, busy: bool, active: bool, excess: float | None = None) -> bool:
    """Latch a wall-clock condition apart on a free and on a contended machine; ``True`` when it alerts now.

    On a free machine the condition is judged under ``source``; on a contended one under ``<source>_contended``
    (an ``info``), unless the same condition is already held as a warning (one event is reported once). Each
    latch sees only the checks of its own kind of machine: contention neither clears nor renews a warning, and a
    condition first seen on a contended machine becomes a warning of its own once it persists on a free one.
    """
    if busy:
        return latch.update(f"{source}_contended", active and not latch.holds(source), excess)
    return latch.update(source, active, excess)


def contention_note(pressure: float) -> str:
    """The words a contended finding's message ends with: the CPU pressure (a share) and what it means.

    Example:
        >>> contention_note(0.4).startswith(" while the machine was contended (some runnable task waited for a CPU 40%")
        True
    """
    return (
        f" while the machine was contended (some runnable task waited for a CPU {pressure:.0%} of the time, and"
        " other processes were busy): the timings follow the machine's load;"
        " judged as a warning when the CPU pressure is below"
        f" {CONTENDED_PRESSURE:.0%} or the run has the CPUs to itself"
    )


def format_seconds(value: float) -> str:
    """A duration in a message: milliseconds below a second, else seconds.

    Example:
        >>> format_seconds(0.0042), format_seconds(2.5)
        ('4.2 ms', '2.50 s')
    """
    return f"{value * 1e3:.1f} ms" if value < 1 else f"{value:.2f} s"
