import json
import logging

import pytest

from lightning_diag.core.alerts import Alert, AlertLog, Severity, read_alerts
from lightning_diag.rules.catalog import ALL_RULES, LOSS_SWING

FIELDS = {"rule", "severity", "message", "epoch", "global_step", "value", "threshold", "source"}


def make(**kw):
    base = dict(
        rule=LOSS_SWING,
        severity="warning",
        message="m",
        epoch=1,
        global_step=10,
        value=0.2,
        threshold=0.1,
        source="train_loss",
    )
    base.update(kw)
    return Alert(**base)


def test_alert_fields_and_roundtrip():
    a = make()
    assert a.severity is Severity.WARNING and a.severity == "warning"
    d = json.loads(a.to_json())
    assert set(d) == FIELDS
    assert Alert.from_json(a.to_json()) == a


def test_alert_is_frozen():
    with pytest.raises(AttributeError):
        make().rule = "x"  # type: ignore[misc]


def test_invalid_severity():
    with pytest.raises(ValueError):
        make(severity="loud")


def test_nonfinite_value_stays_valid_json():
    line = make(value=float("nan")).to_json()
    assert json.loads(line)["value"] == "nan"


def test_rule_ids_are_the_contract():
    assert set(ALL_RULES) == {
        "nonfinite_loss",
        "nonfinite_grad",
        "nonfinite_rollback",
        "loss_swing",
        "val_decline",
        "val_fluctuation",
        "grad_vanish",
        "grad_explode",
        "grad_layer_spread",
        "grad_collapse",
        "grad_frozen",
        "loss_stagnant",
        "attn_entropy_low",
        "attn_entropy_high",
        "attn_sink",
        "data_vocab_shift",
        "data_leakage",
        "label_imbalance",
        "data_nonfinite",
        "sharp_minimum",
        "quantization_error",
        "dataloader_bound",
        "step_time_periodic",
        "step_time_fluctuation",
        "memory_growth",
        "error_cluster",
        "robustness_drop",
        "update_none",
        "update_stale",
        "grad_not_zeroed",
        "ddp_desync",
        "eval_mode_in_training",
        "loss_on_padding",
        "position_overflow",
        "train_override_bypassed",
        "eval_randomness",
        "amp_not_applied",
        "loss_outlier",
        "eval_before_training",
        "batch_size_mismatch",
        "worker_rng_shared",
        "zero_output",
        "dead_units",
        "activation_saturation",
        "update_too_small",
        "output_collapse",
        "attn_logit_growth",
    }


def test_alert_log_appends_flushes_and_logs(tmp_path, caplog):
    path = tmp_path / "diag" / "alerts.jsonl"
    seen = []
    log = AlertLog(path, text_sink=seen.append)
    with caplog.at_level(logging.WARNING, logger="lightning_diag"):
        log.write(make())
        # flushed at once: readable before close
        assert len(path.read_text().splitlines()) == 1
        log.write([make(global_step=11), make(global_step=12, severity="critical")])
    log.close()
    alerts = read_alerts(path)
    assert [a.global_step for a in alerts] == [10, 11, 12]
    assert len(seen) == 3
    assert sum("loss_swing" in r.getMessage() for r in caplog.records) == 3


def test_disabled_log_writes_nothing(tmp_path):
    path = tmp_path / "alerts.jsonl"
    AlertLog(path, enabled=False).write(make())
    assert not path.exists()


def test_read_alerts_ignores_torn_line(tmp_path):
    path = tmp_path / "alerts.jsonl"
    path.write_text(make().to_json() + "\n" + make().to_json()[:20])
    assert len(read_alerts(path)) == 1
