"""Invalid configuration, table-driven: every constructor argument of every callback (issue 7).

Each error is raised at construction, names the argument and says what is allowed.
"""

import inspect
import math

import pytest

from lightning_diag import AnomalyAlarm, AttentionEntropyMonitor, GradientFlowMonitor

# callback -> argument -> [(bad value, error, what the message must say is allowed)]
INVALID = {
    AnomalyAlarm: {
        "on_alert": [(42, TypeError, "a callable")],
        "on_nonfinite": [
            ("explode", ValueError, "'stop', 'raise', 'skip', 'warn', 'rollback'"),
            (1, TypeError, "'stop'"),
        ],
        "max_skips": [(-1, ValueError, "an int >= 0"), (1.5, TypeError, "an int >= 0")],
        "max_scaler_overflows": [(0, ValueError, "an int >= 1"), ("5", TypeError, "an int >= 1")],
        "swing_threshold": [(0, ValueError, "a number > 0"), ("10%", TypeError, "a number > 0")],
        "swing_patience": [(0, ValueError, "an int >= 1")],
        "swing_min_delta": [(-1.0, ValueError, "a number >= 0"), (math.inf, ValueError, ">= 0")],
        "swing_window": [
            ("step", ValueError, "'epoch' or an int >= 1"),
            (0, ValueError, "'epoch' or an int >= 1"),
            (True, TypeError, "'epoch' or an int >= 1"),
            (2.5, TypeError, "'epoch' or an int >= 1"),
        ],
        "monitor": [("", TypeError, "a non-empty metric name"), (3, TypeError, "a non-empty metric name")],
        "mode": [("down", ValueError, "'min', 'max'")],
        "val_decline_patience": [(0, ValueError, "an int >= 1")],
        "val_decline_min_delta": [(math.nan, ValueError, "a number >= 0")],
        "val_fluctuation_ratio": [(-2, ValueError, "a number > 0")],
        "val_fluctuation_window": [(2, ValueError, "an int >= 3")],
        "val_fluctuation_min": [(-0.1, ValueError, "a number >= 0")],
        "val_fluctuation_min_range": [(-1, ValueError, "a number >= 0")],
        "stagnant_min_drop": [(1.0, ValueError, "a number >= 0 and < 1")],
        "stagnant_patience": [(0, ValueError, "an int >= 1")],
        "locate_nonfinite": [("yes", TypeError, "a bool")],
        "rollback_every_n_steps": [(0, ValueError, "an int >= 1")],
        "rollback_lr_factor": [(0.0, ValueError, "a number > 0 and < 1"), (1.0, ValueError, "a number > 0 and < 1")],
        "max_rollbacks": [(-1, ValueError, "an int >= 0")],
        "rollback_device": [("gpu", ValueError, "'cpu', 'device'")],
        "rollback_snapshots": [(0, ValueError, "an int >= 1")],
        "stagnant_baseline_steps": [(0, ValueError, "an int >= 1")],
        "log_every_n_steps": [(0, ValueError, "an int >= 1"), (1.0, TypeError, "an int >= 1")],
    },
    GradientFlowMonitor: {
        "on_alert": [(42, TypeError, "a callable")],
        "log_every_n_steps": [(0, ValueError, "an int >= 1")],
        "params": [("encoder.*", TypeError, "a list of name patterns or a predicate"), ([1], TypeError, "patterns")],
        "per_parameter": [("yes", TypeError, "True or False")],
        "histogram_every_n_steps": [(-1, ValueError, "an int >= 0")],
        "log_weight_norms": [(1, TypeError, "True or False")],
        "activation_grads": [("head.0", TypeError, "True, False or a list of module-name patterns")],
        "vanish_threshold": [(0, ValueError, "a number > 0")],
        "explode_threshold": [(1e-4, ValueError, "a number > 0.001")],
        "spread_ratio": [(0.5, ValueError, "a number > 1")],
        "collapse_ratio": [(1.5, ValueError, "a number > 0 and < 1"), (0, ValueError, "> 0 and < 1")],
        "patience": [(0, ValueError, "an int >= 1")],
        "baseline_measurements": [(0, ValueError, "an int >= 1")],
        "expect_frozen": [("enc", TypeError, "a list of parameter-name patterns"), ([1], TypeError, "patterns")],
        "warmup_steps": [(-1, ValueError, "an int >= 0")],
        "converged_fraction": [(1.0, ValueError, "a number > 0 and < 1"), (-0.1, ValueError, "> 0 and < 1")],
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
        "entropy_low": [(0, ValueError, "a number > 0")],
        "entropy_high": [(0.1, ValueError, "a number > 0.5")],
        "uniform_fraction": [(2, ValueError, "a number > 0 and <= 1")],
        "warmup_steps": [(-1, ValueError, "an int >= 0")],
        "sink_mass": [(1.0, ValueError, "a number > 0 and < 1")],
        "patience": [(0, ValueError, "an int >= 1")],
    },
}
CASES = [
    pytest.param(callback, argument, value, error, allowed, id=f"{callback.__name__}-{argument}-{value!r}")
    for callback, table in INVALID.items()
    for argument, rows in table.items()
    for value, error, allowed in rows
]


@pytest.mark.parametrize("callback", list(INVALID), ids=lambda c: c.__name__)
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
