"""SharpnessProbe: the SAM gap L(w + ε) − L(w) on a few validation batches at validation end."""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl
import torch

from lightning_diag.callbacks.common.base import AlertHandler, RuleChoices
from lightning_diag.callbacks.common.preset import Detector, Preset
from lightning_diag.callbacks.probes.probe import LossFn, ProbeError, ValidationProbe, uses_deepspeed
from lightning_diag.core.alerts import Alert
from lightning_diag.core.tags import sharpness_layer_tag, sharpness_tag
from lightning_diag.core.validation import check_bool, check_int
from lightning_diag.instrument.sharding import reshard_fsdp, uses_fsdp1
from lightning_diag.rules.measures import Measures, SharpnessReading
from lightning_diag.rules.sharp_minimum import (
    SHARP_MINIMUM,
    SHARP_MINIMUM_PATIENCE_KEY,
    SHARP_MINIMUM_RHO_KEY,
    SHARP_MINIMUM_SPEC,
    SharpMinimumRule,
)
from lightning_diag.stats.sharpness import SharpnessResult, sam_gap

__all__ = ["SharpnessProbe"]


def _backward_gradients(loss: torch.Tensor, tensors: list[torch.Tensor]) -> list[torch.Tensor | None]:
    """A sharded model's gradients through its own backward (FSDP2 reduce-scatters them, averaged over the
    data-parallel ranks); the parameters' ``.grad`` are put back as they were."""
    saved = [p.grad for p in tensors]
    for p in tensors:
        p.grad = None
    try:
        loss.backward()
        return [p.grad for p in tensors]
    finally:
        for p, g in zip(tensors, saved, strict=True):
            p.grad = g


class SharpnessProbe(ValidationProbe):
    """Measures how sharp the minimum is: the SAM gap L(w + ε) − L(w), ε = ρ·∇L/‖∇L‖ (Foret et al. 2021).

    At the end of validation, every ``every_n_epochs`` epochs, global rank zero takes the first ``num_batches``
    validation batches, computes the loss L(w) with the module's own loss (``training_step``, or ``loss_fn``) in
    eval mode, its gradient (with :func:`torch.autograd.grad`: ``.grad`` is untouched), then the loss with every
    trainable parameter moved by ε, and puts the parameters back bit for bit. A sharded model (FSDP2, tensor
    parallelism) is measured by every rank at once on its own batches: the gradient comes from the model's own
    backward (``.grad`` is saved and put back), ‖∇L‖ is the full gradient's (squared norms of the shards reduced
    over the mesh), each rank moves its own shards by ε, and the losses are averaged over the ranks.
    Parameters, gradients, optimizer state, RNG states and BatchNorm statistics are exactly as before. Cost per
    probe: 1 forward + backward and 1 forward (plus 1 forward per layer with ``per_layer=True``) on
    ``num_batches`` batches, and one copy of the trainable parameters.

    Args:
        every_n_epochs: Probe every this many epochs.
        num_batches: Validation batches per probe.
        loss_fn: ``loss_fn(pl_module, batch)`` returning the loss; default ``training_step(batch, batch_idx)``
            with ``self.log`` silenced (required under manual optimization).
        per_layer: Also measure each layer's contribution (the gap with only that layer perturbed).
        max_layers: With ``per_layer``, at most this many layers (those with the largest share of ε).
        rules: ``{"sharp_minimum": {"threshold": ...}}``: the rule's threshold and settings
            (docs/thresholds.md), or ``False`` to switch it off.
        on_alert: A callable receiving each :class:`~lightning_diag.core.alerts.Alert` as it is recorded (global
            rank zero, after it is written to ``alerts.jsonl``): send it to Slack, e-mail or a pager. A handler
            that raises is reported once per fit through the ``lightning_diag`` logger and never stops training.

    Logged (TensorBoard, step = global step): ``diag/sharpness/gap``, ``diag/sharpness/relative_gap`` (gap /
    loss), ``diag/sharpness/loss``, ``diag/sharpness/perturbed_loss``, ``diag/sharpness/grad_norm``,
    ``diag/sharpness/layer/<layer>`` (``per_layer``), ``diag/threshold/sharp_minimum``.

    Raises:
        TypeError: If an argument has the wrong type.
        ValueError: If an argument is out of range.

    Example:
        >>> SharpnessProbe().thresholds()["sharp_minimum"]
        0.3
    """

    #: Unique per configuration, so several probes can sit on one trainer and be checkpointed.
    state_key_arguments = ("rho", "threshold", "patience", "every_n_epochs", "num_batches")
    preset = Preset(
        "SharpnessProbe",
        (
            Detector(SharpMinimumRule, "rule", "rules"),
        ),
    )

    def __init__(
        self,
        *,
        every_n_epochs: int = 1,
        num_batches: int = 2,
        loss_fn: LossFn | None = None,
        per_layer: bool = False,
        max_layers: int = 16,
        rules: RuleChoices | None = None,
        on_alert: AlertHandler | None = None,
    ) -> None:
        super().__init__(
            every_n_epochs=every_n_epochs, num_batches=num_batches, loss_fn=loss_fn, rules=rules, on_alert=on_alert
        )
        # the rule's values in effect (``rules=``); ``rho`` is also the radius the probe measures with
        self.threshold = self.setting(SHARP_MINIMUM_SPEC.key("threshold"))
        self.patience = int(self.setting(SHARP_MINIMUM_PATIENCE_KEY))
        self.rho = self.setting(SHARP_MINIMUM_RHO_KEY)
        self.per_layer = check_bool("per_layer", per_layer)
        self.max_layers = check_int("max_layers", max_layers, low=1)
        # the probe's one rule, checkpointed under "rules"
        self.add_preset()
        self.last_result: SharpnessResult | None = None

    def measure(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batches: list[tuple[int, Any]]
    ) -> SharpnessResult:
        """The SAM gap on the captured batches."""
        if uses_deepspeed(trainer):
            raise ProbeError("the SAM gap is not measured under DeepSpeed: its engine owns the backward and ZeRO "
                             "partitions the parameters, so they cannot be moved by ε and put back here")
        if self.all_ranks:
            reshard_fsdp(pl_module)  # the sharded parameters, not the root's gathered copies of the last forward
        params = [(n, p) for n, p in pl_module.named_parameters() if p.requires_grad]
        if not params:
            raise ProbeError("the module has no trainable parameter")
        owned = [(i, self.own_batch(b)) for i, b in batches]
        loss = self.mean_loss(trainer, pl_module, owned)
        if not loss.requires_grad:
            raise ProbeError("the loss does not depend on the trainable parameters (computed under no_grad?)")
        first = [True]

        def closure() -> Any:
            if first[0]:  # the loss just computed, with its graph: one forward saved
                first[0] = False
                return loss
            if self.all_ranks:  # the forward gathers the shards just moved by ε (or put back)
                reshard_fsdp(pl_module)
            return self.mean_loss(trainer, pl_module, owned)

        if not self.all_ranks:
            return sam_gap(params, closure, self.rho, per_layer=self.per_layer, max_layers=self.max_layers)
        # FSDP1's flat parameters are plain local shards, disjoint over the ranks: their squares are summed there.
        reduce_squares = (lambda t: trainer.strategy.reduce(t, reduce_op="sum")) if uses_fsdp1(pl_module) else None
        return sam_gap(params, closure, self.rho, per_layer=self.per_layer, max_layers=self.max_layers,
                       gradients=_backward_gradients, to_float=lambda t: self.mean_over_ranks(trainer, t),
                       reduce_squares=reduce_squares)

    def decide(self, trainer: pl.Trainer, result: SharpnessResult) -> list[Alert]:
        """Log the measurement and feed ``sharp_minimum``."""
        self.last_result = result
        step = trainer.global_step
        values = {
            sharpness_tag("gap"): result.gap,
            sharpness_tag("relative_gap"): result.relative_gap,
            sharpness_tag("loss"): result.loss,
            sharpness_tag("perturbed_loss"): result.perturbed_loss,
            sharpness_tag("grad_norm"): result.grad_norm,
            **{sharpness_layer_tag(name): gap for name, gap in result.layers.items()},
            **self.threshold_lines(SHARP_MINIMUM),
        }
        self.writer.scalars(values, step)
        worst = sorted(result.layers.items(), key=lambda kv: -kv[1])
        reading = SharpnessReading(result.gap, result.relative_gap, self.rho, worst)
        return self.feed(self.context(trainer), Measures(sharpness=reading))

