"""Attention entropy of a Hugging Face model inside a LightningModule (built from a config; nothing downloaded).

Run: ``python examples/hf_attention.py`` (needs ``pip install transformers``), then
``tensorboard --logdir diag_runs/hf``.
"""

from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers import TensorBoardLogger
from transformers import BertConfig, BertModel

from lightning_diag import AttentionEntropyMonitor, attention_requested, record_hf_attentions
from lightning_diag.demo import SyntheticDataModule
from lightning_diag.demo.data import NUM_CLASSES, VOCAB_SIZE


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
            attention_probs_dropout_prob=0.0,
            attn_implementation="eager",  # returns attentions, and computes the same on every step
        )
        self.bert = BertModel(config, add_pooling_layer=False)
        self.head = torch.nn.Linear(32, NUM_CLASSES)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        tokens, padding, labels = batch
        mask = (~padding).long()  # Hugging Face: 1 = real token
        # attentions are materialised only on the steps the monitor samples
        out = self.bert(tokens, attention_mask=mask, output_attentions=attention_requested())
        record_hf_attentions(out.attentions, "bert", attention_mask=mask)
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
