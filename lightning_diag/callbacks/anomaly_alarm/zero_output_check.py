"""AnomalyAlarm's ``zero_output`` check: modules whose output turned all-zero on a sampled training step.

A :class:`~lightning_diag.callbacks.anomaly_alarm.sampled_check.SampledCheck` (the sampling, the hooks' removal) over
:class:`~lightning_diag.instrument.output_watch.ZeroOutputWatch` (the measurement) and
:class:`~lightning_diag.rules.zero_output.ZeroOutputRule` (the judgment, a detector of
:class:`~lightning_diag.AnomalyAlarm`'s preset).

Cost: on a sampled step (the first micro-batch of an optimizer step on the owner's logging cadence, the steps
``GradientFlowMonitor``'s activation watch reads) a forward hook on every module (the driver's one hook per module,
shared with the other watches of the step, for that batch) computes ``output.any()`` and ``(output < 0).any()`` per
call on the device (from the output's minimum and maximum, NaN read as 1), and the calls' extremes are read at the
batch's end in one transfer with ``output_collapse``'s numbers (per module counts, after one all-reduce of
``3 x modules`` numbers, under data parallelism). Other steps: nothing (the owner calls
:meth:`ZeroOutputCheck.on_batch_start` on its cadence batches only).
"""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl
import torch

from lightning_diag.callbacks.anomaly_alarm.sampled_check import SampledCheck
from lightning_diag.instrument.output_watch import ZeroOutputWatch
from lightning_diag.rules.measures import Measures, ZeroOutputs

__all__ = ["ZeroOutputCheck"]


class ZeroOutputCheck(SampledCheck[ZeroOutputWatch]):
    """Installs the watch on sampled steps and feeds what it saw (:class:`ZeroOutputs`) to the owner's preset."""

    def new_watch(self, pl_module: pl.LightningModule) -> ZeroOutputWatch:
        """The watch of every module's output."""
        return ZeroOutputWatch(pl_module)

    def gather(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, watch: ZeroOutputWatch
    ) -> tuple[list[torch.Tensor], Any] | None:
        """The calls' extremes (:meth:`ZeroOutputWatch.extremes`: no operator); under data parallelism the counts
        per module summed over ranks instead (one all-reduce: every rank judges on how many ranks each module was
        zero); ``None`` where none ran (one process; with several ranks the counts are summed even where none ran
        here, so that every rank joins the reduction)."""
        if trainer.world_size > 1:
            counts = watch.counts(signs=True)
            if counts is None:
                counts = torch.zeros(3, len(watch.order), device=pl_module.device)
            return [trainer.strategy.reduce(counts, reduce_op="sum").flatten()], None
        seen = watch.extremes()
        return None if seen is None else (seen[1], seen[0])

    def measure(
        self, trainer: pl.Trainer, watch: ZeroOutputWatch, seen: tuple[str, ...] | None, values: list[float]
    ) -> Measures | None:
        """Which modules ran, returned all zeros or a signed output: from the calls' extremes (``seen``: their
        modules) or from the counts summed over ranks (``seen`` ``None``)."""
        if seen is None:
            n = len(watch.order)
            ran_n, zero_n, signed_n = values[:n], values[n : 2 * n], values[2 * n :]
        else:
            ran_n, zero_n, signed_n = watch.counts_of(seen, values)
        ran = [name for name, r in zip(watch.order, ran_n, strict=True) if r > 0]
        zeros = [name for name, z in zip(watch.order, zero_n, strict=True) if z > 0]
        signed = [name for name, g in zip(watch.order, signed_n, strict=True) if g > 0]
        return Measures(zero_outputs=ZeroOutputs(ran, zeros, signed))
