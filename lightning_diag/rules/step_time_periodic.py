"""``step_time_periodic`` (framework-free), fed by :class:`~lightning_diag.SystemMonitor` at its logging steps.

Exact meaning: in the last ``window`` optimizer steps, steps more than ``slow_ratio`` above the
median recur with a fixed period (:func:`~lightning_diag.stats.timing.detect_period`) and their excess over
the median costs more than ``threshold`` of the window's time. The test needs :data:`MIN_STEPS` step times,
except for a pattern seen enough times to be certain: at least :data:`CERTAIN_OCCURRENCES` slow steps, every
position of the pattern slow and no slow step off it (a stall every 10 steps is named after its third
occurrence past the warm-up, at step 50, instead of at step 80). The warm-up gives way to a pattern in every
step since the fit's start (:func:`pattern_from_start`, steps with a known one-time cause left neutral; a step
whose only known cause is in its data waiting, an epoch's first or the one after a validation run, is judged
by :class:`~lightning_diag.SystemMonitor` on its compute and a typical wait instead):
three stalls in step with the run's start, or two, half a period or more after it, each at least
:data:`OVERWHELMING_FACTOR` times the median step and together costing above
:data:`OVERWHELMING_SHARE_FACTOR` times the threshold (a 70% stall every 10 steps is named at step 20 with the
20-step warm-up). Work the trainer does on schedule is never evidence: the step times are judged without the
lightning_diag callbacks' hooks (wall time) and the loggers' writes, and a step above the median by no more
than :data:`WORK_FACTOR` times that work measured on it (its after-effects: caches, a writer thread) is
neutral (:func:`explained_by_work`), so a logging cadence is no period while a stall far larger than the
logging work on the same steps still is. ``value`` is the period in steps. The same test runs on dips of GPU
utilisation when NVML is present (source ``gpu_utilization``).

On a contended machine (CPU pressure above :data:`~lightning_diag.rules.contention.CONTENDED_PRESSURE` over the
steps judged: the window's, or every step's since the fit's start during the warm-up;
:mod:`lightning_diag.rules.contention`) the alert is an ``info`` (source ``step_time_contended``); a condition that
persists once the machine is free again is a warning of its own (source ``step_time``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from lightning_diag.core.record import Alert, Severity
from lightning_diag.core.registry import POSITIVE, Limit, RuleSpec, default, register
from lightning_diag.rules.base import Latch, Rule, StepContext, excess
from lightning_diag.rules.contention import contended, contention_note, format_seconds, judged_once
from lightning_diag.rules.measures import Measure, Measures, StepTimes
from lightning_diag.stats.timing import Periodicity, Series, detect_period, slow_mask

__all__ = [
    "CERTAIN_OCCURRENCES",
    "DEFAULT_STEP_TIME_PERIODIC_SLOW_RATIO",
    "DEFAULT_STEP_TIME_PERIODIC_THRESHOLD",
    "DEFAULT_STEP_TIME_WINDOW",
    "MIN_OVERWHELMING_PERIOD",
    "MIN_STEPS",
    "OVERWHELMING_FACTOR",
    "OVERWHELMING_SHARE_FACTOR",
    "STEP_TIME_PERIODIC",
    "STEP_TIME_PERIODIC_SPEC",
    "STEP_TIME_WINDOW_KEY",
    "WORK_FACTOR",
    "StepPeriodicRule",
    "explained_by_work",
    "pattern_from_start",
]

_SYSTEM = "SystemMonitor"
STEP_TIME_PERIODIC_SPEC = register(RuleSpec(
    "step_time_periodic", _SYSTEM, "warning", 0.05,
    "slow steps (more than {slow_ratio:.0%} above the median) recurring with a fixed period and costing above "
    "{threshold:.0%} of the time",
    settings={"slow_ratio": 0.5, "window": 200}, source="seed 001 §1.2",
    limits={"threshold": Limit(low=0.0, high=1.0), "slow_ratio": POSITIVE, "window": Limit(low=30, integer=True)},
))
STEP_TIME_PERIODIC = STEP_TIME_PERIODIC_SPEC.rule_id
#: ``thresholds()`` keys of the settings SystemMonitor reads for its own measuring.
STEP_TIME_WINDOW_KEY = STEP_TIME_PERIODIC_SPEC.key("window")
#: ``step_time_periodic``: the periodic slow steps' excess above this share of the time.
DEFAULT_STEP_TIME_PERIODIC_THRESHOLD = default(STEP_TIME_PERIODIC)
#: ``step_time_periodic``: a step is slow more than this fraction above the median.
DEFAULT_STEP_TIME_PERIODIC_SLOW_RATIO = default(STEP_TIME_PERIODIC_SPEC.key("slow_ratio"))
#: Optimizer steps of step times the periodic and fluctuation tests look at.
DEFAULT_STEP_TIME_WINDOW = int(default(STEP_TIME_PERIODIC_SPEC.key("window")))

#: Fewest step times the periodic test judges.
MIN_STEPS = 60
#: Slow steps that make a pattern certain before :data:`MIN_STEPS` (every position of the pattern slow, no slow step
#: off it): three stalls exactly one period apart in a quiet window.
CERTAIN_OCCURRENCES = 3
#: ``step_time_periodic`` during the warm-up: a pattern seen only twice counts when each of its stalls is at least
#: this many times the median step (an order of magnitude past the 1.5x "slow" line)...
OVERWHELMING_FACTOR = 10.0
#: ... and the two stalls' excess over the median costs above this many times the threshold (10 x 5% = 50%).
OVERWHELMING_SHARE_FACTOR = 10.0
#: Fewest steps between two stalls of a pattern seen twice (two slow steps 2 or 3 apart are no pattern).
MIN_OVERWHELMING_PERIOD = 4
#: ``step_time_periodic``: a step above the median by at most this many times the scheduled work measured on it
#: (the diagnostics' hooks and the loggers' writes, already taken out of its time) is that work's after-effect.
WORK_FACTOR = 1.0


def explained_by_work(times: Series, work: Series, factor: float = WORK_FACTOR) -> np.ndarray:
    """Which steps are slow only by the after-effects of the trainer's scheduled work measured on them.

    ``work`` holds, per step, the seconds of work the trainer did on schedule (the lightning_diag callbacks'
    hooks on their logging steps, the loggers' writes every ``log_every_n_steps``), already left out of
    ``times``. What such work leaves behind (evicted caches, a logger's writer thread taking the interpreter)
    makes the step slower still, by about as much as the work itself at most: a step above the median by no
    more than ``factor`` times its work is explained by it. A stall far larger than the work on the same steps
    is not.

    Returns:
        A boolean mask over ``times`` (all ``False`` when the lengths differ or a value is not finite).
    """
    x = np.asarray(times, dtype=float)
    w = np.asarray(work, dtype=float)
    if x.size == 0 or x.shape != w.shape or not (np.all(np.isfinite(x)) and np.all(np.isfinite(w))):
        return np.zeros(x.shape, dtype=bool)
    med = float(np.median(x))
    return (x > med) & (x - med <= factor * np.clip(w, 0.0, None))


def pattern_from_start(
    times: Series,
    explained: Sequence[bool],
    slow_ratio: float = DEFAULT_STEP_TIME_PERIODIC_SLOW_RATIO,
    threshold: float = DEFAULT_STEP_TIME_PERIODIC_THRESHOLD,
) -> Periodicity:
    """A stall pattern certain enough to name during the warm-up, in every step time since the fit's start.

    Steps with a known one-time cause (``explained``: the run's first step, a step that saved a checkpoint;
    :class:`~lightning_diag.SystemMonitor` judges an epoch's first step and the step after a validation run on
    their compute and a typical wait, and does not flag them) are neutral: they take the median of the others, so
    compilation, worker start-up, autotuning, validation and checkpoint saving are never evidence. The slow
    steps (:func:`~lightning_diag.stats.timing.slow_mask`) must then be exactly one period apart, and every
    position of the pattern before the first and after the last must be neutral (every position slow, none off
    it), and either

    * at least :data:`CERTAIN_OCCURRENCES` of them costing above ``threshold``, or
    * exactly two steps at least :data:`OVERWHELMING_FACTOR` times the median (the pattern is judged among those
      steps only, so a noisy machine's 1.5-10x jitter elsewhere neither makes nor breaks it),
      ``period >= MIN_OVERWHELMING_PERIOD``, at least half a period of steps before the first (not a start-up
      effect), together costing above :data:`OVERWHELMING_SHARE_FACTOR` times ``threshold``.

    Returns:
        The pattern (``share`` as in :func:`~lightning_diag.stats.timing.detect_period`); ``period == 0`` when
        there is none.
    """
    x = np.asarray(times, dtype=float)
    flags = np.asarray(explained, dtype=bool)
    if x.size != flags.size or x.size < 2 * MIN_OVERWHELMING_PERIOD or not np.all(np.isfinite(x)):
        return Periodicity(0)
    known = x[~flags]
    if known.size < x.size // 2:
        return Periodicity(0)
    x = np.where(flags, float(np.median(known)), x)
    med = float(np.median(x))
    total = float(x.sum())

    def share(steps: np.ndarray) -> float:
        return float(np.clip(x[steps] - med, 0.0, None).sum() / total) if total > 0 else 0.0

    def found(steps: np.ndarray, period: int) -> Periodicity:
        return Periodicity(
            period=period, phase=int(steps[0]), occurrences=int(steps.size), coverage=1.0, precision=1.0,
            share=share(steps),
        )

    # Three or more slow steps on one period, costing above the threshold.
    slow = np.flatnonzero(slow_mask(x, slow_ratio))
    if slow.size >= CERTAIN_OCCURRENCES:
        period = _one_period(slow, flags)
        if period and share(slow) > threshold:
            return found(slow, period)
    # Or exactly two overwhelming ones, judged among the overwhelming steps only: a noisy machine's 1.5-10x jitter
    # elsewhere neither makes nor breaks a pattern of 10x stalls.
    big = np.flatnonzero(x >= OVERWHELMING_FACTOR * med) if med > 0 else np.zeros(0, dtype=int)
    if big.size == 2:
        period = _one_period(big, flags)
        if (
            period >= MIN_OVERWHELMING_PERIOD
            and big[0] >= period // 2  # half a period of ordinary steps first: not a start-up effect
            and share(big) > OVERWHELMING_SHARE_FACTOR * threshold
        ):
            return found(big, period)
    return Periodicity(0)


def _one_period(slow: np.ndarray, explained: np.ndarray) -> int:
    """The period of ``slow`` (step indices) when they are exactly one period apart and every position of the
    pattern before the first and after the last has a known cause; else 0."""
    gaps = np.diff(slow)
    period = int(gaps[0])
    if np.any(gaps != period) or period < 2:
        return 0
    missed = [*range(int(slow[0]) - period, -1, -period), *range(int(slow[-1]) + period, explained.size, period)]
    return period if all(explained[i] for i in missed) else 0


class StepPeriodicRule(Rule):
    """``step_time_periodic``: slow steps that recur with a fixed period (or periodic hardware dips)."""

    specs = (STEP_TIME_PERIODIC_SPEC,)
    state_keys = ()
    optional = frozenset({Measure.STEP_TIMES, Measure.GPU_UTILIZATION, Measure.CPU_PRESSURE})

    def __init__(
        self,
        threshold: float = DEFAULT_STEP_TIME_PERIODIC_THRESHOLD,
        slow_ratio: float = DEFAULT_STEP_TIME_PERIODIC_SLOW_RATIO,
    ) -> None:
        super().__init__()
        self.latch = Latch(clear_after=3)  # a pattern missed on one or two checks is the same event
        self.threshold = threshold
        self.slow_ratio = slow_ratio
        self.last = Periodicity(0)
        self._pressure: float | None = None  # the CPU pressure of the window being judged

    def judge(self, ctx: StepContext, m: Measures) -> list[Alert]:
        """Judge the window of step times (``m.step_times``), a window of GPU utilisation samples
        (``m.gpu_utilization``: periodic dips, see :meth:`_utilization`), or both."""
        self._pressure = m.cpu_pressure
        alerts = [] if m.step_times is None else self._step_times(ctx, m.step_times)
        if m.gpu_utilization is not None:
            alerts += self._utilization(ctx, m.gpu_utilization)
        return alerts

    def _step_times(self, ctx: StepContext, t: StepTimes) -> list[Alert]:
        """Judge the window of step times ``t`` (seconds, oldest first, after the warm-up; :class:`StepTimes`).

        ``t.run_times``, every step time since the fit's start while the window is shorter than :data:`MIN_STEPS`,
        is judged by :func:`pattern_from_start`, and whether the machine is contended, when it finds a pattern, is
        then read from the CPU pressure over those same steps (``t.run_pressure``; ``m.cpu_pressure`` is the
        window's, which leaves out the warm-up: before its end it is not known). A step of ``t.times`` explained by
        the trainer's scheduled work ``t.work`` (:func:`explained_by_work`) takes the median; one of ``t.run_times``
        explained by ``t.run_work`` is neutral.
        """
        times, run_times, explained, work, run_work = t.times, t.run_times, t.explained, t.work, t.run_work
        source = "step_time"
        if work is not None:
            by_work = explained_by_work(times, work)
            if by_work.any():
                times = np.where(by_work, float(np.median(np.asarray(times, dtype=float))), times).tolist()
        if run_times is not None and explained is not None and run_work is not None:
            explained = (np.asarray(explained, dtype=bool) | explained_by_work(run_times, run_work)).tolist()
        found = Periodicity(0)
        if len(times) >= MIN_STEPS:
            found = detect_period(times, self.slow_ratio)
        else:
            if len(times) >= 2 * CERTAIN_OCCURRENCES:
                # a short window: only a certain pattern counts (see the module's docstring)
                found = detect_period(times, self.slow_ratio, min_occurrences=CERTAIN_OCCURRENCES)
                if not (found.found and found.coverage >= 1.0 and found.precision >= 1.0):
                    found = Periodicity(0)
            if not found.found and run_times is not None and explained is not None:
                early = pattern_from_start(run_times, explained, self.slow_ratio, self.threshold)
                if early.found:
                    # the steps judged are the run's since its start: their pressure decides whether the machine is
                    # contended (without a pattern, the window's: what latches the condition's end is unchanged)
                    self._pressure = t.run_pressure
                    # ``last`` indexes ``times`` (the caller leaves the pattern's steps out of other tests)
                    offset = len(run_times) - len(times)
                    found = dataclasses.replace(early, phase=(early.phase - offset) % early.period)
                    self.last = found
                    found, times = early, run_times
                    return self._judge(ctx, found, times, source)
        self.last = found
        return self._judge(ctx, found, times, source)

    def _judge(self, ctx: StepContext, found: Periodicity, times: Series, source: str) -> list[Alert]:
        """Latch and word the alert for ``found``, a pattern in ``times`` (an ``info`` on a contended machine)."""
        busy = contended(self._pressure)
        if not busy:
            self.observe(found.share if found.found else math.nan, self.threshold)
        active = found.found and found.share > self.threshold
        if not judged_once(self.latch, source, busy, active, excess(found.share, self.threshold)):
            return []
        median = float(np.median(np.asarray(times, dtype=float)))
        slow = float(np.mean(np.asarray(times, dtype=float)[found.phase :: found.period]))
        message = (
            f"every {found.period} steps a step is slow ({format_seconds(slow)} against a median of"
            f" {format_seconds(median)};"
            f" {found.occurrences} times in the last {len(times)} steps), costing {found.share:.0%} of the time"
        )
        if busy:
            assert self._pressure is not None  # contended
            return [
                self._alert(
                    ctx, message + contention_note(self._pressure), f"{source}_contended", float(found.period),
                    self.threshold, severity=Severity.INFO,
                )
            ]
        return [
            self._alert(
                ctx,
                message + ": look for work done every"
                f" {found.period} steps (logging, checkpointing, evaluation, garbage collection, a callback)",
                source,
                float(found.period),
                self.threshold,
            )
        ]

    def _utilization(self, ctx: StepContext, utilization: Series, dip: float = 20.0) -> list[Alert]:
        """Judge a window of GPU utilisation samples (percent): periodic dips ``dip`` points below the median."""
        if len(utilization) < MIN_STEPS:
            return []
        u = np.asarray(utilization, dtype=float)
        found = detect_period(u, mask=u < float(np.median(u)) - dip)
        source = "gpu_utilization"
        if not self.latch.update(source, found.found):
            return []
        return [
            self._alert(
                ctx,
                f"GPU utilisation dips every {found.period} steps ({found.occurrences} times in the last {u.size}"
                " steps): the device idles periodically (host-side work, data stalls, synchronisation)",
                source,
                float(found.period),
                self.threshold,
            )
        ]
