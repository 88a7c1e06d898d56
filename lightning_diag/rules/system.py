"""System rules (framework-free): ``dataloader_bound``, ``step_time_periodic``, ``step_time_fluctuation``,
``memory_growth``. Fed by :class:`~lightning_diag.SystemMonitor` at its logging steps.

Exact meaning:

* ``dataloader_bound``: over one logging interval, the time spent waiting for the next batch is above
  ``threshold`` of the step time (without the lightning_diag callbacks' own hooks, whose cost is not the
  training's) **and** above ``min_wait_s`` per step, on ``patience`` consecutive intervals. Alerts once per fit:
  a loader too slow for the model is a property of its settings, and a share that hovers around the threshold
  is the same condition, not a new one each time it comes back.
* ``step_time_periodic``: in the last ``window`` optimizer steps, steps more than ``slow_ratio`` above the
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
* ``step_time_fluctuation``: the step times of the window (after ``warmup_steps``, without the step after a
  validation run, an epoch's first step, a step that saved a checkpoint and without the steps of a periodic
  pattern) are cut into blocks of ``block_steps``; the median change between consecutive block medians, over
  ``sqrt(2)`` times their median (:func:`~lightning_diag.stats.timing.block_fluctuation`: a level that moves once
  or drifts slowly is no fluctuation), is above ``threshold`` on ``patience`` consecutive evaluations (at least
  :data:`MIN_BLOCKS` blocks).
* The three wall-clock rules, on a machine where more tasks want to run than there are CPUs: when some runnable
  task waited for a CPU during more than :data:`CONTENDED_PRESSURE` of the wall time judged (Linux CPU pressure,
  ``/proc/pressure/cpu``; the busiest rank's under DDP; the step-time window's mean for the step-time rules, the
  interval's for ``dataloader_bound``), the timings measure the machine's load as much as the run, so the alert is
  an ``info`` naming that pressure (source ``step_time_contended``, ``dataloader_contended``) instead of a
  warning. A condition that persists once the machine is no longer contended is then a warning of its own (source
  ``step_time``, ``dataloader``). Where the system keeps no CPU pressure (another OS, an older kernel) the rules
  judge as they would on a free machine.
* ``memory_growth``: a memory series (host RSS, CUDA allocated) that grew by more than ``threshold`` of its
  first value over the last ``window`` intervals (Theil–Sen slope), rising on at least ``rising_fraction`` of
  them.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Sequence

import numpy as np

from lightning_diag.core.record import Alert, Severity
from lightning_diag.core.registry import COUNT, POSITIVE, STEPS, CheckSpec, Limit, RuleSpec, default, register
from lightning_diag.rules.base import Latch, Rule, StepContext, excess
from lightning_diag.rules.measures import Measure, Measures, StepTimes
from lightning_diag.stats.timing import (
    Periodicity,
    Series,
    block_fluctuation,
    detect_period,
    growth,
    slow_mask,
)

__all__ = [
    "CONTENDED_PRESSURE",
    "DATALOADER_BOUND",
    "DATALOADER_BOUND_SPEC",
    "DEFAULT_DATALOADER_BOUND_MIN_WAIT_S",
    "DEFAULT_DATALOADER_BOUND_PATIENCE",
    "DEFAULT_DATALOADER_BOUND_THRESHOLD",
    "DEFAULT_MEMORY_GROWTH_RISING_FRACTION",
    "DEFAULT_MEMORY_GROWTH_THRESHOLD",
    "DEFAULT_MEMORY_GROWTH_WINDOW",
    "DEFAULT_STEP_TIME_FLUCTUATION_BLOCK_STEPS",
    "DEFAULT_STEP_TIME_FLUCTUATION_PATIENCE",
    "DEFAULT_STEP_TIME_FLUCTUATION_THRESHOLD",
    "DEFAULT_STEP_TIME_PERIODIC_SLOW_RATIO",
    "DEFAULT_STEP_TIME_PERIODIC_THRESHOLD",
    "DEFAULT_STEP_TIME_WARMUP_STEPS",
    "DEFAULT_STEP_TIME_WINDOW",
    "LATENCY_FLUCTUATION_CHECK",
    "MEMORY_GROWTH",
    "MEMORY_GROWTH_SPEC",
    "STEP_TIME_FLUCTUATION",
    "STEP_TIME_FLUCTUATION_SPEC",
    "STEP_TIME_PERIODIC",
    "STEP_TIME_PERIODIC_SPEC",
    "STEP_TIME_WARMUP_STEPS_KEY",
    "STEP_TIME_WINDOW_KEY",
    "DataloaderBoundRule",
    "MemoryGrowthRule",
    "StepFluctuationRule",
    "StepPeriodicRule",
    "contended",
    "explained_by_work",
    "pattern_from_start",
]


# -- declarations (one per rule id; the docs' thresholds table and the report read them) -----------------------
_SYSTEM = "SystemMonitor"
DATALOADER_BOUND_SPEC = register(RuleSpec(
    "dataloader_bound", _SYSTEM, "warning", 0.25,
    "waiting for data above {threshold:.0%} of the step time on {patience:g} consecutive intervals",
    settings={"patience": 3, "min_wait_s": 0.005},
    limits={"threshold": Limit(low=0.0, high=1.0), "patience": COUNT},
))
STEP_TIME_PERIODIC_SPEC = register(RuleSpec(
    "step_time_periodic", _SYSTEM, "warning", 0.05,
    "slow steps (more than {slow_ratio:.0%} above the median) recurring with a fixed period and costing above "
    "{threshold:.0%} of the time",
    settings={"slow_ratio": 0.5, "window": 200}, source="seed 001 §1.2",
    limits={"threshold": Limit(low=0.0, high=1.0), "slow_ratio": POSITIVE, "window": Limit(low=30, integer=True)},
))
STEP_TIME_FLUCTUATION_SPEC = register(RuleSpec(
    "step_time_fluctuation", _SYSTEM, "warning", 0.15,
    "step-time fluctuation (median change between consecutive {block_steps:g}-step block medians / (sqrt 2 x their "
    "median)) above {threshold:.0%}",
    settings={"patience": 3, "warmup_steps": 20, "block_steps": 10}, check="deploy_latency_fluctuation",
    source="seed 000 §7.1",
    limits={"threshold": POSITIVE, "patience": COUNT, "warmup_steps": STEPS, "block_steps": COUNT},
))
MEMORY_GROWTH_SPEC = register(RuleSpec(
    "memory_growth", _SYSTEM, "warning", 0.1,
    "host or device memory growing by more than {threshold:.0%} over {window:g} intervals",
    settings={"window": 8, "rising_fraction": 0.7},
    limits={"threshold": POSITIVE, "window": Limit(low=3, integer=True),
            "rising_fraction": Limit(low=0.0, high=1.0)},
))
DATALOADER_BOUND = DATALOADER_BOUND_SPEC.rule_id
STEP_TIME_PERIODIC = STEP_TIME_PERIODIC_SPEC.rule_id
STEP_TIME_FLUCTUATION = STEP_TIME_FLUCTUATION_SPEC.rule_id
MEMORY_GROWTH = MEMORY_GROWTH_SPEC.rule_id
#: ``step_time_fluctuation``'s row of the ``lightning-diag report`` checklist (registered in report order by
#: :mod:`lightning_diag.rules.catalog`).
LATENCY_FLUCTUATION_CHECK = CheckSpec("deploy_latency_fluctuation", "Deployment",
                                      "Latency fluctuation < {step_time_fluctuation:.0%}")
#: ``thresholds()`` keys of the settings SystemMonitor reads for its own measuring.
STEP_TIME_WINDOW_KEY = STEP_TIME_PERIODIC_SPEC.key("window")
STEP_TIME_WARMUP_STEPS_KEY = STEP_TIME_FLUCTUATION_SPEC.key("warmup_steps")


def _default(rule: str, setting: str | None = None) -> float:
    return default(f"{rule}.{setting}" if setting else rule)


#: ``dataloader_bound``: data waiting above this share of the step time.
DEFAULT_DATALOADER_BOUND_THRESHOLD = _default(DATALOADER_BOUND)
#: ``dataloader_bound``: consecutive logging intervals it must hold.
DEFAULT_DATALOADER_BOUND_PATIENCE = int(_default(DATALOADER_BOUND, "patience"))
#: ``dataloader_bound``: seconds of waiting per step below which it never fires.
DEFAULT_DATALOADER_BOUND_MIN_WAIT_S = _default(DATALOADER_BOUND, "min_wait_s")
#: ``step_time_periodic``: the periodic slow steps' excess above this share of the time.
DEFAULT_STEP_TIME_PERIODIC_THRESHOLD = _default(STEP_TIME_PERIODIC)
#: ``step_time_periodic``: a step is slow more than this fraction above the median.
DEFAULT_STEP_TIME_PERIODIC_SLOW_RATIO = _default(STEP_TIME_PERIODIC, "slow_ratio")
#: Optimizer steps of step times the periodic and fluctuation tests look at.
DEFAULT_STEP_TIME_WINDOW = int(_default(STEP_TIME_PERIODIC, "window"))
#: ``step_time_fluctuation``: block-to-block fluctuation above this (seed 000 §7.1: 15%).
DEFAULT_STEP_TIME_FLUCTUATION_THRESHOLD = _default(STEP_TIME_FLUCTUATION)
#: ``step_time_fluctuation``: consecutive evaluations it must hold.
DEFAULT_STEP_TIME_FLUCTUATION_PATIENCE = int(_default(STEP_TIME_FLUCTUATION, "patience"))
#: Optimizer steps at the start of a fit left out of the step-time tests.
DEFAULT_STEP_TIME_WARMUP_STEPS = int(_default(STEP_TIME_FLUCTUATION, "warmup_steps"))
#: ``step_time_fluctuation``: optimizer steps per block whose median is one point of the fluctuation.
DEFAULT_STEP_TIME_FLUCTUATION_BLOCK_STEPS = int(_default(STEP_TIME_FLUCTUATION, "block_steps"))
#: ``memory_growth``: growth above this fraction of the window's first value.
DEFAULT_MEMORY_GROWTH_THRESHOLD = _default(MEMORY_GROWTH)
#: ``memory_growth``: logging intervals the growth is measured over.
DEFAULT_MEMORY_GROWTH_WINDOW = int(_default(MEMORY_GROWTH, "window"))
#: ``memory_growth``: fraction of the intervals that must rise.
DEFAULT_MEMORY_GROWTH_RISING_FRACTION = _default(MEMORY_GROWTH, "rising_fraction")

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
#: Fewest blocks the fluctuation test judges.
MIN_BLOCKS = 5
#: The step-time rules: a share of the window's wall time with some runnable task waiting for a CPU above this
#: makes the machine contended (an ``info``, not a warning). A machine the run has to itself stays at a few
#: percent; three CPU-bound processes on two cores, near 50%.
CONTENDED_PRESSURE = 0.10
#: ``step_time_periodic``: a step above the median by at most this many times the scheduled work measured on it
#: (the diagnostics' hooks and the loggers' writes, already taken out of its time) is that work's after-effect.
WORK_FACTOR = 1.0


def contended(pressure: float | None) -> bool:
    """Whether a CPU pressure (:attr:`~lightning_diag.rules.measures.Measures.cpu_pressure`, ``None``: not known)
    makes the machine contended (above :data:`CONTENDED_PRESSURE`)."""
    return pressure is not None and math.isfinite(pressure) and pressure > CONTENDED_PRESSURE


def _contention(pressure: float | None) -> str:
    return (
        f" while the machine was contended (some runnable task waited for a CPU {pressure:.0%} of the time:"
        " other processes, or more dataloader workers than cores): the timings follow the machine's load;"
        " judged as a warning when the CPU pressure is below"
        f" {CONTENDED_PRESSURE:.0%}"
    )


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


def _seconds(value: float) -> str:
    return f"{value * 1e3:.1f} ms" if value < 1 else f"{value:.2f} s"


class DataloaderBoundRule(Rule):
    """``dataloader_bound``: fed once per logging interval with the summed waiting and step time."""

    specs = (DATALOADER_BOUND_SPEC,)
    state_keys = ("streak",)
    needs = frozenset({Measure.LOADER_WAIT})
    optional = frozenset({Measure.CPU_PRESSURE})

    def __init__(
        self,
        threshold: float = DEFAULT_DATALOADER_BOUND_THRESHOLD,
        patience: int = DEFAULT_DATALOADER_BOUND_PATIENCE,
        min_wait_s: float = DEFAULT_DATALOADER_BOUND_MIN_WAIT_S,
    ) -> None:
        super().__init__()
        self.threshold = threshold
        self.patience = patience
        self.latch = Latch(clear_after=sys.maxsize)  # once per fit: a new fit builds new rules
        self.min_wait_s = min_wait_s
        self.streak = 0

    def judge(self, ctx: StepContext, m: Measures) -> list[Alert]:
        """Judge one interval, ``m.loader_wait``: ``wait_s`` and ``step_s`` (without the diagnostics' own time)
        summed over its ``steps`` optimizer steps; an ``info`` when the interval's CPU pressure (``m.cpu_pressure``)
        makes the machine contended (a loader starved of CPU by other processes waits too)."""
        assert m.loader_wait is not None  # checked against `needs`
        wait_s, step_s, steps, source = m.loader_wait.wait_s, m.loader_wait.step_s, m.loader_wait.steps, "dataloader"
        if steps <= 0 or not (step_s > 0) or not math.isfinite(wait_s):
            return []
        share = wait_s / step_s
        busy = contended(m.cpu_pressure)
        if not busy:
            self.observe(min(excess(share, self.threshold), excess(wait_s / steps, self.min_wait_s)), 1.0)
        active = share > self.threshold and wait_s / steps > self.min_wait_s
        self.streak = self.streak + 1 if active else 0
        persists = self.streak >= self.patience
        fired = self.latch.update(source, persists and not busy)
        fired_busy = self.latch.update(f"{source}_contended", persists and busy)
        if not (fired or fired_busy):
            return []
        message = (
            f"the training loop waits for data {share:.0%} of the step time ({_seconds(wait_s / steps)} per step)"
            f" on {self.streak} consecutive intervals"
        )
        if busy:
            assert m.cpu_pressure is not None  # contended
            return [
                self._alert(
                    ctx, message + _contention(m.cpu_pressure), f"{source}_contended", share, self.threshold,
                    severity=Severity.INFO,
                )
            ]
        return [
            self._alert(
                ctx,
                message + ": raise the DataLoader's `num_workers`, set `pin_memory=True` and"
                " `persistent_workers=True`, raise `prefetch_factor`, or move preprocessing out of `__getitem__`",
                source,
                share,
                self.threshold,
            )
        ]


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
        is judged by :func:`pattern_from_start`. A step of ``t.times`` explained by the trainer's scheduled work
        ``t.work`` (:func:`explained_by_work`) takes the median; one of ``t.run_times`` explained by ``t.run_work``
        is neutral.
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
        # both latches see every check: a pattern that outlasts the contention is then a warning of its own
        fired = self.latch.update(source, active and not busy, excess(found.share, self.threshold))
        fired_busy = self.latch.update(f"{source}_contended", active and busy, excess(found.share, self.threshold))
        if not (fired or fired_busy):
            return []
        median = float(np.median(np.asarray(times, dtype=float)))
        slow = float(np.mean(np.asarray(times, dtype=float)[found.phase :: found.period]))
        message = (
            f"every {found.period} steps a step is slow ({_seconds(slow)} against a median of {_seconds(median)};"
            f" {found.occurrences} times in the last {len(times)} steps), costing {found.share:.0%} of the time"
        )
        if busy:
            assert self._pressure is not None  # contended
            return [
                self._alert(
                    ctx, message + _contention(self._pressure), f"{source}_contended", float(found.period),
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


class StepFluctuationRule(Rule):
    """``step_time_fluctuation``: the block-to-block fluctuation of the step times above the threshold."""

    specs = (STEP_TIME_FLUCTUATION_SPEC,)
    state_keys = ("streak",)
    needs = frozenset({Measure.COMPUTE_TIMES})
    optional = frozenset({Measure.CPU_PRESSURE})

    def __init__(
        self,
        threshold: float = DEFAULT_STEP_TIME_FLUCTUATION_THRESHOLD,
        patience: int = DEFAULT_STEP_TIME_FLUCTUATION_PATIENCE,
        block_steps: int = DEFAULT_STEP_TIME_FLUCTUATION_BLOCK_STEPS,
    ) -> None:
        super().__init__()
        self.threshold = threshold
        self.patience = patience
        self.latch = Latch.for_patience(patience)
        self.block_steps = block_steps
        self.streak = 0
        #: The fluctuation of the last window judged (``nan``: too short), for the logs; not checkpoint state.
        self.last_value = math.nan

    def judge(self, ctx: StepContext, m: Measures) -> list[Alert]:
        """Judge a window of step times already cleared of warm-up, validation and periodic steps
        (``m.compute_times``), an ``info`` when the window's CPU pressure (``m.cpu_pressure``) makes the machine
        contended; the fluctuation it measured is :attr:`last_value`."""
        times, source, pressure = m.compute_times, "step_time", m.cpu_pressure
        assert times is not None  # checked against `needs`
        self.last_value = math.nan
        if len(times) < MIN_BLOCKS * self.block_steps:
            return []
        value = self.last_value = block_fluctuation(times, self.block_steps)
        busy = contended(pressure)
        if not busy:
            self.observe(value, self.threshold)
        active = math.isfinite(value) and value > self.threshold
        self.streak = self.streak + 1 if active else 0
        persists = self.streak >= self.patience
        # both latches see every check: a fluctuation that outlasts the contention is then a warning of its own
        fired = self.latch.update(source, persists and not busy, excess(value, self.threshold))
        fired_busy = self.latch.update(f"{source}_contended", persists and busy, excess(value, self.threshold))
        if not (fired or fired_busy):
            return []
        message = (
            f"step time fluctuates by {value:.0%} (median change between consecutive medians of"
            f" {self.block_steps}-step blocks / (sqrt 2 x their median) over the last {len(times)} steps, warm-up,"
            f" validation and periodic steps left out) on {self.streak} consecutive checks, above {self.threshold:.0%}"
        )
        if busy:
            assert pressure is not None  # contended
            return [
                self._alert(
                    ctx, message + _contention(pressure), f"{source}_contended", value, self.threshold,
                    severity=Severity.INFO,
                )
            ]
        return [
            self._alert(
                ctx,
                message + ": look for contention (other jobs on the machine, thermal throttling), variable batch"
                " shapes or irregular host work",
                source,
                value,
                self.threshold,
            )
        ]


class MemoryGrowthRule(Rule):
    """``memory_growth``: fed once per logging interval with each memory series' current value (bytes)."""

    specs = (MEMORY_GROWTH_SPEC,)
    state_keys = ("history",)
    needs = frozenset({Measure.MEMORY})

    def __init__(
        self,
        threshold: float = DEFAULT_MEMORY_GROWTH_THRESHOLD,
        window: int = DEFAULT_MEMORY_GROWTH_WINDOW,
        rising_fraction: float = DEFAULT_MEMORY_GROWTH_RISING_FRACTION,
    ) -> None:
        super().__init__()
        self.threshold = threshold
        self.window = window
        self.rising_fraction = rising_fraction
        self.history: dict[str, list[float]] = {}

    def judge(self, ctx: StepContext, m: Measures) -> list[Alert]:
        """Judge the latest value of each series (``m.memory``: ``{"host_rss": bytes, ...}``)."""
        values = m.memory or {}
        alerts = []
        for source, value in values.items():
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                continue
            series = self.history.setdefault(source, [])
            series.append(float(value))
            del series[: -self.window]
            if len(series) < self.window:
                continue
            rel, rising = growth(series)
            self.observe(min(excess(rel, self.threshold), excess(rising, self.rising_fraction)), 1.0)
            active = rel > self.threshold and rising >= self.rising_fraction
            if self.latch.update(source, active):
                mib = (series[-1] - series[0]) / 2**20
                alerts.append(
                    self._alert(
                        ctx,
                        f"{source} grew by {rel:.0%} ({mib:+.0f} MiB) over the last {len(series)} intervals, rising on"
                        f" {rising:.0%} of them: a leak (tensors kept with their graph, e.g. `losses.append(loss)`"
                        " instead of `loss.item()`/`loss.detach()`, or a cache that never evicts)",
                        source,
                        rel,
                        self.threshold,
                    )
                )
        return alerts
