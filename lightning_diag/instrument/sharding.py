"""What a callback needs to know about a sharded model (FSDP2, tensor parallelism, FSDP1), Lightning-free.

* :func:`is_sharded_module`: whether a forward of the model is a collective (a DTensor parameter: FSDP2
  ``fully_shard`` or ``parallelize_module``; or an FSDP1 ``FullyShardedDataParallel`` inside it). Such a model must
  run its forward on every rank at once: a rank-zero-only forward waits forever for the others. (The tensor-level
  test is :func:`lightning_diag.stats.grad.is_dtensor`, and a DTensor's local shard is
  :func:`lightning_diag.stats.grad.local_tensor`: one home each, in ``stats``.)
* :func:`head_shard`: how the attention heads a module computes are split over the tensor-parallel ranks.
* :func:`all_reduce_over_shards`, :func:`local_offset`, :func:`is_replica`: reductions of a quantity computed on
  a DTensor's local shard over exactly the mesh dimensions that shard it (the quantization probe's scales).
* :func:`replica_dims`, :func:`mesh_dim_ranks`: the mesh dimensions along which a DTensor's local tensors are
  copies of each other (its ``Replicate`` placements), and the global ranks of such a replica group
  (``ddp_desync``'s comparisons).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightning_diag.stats.grad import is_dtensor

__all__ = [
    "TP_DIM_NAME",
    "all_reduce_over_shards",
    "head_shard",
    "is_replica",
    "is_sharded_module",
    "local_offset",
    "mesh_dim_ranks",
    "replica_dims",
    "reshard_fsdp",
    "uses_fsdp1",
]

#: The mesh dimension name Lightning's ``ModelParallelStrategy`` gives the tensor-parallel ranks.
TP_DIM_NAME = "tensor_parallel"


def uses_fsdp1(module: nn.Module) -> bool:
    """Whether ``module`` is or holds an FSDP1 ``FullyShardedDataParallel`` wrapper."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.fsdp import FullyShardedDataParallel

    return any(isinstance(m, FullyShardedDataParallel) for m in module.modules())


def is_sharded_module(module: nn.Module) -> bool:
    """Whether ``module``'s forward is a collective: a DTensor parameter (FSDP2, TP) or an FSDP1 wrapper.

    Example:
        >>> is_sharded_module(nn.Linear(2, 2))
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


# -- replica groups of one DTensor (ddp_desync) -------------------------------------------------------------
def replica_dims(t: Any) -> list[int]:
    """The mesh dimensions along which ``t``'s local tensors are identical copies: its ``Replicate`` placements
    (HSDP's replicate dimension, a ``RowwiseParallel`` bias or a ``SequenceParallel`` norm on the tensor-parallel
    dimension). ``Shard`` (FSDP2's strided shards included) and ``Partial`` dimensions are not replicas. Empty for
    a plain tensor.
    """
    if not is_dtensor(t):
        return []
    return [i for i, p in enumerate(t.placements) if p.is_replicate()]


def mesh_dim_ranks(mesh: Any, dim: int) -> tuple[int, ...]:
    """The global ranks of this rank's group along mesh dimension ``dim`` (the ranks with the same coordinates on
    every other dimension), in the order of their coordinate on ``dim``. Read from the mesh, no collective.

    Example:
        >>> class Mesh:  # a 2 x 2 mesh seen from global rank 3 (coordinate (1, 1))
        ...     mesh = torch.arange(4).reshape(2, 2)
        ...     def get_coordinate(self): return [1, 1]
        >>> mesh_dim_ranks(Mesh(), 0), mesh_dim_ranks(Mesh(), 1)
        ((1, 3), (2, 3))
    """
    coordinate = list(mesh.get_coordinate() or [])
    index: list[Any] = list(coordinate)
    index[dim] = slice(None)
    return tuple(int(r) for r in mesh.mesh[tuple(index)].reshape(-1).tolist())
