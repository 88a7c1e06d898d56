"""``quantization_error``, the rule of :class:`~lightning_diag.QuantizationProbe` (validation end). Plain
Python; defaults read from the rule registry.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Mapping, Sequence

from lightning_diag.core.record import Alert
from lightning_diag.core.registry import POSITIVE, RULES, CheckSpec, Limit, RuleSpec, register
from lightning_diag.core.tags import quant_layer, quant_tag
from lightning_diag.rules.base import Rule, StepContext
from lightning_diag.rules.measures import Measure, Measures, QuantizationReading
from lightning_diag.rules.rows import Check, LoggedRun, finite_values, fmt, measure, replay, run_setting

__all__ = [
    "CHANGE_SIGNIFICANCE",
    "DEFAULT_QUANTIZATION_ERROR_LAYER_RATIO",
    "DEFAULT_QUANTIZATION_ERROR_MIN_LAYER_ERROR",
    "DEFAULT_QUANTIZATION_ERROR_THRESHOLD",
    "MIN_LAYERS_FOR_MEDIAN",
    "QUANTIZATION_CHECK",
    "QUANTIZATION_ERROR",
    "QUANTIZATION_ERROR_SPEC",
    "QUANTIZATION_LAYER_RATIO_KEY",
    "QuantizationErrorRule",
]

_WORST_NAMED = 3

# -- declaration (the docs' thresholds table and the report read it) ---------------------------------------------
QUANTIZATION_ERROR_SPEC = register(RuleSpec(
    "quantization_error", "QuantizationProbe", "warning", 0.05,
    "INT8 end-to-end relative loss change above {threshold:.0%}, or a layer's output MSE above {layer_ratio:g}x "
    "the median layer's",
    settings={"layer_ratio": 10.0, "min_layer_error": 1e-3}, check="deploy_quantization_error",
    source="seed 000 §5.1, §7.1",
    limits={"threshold": POSITIVE, "layer_ratio": Limit(low=1.0, low_inclusive=True)},
))
QUANTIZATION_ERROR = QUANTIZATION_ERROR_SPEC.rule_id
#: Its row of the ``lightning-diag report`` checklist (registered in report order by
#: :mod:`lightning_diag.rules.catalog`).
QUANTIZATION_CHECK = CheckSpec("deploy_quantization_error", "Deployment",
                               "Quantization error < {quantization_error:.0%} (INT8 end-to-end loss change; no "
                               "layer's output MSE above {quantization_error__layer_ratio:g}x the median layer's)")
#: ``thresholds()`` key of ``quantization_error``'s per-layer ratio (read back by the report).
QUANTIZATION_LAYER_RATIO_KEY = QUANTIZATION_ERROR_SPEC.key("layer_ratio")
_QUANT = QUANTIZATION_ERROR_SPEC
#: End-to-end relative change of the loss above which INT8 is judged too lossy (seed 000 §7.1).
DEFAULT_QUANTIZATION_ERROR_THRESHOLD: float = _QUANT.value({})
#: A layer whose relative output MSE is above this many times the median layer's (seed 000 §5.1).
DEFAULT_QUANTIZATION_ERROR_LAYER_RATIO: float = float(_QUANT.settings["layer_ratio"])
#: ... and above this absolute relative output MSE (noise power / signal power), so tiny errors never alert.
DEFAULT_QUANTIZATION_ERROR_MIN_LAYER_ERROR: float = float(_QUANT.settings["min_layer_error"])
#: The median comparison needs at least this many quantized layers.
MIN_LAYERS_FOR_MEDIAN = 3
#: ``quantization_error``: standard errors of the loss change (the spread of its per-batch changes) it must exceed.
CHANGE_SIGNIFICANCE = 2.0


class QuantizationErrorRule(Rule):
    """``quantization_error``: INT8 ruins the model end to end, or one layer far more than the others.

    Two conditions, each judged against the noise of what it compares:

    * source ``"end_to_end"``: the relative change of the loss is above ``threshold`` and above
      :data:`CHANGE_SIGNIFICANCE` (2) times its own standard error (``change_noise``: the spread of the per-batch
      changes, relative like the change; not required when unknown). A loss whose batches INT8 moves up and down
      (a contrastive loss over in-batch negatives) has a mean change that is noise;
    * a layer's name: its relative output MSE is above ``layer_ratio`` times the median layer's and above
      ``min_layer_error`` (needs at least 3 layers), and it stands apart from the others: between the median and
      it, the layer errors in ascending order make a jump of at least ``sqrt(layer_ratio)`` (3.2x) from one to
      the next. The end of a continuous tail (a deep ReLU stack whose deeper layers see sparser inputs: 70
      layers rising by 1.1 to 1.6x from one to the next up to 11x the median) is the spread of the model, not a
      layer out of line; an outlier weight's layer sits far above the next one. Latched per layer.

    Layers that trip at once make one alert (source: the worst of them) naming the count and the worst few, each
    with the suggested fix: per-channel scales where they bring the layer back in line, else keeping it in higher
    precision (mixed precision). The margin noted (:meth:`~lightning_diag.rules.base.Rule.observe`) is the
    end-to-end statistic that decides: the smaller of the change over ``threshold`` and over twice its standard
    error.

    Example:
        >>> from lightning_diag.rules.measures import QuantizationReading
        >>> rule = QuantizationErrorRule()
        >>> errs = {"a": 1e-4, "b": 2e-4, "c": 0.5}
        >>> m = Measures(quantization=QuantizationReading(0.01, errs, {"a": 1e-4, "b": 1e-4, "c": 1e-4}))
        >>> [a.source for a in rule.judge(StepContext(0, 0), m)]
        ['c']
    """

    specs = (QUANTIZATION_ERROR_SPEC,)
    needs = frozenset({Measure.QUANTIZATION})
    state_keys = ()

    def __init__(
        self,
        threshold: float = DEFAULT_QUANTIZATION_ERROR_THRESHOLD,
        layer_ratio: float = DEFAULT_QUANTIZATION_ERROR_LAYER_RATIO,
        min_layer_error: float = DEFAULT_QUANTIZATION_ERROR_MIN_LAYER_ERROR,
    ) -> None:
        super().__init__()
        self.threshold = threshold
        self.layer_ratio = layer_ratio
        self.min_layer_error = min_layer_error

    def outlier_layers(self, layer_errors: Mapping[str, float]) -> dict[str, float]:
        """The layers out of line: name -> their error over the median layer's, worst first.

        Example:
            >>> rule = QuantizationErrorRule()
            >>> list(rule.outlier_layers({"a": 1e-4, "b": 2e-4, "c": 1e-4, "d": 0.5}))
            ['d']
            >>> tail = {f"l{i}": 1e-4 * 1.1**i for i in range(30)}  # rising 1.1x a layer to 1.6e-3, 11x the median
            >>> rule.outlier_layers(tail)  # the end of a continuous tail, not a layer out of line
            {}
        """
        finite = [v for v in layer_errors.values() if math.isfinite(v)]
        if len(layer_errors) < MIN_LAYERS_FOR_MEDIAN:
            return {}
        median = statistics.median(finite) if finite else 0.0
        apart = _above_a_jump(sorted(v for v in finite if v >= median), math.sqrt(self.layer_ratio))
        out: dict[str, float] = {}
        for name, err in layer_errors.items():
            out_of_line = err > self.layer_ratio * median and err >= apart
            if err > self.min_layer_error and (not math.isfinite(err) or out_of_line):
                out[name] = err / median if median > 0 else math.inf
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    def judge(self, ctx: StepContext, m: Measures) -> list[Alert]:
        """Judge one probe: the end-to-end relative loss change (``None`` when unmeasured) and each layer's
        relative output MSE under the judged scheme and under per-channel weight scales; ``notes`` adds a few
        words on a named layer (its outlier ratios); ``change_noise`` is the standard error of the end-to-end
        change, relative like it (``nan``: unknown)."""
        q = m.quantization
        assert q is not None  # checked against `needs`
        end_to_end, layer_errors, per_channel_errors = q.end_to_end, q.layer_errors, q.per_channel_errors
        scheme, notes, change_noise = q.scheme, q.notes, q.change_noise
        alerts: list[Alert] = []
        measured = end_to_end is not None and math.isfinite(end_to_end)
        change = float(end_to_end) if end_to_end is not None and measured else math.nan
        decides = change / self.threshold
        if math.isfinite(change_noise) and change_noise > 0:
            decides = min(decides, change / (CHANGE_SIGNIFICANCE * change_noise))
        self.observe(decides, 1.0)  # the statistic that decides, as a fraction of its bound
        if measured and self.latch.update("end_to_end", decides > 1.0):
            noise = (
                f" ({change / change_noise:.1f} standard errors of the per-batch changes)"
                if math.isfinite(change_noise) and change_noise > 0
                else ""
            )
            alerts.append(
                self._alert(
                    ctx,
                    f"INT8 ({scheme}) changes the validation loss by {end_to_end:.1%}{noise}, above "
                    f"{self.threshold:.0%}: quantize with per-channel scales, or keep the layers named by "
                    "diag/quant/layer/* in higher precision (mixed-precision quantization)",
                    "end_to_end",
                    end_to_end,
                    self.threshold,
                )
            )
        outliers = self.outlier_layers(layer_errors)
        for name in layer_errors:
            if name not in outliers:
                self.latch.update(name, False)
        newly = [name for name in outliers if self.latch.update(name, True)]
        if newly:
            finite = [v for v in layer_errors.values() if math.isfinite(v)]
            median = statistics.median(finite) if finite else 0.0
            named = []
            for name in newly[:_WORST_NAMED]:
                fix = (
                    "use per-channel scales"
                    if per_channel_errors.get(name, math.inf) <= max(self.layer_ratio * median, self.min_layer_error)
                    else "keep it in higher precision"
                )
                note = f"; {notes[name]}" if notes and name in notes else ""
                named.append(f"{name} ({outliers[name]:.3g}x the median; {fix}{note})")
            more = f" and {len(newly) - _WORST_NAMED} more" if len(newly) > _WORST_NAMED else ""
            alerts.append(
                self._alert(
                    ctx,
                    f"INT8 ({scheme}): {len(newly)} layer(s) with an output MSE above {self.layer_ratio:g}x the "
                    "median layer's (relative output MSE "
                    + f"{layer_errors[newly[0]]:.3g} vs median {median:.3g}): "
                    + ", ".join(named)
                    + more,
                    newly[0],
                    layer_errors[newly[0]],
                    self.layer_ratio,
                )
            )
        return alerts


def _above_a_jump(ascending: Sequence[float], jump: float) -> float:
    """The first value of ``ascending`` at least ``jump`` times the one before it (``inf`` if none).

    Example:
        >>> _above_a_jump([1.0, 1.2, 1.5, 90.0, 100.0], 3.0), _above_a_jump([1.0, 1.2, 1.5], 3.0)
        (90.0, inf)
    """
    for low, high in itertools.pairwise(ascending):
        if high > 0 and high >= jump * low:
            return float(high)
    return math.inf


# -- the report's deploy_quantization_error row (QuantizationProbe's ``diag/quant/...``) ------------------------


def _quant_layers(run: LoggedRun, measure_name: str) -> dict[int, dict[str, float]]:
    by_step: dict[int, dict[str, float]] = {}
    for name, points in run.scalars.items():
        parsed = quant_layer(name)
        if parsed is not None and parsed[1] == measure_name:
            for step, value in points:
                by_step.setdefault(step, {})[parsed[0]] = value
    return by_step


@measure("deploy_quantization_error")
def _measure_quantization(run: LoggedRun, check: Check) -> bool:
    check.threshold = RULES[QUANTIZATION_ERROR].describe(run.thresholds)
    check.threshold_value = {
        "value": run_setting(run, QUANTIZATION_ERROR),
        "layer_ratio": run_setting(run, QUANTIZATION_LAYER_RATIO_KEY),
    }
    errors = finite_values(run.scalars.get(quant_tag("end_to_end"), []))
    if not errors:
        return False
    ratios = finite_values(run.scalars.get(quant_tag("worst_layer_ratio"), []))
    check.measured = f"INT8 end-to-end loss change up to {max(errors):.2%} (last {errors[-1]:.2%})"
    check.measured_value = {"max": max(errors), "last": errors[-1]}
    if ratios:
        check.measured += f"; worst layer up to {fmt(max(ratios))}x the median layer's output MSE"
        check.measured_value["worst_layer_ratio"] = max(ratios)
    return True


@replay("deploy_quantization_error")
def _replay_quantization(run: LoggedRun) -> list[Alert]:
    rule = QuantizationErrorRule.from_settings(run.thresholds)
    layers = _quant_layers(run, "relative_mse")
    per_channel = _quant_layers(run, "relative_mse_per_channel")
    noise = dict(run.scalars.get(quant_tag("change_noise"), []))
    alerts: list[Alert] = []
    for step, value in run.scalars.get(quant_tag("end_to_end"), []):
        end_to_end = value if math.isfinite(value) else None
        ctx = StepContext(0, step)
        reading = QuantizationReading(
            end_to_end, layers.get(step, {}), per_channel.get(step, {}), change_noise=noise.get(step, math.nan)
        )
        alerts += rule.judge(ctx, Measures(quantization=reading))
    return alerts
