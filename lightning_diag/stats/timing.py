"""Pure maths on step-time and memory series: block-to-block fluctuation, periodic slow steps, monotone growth.

Everything here takes plain sequences of floats (seconds, bytes, percent) and returns floats; nothing imports
Lightning or torch, so the functions are tested against brute force on synthetic series.

Example:
    >>> times = [0.1] * 60
    >>> for i in range(9, 60, 10):
    ...     times[i] = 0.5
    >>> period = detect_period(times)
    >>> period.period, period.occurrences
    (10, 6)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

#: A series of floats: a sequence or a 1-D array.
Series = Sequence[float] | np.ndarray

__all__ = ["Periodicity", "block_fluctuation", "detect_period", "growth", "slow_mask"]


def block_fluctuation(values: Series, block: int, z: float = 0.0) -> float:
    """How much the medians of consecutive blocks of ``block`` values change from one block to the next, beyond
    what the noise inside the blocks explains: the median over neighbouring blocks of
    ``max(0, |m[k+1] - m[k]| - z * se)``, over ``sqrt(2)`` times the median of the block medians ``m`` (a partial
    last block is dropped; ``nan`` with fewer than 3 blocks).

    ``se`` is the standard error of the difference of the two medians, ``sqrt(se[k]^2 + se[k+1]^2)``, where a
    block's ``se[k] = 1.2533 * 1.4826 * MAD[k] / sqrt(block)`` is the standard error of a median of ``block``
    values with that median absolute deviation (normal errors). On a machine whose step times jitter from step to
    step, two blocks of 10 steps differ by chance: with a spread of 15% inside the blocks their medians differ by
    about 8% of the level, half the seed's 15% threshold. Only the part of a change above ``z`` standard errors
    counts; with ``z=0`` the raw change counts.

    A block median ignores the jitter of single steps (a preempted step, a batch of a longer sequence) and
    follows sustained changes of the step time. Judging the change between *neighbouring* blocks (the median
    successive difference, as von Neumann's successive-difference estimator of a spread) measures how the step
    time goes up and down, which is what a fluctuation is: a level that moves once (a batch-size ramp, layers
    unfrozen, another job starting on the machine) or drifts slowly changes few neighbouring pairs, and leaves
    it where the noise puts it. ``sqrt(2)`` puts independent block-to-block noise on the scale of the relative
    median absolute deviation (the difference of two independent values spreads ``sqrt(2)`` times more than one).

    Example:
        >>> block_fluctuation([1.0, 9.0] * 15, block=10)  # one slow step in two is steady
        0.0
        >>> block_fluctuation([1.0] * 30 + [2.0] * 30, block=10)  # one level shift: no fluctuation
        0.0
        >>> round(block_fluctuation([1.0] * 10 + [2.0] * 10 + [1.0] * 10 + [2.0] * 10, block=10), 3)  # up, down, up
        0.471
        >>> jitter = [1.0, 1.3, 0.8, 1.1, 0.9, 1.2, 0.7, 1.0, 1.1, 0.9]  # steps spread by 15% around 1.0
        >>> blocks = (jitter + [t + 0.05 for t in jitter]) * 2  # block medians 1.0, 1.05, 1.0, 1.05
        >>> round(block_fluctuation(blocks, block=10), 3), block_fluctuation(blocks, block=10, z=2.0)
        (0.034, 0.0)
    """
    x = np.asarray(values, dtype=float)
    blocks = x.size // block
    if blocks < 3:
        return float("nan")
    grid = x[: blocks * block].reshape(blocks, block)
    medians = np.median(grid, axis=1)
    level = float(np.median(medians))
    if not (level > 0 and np.all(np.isfinite(medians))):
        return float("nan")
    change = np.abs(np.diff(medians))
    if z > 0:
        spread = 1.4826 * np.median(np.abs(grid - medians[:, None]), axis=1)
        se = 1.2533 * spread / np.sqrt(block)
        change = np.maximum(0.0, change - z * np.sqrt(se[1:] ** 2 + se[:-1] ** 2))
    return float(np.median(change) / (np.sqrt(2.0) * level))


def slow_mask(values: Series, slow_ratio: float, mad_factor: float = 5.0) -> np.ndarray:
    """Boolean mask of the slow values: above the median by more than ``slow_ratio`` times the median **and**
    more than ``mad_factor`` median absolute deviations (so the jitter of a noisy machine is not "slow")."""
    x = np.asarray(values, dtype=float)
    if x.size == 0:
        return np.zeros(0, dtype=bool)
    med = float(np.median(x))
    mad = float(np.median(np.abs(x - med)))
    return x > med + max(slow_ratio * med, mad_factor * mad)


@dataclasses.dataclass(frozen=True)
class Periodicity:
    """A periodic pattern of slow steps.

    Attributes:
        period: Steps between two slow steps (0 when none was found).
        phase: Index (in the series) of the first slow step of the pattern.
        occurrences: Slow steps on the pattern.
        coverage: Fraction of the pattern's positions that are slow.
        precision: Fraction of all slow steps that are on the pattern.
        share: Time the pattern's steps take above the median, as a fraction of the series' total time.
        autocorrelation: Autocorrelation of the slow-step indicator at ``period`` (overlap-normalised).
    """

    period: int
    phase: int = 0
    occurrences: int = 0
    coverage: float = 0.0
    precision: float = 0.0
    share: float = 0.0
    autocorrelation: float = 0.0

    @property
    def found(self) -> bool:
        """Whether a period was found."""
        return self.period > 0


_NONE = Periodicity(0)


def detect_period(
    values: Series,
    slow_ratio: float = 0.5,
    min_period: int = 2,
    min_occurrences: int = 4,
    min_coverage: float = 0.75,
    min_precision: float = 0.5,
    mask: Sequence[bool] | np.ndarray | None = None,
) -> Periodicity:
    """Find slow steps that recur with a fixed period.

    A step is slow above ``(1 + slow_ratio)`` times the median. The autocorrelation of the slow-step indicator
    (``scipy.signal.correlate``, normalised by the overlap at each lag) proposes the period: the smallest lag
    whose autocorrelation is within 10% of the largest (so multiples of the period lose to the period itself).
    The proposal is then verified on its best phase: at least ``min_occurrences`` slow steps on the pattern,
    ``min_coverage`` of the pattern's positions slow and ``min_precision`` of all slow steps on the pattern.
    Random slow steps (a shared machine) fail the verification; a stall every 10th step passes it.

    Args:
        values: Step times (or any series where "slow" means "large"), oldest first.
        slow_ratio: Relative excess over the median that makes a value slow.
        min_period: Smallest period considered.
        min_occurrences: Slow steps the pattern needs.
        min_coverage: Fraction of the pattern's positions that must be slow.
        min_precision: Fraction of the slow steps that must be on the pattern.
        mask: Which values are "slow", instead of the ``slow_ratio`` test (e.g. dips of GPU utilisation).

    Returns:
        The pattern; ``period == 0`` when there is none.
    """
    x = np.asarray(values, dtype=float)
    n = x.size
    if n < min_period * min_occurrences or not np.all(np.isfinite(x)):
        return _NONE
    slow = slow_mask(x, slow_ratio) if mask is None else np.asarray(mask, dtype=bool)
    count = int(slow.sum())
    if count < min_occurrences or count > n // 2:
        return _NONE
    ind = slow.astype(float) - slow.mean()
    from scipy import signal  # here, not at import: the report loads this module's rules without scipy's cost

    acf = signal.correlate(ind, ind, mode="full", method="auto")[n - 1 :]
    overlap = np.arange(n, 0, -1, dtype=float)
    acf = acf / overlap
    if acf[0] <= 0:
        return _NONE
    acf = acf / acf[0]
    max_period = n // min_occurrences
    if max_period < min_period:
        return _NONE
    lags = np.arange(min_period, max_period + 1)
    scores = acf[lags]
    best = float(scores.max())
    if best <= 0:
        return _NONE
    period = int(lags[np.argmax(scores >= 0.9 * best)])
    hits_by_phase = [int(slow[phase::period].sum()) for phase in range(period)]
    phase = int(np.argmax(hits_by_phase))
    hits = hits_by_phase[phase]
    positions = len(range(phase, n, period))
    coverage = hits / positions
    precision = hits / count
    if hits < min_occurrences or coverage < min_coverage or precision < min_precision:
        return _NONE
    med = float(np.median(x))
    on_pattern = x[phase::period]
    excess = float(np.clip(on_pattern - med, 0.0, None)[slow[phase::period]].sum())
    total = float(x.sum())
    share = excess / total if total > 0 else 0.0
    first = phase + period * int(np.argmax(slow[phase::period]))
    return Periodicity(
        period=period,
        phase=first,
        occurrences=hits,
        coverage=coverage,
        precision=precision,
        share=share,
        autocorrelation=float(acf[period]),
    )


def growth(values: Series) -> tuple[float, float]:
    """How steadily a series grows: ``(relative_growth, rising_fraction)``.

    ``relative_growth`` is the Theil–Sen slope times the series length over its first value (how much it grew
    over the window, as a fraction of where it started); ``rising_fraction`` is the fraction of consecutive
    differences that are positive. A leak grows steadily (both high); a cache that fills once and stays
    does not keep rising.
    """
    x = np.asarray(values, dtype=float)
    x = x[np.isfinite(x)]
    if x.size < 3 or x[0] <= 0:
        return 0.0, 0.0
    from scipy.stats import theilslopes

    slope = float(theilslopes(x)[0])
    rel = slope * (x.size - 1) / float(x[0])
    rising = float(np.mean(np.diff(x) > 0))
    return rel, rising
