"""A plain Lightning run's own logged series: mapping its tags to roles, the series by role, and the points the
loss-trend rules judge when the run logged no epoch mean (:mod:`lightning_diag.report.plain` replays the rules).

Imports neither torch nor Lightning.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import math
import statistics
from collections.abc import Mapping

from lightning_diag.core.registry import default_thresholds
from lightning_diag.report.load import RunData, Series
from lightning_diag.report.tag_map import ROLES, auto_map
from lightning_diag.report.text import clean

__all__ = [
    "PLAIN_SOURCE", "WINDOW_POINTS", "PlainSeries", "loss_points", "map_plain_run", "spreads", "step_noise",
    "swing_window_points",
]

#: Logged training-loss steps averaged into one point of ``loss_swing`` / ``loss_stagnant`` when the run logged
#: no epoch mean.
WINDOW_POINTS = 8
#: :attr:`RunData.threshold_source` of a plain run.
PLAIN_SOURCE = "the library's defaults (a plain Lightning run logs no thresholds)"


def map_plain_run(run: RunData, overrides: Mapping[str, str] | None = None) -> bool:
    """Map a run's own tags to the roles (:data:`~lightning_diag.report.tag_map.ROLES`); whether it has a loss to
    judge. Then it becomes a plain run (``kind="plain"``, the library's default thresholds).

    An override naming a tag the run did not log is said in its problems (with the loss tags it did log) and
    that role is left to the automatic mapping.
    """
    mapping = auto_map(run.user)
    for role, tag in (overrides or {}).items():
        if tag in run.user:
            mapping[role] = tag
        else:
            logged = ", ".join(sorted(t for t in run.user if "loss" in t.lower())[:10]) or "none"
            run.problems.append(
                f"{run.name}: --map {role}={clean(tag)}: no such scalar in this run (its loss tags: {logged}); "
                "the automatic mapping is used"
            )
    if not {"train_loss", "train_loss_epoch", "val_loss"} & set(mapping):
        return False
    run.mapping = {role: mapping[role] for role in ROLES if role in mapping}
    run.kind = "plain"
    run.thresholds = default_thresholds()
    run.threshold_source = PLAIN_SOURCE
    return True


@dataclasses.dataclass
class PlainSeries:
    """A plain run's series by role (empty when not mapped)."""

    train: Series
    train_epoch: Series
    val: Series
    epochs: Series
    lr: Series

    @classmethod
    def of(cls, run: RunData) -> PlainSeries:
        def get(role: str) -> Series:
            tag = run.mapping.get(role)
            return run.user.get(tag, []) if tag is not None else []

        return cls(get("train_loss"), get("train_loss_epoch"), get("val_loss"), get("epoch"), get("lr"))

    def epoch_at(self, step: int) -> int:
        """The epoch logged at or before ``step`` (0 when none was)."""
        at = bisect.bisect_right(self.epochs, (step, math.inf)) - 1
        value = self.epochs[at][1] if at >= 0 else 0.0
        return int(value) if math.isfinite(value) else 0

    def lr_at(self, step: int) -> float | None:
        at = bisect.bisect_right(self.lr, (step, math.inf)) - 1
        return self.lr[at][1] if at >= 0 else None


def _windows(finite: Series, size: int) -> Series:
    """Means of consecutive windows of ``size`` points, each at its last step (a shorter rest is left out)."""
    chunks = [finite[i : i + size] for i in range(0, len(finite) - size + 1, size)]
    return [(w[-1][0], statistics.fmean(v for _, v in w)) for w in chunks]


def spreads(points: Series, losses: Series) -> list[tuple[int, float | None]]:
    """For each point, the logged step losses of its span (after the previous point, up to its step): their count
    and their noise variance (``None`` below 2): half the mean squared difference of successive losses, which a
    loss still falling within the span barely raises, as AnomalyAlarm's loss sums measure it from every step (the
    noise ``loss_swing`` judges a change against)."""
    out: list[tuple[int, float | None]] = []
    steps = [step for step, _ in losses]
    previous = -1
    for step, _ in points:
        lo, hi = bisect.bisect_right(steps, previous), bisect.bisect_right(steps, step)
        span = [v for _, v in losses[lo:hi]]
        diffs = [(b - a) ** 2 for a, b in itertools.pairwise(span)]
        out.append((len(span), 0.5 * statistics.fmean(diffs) if diffs else None))
        previous = step
    return out


def step_noise(values: list[float]) -> float:
    """The relative noise of one logged loss: a robust standard deviation (1.4826 MAD) of the relative changes
    between consecutive values, over sqrt(2) (a change holds the noise of two values); ``nan`` for fewer than 3.

    Example:
        >>> round(step_noise([1.0, 1.1, 0.9, 1.05, 0.95, 1.2, 0.85, 1.0]), 2)
        0.17
    """
    changes = [(b - a) / abs(a) for a, b in itertools.pairwise(values) if a != 0]
    if len(changes) < 2:
        return math.nan
    mid = statistics.median(changes)
    return 1.4826 * statistics.median(abs(c - mid) for c in changes) / math.sqrt(2)


def loss_points(s: PlainSeries) -> tuple[Series, str]:
    """The points ``loss_stagnant`` judges (its trend test weighs their noise), and what one point is."""
    if s.train_epoch:
        return [p for p in s.train_epoch if math.isfinite(p[1])], "epoch"
    finite = [p for p in s.train if math.isfinite(p[1])]
    return _windows(finite, WINDOW_POINTS), f"window of {WINDOW_POINTS} logged step"


def swing_window_points(s: PlainSeries, threshold: float) -> tuple[Series, str, str]:
    """The points ``loss_swing`` judges, what one point is, and a note on how they were chosen.

    Epoch means when the run logged them (what AnomalyAlarm feeds the rule). Else means of windows of logged
    steps, long enough that the noise of one logged step (a single batch's loss, :func:`step_noise`) cannot make a
    swing: the change between two window means has a standard deviation of ``sqrt(2) * noise / sqrt(n)``, which
    must stay below a third of the threshold (``n >= 18 * (noise / threshold) ** 2``, at least
    :data:`WINDOW_POINTS`).
    """
    if s.train_epoch:
        return [p for p in s.train_epoch if math.isfinite(p[1])], "epoch", ""
    finite = [p for p in s.train if math.isfinite(p[1])]
    noise = step_noise([v for _, v in finite])
    size = WINDOW_POINTS
    if math.isfinite(noise) and threshold > 0:
        size = max(size, math.ceil(18 * (noise / threshold) ** 2))
    note = (
        f"no epoch mean was logged: judged on means of {size} logged steps (one logged loss varies by "
        f"{noise:.0%} from step to step); log the loss with on_epoch=True for epoch means"
        if math.isfinite(noise)
        else ""
    )
    return _windows(finite, size), f"window of {size} logged step", note
