"""sharp_minimum and quantization_error: table-driven, framework-free."""

import math
import statistics

import pytest

from lightning_diag.rules.base import StepContext
from lightning_diag.rules.measures import Measures, QuantizationReading, SharpnessReading
from lightning_diag.rules.quantization_error import (
    DEFAULT_QUANTIZATION_ERROR_LAYER_RATIO,
    DEFAULT_QUANTIZATION_ERROR_THRESHOLD,
    QuantizationErrorRule,
)
from lightning_diag.rules.sharp_minimum import (
    DEFAULT_SHARP_MINIMUM_PATIENCE,
    DEFAULT_SHARP_MINIMUM_THRESHOLD,
    SharpMinimumRule,
)


def _sharp(gap, **parts):
    """The measures of one sharpness probe of SAM gap `gap`."""
    return Measures(sharpness=SharpnessReading(gap, **parts))


def _quant(end_to_end, layer_errors, per_channel_errors, **parts):
    """The measures of one quantization probe."""
    return Measures(quantization=QuantizationReading(end_to_end, layer_errors, per_channel_errors, **parts))


def sharp_fires(gaps, **kwargs):
    rule = SharpMinimumRule(**kwargs)
    return [i for i, g in enumerate(gaps) if rule.judge(StepContext(i, i), _sharp(g))]


@pytest.mark.parametrize(
    ("name", "gaps", "fires_at"),
    [
        ("flat minimum", [0.01, 0.02, 0.05, 0.01], []),
        ("sharp throughout", [0.5, 0.6, 0.7, 0.8], [2]),
        ("one spike is not persistent", [0.5, 0.1, 0.5, 0.1, 0.5], []),
        ("one clear probe is the same event", [0.5, 0.5, 0.5, 0.1, 0.5, 0.5, 0.5], [2]),
        ("clears for 3 probes then returns: alerts again", [0.5] * 3 + [0.1] * 3 + [0.5] * 3, [2, 8]),
        ("10x worse while it persists: alerts again", [0.5, 0.5, 0.5, 1.0, 4.0, 5.0, 6.0], [2, 5]),
        ("at the threshold is not above", [0.3, 0.3, 0.3], []),
        ("non-finite skipped", [0.5, math.nan, 0.5, 0.5], [3]),
    ],
)
def test_sharp_minimum_table(name, gaps, fires_at):
    assert sharp_fires(gaps) == fires_at, name


def test_sharp_defaults_patience_and_resume():
    assert (DEFAULT_SHARP_MINIMUM_THRESHOLD, DEFAULT_SHARP_MINIMUM_PATIENCE) == (0.3, 3)
    assert sharp_fires([0.2, 0.2], threshold=0.1, patience=2) == [1]
    rule = SharpMinimumRule(patience=3)
    rule.judge(StepContext(0, 0), _sharp(0.5))
    rule.judge(StepContext(1, 1), _sharp(0.5))
    resumed = SharpMinimumRule(patience=3)
    resumed.load_state_dict(rule.state_dict())
    (alert,) = resumed.judge(StepContext(2, 2), _sharp(0.5, relative_gap=0.4, rho=0.05, worst_layers=[("fc1", 0.4)]))
    assert alert.rule == "sharp_minimum" and alert.source == "model" and "fc1" in alert.message
    with pytest.raises(KeyError, match="streak"):
        SharpMinimumRule().load_state_dict({"latch": []})


def test_quantization_notes_are_quoted_for_named_layers():
    errors = {"a": 1e-4, "b": 1e-4, "c": 0.5}
    notes = {"c": "input channels max/median 80"}
    (alert,) = QuantizationErrorRule().judge(StepContext(0, 0), _quant(None, errors, {}, notes=notes))
    assert "input channels max/median 80" in alert.message and "higher precision" in alert.message


def test_quantization_end_to_end_and_latch():
    assert (DEFAULT_QUANTIZATION_ERROR_THRESHOLD, DEFAULT_QUANTIZATION_ERROR_LAYER_RATIO) == (0.05, 10.0)
    rule = QuantizationErrorRule()
    ok = {"a": 1e-4, "b": 1e-4, "c": 2e-4}
    changes = [0.01, 0.06, 0.07, 0.02, 0.1]
    fired = [bool(rule.judge(StepContext(i, i), _quant(e, ok, ok))) for i, e in enumerate(changes)]
    assert fired == [False, True, False, False, True]
    assert rule.judge(StepContext(9, 9), _quant(None, ok, ok)) == []


@pytest.mark.parametrize(
    ("name", "errors", "per_channel", "named", "fix"),
    [
        ("one bad layer, per-channel fixes it", {"a": 1e-4, "b": 2e-4, "c": 1e-4, "d": 0.5},
         {"a": 1e-4, "b": 1e-4, "c": 1e-4, "d": 1e-4}, ["d"], "per-channel"),
        ("one bad layer, per-channel does not", {"a": 1e-4, "b": 2e-4, "c": 1e-4, "d": 0.5},
         {"a": 1e-4, "b": 1e-4, "c": 1e-4, "d": 0.4}, ["d"], "higher precision"),
        ("10x the median but tiny: quiet", {"a": 1e-6, "b": 1e-6, "c": 1e-4}, {}, [], None),
        ("two layers are too few for a median", {"a": 1e-6, "b": 0.5}, {}, [], None),
        ("several at once: one alert", {"a": 1e-4, "b": 1e-4, "c": 1e-4, "d": 0.2, "e": 0.5, "f": 1e-4,
                                         "g": 1e-4}, {}, ["e", "d"], "higher precision"),
    ],
)
def test_quantization_layer_table(name, errors, per_channel, named, fix):
    alerts = QuantizationErrorRule().judge(StepContext(0, 0), _quant(0.0, errors, per_channel))
    if not named:
        assert alerts == [], name
        return
    (alert,) = alerts
    assert alert.source == named[0] and alert.severity == "warning", name
    assert f"{len(named)} layer(s)" in alert.message and all(n in alert.message for n in named), name
    assert fix in alert.message, name


# -- calibration (issue 44): each statistic judged against the noise of what it compares ------------------------
def test_an_end_to_end_change_within_its_own_noise_is_not_an_alert():
    ok = {"a": 1e-4, "b": 1e-4, "c": 2e-4}
    # a contrastive loss INT8 moves up on one batch and down on the other: 6% on average, 5% standard error
    noisy = QuantizationErrorRule()
    assert noisy.judge(StepContext(0, 0), _quant(0.06, ok, ok, change_noise=0.05)) == []
    assert noisy.peaks["quantization_error"] == pytest.approx(0.06 / (2 * 0.05))  # the bound that decided
    # the same change, consistent over the batches: an alert that quotes its significance
    (alert,) = QuantizationErrorRule().judge(StepContext(0, 0), _quant(0.06, ok, ok, change_noise=0.005))
    assert alert.source == "end_to_end" and "12.0 standard errors" in alert.message


def test_a_continuous_tail_of_layer_errors_is_not_a_layer_out_of_line():
    # a deep ReLU stack (calibration's healthy_deep_relu): 70 layers, the deepest rising to 11x the median
    errors = [1e-4 * 1.01**i for i in range(35)] + [1.5e-4 * 1.08**j for j in range(35)]  # 1.1x steps at most
    tail = {f"net.{i}.fc1": e for i, e in enumerate(errors)}
    assert max(errors) > 10 * statistics.median(errors) and max(errors) > 1e-3
    assert QuantizationErrorRule().judge(StepContext(0, 0), _quant(0.001, tail, tail)) == []
    # one of them with an outlier weight stands far above the tail: named
    broken = {**tail, "net.40.fc1": 0.5}
    (alert,) = QuantizationErrorRule().judge(StepContext(0, 0), _quant(0.001, broken, tail))
    assert alert.source == "net.40.fc1" and "1 layer(s)" in alert.message


def test_an_outlier_layer_and_the_layer_it_feeds_two_bad_of_five():
    # the probe test's broken ReluNet: the outlier weight's layer and the next one both lose precision
    errors = {"net.0": 7e-5, "net.3": 1.3e-4, "net.5": 0.83, "net.7": 3e-3, "net.9": 7.7e-3}
    (alert,) = QuantizationErrorRule().judge(StepContext(0, 0), _quant(0.0, errors, errors))
    assert alert.source == "net.5" and "1 layer(s)" in alert.message  # net.9 (2.6x the median) is not


def test_the_sharp_minimum_margin_is_the_statistic_that_decides():
    rule = SharpMinimumRule(threshold=0.3, patience=3)
    for i, gap in enumerate([0.67, 0.21, 0.13, 0.09, 0.09]):  # calibration's healthy_denoiser: one sharp probe
        assert rule.judge(StepContext(i, i), _sharp(gap)) == []
    assert rule.peaks["sharp_minimum"] == pytest.approx(0.13 / 0.3)  # the smallest of 3 probes, at its largest
    resumed = SharpMinimumRule(threshold=0.3, patience=3)
    resumed.load_state_dict(rule.state_dict())
    assert resumed.recent == rule.recent == [0.13, 0.09, 0.09]
