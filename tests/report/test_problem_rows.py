"""The checklist rows of issue 45's training-problem rules: ``units_alive`` (``dead_units``),
``activations_in_range`` (``activation_saturation``), ``update_size`` (``update_too_small``), ``outputs_vary``
(``output_collapse``) and ``attn_logits_bounded`` (``attn_logit_growth``): what the run measured, pass or fail on the
rules' alerts, and "not measured" naming the callback when it was not attached (a plain Lightning run included)."""

from __future__ import annotations

from pathlib import Path

import pytest
from torch.utils.tensorboard import SummaryWriter

from lightning_diag import AnomalyAlarm, AttentionEntropyMonitor, GradientFlowMonitor
from lightning_diag.core.alerts import Alert, Severity
from lightning_diag.report.checks import diagnose
from lightning_diag.report.load import load_run
from lightning_diag.report.plain import diagnose_plain, map_plain_run
from tests.report.runs import make_run, write_events

ROWS = {
    "units_alive": "dead_units",
    "activations_in_range": "activation_saturation",
    "update_size": "update_too_small",
    "outputs_vary": "output_collapse",
    "attn_logits_bounded": "attn_logit_growth",
}
OWNERS = {
    "units_alive": "GradientFlowMonitor",
    "activations_in_range": "GradientFlowMonitor",
    "update_size": "GradientFlowMonitor",
    "outputs_vary": "AnomalyAlarm",
    "attn_logits_bounded": "AttentionEntropyMonitor",
}

#: Logged every 10 steps (steps 0, 10, 20, 30).
SERIES = {
    "diag/act_dead/net.0": [0.10, 0.20, 0.30, 0.25],
    "diag/act_dead/net.2": [0.05, 0.40, 0.81, 0.78],
    "diag/grad_zero/net.2": [0.02, 0.30, 0.70, 0.66],
    "diag/act_saturated/net.1": [0.05, 0.10, 0.08, 0.06],
    "diag/update_ratio/net.0": [1e-3, 2e-3, 5e-4, 8e-4],
    "diag/update_ratio/net.2": [3e-3, 1e-7, 2e-3, 1e-3],
    "diag/update_ratio/head": [2e-3, 1e-3, 1e-3, 6e-4],
    "diag/attn_logit_growth/encoder.0": [5.0, 12.0, 30.0, 28.0],
    "diag/attn_logit_growth/encoder.1": [4.0, 6.0, 7.0, 9.0],
}


def _thresholds() -> dict:
    return {
        "GradientFlowMonitor": GradientFlowMonitor().thresholds(),
        "AnomalyAlarm": AnomalyAlarm().thresholds(),
        "AttentionEntropyMonitor": AttentionEntropyMonitor().thresholds(),
    }


def _checks(path: Path) -> dict:
    return {c.id: c for c in diagnose(load_run(path)).checks}


def _alert(rule: str, step: int, value: float, source: str) -> Alert:
    return Alert(rule, Severity.WARNING, f"{rule} fired", 0, step, value, 0.5, source)


def test_the_rows_show_what_was_measured_and_pass_without_alerts(tmp_path):
    run = make_run(tmp_path / "run", thresholds=_thresholds())
    write_events(run, SERIES, suffix=".problems")
    checks = _checks(run)
    for row, rule in ROWS.items():
        assert checks[row].rules == (rule,) and checks[row].status == "pass", (row, checks[row])
    assert {checks[r].layer for r in ROWS} == {"Model", "Training"}

    dead = checks["units_alive"]
    assert dead.measured_value == pytest.approx({"max": 0.81, "last": 0.78, "layers": 2.0, "zero_grad_max": 0.70})
    assert "81.0% (`net.2`, step 20)" in dead.measured and "78.0% (`net.2`) at the last" in dead.measured
    assert "exactly-zero gradient entries up to 70.0% (`net.2`)" in dead.measured
    assert "50%" in dead.title and dead.threshold_value == {"value": 0.5}

    saturated = checks["activations_in_range"]
    assert saturated.measured_value == pytest.approx({"max": 0.10, "last": 0.06, "layers": 1.0})

    # per measurement the median over the three layers: 2e-3, 1e-3, 1e-3, 8e-4 -> lowest 8e-4 at step 30
    update = checks["update_size"]
    assert update.measured_value == pytest.approx({"min_median": 8e-4, "last_median": 8e-4, "min_layer": 1e-7})
    assert "lowest layer 1e-07 (`net.2`, step 10)" in update.measured and "(step 30)" in update.measured

    logits = checks["attn_logits_bounded"]
    assert logits.measured_value == pytest.approx({"max": 30.0, "last": 28.0, "modules": 2.0})
    assert "`encoder.0`, step 20" in logits.measured

    # output_collapse logs no series: measured (its thresholds were logged), without a value
    collapse = checks["outputs_vary"]
    assert collapse.measured is None and "not logged as a series" in collapse.note


def test_each_rules_alert_fails_its_row_only(tmp_path):
    alerts = [
        _alert("dead_units", 20, 0.81, "net.2"),
        _alert("output_collapse", 30, 2e-4, "<root>"),
    ]
    run = make_run(tmp_path / "run", alerts=alerts, thresholds=_thresholds())
    write_events(run, SERIES, suffix=".problems")
    checks = _checks(run)
    assert {r: checks[r].status for r in ROWS} == {
        "units_alive": "fail",
        "activations_in_range": "pass",
        "update_size": "pass",
        "outputs_vary": "fail",
        "attn_logits_bounded": "pass",
    }
    assert checks["units_alive"].first_alert_step == 20 and checks["units_alive"].severity == "warning"
    assert "81.0%" in checks["units_alive"].measured  # the measurement stays beside the failure
    assert checks["outputs_vary"].measured == "outputs' spread 0.0002 of their level at step 30 (`<root>`)"


def test_without_their_callbacks_the_rows_are_not_measured_and_name_them(tmp_path):
    # a run with AnomalyAlarm only: the gradient and attention rows name the callbacks that measure them
    run = make_run(tmp_path / "run", thresholds={"AnomalyAlarm": AnomalyAlarm().thresholds()})
    checks = _checks(run)
    for row, owner in OWNERS.items():
        if owner == "AnomalyAlarm":
            assert checks[row].status == "pass"
            continue
        assert checks[row].status == "not measured", row
        assert checks[row].measured is None and f"{owner} was not attached" in checks[row].note, row


def test_a_plain_lightning_run_names_the_callback_that_measures_each_row(tmp_path):
    path = tmp_path / "plain"
    writer = SummaryWriter(str(path))
    for step in range(0, 60, 5):
        writer.add_scalar("train_loss_step", 1.0 / (1 + step), global_step=step)
    writer.close()
    (run,) = [load_run(path)]
    assert map_plain_run(run)
    checks = {c.id: c for c in diagnose_plain(run).checks}
    for row, owner in OWNERS.items():
        assert checks[row].status == "not measured", row
        assert f"{owner} measures it" in checks[row].note, (row, checks[row].note)


def test_damaged_series_leave_the_row_honest(tmp_path):
    # NaN and infinite points are skipped; a row whose every point is non-finite is not measured
    run = make_run(tmp_path / "run", thresholds=_thresholds())
    write_events(run, {"diag/act_dead/net.0": [float("nan"), float("inf")], "diag/act_saturated/t": [0.2]},
                 suffix=".bad")
    checks = _checks(run)
    assert checks["units_alive"].status == "not measured"
    assert checks["activations_in_range"].status == "pass"
    assert checks["activations_in_range"].measured_value["max"] == pytest.approx(0.2)
