"""A diagnostic never ends a fit because its own output failed (issue 36).

Every failure to write (a read-only folder, a full disk) is reported once per path through the ``lightning_diag``
logger, naming the path and the error; the fit completes, the NaN guard stops it at the same step as on a good
disk, the weights are those of the same fit on a good disk, and the user's own logger gets every metric.

Tests run as root, where ``chmod`` stops nothing, so the read-only and the full folder are made three ways: a
regular file where the run's folder would be (every write under it fails with ``ENOTDIR``, as root too), a
writer that raises ``ENOSPC`` (``open`` of :mod:`lightning_diag.core.files`, the alert log's ``write(2)`` and
TensorBoard's file system, patched), and, where mounting is permitted (root with ``CAP_SYS_ADMIN``), a real
read-only tmpfs and a real 64 KiB tmpfs. The first two always run; the mounts add the kernel's own errors.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch

from lightning_diag import AnomalyAlarm, GradientFlowMonitor
from lightning_diag.core import alerts as alerts_module
from lightning_diag.core import files
from lightning_diag.core.alerts import Alert, AlertLog, Severity
from lightning_diag.core.files import report_write_failure, write_json, write_text
from tests.output.logger_models import FAST, MemoryLogger, Regression

NAN_AT = 10


def _fit(root: Path, logger: Any, **alarm_kwargs: Any) -> tuple[pl.Trainer, AnomalyAlarm, dict[str, torch.Tensor]]:
    """A NaN loss at step NAN_AT (by default under ``on_nonfinite="stop"``), with two callbacks writing every
    step."""
    alarm = AnomalyAlarm(log_every_n_steps=1, **alarm_kwargs)
    callbacks = [alarm, GradientFlowMonitor(log_every_n_steps=1)]
    trainer = pl.Trainer(
        max_steps=14, default_root_dir=root, logger=logger, callbacks=callbacks, log_every_n_steps=1, **FAST
    )
    model = Regression(nan_at=NAN_AT)
    trainer.fit(model)
    return trainer, alarm, {k: v.clone() for k, v in model.state_dict().items()}


def _write_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "lightning_diag" and r.levelno == logging.WARNING and "could not write" in r.getMessage()
    ]


def _warned_paths(messages: list[str]) -> list[str]:
    return [m.split("could not write ", 1)[1].split(" (", 1)[0] for m in messages]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The same fit on a good disk, once for the module: where the guard stopped, the weights, the user's metrics."""
    memory = MemoryLogger()
    trainer, alarm, weights = _fit(tmp_path_factory.mktemp("good_disk"), memory)
    assert [a.rule for a in alarm.alerts if a.severity == "critical"] == ["nonfinite_loss"]
    return {
        "step": trainer.global_step,
        "critical": [(a.rule, a.global_step) for a in alarm.alerts if a.severity == "critical"],
        "weights": weights,
        "user_metrics": memory.user_metrics(),  # compared by repr: the NaN step logs a NaN
    }


def _assert_like_the_good_disk(trainer: pl.Trainer, alarm: AnomalyAlarm, weights: Any, reference: Any) -> None:
    assert trainer.should_stop and trainer.global_step == reference["step"]
    assert [(a.rule, a.global_step) for a in alarm.alerts if a.severity == "critical"] == reference["critical"]
    assert all(torch.equal(weights[k], reference["weights"][k]) for k in weights)
    assert all(torch.isfinite(v).all() for v in weights.values())  # the NaN step changed nothing


# --- the policy's helpers ---


def test_write_text_into_a_folder_that_is_a_file_warns_once_and_returns_false(tmp_path, caplog):
    (tmp_path / "diag").write_text("a file where the folder goes")
    target = tmp_path / "diag" / "thresholds.json"
    with caplog.at_level(logging.WARNING, logger="lightning_diag"):
        assert write_json(target, {"a": 1}) is False
        assert write_text(target, "again") is False
    messages = _write_warnings(caplog)
    assert len(messages) == 1 and str(target) in messages[0] and "FileExistsError: [Errno 17]" in messages[0]
    assert "training goes on" in messages[0]


def test_a_failed_write_keeps_the_previous_file_whole_and_leaves_no_temporary(tmp_path, monkeypatch, caplog):
    target = tmp_path / "run.json"
    assert write_text(target, '{"good": true}') is True

    def full_replace(src: str, dst: str) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(files.os, "replace", full_replace)
    with caplog.at_level(logging.WARNING, logger="lightning_diag"):
        assert write_text(target, '{"new": true}') is False
    monkeypatch.undo()
    assert target.read_text() == '{"good": true}' and os.listdir(tmp_path) == ["run.json"]
    (message,) = _write_warnings(caplog)
    assert "[Errno 28] No space left on device" in message and str(target) in message


def test_report_write_failure_is_once_per_path_and_names_each_path(tmp_path, caplog):
    err = OSError(errno.EROFS, os.strerror(errno.EROFS))
    with caplog.at_level(logging.WARNING, logger="lightning_diag"):
        assert report_write_failure(tmp_path / "a", err) is True
        assert report_write_failure(tmp_path / "a", err) is False
        assert report_write_failure(tmp_path / "b", err) is True
    assert _warned_paths(_write_warnings(caplog)) == [str(tmp_path / "a"), str(tmp_path / "b")]


def test_the_alert_log_on_a_full_disk_still_logs_and_hands_on_every_alert(tmp_path, monkeypatch, caplog):
    def full(fd: int, data: bytes) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(alerts_module, "_write_all", full)
    handed: list[Alert] = []
    log = AlertLog(tmp_path / "diag" / "alerts.jsonl", text_sink=handed.append)
    batch = [Alert("r", Severity.WARNING, f"alert {i}", 0, i, None, None, "s") for i in range(3)]
    with caplog.at_level(logging.INFO, logger="lightning_diag"):
        log.write(batch[:2])
        log.write(batch[2])
        log.close()
    assert log.written == batch and handed == batch
    assert sum("alert " in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING) == 3
    assert _warned_paths(_write_warnings(caplog)) == [str(tmp_path / "diag" / "alerts.jsonl")]


# --- real fits ---


def test_a_read_only_run_folder_with_the_users_logger_changes_nothing(tmp_path, caplog, reference):
    """``default_root_dir`` cannot be written (a file stands where it would be, so every write under it fails, as
    root too) and the user's logger writes elsewhere (a remote MLflow or W&B server): the fit is the good disk's."""
    root = tmp_path / "read_only"
    root.write_text("not a folder")
    memory = MemoryLogger()
    with caplog.at_level(logging.WARNING, logger="lightning_diag"):
        trainer, alarm, weights = _fit(root, memory)
    _assert_like_the_good_disk(trainer, alarm, weights, reference)
    assert repr(memory.user_metrics()) == repr(reference["user_metrics"])  # NaN at the NaN step
    assert any(k.startswith("diag/") for _, m in memory.calls for k in m)  # the scalars still reach the logger
    paths = _warned_paths(_write_warnings(caplog))
    diag = root / "memory" / "version_0" / "diag"
    assert sorted(paths) == sorted(str(diag / f) for f in ("", "alerts.jsonl", "run.json", "thresholds.json"))
    assert all(("NotADirectoryError" in m or "FileExistsError" in m) for m in _write_warnings(caplog))


def _enospc(*args: Any, **kwargs: Any) -> Any:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _fill_the_disk(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Every writer of the diagnostics raises ENOSPC (the event file after its first events); returns the count of
    the event file's appends."""
    from tensorboard.compat.tensorflow_stub.io import gfile

    real_append = gfile.LocalFileSystem.append
    appended = {"n": 0}

    def append_until_full(self: Any, *args: Any, **kwargs: Any) -> Any:
        appended["n"] += 1
        if appended["n"] > 2:
            _enospc()
        return real_append(self, *args, **kwargs)

    monkeypatch.setattr(gfile.LocalFileSystem, "append", append_until_full)
    monkeypatch.setattr(files, "open", _enospc, raising=False)
    monkeypatch.setattr(alerts_module, "_write_all", _enospc)
    return appended


def test_a_full_disk_without_a_logger_warns_once_per_file_and_the_guard_still_stops(
    tmp_path, monkeypatch, caplog, capfd, reference
):
    """``logger=False``: the event file is the library's own; every writer raises ENOSPC once the event file
    started (TensorBoard's writer thread included): no traceback, one warning per file, the same fit."""
    appended = _fill_the_disk(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="lightning_diag"):
        trainer, alarm, weights = _fit(tmp_path, False)
    _assert_like_the_good_disk(trainer, alarm, weights, reference)
    assert appended["n"] > 2  # the event file did fill up during the fit
    messages = _write_warnings(caplog)
    paths = _warned_paths(messages)
    assert len(paths) == len(set(paths)) == 4
    assert {os.path.basename(p) for p in paths if "tfevents" not in p} == {
        "alerts.jsonl",
        "run.json",
        "thresholds.json",
    }
    assert all("No space left on device" in m for m in messages)
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Exception in thread" not in err


@pytest.mark.parametrize("on_nonfinite", ["skip", "rollback"])
def test_skip_and_rollback_on_a_full_disk_train_as_on_a_good_disk(tmp_path, monkeypatch, caplog, on_nonfinite):
    """The guard's other actions go on as on a good disk: the same alerts at the same steps, the same weights."""
    kwargs: dict[str, Any] = {"on_nonfinite": on_nonfinite}
    if on_nonfinite == "rollback":
        kwargs["rules"] = {"nonfinite_rollback": {"every_n_steps": 4}}
    good, good_alarm, good_weights = _fit(tmp_path / "good", False, **kwargs)
    _fill_the_disk(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="lightning_diag"):
        full, full_alarm, full_weights = _fit(tmp_path / "full", False, **kwargs)
    assert full.global_step == good.global_step == 14 and not full.should_stop
    expected = "nonfinite_loss" if on_nonfinite == "skip" else "nonfinite_rollback"
    assert expected in {a.rule for a in good_alarm.alerts}
    assert [(a.rule, a.global_step) for a in full_alarm.alerts] == [(a.rule, a.global_step) for a in good_alarm.alerts]
    assert all(torch.equal(full_weights[k], good_weights[k]) for k in good_weights)
    paths = _warned_paths(_write_warnings(caplog))
    assert len(paths) == len(set(paths)) == 4 and all(str(tmp_path / "full") in p for p in paths)


def test_a_tensorboard_writer_that_raises_is_dropped_once_and_the_users_scalars_go_on(tmp_path, caplog):
    """A TensorBoard writer whose calls raise (the user's, on a broken disk) is reported once and no longer fed;
    the other loggers keep every diag scalar."""
    from lightning_diag.output.writer import DiagWriter

    class Broken:
        calls = 0

        def get_logdir(self) -> str:
            return str(tmp_path / "tb")

        def add_summary(self, *args: Any, **kwargs: Any) -> None:
            raise AssertionError("not a SummaryWriter")

        def add_scalar(self, *args: Any, **kwargs: Any) -> None:
            Broken.calls += 1
            _enospc()

        add_text = add_image = add_histogram = add_scalar

    memory = MemoryLogger()
    writer = DiagWriter(Broken(), loggers=[memory])
    with caplog.at_level(logging.WARNING, logger="lightning_diag"):
        for step in range(3):
            writer.scalars({"diag/loss/train_step": float(step)}, step)  # a summary series
            writer.text("diag/t", "text", step)
        writer.close()
    assert Broken.calls == 1 and memory.calls == [(s, {"diag/loss/train_step": float(s)}) for s in range(3)]
    assert _warned_paths(_write_warnings(caplog)) == [str(tmp_path / "tb")]


def test_a_read_only_working_directory_with_a_remote_mlflow_server(tmp_path, caplog, reference):
    """MLflow on a server (here a sqlite store elsewhere: ``save_dir`` is ``None`` either way), the run's folder under
    a ``default_root_dir`` that cannot be written: the fit completes as on a good disk, the user's metrics and the
    run tag reach MLflow, nothing is uploaded that was not written."""
    pytest.importorskip("mlflow")
    pytest.importorskip("sqlalchemy")
    from mlflow.tracking import MlflowClient
    from pytorch_lightning.loggers import MLFlowLogger

    from lightning_diag.output.logger_sinks import DIAG_DIR_TAG

    server = tmp_path / "server"
    server.mkdir()
    uri = f"sqlite:///{server}/mlflow.db"
    logger = MLFlowLogger(tracking_uri=uri, save_dir=None, artifact_location=str(server / "artifacts"))
    root = tmp_path / "read_only_cwd"
    root.write_text("not a folder")
    with caplog.at_level(logging.WARNING, logger="lightning_diag"):
        trainer, alarm, weights = _fit(root, logger)
    _assert_like_the_good_disk(trainer, alarm, weights, reference)
    client = MlflowClient(tracking_uri=uri)
    history = client.get_metric_history(logger.run_id, "user_loss")
    expected = [(step, m["user_loss"]) for step, m in reference["user_metrics"] if "user_loss" in m]
    assert repr(sorted((h.step, h.value) for h in history)) == repr(expected)
    diag = root / logger.experiment_id / logger.run_id / "diag"
    assert client.get_run(logger.run_id).data.tags[DIAG_DIR_TAG] == str(diag)
    assert client.list_artifacts(logger.run_id, "diag") == []
    paths = _warned_paths(_write_warnings(caplog))
    assert sorted(paths) == sorted(str(diag / f) for f in ("", "alerts.jsonl", "run.json", "thresholds.json"))
    assert not any("failed" in r.getMessage() for r in caplog.records)  # the MLflow sink was not dropped


# --- real file systems (mounting needs root with CAP_SYS_ADMIN; the tests above cover the same paths) ---


@contextmanager
def _tmpfs(path: Path, options: str) -> Iterator[None]:
    path.mkdir(parents=True, exist_ok=True)
    if shutil.which("mount") is None or os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (the patched-writer tests cover the same paths)")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"mounting a tmpfs is not permitted here: {done.stderr.decode(errors='replace').strip()}")
    try:
        yield
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)


def test_a_read_only_tmpfs_as_default_root_dir(tmp_path, caplog, capfd, reference):
    root = tmp_path / "ro"
    with _tmpfs(root, "size=1m,ro"), caplog.at_level(logging.WARNING, logger="lightning_diag"):
        memory = MemoryLogger()
        trainer, alarm, weights = _fit(root, memory)
    _assert_like_the_good_disk(trainer, alarm, weights, reference)
    assert repr(memory.user_metrics()) == repr(reference["user_metrics"])  # NaN at the NaN step
    messages = _write_warnings(caplog)
    assert len(messages) == 4 and all("Read-only file system" in m for m in messages)
    assert "Traceback" not in capfd.readouterr().err


def test_a_full_64k_tmpfs_without_a_logger(tmp_path, caplog, capfd, reference):
    root = tmp_path / "full"
    with _tmpfs(root, "size=64k"), caplog.at_level(logging.WARNING, logger="lightning_diag"):
        (root / "ballast").write_bytes(b"\0" * (56 * 1024))  # leaves the diagnostics a few KiB
        trainer, alarm, weights = _fit(root, False)
        written = sorted(p.name for p in (root / "diag").iterdir())
    _assert_like_the_good_disk(trainer, alarm, weights, reference)
    messages = _write_warnings(caplog)
    assert messages and all("No space left on device" in m for m in messages)
    paths = _warned_paths(messages)
    assert len(paths) == len(set(paths)) and any("tfevents" in p for p in paths)
    assert "thresholds.json" in written  # what fitted was written whole
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Exception in thread" not in err
