"""rules/data_sample.py and rules/data_loader.py: thresholds, latching, state, messages (table-driven)."""

from __future__ import annotations

import math

import pytest

from lightning_diag.rules.base import StepContext
from lightning_diag.rules.data_sample import DataRules
from lightning_diag.rules.measures import Measures
from lightning_diag.rules.records import DataMeasurement, InputProblem

CTX = StepContext(0, 0)


@pytest.mark.parametrize(
    ("measurement", "expected"),
    [
        (DataMeasurement(), []),
        (DataMeasurement(vocab_kl=0.29), []),
        (DataMeasurement(vocab_kl=0.31, oov_share=0.2), [("data_vocab_shift", "warning", "tokens")]),
        (DataMeasurement(leaked_fraction=0.0, val_samples=100), []),
        (DataMeasurement(leaked_fraction=0.04, leaked=4, val_samples=100), [("data_leakage", "info", "val")]),
        (DataMeasurement(leaked_fraction=0.15, leaked=15, val_samples=100), [("data_leakage", "warning", "val")]),
        (DataMeasurement(label_std={"train": 0.1, "val": 0.2}), [("label_imbalance", "warning", "val")]),
        (DataMeasurement(label_std={"train": math.nan}), []),
        (
            DataMeasurement(
                problems=[
                    InputProblem("train", "x", "nonfinite", 2, (4, 9)),
                    InputProblem("val", "input_ids", "empty", 1, (3,)),
                ]
            ),
            [("data_nonfinite", "critical", "train:x"), ("data_nonfinite", "info", "val:input_ids (empty)")],
        ),
    ],
)
def test_rules_fire_at_their_thresholds(measurement, expected):
    alerts = DataRules().judge(CTX, Measures(data=measurement))
    assert [(a.rule, a.severity.value, a.source) for a in alerts] == expected


def test_latched_until_cleared_and_state_round_trip():
    rules = DataRules()
    bad = DataMeasurement(label_std={"train": 0.3}, label_counts={"train": [90, 10]})
    (alert,) = rules.judge(CTX, Measures(data=bad))
    assert "0: 90%, 1: 10%" in alert.message and alert.threshold == 0.1
    assert rules.judge(CTX, Measures(data=bad)) == []
    restored = DataRules()
    restored.load_state_dict(rules.state_dict())
    assert restored.judge(CTX, Measures(data=bad)) == [] and restored.measurements == 3
    assert restored.judge(CTX, Measures(data=DataMeasurement(label_std={"train": 0.0}))) == []
    assert [a.rule for a in restored.judge(CTX, Measures(data=bad))] == ["label_imbalance"]  # cleared, then again


def test_nonfinite_message_names_key_and_indices_and_clears():
    rules = DataRules()
    problem = InputProblem("train", "pixel_values", "nonfinite", 7, (1, 5, 8, 13, 21))
    (alert,) = rules.judge(CTX, Measures(data=DataMeasurement(problems=[problem])))
    assert "`pixel_values`" in alert.message and "1, 5, 8, 13, 21, ..." in alert.message
    assert rules.judge(CTX, Measures(data=DataMeasurement(problems=[problem]))) == []
    rules.judge(CTX, Measures(data=DataMeasurement()))
    assert len(rules.judge(CTX, Measures(data=DataMeasurement(problems=[problem])))) == 1
