"""The "Other" rows of rules that measure only in some runs: ``amp_not_applied`` (mixed precision only) and
``loss_outlier`` (after ``window / 2`` steps of history) say "not measured", never PASS, when nothing was checked."""

from __future__ import annotations

import json
from pathlib import Path

from torch.utils.tensorboard import SummaryWriter

from lightning_diag import AnomalyAlarm
from lightning_diag.report.checks import diagnose
from lightning_diag.report.load import load_run


def _run(path: Path, precision: str | None, last_step: int) -> Path:
    writer = SummaryWriter(str(path))
    for step in range(0, last_step + 1, 5):
        writer.add_scalar("diag/loss/train_step", 1.0 / (1 + step), global_step=step)
    writer.close()
    diag = path / "diag"
    diag.mkdir(parents=True, exist_ok=True)
    (diag / "thresholds.json").write_text(json.dumps({"callbacks": {"AnomalyAlarm": AnomalyAlarm().thresholds()}}))
    if precision is not None:
        (diag / "run.json").write_text(json.dumps({"trainer": {"precision": precision}}))
    return path


def _rows(path: Path) -> dict[str, tuple[str, str]]:
    report = diagnose(load_run(path))
    return {c.id: (c.status, c.note or "") for c in report.checks if c.layer == "Other"}


def test_amp_row_is_not_measured_without_mixed_precision(tmp_path):
    rows = _rows(_run(tmp_path / "fp32", "32-true", 100))
    status, note = rows["amp_not_applied"]
    assert status == "not measured" and "precision='32-true'" in note
    assert rows["loss_outlier"][0] == "pass"

    status, note = _rows(_run(tmp_path / "unknown", None, 100))["amp_not_applied"]
    assert status == "not measured" and "not recorded" in note

    assert _rows(_run(tmp_path / "bf16", "bf16-mixed", 100))["amp_not_applied"][0] == "pass"


def test_loss_outlier_row_is_not_measured_before_its_history_is_full(tmp_path):
    status, note = _rows(_run(tmp_path / "short", "32-true", 5))["loss_outlier"]
    assert status == "not measured" and "logged to step 5" in note and "8 steps of history" in note
    assert _rows(_run(tmp_path / "long", "32-true", 20))["loss_outlier"][0] == "pass"
