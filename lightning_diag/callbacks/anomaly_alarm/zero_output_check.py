"""AnomalyAlarm's ``zero_output`` check: modules whose output turned all-zero on a sampled training step.

A :class:`~lightning_diag.callbacks.anomaly_alarm.sampled_check.SampledCheck` (the sampling, the hooks' removal) over
:class:`~lightning_diag.instrument.output_watch.ZeroOutputWatch` (the measurement) and
:class:`~lightning_diag.rules.zero_output.ZeroOutputRule` (the judgment, a detector of
:class:`~lightning_diag.AnomalyAlarm`'s preset).

Cost: on a sampled step (the owner's logging interval, the first micro-batch of the optimizer step) a forward hook on
every module (installed for that batch) computes ``output.any()`` and ``(output < 0).any()`` per call on the device
(from the output's minimum and maximum, NaN read as 1),
and the flags are read in one transfer at the batch's end (after one all-reduce of ``3 x modules`` numbers under data
parallelism). Other steps:
nothing (the owner calls :meth:`ZeroOutputCheck.on_batch_start` from :attr:`ZeroOutputCheck.next_step` on).
"""

from __future__ import annotations

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

    def measure(self, trainer: pl.Trainer, pl_module: pl.LightningModule, watch: ZeroOutputWatch) -> Measures | None:
        """Which modules ran, returned all zeros or a signed output (one host read, after one all-reduce under data
        parallelism: every rank judges on how many ranks each module was zero); ``None`` where none ran."""
        counts = watch.counts(signs=True)
        if trainer.world_size > 1:
            if counts is None:
                counts = torch.zeros(3, len(watch.order), device=pl_module.device)
            counts = trainer.strategy.reduce(counts, reduce_op="sum")
        if counts is None:
            return None
        ran_n, zero_n, signed_n = counts.tolist()
        ran = [name for name, r in zip(watch.order, ran_n, strict=True) if r > 0]
        zeros = [name for name, z in zip(watch.order, zero_n, strict=True) if z > 0]
        signed = [name for name, g in zip(watch.order, signed_n, strict=True) if g > 0]
        return Measures(zero_outputs=ZeroOutputs(ran, zeros, signed))
