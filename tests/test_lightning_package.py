"""The unified ``lightning`` package and LightningCLI (issue 7).

``lightning_diag.lightning`` gives every callback as a ``lightning.pytorch.Callback`` too, built from the same
class; the tests here run them under ``lightning.pytorch.Trainer``.
"""

import math

import lightning.pytorch as L
import pytest
import pytorch_lightning as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import lightning_diag
import lightning_diag.lightning as unified
from lightning_diag.callbacks.common.base import DiagCallback

LIBRARY_CALLBACKS = [
    name
    for name in lightning_diag.__all__
    if isinstance(getattr(lightning_diag, name), type) and issubclass(getattr(lightning_diag, name), DiagCallback)
]
FAST = dict(accelerator="cpu", enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)


class UnifiedModel(L.LightningModule):
    """A linear regression for ``lightning.pytorch``; the loss is NaN at ``nan_at_step``."""

    def __init__(self, nan_at_step: int = -1, lr: float = 0.05):
        super().__init__()
        torch.manual_seed(0)
        self.nan_at_step = nan_at_step
        self.lr = lr
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        loss = self.layer(batch[0]).pow(2).mean()
        return loss * math.nan if self.global_step == self.nan_at_step else loss

    def train_dataloader(self):
        x = torch.randn(32, 4, generator=torch.Generator().manual_seed(0))
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=4)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def test_every_library_callback_is_offered_for_the_unified_package():
    assert {"AnomalyAlarm", "GradientFlowMonitor", "AttentionEntropyMonitor"} <= set(LIBRARY_CALLBACKS)
    for name in LIBRARY_CALLBACKS:
        made = getattr(unified, name)
        original = getattr(lightning_diag, name)
        assert issubclass(made, original) and issubclass(made, L.Callback) and issubclass(made, pl.Callback)
        assert made is getattr(unified, name)  # made once
        assert made.__module__ == "lightning_diag.lightning" and made.__name__ == name
        assert made().state_key == original().state_key  # checkpoints move between the two packages
    assert set(LIBRARY_CALLBACKS) <= set(dir(unified))
    with pytest.raises(AttributeError, match="NoSuchMonitor"):
        unified.NoSuchMonitor  # noqa: B018


def test_for_lightning_takes_any_diag_callback_subclass():
    class MyMonitor(lightning_diag.GradientFlowMonitor):
        pass

    made = unified.for_lightning(MyMonitor)
    assert issubclass(made, MyMonitor) and issubclass(made, L.Callback) and made.__name__ == "MyMonitor"
    assert unified.for_lightning(made) is made
    with pytest.raises(TypeError, match="`callback_class`"):
        unified.for_lightning(pl.Callback)


def test_unified_trainer_runs_the_callbacks_and_resumes(tmp_path):
    alarm = unified.AnomalyAlarm()
    monitor = unified.GradientFlowMonitor(log_every_n_steps=1, rules={"grad_collapse": {"baseline_measurements": 2}})
    logger = TensorBoardLogger(tmp_path, name="run")
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=4, save_top_k=-1)
    trainer = L.Trainer(max_steps=20, logger=logger, callbacks=[alarm, monitor, checkpoint], **FAST)
    model = UnifiedModel(nan_at_step=6)
    trainer.fit(model)
    assert [(a.rule, a.global_step) for a in alarm.alerts] == [("nonfinite_loss", 6)]
    assert all(torch.isfinite(p).all() for p in model.parameters())
    diag = tmp_path / "run" / "version_0" / "diag"
    assert [a.rule for a in lightning_diag.read_alerts(diag / "alerts.jsonl")] == ["nonfinite_loss"]
    # scalars go through the unified TensorBoardLogger's own writer, not a second one under diag/
    assert not list(diag.glob("events.out.tfevents.*"))
    acc = EventAccumulator(str(tmp_path / "run" / "version_0"))
    acc.Reload()
    assert "diag/grad_norm/total" in acc.Tags()["scalars"]
    (ckpt,) = (tmp_path / "ckpt").glob("*step=4*.ckpt")
    resumed = unified.GradientFlowMonitor(log_every_n_steps=1, rules={"grad_collapse": {"baseline_measurements": 2}})
    L.Trainer(max_steps=5, default_root_dir=tmp_path / "b", logger=False, callbacks=[resumed], **FAST).fit(
        UnifiedModel(), ckpt_path=ckpt
    )
    assert resumed.collapse_rule.baseline == pytest.approx(monitor.collapse_rule.baseline)


def test_unified_csv_logger_gets_the_scalars(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    logger = CSVLogger(tmp_path, name="csv")
    callbacks = [unified.AnomalyAlarm(log_every_n_steps=2), unified.GradientFlowMonitor(log_every_n_steps=2)]
    L.Trainer(max_steps=6, logger=logger, callbacks=callbacks, **FAST).fit(UnifiedModel())
    header = (tmp_path / "csv" / "version_0" / "metrics.csv").read_text().splitlines()[0].split(",")
    assert {"diag/grad_norm/total", "diag/lr/SGD/group_0", "diag/loss/train_step"} <= set(header)


CONFIG = """
trainer:
  max_steps: 3
  accelerator: cpu
  logger: false
  enable_checkpointing: false
  enable_progress_bar: false
  default_root_dir: {root}
  callbacks:
    - class_path: {package}.AnomalyAlarm
      init_args:
        on_nonfinite: skip
        swing_window: 10
        rules:
          nonfinite_loss:
            max_skips: 2
          nonfinite_rollback:
            every_n_steps: 7
          loss_swing:
            threshold: 0.25
            patience: 4
          val_fluctuation: false
    - class_path: {package}.GradientFlowMonitor
      init_args:
        log_every_n_steps: 1
        params: ["layer.*"]
        rules:
          grad_vanish:
            threshold: 1.0e-4
          grad:
            patience: 5
          grad_explode: null
    - class_path: {package}.AttentionEntropyMonitor
      init_args:
        special_positions: [0]
model:
  lr: 0.1
"""


@pytest.mark.parametrize("flavour", ["pytorch_lightning", "lightning"])
def test_lightning_cli_configures_the_callbacks_from_yaml(tmp_path, flavour):
    pytest.importorskip("jsonargparse", reason="LightningCLI needs the dev extra's jsonargparse[signatures]")
    if flavour == "lightning":
        from lightning.pytorch.cli import LightningCLI

        package, model_class = "lightning_diag.lightning", UnifiedModel
    else:
        from pytorch_lightning.cli import LightningCLI

        from tests.callbacks.tiny import TinyAttention

        package, model_class = "lightning_diag", TinyAttention
    config = tmp_path / "config.yaml"
    text = CONFIG.format(root=tmp_path, package=package)
    config.write_text(text if flavour == "lightning" else text.replace("  lr: 0.1", "  samples: 16"))
    cli = LightningCLI(model_class, run=False, args=["--config", str(config)], save_config_callback=None)
    alarm, monitor, attention = (c for c in cli.trainer.callbacks if isinstance(c, DiagCallback))
    assert (alarm.on_nonfinite, alarm.policy.max_skips, alarm.swing_window) == ("skip", 2, 10)
    assert alarm.rollback.every_n_steps == 7
    # the running rules got the YAML's thresholds; the rules switched off report nothing and raise nothing
    assert (alarm.swing_rule.threshold, alarm.swing_rule.patience) == (0.25, 4)
    assert "val_fluctuation" not in alarm.thresholds() and "val_fluctuation" in alarm.rule_choices.off
    assert (monitor.log_every_n_steps, monitor.params) == (1, ["layer.*"])
    assert monitor.band_rule.vanish_threshold == 1e-4 and monitor.thresholds()["grad.patience"] == 5.0
    assert "grad_explode" not in monitor.thresholds() and "grad_explode" in monitor.rule_choices.off
    assert attention.special_positions == (0,)
    cli.trainer.fit(cli.model)
    assert cli.trainer.global_step == 3
