"""Provenance (diag/run.json), `lightning-diag compare` on two runs that differ in learning rate, and `repro`."""

import json
import os

import pytorch_lightning as pl
import torch

from lightning_diag import AnomalyAlarm, GradientFlowMonitor
from lightning_diag.cli import main
from lightning_diag.report.compare import compare_runs, render_comparison
from tests.callbacks.tiny import FAST, TinyAttention


class LrModel(TinyAttention):
    def __init__(self, lr: float = 0.05, samples: int = 64, hf_token: str = "hf_abcdefghijklmnop",
                 wandb_api_key: str = "0123456789abcdef", note: str = "sk-abcdefghijklmnopqrst") -> None:
        super().__init__(samples=samples, repeat=True)  # one batch repeated: smooth curves
        self.save_hyperparameters()
        self.lr = lr

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def fit(root, lr, steps=48):
    pl.seed_everything(0)
    trainer = pl.Trainer(max_steps=steps, default_root_dir=root, log_every_n_steps=2,
                         callbacks=[AnomalyAlarm(log_every_n_steps=2), GradientFlowMonitor(log_every_n_steps=2)],
                         **FAST)
    trainer.fit(LrModel(lr=lr))
    return trainer.log_dir


def test_run_json_holds_the_provenance_and_no_secret(tmp_path, monkeypatch):
    monkeypatch.setenv("MY_SERVICE_PASSWORD", "correct-horse-battery-staple")
    log_dir = fit(tmp_path, 0.05, steps=4)
    text = (tmp_path / "lightning_logs" / "version_0" / "diag" / "run.json").read_text()
    record = json.loads(text)
    assert record["hyperparameters"]["lr"] == 0.05 and record["hyperparameters"]["samples"] == 64
    assert record["trainer"]["max_steps"] == 4 and record["trainer"]["strategy"]
    assert {"python", "torch", "pytorch-lightning", "lightning-diag"} <= set(record["versions"])
    assert record["seed"] == 0
    assert record["data"]["train"]["length"] == 64 and len(record["data"]["train"]["sample_sha256"]) == 16
    assert record["device"] == "cpu"
    for secret in ("hf_abcdefghijklmnop", "0123456789abcdef", "sk-abcdefghijklmnopqrst", "correct-horse"):
        assert secret not in text
    assert "hf_token" not in record["hyperparameters"] and "wandb_api_key" not in record["hyperparameters"]
    assert record["hyperparameters"]["note"] == "<dropped>"
    assert os.path.isdir(log_dir)


def test_the_data_fingerprint_leaves_training_unchanged(tmp_path):
    def weights(with_diag):
        pl.seed_everything(0)
        model = LrModel()
        callbacks = [AnomalyAlarm()] if with_diag else []
        pl.Trainer(max_steps=6, default_root_dir=tmp_path, callbacks=callbacks, logger=False, **FAST).fit(model)
        return model.state_dict()

    plain, diag = weights(False), weights(True)
    assert all(torch.equal(plain[k], diag[k]) for k in plain)


def test_compare_names_the_learning_rate_and_where_the_losses_diverge(tmp_path, capsys):
    a = fit(tmp_path / "a", 0.05)
    b = fit(tmp_path / "b", 0.5)
    comparison = compare_runs([a, b])
    first = next(iter(comparison.differences))
    assert first == "hyperparameters.lr" and comparison.differences[first] == [0.05, 0.5]
    tag, steps = next(iter(comparison.divergence.items()))
    assert tag.startswith("diag/loss/train") and steps[0] is None and steps[1] is not None and steps[1] <= 10
    same = compare_runs([a, a])
    assert same.differences == {} and all(s is None for s in next(iter(same.divergence.values())))
    text = render_comparison(comparison, "md")
    assert "## Provenance differences" in text and "| hyperparameters.lr | 0.05 | 0.5 |" in text
    assert json.loads(render_comparison(comparison, "json"))["differences"]["hyperparameters.lr"] == [0.05, 0.5]
    assert "<table>" in render_comparison(comparison, "html")
    assert main(["compare", a, b]) == 0
    assert "hyperparameters.lr" in capsys.readouterr().out
    assert main(["compare", a]) == 2
    assert main(["compare", a, str(tmp_path / "missing")]) == 2
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["compare", a, str(empty)]) == 1


CONFIG = """
seed_everything: 0
trainer:
  max_epochs: 1
  accelerator: cpu
  default_root_dir: {root}
  enable_progress_bar: false
  enable_model_summary: false
  enable_checkpointing: false
  num_sanity_val_steps: 0
  log_every_n_steps: 1
model:
  class_path: tests.test_compare.LrModel
  init_args:
    samples: 64
"""


def test_repro_runs_a_config_on_a_fraction_with_every_callback(tmp_path, capsys):
    config = tmp_path / "config.yaml"
    config.write_text(CONFIG.format(root=tmp_path))
    assert main(["repro", "--config", str(config), "--fraction", "0.25"]) == 0
    out = capsys.readouterr().out
    assert "# lightning-diag report" in out and "Error concentration" in out
    thresholds = json.loads(next(tmp_path.rglob("thresholds.json")).read_text())
    assert {"GradientFlowMonitor", "AnomalyAlarm", "SystemMonitor", "DataDiagnostics", "ErrorAnalysis",
            "RobustnessProbe"} <= set(thresholds["callbacks"])
    metrics = next(tmp_path.rglob("run.json"))
    assert json.loads(metrics.read_text())["trainer"]["limit_train_batches"] == 4  # 16 batches x 0.25
    assert main(["repro", "--config", str(config), "--fraction", "2"]) == 2
