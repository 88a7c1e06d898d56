"""Scalars reach every logger of the trainer; TensorBoard extras go to one TensorBoard writer; nothing twice."""

import csv
import logging
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from unittest.mock import MagicMock

import pytest
import pytorch_lightning as pl
from pytorch_lightning.loggers import CSVLogger, TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader

from lightning_diag import AnomalyAlarm, GradientFlowMonitor
from lightning_diag.output.writer import SUMMARY_SERIES, DiagWriter, logger_series, set_logger_series
from tests.callbacks.tiny import FAST, TinyAttention

DIAG_COLUMNS = {"diag/grad_norm/total", "diag/lr/SGD/group_0", "diag/loss/train_step", "diag/loss/val"}


class LoggingModel(TinyAttention):
    """Logs its own ``train_loss`` at every step, and ``val_loss``: the user's metrics."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss)
        return loss


def fit(tmp_path, loggers, with_callbacks=True):
    callbacks = [GradientFlowMonitor(), AnomalyAlarm()] if with_callbacks else []
    trainer = pl.Trainer(
        max_epochs=1,
        limit_train_batches=6,
        log_every_n_steps=1,
        logger=loggers,
        default_root_dir=tmp_path,
        callbacks=callbacks,
        **FAST,
    )
    trainer.fit(LoggingModel())
    return trainer


def csv_rows(logger):
    with open(f"{logger.log_dir}/metrics.csv", newline="") as fh:
        return list(csv.DictReader(fh))


def user_points(rows):
    """The user's logged values, (column, step, value) in file order."""
    return [(k, r["step"], v) for r in rows for k, v in r.items() if v and k in ("train_loss", "val_loss", "epoch")]


def tensorboard_points(log_dir):
    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    """The same run without lightning_diag: what Lightning logs for the user by itself."""
    root = tmp_path_factory.mktemp("baseline")
    tb, csv_logger = TensorBoardLogger(root, name="tb"), CSVLogger(root, name="csv")
    fit(root, [tb, csv_logger], with_callbacks=False)
    return csv_rows(csv_logger), tensorboard_points(tb.log_dir)


def test_csv_logger_only_gets_diag_columns_and_keeps_the_users_metrics(tmp_path, baseline):
    logger = CSVLogger(tmp_path, name="csv")
    trainer = fit(tmp_path, logger)
    rows = csv_rows(logger)
    assert set(rows[0]) >= DIAG_COLUMNS
    for column in DIAG_COLUMNS:
        steps = [int(r["step"]) for r in rows if r[column]]
        assert steps and len(steps) == len(set(steps)), column  # each point once
    assert [int(r["step"]) for r in rows if r["diag/grad_norm/total"]] == list(range(6))
    # on the user's axis: the validation at the end of the epoch is at the step of the user's val_loss
    assert [int(r["step"]) for r in rows if r["diag/loss/val"]] == [int(r["step"]) for r in rows if r["val_loss"]]
    assert [int(r["step"]) for r in rows if r["diag/loss/train_step"]] == [
        int(r["step"]) for r in rows if r["train_loss"]
    ]
    assert user_points(rows) == user_points(baseline[0])
    # the library's own SummaryWriter (the report reads it) has the same scalars
    points = tensorboard_points(f"{trainer.log_dir}/diag")
    assert [step for step, _ in points["diag/grad_norm/total"]] == list(range(6))


def test_tensorboard_and_csv_each_point_once_and_the_users_metrics_intact(tmp_path, baseline):
    tb, csv_logger = TensorBoardLogger(tmp_path, name="tb"), CSVLogger(tmp_path, name="csv")
    trainer = fit(tmp_path, [tb, csv_logger])
    assert trainer.log_dir == tb.log_dir
    events = EventAccumulator(tb.log_dir)
    events.Reload()
    diag_tags = [t for t in events.Tags()["scalars"] if t.startswith("diag/")]
    assert set(diag_tags) >= DIAG_COLUMNS
    for tag in diag_tags:
        steps = Counter(e.step for e in events.Scalars(tag))
        assert max(steps.values()) == 1, (tag, steps)  # no (tag, step) twice
    assert "diag/thresholds/text_summary" in events.Tags()["tensors"]  # the text (an extra) went to the logger's writer
    assert not list((tmp_path / "tb" / "version_0" / "diag").glob("events.out.*"))  # no second writer
    points = tensorboard_points(tb.log_dir)
    for tag, series in baseline[1].items():  # Lightning's own points for the user, unchanged
        assert points[tag] == series, tag
    rows = csv_rows(csv_logger)
    assert set(rows[0]) >= DIAG_COLUMNS
    assert user_points(rows) == user_points(baseline[0])


def test_for_trainer_routes_scalars_and_extras(tmp_path):
    tb, other = TensorBoardLogger(tmp_path), MagicMock()
    writer = DiagWriter.for_trainer(SimpleNamespace(is_global_zero=True, loggers=[other, tb]), str(tmp_path))
    assert writer.experiment is tb.experiment and writer.loggers == [other] and not writer.owned
    set_logger_series("all", other)
    writer.scalars({"diag/a": 1.0, "diag/b": 2.0}, step=3)
    writer.text("diag/alerts", "x", 3)
    other.log_metrics.assert_called_once_with({"diag/a": 1.0, "diag/b": 2.0}, step=3)
    tb.experiment.flush()
    paths = sorted(Path(tb.log_dir).glob("events.out.tfevents.*"))
    events = [e for path in paths for e in LegacyEventFileLoader(str(path)).Load()]
    written = [(v.tag, v.simple_value, e.step) for e in events for v in e.summary.value if v.HasField("simple_value")]
    # direct, with the exact tags (no logger prefix), in one event
    assert written == [("diag/a", 1.0, 3), ("diag/b", 2.0, 3)]
    assert len([e for e in events if e.summary.value and e.summary.value[0].tag == "diag/a"]) == 1
    assert not other.add_text.called and not other.log_text.called
    writer.flush()
    other.save.assert_called_once_with()
    off_rank = DiagWriter.for_trainer(SimpleNamespace(is_global_zero=False, loggers=[other]), str(tmp_path))
    assert not off_rank.active


def test_a_failing_logger_is_reported_once_and_dropped(caplog):
    broken, good = MagicMock(), MagicMock()
    broken.log_metrics.side_effect = ConnectionError("tracking server down")
    writer = DiagWriter(None, loggers=[broken, good])
    with caplog.at_level(logging.WARNING, logger="lightning_diag"):
        for step in range(3):
            writer.scalar("diag/grad_norm/total", 1.0, step)  # a summary series
    assert [r.getMessage() for r in caplog.records if "tracking server down" in r.getMessage()]
    assert len(caplog.records) == 1 and broken.log_metrics.call_count == 1
    assert good.log_metrics.call_count == 3


# -- which logger gets what (issue 34 item 6) ------------------------------------------------------------------------


def test_summary_for_loggers_that_keep_history_every_series_for_tensorboard(tmp_path):
    csv_logger, tb = CSVLogger(tmp_path, name="csv"), TensorBoardLogger(tmp_path, name="tb")
    chosen, everything = MagicMock(), MagicMock()
    set_logger_series(["diag/grad_norm/*"], chosen)
    set_logger_series("all", everything)
    writer = DiagWriter(None, loggers=[csv_logger, tb, chosen, everything])
    writer.alert_count = lambda: 2
    detail = {f"diag/grad_norm/layer{i}": 1.0 for i in range(40)}
    heads = {f"diag/attn_entropy/blk{i}.attn/head_{h}": 0.5 for i in range(4) for h in range(8)}
    means = {f"diag/attn_entropy/blk{i}.attn/mean": float(i) for i in range(4)}
    row = {"diag/grad_norm/total": 3.0, "diag/lr/AdamW/group_0": 1e-3, **detail, **heads, **means}
    writer.scalars(row, step=4)
    writer.flush()
    header = Path(csv_logger.log_dir, "metrics.csv").read_text().splitlines()[0].split(",")
    diag = {c for c in header if c.startswith("diag/")}
    # the summary: the global norm, the rate, the mean entropy over modules, the alert count; no detail
    assert diag == {"diag/grad_norm/total", "diag/lr/AdamW/group_0", "diag/attn_entropy/mean", "diag/alerts/count"}
    values = csv_rows(csv_logger)[0]
    assert float(values["diag/attn_entropy/mean"]) == pytest.approx(1.5)
    assert float(values["diag/alerts/count"]) == 2
    assert logger_series(tb) == "all" and logger_series(csv_logger) == "summary"
    tb.experiment.flush()
    assert set(tensorboard_points(tb.log_dir)) == set(row)  # TensorBoard: every series, nothing derived
    (chosen_row,), _ = chosen.log_metrics.call_args
    assert set(chosen_row) == {"diag/grad_norm/total", *detail}  # the user's patterns, nothing else
    (every_row,), _ = everything.log_metrics.call_args
    assert set(every_row) == set(row)


def test_summary_is_bounded_and_documented():
    doc = (Path(__file__).resolve().parents[2] / "docs" / "dashboard.md").read_text()
    for pattern in SUMMARY_SERIES:
        assert f"`{pattern}`" in doc, pattern
    assert len(SUMMARY_SERIES) <= 8


@pytest.mark.parametrize(("series", "error"), [("most", ValueError), ([""], TypeError), ([3], TypeError)])
def test_logger_series_rejects_bad_values(series, error):
    with pytest.raises(error, match="series"):
        set_logger_series(series, MagicMock())
