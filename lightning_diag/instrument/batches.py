"""Finding things in a batch without knowing its type: token ids, the batch size, the tokens it holds.

Batches come as tensors, tuples/lists, or mappings (Hugging Face style, ``input_ids``/``attention_mask``).
Nothing here synchronises with the device: sizes are read from shapes, token counts stay device tensors.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, TypeGuard

import torch

__all__ = [
    "INT_DTYPES",
    "NON_BATCH_KEYS",
    "batch_size_and_tokens",
    "first_tensor",
    "is_int_tensor",
    "leading_sizes",
    "size_mismatch",
    "tensor_leaves",
    "token_ids",
]

#: Containers nested deeper than this are not entered by :func:`tensor_leaves`.
_MAX_DEPTH = 6

#: Batch keys whose first dimension is not the batch by design, left out by :func:`leading_sizes`: Qwen2-VL-style
#: flattened vision patches (rows are the patches of every image, with each image's grid), packed sequences
#: (flash-attention's cumulative lengths), graph batches (edges, the node-to-graph pointer), per-batch values.
NON_BATCH_KEYS = frozenset(
    {
        "image_grid_thw",
        "video_grid_thw",
        "pixel_values_videos",
        "second_per_grid_ts",
        "cu_seqlens",
        "cu_seq_lens_q",
        "cu_seq_lens_k",
        "max_length_q",
        "max_length_k",
        "edge_index",
        "edge_attr",
        "edge_weight",
        "edge_type",
        "ptr",
        "num_items_in_batch",
    }
)
#: ``pixel_values`` holds flattened patches (not one row per sample) when the batch has an image grid.
_FLATTENED_BESIDE = {"pixel_values": "image_grid_thw"}

#: Integer dtypes token ids and class labels come in.
INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def is_int_tensor(value: Any) -> TypeGuard[torch.Tensor]:
    """Whether ``value`` is a tensor of an integer dtype (:data:`INT_DTYPES`)."""
    return isinstance(value, torch.Tensor) and value.dtype in INT_DTYPES


def token_ids(batch: Any) -> torch.Tensor | None:
    """The batch's token ids: ``batch["input_ids"]`` (2-D integer), or the first 2-D integer tensor of a tuple or
    list batch, or a 2-D integer tensor batch itself; ``None`` when there is none.

    Example:
        >>> ids = torch.zeros(2, 5, dtype=torch.long)
        >>> token_ids({"input_ids": ids}) is ids, token_ids((torch.randn(2, 3), ids)) is ids
        (True, True)
        >>> token_ids({"pixel_values": torch.randn(2, 3)}) is None
        True
    """
    if isinstance(batch, dict):
        value = batch.get("input_ids")
        return value if is_int_tensor(value) and value.dim() == 2 else None
    if isinstance(batch, (tuple, list)):
        for item in batch:
            if is_int_tensor(item) and item.dim() == 2:
                return item
        return None
    return batch if is_int_tensor(batch) and batch.dim() == 2 else None


def batch_size_and_tokens(batch: Any) -> tuple[int, int | torch.Tensor | None]:
    """Samples in a batch and its tokens, without a host synchronisation.

    The batch size is the first dimension of the first tensor found (a tensor, a mapping's values, a sequence).
    Tokens: an ``attention_mask`` entry's sum (a device tensor, read later), else an ``input_ids`` entry's
    number of elements, else the first tensor's when it is a 2-D integer tensor (token ids); ``None`` otherwise.
    """
    first = first_tensor(batch)
    size = int(first.shape[0]) if first is not None and first.dim() > 0 else 0
    tokens: int | torch.Tensor | None = None
    if isinstance(batch, dict):
        mask, ids = batch.get("attention_mask"), batch.get("input_ids")
        if isinstance(mask, torch.Tensor):
            tokens = mask.detach().sum()
        elif isinstance(ids, torch.Tensor):
            tokens = ids.numel()
    elif first is not None and is_int_tensor(first) and first.dim() == 2:
        tokens = first.numel()
    return size, tokens


def first_tensor(batch: Any) -> torch.Tensor | None:
    """The first tensor in a batch (depth first through mappings, tuples and lists), or ``None``."""
    if isinstance(batch, torch.Tensor):
        return batch
    if isinstance(batch, dict):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        for item in batch:
            found = first_tensor(item)
            if found is not None:
                return found
    return None


def tensor_leaves(batch: Any, key: str = "", depth: int = 0) -> list[tuple[str, torch.Tensor]]:
    """Every tensor of a batch with its key, depth first: mappings (``dict``, Hugging Face ``BatchEncoding``)
    by key (``"input_ids"``, ``"inputs.pixel_values"``), tuples and lists by position (``"[0]"``), dataclass
    instances by field; a plain tensor batch is ``"batch"``. Other objects are not entered.

    Example:
        >>> [k for k, _ in tensor_leaves({"x": torch.zeros(2), "pair": (torch.ones(2), 3)})]
        ['x', 'pair[0]']
    """
    if isinstance(batch, torch.Tensor):
        return [(key or "batch", batch)]
    if depth > _MAX_DEPTH:
        return []
    out: list[tuple[str, torch.Tensor]] = []
    if isinstance(batch, Mapping):
        for k, v in batch.items():
            out += tensor_leaves(v, f"{key}.{k}" if key else str(k), depth + 1)
    elif isinstance(batch, (tuple, list)):
        for i, v in enumerate(batch):
            out += tensor_leaves(v, f"{key}[{i}]", depth + 1)
    elif dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        for field in dataclasses.fields(batch):
            value = getattr(batch, field.name, None)
            out += tensor_leaves(value, f"{key}.{field.name}" if key else field.name, depth + 1)
    return out


def _name(key: str) -> str:
    """The last component of a :func:`tensor_leaves` key (``"inputs.pixel_values"`` -> ``"pixel_values"``)."""
    return key.rsplit(".", 1)[-1]


def leading_sizes(batch: Any) -> dict[str, tuple[int, ...]]:
    """The shapes of a batch's tensors that should have one row per sample, by key: scalars and the keys of
    :data:`NON_BATCH_KEYS` (and ``pixel_values`` beside an ``image_grid_thw``) are left out.

    Example:
        >>> leading_sizes({"input_ids": torch.zeros(2, 5), "num_items_in_batch": torch.tensor(7)})
        {'input_ids': (2, 5)}
    """
    leaves = tensor_leaves(batch)
    names = {_name(k) for k, _ in leaves}
    out = {}
    for key, t in leaves:
        name = _name(key)
        if t.dim() == 0 or name in NON_BATCH_KEYS or _FLATTENED_BESIDE.get(name, "") in names:
            continue
        out[key] = tuple(t.shape)
    return out


def size_mismatch(batch: Any) -> dict[str, int] | None:
    """``{key: first dimension}`` of a batch's tensors when they disagree on the batch size, else ``None``.

    The batch size is a number ``B`` such that every tensor of :func:`leading_sizes` has ``B`` rows, or (with
    two dimensions or more and more than one row) ``B`` columns: time-major sequences (``[T, B]``,
    ``pad_sequence``'s default) agree with ``[B]`` labels. Reads shapes only: no host synchronisation.

    Example:
        >>> ids, pixels, labels = torch.zeros(1, 8, dtype=torch.long), torch.zeros(16, 3, 4, 4), torch.zeros(16)
        >>> size_mismatch({"input_ids": ids, "pixel_values": pixels, "labels": labels})
        {'input_ids': 1, 'pixel_values': 16, 'labels': 16}
        >>> size_mismatch((torch.zeros(20, 16), torch.zeros(16))) is None  # time-major tokens, labels
        True
    """
    shapes = leading_sizes(batch)
    if len(shapes) < 2:
        return None
    for size in {shape[0] for shape in shapes.values()}:
        if all(shape[0] == size or (len(shape) > 1 and shape[0] > 1 and shape[1] == size) for shape in shapes.values()):
            return None
    return {key: shape[0] for key, shape in shapes.items()}
