"""What a ``training_step`` returned, as the callbacks read it: the loss tensor, or why there is none; and the
scale a mixed-precision gradient scaler put on the loss that ``on_before_backward`` receives."""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl
import torch

__all__ = ["extract_loss", "loss_scale"]


def extract_loss(outputs: Any) -> tuple[torch.Tensor | None, str | None]:
    """The loss tensor in what ``training_step`` returned, or ``(None, reason)``.

    Accepts a tensor or a mapping with a ``"loss"`` tensor (Lightning's two forms). A non-scalar loss is
    reduced with its mean and reported.
    """
    # Lightning hands callbacks `{}` for a `training_step` that returned None under automatic optimization.
    if outputs is None or (isinstance(outputs, dict) and not outputs):
        return (
            None,
            "`training_step` returned None (a skipped batch): the batch is not counted in the loss trend",
        )
    loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
    if not isinstance(loss, torch.Tensor):
        kind = "a dict without a 'loss' tensor" if isinstance(outputs, dict) else type(outputs).__name__
        return None, f"`training_step` returned {kind}: the loss trend needs a tensor or a dict with 'loss'"
    if loss.numel() != 1:
        return loss.detach().float().mean(), (
            f"`training_step` returned a loss of shape {tuple(loss.shape)}: its mean is used for the loss trend"
        )
    loss = loss.detach().float()
    return (loss if loss.dim() == 0 else loss.reshape(())), None


def loss_scale(trainer: pl.Trainer) -> float | None:
    """The factor a gradient scaler multiplied the current optimizer step's losses by, or ``None`` without one.

    Lightning's ``MixedPrecision`` plugin (``precision="16-mixed"``) scales the loss before it calls
    ``on_before_backward``: a callback that keeps that loss divides it by this factor (a power of two: the division
    gives the loss back bit for bit). The scaler changes its scale only in its ``update()`` after the optimizer
    step, so the factor read before the step (``on_before_optimizer_step``) is the one its backwards used. Reading
    it is one host read (``GradScaler.get_scale``): call it only on a step that measures.
    """
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    if scaler is None or not scaler.is_enabled():
        return None
    return float(scaler.get_scale())
