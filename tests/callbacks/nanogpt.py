"""A nanoGPT-style causal language model (2 layers, d 64) learning a deterministic copy task: the healthy case
of learned attention sharpness (issue 23).

Each sequence is a random prefix of ``half`` tokens followed by the same tokens again; the model predicts the next
token. The second half is predictable only by looking back ``half - 1`` positions (an induction / copy head), and
the heads that learn it sharpen far below 0.5 nats while the loss falls.
"""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl
import torch
from torch import nn
from torch.nn import functional as F

VOCAB, LENGTH, WIDTH, HEADS, LAYERS = 32, 24, 64, 4, 2


class CausalSelfAttention(nn.Module):
    """nanoGPT's attention: one fused qkv projection and ``scaled_dot_product_attention(is_causal=True)``."""

    def __init__(self) -> None:
        super().__init__()
        self.c_attn = nn.Linear(WIDTH, 3 * WIDTH)
        self.c_proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(WIDTH, dim=2)
        q, k, v = (z.view(b, t, HEADS, c // HEADS).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.attn = CausalSelfAttention()
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


def make_sequences(n: int, length: int = LENGTH, seed: int = 1) -> torch.Tensor:
    """``n`` sequences of two interleaved counters: ``x[t] = (x[t - 2] + 1) % VOCAB`` from two random starts."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, VOCAB, (n, 2), generator=g)
    steps = torch.arange(length) // 2
    return (start[:, torch.arange(length) % 2] + steps) % VOCAB


def _init(module: nn.Module) -> None:
    """nanoGPT's initialisation: normal(0, 0.02) weights, zero biases."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)


class NanoGPT(pl.LightningModule):
    """Token and position embeddings, ``LAYERS`` pre-norm blocks, a tied LM head; AdamW.

    Args:
        lr: The learning rate.
        batches: Training batches per epoch (batch size 16, fixed data).
    """

    def __init__(self, lr: float = 3e-3, batches: int = 16) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lr = lr
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.wpe = nn.Embedding(LENGTH, WIDTH)
        self.h = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(WIDTH)
        self.apply(_init)
        self.data = make_sequences(batches * 16)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.h:
            x = block(x)
        return self.ln_f(x) @ self.wte.weight.T

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (idx,) = batch
        logits = self(idx[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), idx[:, 1:].reshape(-1))
        self.log("train_loss", loss)
        return loss

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(self.data), batch_size=16, shuffle=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)
