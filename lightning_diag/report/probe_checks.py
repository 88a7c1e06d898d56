"""Checklist rows of the probes: ``loss_surface`` (SharpnessProbe) and ``deploy_quantization_error``
(QuantizationProbe): measured values from the logged ``diag/sharpness/...`` and ``diag/quant/...`` series, and the
two rules replayed over them. Registered on import by :mod:`lightning_diag.report.checks` (machinery:
:mod:`~lightning_diag.report.rows`).
"""

from __future__ import annotations

import math

from lightning_diag.core.alerts import Alert
from lightning_diag.core.registry import RULES
from lightning_diag.core.tags import quant_layer, quant_tag, sharpness_tag
from lightning_diag.report.load import RunData
from lightning_diag.report.replay import replay, run_setting
from lightning_diag.report.rows import Check, finite_values, fmt, measure
from lightning_diag.rules.base import StepContext
from lightning_diag.rules.catalog import QUANTIZATION_ERROR, SHARP_MINIMUM
from lightning_diag.rules.measures import Measures, QuantizationReading, SharpnessReading
from lightning_diag.rules.quantization_error import QUANTIZATION_LAYER_RATIO_KEY, QuantizationErrorRule
from lightning_diag.rules.sharp_minimum import SHARP_MINIMUM_PATIENCE_KEY, SharpMinimumRule

__all__: list[str] = []


@measure("loss_surface")
def _measure_loss_surface(run: RunData, check: Check) -> bool:
    check.threshold = RULES[SHARP_MINIMUM].describe(run.thresholds)
    check.threshold_value = {
        "value": run_setting(run, SHARP_MINIMUM),
        "patience": run_setting(run, SHARP_MINIMUM_PATIENCE_KEY),
    }
    gaps = finite_values(run.scalars.get(sharpness_tag("gap"), []))
    if not gaps:
        return False
    relative = finite_values(run.scalars.get(sharpness_tag("relative_gap"), []))
    check.measured = f"SAM gap {fmt(min(gaps))} .. {fmt(max(gaps))} over {len(gaps)} probes (last {fmt(gaps[-1])}"
    check.measured += f", {relative[-1]:.0%} of the loss)" if relative else ")"
    check.measured_value = {"min": min(gaps), "max": max(gaps), "last": gaps[-1]}
    return True


@replay("loss_surface")
def _replay_loss_surface(run: RunData) -> list[Alert]:
    rule = SharpMinimumRule.from_settings(run.thresholds)
    alerts: list[Alert] = []
    for step, gap in run.scalars.get(sharpness_tag("gap"), []):
        alerts += rule.judge(StepContext(0, step), Measures(sharpness=SharpnessReading(gap)))
    return alerts


def layer_series(run: RunData, measure_name: str) -> dict[int, dict[str, float]]:
    by_step: dict[int, dict[str, float]] = {}
    for name, points in run.scalars.items():
        parsed = quant_layer(name)
        if parsed is not None and parsed[1] == measure_name:
            for step, value in points:
                by_step.setdefault(step, {})[parsed[0]] = value
    return by_step


@measure("deploy_quantization_error")
def _measure_quantization(run: RunData, check: Check) -> bool:
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
def _replay_quantization(run: RunData) -> list[Alert]:
    rule = QuantizationErrorRule.from_settings(run.thresholds)
    layers = layer_series(run, "relative_mse")
    per_channel = layer_series(run, "relative_mse_per_channel")
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
