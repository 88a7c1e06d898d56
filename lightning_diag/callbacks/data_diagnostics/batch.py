"""Reading a loader's data for :class:`~lightning_diag.DataDiagnostics` without touching the training run.

Two jobs: find token ids, padding mask, labels and floating tensors in a batch of any usual shape
(:func:`interpret`), and draw a bounded sample of a loader's dataset (:func:`read_sample`) through the loader's own
``collate_fn`` with a private random generator: the training iterator, the sampler and its generator, worker
processes, the global random number generators (torch's CPU and device generators, numpy, ``random``:
:func:`~lightning_diag.instrument.rng.preserved_rng`) and the generators the dataset holds itself are left exactly
as they were.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Generator, Iterator, Mapping
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset

from lightning_diag.instrument.batches import is_int_tensor, tensor_leaves
from lightning_diag.instrument.rng import HeldGenerators, is_global_generator, preserved_rng

__all__ = [
    "BatchView",
    "UninterpretableBatch",
    "describe",
    "interpret",
    "read_sample",
    "sample_indices",
    "shape_signature",
]

_LABEL_KEYS = ("labels", "label", "targets", "target", "y")


_SIGNATURE_DEPTH = 4


def shape_signature(batch: Any, depth: int = 0) -> Any:
    """The structure and tensor shapes of a batch, cheap to compare with the previous batch's: nested tuples of
    keys, tensor shapes and the types of other values. ``None`` when the batch holds something it does not
    descend into (a dataclass, an object with tensor attributes, nesting deeper than 4): then compare nothing.

    Two batches with equal signatures have the same tensors with the same shapes at the same places, so a batch
    whose signature equals one already checked needs no new shape check. Reads shapes only (no host
    synchronisation), a few microseconds less than walking the batch with names as :func:`size_mismatch
    <lightning_diag.instrument.batches.size_mismatch>` does.

    Example:
        >>> shape_signature((torch.zeros(4, 2), torch.zeros(4)))
        (torch.Size([4, 2]), torch.Size([4]))
        >>> shape_signature({"x": torch.zeros(3), "note": "text"})
        (('x', 'note'), (torch.Size([3]), <class 'str'>))
    """
    cls = type(batch)
    if cls is _Tensor or isinstance(batch, _Tensor):
        return batch.shape
    if depth > _SIGNATURE_DEPTH:
        return None
    if cls is tuple or cls is list:
        values = batch
    elif cls is dict or isinstance(batch, Mapping):
        values = batch.values()
    elif cls in _SCALARS:
        return cls
    else:
        return None
    # tensor leaves inline (no call per leaf): this runs on every training batch
    parts = tuple([v.shape if type(v) is _Tensor else shape_signature(v, depth + 1) for v in values])
    if None in parts:
        return None
    return parts if values is batch else (tuple(batch), parts)


_Tensor = torch.Tensor
_SCALARS = frozenset({str, bytes, int, float, bool, type(None)})


class UninterpretableBatch(ValueError):
    """A batch in which nothing could be found; the message says what it holds and how to pass ``extract=``."""


@dataclasses.dataclass
class BatchView:
    """What a batch holds, as the data diagnostics see it.

    Attributes:
        size: Samples in the batch.
        tokens: ``[B, L]`` integer token ids, or ``None``.
        mask: ``[B, L]`` bool, ``True`` for real (non-padding) tokens, or ``None`` (every position counts, less
            ``pad_token_id`` if one is given).
        labels: ``[B]`` integer class labels, or ``None`` (no labels, token-level labels, or regression targets).
        floats: Every floating tensor of the batch by its key (``"pixel_values"``, ``"[0]"``...).
        inputs: The key of the floating tensor that is the model's input (for exact-copy search without tokens).
        token_labels: ``[B, L]`` integer token-level labels aligned with ``tokens`` (language modelling, token
            classification; -100 is ignored), or ``None``.
        context: With ``tokens``: the sample's other per-sample inputs (images, audio features: every tensor with
            ``size`` rows and at least two dimensions that is not the token ids, a mask, a label, or an integer
            tensor of the token ids' shape such as ``token_type_ids``), by key. ``data_leakage`` judges the
            sample as a whole: two samples are the same only when these are equal too.
    """

    size: int
    tokens: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    labels: torch.Tensor | None = None
    floats: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    inputs: str | None = None
    token_labels: torch.Tensor | None = None
    context: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)


def describe(batch: Any, depth: int = 0) -> str:
    """A short description of a batch's structure (types, keys, dtypes and shapes).

    Example:
        >>> describe({"x": torch.zeros(2, 3), "n": 4})
        "dict{'x': float32[2, 3], 'n': int}"
    """
    if isinstance(batch, torch.Tensor):
        return f"{str(batch.dtype).replace('torch.', '')}{list(batch.shape)}"
    if depth > 2:
        return type(batch).__name__
    if isinstance(batch, Mapping):
        items = list(batch.items())[:8]
        return "dict{" + ", ".join(f"{k!r}: {describe(v, depth + 1)}" for k, v in items) + "}"
    if isinstance(batch, (tuple, list)):
        inner = ", ".join(describe(v, depth + 1) for v in batch[:6])
        return f"{type(batch).__name__}({inner}{', ...' if len(batch) > 6 else ''})"
    return type(batch).__name__


def _floats(batch: Any, key: str, out: dict[str, torch.Tensor]) -> None:
    if isinstance(batch, torch.Tensor):
        if batch.is_floating_point() or batch.is_complex():
            out[key or "batch"] = batch
    elif isinstance(batch, Mapping):
        for k, v in batch.items():
            _floats(v, f"{key}.{k}" if key else str(k), out)
    elif isinstance(batch, (tuple, list)):
        for i, v in enumerate(batch):
            _floats(v, f"{key}[{i}]", out)


def _from_mapping(batch: Mapping[str, Any], view: BatchView) -> None:
    ids = batch.get("input_ids")
    if is_int_tensor(ids) and ids.dim() == 2:
        view.tokens = ids
        mask = batch.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.shape == ids.shape:
            view.mask = mask.bool()
    for key in _LABEL_KEYS:
        if key in batch:
            _set_labels(batch[key], view)
            _set_token_labels(batch[key], view)
            break


def _set_token_labels(labels: Any, view: BatchView) -> None:
    if is_int_tensor(labels) and view.tokens is not None and labels.shape == view.tokens.shape:
        view.token_labels = labels


def _set_labels(labels: Any, view: BatchView) -> None:
    if is_int_tensor(labels) and labels.dim() == 1:
        view.labels = labels
    elif is_int_tensor(labels) and labels.dim() == 2 and labels.shape[1] == 1:
        view.labels = labels[:, 0]


def interpret(
    batch: Any,
    extract: Callable[[Any], Mapping[str, Any] | None] | None = None,
) -> BatchView | None:
    """Find token ids, padding mask, labels and floating tensors in a batch.

    Without ``extract``: a mapping (Hugging Face style) gives ``input_ids``, ``attention_mask`` and ``labels``
    (or ``label``, ``targets``, ``target``, ``y``); a tuple or list is ``(inputs, targets, ...)`` where inputs are
    a 2-D integer tensor of token ids, a floating tensor of features or a mapping as above, and targets a 1-D
    integer tensor of class labels; a plain 2-D integer tensor is token ids, a floating tensor features.
    Token-level labels (``[B, L]``, language modelling) and floating targets are not class labels.

    With ``extract``: ``extract(batch)`` returns a mapping with any of ``"token_ids"`` (``[B, L]`` int),
    ``"mask"`` (``[B, L]``, non-zero for real tokens), ``"labels"`` (``[B]`` int) and ``"features"`` (a tensor or
    a mapping of tensors), or ``None`` to skip the batch.

    Returns:
        The view, or ``None`` when ``extract`` skipped the batch.

    Raises:
        UninterpretableBatch: If nothing was found; the message describes the batch and how to pass ``extract=``.
    """
    if extract is not None:
        got = extract(batch)
        if got is None:
            return None
        if not isinstance(got, Mapping):
            raise UninterpretableBatch(
                f"`extract` returned {type(got).__name__}; it must return a mapping with any of 'token_ids', "
                "'mask', 'labels', 'features' (or None to skip the batch)"
            )
        floats: dict[str, torch.Tensor] = {}
        context_root = got.get("features")
        _floats(context_root, "features", floats)
        view = BatchView(size=0, floats=floats, inputs=next(iter(floats), None))
        ids = got.get("token_ids")
        if is_int_tensor(ids) and ids.dim() == 2:
            view.tokens = ids
            mask = got.get("mask")
            if isinstance(mask, torch.Tensor) and mask.shape == ids.shape:
                view.mask = mask.bool()
        _set_labels(got.get("labels"), view)
        _set_token_labels(got.get("labels"), view)
    else:
        context_root = batch
        floats = {}
        _floats(batch, "", floats)
        view = BatchView(size=0, floats=floats)
        if isinstance(batch, Mapping):
            _from_mapping(batch, view)
            view.inputs = next((k for k in ("pixel_values", "inputs", "input", "x", "features") if k in floats), None)
        elif isinstance(batch, (tuple, list)) and batch:
            x = batch[0]
            if isinstance(x, Mapping):
                _from_mapping(x, view)
            elif is_int_tensor(x) and x.dim() == 2:
                view.tokens = x
            elif isinstance(x, torch.Tensor) and x.is_floating_point():
                view.inputs = "[0]"
            if len(batch) > 1 and view.labels is None:
                _set_labels(batch[1], view)
            if len(batch) > 1 and view.token_labels is None:
                _set_token_labels(batch[1], view)
        elif is_int_tensor(batch) and batch.dim() == 2:
            view.tokens = batch
        elif isinstance(batch, torch.Tensor) and batch.is_floating_point():
            view.inputs = "batch"
    if view.tokens is None and view.labels is None and not view.floats:
        raise UninterpretableBatch(
            f"found no token ids, labels or floating tensors in a batch of {describe(batch)}; pass "
            "`DataDiagnostics(extract=lambda batch: {'token_ids': ..., 'mask': ..., 'labels': ..., 'features': ...})` "
            "returning the parts it has"
        )
    for t in (view.tokens, view.labels, *(view.floats[view.inputs] for _ in [0] if view.inputs in view.floats)):
        if isinstance(t, torch.Tensor) and t.dim() > 0:
            view.size = int(t.shape[0])
            break
    else:
        first = next((t for t in view.floats.values() if t.dim() > 0), None)
        view.size = int(first.shape[0]) if first is not None else 1
    if view.tokens is not None:
        leaves = tensor_leaves(context_root, "features") if extract is not None else tensor_leaves(batch)
        view.context = _context(leaves, view, positional_targets=extract is None and isinstance(batch, (tuple, list)))
    return view


def _context(
    leaves: list[tuple[str, torch.Tensor]], view: BatchView, positional_targets: bool
) -> dict[str, torch.Tensor]:
    """The per-sample inputs of a token batch besides its text (:attr:`BatchView.context`)."""
    assert view.tokens is not None
    text = {id(t) for t in (view.tokens, view.mask, view.labels, view.token_labels) if t is not None}
    out = {}
    for key, t in leaves:
        name = key.rsplit(".", 1)[-1].lower()
        # 1-D per-sample values (an index, a length, a weight) are no content: a dataset index would make every
        # sample unique
        if id(t) in text or t.dim() < 2 or t.shape[0] != view.size or "mask" in name or name in _LABEL_KEYS:
            continue
        if positional_targets and key == "[1]":  # (inputs, targets): the targets are no input
            continue
        if is_int_tensor(t) and t.shape == view.tokens.shape:  # token_type_ids, position_ids: the text again
            continue
        out[key] = t
    return out


def sample_indices(length: int, count: int | None, rank: int, world: int, seed: int) -> np.ndarray:
    """Sorted dataset indices of this rank's sample: ``count`` drawn without replacement from its shard.

    The shard of rank ``r`` of ``w`` is ``r, r + w, r + 2w, ...``; ``count=None`` takes the whole shard. The draw
    uses a private generator seeded with ``seed``: no global random state is read or changed.

    Example:
        >>> sample_indices(10, None, 1, 2, 0).tolist()
        [1, 3, 5, 7, 9]
        >>> len(sample_indices(1000, 5, 0, 1, 0))
        5
    """
    shard = np.arange(rank, length, world)
    if count is None or count >= len(shard):
        return shard
    return np.sort(np.random.default_rng(seed).choice(shard, size=count, replace=False))


def read_sample(
    loader: Any,
    max_batches: int | None,
    rank: int,
    world: int,
    seed: int,
    advanced: list[str] | None = None,
) -> Generator[tuple[Any, np.ndarray], None, None]:
    """``(batch, dataset indices)`` of a bounded sample of ``loader``, leaving the training run untouched.

    A map-style dataset is indexed directly: ``max_batches * batch_size`` indices drawn from this rank's shard,
    fetched in the main process and collated with ``loader.collate_fn`` (no worker is started, the sampler is not
    iterated). An ``IterableDataset`` is read from a fresh ``iter(dataset)`` for its first ``max_batches *
    world`` batches (rank ``r`` keeps every ``world``-th one), never exhausted. The global random states are
    restored afterwards, and so are the generators the dataset and the ``collate_fn`` hold themselves (a numpy
    ``Generator`` or ``RandomState``, a ``random.Random``, a ``torch.Generator``, found by walking their
    attributes: :class:`~lightning_diag.instrument.rng.HeldGenerators`) and the attributes reading bound anew,
    so a ``__getitem__`` with random augmentation leaves no trace either.

    Args:
        advanced: When given, receives the paths (``dataset.rng``...) of the held generators that reading drew
            from, before they are put back, the process-wide ones left out (``worker_rng_shared``).

    Raises:
        TypeError: If ``loader`` is neither a ``DataLoader`` nor a list or tuple of batches (reading any other
            iterable could consume it).
    """
    roots = [("dataset", getattr(loader, "dataset", None)), ("collate_fn", getattr(loader, "collate_fn", None))]
    held = HeldGenerators.capture(*[(name, obj) for name, obj in roots if obj is not None])
    with preserved_rng():
        try:
            yield from _read(loader, max_batches, rank, world, seed)
        finally:
            if advanced is not None:  # the process-wide generators are reseeded in each worker: not listed
                drew = [p for p in held.advanced() if not is_global_generator(held.generators[p])]
                advanced.extend(_carried(loader, held, drew))
            held.restore()


def _carried(loader: Any, held: HeldGenerators, drew: list[str]) -> list[str]:
    """Of the generators that reading drew from, those whose state carries over from one item to the next.

    A ``__getitem__`` that reseeds its generator from the index (``self.g.manual_seed(seed + i)``) leaves a state
    that depends on the item only: its workers do not share a stream. The first item is read twice, once from
    the captured states and once after one draw from each generator; a generator whose state after the read is
    the same both times is reseeded per item. Not probed (all kept): an ``IterableDataset``, an empty one, or a
    read that fails.
    """
    dataset = getattr(loader, "dataset", None)
    if not drew or dataset is None or isinstance(dataset, IterableDataset):
        return drew
    try:
        if len(dataset) == 0:
            return drew
        held.restore()
        dataset[0]
        plain = held.current(drew)
        held.restore()
        held.nudge(drew)
        dataset[0]
        nudged = held.current(drew)
    except Exception:  # the probe must never fail the measurement
        return drew
    reseeded = set(HeldGenerators.same(plain, nudged))
    return [p for p in drew if p not in reseeded]


def _read(loader: Any, max_batches: int | None, rank: int, world: int, seed: int) -> Iterator[tuple[Any, np.ndarray]]:
    if isinstance(loader, (list, tuple)):
        batches = loader if max_batches is None else loader[: max_batches * world]
        for i, batch in enumerate(batches):
            if i % world == rank:
                yield batch, np.array([i])
        return
    if not isinstance(loader, DataLoader):
        raise TypeError(
            f"a {type(loader).__name__} is not a torch DataLoader: reading it could consume the batches training "
            "needs, so it is not sampled"
        )
    dataset = loader.dataset
    batch_size = loader.batch_size or 32
    collated = loader.batch_sampler is not None
    if isinstance(dataset, IterableDataset):
        stream = iter(dataset)
        size = batch_size if collated else 1
        limit = None if max_batches is None else max_batches * world
        position = 0
        for b in itertools.count():
            if limit is not None and b >= limit:
                return
            items = list(itertools.islice(stream, size))
            if not items:
                return
            idx = np.arange(position, position + len(items))
            position += len(items)
            if b % world == rank:
                yield (loader.collate_fn(items) if collated else items[0]), idx
        return
    length = len(dataset)  # type: ignore[arg-type]
    per_batch = batch_size if collated else 1
    count = None if max_batches is None else max_batches * per_batch
    indices = sample_indices(length, count, rank, world, seed)
    for start in range(0, len(indices), per_batch):
        idx = indices[start : start + per_batch]
        items = [dataset[int(i)] for i in idx]
        yield (loader.collate_fn(items) if collated else items[0]), idx
