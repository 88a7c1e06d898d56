"""Invalid configuration, table-driven: every constructor argument of every callback (issues 7, 20).

Each error is raised at construction, names the argument and says what is allowed.
"""

import dataclasses
import inspect
import math

import pytest

import lightning_diag
from lightning_diag import (
    AnomalyAlarm,
    AttentionEntropyMonitor,
    DataDiagnostics,
    GradientFlowMonitor,
    LossTrendSettings,
    RollbackSettings,
    SystemMonitor,
)
from lightning_diag.core.registry import default_thresholds

# callback -> argument -> [(bad value, error, what the message must say is allowed)]
INVALID = {
    AnomalyAlarm: {
        "desync_every_n_steps": [(0, ValueError, "an int >= 1")],
        "desync_tolerance": [(-1.0, ValueError, "a number >= 0")],
        "on_alert": [(42, TypeError, "a callable")],
        "on_nonfinite": [
            ("explode", ValueError, "'stop', 'raise', 'skip', 'warn', 'rollback'"),
            (1, TypeError, "'stop'"),
        ],
        "max_skips": [(-1, ValueError, "an int >= 0"), (1.5, TypeError, "an int >= 0")],
        "max_scaler_overflows": [(0, ValueError, "an int >= 1"), ("5", TypeError, "an int >= 1")],
        "monitor": [("", TypeError, "a non-empty metric name"), (3, TypeError, "a non-empty metric name")],
        "mode": [("down", ValueError, "'min', 'max'")],
        "locate_nonfinite": [("yes", TypeError, "a bool")],
        "loss_trend": [({"swing_threshold": 0.2}, TypeError, "a LossTrendSettings or None")],
        "rollback": [(RollbackSettings, TypeError, "a RollbackSettings or None")],
        "log_every_n_steps": [(0, ValueError, "an int >= 1"), (1.0, TypeError, "an int >= 1")],
    },
    GradientFlowMonitor: {
        "stale_fraction": [(1.5, ValueError, "a number >= 0 and < 1")],
        "update_sample_size": [(-1, ValueError, "an int >= 0")],
        "on_alert": [(42, TypeError, "a callable")],
        "log_every_n_steps": [(0, ValueError, "an int >= 1")],
        "params": [("encoder.*", TypeError, "a list of name patterns or a predicate"), ([1], TypeError, "patterns")],
        "per_parameter": [("yes", TypeError, "True or False")],
        "histogram_every_n_steps": [(-1, ValueError, "an int >= 0")],
        "log_weight_norms": [(1, TypeError, "True or False")],
        "activation_grads": [("head.0", TypeError, "True, False or a list of module-name patterns")],
        "vanish_threshold": [(0, ValueError, "a number > 0")],
        "explode_threshold": [(1e-4, ValueError, "a number > 0.001")],
        "layer_spread_threshold": [(0.5, ValueError, "a number > 1")],
        "collapse_threshold": [(1.5, ValueError, "a number > 0 and < 1"), (0, ValueError, "> 0 and < 1")],
        "patience": [(0, ValueError, "an int >= 1")],
        "collapse_baseline_measurements": [(0, ValueError, "an int >= 1")],
        "expect_frozen": [("enc", TypeError, "a list of parameter-name patterns"), ([1], TypeError, "patterns")],
        "warmup_steps": [(-1, ValueError, "an int >= 0")],
        "collapse_converged_fraction": [
            (1.0, ValueError, "a number > 0 and < 1"),
            (-0.1, ValueError, "> 0 and < 1"),
        ],
        "logit_projections": [("q_proj", TypeError, "a list of module names"), ([1], TypeError, "module names")],
    },
    AttentionEntropyMonitor: {
        "on_alert": [(42, TypeError, "a callable")],
        "log_every_n_steps": [(0, ValueError, "an int >= 1")],
        "modules": [("attn", TypeError, "a list of module-name patterns")],
        "sample_size": [(0, ValueError, "an int >= 1")],
        "max_queries": [(0, ValueError, "an int >= 1")],
        "special_positions": [("0", TypeError, "a sequence of ints"), ([1.5], TypeError, "a sequence of ints")],
        "special_token_ids": [([True], TypeError, "a sequence of ints")],
        "input_ids": [("input_ids", TypeError, "a callable batch -> tensor")],
        "image_every_n_steps": [(-1, ValueError, "an int >= 0")],
        "entropy_low_threshold": [(0, ValueError, "a number > 0")],
        "entropy_high_threshold": [(0.1, ValueError, "a number > 0.5")],
        "entropy_high_uniform_fraction": [(2, ValueError, "a number > 0 and <= 1")],
        "entropy_high_warmup_steps": [(-1, ValueError, "an int >= 0")],
        "sink_threshold": [(1.0, ValueError, "a number > 0 and < 1")],
        "patience": [(0, ValueError, "an int >= 1")],
    },
    # The renamed thresholds of the other two callbacks (their other arguments: their own test modules).
    DataDiagnostics: {
        "padding_labels": [(-1.0, ValueError, "a number >= 0 and < 1")],
        "length_ratio": [(0.0, ValueError, "a number >= 1")],
        "vocab_shift_threshold": [(-1, ValueError, "a number > 0")],
        "vocab_shift_min_count": [(0, ValueError, "an int >= 1")],
        "leakage_threshold": [(1.5, ValueError, "a number > 0 and <= 1")],
        "leakage_near_duplicate": [("high", TypeError, "a number > 0 and <= 1")],
        "leakage_shingle_size": [(0, ValueError, "an int >= 1 and <= 16")],
        "label_imbalance_threshold": [(0.7, ValueError, "a number > 0 and <= 0.5")],
    },
    SystemMonitor: {
        "dataloader_bound_threshold": [(1.5, ValueError, "a number > 0 and <= 1"), ("x", TypeError, "a number")],
        "dataloader_bound_patience": [(0, ValueError, "an int >= 1")],
        "dataloader_bound_min_wait_s": [(-1.0, ValueError, "a number >= 0")],
        "step_time_periodic_threshold": [(0, ValueError, "a number > 0")],
        "step_time_periodic_slow_ratio": [(0, ValueError, "a number > 0")],
        "step_time_fluctuation_threshold": [(-0.1, ValueError, "a number > 0")],
        "step_time_fluctuation_patience": [(0, ValueError, "an int >= 1")],
        "step_time_fluctuation_block_steps": [(0, ValueError, "an int >= 1")],
        "memory_growth_threshold": [(0, ValueError, "a number > 0")],
        "memory_growth_window": [(2, ValueError, "an int >= 3")],
        "memory_growth_rising_fraction": [(1.5, ValueError, "a number > 0 and <= 1")],
    },
}
#: Callbacks whose table above lists every constructor argument.
COMPLETE = (AnomalyAlarm, GradientFlowMonitor, AttentionEntropyMonitor)

# settings class -> field -> [(bad value, error, what the message must say is allowed)]
SETTINGS_INVALID = {
    LossTrendSettings: {
        "swing_threshold": [(0, ValueError, "a number > 0"), ("10%", TypeError, "a number > 0")],
        "swing_patience": [(0, ValueError, "an int >= 1")],
        "swing_min_delta": [(-1.0, ValueError, "a number >= 0"), (math.inf, ValueError, ">= 0")],
        "swing_window": [
            ("step", ValueError, "'epoch' or an int >= 1"),
            (0, ValueError, "'epoch' or an int >= 1"),
            (True, TypeError, "'epoch' or an int >= 1"),
            (2.5, TypeError, "'epoch' or an int >= 1"),
        ],
        "stagnant_threshold": [(1.0, ValueError, "a number >= 0 and < 1"), ("10%", TypeError, ">= 0 and < 1")],
        "stagnant_patience": [(0, ValueError, "an int >= 1")],
        "stagnant_baseline_steps": [(0, ValueError, "an int >= 1")],
        "val_decline_threshold": [(0, ValueError, "an int >= 1"), (5.0, TypeError, "an int >= 1")],
        "val_decline_min_delta": [(math.nan, ValueError, "a number >= 0")],
        "val_fluctuation_threshold": [(-2, ValueError, "a number > 0")],
        "val_fluctuation_window": [(2, ValueError, "an int >= 3")],
        "val_fluctuation_min": [(-0.1, ValueError, "a number >= 0")],
        "val_fluctuation_min_range": [(-1, ValueError, "a number >= 0")],
        "val_fluctuation_min_rise": [(-1, ValueError, "a number >= 0")],
    },
    RollbackSettings: {
        "every_n_steps": [(0, ValueError, "an int >= 1")],
        "lr_factor": [(0.0, ValueError, "a number > 0 and < 1"), (1.0, ValueError, "a number > 0 and < 1")],
        "max_rollbacks": [(-1, ValueError, "an int >= 0")],
        "device": [("gpu", ValueError, "'cpu', 'device'")],
        "snapshots": [(0, ValueError, "an int >= 1")],
    },
}
CASES = [
    pytest.param(callback, argument, value, error, allowed, id=f"{callback.__name__}-{argument}-{value!r}")
    for callback, table in INVALID.items()
    for argument, rows in table.items()
    for value, error, allowed in rows
]


@pytest.mark.parametrize("callback", COMPLETE, ids=lambda c: c.__name__)
def test_every_constructor_argument_has_a_row(callback):
    assert set(INVALID[callback]) == set(inspect.signature(callback).parameters)


@pytest.mark.parametrize(("callback", "argument", "value", "error", "allowed"), CASES)
def test_invalid_argument_is_rejected_naming_it_and_the_allowed_values(callback, argument, value, error, allowed):
    with pytest.raises(error) as info:
        callback(**{argument: value})
    message = str(info.value)
    assert f"Expected argument `{argument}` to be " in message
    assert allowed in message
    assert f"but got {value!r}" in message


@pytest.mark.parametrize("callback", list(INVALID), ids=lambda c: c.__name__)
def test_defaults_are_valid(callback):
    callback()


@pytest.mark.parametrize("callback", list(INVALID), ids=lambda c: c.__name__)
def test_constructors_are_keyword_only(callback):
    kinds = {p.kind for p in inspect.signature(callback).parameters.values()}
    assert kinds == {inspect.Parameter.KEYWORD_ONLY}
    with pytest.raises(TypeError):
        callback(1)


# -- settings classes ------------------------------------------------------------------------------------------
SETTINGS_CASES = [
    pytest.param(kind, field, value, error, allowed, id=f"{kind.__name__}-{field}-{value!r}")
    for kind, table in SETTINGS_INVALID.items()
    for field, rows in table.items()
    for value, error, allowed in rows
]


@pytest.mark.parametrize("kind", list(SETTINGS_INVALID), ids=lambda c: c.__name__)
def test_every_settings_field_has_a_row(kind):
    assert set(SETTINGS_INVALID[kind]) == {f.name for f in dataclasses.fields(kind)}


@pytest.mark.parametrize(("kind", "field", "value", "error", "allowed"), SETTINGS_CASES)
def test_invalid_setting_is_rejected_at_construction_naming_it(kind, field, value, error, allowed):
    with pytest.raises(error) as info:
        kind(**{field: value})
    message = str(info.value)
    assert f"Expected argument `{field}` to be " in message
    assert allowed in message
    assert f"but got {value!r}" in message


@pytest.mark.parametrize("kind", list(SETTINGS_INVALID), ids=lambda c: c.__name__)
def test_settings_are_frozen_keyword_values_with_the_registry_defaults(kind):
    settings = kind()
    name = next(iter(SETTINGS_INVALID[kind]))
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(settings, name, 1)
    assert kind() == settings and hash(kind()) == hash(settings)
    alarm = AnomalyAlarm(on_nonfinite="rollback")
    expected = default_thresholds("AnomalyAlarm")
    expected.pop("nonfinite_loss.max_skips")  # in force only with on_nonfinite="skip", so left out here
    assert {k: v for k, v in alarm.thresholds().items() if k in expected} == expected


def test_settings_objects_are_passed_and_read_back():
    alarm = AnomalyAlarm(
        on_nonfinite="rollback",
        loss_trend=LossTrendSettings(swing_threshold=0.2, swing_window=100, val_decline_threshold=2),
        rollback=RollbackSettings(every_n_steps=100, lr_factor=0.25),
    )
    values = alarm.thresholds()
    assert values["loss_swing"] == 0.2 and values["loss_swing.window_steps"] == 100.0
    assert values["val_decline"] == 2.0
    assert values["nonfinite_rollback.every_n_steps"] == 100.0 and values["nonfinite_rollback.lr_factor"] == 0.25
    assert alarm.recovery.every_n_steps == 100 and alarm.recovery.rule.lr_factor == 0.25
    assert alarm.trend.swing_rule.threshold == 0.2 and alarm.trend.val_decline_rule.patience == 2
    assert alarm.state_key == "AnomalyAlarm{'monitor': 'val_loss', 'swing_window': 100}"


def test_defaults_are_those_of_before_the_settings_classes():
    alarm = AnomalyAlarm()
    expected = {
        k: v
        for k, v in default_thresholds("AnomalyAlarm").items()
        if not k.startswith("nonfinite_rollback.") and k != "nonfinite_loss.max_skips"  # action-dependent
    }
    assert alarm.thresholds() == {**expected, "val_decline.higher_is_better": 0.0}
    assert alarm.state_key == "AnomalyAlarm{'monitor': 'val_loss', 'swing_window': 'epoch'}"
    assert GradientFlowMonitor().thresholds() == {
        **default_thresholds("GradientFlowMonitor"),
        "grad_vanish.relative": 100.0,
    }
    for callback in (AttentionEntropyMonitor, DataDiagnostics, SystemMonitor):
        assert callback().thresholds() == default_thresholds(callback.__name__)


def test_loss_trend_does_not_read_its_owner():
    from lightning_diag.callbacks.loss_trend import LossTrend

    assert "owner" not in inspect.signature(LossTrend).parameters
    trend = LossTrend(LossTrendSettings(val_fluctuation_min_range=0.5), monitor="val_acc", mode="max")
    assert trend.val_fluctuation_rule.min_range == 0.5 and trend.val_decline_rule.monitor == "val_acc"
    assert not hasattr(trend, "owner")


def test_settings_classes_are_public():
    assert {"LossTrendSettings", "RollbackSettings"} <= set(lightning_diag.__all__)
    assert lightning_diag.RollbackSettings is RollbackSettings
