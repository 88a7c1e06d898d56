"""Grouped gradient norms: one fused norm pass per device/dtype group, reduced into per-group norms.

These are the measures behind ``GradientFlowMonitor``. Nothing here copies to the host.

Sharded tensors (``DTensor``: FSDP2's ``fully_shard``, tensor parallelism, both, HSDP) are measured from their
local shards: :func:`per_tensor_norms` takes the norm of each rank's own shard, and :func:`copy_weights` says how
much each rank's sum of squares counts in a SUM over all ranks, so that one all-reduce gives the sum of squares of
the full tensor. A shard held by ``k`` ranks (replicated along a ``Replicate`` mesh dimension, or along the mesh
dimensions a sub-mesh leaves out) counts ``1/k`` on each of them: replicated copies add up to one, and the
all-reduce sums exactly over the dimensions that shard the tensor. Nothing is gathered (no ``full_tensor()``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["copy_weights", "grouped_norms", "grouped_squares", "is_dtensor", "local_tensor", "per_tensor_norms"]

_DTensor: Any
try:  # torch >= 2.4 (public path since 2.5)
    from torch.distributed.tensor import DTensor as _DTensor
except ImportError:  # pragma: no cover - torch without distributed tensors
    _DTensor = None


def is_dtensor(tensor: Any) -> bool:
    """Whether ``tensor`` is a distributed tensor (``DTensor``: FSDP2, tensor parallelism, HSDP), whose
    ``.numel()`` and ``.shape`` are global and whose ``placements`` say how its local tensors relate.

    The one tensor-level test; :func:`lightning_diag.instrument.sharding.is_sharded_module` is the module-level
    one (a collective forward).

    Example:
        >>> is_dtensor(torch.ones(2))
        False
    """
    return _DTensor is not None and isinstance(tensor, _DTensor)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's own part of ``tensor``: the local shard of a ``DTensor`` (possibly empty), else ``tensor``.

    Taken outside autograd (``DTensor.to_local`` under grad mode costs ~80 us a call on CPU, ~0.2 us without).

    Example:
        >>> local_tensor(torch.ones(2)).tolist()
        [1.0, 1.0]
    """
    if not is_dtensor(tensor):
        return tensor
    with torch.no_grad():
        return tensor.to_local()  # type: ignore[attr-defined]


def copy_weights(tensors: Sequence[torch.Tensor], world_size: int) -> list[float]:
    """How much each rank's sum of squares of each tensor counts in a SUM over ``world_size`` ranks.

    A ``DTensor`` sharded (``Shard``, FSDP2's strided shards included) along mesh dimensions of sizes
    ``s1, s2, ...`` has ``s1 * s2 * ...`` distinct shards, each held by ``world_size / (s1 * s2 * ...)`` ranks;
    each copy weighs the inverse of that count. A plain tensor (identical on every rank) weighs
    ``1 / world_size``. Summed over the ranks, weighted sums of squares give the full tensor's.

    Raises:
        ValueError: If a tensor has a ``Partial`` placement (pending reduction: its local values are not a
            shard of the gradient).

    Example:
        >>> copy_weights([torch.ones(2)], 4)
        [0.25]
    """
    weights = []
    for t in tensors:
        if not is_dtensor(t):
            weights.append(1.0 / world_size)
            continue
        shards = 1
        for dim, placement in enumerate(t.placements):  # type: ignore[attr-defined]
            if placement.is_partial():
                raise ValueError(f"a tensor with a Partial placement cannot be measured from its shard: {t.placements}")  # type: ignore[attr-defined]
            # Shard, and FSDP2's _StridedShard over a TP-sharded parameter (not a Shard subclass in every torch)
            if not placement.is_replicate():
                shards *= t.device_mesh.size(dim)  # type: ignore[attr-defined]
        weights.append(shards / world_size)
    return weights


@torch.no_grad()
def per_tensor_norms(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of each tensor (of this rank's local shard for a ``DTensor``), as one float32 vector on the
    first tensor's device.

    Tensors are bucketed by (device, dtype) and each bucket takes one multi-tensor norm kernel
    (``torch._foreach_norm``, the kernel ``clip_grad_norm_`` uses), so the cost does not grow with a Python
    loop over tensors on the device side. An empty local shard has norm 0.

    Example:
        >>> per_tensor_norms([torch.tensor([3.0, 4.0]), torch.tensor([1.0])]).tolist()
        [5.0, 1.0]
    """
    if len(tensors) == 0:
        return torch.zeros(0)
    local = [local_tensor(t) for t in tensors]
    device = local[0].device
    buckets: dict[tuple[torch.device, torch.dtype], list[int]] = defaultdict(list)
    for i, t in enumerate(local):
        buckets[(t.device, t.dtype)].append(i)
    stacks = [
        (indices, _stacked_norms([local[i] for i in indices], dtype, device)) for (_, dtype), indices in buckets.items()
    ]
    if len(stacks) == 1:  # one (device, dtype), the usual case: the norms are in order already, no scatter
        return stacks[0][1]
    out = torch.empty(len(local), dtype=torch.float32, device=device)
    for indices, stacked in stacks:
        out[torch.tensor(indices, device=device)] = stacked
    return out


def _stacked_norms(tensors: list[torch.Tensor], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The L2 norms of ``tensors`` (one device and dtype) by one multi-tensor kernel, as a float32 vector on
    ``device``."""
    # 16-bit tensors accumulate in float32: a float16 norm overflows past 65504.
    accumulate = torch.float32 if dtype in (torch.float16, torch.bfloat16) else None
    norms = torch._foreach_norm(tensors, 2, dtype=accumulate)
    if norms and norms[0].dtype is torch.float32 and norms[0].device == device:  # one bucket: on the device already
        return torch.stack(norms)
    return torch.stack([n.to(device=device, dtype=torch.float32) for n in norms])


def grouped_norms(norms: torch.Tensor, group_of: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Combine per-tensor L2 norms into per-group L2 norms: ``sqrt(sum of squares)`` within each group.

    Args:
        norms: Per-tensor norms, shape ``[n]``.
        group_of: Group index of each tensor, shape ``[n]``, values in ``[0, num_groups)``.
        num_groups: Number of groups.

    Example:
        >>> grouped_norms(torch.tensor([3.0, 4.0, 1.0]), torch.tensor([0, 0, 1]), 2).tolist()
        [5.0, 1.0]
    """
    return grouped_squares(norms.float() ** 2, group_of, num_groups).sqrt()


def grouped_squares(squares: torch.Tensor, group_of: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Sum per-tensor sums of squares within each group (the step before a cross-rank SUM and the square root).

    Example:
        >>> grouped_squares(torch.tensor([9.0, 16.0, 1.0]), torch.tensor([0, 0, 1]), 2).tolist()
        [25.0, 1.0]
    """
    out = torch.zeros(num_groups, dtype=torch.float32, device=squares.device)
    out.index_add_(0, group_of.to(squares.device), squares.float())
    return out
