"""SystemMonitor's step-time windows: the evidence its step-time tests judge, kept across logging intervals and
checkpoints."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from lightning_diag.rules.measures import StepTimes
from lightning_diag.stats.timing import Periodicity

__all__ = ["StepWindows"]


def _mean_pressure(pressures: Iterable[float]) -> float | None:
    """The mean CPU pressure over the steps whose pressure is known (``None``: none is)."""
    known = [p for p in pressures if p >= 0]
    return float(np.mean(known)) if known else None


class StepWindows:
    """The last ``window`` optimizer steps after the warm-up, and every step of a fit until that window is long
    enough for the ordinary periodic test (``warmup_steps + min_steps`` steps).

    Args:
        window: Optimizer steps the periodic and fluctuation tests look at.
        warmup_steps: First optimizer steps of a fit left out of :attr:`step_window`.
        min_steps: Steps after the warm-up from which the ordinary periodic test judges (and :attr:`run_window` is
            dropped).
    """

    def __init__(self, window: int, warmup_steps: int, min_steps: int) -> None:
        self.window = window
        self.warmup_steps = warmup_steps
        self.min_steps = min_steps
        # (wall step time, compute time, excluded from the fluctuation test, scheduled work left out of the step
        # time) per optimizer step after warm-up
        self.step_window: deque[tuple[float, float, bool, float]] = deque(maxlen=window)
        self.util_window: deque[float] = deque(maxlen=window)
        # the CPU pressure blamed on the machine at each step of `step_window` (its interval's share, 0 where the
        # run's own tasks made it: `machine_pressure`; -1: not known)
        self.pressure_window: deque[float] = deque(maxlen=window)
        # (wall step time, known one-time cause, scheduled work) of every step since the fit's start, warm-up
        # included, until the window after the warm-up is long enough for the ordinary periodic test
        self.run_window: list[tuple[float, bool, float]] = []
        # the CPU pressure blamed on the machine at each step of `run_window` (as `pressure_window`)
        self.run_pressure: list[float] = []
        self.steps_seen = 0

    def state_dict(self) -> dict[str, Any]:
        """The windows and the steps seen, under SystemMonitor's checkpoint keys."""
        return {
            "window": [[t, c, bool(f), w] for t, c, f, w in self.step_window],
            "utilization": list(self.util_window),
            "steps_seen": self.steps_seen,
            "run_window": [[t, bool(f), w] for t, f, w in self.run_window],
            "pressure": list(self.pressure_window),
            "run_pressure": list(self.run_pressure),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output (the caller checked its keys)."""
        self.step_window = deque(
            ((float(t), float(c), bool(f), float(w)) for t, c, f, w in state_dict["window"]), maxlen=self.window
        )
        self.util_window = deque((float(u) for u in state_dict["utilization"]), maxlen=self.window)
        self.steps_seen = int(state_dict["steps_seen"])
        self.run_window = [(float(t), bool(f), float(w)) for t, f, w in state_dict["run_window"]]
        self.pressure_window = deque((float(p) for p in state_dict["pressure"]), maxlen=self.window)
        self.run_pressure = [float(p) for p in state_dict["run_pressure"]]

    def add(
        self,
        judged: Sequence[float],
        compute: Sequence[float],
        flags: Sequence[bool],
        one_time: Sequence[bool],
        work: Sequence[float],
        pressure: float,
    ) -> None:
        """Add one interval's steps: the step times judged, their compute times, whether each is left out of the
        fluctuation test, whether each has a known one-time cause, their scheduled work, and the interval's CPU
        pressure (the same for every step)."""
        for t, c, flag, once, w in zip(judged, compute, flags, one_time, work, strict=True):
            self.steps_seen += 1
            if self.steps_seen > self.warmup_steps:
                self.step_window.append((float(t), float(c), bool(flag), float(w)))
                self.pressure_window.append(pressure)
            if self.steps_seen < self.warmup_steps + self.min_steps:
                self.run_window.append((float(t), bool(once), float(w)))
                self.run_pressure.append(pressure)
        if self.steps_seen >= self.warmup_steps + self.min_steps:
            # the window after the warm-up is long enough for the ordinary test
            self.run_window, self.run_pressure = [], []

    def step_times(self) -> StepTimes:
        """What ``step_time_periodic`` judges: the window's step times, and the fit's since its start."""
        return StepTimes(
            [t for t, _, _, _ in self.step_window],
            run_times=[t for t, _, _ in self.run_window],
            explained=[f for _, f, _ in self.run_window],
            work=[w for _, _, _, w in self.step_window],
            run_work=[w for _, _, w in self.run_window],
            run_pressure=_mean_pressure(self.run_pressure),
        )

    def pressure(self) -> float | None:
        """The mean CPU pressure over the window's steps whose pressure is known (``None``: none is)."""
        return _mean_pressure(self.pressure_window)

    def compute_times(self, pattern: Periodicity) -> list[float]:
        """What ``step_time_fluctuation`` judges: the window's compute times, without the steps left out of it and
        those of the periodic ``pattern`` (when found)."""
        return [
            c
            for i, (_, c, flag, _) in enumerate(self.step_window)
            if not flag and not (pattern.found and i >= pattern.phase and (i - pattern.phase) % pattern.period == 0)
        ]
