"""Invalid configuration, table-driven: every constructor argument of every callback, and every rule field set
through ``rules=`` (issues 7, 20, 33).

Each error is raised at construction, names the argument (or the ``rules[...]`` field) and says what is allowed.
"""

import inspect
import math

import pytest
import pytorch_lightning as pl

import lightning_diag
from lightning_diag import (
    AnomalyAlarm,
    AttentionEntropyMonitor,
    DataDiagnostics,
    GradientFlowMonitor,
    SystemMonitor,
)
from lightning_diag.core.registry import RULES, default_thresholds, rules_of

# callback -> argument -> [(bad value, error, what the message must say is allowed)]
INVALID = {
    AnomalyAlarm: {
        "on_alert": [(42, TypeError, "a callable")],
        "on_nonfinite": [
            ("explode", ValueError, "'stop', 'raise', 'skip', 'warn', 'rollback'"),
            (1, TypeError, "'stop'"),
        ],
        "monitor": [("", TypeError, "a non-empty metric name"), (3, TypeError, "a non-empty metric name")],
        "mode": [("down", ValueError, "'min', 'max'")],
        "locate_nonfinite": [("yes", TypeError, "a bool")],
        "swing_window": [
            ("step", ValueError, "'epoch' or an int >= 1"),
            (0, ValueError, "'epoch' or an int >= 1"),
            (True, TypeError, "'epoch' or an int >= 1"),
            (2.5, TypeError, "'epoch' or an int >= 1"),
        ],
        "rollback_device": [("gpu", ValueError, "'cpu', 'device'")],
        "log_every_n_steps": [(0, ValueError, "an int >= 1"), (1.0, TypeError, "an int >= 1")],
        "rules": [(3, TypeError, "a mapping of rule id to {field: value}")],
    },
    GradientFlowMonitor: {
        "on_alert": [(42, TypeError, "a callable")],
        "log_every_n_steps": [(0, ValueError, "an int >= 1")],
        "params": [("encoder.*", TypeError, "a list of name patterns or a predicate"), ([1], TypeError, "patterns")],
        "per_parameter": [("yes", TypeError, "True or False")],
        "histogram_every_n_steps": [(-1, ValueError, "an int >= 0")],
        "log_weight_norms": [(1, TypeError, "True or False")],
        "activation_grads": [("head.0", TypeError, "True, False or a list of module-name patterns")],
        "expect_frozen": [("enc", TypeError, "a list of parameter-name patterns"), ([1], TypeError, "patterns")],
        "logit_projections": [("q_proj", TypeError, "a list of module names"), ([1], TypeError, "module names")],
        "rules": [(["grad_vanish"], TypeError, "a mapping of rule id to {field: value}")],
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
        "rules": [("attn_sink", TypeError, "a mapping of rule id to {field: value}")],
    },
    SystemMonitor: {
        "on_alert": [(42, TypeError, "a callable")],
        "log_every_n_steps": [(0, ValueError, "an int >= 1")],
        "nvml": [(1, TypeError, "a bool")],
        "time_callbacks": [("yes", TypeError, "a bool")],
        "overhead_sample_every": [(0, ValueError, "an int >= 1"), (2.0, TypeError, "an int >= 1")],
        "rules": [(3, TypeError, "a mapping of rule id to {field: value}")],
    },
}
#: Callbacks whose table above lists every constructor argument.
COMPLETE = (AnomalyAlarm, GradientFlowMonitor, AttentionEntropyMonitor, SystemMonitor)

# (callback, rule id or family, field, bad value, error, what the message must say is allowed)
RULE_INVALID = [
    (AnomalyAlarm, "ddp_desync", "every_n_steps", 0, ValueError, "an int >= 1"),
    (AnomalyAlarm, "ddp_desync", "threshold", -1.0, ValueError, "a number >= 0"),
    (AnomalyAlarm, "nonfinite_loss", "max_skips", -1, ValueError, "an int >= 0"),
    (AnomalyAlarm, "nonfinite_loss", "max_skips", 1.5, TypeError, "an int >= 0"),
    (AnomalyAlarm, "nonfinite_grad", "max_scaler_overflows", 0, ValueError, "an int >= 1"),
    (AnomalyAlarm, "nonfinite_grad", "max_scaler_overflows", "5", TypeError, "an int >= 1"),
    (AnomalyAlarm, "loss_swing", "threshold", 0, ValueError, "a number > 0"),
    (AnomalyAlarm, "loss_swing", "threshold", "10%", TypeError, "a number > 0"),
    (AnomalyAlarm, "loss_swing", "patience", 0, ValueError, "an int >= 1"),
    (AnomalyAlarm, "loss_swing", "min_delta", -1.0, ValueError, "a number >= 0"),
    (AnomalyAlarm, "loss_swing", "min_delta", math.inf, ValueError, ">= 0"),
    (AnomalyAlarm, "loss_stagnant", "threshold", 1.0, ValueError, "a number >= 0 and < 1"),
    (AnomalyAlarm, "loss_stagnant", "patience", 0, ValueError, "an int >= 1"),
    (AnomalyAlarm, "loss_stagnant", "baseline_steps", 0, ValueError, "an int >= 1"),
    (AnomalyAlarm, "val_decline", "threshold", 0, ValueError, "an int >= 1"),
    (AnomalyAlarm, "val_decline", "threshold", 5.5, TypeError, "an int >= 1"),
    (AnomalyAlarm, "val_decline", "min_delta", math.nan, ValueError, "a number >= 0"),
    (AnomalyAlarm, "val_fluctuation", "threshold", -2, ValueError, "a number > 0"),
    (AnomalyAlarm, "val_fluctuation", "window", 2, ValueError, "an int >= 3"),
    (AnomalyAlarm, "val_fluctuation", "min", -0.1, ValueError, "a number >= 0"),
    (AnomalyAlarm, "val_fluctuation", "min_range", -1, ValueError, "a number >= 0"),
    (AnomalyAlarm, "val_fluctuation", "min_rise", -1, ValueError, "a number >= 0"),
    (AnomalyAlarm, "nonfinite_rollback", "every_n_steps", 0, ValueError, "an int >= 1"),
    (AnomalyAlarm, "nonfinite_rollback", "lr_factor", 1.0, ValueError, "a number > 0 and < 1"),
    (AnomalyAlarm, "nonfinite_rollback", "max_rollbacks", -1, ValueError, "an int >= 0"),
    (AnomalyAlarm, "nonfinite_rollback", "snapshots", 0, ValueError, "an int >= 1"),
    (AnomalyAlarm, "loss_outlier", "threshold", 0, ValueError, "a number > 0"),
    (AnomalyAlarm, "loss_outlier", "ratio", 1.0, ValueError, "a number > 1"),
    (AnomalyAlarm, "loss_outlier", "window", 3, ValueError, "an int >= 4"),
    (AnomalyAlarm, "amp_not_applied", "threshold", 1.0, ValueError, "a number > 0 and < 1"),
    (AnomalyAlarm, "loss_stagnant", "alpha", 0.0, ValueError, "a number > 0 and < 1"),
    (AnomalyAlarm, "loss_stagnant", "min_steps", -1, ValueError, "an int >= 0"),
    (AnomalyAlarm, "loss_stagnant", "min_trend", -0.1, ValueError, "a number >= 0"),
    (AnomalyAlarm, "loss_swing", "z", 0, ValueError, "a number > 0"),
    (AnomalyAlarm, "loss_swing", "lr_ratio", 0.5, ValueError, "a number >= 1"),
    (GradientFlowMonitor, "update_stale", "threshold", 1.5, ValueError, "a number >= 0 and < 1"),
    (GradientFlowMonitor, "update_none", "sample_size", -1, ValueError, "an int >= 0"),
    (GradientFlowMonitor, "grad_vanish", "threshold", 0, ValueError, "a number > 0"),
    (GradientFlowMonitor, "grad_explode", "threshold", -1e-4, ValueError, "a number > 0"),
    (GradientFlowMonitor, "grad_layer_spread", "threshold", 0.5, ValueError, "a number > 1"),
    (GradientFlowMonitor, "grad_collapse", "threshold", 1.5, ValueError, "a number > 0 and < 1"),
    (GradientFlowMonitor, "grad_collapse", "baseline_measurements", 0, ValueError, "an int >= 1"),
    (GradientFlowMonitor, "grad_collapse", "converged_fraction", 1.0, ValueError, "a number > 0 and < 1"),
    (GradientFlowMonitor, "grad", "patience", 0, ValueError, "an int >= 1"),
    (GradientFlowMonitor, "grad", "warmup_steps", -1, ValueError, "an int >= 0"),
    (AttentionEntropyMonitor, "attn_entropy_low", "threshold", 0, ValueError, "a number > 0"),
    (AttentionEntropyMonitor, "attn_entropy_high", "uniform_fraction", 2, ValueError, "a number > 0 and <= 1"),
    (AttentionEntropyMonitor, "attn_entropy_high", "warmup_steps", -1, ValueError, "an int >= 0"),
    (AttentionEntropyMonitor, "attn_sink", "threshold", 1.0, ValueError, "a number > 0 and < 1"),
    (AttentionEntropyMonitor, "attn", "patience", 0, ValueError, "an int >= 1"),
    (DataDiagnostics, "loss_on_padding", "threshold", -1.0, ValueError, "a number >= 0 and < 1"),
    (DataDiagnostics, "position_overflow", "threshold", 0.0, ValueError, "a number >= 1"),
    (DataDiagnostics, "data_vocab_shift", "threshold", -1, ValueError, "a number > 0"),
    (DataDiagnostics, "data_vocab_shift", "min_count", 0, ValueError, "an int >= 1"),
    (DataDiagnostics, "data_leakage", "threshold", 1.5, ValueError, "a number > 0 and <= 1"),
    (DataDiagnostics, "data_leakage", "near_duplicate", "high", TypeError, "a number > 0 and <= 1"),
    (DataDiagnostics, "data_leakage", "shingle_size", 0, ValueError, "an int >= 1 and <= 16"),
    (DataDiagnostics, "label_imbalance", "threshold", 0.7, ValueError, "a number > 0 and <= 0.5"),
    (SystemMonitor, "dataloader_bound", "threshold", 1.5, ValueError, "a number > 0 and <= 1"),
    (SystemMonitor, "dataloader_bound", "threshold", "x", TypeError, "a number"),
    (SystemMonitor, "dataloader_bound", "patience", 0, ValueError, "an int >= 1"),
    (SystemMonitor, "dataloader_bound", "min_wait_s", -1.0, ValueError, "a number >= 0"),
    (SystemMonitor, "step_time_periodic", "threshold", 0, ValueError, "a number > 0"),
    (SystemMonitor, "step_time_periodic", "slow_ratio", 0, ValueError, "a number > 0"),
    (SystemMonitor, "step_time_periodic", "window", 29, ValueError, "an int >= 30"),
    (SystemMonitor, "step_time_fluctuation", "threshold", -0.1, ValueError, "a number > 0"),
    (SystemMonitor, "step_time_fluctuation", "patience", 0, ValueError, "an int >= 1"),
    (SystemMonitor, "step_time_fluctuation", "block_steps", 0, ValueError, "an int >= 1"),
    (SystemMonitor, "memory_growth", "threshold", 0, ValueError, "a number > 0"),
    (SystemMonitor, "memory_growth", "window", 2, ValueError, "an int >= 3"),
    (SystemMonitor, "memory_growth", "rising_fraction", 1.5, ValueError, "a number > 0 and <= 1"),
]
CASES = [
    pytest.param(callback, argument, value, error, allowed, id=f"{callback.__name__}-{argument}-{value!r}")
    for callback, table in INVALID.items()
    for argument, rows in table.items()
    for value, error, allowed in rows
]


def _public_callbacks() -> list[type]:
    found = [getattr(lightning_diag, name) for name in lightning_diag.__all__]
    return [c for c in found if isinstance(c, type) and issubclass(c, pl.Callback)]


@pytest.mark.parametrize("callback", COMPLETE, ids=lambda c: c.__name__)
def test_every_constructor_argument_has_a_row(callback):
    assert set(INVALID[callback]) == set(inspect.signature(callback).parameters)


@pytest.mark.parametrize("callback", _public_callbacks(), ids=lambda c: c.__name__)
def test_constructors_take_at_most_ten_arguments_one_of_them_rules(callback):
    """What a callback measures, how often and what it does on an alert; thresholds go through ``rules=``."""
    parameters = inspect.signature(callback).parameters
    assert len(parameters) <= 10, list(parameters)
    assert "rules" in parameters and parameters["rules"].default is None


@pytest.mark.parametrize(("callback", "argument", "value", "error", "allowed"), CASES)
def test_invalid_argument_is_rejected_naming_it_and_the_allowed_values(callback, argument, value, error, allowed):
    with pytest.raises(error) as info:
        callback(**{argument: value})
    message = str(info.value)
    assert f"Expected argument `{argument}` to be " in message
    assert allowed in message
    assert f"but got {value!r}" in message


@pytest.mark.parametrize(
    ("callback", "rule", "field", "value", "error", "allowed"),
    [pytest.param(*row, id=f"{row[0].__name__}-{row[1]}.{row[2]}-{row[3]!r}") for row in RULE_INVALID],
)
def test_invalid_rule_field_is_rejected_naming_it_and_the_allowed_values(callback, rule, field, value, error, allowed):
    with pytest.raises(error) as info:
        callback(rules={rule: {field: value}})
    message = str(info.value)
    assert f"Expected `rules[{rule!r}][{field!r}]` to be " in message
    assert allowed in message
    assert f"but got {value!r}" in message


@pytest.mark.parametrize("callback", _public_callbacks(), ids=lambda c: c.__name__)
def test_unknown_rule_or_field_names_the_allowed_ones(callback):
    owned = [s.rule_id for s in rules_of(callback.__name__)]
    with pytest.raises(ValueError, match=rf"`rules` of {callback.__name__} can name {owned[0]}.*; got 'no_such_rule'"):
        callback(rules={"no_such_rule": {"threshold": 1.0}})
    spec = RULES[owned[0]]
    with pytest.raises(ValueError, match=rf"`rules\['{owned[0]}'\]` can set .*; got 'no_such_field'"):
        callback(rules={owned[0]: {"no_such_field": 1.0}})
    with pytest.raises(TypeError, match=rf"`rules\['{owned[0]}'\]` to be a mapping of field to value"):
        callback(rules={owned[0]: 0.5})
    assert set(spec.fields) <= {"threshold", *spec.settings}


@pytest.mark.parametrize("callback", _public_callbacks(), ids=lambda c: c.__name__)
def test_a_rule_switched_off_raises_nothing_and_reports_no_threshold(callback):
    spec = rules_of(callback.__name__)[0]
    for off in (False, None):
        instance = callback(rules={spec.rule_id: off})
        assert spec.rule_id in instance.rule_choices.off
        assert not any(k == spec.rule_id or k.startswith(f"{spec.rule_id}.") for k in instance.thresholds())
        alert = lightning_diag.Alert(spec.rule_id, spec.severity, "x", 0, 0, None, None, "src")
        assert instance.record([alert]) == [] and instance.alerts == []
    assert callback(rules={spec.rule_id: True}).thresholds() == callback().thresholds()


def test_a_value_set_reaches_the_rule_and_the_thresholds():
    monitor = GradientFlowMonitor(rules={"grad_vanish": {"threshold": 1e-4}, "grad": {"patience": 5}})
    assert monitor.band_rule.vanish_threshold == 1e-4 and monitor.thresholds()["grad.patience"] == 5.0
    alarm = AnomalyAlarm(
        on_nonfinite="rollback",
        swing_window=100,
        rules={"loss_swing": {"threshold": 0.2}, "val_decline": {"threshold": 2},
               "nonfinite_rollback": {"every_n_steps": 100, "lr_factor": 0.25}},
    )
    values = alarm.thresholds()
    assert values["loss_swing"] == 0.2 and values["loss_swing.window_steps"] == 100.0
    assert values["val_decline"] == 2.0
    assert values["nonfinite_rollback.every_n_steps"] == 100.0 and values["nonfinite_rollback.lr_factor"] == 0.25
    assert alarm.recovery.every_n_steps == 100 and alarm.recovery.rule.lr_factor == 0.25
    assert alarm.swing_rule.threshold == 0.2 and alarm.val_decline_rule.patience == 2
    assert alarm.state_key == "AnomalyAlarm{'monitor': 'val_loss', 'swing_window': 100}"


def test_run_time_checks_and_trend_evidence_are_set_like_every_rule():
    """AnomalyAlarm's run-time rules (one module each) and the trend rules' evidence settings reach their rules."""
    alarm = AnomalyAlarm(
        rules={"loss_outlier": {"threshold": 8, "ratio": 3.0, "window": 16}, "amp_not_applied": {"threshold": 0.25},
               "loss_stagnant": {"min_steps": 200, "alpha": 0.01, "min_trend": 0.05},
               "loss_swing": {"z": 3.0, "lr_ratio": 4.0}, "val_decline": {"min_steps": 30},
               "val_fluctuation": {"min_steps": 0},
               "eval_randomness": False}
    )
    assert (alarm.outlier_rule.threshold, alarm.outlier_rule.ratio, alarm.outlier_rule.window) == (8.0, 3.0, 16)
    assert alarm.amp_rule.share == 0.25
    stagnant = alarm.stagnant_rule
    assert (stagnant.min_steps, stagnant.alpha, stagnant.min_trend) == (200, 0.01, 0.05)
    assert (alarm.swing_rule.z, alarm.swing_rule.lr_ratio) == (3.0, 4.0)
    assert alarm.val_decline_rule.min_steps == 30
    assert alarm.val_fluctuation_rule.min_steps == 0
    values = alarm.thresholds()
    assert values["loss_outlier"] == 8.0 and values["loss_outlier.window"] == 16.0
    assert values["loss_stagnant.alpha"] == 0.01 and alarm.rule_choices.off == {"eval_randomness"}
    # a fresh fit rebuilds the declared rules from the same values
    alarm.reset_rules()
    assert alarm.outlier_rule.threshold == 8.0


def test_error_cluster_fields_and_the_significance_level():
    from lightning_diag import ErrorAnalysis

    analysis = ErrorAnalysis(rules={"error_cluster": {"threshold": 4.0, "min_share": 0.1, "min_errors": 20}})
    assert (analysis.rule.ratio, analysis.rule.min_share, analysis.min_errors) == (4.0, 0.1, 20)
    analysis.alpha = 0.001
    assert analysis.rule.alpha == 0.001
    with pytest.raises(ValueError, match="alpha"):
        analysis.alpha = 1.0
    with pytest.raises(ValueError, match=r"rules\['error_cluster'\]\['min_errors'\]"):
        ErrorAnalysis(rules={"error_cluster": {"min_errors": 1}})


@pytest.mark.parametrize("callback", list(INVALID), ids=lambda c: c.__name__)
def test_defaults_are_valid(callback):
    callback()


@pytest.mark.parametrize("callback", list(INVALID), ids=lambda c: c.__name__)
def test_constructors_are_keyword_only(callback):
    kinds = {p.kind for p in inspect.signature(callback).parameters.values()}
    assert kinds == {inspect.Parameter.KEYWORD_ONLY}
    with pytest.raises(TypeError):
        callback(1)


def test_defaults_are_the_registry_defaults():
    alarm = AnomalyAlarm()
    expected = {
        k: v
        for k, v in default_thresholds("AnomalyAlarm").items()
        if not k.startswith("nonfinite_rollback.") and k != "nonfinite_loss.max_skips"  # action-dependent
    }
    assert alarm.thresholds() == {**expected, "val_decline.higher_is_better": 0.0}
    assert alarm.state_key == "AnomalyAlarm{'monitor': 'val_loss', 'swing_window': 'epoch'}"
    for callback in (GradientFlowMonitor, AttentionEntropyMonitor, DataDiagnostics, SystemMonitor):
        assert callback().thresholds() == default_thresholds(callback.__name__)


def test_loss_trend_does_not_read_its_owner():
    from lightning_diag.callbacks.anomaly_alarm.loss_trend import LossTrend

    assert "owner" not in inspect.signature(LossTrend).parameters
    alarm = AnomalyAlarm(monitor="val_acc", mode="max", rules={"val_fluctuation": {"min_range": 0.5}})
    trend = alarm.trend  # handed the alarm's feed and declared sums, whose state the alarm saves
    assert trend.feed == alarm.feed and trend.loss_sums is alarm.loss_sums
    assert trend.fluctuation is alarm.val_fluctuation_rule  # read for the logged scalars only
    assert alarm.val_fluctuation_rule.min_range == 0.5 and alarm.val_decline_rule.monitor == "val_acc"
    assert trend.higher_is_better and not hasattr(trend, "owner")
