"""sharp_minimum and quantization_error: table-driven, framework-free."""

import math

import pytest

from lightning_diag.rules.base import StepContext
from lightning_diag.rules.probes import (
    DEFAULT_QUANTIZATION_ERROR_LAYER_RATIO,
    DEFAULT_QUANTIZATION_ERROR_THRESHOLD,
    DEFAULT_SHARP_MINIMUM_PATIENCE,
    DEFAULT_SHARP_MINIMUM_THRESHOLD,
    QuantizationErrorRule,
    SharpMinimumRule,
)


def sharp_fires(gaps, **kwargs):
    rule = SharpMinimumRule(**kwargs)
    return [i for i, g in enumerate(gaps) if rule.update(g, StepContext(i, i))]


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
    rule.update(0.5, StepContext(0, 0))
    rule.update(0.5, StepContext(1, 1))
    resumed = SharpMinimumRule(patience=3)
    resumed.load_state_dict(rule.state_dict())
    (alert,) = resumed.update(0.5, StepContext(2, 2), relative_gap=0.4, rho=0.05, worst_layers=[("fc1", 0.4)])
    assert alert.rule == "sharp_minimum" and alert.source == "model" and "fc1" in alert.message
    with pytest.raises(KeyError, match="streak"):
        SharpMinimumRule().load_state_dict({"latch": []})


def test_quantization_notes_are_quoted_for_named_layers():
    errors = {"a": 1e-4, "b": 1e-4, "c": 0.5}
    notes = {"c": "input channels max/median 80"}
    (alert,) = QuantizationErrorRule().update(None, errors, {}, StepContext(0, 0), notes=notes)
    assert "input channels max/median 80" in alert.message and "higher precision" in alert.message


def test_quantization_end_to_end_and_latch():
    assert (DEFAULT_QUANTIZATION_ERROR_THRESHOLD, DEFAULT_QUANTIZATION_ERROR_LAYER_RATIO) == (0.05, 10.0)
    rule = QuantizationErrorRule()
    ok = {"a": 1e-4, "b": 1e-4, "c": 2e-4}
    fired = [bool(rule.update(e, ok, ok, StepContext(i, i))) for i, e in enumerate([0.01, 0.06, 0.07, 0.02, 0.1])]
    assert fired == [False, True, False, False, True]
    assert rule.update(None, ok, ok, StepContext(9, 9)) == []


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
    alerts = QuantizationErrorRule().update(0.0, errors, per_channel, StepContext(0, 0))
    if not named:
        assert alerts == [], name
        return
    (alert,) = alerts
    assert alert.source == named[0] and alert.severity == "warning", name
    assert f"{len(named)} layer(s)" in alert.message and all(n in alert.message for n in named), name
    assert fix in alert.message, name
