"""One logging interval of SystemMonitor: per-step seconds from the clock marks, the DDP merge, the logged values.

:class:`~lightning_diag.callbacks.system_monitor.monitor.SystemMonitor` records marks during the steps and judges its
rules; these functions turn the interval's marks into numbers and the numbers into ``diag/system/...`` scalars.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch

from lightning_diag.core.tags import family_tag
from lightning_diag.instrument.clocks import CudaClock, HostClock

__all__ = ["HEADER", "Mark", "Step", "gather_ranks", "interval_values", "judged_waits", "resolve_steps"]

#: Per-interval numbers every rank contributes (gathered on logging steps under DDP); ``loader_wait`` and
#: ``loader_step`` are the data waiting and the step time ``dataloader_bound`` judges (:func:`judged_waits` of the
#: steps after a validation run inside an epoch; without the diagnostics' own hooks); ``cpu_pressure`` is the share
#: of the interval's wall time with some runnable task waiting for a CPU, ``cpu_others`` the CPUs the machine's
#: other processes used (:class:`~lightning_diag.callbacks.system_monitor.load.MachineLoad`; each -1: not known; the
#: busiest rank's).
HEADER = (
    "wait", "forward_backward", "optimizer", "validation", "checkpoint", "samples", "tokens", "rss", "loader_wait",
    "loader_step", "cpu_pressure", "cpu_others",
)
#: A ``(start, end, "fb" | "opt")`` pair of clock marks.
Mark = tuple[Any, Any, str]
#: (wait, forward+backward, optimizer, compute for the fluctuation test, checkpoint) seconds of one step.
Step = tuple[float, float, float, float, float]
_MIB = 2**20


def resolve_steps(
    clock: HostClock | CudaClock,
    pending: list[Mark],
    step_ends: list[int],
    waits: list[float],
    cpu: list[float],
    ckpt: list[float],
) -> tuple[list[Step], list[Mark]]:
    """The seconds of each optimizer step closed in the interval, and the marks of a step still in progress.

    ``step_ends[i]`` is the index into ``pending`` where step ``i`` ends; ``waits``, ``cpu`` and ``ckpt`` are its
    data waiting, process CPU time and checkpoint saving inside the batch. The compute time of the fluctuation
    test is the process CPU time on CPU (the contention of other processes on a shared machine is the
    machine's, not the run's) and the CUDA-event time on CUDA.
    """
    on_cpu = isinstance(clock, HostClock)
    durations = clock.durations([(a, b) for a, b, _ in pending])
    steps: list[Step] = []
    begin = 0
    for i, stop in enumerate(step_ends):
        kinds = [k for _, _, k in pending[begin:stop]]
        fb = sum(d for d, k in zip(durations[begin:stop], kinds, strict=True) if k == "fb")
        opt = sum(d for d, k in zip(durations[begin:stop], kinds, strict=True) if k == "opt")
        # checkpoint saving inside the batch (ModelCheckpoint's hook) is reported apart, and the periodic
        # test sees it again through the step total
        saving = ckpt[i]
        opt, fb = max(0.0, opt - saving), max(0.0, fb - max(0.0, saving - opt))
        steps.append((waits[i], fb, opt, cpu[i] if on_cpu else fb + opt, saving))
        begin = stop
    # keep the marks of a step still in progress (gradient accumulation across a logging boundary)
    return steps, pending[begin:]


def judged_waits(waits: np.ndarray, explained: Sequence[bool], wait_explained: Sequence[bool]) -> np.ndarray:
    """The data waiting of each step as a wall-clock rule judges it.

    A step whose wait has a known cause (``wait_explained``; for ``step_time_periodic`` an epoch's first step,
    which waits for a fresh dataloader iterator and the epoch-start hooks of the callbacks listed after
    ``SystemMonitor``, and the step after a validation run, which waits for the validation-end hooks of those
    callbacks) takes the median wait of the interval's steps without a known cause (``explained``), or of all its
    steps when every one has one (one-step epochs: every step waits alike). Its compute is judged as measured: a
    stall inside the training step is still seen on an epoch's first step.
    """
    out = np.asarray(waits, dtype=float).copy()
    boundary = np.asarray(wait_explained, dtype=bool)
    if out.size == 0 or boundary.shape != out.shape or not boundary.any():
        return out
    plain = out[~np.asarray(explained, dtype=bool)] if len(explained) == out.size else out[:0]
    out[boundary] = float(np.median(plain if plain.size else out))
    return out


def gather_ranks(
    trainer: pl.Trainer, device: Any, header: np.ndarray, totals: np.ndarray, compute: np.ndarray,
    judged: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, tuple[np.ndarray, np.ndarray] | None, np.ndarray]:
    """Under DDP: the elementwise maximum over ranks (one collective; samples and tokens summed), and each
    rank's summed step time and data waiting. On one process the inputs unchanged and ``None``.

    ``judged`` (default ``totals``): the step times the periodic test judges (without the diagnostics' own
    time), merged like ``totals`` and returned last.
    """
    judged = totals if judged is None else judged
    if trainer.world_size <= 1:
        return header, totals, compute, None, judged
    n = len(totals)
    local = torch.tensor(np.concatenate([header, totals, compute, judged]), dtype=torch.float64, device=device)
    gathered = trainer.strategy.all_gather(local)
    rows = gathered.reshape(trainer.world_size, -1).cpu().numpy()
    merged_header = rows[:, : len(header)].max(axis=0)
    merged_header[HEADER.index("samples")] = rows[:, HEADER.index("samples")].sum()
    merged_header[HEADER.index("tokens")] = rows[:, HEADER.index("tokens")].sum()
    h = len(header)
    step_times = rows[:, h : h + n]
    per_rank = (step_times.sum(axis=1), rows[:, HEADER.index("wait")])
    return (
        merged_header, step_times.max(axis=0), rows[:, h + n : h + 2 * n].max(axis=0), per_rank,
        rows[:, h + 2 * n :].max(axis=0),
    )


def interval_values(
    merged: dict[str, float],
    n: int,
    period: int,
    fluctuation: float,
    fluctuation_id: str,
    cuda: dict[str, float],
    per_rank: tuple[np.ndarray, np.ndarray] | None,
    reference_lines: dict[str, float],
    step_total: float,
) -> dict[str, float]:
    """The interval's ``diag/system/...`` scalars (the GPU and overhead ones are added by the callback).

    Args:
        merged: The :data:`HEADER` numbers of the interval (merged over ranks).
        n: Optimizer steps in the interval.
        period: The periodic slow steps' period (0 when none).
        fluctuation: The step-time fluctuation (NaN when not measured yet).
        fluctuation_id: The id of the rule that judges it, whose name its series takes
            (``diag/system/<rule>``; handed in by the monitor's preset module).
        cuda: CUDA memory in bytes by name (empty off CUDA).
        per_rank: Each rank's summed step time and data waiting under DDP, else ``None``.
        reference_lines: ``diag/threshold/...`` values to write beside the series.
        step_total: Seconds of the interval's optimizer steps.
    """
    values = {
        family_tag("system", "step_time_s"): step_total / n,
        family_tag("system", "data_wait_s"): merged["wait"] / n,
        family_tag("system", "forward_backward_s"): merged["forward_backward"] / n,
        family_tag("system", "optimizer_s"): merged["optimizer"] / n,
        family_tag("system", "data_wait_share"): merged["wait"] / step_total if step_total > 0 else 0.0,
        family_tag("system", "validation_s"): merged["validation"],
        family_tag("system", "checkpoint_s"): merged["checkpoint"],
        family_tag("system", "step_time_period"): float(period),
        family_tag("system", "host_rss_mib"): merged["rss"] / _MIB,
        **{family_tag("system", f"{k}_mib"): v / _MIB for k, v in cuda.items()},
        **reference_lines,
    }
    if step_total > 0:
        values[family_tag("system", "samples_per_s")] = merged["samples"] / step_total
        if merged["tokens"] > 0:
            values[family_tag("system", "tokens_per_s")] = merged["tokens"] / step_total
    for load in ("cpu_pressure", "cpu_others"):
        if merged[load] >= 0:
            values[family_tag("system", load)] = merged[load]
    if math.isfinite(fluctuation):
        values[family_tag("system", fluctuation_id)] = fluctuation
    if per_rank is not None:
        rank_totals, rank_waits = per_rank
        # The gradient all-reduce makes every rank's step as long as the slowest one's, so the step times
        # barely differ: the rank the others wait for is the one with the most data waiting when that is
        # material, else the one with the longest step.
        material = rank_waits.max() > 0.1 * max(float(np.median(rank_totals)), 1e-12)
        slowest = int(np.argmax(rank_waits if material else rank_totals))
        values[family_tag("system", "slowest_rank")] = float(slowest)
        values[family_tag("system", "straggler_ratio")] = float(rank_totals.max() / max(rank_totals.min(), 1e-12))
        for r, (total, wait) in enumerate(zip(rank_totals.tolist(), rank_waits.tolist(), strict=True)):
            values[family_tag("system", f"rank_{r}", "step_time_s")] = total / n
            values[family_tag("system", f"rank_{r}", "data_wait_s")] = wait / n
    return values
