"""``loss_outlier``: one step's loss back at the untrained level (framework-free).

Fed by :class:`~lightning_diag.AnomalyAlarm`
(:mod:`lightning_diag.callbacks.anomaly_alarm.runtime_checks` measures).

``loss_outlier`` (warning): a training step's loss jumps back to the level of the untrained model for that step
alone: on a log scale (all losses positive; their own scale otherwise) more than ``threshold`` robust standard
deviations (1.4826 x the median absolute deviation) above the median of the (up to) ``window`` steps before it,
that bound times ``sqrt((window / 2) / n)`` while only ``n < window / 2`` steps are known; more than ``ratio``
times their median; at least the median loss of the fit's first ``window / 4`` steps (the untrained level); and
**isolated**: the losses of the steps just before and just after it are at most ``ratio`` times that median and at
most its own loss over ``ratio``. A transient corruption (a batch copied as zeros, a bad record) looks so: one
step, its neighbours normal batches. A healthy run's hard batch near convergence, a heavy-tailed regression batch
or a single sample's loss at batch size 1 rises far less on the log scale, where its spread is measured, and stays
below the untrained level; an optimisation spike (SGD's catapult at a large learning rate, Adam's loss spike on a
converged model) rises and decays over several steps, so its neighbours are elevated too. Needs ``window / 4``
steps of history; judged on logging steps over the steps since the last one, each step once its successor is
known (the last step of a chunk at the next call). Under gradient accumulation a step is its micro-batches (the
most losses fed for one global step): the neighbours are the losses just outside them. Corrupted batches on
several steps in a row are not isolated and not judged outliers (``zero_output`` sees a corrupted copy on sampled
steps).
"""

from __future__ import annotations

import bisect
import collections
import itertools
import math
from collections.abc import Sequence

from lightning_diag.core.record import Alert
from lightning_diag.core.registry import POSITIVE, Limit, RuleSpec, default, register, value_of
from lightning_diag.core.tags import loss_tag
from lightning_diag.rules.base import Latch, Rule, StepContext
from lightning_diag.rules.measures import Measure, Measures
from lightning_diag.rules.rows import Check, LoggedRun, measure

__all__ = [
    "DEFAULT_LOSS_OUTLIER_RATIO",
    "DEFAULT_LOSS_OUTLIER_THRESHOLD",
    "DEFAULT_LOSS_OUTLIER_WINDOW",
    "LOSS_OUTLIER",
    "LOSS_OUTLIER_SPEC",
    "LOSS_OUTLIER_WINDOW_KEY",
    "LossOutlierRule",
    "judge_losses",
    "loss_outlier_min_history",
    "outlier_excess",
]

_ALARM = "AnomalyAlarm"

LOSS_OUTLIER_SPEC = register(
    RuleSpec(
        "loss_outlier",
        _ALARM,
        "warning",
        8.0,
        "a training step's loss more than {threshold:g} robust standard deviations and {ratio:g}x above the median "
        "of the {window:g} steps before it, back at the untrained model's level, the steps around it normal",
        settings={"ratio": 2.0, "window": 32},
        limits={"threshold": POSITIVE, "ratio": Limit(low=1.0), "window": Limit(low=4, integer=True)},
    )
)
LOSS_OUTLIER = LOSS_OUTLIER_SPEC.rule_id
#: ``thresholds()`` key of the history ``loss_outlier`` judges against (read by the report).
LOSS_OUTLIER_WINDOW_KEY = LOSS_OUTLIER_SPEC.key("window")

#: ``loss_outlier``: robust standard deviations above the median of the window.
DEFAULT_LOSS_OUTLIER_THRESHOLD: float = default(LOSS_OUTLIER_SPEC.rule_id)
#: ``loss_outlier``: ... and this factor above that median.
DEFAULT_LOSS_OUTLIER_RATIO: float = float(LOSS_OUTLIER_SPEC.settings["ratio"])
#: ``loss_outlier``: the steps the median and MAD are taken over.
DEFAULT_LOSS_OUTLIER_WINDOW: int = int(LOSS_OUTLIER_SPEC.settings["window"])
#: Names an alert lists, at most.
_SHOWN = 4
#: ``loss_outlier``: judgments without an outlier after which a new outlier is a new event.
_OUTLIER_CLEAR_AFTER = 10


def judge_losses(
    history: Sequence[float],
    new: Sequence[float],
    threshold: float,
    ratio: float,
    window: int,
    floor: float | None = None,
    before: Sequence[float] = (),
    after: Sequence[float] = (),
    span: int = 1,
) -> list[tuple[int, float, float, float]]:
    """``(index into new, loss, excess, median)`` of every finite loss of ``new``: :func:`outlier_excess` against
    the up to ``window`` losses before it that were not outliers, with its neighbours in the finite sequence
    ``*before, *new, *after``: the losses just outside a run of ``span`` consecutive losses that holds it (the
    micro-batches of one optimizer step under gradient accumulation: ``span`` of them), the run whose larger
    outside neighbour is the smallest. A neighbour beyond the sequence is unknown, not required. Outliers
    (``excess > 1``) do not enter the reference; non-finite losses (the non-finite rules' concern) are not judged.

    Example:
        >>> hist = [0.4 + 0.05 * (i % 5) for i in range(32)]
        >>> def outliers(new, **kw):
        ...     return [(i, x) for i, x, e, _ in judge_losses(hist, new, 10.0, 2.0, 32, **kw) if e > 1]
        >>> outliers([0.45, 4.0, 0.5], floor=0.7)
        [(1, 4.0)]
        >>> outliers([0.45, 0.9, 0.5], floor=0.7), outliers([0.45, 4.0, 3.0], floor=0.7)  # a hard batch; not isolated
        ([], [])
    """
    return _judge_against(
        _window_of(history, window), new, threshold, ratio, window, floor, before, after, span
    )


def _window_of(history: Sequence[float], window: int) -> _LossWindow:
    """The window :func:`judge_losses` judges against, from the losses ``history``: its last ``window`` finite ones."""
    return _LossWindow([v for v in history if math.isfinite(v)][-window:])


def _judge_against(
    past: _LossWindow,
    new: Sequence[float],
    threshold: float,
    ratio: float,
    window: int,
    floor: float | None,
    before: Sequence[float],
    after: Sequence[float],
    span: int,
) -> list[tuple[int, float, float, float]]:
    """:func:`judge_losses` against the window ``past``, which it updates in place (the losses judged normal
    appended, trimmed to ``window``)."""
    finite = [(i, float(x)) for i, x in enumerate(new) if math.isfinite(x)]
    head = [float(v) for v in before if math.isfinite(v)]
    sequence = [*head, *(x for _, x in finite), *(float(v) for v in after if math.isfinite(v))]
    span = max(int(span), 1)
    out = []
    for k, (i, x) in enumerate(finite):
        at = len(head) + k
        if span == 1:  # one run holds the loss: its neighbours are the losses just before and after it
            neighbours = [sequence[n] for n in (at - 1, at + 1) if 0 <= n < len(sequence)]
        else:
            runs = [
                [sequence[n] for n in (start - 1, start + span) if 0 <= n < len(sequence)]
                for start in range(at - span + 1, at + 1)
            ]
            neighbours = min(runs, key=lambda nb: max(nb, default=-math.inf))
        excess, med = past.excess(x, threshold, ratio, window, floor, neighbours)
        out.append((i, x, excess, med))
        if excess > 1.0:
            continue  # an outlier does not enter the reference
        past.append(x)
        if len(past) > window:
            past.pop_oldest()
    return out


class _LossWindow:
    """The losses :func:`judge_losses` judges against, in order, kept sorted between judgments: their values, their
    logarithms and the absolute differences of successive logarithms (the three sorts of :func:`outlier_excess`,
    each updated by one insertion and one removal per loss instead of sorted again). The statistics are the same
    numbers as :func:`outlier_excess`'s (the same floats, sorted); a window with a loss at or below 0, or a loss
    ``x`` at or below 0, is judged by :func:`outlier_excess` itself (on its own scale).

    Example:
        >>> window = _LossWindow([0.1, 0.12, 0.09, 0.11, 0.1, 0.13, 0.1, 0.08])
        >>> window.excess(4.0, 10.0, 2.0, 32) == outlier_excess(window.values, 4.0, 10.0, 2.0, 32)
        True
    """

    def __init__(self, past: Sequence[float]) -> None:
        #: The losses, oldest first.
        self.values = collections.deque(past)
        #: Their logarithms (``None`` for a loss at or below 0), oldest first.
        self.log_values = collections.deque(math.log(v) if v > 0 else None for v in past)
        #: The losses, sorted.
        self.ordered = sorted(past)
        #: Losses at or below 0 in the window (none: the log scale).
        self.nonpositive = bisect.bisect_right(self.ordered, 0.0)
        #: The logarithms of the positive ones, sorted.
        self.logs = sorted(v for v in self.log_values if v is not None)
        #: ``|log b - log a|`` of each two successive positive losses ``a, b``, sorted.
        self.spreads = sorted(
            abs(b - a) for a, b in itertools.pairwise(self.log_values) if a is not None and b is not None
        )

    def __len__(self) -> int:
        return len(self.values)

    def append(self, v: float) -> None:
        """Add the newest loss."""
        log_v = math.log(v) if v > 0 else None
        last = self.log_values[-1] if self.log_values else None
        if log_v is not None and last is not None:
            bisect.insort(self.spreads, abs(log_v - last))
        self.values.append(v)
        self.log_values.append(log_v)
        bisect.insort(self.ordered, v)
        if log_v is None:
            self.nonpositive += 1
        else:
            bisect.insort(self.logs, log_v)

    def pop_oldest(self) -> None:
        """Drop the oldest loss."""
        _remove(self.ordered, self.values.popleft())
        log_v = self.log_values.popleft()
        if log_v is None:
            self.nonpositive -= 1
            return
        _remove(self.logs, log_v)
        following = self.log_values[0] if self.log_values else None
        if following is not None:
            _remove(self.spreads, abs(following - log_v))

    def excess(
        self,
        x: float,
        threshold: float,
        ratio: float,
        window: int,
        floor: float | None = None,
        neighbours: Sequence[float] = (),
    ) -> tuple[float, float]:
        """:func:`outlier_excess` of ``x`` against the window's losses."""
        n = len(self.values)
        if n < loss_outlier_min_history(window) or self.nonpositive or x <= 0:
            return outlier_excess(list(self.values), x, threshold, ratio, window, floor, neighbours)
        return _excess(
            n,
            _median(self.ordered),
            math.log(x) - _median(self.logs),
            self.spreads,
            x,
            threshold,
            ratio,
            window,
            floor,
            neighbours,
        )


def _remove(ordered: list[float], v: float) -> None:
    """Remove one value equal to ``v`` from the sorted list ``ordered``, which holds it."""
    del ordered[bisect.bisect_left(ordered, v)]


def loss_outlier_min_history(window: int) -> int:
    """The steps of history ``loss_outlier`` needs before it judges a step: ``window // 4`` (at least 2).

    Example:
        >>> loss_outlier_min_history(32)
        8
    """
    return max(int(window) // 4, 2)


def outlier_excess(
    past: Sequence[float],
    x: float,
    threshold: float,
    ratio: float,
    window: int,
    floor: float | None = None,
    neighbours: Sequence[float] = (),
) -> tuple[float, float]:
    """How far loss ``x`` is past ``loss_outlier``'s bound against the losses ``past`` before it, with their
    median: ``(excess, median)``; an excess above 1 is an outlier, ``nan`` means not judged.

    The losses are compared on a log scale when they are all positive (a loss's spread grows with its level, and
    batch losses near convergence are heavy-tailed: a few confidently wrong samples in a small batch multiply it),
    on their own scale otherwise. With ``m`` and ``s`` the median and robust deviation (1.4826 x the median absolute
    deviation) of the past on that scale, ``x`` is an outlier when ``(f(x) - m) / s`` is above ``threshold`` times
    ``sqrt(max(1, (window / 2) / n))`` (``n`` past losses, at least ``window // 4``: a shorter history is judged
    against a correspondingly stricter bound), ``x`` is above ``ratio`` times the past's median and at least
    ``floor``, and it is isolated: each of its ``neighbours`` (the losses of the steps just before and after it)
    is at most ``ratio`` times that median and at most ``x / ratio`` (with a median of 0 or below: rises above it
    at most half as much as ``x``). The excess is the smallest of the ratios to their bounds (the isolation's: the
    smaller of ``ratio x median`` and ``x / ratio`` over the larger neighbour), the statistic that decides.

    Example:
        >>> past = [0.1, 0.12, 0.09, 0.11, 0.1, 0.13, 0.1, 0.08]  # 8 steps: judged against 10 * sqrt(16 / 8)
        >>> [(round(excess, 2), med) for excess, med in (outlier_excess(past, x, 10.0, 2.0, 32) for x in (0.3, 4.0))]
        [(0.33, 0.1), (1.12, 0.1)]
        >>> round(outlier_excess(past, 4.0, 10.0, 2.0, 32, neighbours=[0.1, 0.8])[0], 2)  # the step after: 8x
        0.25
    """
    n = len(past)
    if n < loss_outlier_min_history(window):
        return math.nan, math.nan
    ordered = sorted(past)
    log_scale = ordered[0] > 0 and x > 0
    scaled = [math.log(v) for v in past] if log_scale else list(past)
    rise = (math.log(x) if log_scale else x) - _median(sorted(scaled))
    spreads = sorted(abs(b - a) for a, b in itertools.pairwise(scaled))
    return _excess(n, _median(ordered), rise, spreads, x, threshold, ratio, window, floor, neighbours)


def _excess(
    n: int,
    med: float,
    rise: float,
    spreads: Sequence[float],
    x: float,
    threshold: float,
    ratio: float,
    window: int,
    floor: float | None,
    neighbours: Sequence[float],
) -> tuple[float, float]:
    """:func:`outlier_excess` from the statistics of ``n`` past losses: their median ``med``, ``x``'s rise above
    their median on the scale compared, and the sorted absolute differences of successive past losses on it."""
    # the spread from one step to the next (a falling loss's trend is not spread): the median absolute successive
    # difference, over sqrt(2), times 1.4826 (a standard deviation for Gaussian noise)
    sigma = 1.4826 * _median(spreads) / math.sqrt(2.0)
    bound = threshold * math.sqrt(max(1.0, (window / 2) / n))
    z = rise / sigma if sigma > 0 else (math.inf if rise > 0 else 0.0)
    parts = [z / bound, x / (ratio * med) if med > 0 else (math.inf if x > 0 else 0.0)]
    if floor is not None and floor > 0:
        parts.append(x / floor)
    if neighbours:
        top = max(neighbours)
        if med > 0:  # each neighbour at most ratio x the median, and x at least ratio x each neighbour
            parts.append(min(ratio * med, x / ratio) / top if top > 0 else math.inf)
        else:
            parts.append(0.5 * (x - med) / (top - med) if top > med else math.inf)
    return min(parts), med


def _median(ordered: Sequence[float]) -> float:
    n = len(ordered)
    mid = n // 2
    return float(ordered[mid]) if n % 2 else 0.5 * (float(ordered[mid - 1]) + float(ordered[mid]))


class LossOutlierRule(Rule):
    """``loss_outlier``: per-step training losses judged against their own recent median and spread, each once the
    step after it is known (it must be isolated: see :func:`outlier_excess`).

    Example:
        >>> from lightning_diag.rules.measures import StepLosses
        >>> rule = LossOutlierRule(window=8)
        >>> def losses(values, steps):
        ...     return Measures(step_losses=StepLosses(values, steps))
        >>> rule.judge(StepContext(0, 8), losses([1.4, 0.3, 0.2, 0.21, 0.19, 0.2, 0.22, 0.18], list(range(1, 9))))
        []
        >>> [(a.rule, a.global_step) for a in rule.judge(StepContext(0, 11), losses([0.2, 2.1, 0.2], [9, 10, 11]))]
        [('loss_outlier', 10)]
        >>> rule.judge(StepContext(0, 13), losses([0.2, 2.1], [12, 13])), rule.pending  # step 13 waits for step 14
        ([], [[13.0, 2.1]])
    """

    specs = (LOSS_OUTLIER_SPEC,)
    state_keys = ("history", "initial", "outliers", "first", "pending", "before", "span")
    needs = frozenset({Measure.STEP_LOSSES})

    def __init__(
        self,
        threshold: float = DEFAULT_LOSS_OUTLIER_THRESHOLD,
        ratio: float = DEFAULT_LOSS_OUTLIER_RATIO,
        window: int = DEFAULT_LOSS_OUTLIER_WINDOW,
    ) -> None:
        super().__init__()
        self.threshold, self.ratio, self.window = threshold, ratio, max(int(window), 4)
        # Repeated corruptions are one event: it ends after 10 judgments (logging steps) without an outlier.
        self.latch = Latch(clear_after=_OUTLIER_CLEAR_AFTER)
        #: The last ``window`` finite losses judged normal.
        self.history: list[float] = []
        #: The median loss of the fit's first ``window // 4`` finite steps (the untrained model's level).
        self.initial: float | None = None
        #: The fit's first finite losses, until ``initial`` is taken from them.
        self.first: list[float] = []
        #: Outliers found so far in this fit.
        self.outliers = 0
        #: ``[global step, loss]`` of the last ``span`` finite losses fed, judged when as many after them are known.
        self.pending: list[list[float]] = []
        #: The last ``span`` losses judged (the neighbours before the pending ones).
        self.before: list[float] = []
        #: Losses a step: 1, or the micro-batches of an optimizer step under gradient accumulation.
        self.span = 1
        # the window judged against last, with the history it then held (not state: rebuilt from `history`)
        self._kept: tuple[_LossWindow, list[float]] | None = None

    def _past(self) -> _LossWindow:
        """The window of :attr:`history` to judge against: the one kept from the last judgment while it still holds
        this history (the same list, the same losses), else built from it (the first judgment, a state load or a
        resume, a history set from outside): the same window either way, without three sorts and ``window``
        logarithms a call."""
        kept = self._kept
        if kept is not None and kept[1] is self.history and list(kept[0].values) == self.history:
            return kept[0]
        return _window_of(self.history, self.window)

    def judge(self, ctx: StepContext, m: Measures) -> list[Alert]:
        """Judge the per-step losses since the last call (``steps``: their global steps); return the alerts. Each
        finite loss is judged when the ``span`` losses after it are known (one, or the micro-batches of a step
        under gradient accumulation: the most losses fed for one global step): the last ones wait for the next
        call."""
        assert m.step_losses is not None  # checked against `needs`
        losses, steps = m.step_losses.values, m.step_losses.steps
        fed = [(int(t), float(v)) for t, v in zip(steps, losses, strict=False) if math.isfinite(v)]
        if self.initial is None:
            self.first = self.first + [v for _, v in fed]
            need = loss_outlier_min_history(self.window)
            if len(self.first) >= need:
                self.initial = _median(sorted(self.first[:need]))
                self.first = []
        per_step = collections.Counter(t for t, _ in fed)
        self.span = max(self.span, *per_step.values()) if per_step else self.span
        sequence = [(int(t), float(v)) for t, v in self.pending] + fed
        cut = max(len(sequence) - self.span, 0)
        judged_now, waiting = sequence[:cut], sequence[cut:]
        values = [v for _, v in judged_now]
        past = self._past()
        judged = _judge_against(
            past,
            values,
            self.threshold,
            self.ratio,
            self.window,
            self.initial,
            self.before,
            [v for _, v in waiting],
            self.span,
        )
        for _, _, excess, _ in judged:
            self.observe(excess, 1.0)
        found = [(i, x, med) for i, x, excess, med in judged if excess > 1.0]
        bad = {i for i, _, _ in found}
        self.history = (self.history + [v for i, v in enumerate(values) if i not in bad])[-self.window :]
        self._kept = (past, self.history)  # the window now holds this history (judge_losses' own updates)
        self.before = (self.before + values)[-self.span :]
        self.pending = [[float(t), v] for t, v in waiting]
        self.outliers += len(found)
        if not self.latch.update("loss", bool(found)) or not found:
            return []
        i, x, med = found[0]
        at = [judged_now[j][0] for j, _, _ in found]
        where = ", ".join(map(str, at[:_SHOWN])) + (f" and {len(at) - _SHOWN} more" if len(at) > _SHOWN else "")
        alert = self._alert(
            StepContext(ctx.epoch, judged_now[i][0]),
            f"the training loss of step(s) {where} jumps back to the untrained model's level: {x:.4g} against a "
            f"median of {med:.4g} over the steps before (more than {self.threshold:g} robust standard deviations "
            f"and {self.ratio:g}x above), while the steps just before and after it are normal. Single steps like "
            "this point to a corrupted batch or transfer (inputs copied as zeros, a broken shard or record) rather "
            "than to optimisation: check the data of that step",
            source="loss",
            value=x,
            threshold=self.threshold,
        )
        return [alert]


# -- the report's loss_outlier row (an "Other" row: the rule has no check) -------------------------------------


@measure(LOSS_OUTLIER)
def _loss_outlier_measured(run: LoggedRun, check: Check) -> bool:
    """``loss_outlier`` judges a step only after ``window / 4`` steps of history."""
    if LOSS_OUTLIER not in run.thresholds:
        return False
    need = loss_outlier_min_history(int(value_of(run.thresholds, LOSS_OUTLIER_WINDOW_KEY)))
    steps = [step for step, _ in run.scalars.get(loss_tag("train_step"), [])]
    if steps and max(steps) >= need:
        return True
    logged = f"the training loss was logged to step {max(steps)}" if steps else "no training loss was logged"
    check.add_note(f"{logged}; the check needs {need} steps of history before it judges a step")
    return False
