"""``val_fluctuation`` (framework-free): the validation loss fluctuates more than the training loss, fed by
:class:`~lightning_diag.AnomalyAlarm`.

Exact definition (also in ``docs/anomaly_alarm.md``):

Over the last ``window`` validation runs, the fluctuation of a series is the RMS of its
residuals around a least-squares line or parabola fitted to its logarithm
(:func:`~lightning_diag.stats.fluctuation`). A window is judged at the run after it. Fires when the validation
fluctuation exceeds ``ratio`` times the training-loss fluctuation (the larger of the training periods' before
and after the window's runs), is itself above ``min_fluctuation`` and the range of the
validation window (loss units) is above ``min_range``, **and** the validation value's rises over the window (the
sum of its increases from one run to the next) are above ``min_rise`` of its *scale*, the first validation value
of the fit (the loss at the start of training), **and** it rises at least twice (once for a window of 3): a rise
counts when it is at least a quarter of the window's largest rise (the validation fluctuation: the part its runs'
standard errors do not explain, :func:`noise_fluctuation`). Relative fluctuations blow up near zero: a
converged fine-tune whose validation loss wanders 0.097 -> 0.167 -> 0.024 reads 50% in log units against 7% for
its training loss, yet it rises once, by 0.07, 7% of its initial 0.96 (a bump, not a fluctuation); a validation
loss that zig-zags by 40% of its level rises twice, by 150% of it.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Mapping
from typing import ClassVar, cast

from lightning_diag.core.record import Alert
from lightning_diag.core.registry import POSITIVE, STEPS, CheckSpec, Limit, RuleSpec, default, register
from lightning_diag.core.tags import LossSeries, loss_tag
from lightning_diag.rules.base import Latch, Rule, StepContext, excess
from lightning_diag.rules.measures import Measure, Measures
from lightning_diag.rules.rows import Check, LoggedRun, fmt, measure, run_threshold
from lightning_diag.stats.trend import fluctuation

__all__ = [
    "DEFAULT_VAL_FLUCTUATION_MIN",
    "DEFAULT_VAL_FLUCTUATION_MIN_RANGE",
    "DEFAULT_VAL_FLUCTUATION_MIN_RISE",
    "DEFAULT_VAL_FLUCTUATION_MIN_STEPS",
    "DEFAULT_VAL_FLUCTUATION_THRESHOLD",
    "DEFAULT_VAL_FLUCTUATION_WINDOW",
    "VAL_FLUCTUATION",
    "VAL_FLUCTUATION_CHECK",
    "VAL_FLUCTUATION_SPEC",
    "VAL_FLUCTUATION_WINDOW_KEY",
    "ValFluctuationRule",
    "noise_fluctuation",
    "repeated_rises",
]

_ALARM = "AnomalyAlarm"
VAL_FLUCTUATION_SPEC = register(RuleSpec(
    "val_fluctuation", _ALARM, "warning", 2.0,
    "validation-loss fluctuation above {threshold:g}x the training-loss fluctuation",
    settings={"window": 5, "min": 0.15, "min_range": 0.01, "min_rise": 0.1, "min_steps": 20}, check="val_fluctuation",
    source="seed 000 §4.1",
    limits={"threshold": POSITIVE, "window": Limit(low=3, integer=True), "min_steps": STEPS},
))
VAL_FLUCTUATION = VAL_FLUCTUATION_SPEC.rule_id
#: Its row of the ``lightning-diag report`` checklist (registered in report order by
#: :mod:`lightning_diag.rules.catalog`).
VAL_FLUCTUATION_CHECK = CheckSpec(
    VAL_FLUCTUATION, "Training", "Validation fluctuation at most {val_fluctuation:g}x the training fluctuation"
)
#: ``thresholds()`` key the report reads back from a run.
VAL_FLUCTUATION_WINDOW_KEY = VAL_FLUCTUATION_SPEC.key("window")

#: ``val_fluctuation``: validation fluctuation above this multiple of the training one (seed 000 §4.1: 2x).
DEFAULT_VAL_FLUCTUATION_THRESHOLD = default(VAL_FLUCTUATION)
#: ``val_fluctuation``: validation runs in the window.
DEFAULT_VAL_FLUCTUATION_WINDOW = int(default(VAL_FLUCTUATION_WINDOW_KEY))
#: ``val_fluctuation``: validation fluctuation (relative to its level) below which the rule never fires.
DEFAULT_VAL_FLUCTUATION_MIN = default(VAL_FLUCTUATION_SPEC.key("min"))
#: ``val_fluctuation``: range (max - min, loss units) of the validation window below which it never fires.
DEFAULT_VAL_FLUCTUATION_MIN_RANGE = default(VAL_FLUCTUATION_SPEC.key("min_range"))
#: ``val_fluctuation``: the window's rises, as a fraction of the first validation value, below which it never fires.
DEFAULT_VAL_FLUCTUATION_MIN_RISE = default(VAL_FLUCTUATION_SPEC.key("min_rise"))
#: ``val_fluctuation``: optimizer steps the window must span.
DEFAULT_VAL_FLUCTUATION_MIN_STEPS = int(default(VAL_FLUCTUATION_SPEC.key("min_steps")))
#: ``val_fluctuation``: validation runs kept, at most (the window, and earlier runs its ``min_steps`` needs).
_VAL_RUNS_KEPT = 64


def repeated_rises(steps_up: list[float]) -> int:
    """How many of a window's rises count for ``val_fluctuation``: those at least a quarter of its largest rise.

    Example:
        >>> repeated_rises([0.5, 0.6]), repeated_rises([0.07]), repeated_rises([0.6, 0.01]), repeated_rises([])
        (2, 1, 1, 0)
    """
    if not steps_up:
        return 0
    largest = max(steps_up)
    return sum(1 for rise in steps_up if rise >= 0.25 * largest)


def noise_fluctuation(values: list[float], ses: list[float]) -> float:
    """The fluctuation (:func:`~lightning_diag.stats.trend.fluctuation`) that independent sampling errors alone
    leave in ``values`` around their fit: ``sqrt(mean((se / value)^2) (n - p) / n)`` in log units for positive
    values (``mean(se^2) (n - p) / n`` over the mean absolute level otherwise), ``p`` the fit's coefficients (2
    below 5 values, 3 from 5 on). ``nan`` when a standard error is unknown.

    Example:
        >>> round(noise_fluctuation([1.0, 1.0, 1.0, 1.0, 1.0], [0.1] * 5), 4)
        0.0632
    """
    n = len(values)
    if n < 3 or len(ses) != n or not all(math.isfinite(e) for e in ses):
        return math.nan
    kept = (n - (2 if n < 5 else 3)) / n
    if all(v > 0 for v in values):
        return math.sqrt(sum((e / v) ** 2 for e, v in zip(ses, values, strict=True)) / n * kept)
    level = sum(abs(v) for v in values) / n
    return math.sqrt(sum(e * e for e in ses) / n * kept) / level if level > 0 else math.nan


class ValFluctuationRule(Rule):
    """``val_fluctuation``: validation-loss fluctuation above ``ratio`` times the training-loss fluctuation.

    Args:
        ratio: Multiple of the training fluctuation the validation fluctuation must exceed.
        window: Validation runs in the window (at least 3).
        min_fluctuation: Validation fluctuation (relative to its level) below which the rule never fires.
        min_range: Range (max - min) of the validation window below which the rule never fires.
        monitor: Name of the validation metric, for messages and the alert's ``source``.
        min_rise: The window's rises (sum of increases between consecutive runs), as a fraction of the first
            validation value, below which the rule never fires.
        min_steps: Optimizer steps the window must span (``val_fluctuation.min_steps``).

    The validation fluctuation judged is the part the validation set's own sampling noise does not explain: with
    ``se`` (each run's standard error, :meth:`update`) known, the residual mean square of the fit, in log units,
    less what independent errors of relative size ``se / value`` leave in it (their mean square over the window
    times ``(n - p) / n`` for ``n`` runs and a fit of ``p`` coefficients), floored at 0, under the square root
    (:func:`noise_fluctuation`). A validation set of two batches wanders by its standard error from run to run: that
    is the set's noise, not a model that fluctuates.

    Example:
        >>> from lightning_diag.rules.measures import Validation
        >>> rule = ValFluctuationRule()
        >>> train = [1.29, 0.52, 0.19, 0.10, 0.079, 0.041]  # a converged fine-tune (corpus BERT at lr 2e-3)
        >>> val = [0.964, 0.237, 0.097, 0.167, 0.024, 0.025]
        >>> ms = [Measures(validation=Validation(v, train=t)) for t, v in zip(train, val)]
        >>> [len(rule.judge(StepContext(i, 10 * i), m)) for i, m in enumerate(ms)]
        [0, 0, 0, 0, 0, 0]
        >>> round(rule.last_rise, 3)
        0.073
    """

    needs = frozenset({Measure.VALIDATION})
    specs = (VAL_FLUCTUATION_SPEC,)
    setting_keys: ClassVar[Mapping[str, str]] = {
        "ratio": VAL_FLUCTUATION, "min_fluctuation": VAL_FLUCTUATION_SPEC.key("min")
    }
    state_keys = ("train", "val", "last_ratio", "scale", "steps", "ses")

    def __init__(
        self,
        ratio: float = DEFAULT_VAL_FLUCTUATION_THRESHOLD,
        window: int = DEFAULT_VAL_FLUCTUATION_WINDOW,
        min_fluctuation: float = DEFAULT_VAL_FLUCTUATION_MIN,
        monitor: str = "val_loss",
        min_range: float = DEFAULT_VAL_FLUCTUATION_MIN_RANGE,
        min_rise: float = DEFAULT_VAL_FLUCTUATION_MIN_RISE,
        min_steps: int = DEFAULT_VAL_FLUCTUATION_MIN_STEPS,
    ) -> None:
        super().__init__()
        self.latch = Latch(clear_after=2)  # one calm validation run between two fluctuating ones: one event
        self.min_range = min_range
        self.min_rise = min_rise
        self.scale: float | None = None
        self.last_rise = math.nan
        self.last_rises = 0
        self.ratio = ratio
        self.window = window
        self.min_fluctuation = min_fluctuation
        self.monitor = monitor
        self.train: list[float] = []
        self.val: list[float] = []
        #: The global step of each run of ``train`` / ``val`` (the runs kept: the window and those before it that
        #: ``min_steps`` needs).
        self.steps: list[int] = []
        #: The standard error of each run of ``val`` (``nan``: unknown).
        self.ses: list[float] = []
        #: The validation fluctuation the window's standard errors explain (``nan``: unknown, judged as 0).
        self.last_noise = math.nan
        #: Optimizer steps the window must span (``val_fluctuation.min_steps``): with short epochs the window
        #: takes in earlier runs until it does.
        self.min_steps = min_steps
        self.last_ratio = math.nan

    def window_runs(self) -> int:
        """Runs in the judged window, which ends at the run before the newest (whose following training period is
        only now known): the last ``window`` of them, and earlier ones until it spans ``min_steps`` steps."""
        judged = len(self.val) - 1
        count = min(self.window, max(judged, 0))
        while count < judged and self.steps[-2] - self.steps[-1 - count] < self.min_steps:
            count += 1
        return count

    def measures(self) -> tuple[float, float]:
        """``(train_fluctuation, val_fluctuation)`` over the judged window (``nan`` until it is full: ``window``
        runs spanning ``min_steps`` steps, and the run after them).

        The training fluctuation is the larger of the training loss's over the periods that end at the window's
        validation runs and over those that start at them: a validation run is a snapshot of the model between
        the two, and with short epochs the model moves a lot within one (a training spike the validation follows
        shows in the period after it)."""
        count = self.window_runs()
        if count < self.window or self.steps[-2] - self.steps[-1 - count] < self.min_steps:
            return math.nan, math.nan
        before, after = self.train[-1 - count : -1], self.train[-count:]
        finite = [f for f in (fluctuation(before), fluctuation(after)) if math.isfinite(f)]
        return max(finite) if finite else math.nan, fluctuation(self.val[-1 - count : -1])

    def judge(self, ctx: StepContext, m: Measures) -> list[Alert]:
        """Judge the mean training loss since the last validation run and the validation value (with its standard
        error when known: ``noise_se``, else ``se``, the spread of its batches' values)."""
        assert m.validation is not None  # checked against `needs`
        v = m.validation
        train_loss = math.nan if v.train is None else v.train
        val_loss, se = v.value, v.se if v.noise_se is None else v.noise_se
        if not (math.isfinite(train_loss) and math.isfinite(val_loss)):
            return []
        if self.scale is None:
            self.scale = abs(float(val_loss))  # the validation loss at the start of training
        keep = max(self.window, _VAL_RUNS_KEPT) + 1  # the judged window, and the run after it
        self.train = list(deque([*self.train, train_loss], maxlen=keep))
        self.val = list(deque([*self.val, val_loss], maxlen=keep))
        self.steps = list(deque([*self.steps, ctx.global_step], maxlen=keep))
        error = float(se) if se is not None and math.isfinite(se) and se >= 0 else math.nan
        self.ses = list(deque([*self.ses, error], maxlen=keep))
        train_f, raw_f = self.measures()
        if not (math.isfinite(train_f) and math.isfinite(raw_f)):
            return []
        count = self.window_runs()
        window = self.val[-1 - count : -1]
        self.last_noise = noise_fluctuation(window, self.ses[-1 - count : -1])
        noise = self.last_noise if math.isfinite(self.last_noise) else 0.0
        val_f = math.sqrt(max(raw_f * raw_f - noise * noise, 0.0))  # the part the validation set's noise leaves
        self.last_ratio = val_f / train_f if train_f > 0 else math.inf
        val_abs = max(window) - min(window)
        steps_up = [b - a for a, b in itertools.pairwise(window) if b > a]
        self.last_rise = sum(steps_up) / self.scale if self.scale > 0 else math.inf
        self.last_rises = repeated_rises(steps_up)
        rises_needed = min(2, len(window) // 2)
        # the other conditions; the margin is the ratio's excess where they hold (0 where one does not)
        gates = (
            val_f > self.min_fluctuation
            and val_abs > self.min_range
            and self.last_rise > self.min_rise
            and self.last_rises >= rises_needed
        )
        self.observe(excess(self.last_ratio, self.ratio) if gates else 0.0, 1.0)
        active = gates and val_f > self.ratio * train_f
        if not self.latch.update(self.monitor, active, excess(self.last_ratio, self.ratio)):
            return []
        return [
            self._alert(
                ctx,
                f"`{self.monitor}` fluctuates {val_f:.1%} around its trend over the last {len(window)} "
                f"validation runs, more than {self.ratio:g}x the training loss ({train_f:.1%}), rising by "
                f"{self.last_rise:.0%} of its initial {self.scale:.4g} over the window: the validation set may be "
                "too small or unrepresentative, or the model unstable",
                source=self.monitor,
                value=self.last_ratio if math.isfinite(self.last_ratio) else val_f,
                threshold=self.ratio,
            )
        ]


# -- the report's val_fluctuation row (it compares the two fluctuations the alarm logged; nothing is replayed) ---


@measure(VAL_FLUCTUATION)
def _measure_val_fluctuation(run: LoggedRun, check: Check) -> bool:
    ratio = run_threshold(run, VAL_FLUCTUATION)
    check.threshold = f"val / train fluctuation <= {fmt(ratio)}" if ratio is not None else "not logged"
    check.threshold_value = {"value": ratio} if ratio is not None else {}
    train = dict(run.scalars.get(loss_tag("train_fluctuation"), []))
    ratios = [
        v / train[s]
        for s, v in run.scalars.get(loss_tag(cast(LossSeries, VAL_FLUCTUATION)), [])
        if s in train and train[s] > 0 and math.isfinite(v / train[s])
    ]
    if ratios:
        check.measured = f"val / train fluctuation up to {fmt(max(ratios))}"
        check.measured_value = {"max": max(ratios)}
    elif run.scalars.get(loss_tag("val")):
        window = run_threshold(run, VAL_FLUCTUATION_WINDOW_KEY)
        check.add_note(f"needs {int(window) if window else 'more'} validation runs")
    return bool(ratios)
