"""TensorBoard histograms computed where the tensor lives: the counts of ``SummaryWriter.add_histogram``'s default
buckets without copying the tensor to the host or sorting it.

``add_histogram`` converts the tensor to a float64 NumPy array on the host and calls ``numpy.histogram`` with its
~1,550 non-uniform default edges, which sorts the whole array: about 20 ms per million values on one CPU core,
and a full device-to-host copy on CUDA. The default edges are a geometric series (``1e-12 * 1.1**k`` by
repeated multiplication, mirrored for negative values, with 0 between), so a value's bucket is found from its
logarithm and then corrected against the exact edges: the counts, minimum, maximum and number of values are
identical to ``numpy.histogram``'s; sum and sum of squares are float64 sums like NumPy's (equal up to the order
of float64 additions). Only the bucket counts and five numbers reach the host.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch

__all__ = ["HistogramData", "default_edges", "tensorboard_histogram"]

_FIRST = 1e-12
_RATIO = 1.1
_LAST = 1e20
#: Values per chunk: bounds the float64 working copy (32 MiB) whatever the tensor's size.
_CHUNK = 1 << 22


@functools.lru_cache(maxsize=1)
def default_edges() -> tuple[float, ...]:
    """The bucket edges of ``torch.utils.tensorboard.SummaryWriter.default_bins``, computed the same way.

    Example:
        >>> edges = default_edges()
        >>> len(edges), edges[len(edges) // 2], edges[len(edges) // 2 + 1]
        (1549, 0, 1e-12)
    """
    v = _FIRST
    positive: list[float] = []
    while v < _LAST:
        positive.append(v)
        v *= _RATIO
    return (*(-p for p in reversed(positive)), 0, *positive)


@dataclasses.dataclass(frozen=True)
class HistogramData:
    """The fields of a TensorBoard ``HistogramProto`` (the arguments of ``SummaryWriter.add_histogram_raw``)."""

    min: float
    max: float
    num: int
    sum: float
    sum_squares: float
    bucket_limits: list[float]
    bucket_counts: list[int]


def _bucket_index(v: torch.Tensor, edges: torch.Tensor, n_positive: int) -> torch.Tensor:
    """``i`` with ``edges[i] <= v < edges[i + 1]`` (NumPy's rule) for float64 values inside the edges' range."""
    last = len(edges) - 2
    # the geometric series' exponent from the logarithm: positive v in [pos[k], pos[k+1]) is bucket
    # n_positive + 1 + k, negative v in [-pos[k+1], -pos[k]) is n_positive - 2 - k (|v| < 1e-12: k = -1)
    k = torch.log(v.abs()).mul_(1 / math.log(_RATIO)).add_(-math.log(_FIRST) / math.log(_RATIO))
    k = k.floor_().clamp_(-1, n_positive - 1).long()
    guess = torch.where(v < 0, (n_positive - 2) - k, (n_positive + 1) + k).clamp_(0, last)
    # the float logarithm can be one bucket off next to an edge: one correction against the exact edges
    guess += (v >= torch.take(edges, (guess + 1).clamp_(max=last + 1))).long()
    guess -= (v < torch.take(edges, guess)).long()
    guess.clamp_(0, last)
    wrong = (v < torch.take(edges, guess)) | ((v >= torch.take(edges, guess + 1)) & (guess < last))
    if bool(wrong.any()):  # not expected; exact either way
        guess = torch.where(wrong, (torch.searchsorted(edges, v, right=True) - 1).clamp_(0, last), guess)
    return guess


def tensorboard_histogram(values: torch.Tensor) -> HistogramData | None:
    """What ``SummaryWriter.add_histogram(tag, values)`` writes, computed on ``values``' device.

    Returns ``None`` when ``values`` is empty or holds a NaN or an infinity (the caller then skips it, or falls
    back to ``add_histogram``).

    Example:
        >>> h = tensorboard_histogram(torch.tensor([-1.0, 0.0, 0.5, 2.0]))
        >>> h.num, h.min, h.max, sum(h.bucket_counts)
        (4, -1.0, 2.0, 4)
    """
    flat = values.detach().reshape(-1)
    if flat.numel() == 0:
        return None
    edges_list = default_edges()
    edges = torch.tensor(edges_list, dtype=torch.float64, device=flat.device)
    n_positive = (len(edges_list) - 1) // 2
    n_buckets = len(edges_list) - 1
    counts = torch.zeros(n_buckets, dtype=torch.int64, device=flat.device)
    stats = torch.zeros(2, dtype=torch.float64, device=flat.device)
    extremes = torch.stack([flat.min(), flat.max()]).double()
    for start in range(0, flat.numel(), _CHUNK):
        v = flat[start : start + _CHUNK].double()
        stats += torch.stack([v.sum(), v.dot(v)])
        inside = (v >= edges[0]) & (v <= edges[-1])
        if not bool(inside.all()):
            v = v[inside]
        counts += torch.bincount(_bucket_index(v, edges, n_positive), minlength=n_buckets)
    lo, hi, total, squares = torch.cat([extremes, stats]).tolist()  # the one host copy of the numbers
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return None
    host_counts = counts.tolist()
    # TensorBoard's support trimming, as torch.utils.tensorboard.summary.make_histogram does it: keep the buckets
    # from the one before the first non-empty to the last non-empty, and the right edge of each.
    nonzero = [i for i, c in enumerate(host_counts) if c > 0]
    if not nonzero:
        return None
    first, last = nonzero[0], nonzero[-1]
    kept_counts = host_counts[first - 1 : last + 1] if first > 0 else [0, *host_counts[: last + 1]]
    limits = list(edges_list[first : last + 2])
    return HistogramData(
        min=lo,
        max=hi,
        num=flat.numel(),
        sum=total,
        sum_squares=squares,
        bucket_limits=[float(x) for x in limits],
        bucket_counts=kept_counts,
    )
