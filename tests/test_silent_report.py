"""The report's silent-error rows ("updates applied", "replicas agree") and the dashboard's series, from real runs."""

import pytest
import torch

from lightning_diag.demo import run_demo
from lightning_diag.output.dashboard import dashboard_layout
from lightning_diag.report import load_run
from lightning_diag.report.checks import diagnose


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _row(log_dir, check_id):
    report = diagnose(load_run(log_dir))
    return next(c for c in report.checks if c.id == check_id)


def test_optimizer_over_a_copy_fails_the_updates_applied_row(tmp_path):
    # 15 steps: measured at 4, 9, 14 (the user's cadence, 5), the 3 measurements update_none's patience needs
    result = run_demo("optimizer_copy", root=str(tmp_path), max_epochs=1, limit_train_batches=15)
    row = _row(result.log_dir, "updates_applied")
    assert row.status == "fail" and row.layer == "Training"
    assert row.measured_value["max"] == 1.0 and "100.0%" in row.measured


def test_a_healthy_run_passes_updates_applied_and_leaves_replicas_not_measured(tmp_path):
    result = run_demo("none", root=str(tmp_path), max_epochs=1, limit_train_batches=12)
    row = _row(result.log_dir, "updates_applied")
    assert row.status == "pass" and row.measured_value["max"] == 0.0
    assert _row(result.log_dir, "replicas_agree").status == "not measured"  # one process: nothing to compare


def test_dashboard_charts_the_update_and_replica_series():
    layout = dashboard_layout({"grad_explode", "update_none", "loss_swing", "ddp_desync"})
    assert sorted(layout) == ["Gradients", "Loss & LR"]  # in the sections of their callbacks
    assert "diag/updates/" in repr(layout["Gradients"]) and "diag/replicas/" in repr(layout["Loss & LR"])
