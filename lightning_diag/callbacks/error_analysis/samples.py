"""ErrorAnalysis's samples: reading predictions, labels, token ids, embeddings and metadata from validation batches,
scoring each sample, and the samples of one validation kept on this rank and gathered from every rank.

The judging (the slice search, the rule, what is logged and written) is :mod:`lightning_diag.callbacks.error_analysis`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import pytorch_lightning as pl
import torch

from lightning_diag.instrument.batches import is_int_tensor, token_ids

__all__ = [
    "Predictions",
    "SampleBuffer",
    "Samples",
    "Scores",
    "batch_metadata",
    "batch_tokens",
    "default_predictions",
    "embedding_rows",
    "gather_samples",
    "score",
]

_LABEL_KEYS = ("labels", "label", "targets", "target", "y")
_IGNORE_INDEX = -100

#: ``predict(pl_module, batch, outputs) -> (predictions, labels)``: class ids ``[B]`` (or logits ``[B, C]``) and
#: labels ``[B]``; or token predictions ``[B, T]`` (or logits ``[B, T, V]``) and labels ``[B, T]`` (-100 ignored).
Predictions = Callable[[pl.LightningModule, Any, Any], "tuple[torch.Tensor, torch.Tensor] | None"]


def _labels_of(batch: Any) -> torch.Tensor | None:
    if isinstance(batch, dict):
        for key in _LABEL_KEYS:
            if is_int_tensor(batch.get(key)):
                return batch[key]
        return None
    if isinstance(batch, (tuple, list)) and len(batch) >= 2 and is_int_tensor(batch[-1]):
        return batch[-1]
    return None


def default_predictions(pl_module: pl.LightningModule, batch: Any, outputs: Any) -> tuple[Any, Any] | None:
    """What ``validation_step`` returned, read as predictions, and the labels.

    ``outputs`` is a logits tensor, or a dict with ``"logits"`` or ``"preds"`` (and optionally ``"labels"`` /
    ``"target"``, and ``"metadata"``, read by :class:`~lightning_diag.callbacks.error_analysis.analysis.ErrorAnalysis`
    itself); the labels default to the batch's (``batch["labels"]`` and the other usual keys, or the last element
    of a tuple batch). Logits ``[B, T, V]`` against labels that are the batch's own ``input_ids`` (a causal LM,
    which Hugging Face shifts itself) are compared one position ahead.
    """
    preds: Any
    labels: Any
    if isinstance(outputs, torch.Tensor):
        preds, labels = outputs, None
    elif isinstance(outputs, dict):
        preds = outputs.get("logits", outputs.get("preds"))
        labels = outputs.get("labels", outputs.get("target"))
    else:
        return None
    if not isinstance(preds, torch.Tensor):
        return None
    labels = labels if isinstance(labels, torch.Tensor) else _labels_of(batch)
    if labels is None:
        return None
    if preds.is_floating_point() and preds.dim() == 3 and labels.dim() == 2:
        ids = token_ids(batch)
        if ids is not None and ids.shape == labels.shape and torch.equal(ids, labels):
            return preds[:, :-1], labels[:, 1:]
    return preds, labels


class Scores(NamedTuple):
    """One batch's samples, scored.

    Attributes:
        errors: Per sample: 1.0 wrong / 0.0 right (classification), or its token error rate (NaN without a
            scored token).
        labels: The true class per sample (-1 for token tasks).
        preds: The predicted class per sample (-1 for token tasks).
        classification: Whether the batch is a classification (else a token task).
    """

    errors: list[float]
    labels: list[int]
    preds: list[int]
    classification: bool


def score(preds: torch.Tensor, labels: torch.Tensor) -> Scores | None:
    """Each sample's error: the argmax against the label, or a sequence's token error rate (labels -100 ignored).

    Returns ``None`` for shapes that are neither ``([B] or [B, C], [B])`` nor ``([B, T] or [B, T, V], [B, T])``.
    """
    if preds.is_floating_point():
        preds = preds.argmax(-1)
    if preds.shape != labels.shape or preds.dim() not in (1, 2):
        return None
    preds, labels = preds.detach().cpu(), labels.detach().cpu()
    if preds.dim() == 1:
        return Scores((preds != labels).float().tolist(), labels.tolist(), preds.tolist(), True)
    valid = labels != _IGNORE_INDEX
    counts = valid.sum(-1)
    wrong = ((preds != labels) & valid).sum(-1).float()
    rates = torch.where(counts > 0, wrong / counts.clamp(min=1), torch.full_like(wrong, math.nan))
    return Scores(rates.tolist(), [-1] * len(rates), [-1] * len(rates), False)


def embedding_rows(rows: Any, size: int) -> tuple[list[np.ndarray] | None, str]:
    """What ``embed=`` returned, one flat row per sample, or ``None`` and why it cannot be used."""
    if not isinstance(rows, torch.Tensor) or rows.numel() == 0 or rows.shape[0] != size:
        shape = tuple(rows.shape) if isinstance(rows, torch.Tensor) else ""
        return None, (
            f"embed= returned {type(rows).__name__} {shape}: expected a Tensor[B, D] with B = {size}, "
            "the batch's samples"
        )
    return list(rows.detach().float().cpu().reshape(size, -1).numpy()), ""


def batch_tokens(batch: Any, size: int) -> list[np.ndarray | None] | None:
    """The token ids of each sample (padding dropped by the attention mask), or ``None`` when the batch has none."""
    ids = token_ids(batch)
    if ids is None or ids.dim() != 2 or ids.shape[0] != size:
        return None
    mask = batch.get("attention_mask") if isinstance(batch, dict) else None
    ids = ids.detach().cpu()
    keep = mask.detach().cpu().bool() if isinstance(mask, torch.Tensor) and mask.shape == ids.shape else None
    return [row[keep[i]].numpy() if keep is not None else row.numpy() for i, row in enumerate(ids)]


def batch_metadata(outputs: Any, size: int) -> tuple[list[dict[str, str]], list[tuple[str, str]]]:
    """The ``"metadata"`` of what ``validation_step`` returned, one ``field -> value`` dict per sample.

    Returns:
        The rows, and ``(key, message)`` notices for what was ignored (a field that is not one value per sample).
    """
    fields = outputs.get("metadata") if isinstance(outputs, dict) else None
    rows: list[dict[str, str]] = [{} for _ in range(size)]
    notices: list[tuple[str, str]] = []
    if fields is None:
        return rows, notices
    if not isinstance(fields, Mapping):
        notices.append(
            (
                "metadata-type",
                f"`validation_step`'s 'metadata' is a {type(fields).__name__}, not a "
                "dict of field -> per-sample values: it is ignored",
            )
        )
        return rows, notices
    for name, values in fields.items():
        if isinstance(values, torch.Tensor):
            values = values.detach().cpu().reshape(-1).tolist() if values.numel() == size else None
        elif isinstance(values, (list, tuple, np.ndarray)) and len(values) != size:
            values = None
        if values is None or not isinstance(values, (list, tuple, np.ndarray)) or "=" in str(name):
            notices.append(
                (
                    f"metadata-{name}",
                    f"metadata field {name!r} is not one value per sample ({size}) "
                    "under a name without '=': it is ignored",
                )
            )
            continue
        for row, value in zip(rows, values, strict=True):
            if value is not None:
                row[str(name)] = str(value)
    return rows, notices


class SampleBuffer:
    """The samples of one validation kept on this rank, in batch order, up to a budget."""

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        """Start empty."""
        self.errors: list[float] = []
        self.labels: list[int] = []
        self.preds: list[int] = []
        self.tokens: list[np.ndarray | None] = []
        self.embeddings: list[np.ndarray] = []
        self.metadata: list[dict[str, str]] = []
        self.classification = True

    def __len__(self) -> int:
        return len(self.errors)

    def add(
        self,
        scores: Scores,
        tokens: list[np.ndarray | None] | None,
        embeddings: list[np.ndarray] | None,
        metadata: list[dict[str, str]],
        max_samples: int,
    ) -> None:
        """Keep one batch's samples, those within ``max_samples`` in all."""
        room = max_samples - len(self.errors)
        size = len(scores.errors)
        self.classification = self.classification and scores.classification
        self.errors.extend(scores.errors[:room])
        self.labels.extend(scores.labels[:room])
        self.preds.extend(scores.preds[:room])
        self.tokens.extend((tokens or [None] * size)[:room])
        if embeddings is not None:
            self.embeddings.extend(embeddings[:room])
        self.metadata.extend(metadata[:room])

    def parts(self) -> tuple[Any, ...]:
        """What :func:`gather_samples` reads from each rank (plain lists, for ``all_gather_object``)."""
        return (self.errors, self.labels, self.preds, self.tokens, self.embeddings, self.metadata, self.classification)


@dataclasses.dataclass(frozen=True)
class Samples:
    """One validation's samples, gathered from every rank."""

    errors: np.ndarray
    labels: np.ndarray
    preds: np.ndarray
    tokens: list[np.ndarray | None]
    embeddings: np.ndarray | None
    metadata: list[dict[str, str]]
    classification: bool


def gather_samples(parts: Sequence[tuple[Any, ...]], min_samples: int) -> Samples | None:
    """The samples of every rank's :meth:`SampleBuffer.parts` whose error is finite, or ``None`` when fewer than
    ``min_samples`` are."""
    errors = np.array([e for p in parts for e in p[0]], dtype=float)
    labels = np.array([v for p in parts for v in p[1]])
    preds = np.array([v for p in parts for v in p[2]])
    tokens = [t for p in parts for t in p[3]]
    embeddings = [e for p in parts for e in p[4]]
    metadata = [m for p in parts for m in p[5]]
    classification = all(p[6] for p in parts)
    keep = np.isfinite(errors)
    if keep.sum() < min_samples:
        return None
    errors, labels, preds = errors[keep], labels[keep], preds[keep]
    tokens = [t for t, k in zip(tokens, keep, strict=True) if k]
    metadata = [m for m, k in zip(metadata, keep, strict=True) if k]
    matrix = np.stack(embeddings)[keep] if len(embeddings) == len(keep) and embeddings else None
    return Samples(errors, labels, preds, tokens, matrix, metadata, classification)
