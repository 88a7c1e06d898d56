"""AnomalyAlarm's ``output_collapse`` check: predictions that no longer depend on the input.

A thin adapter over :class:`~lightning_diag.instrument.output_watch.OutputSpreadWatch` (the measurement) and
:class:`~lightning_diag.rules.output_collapse.OutputCollapseRule` (the judgment, declared on the owner by
:class:`~lightning_diag.callbacks.anomaly_alarm.runtime_checks.RuntimeChecks`).

Where the outputs come from: a Lightning step has no notion of "the model's output", so the check takes the
``LightningModule``'s own forward output (``self(x)`` in ``training_step``; a mapping's ``logits`` / ``preds``
entry, else its first tensor with a batch dimension), or, when the step does not call the ``LightningModule``
itself (``self.model(x)``), the output of the last of its direct children that ran (loss modules left out).

Cost: on a sampled training step (the owner's logging interval, the first micro-batch of the optimizer step) a
forward hook on the ``LightningModule`` and its direct children keeps a reference to their outputs; at the batch's
end five numbers (the chosen output's spread, level and batch size, its module's floating-point input's spread and
level) are computed on the device and read in one transfer. Other steps: nothing.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import pytorch_lightning as pl

from lightning_diag.instrument.output_watch import OutputSpreadWatch
from lightning_diag.rules.base import StepContext
from lightning_diag.rules.measures import Measures, OutputSpread
from lightning_diag.rules.output_collapse import OUTPUT_COLLAPSE, OutputCollapseRule, relative_spread

if TYPE_CHECKING:  # pragma: no cover
    from lightning_diag.callbacks.common.base import DiagCallback

__all__ = ["RULE_ATTRIBUTE", "OutputCollapseCheck"]

#: The owner's attribute holding ``output_collapse``'s rule (declared with ``add_rule`` by ``RuntimeChecks``).
RULE_ATTRIBUTE = "collapse_rule"


class OutputCollapseCheck:
    """Watches the model's output on sampled steps; feeds the owner's rule."""

    def __init__(self, owner: DiagCallback) -> None:
        self.owner = owner
        self.reset()

    def reset(self) -> None:
        """The start of a fit: nothing watched yet."""
        self.stop()
        self._watch: OutputSpreadWatch | None = None
        self._step = -1
        #: The global step from which :meth:`on_batch_start` may have something to do (the next sampled one).
        self.next_step: float = 0

    @property
    def _off(self) -> bool:
        return OUTPUT_COLLAPSE in self.owner.rule_choices.off

    def _rule(self) -> OutputCollapseRule:
        rule: OutputCollapseRule = getattr(self.owner, RULE_ATTRIBUTE)  # rebuilt by the owner at each fit
        return rule

    def on_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """On the first batch of a sampled optimizer step: hook the model's output."""
        step = trainer.global_step
        if step < self.next_step:
            return
        if self._off:
            self.next_step = math.inf
            return
        every = self.owner.every_n_steps(trainer)
        if step == self._step or step % every:
            self.next_step = step - step % every + every
            return
        self._step = step
        self.next_step = step + every
        if self._watch is None:
            self._watch = OutputSpreadWatch(pl_module)
        self._watch.start()

    def on_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Remove the hooks and judge the output seen (one host read)."""
        watch = self._watch
        if watch is None or not watch.active:
            return
        watch.stop()
        seen = watch.take()
        rule = self._rule()
        ctx = StepContext(trainer.current_epoch, self._step)  # the measured step (global_step has moved on)
        if seen is None:
            rule.unmeasured += 1
            self.owner.notice(
                trainer,
                "output-collapse:none",
                f"`{OUTPUT_COLLAPSE}` is not measured: neither the LightningModule's forward nor one of its direct "
                "children returned a tensor with a batch dimension on a sampled step",
            )
            return
        source, stats = seen
        spread, level, batch, input_spread, input_level = stats.tolist()
        if batch < 2:
            self.owner.notice(
                trainer,
                "output-collapse:batch1",
                f"`{OUTPUT_COLLAPSE}` is not measured on batches of one sample: one output has no spread across "
                "the batch",
            )
        inputs = relative_spread(input_spread, input_level)
        measured = OutputSpread(spread, level, int(batch), source, inputs)
        self.owner.record(rule.judge(ctx, Measures(output_spread=measured)))

    def stop(self) -> None:
        """Remove any hook (the end of a fit, or an exception in the middle of a batch)."""
        watch = getattr(self, "_watch", None)
        if watch is not None:
            watch.stop()
