"""A training run killed with SIGKILL leaves an alerts.jsonl whose every line parses (issue 7)."""

import dataclasses
import json
import os
import signal
import sys
import textwrap
import time
from pathlib import Path

import pytest

from lightning_diag import Alert
from tests import launch

ROOT = Path(__file__).resolve().parents[1]
FIELDS = [f.name for f in dataclasses.fields(Alert)]

# Two writers share the run's alert log until the run is killed: GradientFlowMonitor on gradients that flap between
# huge and tiny (its rules alert once per event: a few lines), and a callback that records a batch of 64 alerts with
# distinct sources through the public `DiagCallback.record` path at every step (the dense stream a kill must cut
# mid-way).
SCRIPT = textwrap.dedent(
    """
    import sys

    import pytorch_lightning as pl
    import torch

    from lightning_diag import Alert, GradientFlowMonitor
    from lightning_diag.callbacks.common.base import DiagCallback
    from lightning_diag.core.record import Severity

    class Flood(DiagCallback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.record(
                Alert(rule="flood", severity=Severity.INFO, message="a line of the dense stream " + "x" * 200,
                      epoch=trainer.current_epoch, global_step=trainer.global_step, value=float(i), threshold=None,
                      source=f"stream.{trainer.global_step}.{i}")
                for i in range(64)
            )

    class Flapping(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(16)])

        def training_step(self, batch, batch_idx):
            scale = 1e4 if self.global_step % 2 else 1e-4
            return self.layers(batch[0]).pow(2).mean() * scale

        def train_dataloader(self):
            x = torch.randn(64, 4)
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=4)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)

    monitor = GradientFlowMonitor(log_every_n_steps=1, per_parameter=True, log_weight_norms=False,
                                  histogram_every_n_steps=0, rules={"grad_explode": {"threshold": 1.0}})
    trainer = pl.Trainer(max_steps=10**9, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, accelerator="cpu", default_root_dir=sys.argv[1],
                         callbacks=[monitor, Flood()])
    trainer.fit(Flapping())
    """
)


@pytest.mark.slow
def test_sigkill_leaves_only_whole_alert_lines(tmp_path):
    script = tmp_path / "flapping.py"
    script.write_text(SCRIPT)
    log = tmp_path / "diag" / "alerts.jsonl"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    with launch.started([sys.executable, str(script), str(tmp_path)], env=env, capture=False) as proc:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            if log.exists() and log.stat().st_size > 64_000:  # well past the first batches, mid-stream
                break
            time.sleep(0.01)
        assert proc.poll() is None, "the run ended before it was killed"
        assert log.exists(), "no alert was written within the time limit"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    data = log.read_bytes()
    assert data.endswith(b"\n")  # no torn last line
    lines = data.decode("utf-8").splitlines()
    assert len(lines) > 100  # killed mid-stream, well past the first batches
    rules = set()
    for line in lines:
        record = json.loads(line)
        assert list(record) == FIELDS
        rules.add(Alert.from_dict(record).rule)
    assert "flood" in rules
    assert any(rule.startswith(("grad_", "update_")) for rule in rules)  # the library's own rules wrote there too
