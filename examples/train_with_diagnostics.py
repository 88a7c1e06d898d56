"""Train a small transformer classifier with lightning_diag's callbacks attached.

Run: ``python examples/train_with_diagnostics.py`` then ``tensorboard --logdir diag_runs/example``.
"""

import pytorch_lightning as pl
from pytorch_lightning.loggers import TensorBoardLogger

from lightning_diag import AnomalyAlarm, AttentionEntropyMonitor, GradientFlowMonitor
from lightning_diag.demo import SyntheticDataModule, TinyTransformerClassifier


def main() -> None:
    pl.seed_everything(0)
    alarm = AnomalyAlarm(on_nonfinite="stop")
    monitors = [GradientFlowMonitor(), AttentionEntropyMonitor()]
    trainer = pl.Trainer(
        max_epochs=4,
        accelerator="cpu",
        logger=TensorBoardLogger("diag_runs", name="example"),
        callbacks=[alarm, *monitors],
        log_every_n_steps=5,
        enable_progress_bar=False,
    )
    trainer.fit(TinyTransformerClassifier(), datamodule=SyntheticDataModule())
    alerts = [a for cb in (alarm, *monitors) for a in cb.alerts]
    print(f"{len(alerts)} alerts; logs in {trainer.log_dir}")
    for alert in alerts:
        print(alert.format())


if __name__ == "__main__":
    main()
