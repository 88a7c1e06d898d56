"""What a callback needs to know about a sharded model (FSDP2, tensor parallelism, FSDP1), Lightning-free.

* :func:`is_sharded`: whether a forward of the model is a collective (a DTensor parameter: FSDP2 ``fully_shard``
  or ``parallelize_module``; or an FSDP1 ``FullyShardedDataParallel`` inside it). Such a model must run its
  forward on every rank at once: a rank-zero-only forward waits forever for the others.
* :func:`local_tensor`: a DTensor's local shard (any other tensor unchanged).
* :func:`head_shard`: how the attention heads a module computes are split over the tensor-parallel ranks.
* :func:`all_reduce_over_shards`, :func:`local_offset`, :func:`is_replica`: reductions of a quantity computed on
  a DTensor's local shard over exactly the mesh dimensions that shard it (the quantization probe's scales).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightning_diag.stats.grad import local_tensor as _local_tensor

__all__ = [
    "TP_DIM_NAME",
    "all_reduce_over_shards",
    "head_shard",
    "is_dtensor",
    "is_replica",
    "is_sharded",
    "local_offset",
    "local_tensor",
    "reshard_fsdp",
    "uses_fsdp1",
]

#: The mesh dimension name Lightning's ``ModelParallelStrategy`` gives the tensor-parallel ranks.
TP_DIM_NAME = "tensor_parallel"


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor`` (without importing it when distributed is off)."""
    return hasattr(t, "to_local") and hasattr(t, "placements") and isinstance(t, torch.Tensor)


# One definition of "this rank's part of a tensor", shared with the gradient measurement.
local_tensor = _local_tensor


def uses_fsdp1(module: nn.Module) -> bool:
    """Whether ``module`` is or holds an FSDP1 ``FullyShardedDataParallel`` wrapper."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.fsdp import FullyShardedDataParallel

    return any(isinstance(m, FullyShardedDataParallel) for m in module.modules())


def is_sharded(module: nn.Module) -> bool:
    """Whether ``module``'s forward is a collective: a DTensor parameter (FSDP2, TP) or an FSDP1 wrapper.

    Example:
        >>> is_sharded(nn.Linear(2, 2))
        False
    """
    return any(is_dtensor(p) for p in module.parameters()) or uses_fsdp1(module)


def reshard_fsdp(module: nn.Module) -> None:
    """Put every FSDP2 module of ``module`` back in its sharded state (``FSDPModule.reshard()``, no collective).

    After a forward without backward (a validation step, a replay, a probe), FSDP2's root keeps its gathered
    parameters registered: ``named_parameters()`` then yields plain full tensors, not the sharded DTensors the
    optimizer steps, and an in-place change to the sharded ones would not reach the next forward.
    """
    if not torch.distributed.is_available():
        return
    from torch.distributed.fsdp import FSDPModule

    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def head_shard(module: nn.Module | None, query: Any, tp_mesh: Any) -> tuple[int, int] | None:
    """``(tp_rank, tp_size)`` when the heads an attention call of ``module`` sees are this rank's share only.

    Two cases: the call's ``query`` is itself a DTensor sharded on its head dimension (dim ``-3`` of
    ``[..., H, L, E]``), or it is a plain tensor while a parameter of the calling module is a DTensor sharded over
    the tensor-parallel mesh dimension (``ColwiseParallel`` projections followed by a reshape to local heads, the
    usual recipe). The heads are then taken to be split evenly and in order: rank ``r`` holds heads
    ``r * H_local ... (r + 1) * H_local - 1``.

    Args:
        module: The module that made the call (``None``: unknown).
        query: The call's ``query`` argument.
        tp_mesh: The tensor-parallel ``DeviceMesh`` (1-D), or ``None`` when there is no tensor parallelism.

    Returns:
        ``None`` when the heads are not split (no tensor parallelism, or the call sees every head).
    """
    if tp_mesh is None or tp_mesh.size() <= 1:
        return None
    rank, size = int(tp_mesh.get_local_rank()), int(tp_mesh.size())
    if is_dtensor(query):
        names = query.device_mesh.mesh_dim_names or ()
        for i, placement in enumerate(query.placements):
            if placement.is_shard() and placement.dim % query.dim() == query.dim() - 3:
                if TP_DIM_NAME in names and names[i] != TP_DIM_NAME:
                    continue
                return int(query.device_mesh.get_local_rank(i)), int(query.device_mesh.size(i))
        return None
    if module is None:
        return None
    for p in module.parameters():
        if not is_dtensor(p):
            continue
        dt: Any = p
        names = dt.device_mesh.mesh_dim_names or ()
        for i, placement in enumerate(dt.placements):
            if placement.is_shard() and i < len(names) and names[i] == TP_DIM_NAME:
                return rank, size
    return None


# -- reductions over the shards of one DTensor (no full tensor is gathered) --------------------------------
def _shard_dims(t: Any) -> list[int]:
    """The mesh dimensions over which ``t``'s local tensors differ (its ``Shard`` placements)."""
    return [i for i, p in enumerate(t.placements) if p.is_shard()]


def all_reduce_over_shards(value: torch.Tensor, t: Any, op: str = "max") -> torch.Tensor:
    """``value`` (computed from ``t``'s local shard) reduced with ``op`` (``"max"`` or ``"sum"``) over the mesh
    dimensions that shard ``t``: a replicated dimension is not counted twice. Returns ``value`` unchanged when ``t``
    is not a DTensor."""
    if not is_dtensor(t):
        return value
    import torch.distributed as dist

    reduce_op = dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM
    for i in _shard_dims(t):
        dist.all_reduce(value, op=reduce_op, group=t.device_mesh.get_group(i))
    return value


def local_offset(t: Any, dim: int) -> int:
    """Where ``t``'s local shard starts along ``dim`` of the global tensor (0 for a plain tensor)."""
    if not is_dtensor(t):
        return 0
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return int(offset[dim])


def is_replica(t: Any) -> bool:
    """Whether this rank's shard of ``t`` is a copy of a lower rank's (a non-zero coordinate on a mesh dimension
    that replicates ``t``): such a rank must not contribute to a sum or a sample over the shards."""
    if not is_dtensor(t):
        return False
    coordinate = t.device_mesh.get_coordinate() or []
    return any(not p.is_shard() and coordinate[i] != 0 for i, p in enumerate(t.placements))
