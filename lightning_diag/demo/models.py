"""Tiny models for the demo, the tests and the benchmarks, with switches the fault library turns."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytorch_lightning as pl
import torch
from torch import nn

from lightning_diag.demo.data import NUM_CLASSES, VOCAB_SIZE

__all__ = ["DemoConfig", "TinyTransformerClassifier"]


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    """Everything a fault can change. The defaults train a healthy model.

    Attributes:
        d_model: Width of the transformer.
        nhead: Attention heads per layer.
        num_layers: Encoder layers.
        lr: Learning rate.
        optimizer: ``"adamw"`` or ``"sgd"`` (plain SGD, which lets a too-high learning rate diverge).
        weight_decay: AdamW weight decay.
        lr_schedule: ``"constant"``, or ``"oscillate"``: the learning rate alternates every epoch between
            ``lr`` and ``lr * oscillate_factor``.
        oscillate_factor: Multiplier of the high epochs of the oscillating schedule.
        nan_at_step: Multiply the loss by NaN at this global step.
        inf_input_at_step: Put an Inf into the input embeddings at this global step.
        kill_hidden_at_step: From this step on, every linear layer outputs 0 (all units dead): the logits are
            constant and every gradient is exactly 0.
        freeze: Module-name prefixes whose parameters get ``requires_grad=False``.
        hidden_activation: Activation of the classifier head's hidden layers (``"relu"``, ``"sigmoid"``).
        head_depth: Hidden layers in the classifier head.
        attention_collapse_at_step: From this step on, every head puts all its attention on [CLS].
        seed: Seed of the model's initialisation.
    """

    d_model: int = 32
    nhead: int = 4
    num_layers: int = 2
    lr: float = 3e-3
    optimizer: str = "adamw"
    weight_decay: float = 0.0
    lr_schedule: str = "constant"
    oscillate_factor: float = 10.0
    nan_at_step: int | None = None
    inf_input_at_step: int | None = None
    kill_hidden_at_step: int | None = None
    freeze: tuple[str, ...] = ()
    hidden_activation: str = "relu"
    head_depth: int = 1
    attention_collapse_at_step: int | None = None
    seed: int = 0


class TinyTransformerClassifier(pl.LightningModule):
    """A 2-layer ``nn.TransformerEncoder`` classifier over the synthetic task; [CLS] pooling.

    Logs ``train_loss`` (step and epoch), ``val_loss`` and ``val_acc``.
    """

    def __init__(self, config: DemoConfig | None = None) -> None:
        super().__init__()
        self.config = config or DemoConfig()
        c = self.config
        torch.manual_seed(c.seed)
        self.embed = nn.Embedding(VOCAB_SIZE, c.d_model)
        self.pos = nn.Parameter(torch.randn(1, 64, c.d_model) * 0.02)
        layer = nn.TransformerEncoderLayer(
            c.d_model, c.nhead, dim_feedforward=2 * c.d_model, dropout=0.0, batch_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, c.num_layers, enable_nested_tensor=False)
        act: type[nn.Module] = {"relu": nn.ReLU, "sigmoid": nn.Sigmoid, "tanh": nn.Tanh}[c.hidden_activation]
        head: list[nn.Module] = []
        for _ in range(c.head_depth):
            head += [nn.Linear(c.d_model, c.d_model), act()]
        self.head = nn.Sequential(*head, nn.Linear(c.d_model, NUM_CLASSES))
        for prefix in c.freeze:
            for name, p in self.named_parameters():
                if name.startswith(prefix):
                    p.requires_grad_(False)
        self._kill_handles: list[Any] = []

    def forward(self, tokens: torch.Tensor, padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        c = self.config
        x = self.embed(tokens) + self.pos[:, : tokens.shape[1]]
        if self.training and c.inf_input_at_step is not None and self.global_step == c.inf_input_at_step:
            x = x.clone()
            x[0, 1, 0] = math.inf
        mask: torch.Tensor | None = padding_mask
        if c.attention_collapse_at_step is not None and self.global_step >= c.attention_collapse_at_step:
            # Every key but [CLS] gets a score penalty of 20 (still allowed, unlike padding): every query puts
            # all its mass on one token, as attention-logit growth does in a real run.
            bias = torch.full(tokens.shape, -20.0, device=tokens.device)
            bias[:, 0] = 0.0
            if padding_mask is not None:
                bias = bias.masked_fill(padding_mask, -math.inf)
            mask = bias
        x = self.encoder(x, src_key_padding_mask=mask)
        return self.head(x[:, 0])

    def _maybe_kill_hidden(self) -> None:
        c = self.config
        if c.kill_hidden_at_step is None or self._kill_handles or self.global_step < c.kill_hidden_at_step:
            return
        for module in self.modules():
            if isinstance(module, nn.TransformerEncoderLayer):
                self._kill_handles.append(module.linear1.register_forward_hook(lambda m, i, o: o * 0.0))
        for module in self.head:
            if isinstance(module, nn.Linear):
                self._kill_handles.append(module.register_forward_hook(lambda m, i, o: o * 0.0))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self._maybe_kill_hidden()
        tokens, mask, labels = batch
        loss = nn.functional.cross_entropy(self(tokens, mask), labels)
        if self.config.nan_at_step is not None and self.global_step == self.config.nan_at_step:
            loss = loss * math.nan
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        tokens, mask, labels = batch
        logits = self(tokens, mask)
        self.log("val_loss", nn.functional.cross_entropy(logits, labels), prog_bar=True)
        self.log("val_acc", (logits.argmax(-1) == labels).float().mean())

    def test_step(self, batch: Any, batch_idx: int) -> None:
        tokens, mask, labels = batch
        self.log("test_loss", nn.functional.cross_entropy(self(tokens, mask), labels))

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        tokens, mask, _ = batch
        return self(tokens, mask).argmax(-1)

    def configure_optimizers(self) -> Any:
        c = self.config
        params = [p for p in self.parameters() if p.requires_grad]
        opt: torch.optim.Optimizer
        if c.optimizer == "sgd":
            opt = torch.optim.SGD(params, lr=c.lr, weight_decay=c.weight_decay)
        else:
            opt = torch.optim.AdamW(params, lr=c.lr, weight_decay=c.weight_decay)
        if c.lr_schedule == "oscillate":
            factor = c.oscillate_factor
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: factor if epoch % 2 == 1 else 1.0)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "epoch"}}
        return opt
