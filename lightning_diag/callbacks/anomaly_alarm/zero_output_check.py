"""AnomalyAlarm's ``zero_output`` check: modules whose output turned all-zero on a sampled training step.

A thin adapter over :class:`~lightning_diag.instrument.output_watch.ZeroOutputWatch` (the measurement) and
:class:`~lightning_diag.rules.zero_output.ZeroOutputRule` (the judgment, declared on the owner by
:class:`~lightning_diag.callbacks.anomaly_alarm.runtime_checks.RuntimeChecks`).

Cost: on a sampled step (the owner's logging interval, the first micro-batch of the optimizer step) a forward hook on
every module (installed for that batch) computes ``output.any()`` and ``(output < 0).any()`` per call on the device,
and the flags are read in one transfer at the batch's end (after one all-reduce of ``3 x modules`` numbers under data
parallelism). Other steps:
nothing (the owner calls :meth:`ZeroOutputCheck.on_batch_start` from :attr:`ZeroOutputCheck.next_step` on).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import pytorch_lightning as pl
import torch

from lightning_diag.instrument.output_watch import ZeroOutputWatch
from lightning_diag.rules.base import StepContext
from lightning_diag.rules.measures import Measures, ZeroOutputs
from lightning_diag.rules.zero_output import ZERO_OUTPUT, ZeroOutputRule

if TYPE_CHECKING:  # pragma: no cover
    from lightning_diag.callbacks.common.base import DiagCallback

__all__ = ["RULE_ATTRIBUTE", "ZeroOutputCheck"]

#: The owner's attribute holding ``zero_output``'s rule (declared with ``add_rule`` by ``RuntimeChecks``).
RULE_ATTRIBUTE = "zero_rule"


class ZeroOutputCheck:
    """Installs the watch on sampled steps and feeds the owner's ``zero_rule``."""

    def __init__(self, owner: DiagCallback) -> None:
        self.owner = owner
        self.reset()

    def reset(self) -> None:
        """The start of a fit: nothing watched yet."""
        self.stop()
        self._watch: ZeroOutputWatch | None = None
        self._step = -1
        #: The global step from which :meth:`on_batch_start` may have something to do (the next sampled one).
        self.next_step: float = 0

    def on_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """On the first batch of a sampled optimizer step: install the watch."""
        step = trainer.global_step
        if step < self.next_step:
            return
        every = self.owner.every_n_steps(trainer)
        if ZERO_OUTPUT in self.owner.rule_choices.off:
            self.next_step = math.inf
            return
        if step == self._step or step % every:
            self.next_step = step - step % every + every
            return
        self._step = step
        self.next_step = step + every
        if self._watch is None:
            self._watch = ZeroOutputWatch(pl_module)
        self._watch.start()

    def on_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Remove the watch and judge what it saw (one host read)."""
        watch = self._watch
        if watch is None or not watch.active:
            return
        watch.stop()
        counts = watch.counts(signs=True)
        if trainer.world_size > 1:  # every rank judges the same numbers: on how many ranks each module was zero
            if counts is None:
                counts = torch.zeros(3, len(watch.order), device=pl_module.device)
            counts = trainer.strategy.reduce(counts, reduce_op="sum")
        if counts is None:
            return
        ran_n, zero_n, signed_n = counts.tolist()
        ran = [name for name, r in zip(watch.order, ran_n, strict=True) if r > 0]
        zeros = [name for name, z in zip(watch.order, zero_n, strict=True) if z > 0]
        signed = [name for name, g in zip(watch.order, signed_n, strict=True) if g > 0]
        ctx = StepContext(trainer.current_epoch, self._step)  # the measured step (global_step has moved on)
        rule: ZeroOutputRule = getattr(self.owner, RULE_ATTRIBUTE)  # rebuilt by the owner at each fit
        self.owner.record(rule.judge(ctx, Measures(zero_outputs=ZeroOutputs(ran, zeros, signed))))

    def stop(self) -> None:
        """Remove the hook if installed (the end of a fit, or an exception in the middle of a batch)."""
        watch = getattr(self, "_watch", None)
        if watch is not None:
            watch.stop()
