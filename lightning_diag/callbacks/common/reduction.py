"""The DDP adapter of :class:`~lightning_diag.stats.reduced.ReducedState`: values over all ranks, by declaration.

One collective per reduction kind (and one read back to the host), through ``trainer.strategy``, so it works
for every Lightning strategy; with one process nothing is communicated. :func:`reduce_states` merges the values of
several states in those same collectives (the driver's checkpoint, and each point of the fit where callbacks
reduce, ``Driver.reduce_at``: every callback's declared state together), and
:func:`reduce_saved` writes what all ranks know of the declared state into a checkpoint's callback entries.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import pytorch_lightning as pl
import torch

from lightning_diag.stats.reduced import ReducedState, Reduction

__all__ = ["FitReduction", "Reduced", "SavedPart", "reduce_saved", "reduce_state", "reduce_states"]

#: One declared object of a callback's checkpoint entry: ``(the callback's state_key, the object's key in its entry,
#: the object)``, the object a :class:`ReducedState` or one with an ``all_ranks_state_dict(trainer, device)``.
SavedPart = tuple[str, str, Any]

#: What a callback reduces at one point of the fit (``Driver.reduce_at``): a declared state and the names of the
#: values to reduce (each name's declared reduction).
FitReduction = tuple[ReducedState, tuple[str, ...]]

#: The values a point of the fit reduced (``Driver.reduce_at``): each request's merged values, by ``(id(state),
#: names)``.
Reduced = Mapping[tuple[int, tuple[str, ...]], dict[str, Any]]


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
    return reduce_states(trainer, [(state, names)], device)[0]


def reduce_states(
    trainer: pl.Trainer,
    states: Sequence[tuple[ReducedState, Sequence[str] | None]],
    device: torch.device | None = None,
) -> list[dict[str, Any]]:
    """:func:`reduce_state` of each ``(state, names)`` pair, with one collective per reduction kind for all of
    them together (``CAT``: one gather of the lengths and one of the values, for every ``CAT`` value at once).

    Every rank must call this with the same states and names, in the same order (it is a collective).

    Returns:
        The merged values of each pair, in the order of ``states``.
    """
    device = device if device is not None else trainer.strategy.root_device
    # float64 keeps integer steps exact; MPS has no float64 (and no multi-process training).
    dtype = torch.float32 if device.type == "mps" else torch.float64
    distributed = trainer.world_size > 1
    groups: dict[Reduction, list[tuple[int, str]]] = {}
    for index, (state, names) in enumerate(states):
        specs = state.specs
        for name in state if names is None else names:
            groups.setdefault(specs[name].reduction, []).append((index, name))
    out: list[dict[str, Any]] = [{} for _ in states]
    for reduction, group in groups.items():
        merged: list[Any]
        if reduction is Reduction.CAT:
            lists = [_host_list(states[index][0][name]) for index, name in group]
            merged = _gather_cat(trainer, lists, device, dtype) if distributed else lists
        else:
            local = torch.stack(
                [torch.as_tensor(states[i][0][n], dtype=dtype, device=device).reshape(()) for i, n in group]
            )
            merged = (trainer.strategy.reduce(local, reduce_op=reduction.value) if distributed else local).tolist()
        for (index, name), value in zip(group, merged, strict=True):
            out[index][name] = value
    return out


def reduce_saved(
    trainer: pl.Trainer, saved: Mapping[str, dict[str, Any]], parts: Iterable[SavedPart], device: torch.device
) -> None:
    """Write what all ranks know of ``parts`` into the checkpoint's callback entries ``saved`` (its
    ``"callbacks"``): a :class:`ReducedState`'s values merged by their declared reductions (every state of
    ``parts`` in the collectives of one :func:`reduce_states`), then, in order, the ``all_ranks_state_dict(trainer,
    device)`` of each object that has one. A part whose callback has no entry is skipped.

    Every rank must call this with the same parts, in the same order (it is a collective).
    """
    reduced: list[tuple[dict[str, Any], str, ReducedState]] = []
    gathered: list[tuple[dict[str, Any], str, Any]] = []
    for state_key, key, declared in parts:
        entry = saved.get(state_key)
        if entry is None:
            continue
        if isinstance(declared, ReducedState):
            reduced.append((entry, key, declared))
        elif hasattr(declared, "all_ranks_state_dict"):
            gathered.append((entry, key, declared))
    merged = reduce_states(trainer, [(declared, None) for _entry, _key, declared in reduced], device)
    for (entry, key, _declared), values in zip(reduced, merged, strict=True):
        entry[key] = {**entry[key], **values}
    for entry, key, declared in gathered:
        entry[key] = declared.all_ranks_state_dict(trainer, device)


def _host_list(value: Any) -> list[float]:
    if isinstance(value, torch.Tensor):
        return [float(v) for v in value.detach().reshape(-1).tolist()]
    return [float(v) for v in value]


def _gather_cat(
    trainer: pl.Trainer, lists: Sequence[list[float]], device: torch.device, dtype: torch.dtype
) -> list[list[float]]:
    """Each of ``lists`` concatenated over the ranks, in rank order: ``all_gather`` needs one shape on every rank,
    so the lengths are gathered first, then every list of a rank in one padded row (none when all are empty)."""
    counts = torch.tensor([len(values) for values in lists], device=device)
    lengths = trainer.strategy.all_gather(counts).reshape(-1, len(lists)).tolist()
    longest = max(sum(row) for row in lengths)
    if longest == 0:
        return [[] for _ in lists]
    padded = torch.zeros(longest, dtype=dtype, device=device)
    local = [value for values in lists for value in values]
    padded[: len(local)] = torch.tensor(local, dtype=dtype, device=device)
    rows = trainer.strategy.all_gather(padded).reshape(len(lengths), -1).tolist()
    out: list[list[float]] = [[] for _ in lists]
    for row, counts_of_rank in zip(rows, lengths, strict=True):
        start = 0
        for index, count in enumerate(counts_of_rank):
            out[index] += row[start : start + int(count)]
            start += int(count)
    return out
