"""The DDP adapter of :class:`~lightning_diag.stats.reduced.ReducedState`: values over all ranks, by declaration.

One collective per reduction kind (and one read back to the host), through ``trainer.strategy``, so it works
for every Lightning strategy; with one process nothing is communicated.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytorch_lightning as pl
import torch

from lightning_diag.stats.reduced import ReducedState, Reduction

__all__ = ["reduce_state"]


def reduce_state(
    trainer: pl.Trainer, state: ReducedState, names: Sequence[str] | None = None, device: torch.device | None = None
) -> dict[str, Any]:
    """The named values of ``state`` (all by default) merged over every process by their declared reductions.

    Every rank must call this with the same ``names`` (it is a collective). Scalars come back as ``float``,
    ``CAT`` values as ``list[float]`` in rank order.

    Args:
        trainer: Its strategy communicates.
        state: The local state.
        names: Which values to reduce.
        device: Where the collective runs (the module's device); defaults to the strategy's root device.
    """
    names = list(state) if names is None else list(names)
    device = device if device is not None else trainer.strategy.root_device
    # float64 keeps integer steps exact; MPS has no float64 (and no multi-process training).
    dtype = torch.float32 if device.type == "mps" else torch.float64
    distributed = trainer.world_size > 1
    groups: dict[Reduction, list[str]] = {}
    for name in names:
        groups.setdefault(state.specs[name].reduction, []).append(name)
    out: dict[str, Any] = {}
    for reduction, group in groups.items():
        if reduction is Reduction.CAT:
            for name in group:
                out[name] = _gather_cat(trainer, state[name], device, dtype) if distributed else _host_list(state[name])
            continue
        local = torch.stack([torch.as_tensor(state[n], dtype=dtype, device=device).reshape(()) for n in group])
        total = trainer.strategy.reduce(local, reduce_op=reduction.value) if distributed else local
        out.update(zip(group, total.tolist(), strict=True))
    return out


def _host_list(value: Any) -> list[float]:
    if isinstance(value, torch.Tensor):
        return [float(v) for v in value.detach().reshape(-1).tolist()]
    return [float(v) for v in value]


def _gather_cat(trainer: pl.Trainer, value: Any, device: torch.device, dtype: torch.dtype) -> list[float]:
    # all_gather needs one shape on every rank: gather the lengths, pad to the longest, strip the padding.
    local = torch.as_tensor(_host_list(value), dtype=dtype, device=device)
    lengths = trainer.strategy.all_gather(torch.tensor([local.numel()], device=device)).reshape(-1).tolist()
    padded = torch.zeros(max(lengths), dtype=dtype, device=device)
    padded[: local.numel()] = local
    gathered = trainer.strategy.all_gather(padded).reshape(len(lengths), -1)
    return [float(v) for rank, n in enumerate(lengths) for v in gathered[rank, : int(n)].tolist()]
