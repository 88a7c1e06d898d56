"""Run by test_attention_capture.py: 2 CPU processes (gloo) train a tiny GPT whose attention calls
F.scaled_dot_product_attention; each rank dumps the attention statistics it judged (after the cross-rank average)."""

import json
import os
import sys
from pathlib import Path

import pytorch_lightning as pl
import torch

from lightning_diag import AttentionEntropyMonitor


class Recording(AttentionEntropyMonitor):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.judged = []

    def _reduce(self, trainer, recorder, loss=None):
        reduced = super()._reduce(trainer, recorder, loss)
        layers = reduced[0] if reduced is not None else {}
        self.judged.append({n: [round(x, 5) for x in s.entropy] for n, s in layers.items()})
        return reduced


class Attention(torch.nn.Module):
    """nanoGPT-style causal self-attention through F.scaled_dot_product_attention."""

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(32, 96)

    def forward(self, x):
        q, k, v = self.qkv(x).reshape(*x.shape[:2], 3, 4, 8).permute(2, 0, 3, 1, 4)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2)


class TinyGPT(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(50, 32)
        self.blocks = torch.nn.ModuleList(torch.nn.ModuleDict({"attn": Attention()}) for _ in range(2))
        self.head = torch.nn.Linear(32, 50)

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        x = self.embed(ids)
        for block in self.blocks:
            x = x + block["attn"](x)
        return torch.nn.functional.cross_entropy(self.head(x).flatten(0, 1), ids.flatten())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


if __name__ == "__main__":
    root = Path(sys.argv[1])
    pl.seed_everything(0)
    data = torch.utils.data.TensorDataset(torch.randint(0, 50, (32, 12), generator=torch.Generator().manual_seed(0)))
    monitor = Recording(log_every_n_steps=2, image_every_n_steps=0)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=4,
        default_root_dir=str(root),
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        callbacks=[monitor],
    )
    trainer.fit(TinyGPT(), torch.utils.data.DataLoader(data, batch_size=4))
    out = {"judged": monitor.judged, "log_dir": trainer.log_dir}
    (root / f"rank{trainer.global_rank}.json").write_text(json.dumps(out))
    if torch.distributed.is_initialized():
        torch.distributed.barrier()  # every rank has written its results
    # End without the interpreter's teardown: gloo's threads can abort it after a fit that passed ("terminate called
    # without an active exception", seen in CI); nothing is left to run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
