"""Trend measures on short scalar series (per-epoch losses, validation values). Pure numpy/scipy.

The definitions here are the ones documented in ``docs/anomaly_alarm.md``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import numpy as np

__all__ = [
    "fluctuation",
    "mann_kendall",
    "mann_kendall_min_points",
    "mann_kendall_z_p",
    "relative_change",
    "theil_sen_slope",
]


def relative_change(previous: float, current: float) -> float:
    """``(current - previous) / |previous|``; ``nan`` when either is non-finite or ``previous`` is 0.

    Example:
        >>> relative_change(1.0, 1.2)
        0.19999999999999996
        >>> relative_change(2.0, 1.0)
        -0.5
    """
    if not (math.isfinite(previous) and math.isfinite(current)) or previous == 0:
        return math.nan
    return (current - previous) / abs(previous)


def fluctuation(series: Sequence[float]) -> float:
    """Relative fluctuation of a series around its smooth trend.

    For a positive series (losses) the trend is fitted to ``log(series)``, so an exponential decay, the usual
    shape of a healthy loss, is all trend; otherwise to the series itself. The fit is a least-squares line for
    3 or 4 points and a parabola from 5 on, so a smooth bend is trend too. The fluctuation is the
    root-mean-square of the residuals: in log units (about the relative deviation) for a positive series,
    divided by the mean absolute level otherwise. A smooth series has fluctuation near 0 whatever its slope;
    one that zig-zags has a large one.

    Returns ``nan`` for fewer than 3 points, non-finite values or a zero mean level.

    Example:
        >>> round(fluctuation([5.0, 4.0, 3.0, 2.0]), 2)
        0.05
        >>> round(fluctuation([1.0, 0.5, 0.25, 0.125, 0.0625]), 6)
        0.0
        >>> fluctuation([1.0, 2.0, 1.0, 2.0, 1.0]) > 0.2
        True
    """
    y = np.asarray(series, dtype=np.float64)
    if y.size < 3 or not np.all(np.isfinite(y)):
        return math.nan
    level = float(np.mean(np.abs(y)))
    if level == 0.0:
        return math.nan
    if np.all(y == y[0]):
        return 0.0
    positive = bool(np.all(y > 0))
    target = np.log(y) if positive else y
    x = np.arange(y.size, dtype=np.float64)
    coefficients = np.polyfit(x, target, 1 if y.size < 5 else 2)
    rms = float(np.sqrt(np.mean((target - np.polyval(coefficients, x)) ** 2)))
    return rms if positive else rms / level


def mann_kendall(series: Sequence[float]) -> tuple[float, float]:
    """Mann-Kendall trend test of a series against its order: ``(z, p)``.

    ``S`` is the sum of ``sign(y[j] - y[i])`` over all pairs ``i < j``; under "no trend" (independent values
    from one distribution) its variance is ``n(n-1)(2n+5)/18`` less the ties' share. ``z`` is ``S`` with a
    continuity correction over its standard deviation (negative for a falling series) and ``p`` the two-sided
    normal p-value. A trend test on ranks: it asks whether the series moves one way against its own noise,
    whatever its scale or floor. Non-finite values are dropped; fewer than 3 values give ``(0.0, 1.0)``.

    Example:
        >>> z, p = mann_kendall([5.0, 4.0, 3.0, 2.0, 1.0, 0.5])
        >>> round(z, 2), p < 0.05
        (-2.63, True)
        >>> mann_kendall([1.0, 1.0, 1.0])
        (0.0, 1.0)
    """
    y = np.asarray([v for v in series if math.isfinite(v)], dtype=np.float64)
    n = y.size
    if n < 3:
        return 0.0, 1.0
    s = float(np.sign(y[None, :] - y[:, None])[np.triu_indices(n, 1)].sum())
    _, counts = np.unique(y, return_counts=True)
    return mann_kendall_z_p(s, n, float(np.sum(counts * (counts - 1) * (2 * counts + 5))))


def mann_kendall_z_p(s: float, n: int, ties: float) -> tuple[float, float]:
    """:func:`mann_kendall`'s ``(z, p)`` from its statistic ``s`` over ``n`` (at least 3) finite values, ``ties``
    being the sum of ``c (c - 1) (2c + 5)`` over the counts ``c`` of equal values (for a caller that keeps ``s``
    and the counts as a series grows).

    Example:
        >>> mann_kendall_z_p(-15.0, 6, 0.0) == mann_kendall([5.0, 4.0, 3.0, 2.0, 1.0, 0.5])
        True
    """
    var = (n * (n - 1) * (2 * n + 5) - ties) / 18.0
    if var <= 0.0 or s == 0.0:
        return 0.0, 1.0
    z = (s - math.copysign(1.0, s)) / math.sqrt(var)
    return z, math.erfc(abs(z) / math.sqrt(2.0))


def theil_sen_slope(series: Sequence[float]) -> float:
    """Median of the pairwise slopes ``(y[j] - y[i]) / (j - i)``: the series' trend per point, robust to outliers.

    ``nan`` for fewer than 2 finite values (non-finite values are dropped, the others keep their positions).

    Example:
        >>> theil_sen_slope([3.0, 2.0, 1.0, 100.0, -1.0])
        -1.0
    """
    x = np.asarray([i for i, v in enumerate(series) if math.isfinite(v)], dtype=np.float64)
    y = np.asarray([v for v in series if math.isfinite(v)], dtype=np.float64)
    if y.size < 2:
        return math.nan
    i, j = np.triu_indices(y.size, 1)
    return float(np.median((y[j] - y[i]) / (x[j] - x[i])))


@functools.lru_cache(maxsize=16)
def mann_kendall_min_points(alpha: float) -> int:
    """The fewest points with which :func:`mann_kendall` can find a trend at significance ``alpha`` (a strictly
    monotone series): with fewer, "no trend found" is no evidence of a flat series. Kept per ``alpha`` (a pure
    function of it; ``loss_stagnant`` asks at every epoch's end).

    Example:
        >>> mann_kendall_min_points(0.05), mann_kendall_min_points(0.01)
        (5, 6)
    """
    n = 3
    while n < 64 and mann_kendall([float(i) for i in range(n)])[1] >= alpha:
        n += 1
    return n
