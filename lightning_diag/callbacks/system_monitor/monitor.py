"""SystemMonitor: where each step's time goes, periodic stalls, memory, the hardware, and the diagnostics' cost."""

from __future__ import annotations

import contextlib
import math
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch
from pytorch_lightning.trainer.states import TrainerFn

from lightning_diag.callbacks.common.base import AlertHandler, DiagCallback, RuleChoices
from lightning_diag.callbacks.common.preset import Detector, Preset
from lightning_diag.callbacks.system_monitor.hooks import HookTimer
from lightning_diag.callbacks.system_monitor.interval import HEADER, gather_ranks, interval_values, judged_waits
from lightning_diag.callbacks.system_monitor.load import MachineLoad
from lightning_diag.callbacks.system_monitor.profiler import SystemProfiler
from lightning_diag.callbacks.system_monitor.steps import StepRecorder
from lightning_diag.callbacks.system_monitor.windows import StepWindows
from lightning_diag.core.tags import family_tag, overhead_tag
from lightning_diag.core.validation import check_bool, check_int
from lightning_diag.instrument.clocks import CudaClock, HostClock, TimeSource
from lightning_diag.instrument.memory import NvmlProbe, cuda_memory, host_rss_bytes
from lightning_diag.rules.contention import machine_pressure
from lightning_diag.rules.dataloader_bound import DATALOADER_BOUND, DataloaderBoundRule
from lightning_diag.rules.measures import LoaderWait, Measures
from lightning_diag.rules.memory_growth import MemoryGrowthRule
from lightning_diag.rules.step_time_fluctuation import (
    STEP_TIME_FLUCTUATION,
    STEP_TIME_WARMUP_STEPS_KEY,
    StepFluctuationRule,
)
from lightning_diag.rules.step_time_periodic import MIN_STEPS, STEP_TIME_WINDOW_KEY, StepPeriodicRule

__all__ = ["SystemMonitor", "SystemProfiler"]


class _ProfilerEvents:
    """What the trainer's :class:`SystemProfiler` tells its monitor, for the current fit."""

    def __init__(self, monitor: SystemMonitor, trainer: pl.Trainer) -> None:
        self.monitor = monitor
        self.trainer = trainer

    def batch_hooks_done(self) -> None:
        self.monitor.end_batch(self.trainer)

    def fetched(self, seconds: float) -> None:
        self.monitor.steps.add_fetch(seconds)

    def checkpoint_saved(self, seconds: float) -> None:
        self.monitor.steps.add_checkpoint(seconds)


class SystemMonitor(DiagCallback):
    r"""Where each optimizer step's time goes, periodic stalls, memory growth, and what the diagnostics cost.

    Every optimizer step is split into **waiting for data** (from the end of one training batch, or an epoch's
    start, to the start of the next batch, without validation and checkpoint saving), **forward + backward**
    (batch start to ``on_before_optimizer_step``; with gradient accumulation, every micro-batch) and the
    **optimizer step** (``on_before_optimizer_step`` to batch end). On CPU the marks are ``time.perf_counter``
    readings; on CUDA the compute marks are CUDA events read on logging steps only, so quiet steps never
    synchronise. Validation
    and ``trainer.save_checkpoint`` are timed on the host. Aggregated and logged every ``log_every_n_steps``
    optimizer steps.

    It also times the hooks of every other lightning_diag callback on the trainer (and its own, and the
    attention recorder's): the time inside them over the interval's time is ``diag/overhead/<CallbackName>``,
    the share of the interval's time the callback's hooks took, logging steps included. On CPU both are the
    training thread's CPU time, the quantity ``benchmarks/paired_share.py`` measures a callback's marginal cost
    in, so other processes on the machine do not inflate it; a hook blocked without using the CPU (sleeping,
    waiting on a file) is not counted there. On CUDA both are host wall times (kernels the hooks launch run
    asynchronously and are not counted). Reading the clock costs, so the per-batch hooks are timed on the batches
    around logging steps and on one quiet batch in each ``overhead_sample_every`` (at a random position); the
    other quiet batches are extrapolated from the sampled ones, with the sampling's standard error logged beside
    (``diag/system/overhead_stderr/<CallbackName>``), and the timing's own cost is added to ``SystemMonitor``'s
    share. See ``docs/system_monitor.md`` and ``docs/performance.md`` for how it compares with the measured
    marginal cost.

    Logged metrics (global rank zero; ``_s`` values are means per optimizer step over the interval):

    * ``diag/system/step_time_s``, ``diag/system/data_wait_s``, ``diag/system/forward_backward_s``,
      ``diag/system/optimizer_s``, ``diag/system/data_wait_share`` (waiting / step time).
    * ``diag/system/validation_s``, ``diag/system/checkpoint_s``: seconds spent in the interval.
    * ``diag/system/samples_per_s``, ``diag/system/tokens_per_s`` (when the batch has ``attention_mask`` /
      ``input_ids`` or is 2-D integer token ids).
    * ``diag/system/step_time_fluctuation`` (the block-to-block fluctuation of the window beyond its noise,
      :func:`~lightning_diag.stats.timing.block_fluctuation`),
      ``diag/system/step_time_period`` (steps; 0 when none).
    * ``diag/system/host_rss_mib``; on CUDA ``diag/system/cuda_allocated_mib``, ``cuda_reserved_mib``,
      ``cuda_peak_mib`` (peak over the interval); with NVML ``diag/system/gpu_utilization``,
      ``gpu_memory_mib``, ``gpu_temperature_c``, ``gpu_power_w``, ``gpu_sm_clock_mhz``.
    * Under DDP: ``diag/system/rank_<r>/step_time_s``, ``diag/system/rank_<r>/data_wait_s``,
      ``diag/system/slowest_rank`` (the rank with the most data waiting when that is above 10% of the step,
      else the longest step), ``diag/system/straggler_ratio`` (longest / shortest rank step time).
    * ``diag/overhead/<CallbackName>``: fraction of the interval's time spent in that callback's hooks (CPU time
      on CPU, host wall time on CUDA); ``diag/system/overhead_stderr/<CallbackName>`` (and ``.../total``, of their
      sum): its sampling standard error, as a fraction of the interval's time;
      ``diag/system/overhead_timed_batches``: the share of the interval's batches whose hooks were timed.
    * ``diag/threshold/dataloader_bound``, ``diag/threshold/step_time_fluctuation``: reference lines.

    Rules (see their modules in :mod:`lightning_diag.rules`, each named after its rule, for the exact meaning):
    ``dataloader_bound``, ``step_time_periodic``, ``step_time_fluctuation``, ``memory_growth``. Under DDP the rules
    judge the elementwise maximum over ranks (a synchronous step is as slow as its slowest rank), so every rank
    decides the same; the NVML utilisation test judges each rank's own device.

    Args:
        log_every_n_steps: Aggregate, log and judge every this many optimizer steps; defaults to the trainer's.
        nvml: Read GPU metrics through NVML when ``nvidia-ml-py`` is installed and the run is on CUDA.
        time_callbacks: Time the other lightning_diag callbacks' hooks (``diag/overhead/...``).
        overhead_sample_every: Time the per-batch hooks of one quiet batch in each block of this many (and every
            batch around a logging step); 1 times every batch, at the clock's cost on every hook call.
        rules: Thresholds and settings by rule id, ``False`` to switch a rule off (docs/thresholds.md):
            ``{"dataloader_bound": {"threshold": 0.4}, "step_time_periodic": {"window": 100}}``. The step-time
            tests look at ``step_time_periodic.window`` optimizer steps (default 200) and leave out the first
            ``step_time_fluctuation.warmup_steps`` (default 20).
        on_alert: A callable receiving each :class:`~lightning_diag.core.alerts.Alert` as it is recorded (global
            rank zero, after it is written to ``alerts.jsonl``): send it to Slack, e-mail or a pager. A handler
            that raises is reported once per fit through the ``lightning_diag`` logger and never stops training.

    Raises:
        TypeError: If an argument has the wrong type.
        ValueError: If an argument is out of range.
    """

    extra_state_keys = ("window", "utilization", "steps_seen", "run_window", "pressure", "run_pressure")
    preset = Preset(
        "SystemMonitor",
        (
            Detector(DataloaderBoundRule, "dataloader_rule", "dataloader"),
            Detector(StepPeriodicRule, "periodic_rule", "periodic"),
            Detector(StepFluctuationRule, "fluctuation_rule", "fluctuation"),
            Detector(MemoryGrowthRule, "memory_rule", "memory"),
        ),
    )
    # the detectors whose results this reads (the periodic pattern's steps are left out of the fluctuation's
    # compute times; the fluctuation is written); all are fed, see `feed`
    periodic_rule: StepPeriodicRule
    fluctuation_rule: StepFluctuationRule

    def __init__(
        self,
        *,
        log_every_n_steps: int | None = None,
        nvml: bool = True,
        time_callbacks: bool = True,
        overhead_sample_every: int = 8,
        rules: RuleChoices | None = None,
        on_alert: AlertHandler | None = None,
    ) -> None:
        super().__init__(rules=rules, log_every_n_steps=log_every_n_steps, on_alert=on_alert)
        #: Optimizer steps the periodic and fluctuation tests look at (``step_time_periodic.window``).
        self.window = int(self.setting(STEP_TIME_WINDOW_KEY))
        #: First optimizer steps of a fit left out of the step-time tests (``step_time_fluctuation.warmup_steps``).
        self.warmup_steps = int(self.setting(STEP_TIME_WARMUP_STEPS_KEY))
        check_bool("nvml", nvml)
        check_bool("time_callbacks", time_callbacks)
        check_int("overhead_sample_every", overhead_sample_every)
        self.nvml = nvml
        self.time_callbacks = time_callbacks
        self.overhead_sample_every = overhead_sample_every
        #: Where host time comes from (the injection point for tests: a fake with ``wall()`` and ``cpu()``).
        self.time_source = TimeSource()
        self.add_preset()
        self._reset_windows()
        self._overhead_clock = self.time_source.cpu
        self._hooks = HookTimer(self._overhead_clock)
        self._intervals: set[int] = set()
        self._last_cadence = 0
        self._nvml_probe: NvmlProbe | None = None
        self._profiler: SystemProfiler | None = None
        self._timed_close: Any = None
        self._reset_run()

    def _reset_windows(self) -> None:
        #: The step-time tests' evidence, kept across logging intervals and checkpoints.
        self.windows = StepWindows(self.window, self.warmup_steps, MIN_STEPS)

    @property
    def steps(self) -> StepRecorder:
        """The current fit's step recorder."""
        return self._steps

    def _reset_run(self, clock: HostClock | CudaClock | None = None) -> None:
        self._steps = StepRecorder(self.time_source, clock)
        self._load = MachineLoad(self.time_source)
        self._diag_mark = self._hooks.step_wall_seconds if hasattr(self, "_hooks") else 0.0
        clock = getattr(self, "_overhead_clock", None)
        self._overhead_mark = clock() if clock is not None else 0.0
        if hasattr(self, "_hooks"):
            self._hooks.take()  # hooks of the sanity check before the fit's first step are not the steps' cost

    # -- state ---------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The rules' state (the base class), the step-time and utilisation windows and the steps seen."""
        return {**super().state_dict(), **self.windows.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output.

        Raises:
            KeyError: If a key is missing; the message names every missing key.
        """
        super().load_state_dict(state_dict)
        self.windows.load_state_dict(state_dict)

    # -- set-up ----------------------------------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Fresh rules for a new fit; start timing the diagnostics' hooks; listen to the trainer's
        :class:`SystemProfiler` when it has one."""
        super().setup(trainer, pl_module, stage)
        if stage != TrainerFn.FITTING:
            return
        self._reset_windows()
        self._reset_run()
        # what the hooks cost is counted in CPU time on CPU (as benchmarks/paired_share.py measures it), in host
        # wall time on CUDA (the step's time is the events'; the hooks' kernels run asynchronously)
        on_cuda = trainer.strategy.root_device.type == "cuda"
        cpu_clock = getattr(self.time_source, "thread", self.time_source.cpu)
        self._overhead_clock = self.time_source.wall if on_cuda else cpu_clock
        self._hooks = HookTimer(self._overhead_clock, self.overhead_sample_every, wall=self.time_source.wall)
        diagnostics = [cb for cb in trainer.callbacks if isinstance(cb, DiagCallback)]  # type: ignore[attr-defined]
        # the batches around every timed callback's logging steps are timed whole (their measuring and writing)
        self._intervals = {cb.every_n_steps(trainer) for cb in diagnostics}
        self._last_cadence = self.cadence_step(trainer)
        self._timed_close = None
        if self.time_callbacks:
            # the timing's own cost per call, outside the windows it measures: SystemMonitor's, added to its share
            self._hooks.calibrate()
            # the driver calls every diagnostic's hooks through the timer; the batch's end is timed here, apart: it
            # picks which batch is timed next (`_next_batch`)
            if self._driver is not None:
                wrap = self._hooks.part_wrap(diagnostics, skip=[(self, "on_train_batch_end")])
                self._driver.time_parts(wrap, self._hooks.recorder_timed)
            self._timed_close = self._hooks.timed(type(self).__name__, self._close_batch, step=True, batch=True)
        # the trainer's own work (checkpoint saving, the batch fetch, the end of the callbacks' hooks) through its
        # profiler, when it is ours; else the batch ends at this callback's `on_train_batch_end`
        self._listen(None)
        profiler = getattr(trainer, "profiler", None)
        if isinstance(profiler, SystemProfiler):
            self._profiler = profiler
            profiler.listen(_ProfilerEvents(self, trainer), self.time_source.wall)

    def _listen(self, profiler: SystemProfiler | None) -> None:
        if self._profiler is not None:
            self._profiler.listen(None)
        self._profiler = profiler

    def end_batch(self, trainer: pl.Trainer) -> None:
        """The end of a training batch: close it, and pick whether the next one's hooks are timed."""
        if self._timed_close is None:
            self._close_batch(trainer)
            return
        self._timed_close(trainer)
        self._next_batch(trainer)

    def _next_batch(self, trainer: pl.Trainer) -> None:
        # the next batch touches the cadence steps from `step` (its forward) to `step + delta` (its end): timed
        # whole when one of them, or the one before, is a logging step of a timed callback
        step = self.cadence_step(trainer)
        delta, self._last_cadence = max(1, step - self._last_cadence), step
        # steps step-1 .. step+delta hold a multiple of `every` when (step+delta) % every <= delta+1
        exact = any((step + delta) % every <= delta + 1 for every in self._intervals)
        self._hooks.next_batch(exact)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Stop timing the driver's parts and listening to the profiler, then release the session."""
        if self._driver is not None and self.time_callbacks:
            self._driver.time_parts(None)
        self._timed_close = None
        self._listen(None)
        if self._nvml_probe is not None and self._nvml_probe.nvml is not None:
            with contextlib.suppress(Exception):
                self._nvml_probe.nvml.nvmlShutdown()
        self._nvml_probe = None
        super().teardown(trainer, pl_module, stage)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Pick the clock (CUDA events on a CUDA device) and open NVML."""
        super().on_train_start(trainer, pl_module)
        device = pl_module.device
        self._device = device
        clock = CudaClock() if device.type == "cuda" else HostClock(self.time_source)
        if self.nvml and device.type == "cuda" and self._nvml_probe is None:
            probe = NvmlProbe(device.index if device.index is not None else torch.cuda.current_device())
            self._nvml_probe = probe if probe.active else None
        self._reset_run(clock)
        host_rss_bytes()  # one-time set-up (importing psutil) here, not in the first logging step's timed hook
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)

    # -- the step (recorded by StepRecorder) -----------------------------------------------------------------
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """Close the data wait; mark the start of the batch's compute."""
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        # the diagnostics' hooks since the last batch's end are scheduled work, not data waiting
        spent = self._hooks.step_wall_seconds
        if spent != self._diag_mark:
            self._steps.add_work(spent - self._diag_mark)
            self._diag_mark = spent
        self._steps.batch_start(trainer.global_step, batch)

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        """Mark the end of forward + backward."""
        self._steps.before_optimizer_step()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        """The end of the batch (without a :class:`SystemProfiler`; with one, after every callback's hook)."""
        if self._profiler is None:
            self.end_batch(trainer)

    def save_checkpoint_state(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """Without a :class:`SystemProfiler`: a checkpoint is being saved (its file is written after the hooks)."""
        super().save_checkpoint_state(trainer, pl_module, checkpoint)
        if self._profiler is None and trainer.state.fn == TrainerFn.FITTING:
            self._steps.checkpoint_mark()

    def _close_batch(self, trainer: pl.Trainer) -> None:
        """At the end of the batch: mark it; on an optimizer-step boundary close the step, on a logging step
        report."""
        if not self._steps.in_batch:
            return
        # the diagnostics' hooks in wall time, as the step is measured (their CPU time leaves out their writing)
        spent = self._hooks.step_wall_seconds
        if self._steps.batch_end(trainer.global_step, spent - self._diag_mark) and self.is_logging_step(trainer):
            self._report(trainer)
        self._steps.resume()
        self._diag_mark = self._hooks.step_wall_seconds

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The epoch's first step waits from here (for a fresh dataloader iterator: a known cause); the time since
        the last batch (validation, the epoch-end hooks, checkpoint saving) is no step's."""
        super().on_train_epoch_start(trainer, pl_module)
        self._diag_mark = self._hooks.step_wall_seconds  # the diagnostics' epoch-end hooks are no step's work either
        self._steps.epoch_start()

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Start timing validation (its time is not data waiting)."""
        self._steps.validation_start()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Stop timing validation; the next step has a known cause (left out of the step-time tests' evidence)."""
        self._steps.validation_end(trainer.sanity_checking)

    # -- reporting -------------------------------------------------------------------------------------------
    def _report(self, trainer: pl.Trainer) -> None:
        interval = self._steps.take()
        if interval is None:
            return
        steps, flags, acc = interval.steps, interval.explained, interval.sums
        acc["rss"] = host_rss_bytes()
        acc["cpu_pressure"], acc["cpu_others"] = self._load.take()
        device = getattr(self, "_device", None)
        cuda = cuda_memory(device) if device is not None else {}
        waits = np.array([s[0] for s in steps], dtype=float)
        acc["wait"] = float(waits.sum())
        acc["forward_backward"] = float(sum(s[1] for s in steps))
        acc["optimizer"] = float(sum(s[2] for s in steps))
        busy = np.array([s[1] + s[2] + s[4] for s in steps], dtype=float)
        totals = waits + busy
        # the periodic test judges a step whose wait has a known cause (an epoch's first, the one after a validation
        # run) on its compute and the interval's typical wait: what other callbacks do at those boundaries is no
        # stall; `dataloader_bound` counts an epoch's fresh iterator (worker start-up is data waiting), not the
        # validation-end hooks of the callbacks after this one inside an epoch
        waits_judged = judged_waits(waits, flags, interval.wait_explained)
        loader_waits = judged_waits(waits, flags, interval.mid_validation)
        compute = np.array([s[3] for s in steps], dtype=float)
        # the diagnostics' own hooks are their cost (diag/overhead/...), not a stall of the training; they and
        # the loggers' writes are the scheduled work whose after-effects are no stall either
        diagnostics = np.array(interval.diagnostics, dtype=float)
        judged = np.clip(waits_judged + busy - diagnostics, 0.0, None)
        acc["loader_wait"] = float(loader_waits.sum())
        acc["loader_step"] = float(np.clip(loader_waits + busy - diagnostics, 0.0, None).sum())
        header = np.array([acc[k] for k in HEADER], dtype=float)
        work = diagnostics + np.array(interval.logging or [0.0] * len(steps), dtype=float)
        header, totals, compute, per_rank, both = gather_ranks(
            trainer, device, header, totals, compute, np.concatenate([judged, work])
        )
        judged, work = both[: len(steps)], both[len(steps) :]
        merged = dict(zip(HEADER, header.tolist(), strict=True))
        # the pressure the rules blame on the machine: none where the run's own tasks (its workers) made it
        machine = machine_pressure(merged["cpu_pressure"], merged["cpu_others"])
        # the step-time tests' pressure per step: not known while the other processes' CPUs are not read yet (a
        # fit's first 0.2 s, where its own start-up makes the pressure) on a machine that counts them
        per_step = -1.0 if merged["cpu_others"] < 0 and self._load.counts_others else machine
        n = len(steps)
        ctx = self.context(trainer)
        step = trainer.global_step

        # a step with a known cause in its wait only is judged (above) and is no longer neutral in the early test
        whole = [f and not b for f, b in zip(flags, interval.wait_explained or [False] * n, strict=True)]
        self.windows.add(judged.tolist(), compute.tolist(), flags, whole, work.tolist(), per_step)
        alerts = []
        step_total = float(totals.sum())
        # the share of the training's time: the diagnostics' own (a heavy logging step) would dilute it
        wait = LoaderWait(merged["loader_wait"], merged["loader_step"], n)
        alerts += self.feed(ctx, Measures(loader_wait=wait, cpu_pressure=machine if machine >= 0 else None))
        pressure = self.windows.pressure()
        alerts += self.feed(ctx, Measures(step_times=self.windows.step_times(), cpu_pressure=pressure))
        pattern = self.periodic_rule.last
        keep = self.windows.compute_times(pattern)
        alerts += self.feed(ctx, Measures(compute_times=keep, cpu_pressure=pressure))
        fluctuation = self.fluctuation_rule.last_value
        memory = {"host_rss": merged["rss"], **{k: v for k, v in cuda.items() if k == "cuda_allocated"}}
        alerts += self.feed(ctx, Measures(memory=memory))

        values = interval_values(
            merged,
            n,
            pattern.period,
            fluctuation,
            STEP_TIME_FLUCTUATION,
            cuda,
            per_rank,
            self.threshold_lines(DATALOADER_BOUND, STEP_TIME_FLUCTUATION),
            step_total,
        )
        if self._nvml_probe is not None:
            values.update({family_tag("system", k): v for k, v in self._nvml_probe.snapshot().items()})
            util = self._nvml_probe.utilization()
            if math.isfinite(util):
                self.windows.util_window.append(util)
                values[family_tag("system", "gpu_utilization")] = util
                alerts += self.feed(ctx, Measures(gpu_utilization=list(self.windows.util_window)))
        # the hooks' seconds over the same clock's seconds since the last report: the share of the interval
        now = self._overhead_clock()
        span, self._overhead_mark = now - self._overhead_mark, now
        taken = self._hooks.take()
        if span > 0 and self.time_callbacks:
            own = type(self).__name__
            # what the timing costs (clock reads, wrappers) is SystemMonitor's
            taken.seconds[own] = taken.seconds.get(own, 0.0) + taken.timer_seconds
            for name, seconds in taken.seconds.items():
                # an extrapolated near-zero cost can come out a hair below zero
                values[overhead_tag(name)] = max(0.0, seconds) / span
            for name, err in taken.stderr.items():
                if not math.isnan(err):
                    values[family_tag("system", "overhead_stderr", name)] = err / span
            values[family_tag("system", "overhead_timed_batches")] = taken.timed / max(taken.batches, 1)
        self.writer.scalars(values, step)
        self.record(alerts)
