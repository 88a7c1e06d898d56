"""The SAM sharpness gap L(w + ε) − L(w), ε = ρ·∇L/‖∇L‖ (Foret et al. 2021), measured without a SAM optimizer.

Pure torch: the caller hands in the parameters and a closure computing the loss on fixed batches. The parameters
are perturbed in place and restored bit for bit from saved copies (``finally``), and gradients are taken with
:func:`torch.autograd.grad`, so ``.grad`` fields are never touched.

Sharded parameters (DTensors: FSDP2, tensor parallelism) work as they are: the caller hands in ``gradients`` (a
sharded model's gradients come from its own backward, which reduce-scatters them; ``autograd.grad`` with respect
to FSDP2's sharded parameters finds them unused) and ``to_float`` (the loss averaged over the ranks); each
squared norm is that of the full tensor (a DTensor reduction, then its value), so ε is the full gradient's.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import torch

__all__ = ["SharpnessResult", "layer_of", "relative_gap", "sam_epsilon", "sam_gap"]

#: Below this, a loss is treated as this small when the gap is expressed relative to it.
RELATIVE_LOSS_FLOOR = 1e-8


@dataclasses.dataclass(frozen=True)
class SharpnessResult:
    """One sharpness measurement.

    Attributes:
        loss: L(w), the mean loss over the batches.
        perturbed_loss: L(w + ε).
        gap: ``perturbed_loss - loss`` (the SAM gap).
        relative_gap: ``gap / max(|loss|, 1e-8)``.
        grad_norm: ‖∇L‖ over the perturbed parameters.
        layers: Per-layer gap: L(w + ε restricted to that layer's parameters) − L(w), by layer name (empty when
            not asked for).
    """

    loss: float
    perturbed_loss: float
    gap: float
    relative_gap: float
    grad_norm: float
    layers: dict[str, float] = dataclasses.field(default_factory=dict)


def _value(t: torch.Tensor) -> float:
    """A 0-d tensor's value; a DTensor's is that of the full tensor (its pending reduction resolved)."""
    full = getattr(t, "full_tensor", None)
    return float(full() if full is not None else t)


def _squared_norm(g: torch.Tensor) -> float:
    return _value(torch.linalg.vector_norm(g.float())) ** 2


def sam_epsilon(
    grads: Sequence[torch.Tensor],
    rho: float,
    reduce_squares: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[list[torch.Tensor], float]:
    """SAM's ascent step ε = ρ·g/‖g‖ (global L2 norm over every tensor) and ‖g‖.

    A zero gradient gives ε = 0.

    Example:
        >>> eps, norm = sam_epsilon([torch.tensor([3.0]), torch.tensor([4.0])], rho=0.5)
        >>> [round(e.item(), 3) for e in eps], norm
        ([0.3, 0.4], 5.0)
    """
    if not grads:
        return [], 0.0
    if reduce_squares is not None:  # plain local shards, disjoint over the ranks (FSDP1's flat parameters)
        local = torch.stack([torch.linalg.vector_norm(g.float()) ** 2 for g in grads]).sum()
        norm_value = math.sqrt(float(reduce_squares(local)))
    elif any(hasattr(g, "full_tensor") for g in grads):
        norm_value = math.sqrt(sum(_squared_norm(g) for g in grads))
    else:
        norm_value = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])))
    scale = rho / norm_value if norm_value > 0 and math.isfinite(norm_value) else 0.0
    return [g * scale for g in grads], norm_value


def relative_gap(gap: float, loss: float) -> float:
    """The gap relative to the loss: ``gap / max(|loss|, 1e-8)``.

    Example:
        >>> relative_gap(0.5, 2.0)
        0.25
    """
    return gap / max(abs(loss), RELATIVE_LOSS_FLOOR)


def layer_of(parameter_name: str) -> str:
    """The layer a parameter belongs to: its qualified name without the last component.

    Example:
        >>> layer_of("encoder.0.weight"), layer_of("bias")
        ('encoder.0', 'bias')
    """
    return parameter_name.rsplit(".", 1)[0] if "." in parameter_name else parameter_name


def sam_gap(
    params: Sequence[tuple[str, torch.nn.Parameter]],
    loss_closure: Callable[[], torch.Tensor],
    rho: float,
    per_layer: bool = False,
    max_layers: int = 32,
    gradients: Callable[[torch.Tensor, list[torch.Tensor]], Sequence[torch.Tensor | None]] | None = None,
    to_float: Callable[[torch.Tensor], float] = _value,
    reduce_squares: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> SharpnessResult:
    """Measure the SAM gap of ``loss_closure`` at the current parameters.

    Args:
        params: ``(name, parameter)`` pairs to perturb (the trainable ones).
        loss_closure: Computes the scalar loss on fixed batches, deterministically (the model in eval mode).
        rho: The radius of the perturbation.
        per_layer: Also measure each layer's own contribution (one more loss evaluation per layer).
        max_layers: At most this many layers (the ones with the largest ‖ε‖) are measured per layer.
        gradients: ``gradients(loss, tensors)``: the gradient of ``loss`` for each tensor (``None`` if unused);
            default :func:`torch.autograd.grad`.
        to_float: A loss tensor's value (e.g. averaged over the ranks); default ``float``.
        reduce_squares: Sums this rank's squared gradient norm over the ranks, for plain tensors that are
            disjoint local shards (FSDP1); ``None`` for whole tensors and DTensors.

    Returns:
        The measurement. The parameters hold exactly their old values afterwards, even when the closure raises.
    """
    tensors: list[torch.Tensor] = [p for _, p in params]
    with torch.enable_grad():
        loss = loss_closure()
        if gradients is None:
            grads: Sequence[torch.Tensor | None] = torch.autograd.grad(loss, tensors, allow_unused=True)
        else:
            grads = gradients(loss, tensors)
    loss_value = to_float(loss.detach())
    present = [(n, p, g) for (n, p), g in zip(params, grads, strict=True) if g is not None]
    eps, grad_norm = sam_epsilon([g for _, _, g in present], rho, reduce_squares)
    saved = [p.detach().clone() for _, p, _ in present]

    def perturbed(selected: Sequence[int]) -> float:
        try:
            with torch.no_grad():
                for i in selected:
                    present[i][1].add_(eps[i].to(present[i][1].dtype))
                return to_float(loss_closure().detach())
        finally:
            with torch.no_grad():
                for i in selected:
                    present[i][1].copy_(saved[i])

    perturbed_loss = perturbed(range(len(present)))
    layers: dict[str, float] = {}
    if per_layer and present:
        by_layer: dict[str, list[int]] = {}
        for i, (name, _, _) in enumerate(present):
            by_layer.setdefault(layer_of(name), []).append(i)
        size = {k: sum(_squared_norm(eps[i]) for i in idx) for k, idx in by_layer.items()}
        for name in sorted(by_layer, key=lambda k: -size[k])[:max_layers]:
            layers[name] = perturbed(by_layer[name]) - loss_value
    gap = perturbed_loss - loss_value
    return SharpnessResult(
        loss=loss_value,
        perturbed_loss=perturbed_loss,
        gap=gap,
        relative_gap=relative_gap(gap, loss_value),
        grad_norm=grad_norm,
        layers=layers,
    )
