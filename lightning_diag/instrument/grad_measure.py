"""What :class:`~lightning_diag.callbacks.gradient_flow.GradientFlowMonitor` measures and how: the parameter
index (which parameters are measured, the layer each belongs to, which layers are comparable weight matrices,
their blocks and roles), the device computation of a measured step that ends in its one host copy, and the
update-to-weight ratios after the optimizer step."""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Sequence

import torch

from lightning_diag.core.tags import update_ratio_tag, weight_norm_tag
from lightning_diag.rules.grad import role_of
from lightning_diag.stats.grad import grouped_norms, per_tensor_norms

__all__ = ["DEFAULT_LOGIT_PROJECTIONS", "ParamIndex", "StepMeasurement", "measure_step", "update_ratios"]

_COMPILED_PREFIX = re.compile(r"(?:^|(?<=\.))_orig_mod\.")

#: Attention query/key projections (last name component): their gradient flows only through the softmax, so it
#: is tiny whenever attention is near uniform (at initialisation, or for a head the task does not need).
DEFAULT_LOGIT_PROJECTIONS = ("q", "k", "query", "key", "q_proj", "k_proj", "q_lin", "k_lin", "wq", "wk", "to_q", "to_k")


#: Name components of embedding tables and learned position/class tokens, which are not weight matrices.
_EMBEDDING = re.compile(r".*embed.*|pos|pos_emb|wte|wpe|cls_token|mask_token|dist_token")


class ParamIndex:
    """Which parameters are measured, the layer each belongs to, and which layers are comparable weight
    matrices (built once per fit).

    Example:
        >>> net = torch.nn.Sequential(torch.nn.Embedding(5, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        >>> named = list(net.named_parameters())
        >>> index = ParamIndex([n for n, _ in named], [p for _, p in named], False, dict(net.named_modules()))
        >>> index.layers, index.is_matrix
        (['0', '1', '2'], [False, True, False, True, False])
    """

    def __init__(
        self,
        names: list[str],
        params: list[torch.nn.Parameter],
        per_parameter: bool,
        modules: dict[str, torch.nn.Module] | None = None,
        logit_projections: Sequence[str] = DEFAULT_LOGIT_PROJECTIONS,
    ) -> None:
        modules = modules or {}
        owners = [n.rsplit(".", 1)[0] if "." in n else "" for n in names]
        # A torch.compile'd submodule adds `_orig_mod` to its parameters' names: report the model's own names.
        names = [_COMPILED_PREFIX.sub("", n) for n in names]
        layers = [n if per_parameter else (n.rsplit(".", 1)[0] if "." in n else n) for n in names]
        self.layers = list(dict.fromkeys(layers))
        position = {layer: i for i, layer in enumerate(self.layers)}
        self.names = names
        self.params = params
        self.layer_of = [position[layer] for layer in layers]
        self.numel = [p.numel() for p in params]
        # A comparable weight matrix: a >= 2-D parameter of a module that is neither an embedding (sparse rows)
        # nor an attention query/key projection.
        skip = set(logit_projections)
        self.is_matrix = [
            p.ndim >= 2
            and not isinstance(modules.get(owner), torch.nn.Embedding)
            and not any(_EMBEDDING.fullmatch(part) for part in name.split("."))
            and owner.rsplit(".", 1)[-1] not in skip
            for p, owner, name in zip(params, owners, names, strict=True)
        ]
        matrix_layers = {self.layers[self.layer_of[i]] for i, m in enumerate(self.is_matrix) if m}
        in_blocks = {layer for layer in matrix_layers if role_of(layer) != layer}
        self.block_layers = in_blocks or matrix_layers  # no repeated blocks (an LSTM and its head): all matrices
        self.roles = {layer: role_of(layer) for layer in matrix_layers}
        self.in_block = [layer in self.block_layers for layer in self.layers]


@dataclasses.dataclass
class StepMeasurement:
    """The host values of one measured step.

    Attributes:
        total: L2 norm of all measured gradients.
        norms: ``{layer: L2 norm of its gradients}`` of the layers with a gradient.
        rms: ``{layer: RMS gradient per element}``.
        relative: ``{layer: ||g_W|| / ||W||}`` of the comparable weight matrices.
        blocks: L2 norm of the blocks' weight-matrix gradients (``total`` when there is no matrix).
        has_matrices: Whether any comparable weight matrix has a gradient.
        loss: The step's training loss, ``None`` when unknown or not finite.
    """

    total: float
    norms: dict[str, float]
    rms: dict[str, float]
    relative: dict[str, float]
    blocks: float
    has_matrices: bool
    loss: float | None


def measure_step(
    index: ParamIndex,
    chosen: list[int],
    loss: torch.Tensor | None,
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> StepMeasurement:
    """Per-layer norms, RMS and relative gradients of the ``chosen`` parameters (positions in ``index``, each
    with a gradient), computed on their device and copied to the host once.

    Args:
        index: The parameter index.
        chosen: Positions of the parameters measured this step (each has a ``.grad``).
        loss: The step's loss (a device scalar), or ``None``.
        reduce: Applied to the loss before the copy (the mean across ranks under DDP), or ``None``.
    """
    grads = [index.params[i].grad for i in chosen]
    device = grads[0].device  # type: ignore[union-attr]
    n_layers = len(index.layers)
    group_of = torch.tensor([index.layer_of[i] for i in chosen], device=device)
    tensor_norms = per_tensor_norms(grads)  # type: ignore[arg-type]
    layer_norms = grouped_norms(tensor_norms, group_of, n_layers)
    total = layer_norms.pow(2).sum().sqrt()
    numel = torch.zeros(n_layers, dtype=torch.float32, device=device)
    numel.index_add_(0, group_of, torch.tensor([float(index.numel[i]) for i in chosen], device=device))
    rms = layer_norms / numel.clamp_min(1.0).sqrt()
    # comparable weight matrices: ||g_W|| / ||W|| per layer, and the blocks' gradient norm
    matrix = [k for k, i in enumerate(chosen) if index.is_matrix[i]]
    matrix_layers = sorted({index.layer_of[chosen[k]] for k in matrix})
    extra: list[torch.Tensor] = []
    if matrix:
        m_groups = torch.tensor([index.layer_of[chosen[k]] for k in matrix], device=device)
        m_grad = grouped_norms(tensor_norms[torch.tensor(matrix, device=device)], m_groups, n_layers)
        m_weight = grouped_norms(
            per_tensor_norms([index.params[chosen[k]].detach() for k in matrix]), m_groups, n_layers
        )
        relative = m_grad / m_weight.clamp_min(1e-12)
        in_block = torch.tensor(index.in_block, device=device, dtype=torch.bool)
        extra = [
            relative[torch.tensor(matrix_layers, device=device)],
            m_grad[in_block].pow(2).sum().sqrt().reshape(1),
        ]
    loss_t = loss.reshape(1).to(device) if loss is not None else torch.full((1,), math.nan, device=device)
    if reduce is not None:
        loss_t = reduce(loss_t)
    present = sorted(set(group_of.tolist()))
    host = torch.cat([total.reshape(1), layer_norms, rms, *extra, loss_t]).tolist()  # the one copy of this step
    return StepMeasurement(
        total=host[0],
        norms={index.layers[g]: host[1 + g] for g in present},
        rms={index.layers[g]: host[1 + n_layers + g] for g in present},
        relative={index.layers[g]: host[1 + 2 * n_layers + j] for j, g in enumerate(matrix_layers)},
        blocks=host[1 + 2 * n_layers + len(matrix_layers)] if matrix else host[0],
        has_matrices=bool(matrix),
        loss=host[-1] if math.isfinite(host[-1]) else None,
    )


def update_ratios(index: ParamIndex, chosen: list[int], before: list[torch.Tensor]) -> dict[str, float]:
    """``diag/weight_norm/<layer>`` and ``diag/update_ratio/<layer>`` values: the layers' weight norms before the
    optimizer step, and ``||W_after - W_before|| / ||W_before||``, from the ``before`` copies of ``chosen``."""
    device = before[0].device
    group_of = torch.tensor([index.layer_of[i] for i in chosen], device=device)
    after = [index.params[i].detach() for i in chosen]
    deltas = torch._foreach_sub(after, before)
    n = len(index.layers)
    weight = grouped_norms(per_tensor_norms(before), group_of, n)
    update = grouped_norms(per_tensor_norms(deltas), group_of, n)
    ratio = update / weight.clamp_min(1e-12)
    w_host, r_host = torch.stack([weight, ratio]).tolist()
    values = {}
    for g in sorted(set(group_of.tolist())):
        values[weight_norm_tag(index.layers[g])] = w_host[g]
        values[update_ratio_tag(index.layers[g])] = r_host[g]
    return values
