"""INT8 fake quantization of a sharded weight (a DTensor: FSDP2 shards, tensor-parallel shards, both), measured
on the full weight from its shards without gathering it.

Symmetric INT8 needs one number from the full weight: its absolute maximum (per tensor), or each output channel's
(per channel, channel = dimension 0). Each rank takes the absolute maximum of its local shard (0 for an empty
shard) and one all-reduce MAX over the mesh dimensions that shard the tensor gives the full weight's; per channel,
each rank writes its rows' maxima at their global row offsets in a vector of the full channel count (zeros
elsewhere) before the same all-reduce, so a tensor sharded along its input dimension (row-wise tensor parallelism)
also gets every channel's true maximum. Quantizing is elementwise: each rank rounds its own shard with the global
scale, and the quantized weight is a DTensor with the original placements. The largest error is a local maximum
and one more all-reduce MAX.

The weight outlier ratio's 99th percentile needs values, not a maximum: each rank that holds a distinct shard
sends an evenly spaced sample of its ``|w|`` (its share of the 2^20 values the single-process measure samples:
every value of a weight under 2^20 elements), the samples are gathered and the percentile is taken over them.
That gathers at most 2^20 numbers of one weight at a time, and only when the weight is sharded.

Activations (W8A8) are quantized per tensor with the absolute maximum over every rank's batch
(:func:`global_batch_fake_quantize`, one all-reduce MAX of a scalar per layer call), so the dynamic activation
scale is the one a single process running the whole global batch would take.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from lightning_diag.instrument.sharding import all_reduce_over_shards, is_replica, local_offset
from lightning_diag.stats.grad import is_dtensor, local_tensor
from lightning_diag.stats.quantization import INT8_MAX, OUTLIER_QUANTILE, QUANTILE_SAMPLE, Granularity

__all__ = [
    "global_batch_fake_quantize",
    "sharded_fake_quantize",
    "sharded_max_error_pct",
    "sharded_outlier_ratio",
    "sharded_scale",
]


def sharded_scale(w: Any, granularity: Granularity) -> torch.Tensor:
    """The INT8 scale of the full weight behind DTensor ``w``, for its local shard: a 0-d tensor (per tensor) or
    ``[local rows, 1, ...]`` (per channel). One all-reduce MAX per sharding mesh dimension."""
    local = local_tensor(w).detach().float()
    if granularity == "per_channel" and w.dim() > 1:
        rows = local.abs().reshape(local.shape[0], -1)
        row_max = rows.amax(dim=1) if rows.shape[1] else torch.zeros(rows.shape[0], device=local.device)
        start = local_offset(w, 0)
        full = torch.zeros(w.shape[0], dtype=torch.float32, device=local.device)
        full[start : start + local.shape[0]] = row_max
        amax = all_reduce_over_shards(full, w, "max")[start : start + local.shape[0]]
        amax = amax.reshape(-1, *([1] * (w.dim() - 1)))
    else:
        amax = local.abs().amax() if local.numel() else torch.zeros((), device=local.device)
        amax = all_reduce_over_shards(amax.reshape(()).clone(), w, "max")
    scale = amax / INT8_MAX
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def _rounded(local: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return torch.clamp(torch.round(local.float() / scale), -INT8_MAX, INT8_MAX) * scale


def sharded_fake_quantize(w: Any, granularity: Granularity = "per_tensor") -> Any:
    """``w`` quantized to INT8 and back with the full weight's scale; a DTensor with ``w``'s placements."""
    from torch.distributed.tensor import DTensor

    local = local_tensor(w).detach()
    quantized = _rounded(local, sharded_scale(w, granularity)).to(local.dtype)
    return DTensor.from_local(quantized, w.device_mesh, w.placements, shape=w.shape, stride=w.stride())


def global_batch_fake_quantize(x: Any) -> Any:
    """An activation quantized per tensor with the absolute maximum over **every rank's** batch (one all-reduce
    MAX over the world): what one process running the global batch would use. A DTensor keeps its placements."""
    local = local_tensor(x).detach()
    amax = local.float().abs().amax() if local.numel() else torch.zeros((), device=local.device)
    amax = amax.reshape(()).clone()
    if dist.is_initialized():
        dist.all_reduce(amax, op=dist.ReduceOp.MAX)
    scale = amax / INT8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    quantized = _rounded(local, scale).to(local.dtype)
    if not is_dtensor(x):
        return quantized
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(quantized, x.device_mesh, x.placements, shape=x.shape, stride=x.stride())


def sharded_max_error_pct(w: Any, granularity: Granularity = "per_tensor") -> float:
    """:func:`~lightning_diag.stats.quantization.max_error_pct_of_scale` of the full weight, from its shards."""
    local = local_tensor(w).detach().float()
    scale = sharded_scale(w, granularity)
    err = (local - _rounded(local, scale)).abs() / scale
    top = err.max() if err.numel() else torch.zeros((), device=local.device)
    return float(all_reduce_over_shards(top.reshape(()).clone(), w, "max")) * 100.0


def sharded_outlier_ratio(w: Any, quantile: float = OUTLIER_QUANTILE) -> float:
    """:func:`~lightning_diag.stats.quantization.outlier_ratio` of the full weight: the maximum from the shards,
    the percentile over the gathered samples of ``|w|`` (see the module docstring)."""
    local = local_tensor(w).detach().float().abs().flatten()
    top = local.max() if local.numel() else torch.zeros((), device=local.device)
    top_value = float(all_reduce_over_shards(top.reshape(()).clone(), w, "max"))
    share = max(1, int(QUANTILE_SAMPLE * local.numel() / max(w.numel(), 1)))
    if is_replica(w) or local.numel() == 0:
        sample = local[:0]
    elif local.numel() > share:
        sample = local[torch.linspace(0, local.numel() - 1, share, device=local.device).long()]
    else:
        sample = local
    if is_dtensor(w) and dist.is_initialized():
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, sample.cpu())
        sample = torch.cat([s for s in everyone if s is not None and s.numel()]) if any(
            s is not None and s.numel() for s in everyone) else sample.cpu()
    if sample.numel() == 0:
        return 0.0
    bulk = float(torch.quantile(sample, quantile))
    if bulk <= 0:
        return 0.0 if top_value <= 0 else float("inf")
    return top_value / bulk
