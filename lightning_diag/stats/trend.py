"""Trend measures on short scalar series (per-epoch losses, validation values). Pure numpy/scipy.

The definitions here are the ones documented in ``docs/anomaly_alarm.md``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from scipy import stats as _sstats

__all__ = ["fluctuation", "relative_change"]


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
    """Relative fluctuation of a series around its linear trend.

    The series is fitted with a least-squares line (``scipy.stats.linregress``); the fluctuation is the
    standard deviation of the residuals divided by the mean absolute level of the series. A series that
    falls or rises steadily has fluctuation near 0 whatever its slope; one that zig-zags has a large one.

    Returns ``nan`` for fewer than 3 points, non-finite values or a zero mean level.

    Example:
        >>> round(fluctuation([5.0, 4.0, 3.0, 2.0]), 6)
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
    x = np.arange(y.size, dtype=np.float64)
    fit = _sstats.linregress(x, y)
    residuals = y - (fit.intercept + fit.slope * x)
    return float(np.std(residuals, ddof=2) / level) if y.size > 2 else math.nan
