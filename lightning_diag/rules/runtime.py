"""Silent errors of the run's set-up, judged on what the model did (framework-free).

Fed by :class:`~lightning_diag.AnomalyAlarm` (:mod:`lightning_diag.callbacks.anomaly_alarm.runtime_checks` measures):

* ``train_override_bypassed`` (warning): a module overrides ``train()`` and what the override does (modules it puts
  in eval mode, parameters it freezes) is not in effect during training: Lightning never calls ``train()``
  during ``fit`` (it sets the ``training`` flags directly when validation ends), so the override's effect never
  happens. Judged once, at the first training batch of a fit.
* ``eval_randomness`` (warning): a dropout was applied with ``training=True`` (``F.dropout(x, training=True)``, a
  Dropout module left in training mode) during validation: evaluation is random and the validation metric noisy.
  Judged on the first batch of every validation run.
* ``amp_not_applied`` (warning): ``precision="16-mixed"`` or ``"bf16-mixed"`` is configured, but more than
  ``share`` of the matmul layers' parameters (``nn.Linear``, ``nn.Conv*``) computed in float32 on a sampled
  training step: the forward escapes autocast (an ``autocast(enabled=False)`` block, inputs cast after it), so
  the run pays for float32. Judged once per fit, on its first training batch.
* ``loss_outlier`` (warning): a training step's loss jumps back to the level of the untrained model for that step
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
* ``zero_output`` (warning): a module's output is all zeros on a sampled training step while it was non-zero on
  each of its (at least ``threshold``) measurements before and never zero: a copy between devices or ranks that
  arrived as zeros (a faulty link, a failed transfer). Transitions are judged, not the state: a module whose output
  was ever zero before (a ReLU dead from the start, a zero-initialised adapter) never fires, and each module fires
  once per fit. Only modules whose output took negative values on an earlier measurement are judged: a rectifier
  (or a block ending in one) returns all zeros whenever no unit responds to the input, which one sample (batch size
  1) or a layer whose units died does legitimately (``dead_units``' concern, not a corrupted copy); an exact zero
  from a module whose outputs had both signs is implausible at any batch size.
* ``eval_before_training`` (warning; ``info`` in the sanity check): a validation runs before the first training
  forward of a component whose state only training updates (an ``nn.utils.spectral_norm`` whose power iteration
  never ran: its weight is divided by a norm estimated from random vectors), so the validation computes nonsense.
"""

from __future__ import annotations

import collections
import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any

from lightning_diag.core.record import Alert, Severity
from lightning_diag.core.registry import FRACTION, POSITIVE, Limit, RuleSpec, register
from lightning_diag.rules.base import Latch, Rule, StepContext, list_names
from lightning_diag.rules.grad import GRAD_COLLAPSE
from lightning_diag.rules.measures import (
    Measure,
    Measures,
)

__all__ = [
    "AMP_NOT_APPLIED",
    "AMP_NOT_APPLIED_SPEC",
    "DEFAULT_AMP_SHARE",
    "DEFAULT_LOSS_OUTLIER_RATIO",
    "DEFAULT_LOSS_OUTLIER_THRESHOLD",
    "DEFAULT_LOSS_OUTLIER_WINDOW",
    "DEFAULT_ZERO_OUTPUT_HISTORY",
    "EVAL_BEFORE_TRAINING",
    "EVAL_BEFORE_TRAINING_SPEC",
    "EVAL_RANDOMNESS",
    "EVAL_RANDOMNESS_SPEC",
    "LOSS_OUTLIER",
    "LOSS_OUTLIER_SPEC",
    "TRAIN_OVERRIDE_BYPASSED",
    "TRAIN_OVERRIDE_BYPASSED_SPEC",
    "ZERO_OUTPUT",
    "ZERO_OUTPUT_SPEC",
    "AmpRule",
    "EvalBeforeTrainingRule",
    "EvalRandomnessRule",
    "LossOutlierRule",
    "TrainOverrideRule",
    "ZeroOutputRule",
    "judge_losses",
    "loss_outlier_min_history",
    "loss_outliers",
    "outlier_excess",
]

_ALARM = "AnomalyAlarm"

# -- declarations (the docs' thresholds table and the report read them) ----------------------------------------
TRAIN_OVERRIDE_BYPASSED_SPEC = register(
    RuleSpec(
        "train_override_bypassed",
        _ALARM,
        "warning",
        None,
        "a module's train() override would freeze parameters or switch modules to eval mode, but Lightning never "
        "calls train() during fit, so they keep training",
    )
)
TRAIN_OVERRIDE_BYPASSED = TRAIN_OVERRIDE_BYPASSED_SPEC.rule_id

EVAL_RANDOMNESS_SPEC = register(
    RuleSpec(
        "eval_randomness",
        _ALARM,
        "warning",
        None,
        "a dropout applied with training=True during validation (evaluation is random)",
    )
)
EVAL_RANDOMNESS = EVAL_RANDOMNESS_SPEC.rule_id

AMP_NOT_APPLIED_SPEC = register(
    RuleSpec(
        "amp_not_applied",
        _ALARM,
        "warning",
        0.5,
        "mixed precision configured, but more than {threshold:g} of the matmul layers' parameters compute in "
        "float32 on a sampled training step",
        limits={"threshold": FRACTION},
    )
)
AMP_NOT_APPLIED = AMP_NOT_APPLIED_SPEC.rule_id

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

EVAL_BEFORE_TRAINING_SPEC = register(
    RuleSpec(
        "eval_before_training",
        _ALARM,
        "warning",
        None,
        "a validation runs before the first training forward of a component whose state only training updates "
        "(spectral norm's power iteration)",
    )
)
EVAL_BEFORE_TRAINING = EVAL_BEFORE_TRAINING_SPEC.rule_id

ZERO_OUTPUT_SPEC = register(
    RuleSpec(
        "zero_output",
        _ALARM,
        "warning",
        3,
        "a module's output all zeros on a sampled training step after non-zero outputs on each of its "
        "{threshold:g} or more measurements before (a copy arriving as zeros)",
        limits={"threshold": Limit(low=1, integer=True)},
    )
)
ZERO_OUTPUT = ZERO_OUTPUT_SPEC.rule_id

#: ``amp_not_applied``: share of the matmul layers' parameters computing in float32 above which it fires.
DEFAULT_AMP_SHARE: float = float(AMP_NOT_APPLIED_SPEC.threshold or 0.5)
#: ``loss_outlier``: robust standard deviations above the median of the window.
DEFAULT_LOSS_OUTLIER_THRESHOLD: float = float(LOSS_OUTLIER_SPEC.threshold or 8.0)
#: ``loss_outlier``: ... and this factor above that median.
DEFAULT_LOSS_OUTLIER_RATIO: float = float(LOSS_OUTLIER_SPEC.settings["ratio"])
#: ``loss_outlier``: the steps the median and MAD are taken over.
DEFAULT_LOSS_OUTLIER_WINDOW: int = int(LOSS_OUTLIER_SPEC.settings["window"])

#: ``zero_output``: non-zero measurements a module needs before an all-zero output is judged a transition.
DEFAULT_ZERO_OUTPUT_HISTORY: int = int(ZERO_OUTPUT_SPEC.threshold or 3)

_SHOWN = 4
#: ``loss_outlier``: judgments without an outlier after which a new outlier is a new event.
_OUTLIER_CLEAR_AFTER = 10


class TrainOverrideRule(Rule):
    """``train_override_bypassed``: one comparison of what ``train()`` overrides would do with what is in effect.

    Example:
        >>> from lightning_diag.rules.measures import TrainOverrides
        >>> rule = TrainOverrideRule()
        >>> m = Measures(train_overrides=TrainOverrides(["Net"], ["backbone.bn"], ["backbone.conv.weight"]))
        >>> [(a.rule, a.source) for a in rule.judge(StepContext(0, 0), m)]
        [('train_override_bypassed', 'Net')]
        >>> rule.judge(StepContext(0, 0), Measures(train_overrides=TrainOverrides(["Net"], [], [])))
        []
    """

    specs = (TRAIN_OVERRIDE_BYPASSED_SPEC,)
    state_keys = ("checks",)
    needs = frozenset({Measure.TRAIN_OVERRIDES})

    def __init__(self) -> None:
        super().__init__()
        self.checks = 0

    @classmethod
    def from_settings(cls, thresholds: Mapping[str, float | None]) -> TrainOverrideRule:
        """The rule (it has no thresholds; see :meth:`Rule.from_settings`)."""
        del thresholds
        return cls()

    def judge(self, ctx: StepContext, m: Measures) -> list[Alert]:
        """Judge one comparison, ``m.train_overrides``: the classes whose ``train()`` override was tried, the
        modules the overrides would put in eval mode that are in training mode, and the parameters they would
        freeze (``requires_grad=False``) that train."""
        o = m.train_overrides
        assert o is not None  # checked against `needs`
        overriders, to_eval, to_freeze = o.overriders, o.to_eval, o.to_freeze
        self.checks += 1
        bypassed = bool(to_eval or to_freeze)
        if not self.latch.update("override", bypassed) or not overriders:
            return []
        parts = []
        if to_freeze:
            parts.append(f"freeze {list_names(to_freeze, _SHOWN, 'parameters')}")
        if to_eval:
            parts.append(f"put {list_names(to_eval, _SHOWN, 'modules')} in eval mode")
        who = ", ".join(f"`{c}`" for c in overriders[:_SHOWN])
        return [
            self._alert(
                ctx,
                f"{who} override(s) `train()`, which would {' and '.join(parts)}; Lightning never calls `train()` "
                "during fit (it sets the modules' `training` flags directly), so none of this is in effect and "
                f"{len(to_freeze)} parameter(s) meant to be frozen keep training. Apply it where Lightning runs "
                "it: freeze in `__init__`/`configure_model`/`on_fit_start`, switch modules in `on_train_epoch_start` "
                "(and `on_validation_model_train`)",
                source=overriders[0],
                value=float(len(to_freeze) + len(to_eval)),
                threshold=None,
            )
        ]


class EvalRandomnessRule(Rule):
    """``eval_randomness``: the dropouts applied in training mode during one validation batch.

    Example:
        >>> rule = EvalRandomnessRule()
        >>> [(a.rule, a.source) for a in rule.judge(StepContext(0, 10), Measures(eval_dropouts={"encoder": 0.1}))]
        [('eval_randomness', 'encoder')]
        >>> rule.judge(StepContext(1, 20), Measures(eval_dropouts={"encoder": 0.1}))  # the same condition: latched
        []
    """

    specs = (EVAL_RANDOMNESS_SPEC,)
    state_keys = ("checks",)
    needs = frozenset({Measure.EVAL_DROPOUTS})

    def __init__(self) -> None:
        super().__init__()
        self.checks = 0

    @classmethod
    def from_settings(cls, thresholds: Mapping[str, float | None]) -> EvalRandomnessRule:
        """The rule (it has no thresholds; see :meth:`Rule.from_settings`)."""
        del thresholds
        return cls()

    def judge(self, ctx: StepContext, m: Measures) -> list[Alert]:
        """Judge one validation batch's findings: ``{module name: dropout probability}``."""
        found = m.eval_dropouts or {}
        self.checks += 1
        if not self.latch.update("eval", bool(found)):
            return []
        names = sorted(found)
        shown = ", ".join(f"`{n or '<root>'}` (p={found[n]:g})" for n in names[:_SHOWN])
        more = f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""
        return [
            self._alert(
                ctx,
                f"dropout applied in training mode during validation in {len(names)} module(s): {shown}{more}; "
                "each evaluation of the same batch gives another result and the validation metric is noisy and "
                "biased. Look for `F.dropout(x, p, training=True)` (pass `training=self.training`) or a Dropout "
                "switched back to training mode in a validation hook",
                source=names[0] or "<root>",
                value=max(found.values()),
                threshold=None,
            )
        ]


class AmpRule(Rule):
    """``amp_not_applied``: one sampled step's matmul layers and the dtype they computed in.

    Example:
        >>> from lightning_diag.rules.measures import AmpLayers
        >>> rule = AmpRule(0.5)
        >>> m = Measures(amp=AmpLayers({"fc1": 100, "fc2": 100}, {"fc1": 100, "fc2": 100}, "bf16-mixed"))
        >>> [(a.rule, a.value) for a in rule.judge(StepContext(0, 1), m)]
        [('amp_not_applied', 1.0)]
        >>> m = Measures(amp=AmpLayers({"fc1": 100, "fc2": 100}, {"fc2": 10}, "bf16-mixed"))
        >>> AmpRule(0.5).judge(StepContext(0, 1), m)
        []
    """

    specs = (AMP_NOT_APPLIED_SPEC,)
    state_keys = ("checks", "last_share")
    needs = frozenset({Measure.AMP})

    def __init__(self, share: float = DEFAULT_AMP_SHARE) -> None:
        super().__init__()
        self.share = share
        self.checks = 0
        self.last_share = 0.0

    @classmethod
    def from_settings(cls, thresholds: Mapping[str, float | None]) -> AmpRule:
        """The rule with the threshold in effect (see :meth:`Rule.from_settings`)."""
        return cls(AMP_NOT_APPLIED_SPEC.value(thresholds))

    def judge(self, ctx: StepContext, m: Measures) -> list[Alert]:
        """Judge one sampled step, ``m.amp``: ``{layer: parameter count}`` of every matmul layer that ran, the same
        for those whose output was float32, and the trainer's precision setting."""
        assert m.amp is not None  # checked against `needs`
        layers, float32, precision = m.amp.layers, m.amp.float32, m.amp.precision
        total = sum(layers.values())
        if not total:
            return []
        self.checks += 1
        self.last_share = sum(float32.values()) / total
        self.observe(self.last_share, self.share)
        if not self.latch.update("amp", self.last_share > self.share):
            return []
        names = sorted(float32, key=lambda n: -float32[n])
        return [
            self._alert(
                ctx,
                f"`precision={precision!r}` is set, but {self.last_share:.0%} of the matmul layers' parameters "
                f"computed in float32 on this step ({list_names(names, _SHOWN)}); the forward escapes autocast (an "
                "`autocast(enabled=False)` block, a forward run outside `training_step`, inputs cast to float32 "
                "inside it), so the run pays float32's time and memory for mixed precision it does not get",
                source=names[0],
                value=self.last_share,
                threshold=self.share,
            )
        ]


def loss_outliers(
    history: Sequence[float],
    new: Sequence[float],
    threshold: float,
    ratio: float,
    window: int,
    floor: float | None = None,
    before: Sequence[float] = (),
    after: Sequence[float] = (),
    span: int = 1,
) -> list[tuple[int, float, float]]:
    """The steps of ``new`` whose loss is an upward outlier against the (up to) ``window`` losses before it.

    See :func:`judge_losses` (the neighbours) and :func:`outlier_excess` (the test); outliers do not enter the
    reference, and non-finite losses (the non-finite rules' concern) are not judged.

    Returns:
        ``(index into new, loss, median)`` of each outlier.

    Example:
        >>> hist = [0.4 + 0.05 * (i % 5) for i in range(32)]
        >>> loss_outliers(hist, [0.45, 4.0, 0.5], 10.0, 2.0, 32, floor=0.7)
        [(1, 4.0, 0.5)]
        >>> loss_outliers(hist, [0.45, 0.9, 0.5], 10.0, 2.0, 32, floor=0.7)  # a hard batch, not the untrained level
        []
        >>> loss_outliers(hist, [0.45, 4.0, 3.0], 10.0, 2.0, 32, floor=0.7)  # not isolated: a spike of the run
        []
        >>> loss_outliers(hist[:7], [4.0], 10.0, 2.0, 32)  # not enough history (8 steps)
        []
    """
    judged = judge_losses(history, new, threshold, ratio, window, floor, before, after, span)
    return [(i, x, med) for i, x, excess, med in judged if excess > 1.0]


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
    outside neighbour is the smallest. A neighbour beyond the sequence is unknown, not required."""
    past = [v for v in history if math.isfinite(v)][-window:]
    finite = [(i, float(x)) for i, x in enumerate(new) if math.isfinite(x)]
    head = [float(v) for v in before if math.isfinite(v)]
    sequence = [*head, *(x for _, x in finite), *(float(v) for v in after if math.isfinite(v))]
    span = max(int(span), 1)
    out = []
    for k, (i, x) in enumerate(finite):
        at = len(head) + k
        runs = [
            [sequence[n] for n in (start - 1, start + span) if 0 <= n < len(sequence)]
            for start in range(at - span + 1, at + 1)
        ]
        neighbours = min(runs, key=lambda nb: max(nb, default=-math.inf))
        excess, med = outlier_excess(past, x, threshold, ratio, window, floor, neighbours)
        out.append((i, x, excess, med))
        if excess > 1.0:
            continue  # an outlier does not enter the reference
        past.append(x)
        if len(past) > window:
            past.pop(0)
    return out


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
    med = _median(ordered)
    log_scale = ordered[0] > 0 and x > 0
    scaled = [math.log(v) for v in past] if log_scale else list(past)
    centre = _median(sorted(scaled))
    # the spread from one step to the next (a falling loss's trend is not spread): the median absolute successive
    # difference, over sqrt(2), times 1.4826 (a standard deviation for Gaussian noise)
    sigma = 1.4826 * _median(sorted(abs(b - a) for a, b in itertools.pairwise(scaled))) / math.sqrt(2.0)
    bound = threshold * math.sqrt(max(1.0, (window / 2) / n))
    rise = (math.log(x) if log_scale else x) - centre
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

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output; a checkpoint from before ``first`` / ``pending`` were saved loads
        with none."""
        super().load_state_dict({"first": [], "pending": [], "before": [], "span": 1, **state})

    @classmethod
    def from_settings(cls, thresholds: Mapping[str, float | None]) -> LossOutlierRule:
        """The rule with the threshold and settings in effect (see :meth:`Rule.from_settings`)."""
        spec = LOSS_OUTLIER_SPEC
        return cls(spec.value(thresholds), spec.value(thresholds, "ratio"), int(spec.value(thresholds, "window")))

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
        judged = judge_losses(
            self.history,
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


class EvalBeforeTrainingRule(Rule):
    """``eval_before_training``: components evaluated before any training forward updated their state.

    Example:
        >>> from lightning_diag.rules.measures import UntrainedInEval
        >>> rule = EvalBeforeTrainingRule()
        >>> m = Measures(untrained_in_eval=UntrainedInEval(["disc.conv"], sanity=False))
        >>> [(a.rule, a.severity.value) for a in rule.judge(StepContext(0, 0), m)]
        [('eval_before_training', 'warning')]
        >>> rule.judge(StepContext(0, 0), m)
        []
    """

    specs = (EVAL_BEFORE_TRAINING_SPEC,)
    state_keys = ("checks",)
    needs = frozenset({Measure.UNTRAINED_IN_EVAL})

    def __init__(self) -> None:
        super().__init__()
        self.checks = 0

    @classmethod
    def from_settings(cls, thresholds: Mapping[str, float | None]) -> EvalBeforeTrainingRule:
        """The rule (it has no thresholds; see :meth:`Rule.from_settings`)."""
        del thresholds
        return cls()

    def judge(self, ctx: StepContext, m: Measures) -> list[Alert]:
        """Judge one validation run's untrained components (``sanity``: it is Lightning's sanity check)."""
        assert m.untrained_in_eval is not None  # checked against `needs`
        modules, sanity = m.untrained_in_eval.modules, m.untrained_in_eval.sanity
        self.checks += 1
        key = "sanity" if sanity else "eval"
        if not modules or not self.latch.update(key, True):
            return []
        what = "the sanity check" if sanity else "a validation whose metrics are logged"
        return [
            self._alert(
                ctx,
                f"{what} runs before the first training forward of {list_names(modules, _SHOWN, 'modules')} with "
                "`spectral_norm`: its power iteration has not run, so the weight is divided by a norm estimated from "
                "random vectors and the outputs are meaningless. Run a training forward first, or use "
                "`torch.nn.utils.parametrizations.spectral_norm`, which iterates at construction",
                source=modules[0],
                value=float(len(modules)),
                threshold=None,
                severity=Severity.INFO if sanity else None,
            )
        ]


class ZeroOutputRule(Rule):
    """``zero_output``: modules whose output turned all-zero on a sampled step after non-zero measurements.

    Example:
        >>> from lightning_diag.rules.measures import ZeroOutputs
        >>> rule = ZeroOutputRule(history=2)
        >>> def zeros(names):
        ...     return Measures(zero_outputs=ZeroOutputs(["enc", "enc.act"], names))
        >>> [rule.judge(StepContext(0, s), zeros(["enc.act"])) for s in (0, 5)]  # dead from the start
        [[], []]
        >>> rule.judge(StepContext(0, 10), zeros([]))
        []
        >>> [(a.rule, a.source) for a in rule.judge(StepContext(0, 15), zeros(["enc"]))]
        [('zero_output', 'enc')]
        >>> rule.judge(StepContext(0, 20), zeros(["enc"]))  # once per module and fit
        []
    """

    specs = (ZERO_OUTPUT_SPEC,)
    state_keys = ("nonzero", "zeroed", "checks", "signed")
    needs = frozenset({Measure.ZERO_OUTPUTS})

    def __init__(self, history: int = DEFAULT_ZERO_OUTPUT_HISTORY) -> None:
        super().__init__()
        self.history = max(int(history), 1)
        #: Per module, its measurements with a non-zero output (while never zero).
        self.nonzero: dict[str, int] = {}
        #: The modules seen returning zeros (never judged again in this fit).
        self.zeroed: list[str] = []
        #: Sampled steps judged.
        self.checks = 0
        #: The modules seen returning a negative value (only they are judged, when signs are fed).
        self.signed: list[str] = []

    @classmethod
    def from_settings(cls, thresholds: Mapping[str, float | None]) -> ZeroOutputRule:
        """The rule with the threshold in effect (see :meth:`Rule.from_settings`)."""
        return cls(int(ZERO_OUTPUT_SPEC.value(thresholds)))

    def judge(self, ctx: StepContext, m: Measures) -> list[Alert]:
        """Judge one sampled step: the modules that ran, those among them whose every output was all zeros and,
        when known, those that returned a negative value (``None``: signs not measured, every module judged)."""
        assert m.zero_outputs is not None  # checked against `needs`
        ran, zeros, signed = m.zero_outputs.ran, m.zero_outputs.zeros, m.zero_outputs.signed
        self.checks += 1
        zero_set = set(zeros)
        known = set(self.zeroed)
        judged = None if signed is None else set(self.signed)
        found = [
            n
            for n in zeros
            if n not in known and self.nonzero.get(n, 0) >= self.history and (judged is None or n in judged)
        ]
        if signed is not None:
            self.signed += [n for n in signed if judged is not None and n not in judged]
        for name in ran:
            if name in zero_set:
                if name not in known:
                    self.zeroed.append(name)
                    known.add(name)
                self.nonzero.pop(name, None)
            elif name not in known:
                self.nonzero[name] = self.nonzero.get(name, 0) + 1
        if not found:
            return []
        found.sort(key=lambda n: -n.count(".") if n else 1)  # the innermost first
        shown = list_names([n or "<root>" for n in found], _SHOWN, "modules")
        return [
            self._alert(
                ctx,
                f"the output of {shown} is all zeros on this step, after non-zero outputs of both signs on each of "
                f"its {self.history} or more earlier measurements: a copy between devices or ranks that arrived as "
                "zeros (a faulty link or transfer: pytorch #84803, #96600), or a layer whose weights were zeroed. A "
                f"transient corruption comes and goes (look for `{LOSS_OUTLIER}` at other steps); a layer that stays "
                f"zero is followed by `{GRAD_COLLAPSE}`",
                source=found[0] or "<root>",
                value=float(len(found)),
                threshold=float(self.history),
            )
        ]
