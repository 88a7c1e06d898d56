"""Trend measures on short scalar series (per-epoch losses, validation values). Pure numpy/scipy.

The definitions here are the ones documented in ``docs/anomaly_alarm.md``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

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
