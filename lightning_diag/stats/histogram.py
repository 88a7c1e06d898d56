"""TensorBoard histograms computed where the tensor lives: the counts of ``SummaryWriter.add_histogram``'s default
buckets without copying the tensor to the host or sorting it.

``add_histogram`` converts the tensor to a float64 NumPy array on the host and calls ``numpy.histogram`` with its
~1,550 non-uniform default edges, which sorts the whole array: about 20 ms per million values on one CPU core,
and a full device-to-host copy on CUDA. The default edges are a geometric series (``1e-12 * 1.1**k`` by
repeated multiplication, mirrored for negative values, with 0 between), so a value's bucket is found from its
logarithm and then corrected against the exact edges: the counts, minimum, maximum and number of values are
identical to ``numpy.histogram``'s; sum and sum of squares are float64 sums like NumPy's (equal up to the order
of float64 additions). Only the bucket counts and five numbers reach the host.

On the CPU, :func:`cpu_histogram` gives ``add_histogram``'s exact numbers for a float32 tensor without the sort:
the top 20 bits of a float32 value (sign, exponent, 11 mantissa bits) span less than a tenth of any default
bucket, so a table indexed by them gives each value's bucket, except for the few values whose 20-bit prefix
straddles an edge, which are placed by a binary search against the exact edges. The prefixes are looked up and
counted with torch's int32 ``index_select`` and int16 ``bincount`` (NumPy converts both the index and the counted
array to 64-bit integers first, which cost as much as the lookup). Minimum and maximum come from one float32 pass
when they are nonzero and finite (float32 to float64 is exact and keeps the order: the same numbers), from
NumPy's reductions otherwise (which zero or which NaN is NumPy's choice). Sum and sum of squares are NumPy's
float64 reductions (its pairwise sum, BLAS's dot) of the same float64 array that ``add_histogram`` builds: every
field is equal to what ``add_histogram`` writes, byte for byte (tested). Torch's float64 reductions of that array
(or float32 ones with a float64 accumulator) add in another order: they differ from NumPy's in the last bits
(up to 3e-14 relatively: the sum of squares of each of 20 random 600 x 600 gradients, the sum of one), and the
copy and its two reductions cost about a seventh of a call, so the exact ones are kept
(``benchmarks/histogram_cost.py``: the 1.1M-parameter MLP's 10 gradients in about 5 ms, about 10x faster than
``add_histogram``'s sort).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np
import torch

__all__ = ["HistogramData", "cpu_histogram", "default_edges", "tensorboard_histogram"]

_FIRST = 1e-12
_RATIO = 1.1
_LAST = 1e20
#: Values per chunk: bounds the float64 working copy (32 MiB) whatever the tensor's size.
_CHUNK = 1 << 22
#: Bits of a float32 value dropped from the key of :func:`_prefix_table` (32 - 12 = 20 bits kept: sign,
#: exponent and 11 mantissa bits, a relative width of 2**-11, far below the default buckets' 1.1 ratio).
_DROPPED_BITS = 12
#: The prefix of a float32 value: its bits shifted right by :data:`_DROPPED_BITS`, the sign bit's copies masked off.
_PREFIX_MASK = (1 << (32 - _DROPPED_BITS)) - 1
#: Mantissa bits of a prefix: a block of the prefix table (one sign and exponent) holds ``2**_BLOCK_BITS`` prefixes.
_BLOCK_BITS = 32 - _DROPPED_BITS - 9
_BLOCK_SIZE = 1 << _BLOCK_BITS


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


@functools.lru_cache(maxsize=1)
def _prefix_table() -> tuple[np.ndarray, torch.Tensor]:
    """The default edges as float64, and for each 20-bit float32 prefix its bucket (int16, indexed by the prefix):
    ``len(edges) - 1`` (one past the last bucket) where the prefix's values lie outside the edges' range (NaN,
    infinities, magnitudes beyond 1e20), which ``numpy.histogram`` leaves out, ``len(edges)`` (two past the last)
    where they straddle an edge (those values are searched one by one), and ``len(edges) + 1`` where the prefix's
    block is not built yet (:func:`_build_blocks`).

    The table starts unbuilt and each block of :data:`_BLOCK_SIZE` prefixes (one sign and exponent) is built the
    first time a value of it is binned: a model's gradients span a few dozen exponents, and building all 512
    blocks at once (a million prefixes searched among the edges, twice) cost 45 ms on an idle CPU thread and
    120-230 ms in the first histogram step of a fit."""
    edges = np.asarray(default_edges(), dtype=np.float64)
    return edges, torch.full((1 << (32 - _DROPPED_BITS),), len(edges) + 1, dtype=torch.int16)


def _build_blocks(table: torch.Tensor, edges: np.ndarray, blocks: np.ndarray) -> None:
    """Fill the entries of :func:`_prefix_table`'s ``table`` for the prefixes of ``blocks`` (``prefix >>
    _BLOCK_BITS``), each as the whole table once was: the buckets of the prefix's smallest and largest magnitude,
    or the straddling mark where they differ."""
    shift = np.uint32(_BLOCK_BITS)  # uint32 throughout: the keys are viewed as float32
    prefixes = ((blocks.astype(np.uint32)[:, None] << shift) | np.arange(_BLOCK_SIZE, dtype=np.uint32)).ravel()
    keys = prefixes << np.uint32(_DROPPED_BITS)
    with np.errstate(invalid="ignore"):  # the NaN prefixes
        low = keys.view(np.float32).astype(np.float64)  # the prefix's smallest magnitude
        high = (keys | np.uint32((1 << _DROPPED_BITS) - 1)).view(np.float32).astype(np.float64)  # and its largest
    low_bucket = _buckets(low, edges)
    table.numpy()[prefixes] = np.where(low_bucket == _buckets(high, edges), low_bucket, len(edges))


def _buckets(values: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """``numpy.histogram``'s bucket of each float64 value (``edges[i] <= v < edges[i + 1]``, the last bucket closed
    on the right); ``len(edges) - 1`` for a value it leaves out (outside the edges, or NaN)."""
    n = len(edges) - 1
    index = np.searchsorted(edges, values, side="right") - 1
    index = np.where(values == edges[-1], n - 1, index)
    with np.errstate(invalid="ignore"):
        outside = ~((values >= edges[0]) & (values <= edges[-1]))  # NaN too
    return np.where(outside, n, index)


def cpu_histogram(values: torch.Tensor) -> HistogramData | None:
    """What ``SummaryWriter.add_histogram(tag, values)`` writes, field for field, for a float32 CPU tensor.

    Returns ``None`` for another dtype or device, an empty tensor, or one with no value inside the default edges:
    the caller then uses ``add_histogram`` itself.

    Example:
        >>> h = cpu_histogram(torch.tensor([-1.0, 0.0, 0.5, 2.0]))
        >>> h.num, h.min, h.max, sum(h.bucket_counts)
        (4, -1.0, 2.0, 4)
    """
    if values.device.type != "cpu" or values.dtype is not torch.float32 or values.numel() == 0:
        return None
    edges, table = _prefix_table()
    n = len(edges) - 1
    straddle = n + 1  # the table's mark of a prefix that straddles an edge (n: the values left out)
    unbuilt = n + 2  # and of a prefix whose block is not built yet
    single = values.detach().reshape(-1)
    # the bucket of each value from its 20-bit prefix: a shift, a mask, a gather and a count (torch's int32 index
    # and int16 bincount, without NumPy's conversions of both to intp)
    prefix = single.view(torch.int32).bitwise_right_shift(_DROPPED_BITS).bitwise_and_(_PREFIX_MASK)
    bucket = table.index_select(0, prefix)
    counts = torch.bincount(bucket, minlength=unbuilt + 1).numpy()
    if counts[unbuilt]:  # values of blocks not built yet: build those, then look the prefixes up again
        missing = prefix[bucket == unbuilt].bitwise_right_shift_(_BLOCK_BITS)
        _build_blocks(table, edges, np.flatnonzero(np.bincount(missing.numpy(), minlength=1 << 9)))
        bucket = table.index_select(0, prefix)
        counts = torch.bincount(bucket, minlength=unbuilt + 1).numpy()
    flat = single.numpy().astype(np.float64)  # what add_histogram bins and sums
    if counts[straddle]:  # the few values whose prefix straddles an edge, placed by a binary search
        straddling = np.flatnonzero(bucket.numpy() == straddle)
        counts = counts[:n] + np.bincount(_buckets(flat[straddling], edges), minlength=n + 1)[:n]
    else:
        counts = counts[:n]
    if not counts.any():
        return None
    # TensorBoard's support trimming, as torch.utils.tensorboard.summary.make_histogram does it
    nonzero = np.flatnonzero(counts)
    start, end = int(nonzero[0]), int(nonzero[-1]) + 1
    kept = counts[start - 1 : end] if start > 0 else np.concatenate([[0], counts[:end]])
    lo, hi = _extremes(single, flat)
    return HistogramData(
        min=lo,
        max=hi,
        num=len(flat),
        sum=float(flat.sum()),
        sum_squares=float(flat.dot(flat)),
        bucket_limits=edges[start : end + 1].tolist(),
        bucket_counts=kept.tolist(),
    )


def _extremes(single: torch.Tensor, flat: np.ndarray) -> tuple[float, float]:
    """NumPy's ``flat.min()`` and ``flat.max()`` of the float64 copy ``flat`` of the float32 ``single``: one float32
    pass where that is the same number (a nonzero finite minimum and maximum: float32 to float64 is exact and keeps
    the order), NumPy's own reductions otherwise (which zero, which NaN, NumPy's choice)."""
    lo, hi = (float(x) for x in torch.aminmax(single))
    if lo != 0.0 and hi != 0.0 and math.isfinite(lo) and math.isfinite(hi):
        return lo, hi
    return float(flat.min()), float(flat.max())
