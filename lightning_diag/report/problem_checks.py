"""Checklist rows of the training-problem rules (issue 45): ``units_alive`` (``dead_units``),
``activations_in_range`` (``activation_saturation``), ``update_size`` (``update_too_small``), ``outputs_vary``
(``output_collapse``) and ``attn_logits_bounded`` (``attn_logit_growth``).

Each row shows what the run measured, from its logged series: GradientFlowMonitor's ``diag/act_dead/<layer>``,
``diag/grad_zero/<layer>``, ``diag/act_saturated/<layer>`` and ``diag/update_ratio/<layer>``, and
AttentionEntropyMonitor's ``diag/attn_logit_growth/<module>``. The rows pass or fail on the rules' alerts: the rules
also judge what the series do not hold (the loss's fall since the fit began, the activation each layer feeds, the
measurements since the start), so nothing is replayed. ``output_collapse`` logs no series (its spread is judged on
sampled steps only): its row shows the alert's value, or says the rule was judged without a logged value.
Registered on import by :mod:`lightning_diag.report.checks` (machinery: :mod:`~lightning_diag.report.rows`).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable

from lightning_diag.core.registry import RULES
from lightning_diag.core.tags import dead_units_tag, saturation_tag, tag, update_ratio_tag, zero_grad_tag
from lightning_diag.report.load import RunData
from lightning_diag.report.replay import run_setting
from lightning_diag.report.rows import Check, fmt, measure, serious_alerts
from lightning_diag.rules.catalog import (
    ACTIVATION_SATURATION,
    ATTN_LOGIT_GROWTH,
    DEAD_UNITS,
    OUTPUT_COLLAPSE,
    UPDATE_TOO_SMALL,
)

__all__: list[str] = []

#: Per layer (or module), its ``(step, value)`` points of one tag family.
Series = dict[str, list[tuple[int, float]]]


def _family(run: RunData, tag_of: Callable[[str], str]) -> Series:
    """The finite points of every ``tag_of(<layer>)`` series of the run, by layer."""
    probe = "layer"
    head = tag_of(probe)[: -len(probe)]
    out: Series = {}
    for name, points in run.scalars.items():
        if name.startswith(head) and len(name) > len(head):
            finite = [(s, v) for s, v in points if math.isfinite(v)]
            if finite:
                out[name[len(head) :]] = finite
    return out


def _worst(series: Series, lowest: bool = False) -> tuple[str, int, float]:
    """The layer, step and value of the largest point (the smallest with ``lowest``)."""
    sign = -1.0 if lowest else 1.0
    layer, (step, value) = max(
        ((name, point) for name, points in series.items() for point in points), key=lambda lp: sign * lp[1][1]
    )
    return layer, step, value


def _last(series: Series) -> tuple[str, float]:
    """The worst layer's (largest) value at each layer's last measurement."""
    layer = max(series, key=lambda k: series[k][-1][1])
    return layer, series[layer][-1][1]


def _share_row(check: Check, series: Series, what: str) -> None:
    layer, step, peak = _worst(series)
    last_layer, last = _last(series)
    measurements = max(len(p) for p in series.values())
    check.measured = (
        f"largest share of {what}: {peak:.1%} (`{layer}`, step {step}); {last:.1%} (`{last_layer}`) at the last "
        f"measurement, over {len(series)} layers and {measurements} measurements"
    )
    check.measured_value = {"max": peak, "last": last, "layers": float(len(series))}


@measure("units_alive")
def _measure_dead_units(run: RunData, check: Check) -> bool:
    check.threshold = RULES[DEAD_UNITS].describe(run.thresholds)
    check.threshold_value = {"value": run_setting(run, DEAD_UNITS)}
    dead = _family(run, dead_units_tag)
    if not dead:
        return False
    _share_row(check, dead, "units inactive for every sample of the measured batch")
    zero = _family(run, zero_grad_tag)
    if zero:
        layer, _, peak = _worst(zero)
        check.measured = f"{check.measured}; exactly-zero gradient entries up to {peak:.1%} (`{layer}`)"
        check.measured_value["zero_grad_max"] = peak
    return True


@measure("activations_in_range")
def _measure_saturation(run: RunData, check: Check) -> bool:
    check.threshold = RULES[ACTIVATION_SATURATION].describe(run.thresholds)
    check.threshold_value = {"value": run_setting(run, ACTIVATION_SATURATION)}
    saturated = _family(run, saturation_tag)
    if not saturated:
        return False
    _share_row(check, saturated, "a bounded activation's inputs beyond its linear range")
    return True


@measure("update_size")
def _measure_update_size(run: RunData, check: Check) -> bool:
    check.threshold = RULES[UPDATE_TOO_SMALL].describe(run.thresholds)
    check.threshold_value = {"value": run_setting(run, UPDATE_TOO_SMALL)}
    ratios = _family(run, update_ratio_tag)
    by_step: dict[int, list[float]] = {}
    for points in ratios.values():
        for step, value in points:
            by_step.setdefault(step, []).append(value)
    if not by_step:
        return False
    medians = {step: statistics.median(values) for step, values in sorted(by_step.items())}
    low_step = min(medians, key=medians.__getitem__)
    last_step = max(medians)
    layer, step, lowest = _worst(ratios, lowest=True)
    check.measured = (
        f"lowest median ||ΔW||/||W|| over layers {fmt(medians[low_step])} (step {low_step}), {fmt(medians[last_step])}"
        f" at the last of {len(medians)} measurements; lowest layer {fmt(lowest)} (`{layer}`, step {step})"
    )
    check.measured_value = {"min_median": medians[low_step], "last_median": medians[last_step], "min_layer": lowest}
    return True


@measure("outputs_vary")
def _measure_output_spread(run: RunData, check: Check) -> bool:
    check.threshold = RULES[OUTPUT_COLLAPSE].describe(run.thresholds)
    check.threshold_value = {"value": run_setting(run, OUTPUT_COLLAPSE)}
    alerts = serious_alerts(run.alerts, (OUTPUT_COLLAPSE,))
    if alerts:
        last = alerts[-1]
        value = fmt(last.value) if last.value is not None else "-"
        check.measured = f"outputs' spread {value} of their level at step {last.global_step} (`{last.source}`)"
    measured = OUTPUT_COLLAPSE in run.thresholds
    if measured and not alerts:
        check.add_note("judged on AnomalyAlarm's sampled steps; the spread is not logged as a series")
    return measured


@measure("attn_logits_bounded")
def _measure_attn_logits(run: RunData, check: Check) -> bool:
    check.threshold = RULES[ATTN_LOGIT_GROWTH].describe(run.thresholds)
    check.threshold_value = {"value": run_setting(run, ATTN_LOGIT_GROWTH)}
    peaks = _family(run, lambda module: tag(ATTN_LOGIT_GROWTH, module))
    if not peaks:
        return False
    module, step, peak = _worst(peaks)
    last_module, last = _last(peaks)
    check.measured = (
        f"largest attention logit {fmt(peak)} (`{module}`, step {step}); {fmt(last)} (`{last_module}`) at the last "
        f"measurement, over {len(peaks)} modules"
    )
    check.measured_value = {"max": peak, "last": last, "modules": float(len(peaks))}
    return True
