"""Every logger without mixing runs, alerts where the user looks, the user's step axis (issue 24).

Real loggers: ``WandbLogger`` offline, ``MLFlowLogger`` on a sqlite store, ``CSVLogger``; real ``Trainer.fit`` runs.
"""

from __future__ import annotations

import csv
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers import CSVLogger

from lightning_diag import AnomalyAlarm, GradientFlowMonitor
from lightning_diag.core.alerts import read_alerts
from lightning_diag.report import build_report, find_runs
from tests.output.logger_models import FAST, Regression, TwoOptimizers, fit

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", os.environ.get("TMPDIR", "/tmp"))
    torch.set_num_threads(1)


def _diag_dirs(root: Path) -> list[Path]:
    return sorted(p.parent for p in root.rglob("diag/thresholds.json"))


def _check_two_runs(root: Path, first_has_nan: bool = True) -> None:
    dirs = _diag_dirs(root)
    assert len(dirs) == 2, dirs
    runs = find_runs(root)
    assert sorted(runs) == sorted(d.parent for d in dirs)
    reports = {r.run.path: r for r in build_report(root)}
    assert set(reports) == set(runs)
    nan_runs = [p for p, r in reports.items() if any(a.rule == "nonfinite_loss" for a in r.run.alerts)]
    assert len(nan_runs) == (1 if first_has_nan else 0)


# -- W&B --------------------------------------------------------------------------------------------------------


def test_wandb_two_fits_in_one_process_get_their_own_diag_folder(tmp_path, monkeypatch, caplog):
    pytest.importorskip("wandb")
    import wandb

    sent: list[dict] = []
    monkeypatch.setattr(wandb.Run, "alert", lambda self, **kw: sent.append(kw), raising=True)
    tables: list[dict] = []
    from pytorch_lightning.loggers import WandbLogger

    real_log_table = WandbLogger.log_table

    def spy_table(self, key, columns=None, data=None, dataframe=None, step=None):
        tables.append({"key": key, "columns": columns, "data": data})
        return real_log_table(self, key, columns=columns, data=data, dataframe=dataframe, step=step)

    monkeypatch.setattr(WandbLogger, "log_table", spy_table)
    with caplog.at_level(logging.INFO, logger="lightning_diag"):
        _, first, alarm = fit("wandb", str(tmp_path), nan_at=2)
        _, second, _ = fit("wandb", str(tmp_path))
    assert first.version != second.version
    dirs = _diag_dirs(tmp_path)
    assert dirs == sorted(tmp_path / "diagtest" / v / "diag" for v in (first.version, second.version))
    # the NaN is in the first run only
    assert [a.rule for a in read_alerts(tmp_path / "diagtest" / first.version / "diag" / "alerts.jsonl")] == [
        "nonfinite_loss"
    ]
    assert not (tmp_path / "diagtest" / second.version / "diag" / "alerts.jsonl").exists()
    _check_two_runs(tmp_path)
    # printed once per fit, and recorded in the run config
    printed = [r.getMessage() for r in caplog.records if "diagnostics of this run" in r.getMessage()]
    assert len(printed) == 2 and str(dirs[0]) in " ".join(printed)
    # critical alerts go through wandb.Run.alert; the table holds every alert of the fit
    assert len(sent) == 1 and "nonfinite_loss" in sent[0]["title"] and sent[0]["level"] == "ERROR"
    assert tables and tables[-1]["key"] == "diag/alerts_table"
    assert [row[3] for row in tables[-1]["data"]] == [a.rule for a in alarm.alerts]


def test_wandb_config_records_the_diag_folder(tmp_path):
    pytest.importorskip("wandb")
    from lightning_diag.output.logger_sinks import DIAG_DIR_CONFIG_KEY
    from tests.output.logger_models import make_logger

    logger = make_logger("wandb", str(tmp_path))
    trainer = pl.Trainer(max_steps=2, logger=logger, default_root_dir=tmp_path, callbacks=[AnomalyAlarm()], **FAST)
    trainer.fit(Regression())
    assert logger.experiment.config[DIAG_DIR_CONFIG_KEY] == str(tmp_path / "diagtest" / logger.version / "diag")
    logger.experiment.finish()


# -- MLflow -----------------------------------------------------------------------------------------------------


def test_mlflow_two_fits_get_their_own_folder_tag_and_artifacts(tmp_path):
    pytest.importorskip("mlflow")
    pytest.importorskip("sqlalchemy")
    from mlflow.tracking import MlflowClient

    from lightning_diag.output.logger_sinks import DIAG_DIR_TAG

    seen_at_alert: list[list[str]] = []
    client_holder: dict = {}

    def on_alert(alert):
        # the sink uploads before the handlers run: the artifacts are there at the critical alert
        lg = client_holder["logger"]
        seen_at_alert.append(sorted(os.path.basename(f.path) for f in lg.experiment.list_artifacts(lg.run_id, "diag")))

    from tests.output import logger_models

    real_make = logger_models.make_logger

    def make_and_keep(kind, root):
        client_holder["logger"] = real_make(kind, root)
        return client_holder["logger"]

    logger_models.make_logger = make_and_keep
    try:
        _, first, _ = fit("mlflow", str(tmp_path), nan_at=2, on_alert=on_alert)
        _, second, _ = fit("mlflow", str(tmp_path))
    finally:
        logger_models.make_logger = real_make
    assert first.run_id != second.run_id
    assert seen_at_alert == [["alerts.jsonl", "report.md", "thresholds.json"]]
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    for lg in (first, second):
        diag = tmp_path / lg.experiment_id / lg.run_id / "diag"
        assert client.get_run(lg.run_id).data.tags[DIAG_DIR_TAG] == str(diag)
        names = sorted(os.path.basename(f.path) for f in client.list_artifacts(lg.run_id, "diag"))
        expected = ["alerts.jsonl", "report.md", "thresholds.json"] if lg is first else ["report.md", "thresholds.json"]
        assert names == expected
    download = tmp_path.parent / f"{tmp_path.name}_download"
    report = Path(client.download_artifacts(first.run_id, "diag/report.md", str(download))).read_text()
    assert "nonfinite_loss" in report and "FAIL" in report
    _check_two_runs(tmp_path)


@pytest.mark.parametrize("kind", ["wandb", "mlflow"])
def test_two_processes_get_their_own_diag_folder(tmp_path, kind):
    pytest.importorskip(kind)
    if kind == "mlflow":
        pytest.importorskip("sqlalchemy")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    script = str(ROOT / "tests" / "output" / "logger_models.py")
    for args in (["2"], []):
        done = subprocess.run(
            [sys.executable, script, kind, str(tmp_path), *args], env=env, cwd=tmp_path, capture_output=True,
            text=True, timeout=300,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        assert "diagnostics of this run:" in done.stderr
    _check_two_runs(tmp_path)


# -- on_alert -----------------------------------------------------------------------------------------------------


def test_on_alert_receives_each_alert(tmp_path):
    received = []
    alarm = AnomalyAlarm(on_alert=received.append, on_nonfinite="warn")
    trainer = pl.Trainer(max_steps=5, logger=False, default_root_dir=tmp_path, callbacks=[alarm], **FAST)
    trainer.fit(Regression(nan_at=2))
    assert received and received == alarm.alerts
    assert received == read_alerts(tmp_path / "diag" / "alerts.jsonl")


def test_a_raising_on_alert_is_reported_once_and_training_completes(tmp_path, caplog):
    calls = []

    def broken(alert):
        calls.append(alert)
        raise ConnectionError("slack is down")

    alarm = AnomalyAlarm(on_alert=broken, on_nonfinite="skip")
    flow = GradientFlowMonitor(on_alert=broken)
    trainer = pl.Trainer(max_steps=6, logger=False, default_root_dir=tmp_path, callbacks=[alarm, flow], **FAST)
    model = Regression(nan_at=2)
    model.nan_at = None
    model.loss = _nan_twice(model.loss)  # two separate non-finite events: two alerts, one report
    with caplog.at_level(logging.WARNING, logger="lightning_diag"):
        trainer.fit(model)
    assert trainer.global_step == 6  # training completed
    assert len(calls) >= 2
    reports = [r for r in caplog.records if "on_alert handler raised" in r.getMessage()]
    assert len(reports) == 1 and "slack is down" in reports[0].getMessage()


def _nan_twice(loss_fn):
    calls = {"n": 0}

    def loss(batch):
        calls["n"] += 1
        value = loss_fn(batch)
        return value * float("nan") if calls["n"] in (2, 5) else value

    return loss


def test_on_alert_must_be_callable():
    with pytest.raises(TypeError, match="on_alert"):
        AnomalyAlarm(on_alert="slack")


# -- the step axis --------------------------------------------------------------------------------------------------


def _steps(path: Path) -> dict[str, set[int]]:
    out: dict[str, set[int]] = {}
    with open(path, newline="") as fh:
        for row in csv.DictReader(fh):
            for key, value in row.items():
                if key != "step" and value not in ("", None):
                    out.setdefault(key, set()).add(int(row["step"]))
    return out


@pytest.mark.parametrize("model_cls", [Regression, TwoOptimizers], ids=["automatic", "manual-two-optimizers"])
def test_diag_series_share_the_users_step_axis_in_csv(tmp_path, model_cls):
    logger = CSVLogger(tmp_path)
    callbacks = [GradientFlowMonitor(log_every_n_steps=1), AnomalyAlarm(log_every_n_steps=1)]
    trainer = pl.Trainer(max_steps=12, logger=logger, log_every_n_steps=1, callbacks=callbacks, **FAST)
    trainer.fit(model_cls())
    steps = _steps(Path(logger.log_dir) / "metrics.csv")
    user = steps["user_loss"]
    batches = 12 if model_cls is Regression else 6
    assert user == set(range(batches))
    assert trainer.global_step == 12  # two optimizer steps per batch in the manual model
    assert steps["diag/grad_norm/total"] == user
    if model_cls is Regression:
        assert steps["diag/loss/train_step"] == user


def test_step_axis_survives_a_resume(tmp_path):
    first = pl.Trainer(max_steps=8, logger=False, default_root_dir=tmp_path, callbacks=[GradientFlowMonitor()], **FAST)
    first.fit(TwoOptimizers())
    ckpt = tmp_path / "mid.ckpt"
    first.save_checkpoint(ckpt)
    assert torch.load(ckpt, weights_only=False)["lightning_diag_step_axis"] == {"stepped": 4}
    logger = CSVLogger(tmp_path / "resumed")
    callbacks = [GradientFlowMonitor(log_every_n_steps=1)]
    second = pl.Trainer(max_steps=16, logger=logger, log_every_n_steps=1, callbacks=callbacks, **FAST)
    second.fit(TwoOptimizers(), ckpt_path=ckpt)
    steps = _steps(Path(logger.log_dir) / "metrics.csv")
    assert steps["user_loss"] == set(range(4, 8))
    assert steps["diag/grad_norm/total"] == steps["user_loss"]


def test_tensorboard_and_csv_keep_their_diag_folder(tmp_path):
    from pytorch_lightning.loggers import TensorBoardLogger

    for logger in (TensorBoardLogger(tmp_path / "tb"), CSVLogger(tmp_path / "csv")):
        trainer = pl.Trainer(max_steps=2, logger=logger, callbacks=[AnomalyAlarm()], **FAST)
        trainer.fit(Regression())
        assert json.loads((Path(logger.log_dir) / "diag" / "thresholds.json").read_text())["callbacks"]


def test_a_second_fit_of_the_same_trainer_continues_the_axis(tmp_path):
    logger = CSVLogger(tmp_path)
    callbacks = [GradientFlowMonitor(log_every_n_steps=1)]
    trainer = pl.Trainer(
        max_epochs=1, limit_train_batches=3, logger=logger, log_every_n_steps=1, callbacks=callbacks, **FAST
    )
    model = TwoOptimizers()
    trainer.fit(model)
    trainer.fit_loop.max_epochs = 2
    trainer.fit(model)
    assert trainer.global_step == 12
    steps = _steps(Path(logger.log_dir) / "metrics.csv")
    assert steps["user_loss"] == set(range(6))
    assert steps["diag/grad_norm/total"] == steps["user_loss"]
