"""Slice search: the groups of validation samples that share a feature and fail more often than the rest.

The approach of the slice-discovery methods (SliceFinder, Chung et al. 2019; SliceLine, Sagadeeva and Boehm 2021;
Domino, Eyuboglu et al. 2022): a *slice* is the set of samples that share one feature; every slice with enough
samples is judged on its error rate against the rest, with a significance test corrected for the number of slices
tried, and slices that hold nearly the same samples are merged into one finding. Unlike clustering, a slice is
never diluted by the easy samples around it: a hard group of 14% that shares a token is measured on exactly the
samples that carry it.

1. Features (:func:`token_features`, :func:`value_features`): a token-id unigram or bigram present in the sample
   (``"12"``, ``"12 57"``), the true label (``"label=1"``), a metadata field's value (``"source=forum"``), or an
   embedding cluster (``"embedding=k4/c2"``, :mod:`lightning_diag.stats.error_clusters`). Each is a boolean
   column of a sparse sample x feature matrix.
2. Search (:func:`find_slices`): every feature held by at least ``min_count`` samples (and missing from at least as
   many) is a slice. Its error rate is the mean error of its samples; its *lift* is that rate over the overall
   rate; its p-value is the one-sided Fisher exact test (the hypergeometric tail) of its wrong samples against
   the rest's. Features with exactly the same samples are one slice. The p-values are corrected by Bonferroni
   over the number of slices tested.
3. Grouping (:func:`lightning_diag.stats.slice_groups.find_groups`): slices that fail together become one
   :class:`Finding`.

Pure numpy and scipy (installed with scikit-learn, the ``errors`` extra), imported when a function runs.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = [
    "MERGE_JACCARD",
    "Finding",
    "Member",
    "SliceFeatures",
    "SliceStat",
    "find_slices",
    "stack_features",
    "token_features",
    "value_features",
]

#: Slices whose sample sets overlap at least this much (Jaccard index) are one finding.
MERGE_JACCARD = 0.5


@dataclasses.dataclass(frozen=True)
class SliceFeatures:
    """A boolean sample x feature matrix and the feature names.

    Attributes:
        members: ``scipy.sparse.csc_matrix`` of shape ``[samples, features]``, 1 where the sample has the feature.
        names: One name per column.
    """

    members: Any
    names: list[str]

    @property
    def samples(self) -> int:
        """The number of samples (rows)."""
        return int(self.members.shape[0])


def _columns(rows: np.ndarray, cols: np.ndarray, samples: int, features: int) -> Any:
    from scipy.sparse import csc_matrix

    data = np.ones(len(rows), dtype=np.float64)
    return csc_matrix((data, (rows, cols)), shape=(samples, features))


def token_features(sequences: Sequence[np.ndarray], min_count: int = 1) -> SliceFeatures:
    """Presence of each token-id unigram and bigram, kept where at least ``min_count`` samples hold it.

    Names are the ids, space-separated (``"12"``, ``"12 57"``), so that a tokenizer can decode them.

    Example:
        >>> f = token_features([np.array([1, 2, 2]), np.array([2, 3])])
        >>> f.names, f.members.toarray().astype(int).tolist()
        (['1', '2', '3', '1 2', '2 2', '2 3'], [[1, 1, 0, 1, 1, 0], [0, 1, 1, 0, 0, 1]])
    """
    seqs = [np.asarray(s, dtype=np.int64).ravel() for s in sequences]
    seqs = [s[s >= 0] for s in seqs]
    top = max((int(s.max()) for s in seqs if len(s)), default=0) + 1
    rows, keys = [], []
    for i, s in enumerate(seqs):
        grams = np.unique(np.concatenate([s, top + s[:-1] * top + s[1:]]) if len(s) > 1 else s)
        rows.append(np.full(len(grams), i, dtype=np.int64))
        keys.append(grams)
    if not keys:
        return SliceFeatures(_columns(np.empty(0, int), np.empty(0, int), 0, 0), [])
    all_rows, all_keys = np.concatenate(rows), np.concatenate(keys)
    unique, inverse, counts = np.unique(all_keys, return_inverse=True, return_counts=True)
    kept = counts >= min_count
    column = np.cumsum(kept) - 1
    keep_entry = kept[inverse]
    members = _columns(all_rows[keep_entry], column[inverse[keep_entry]], len(seqs), int(kept.sum()))
    names = [str(k) if k < top else f"{(k - top) // top} {(k - top) % top}" for k in unique[kept].tolist()]
    return SliceFeatures(members, names)


def value_features(values: Sequence[Any], field: str, min_count: int = 1) -> SliceFeatures:
    """One feature per distinct value of a per-sample field (``"label=1"``, ``"source=forum"``), kept where at
    least ``min_count`` samples hold it; a ``None`` value is no feature.

    Example:
        >>> value_features(["a", "b", None, "a"], "source").names
        ['source=a', 'source=b']
    """
    text = [None if v is None else str(v) for v in values]
    distinct = sorted({v for v in text if v is not None})
    index = {v: i for i, v in enumerate(distinct)}
    rows = np.array([i for i, v in enumerate(text) if v is not None], dtype=np.int64)
    cols = np.array([index[v] for v in text if v is not None], dtype=np.int64)
    members = _columns(rows, cols, len(text), len(distinct))
    counts = np.asarray(members.sum(axis=0)).ravel()
    kept = np.flatnonzero(counts >= min_count)
    return SliceFeatures(members[:, kept], [f"{field}={distinct[i]}" for i in kept])


def stack_features(parts: Sequence[SliceFeatures]) -> SliceFeatures:
    """The columns of several feature sets over the same samples, side by side."""
    from scipy.sparse import csc_matrix, hstack

    parts = [p for p in parts if p.members.shape[1] > 0]
    if not parts:
        raise ValueError("no features to stack")
    return SliceFeatures(csc_matrix(hstack([p.members for p in parts])), [n for p in parts for n in p.names])


@dataclasses.dataclass(frozen=True)
class _SliceNumbers:
    """What a slice (or a merged finding) is measured by.

    Attributes:
        features: The features that define it (several when they hold exactly the same samples, or were merged).
        size: Its samples.
        share: ``size`` over all samples.
        error_rate: The mean error of its samples (the fraction wrong; for token tasks the mean token error rate).
        rest_error_rate: The mean error of the other samples.
        lift: ``error_rate`` over the overall error rate.
        wrong: Its samples counted wrong.
        p_value: One-sided Fisher exact test: the chance of at least ``wrong`` wrong samples in a random set of
            ``size`` samples.
        p_adjusted: ``p_value`` times the number of slices tested (Bonferroni), at most 1.
    """

    features: tuple[str, ...]
    size: int
    share: float
    error_rate: float
    rest_error_rate: float
    lift: float
    wrong: int
    p_value: float
    p_adjusted: float

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        out = dataclasses.asdict(self)
        out["features"] = list(self.features)
        return out


@dataclasses.dataclass(frozen=True)
class SliceStat(_SliceNumbers):
    """One slice: the samples that share a feature, measured against the rest (the fields of
    :class:`_SliceNumbers`).

    Attributes:
        column: Its column in the feature matrix (the first of identical columns).
    """

    column: int

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (without the column)."""
        out = super().to_dict()
        del out["column"]
        return out


def find_slices(
    features: SliceFeatures, errors: np.ndarray, wrong: np.ndarray, min_count: int
) -> tuple[list[SliceStat], int]:
    """Every slice of at least ``min_count`` samples (and at least ``min_count`` outside it), judged against the
    rest; returns those whose error rate exceeds the rest's, most significant first, and the number tested.

    Args:
        features: The sample x feature matrix.
        errors: Each sample's error (0/1, or a token error rate).
        wrong: Each sample counted wrong (the test counts these).
        min_count: The smallest slice tested (the support).

    Example:
        >>> wrong = np.array([1, 1, 1, 0, 0, 0, 0, 0, 0, 0], dtype=bool)
        >>> f = value_features(["x", "x", "x", "x", "y", "y", "y", "y", "y", "y"], "group")
        >>> slices, tested = find_slices(f, wrong.astype(float), wrong, min_count=3)
        >>> [(s.features, s.size, s.error_rate, round(s.lift, 2)) for s in slices], tested
        ([(('group=x',), 4, 0.75, 2.5)], 2)
    """
    from scipy.stats import hypergeom

    members = features.members.tocsc()
    n = features.samples
    if n == 0 or members.shape[1] == 0:
        return [], 0
    sizes = np.asarray(members.sum(axis=0)).ravel().astype(np.int64)
    candidates = np.flatnonzero((sizes >= min_count) & (n - sizes >= min_count))
    groups: dict[bytes, list[int]] = {}
    for c in candidates.tolist():  # identical sample sets are one slice
        rows = members.indices[members.indptr[c]:members.indptr[c + 1]]
        groups.setdefault(np.sort(rows).tobytes(), []).append(c)
    tested = len(groups)
    if tested == 0:
        return [], 0
    firsts = np.array([cols[0] for cols in groups.values()], dtype=np.int64)
    sub = members[:, firsts]
    size = sizes[firsts]
    err_sum = np.asarray(sub.T @ errors.astype(np.float64)).ravel()
    bad = np.asarray(sub.T @ wrong.astype(np.float64)).ravel().round().astype(np.int64)
    total_err, total_bad = float(errors.sum()), int(wrong.sum())
    rate = err_sum / size
    rest = (total_err - err_sum) / (n - size)
    overall = total_err / n
    p = hypergeom.sf(bad - 1, n, total_bad, size)
    out = []
    for j, cols in enumerate(groups.values()):
        if not rate[j] > rest[j]:
            continue
        pj = float(min(max(p[j], 0.0), 1.0))
        out.append(SliceStat(
            column=int(cols[0]), features=tuple(features.names[c] for c in cols), size=int(size[j]),
            share=float(size[j] / n), error_rate=float(rate[j]), rest_error_rate=float(rest[j]),
            lift=float(rate[j] / overall) if overall > 0 else math.inf, wrong=int(bad[j]), p_value=pj,
            p_adjusted=min(1.0, pj * tested),
        ))
    out.sort(key=lambda s: (s.p_value, -s.lift, -s.size))
    return out, tested


@dataclasses.dataclass(frozen=True)
class Member:
    """One member slice of a group (:mod:`lightning_diag.stats.slice_groups`), measured on its own samples.

    Attributes:
        features: Its features (several when they hold exactly the same samples; ``"a & b"`` for a conjunction).
        size: Its samples.
        share: ``size`` over all samples.
        error_rate: The mean error of its samples.
        lift: ``error_rate`` over the overall error rate.
        wrong: Its samples counted wrong.
        p_value: Its one-sided Fisher exact p-value (uncorrected).
    """

    features: tuple[str, ...]
    size: int
    share: float
    error_rate: float
    lift: float
    wrong: int
    p_value: float


@dataclasses.dataclass(frozen=True)
class Finding(_SliceNumbers):
    """Slices that fail together, as one finding (the fields of :class:`_SliceNumbers`; every slice's features,
    the most significant first).

    From :func:`lightning_diag.stats.slice_groups.find_groups`: the numbers are those of the union of its members
    (``share`` and ``error_rate`` equal ``union_share`` and ``union_error_rate``).

    Attributes:
        slices: The number of slices merged (members and alternates).
        majority_label: The most common true label of its wrong samples (classification), else ``None``.
        majority_prediction: The most common prediction of its wrong samples (classification), else ``None``.
        kind: How its members describe it: ``"slice"`` (one feature, and the features of the same samples),
            ``"conjunction"`` (two features that fail together: ``"a & b"``), ``"disjunction"`` (samples holding
            any of several members).
        members: The member slices whose union it is.
        union_share: The share of the samples in the union of its members.
        union_error_rate: The mean error of that union.
        alternates: Features of other slices of largely the same samples (listed in ``features`` too).
    """

    slices: int = 1
    majority_label: int | None = None
    majority_prediction: int | None = None
    kind: str = "slice"
    members: tuple[Member, ...] = ()
    union_share: float | None = None
    union_error_rate: float | None = None
    alternates: tuple[str, ...] = ()
