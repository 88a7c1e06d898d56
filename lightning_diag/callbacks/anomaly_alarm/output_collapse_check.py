"""AnomalyAlarm's ``output_collapse`` check: predictions that no longer depend on the input.

A :class:`~lightning_diag.callbacks.anomaly_alarm.sampled_check.SampledCheck` (the sampling, the hooks' removal) over
:class:`~lightning_diag.instrument.output_watch.OutputSpreadWatch` (the measurement) and
:class:`~lightning_diag.rules.output_collapse.OutputCollapseRule` (the judgment, a detector of
:class:`~lightning_diag.AnomalyAlarm`'s preset).

Where the outputs come from: a Lightning step has no notion of "the model's output", so the check takes the
``LightningModule``'s own forward output (``self(x)`` in ``training_step``; a mapping's ``logits`` / ``preds``
entry, else its first tensor with a batch dimension), or, when the step does not call the ``LightningModule``
itself (``self.model(x)``), the output of the last of its direct children that ran (loss modules left out).

Cost: on a sampled training step (the first micro-batch of an optimizer step on the owner's logging cadence) a
forward hook on the ``LightningModule`` and its direct children (the driver's one hook per module, shared with
``zero_output``'s) keeps a reference to their outputs; at the batch's
end four numbers (the chosen output's spread and level, its module's floating-point input's spread and level) are
computed on the device and read in one transfer, with ``zero_output``'s. Other steps: nothing.
"""

from __future__ import annotations

import math
from typing import Any

import pytorch_lightning as pl
import torch

from lightning_diag.callbacks.anomaly_alarm.sampled_check import SampledCheck
from lightning_diag.instrument.output_watch import OutputSpreadWatch
from lightning_diag.rules.measures import Measures, OutputSpread
from lightning_diag.stats.spread import relative_spread

__all__ = ["OutputCollapseCheck"]


#: What a sampled step where no output was seen measured: no spread (the rule counts the step as not measured).
_NOTHING_SEEN = Measures(output_spread=OutputSpread(math.nan, math.nan, 0, ""))


class OutputCollapseCheck(SampledCheck[OutputSpreadWatch]):
    """Watches the model's output on sampled steps; feeds its spread (:class:`OutputSpread`) to the owner's preset."""

    def new_watch(self, pl_module: pl.LightningModule) -> OutputSpreadWatch:
        """The watch of the ``LightningModule``'s output and its direct children's."""
        return OutputSpreadWatch(pl_module)

    def gather(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, watch: OutputSpreadWatch
    ) -> tuple[list[torch.Tensor], Any] | None:
        """The spread and level of the output seen and of its input (:meth:`OutputSpreadWatch.take`), with its
        module and batch size; nothing to read where no output was seen."""
        seen = watch.take()
        return ([], None) if seen is None else (seen[2], seen[:2])

    def measure(
        self, trainer: pl.Trainer, watch: OutputSpreadWatch, seen: tuple[str, int] | None, values: list[float]
    ) -> Measures | None:
        """The spread of the output seen; none (a step not measured), with a notice, where no output was seen."""
        if seen is None:
            self.owner.notice(
                trainer,
                "output-collapse:none",
                f"`{self.rule_id}` is not measured: neither the LightningModule's forward nor one of its direct "
                "children returned a tensor with a batch dimension on a sampled step",
            )
            return _NOTHING_SEEN
        source, batch = seen
        spread, level = values[:2]
        input_spread, input_level = values[2:] if len(values) > 2 else (math.nan, math.nan)
        if batch < 2:
            self.owner.notice(
                trainer,
                "output-collapse:batch1",
                f"`{self.rule_id}` is not measured on batches of one sample: one output has no spread across "
                "the batch",
            )
        inputs = relative_spread(input_spread, input_level)
        return Measures(output_spread=OutputSpread(spread, level, batch, source, inputs))
