"""``lightning-diag report`` on plain Lightning runs (trained without lightning_diag callbacks, issue 46): real
fits with ``TensorBoardLogger`` and ``CSVLogger`` and a ``LearningRateMonitor``, healthy and with a planted fault;
the tag mapping and its override; the summary of a tree of runs; two fits logged into one folder."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from lightning_diag.cli import main
from lightning_diag.report import iter_reports, load_fits
from lightning_diag.report.tag_map import auto_map, parse_overrides

pytestmark = pytest.mark.slow

#: The rows a plain run is judged on, and the "Other" rows it adds.
JUDGED = ("nonfinite", "loss_swing", "val_decline", "val_fluctuation", "loss_stagnant", "loss_outlier")


def _fit(root: Path, fault: str, *, names: tuple[str, str] = ("train_loss", "val_loss"), epochs: int = 8) -> None:
    """A plain fit (2 layers, d 64, 20 steps an epoch, every step logged) into ``root/tb`` and ``root/csv``.

    Faults: ``nan`` (the loss is NaN from step 40 on), ``swing`` (the targets are tripled every other epoch: the
    training loss rises and falls epoch after epoch), ``overfit`` (the validation targets drift away: the
    validation loss worsens every epoch).
    """
    import pytorch_lightning as pl
    import torch
    from pytorch_lightning.callbacks import LearningRateMonitor
    from pytorch_lightning.loggers import CSVLogger, TensorBoardLogger
    from torch.utils.data import DataLoader, TensorDataset

    train_name, val_name = names

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))

        def training_step(self, batch, _):
            x, y = batch
            if fault == "swing" and self.current_epoch % 2 == 1:
                y = 3 * y
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            if fault == "nan" and self.global_step >= 40:
                loss = loss * float("nan")
            self.log(train_name, loss, on_step=True, on_epoch=True)
            return loss

        def validation_step(self, batch, _):
            x, y = batch
            if fault == "overfit":
                y = y + 0.3 * self.current_epoch
            self.log(val_name, torch.nn.functional.mse_loss(self.net(x), y))

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=0.01)

    torch.manual_seed(0)
    x = torch.randn(320, 8, generator=torch.Generator().manual_seed(0))
    data = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=16)
    trainer = pl.Trainer(
        default_root_dir=root,
        logger=[TensorBoardLogger(root, name="tb"), CSVLogger(root, name="csv")],
        callbacks=[LearningRateMonitor()],
        max_epochs=epochs,
        limit_val_batches=4,
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Net(), data, data)


@pytest.fixture(scope="module")
def plain_runs(tmp_path_factory) -> Path:
    """``<root>/<fault>/{tb,csv}/version_0`` for a healthy run and three faults."""
    root = tmp_path_factory.mktemp("plain")
    for fault in ("none", "nan", "swing", "overfit"):
        _fit(root / fault, fault)
    return root


def _runs(path: Path, capsys, *args: str) -> list[dict]:
    assert main(["report", str(path), "--format", "json", *args]) == 0
    return json.loads(capsys.readouterr().out)["runs"]


def _statuses(run: dict) -> dict[str, str]:
    return {c["id"]: c["status"] for c in run["checks"]}


@pytest.mark.parametrize("logger", ["tb", "csv"])
def test_a_healthy_plain_run_has_no_failing_row(plain_runs, capsys, logger):
    (run,) = _runs(plain_runs / "none" / logger, capsys)
    assert run["kind"] == "plain"
    assert run["mapping"] == {
        "train_loss": "train_loss_step",
        "train_loss_epoch": "train_loss_epoch",
        "val_loss": "val_loss",
        "lr": "lr-Adam",
        "epoch": "epoch",
    }
    status = _statuses(run)
    assert {row: status[row] for row in JUDGED} == dict.fromkeys(JUDGED, "pass")
    assert run["alerts"] == [] and run["summary"]["fail"] == 0
    # every other row is not measured, naming the callback that would measure it
    others = {c["id"]: c for c in run["checks"] if c["id"] not in JUDGED}
    assert {c["status"] for c in others.values()} == {"not measured"}
    assert "GradientFlowMonitor measures it" in others["grad_norm_band"]["note"]
    assert "AttentionEntropyMonitor measures it" in others["attn_entropy_band"]["note"]
    assert "DataDiagnostics measures it" in others["data_label_balance"]["note"]


@pytest.mark.parametrize("logger", ["tb", "csv"])
@pytest.mark.parametrize(
    ("fault", "failing", "rule"),
    [
        ("nan", {"nonfinite"}, "nonfinite_loss"),
        ("swing", {"loss_swing"}, "loss_swing"),
        ("overfit", {"val_decline"}, "val_decline"),
    ],
)
def test_a_planted_fault_fails_its_row(plain_runs, capsys, logger, fault, failing, rule):
    (run,) = _runs(plain_runs / fault / logger, capsys)
    status = _statuses(run)
    assert failing <= {row for row in JUDGED if status[row] == "fail"}
    assert rule in {a["rule"] for a in run["alerts"]}
    quiet = {
        "nan": ("loss_swing", "val_decline"),
        "swing": ("nonfinite", "val_decline"),
        "overfit": ("nonfinite", "loss_swing", "loss_outlier"),
    }[fault]
    assert {row: status[row] for row in quiet} != {} and all(status[row] != "fail" for row in quiet)


def test_the_nan_run_names_the_tag_and_the_first_step(plain_runs, capsys):
    (run,) = _runs(plain_runs / "nan" / "tb", capsys)
    check = next(c for c in run["checks"] if c["id"] == "nonfinite")
    assert check["severity"] == "critical" and check["first_alert_step"] == 40
    assert "first: train_loss_step at step 40" in check["measured"]
    first = run["alerts"][0]
    assert first["source"] == "train_loss_step" and "learning rate 0.01" in first["message"]


def test_a_tree_of_runs_gives_one_summary_line_per_run_worst_first(plain_runs, capsys):
    assert main(["report", str(plain_runs)]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith(("| FAIL", "| ok", "| not judged"))]
    assert len(rows) == 8  # four fits, each with a TensorBoard and a CSV run
    verdicts = [r.split(" | ")[0].lstrip("| ") for r in rows]
    assert verdicts[:2] == ["FAIL (critical)"] * 2 and verdicts[-2:] == ["ok"] * 2
    assert all("/nan/" in r for r in rows[:2]) and all("/none/" in r for r in rows[-2:])
    assert "### Checklist" not in out  # the summary alone; --details adds each run's checklist
    assert main(["report", str(plain_runs), "--details"]) == 0
    assert capsys.readouterr().out.count("### Checklist") == 8
    assert main(["report", str(plain_runs), "--fail-on", "critical"]) == 1
    assert "nonfinite_loss" in capsys.readouterr().err


def test_the_mapping_can_be_overridden(tmp_path, capsys):
    _fit(tmp_path, "overfit", names=("objective", "valid/nll"), epochs=7)
    assert main(["report", str(tmp_path)]) == 1  # neither name says loss: nothing to judge, said in one line
    err = capsys.readouterr().err
    assert "no logged loss" in err and "--map train_loss=TAG" in err and len(err.strip().splitlines()) == 1
    maps = ["--map", "train_loss=objective_step", "--map", "val_loss=valid/nll"]
    (run,) = _runs(tmp_path / "tb", capsys, *maps, "--map", "train_loss_epoch=objective_epoch")
    assert run["mapping"] == {
        "train_loss": "objective_step",
        "train_loss_epoch": "objective_epoch",
        "val_loss": "valid/nll",
        "lr": "lr-Adam",
        "epoch": "epoch",
    }
    assert _statuses(run)["val_decline"] == "fail" and _statuses(run)["loss_swing"] == "pass"
    assert _statuses(run)["nonfinite"] == "pass"
    (csv,) = _runs(tmp_path / "csv", capsys, *maps)  # the same override on the CSVLogger run
    assert csv["mapping"]["val_loss"] == "valid/nll" and _statuses(csv)["val_decline"] == "fail"
    # a tag the run did not log: said once, the automatic mapping is kept
    runs = _runs(tmp_path / "tb", capsys, "--map", "val_loss=valid/nll", "--map", "train_loss=nope")
    assert any("--map train_loss=nope: no such scalar" in p for p in runs[0]["problems"])


@pytest.mark.parametrize(
    ("arg", "why"),
    [("val_loss", "expected ROLE=TAG"), ("loss=x", "unknown role 'loss'"), ("val_loss=", "expected ROLE=TAG")],
)
def test_a_bad_map_is_one_line_and_exit_2(tmp_path, capsys, arg, why):
    assert main(["report", str(tmp_path), "--map", arg]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and why in err[0]


def test_a_role_mapped_twice_is_refused():
    with pytest.raises(ValueError, match="val_loss is mapped twice"):
        parse_overrides(["val_loss=a", "val_loss=b"])


@pytest.mark.parametrize(
    ("tags", "expected"),
    [
        (["train_loss", "val_loss", "epoch"], {"train_loss": "train_loss", "val_loss": "val_loss", "epoch": "epoch"}),
        (["loss", "val/loss"], {"train_loss": "loss", "val_loss": "val/loss"}),
        (["train/loss", "valid/loss", "test/loss"], {"train_loss": "train/loss", "val_loss": "valid/loss"}),
        (
            ["my_loss_step", "my_loss_epoch", "val_my_loss"],
            {"train_loss": "my_loss_step", "train_loss_epoch": "my_loss_epoch", "val_loss": "val_my_loss"},
        ),
        (
            ["lr-AdamW/pg1", "lr-AdamW/pg2", "lr-SGD-momentum", "train_loss"],
            {"train_loss": "train_loss", "lr": "lr-AdamW/pg1"},
        ),
        (["accuracy", "val_acc"], {}),
    ],
)
def test_tags_are_mapped_automatically(tags, expected):
    assert auto_map(tags) == expected


def test_two_fits_logged_into_one_folder_are_two_runs(tmp_path, capsys):
    """Two real fits with AnomalyAlarm and ``logger=False`` into one ``default_root_dir``: one healthy, one with
    a NaN loss. Before, the report showed one run (the second fit's points, every step logged twice)."""
    import pytorch_lightning as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_diag import AnomalyAlarm

    class Net(pl.LightningModule):
        def __init__(self, nan_at: int | None) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
            self.nan_at = nan_at

        def training_step(self, batch, _):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            if self.nan_at is not None and self.global_step >= self.nan_at:
                loss = loss * float("nan")
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    x = torch.randn(256, 8, generator=torch.Generator().manual_seed(0))
    data = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=16)
    for nan_at in (None, 30):
        trainer = pl.Trainer(
            default_root_dir=tmp_path,
            logger=False,
            max_steps=48,
            log_every_n_steps=4,
            callbacks=[AnomalyAlarm(on_nonfinite="warn")],
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(Net(nan_at), data)
    fits = load_fits(tmp_path)
    assert [f.fit for f in fits] == ["fit 1 of 2", "fit 2 of 2"]
    assert [[a.rule for a in f.alerts] for f in fits] == [[], ["nonfinite_loss"]]
    for f in fits:  # each fit's own points, each step once
        steps = [s for s, _ in f.scalars["diag/loss/train_step"]]
        assert steps == sorted(set(steps)) and steps[0] < 8
    assert all(math.isfinite(v) for _, v in fits[0].scalars["diag/loss/train_step"])
    runs = _runs(tmp_path, capsys)
    assert [(r["fit"], _statuses(r)["nonfinite"]) for r in runs] == [("fit 1 of 2", "pass"), ("fit 2 of 2", "fail")]
    assert all(any("2 fits were logged into this folder" in p for p in r["problems"]) for r in runs)
    assert [r.run.fit for r in iter_reports(tmp_path)] == ["fit 1 of 2", "fit 2 of 2"]


def test_a_plain_run_gets_its_loss_plot_with_the_findings(plain_runs, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "out"
    assert main(["report", str(plain_runs / "nan" / "tb"), "--format", "html", "--out", str(out)]) == 0
    assert [p.name for p in (out / "lightning-diag-plots").rglob("*.png")] == ["loss.png"]
    assert "A plain Lightning run" in (out / "report.html").read_text()
