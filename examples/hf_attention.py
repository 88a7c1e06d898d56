"""Attention entropy of a Hugging Face model inside a LightningModule (built from a config; nothing downloaded).

Nothing in the model refers to the monitor: its ``scaled_dot_product_attention`` calls (the default
``attn_implementation="sdpa"``; ``"eager"`` works too) are seen on the sampled steps and named after the calling
modules (``bert.encoder.layer.0.attention.self``).

Run: ``python examples/hf_attention.py`` (needs ``pip install transformers``), then
``tensorboard --logdir diag_runs/hf``.
"""

from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers import TensorBoardLogger
from transformers import BertConfig, BertModel

from lightning_diag import AttentionEntropyMonitor
from lightning_diag.demo import SyntheticDataModule
from lightning_diag.demo.synthetic import NUM_CLASSES, VOCAB_SIZE


class BertClassifier(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        config = BertConfig(
            vocab_size=VOCAB_SIZE,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            max_position_embeddings=64,
        )
        self.bert = BertModel(config, add_pooling_layer=False)
        self.head = torch.nn.Linear(32, NUM_CLASSES)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        tokens, padding, labels = batch
        mask = (~padding).long()  # Hugging Face: 1 = real token; padded keys and query rows are left out
        out = self.bert(tokens, attention_mask=mask)
        return torch.nn.functional.cross_entropy(self.head(out.last_hidden_state[:, 0]), labels)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def main() -> None:
    pl.seed_everything(0)
    monitor = AttentionEntropyMonitor()
    trainer = pl.Trainer(
        max_epochs=1,
        accelerator="cpu",
        logger=TensorBoardLogger("diag_runs", name="hf"),
        callbacks=[monitor],
        log_every_n_steps=5,
        limit_val_batches=0,
        enable_progress_bar=False,
    )
    trainer.fit(BertClassifier(), datamodule=SyntheticDataModule())
    print(f"{len(monitor.alerts)} alerts; logs in {trainer.log_dir}")


if __name__ == "__main__":
    main()
