"""Tiny models for the demo, the tests and the benchmarks, with switches the fault library turns.

Four shapes, each paired with a synthetic task of :mod:`lightning_diag.demo.synthetic`:

* ``"transformer"``: :class:`TinyTransformerClassifier` (``nn.TransformerEncoder`` classifier).
* ``"mlp"``: :class:`RegressionMLP` (an MLP regressing noisy targets).
* ``"causal_lm"``: :class:`TinyCausalLM` (a causal transformer language model).
* ``"gru"``: :class:`GRUClassifier` (a recurrent classifier).

Example:
    >>> model = build_model(DemoConfig(model="gru"))
    >>> type(model).__name__
    'GRUClassifier'
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import pytorch_lightning as pl
import torch
from torch import nn

from lightning_diag.demo.synthetic import LM_VOCAB_SIZE, NUM_CLASSES, REGRESSION_FEATURES, VOCAB_SIZE

__all__ = [
    "MODELS",
    "DemoConfig",
    "DemoModule",
    "GRUClassifier",
    "RegressionMLP",
    "TinyCausalLM",
    "TinyTransformerClassifier",
    "build_model",
]


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    """Everything a fault can change. The defaults train a healthy model.

    Attributes:
        model: The model's shape, a key of :data:`MODELS` (``"transformer"``, ``"mlp"``, ``"causal_lm"``,
            ``"gru"``).
        d_model: Width of the transformer (hidden width of the MLP and the GRU).
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
        exclude_from_optimizer: Parameter-name prefixes left out of the optimizer (trainable, never updated).
        hidden_activation: Activation of the classifier head's hidden layers (``"relu"``, ``"sigmoid"``,
            ``"tanh"``); of the MLP's hidden layers for ``model="mlp"``.
        head_depth: Hidden layers in the classifier head (the MLP's hidden layers for ``model="mlp"``).
        attention_collapse_at_step: From this step on, every head puts all its attention on [CLS].
        dropout: Dropout of the transformer layers (transformer classifier and causal LM).
        optimizer_over_copy: Build the optimizer over copies of the parameters (the model never changes).
        manual: ``""`` (automatic optimization), ``"no_zero_grad"`` (manual: backward and step, never
            ``zero_grad``) or ``"accumulate"`` (manual: backward on every batch, step and ``zero_grad`` every
            second batch, deliberate accumulation).
        eval_at_epoch_start: Call ``self.eval()`` in ``on_train_epoch_start`` (Dropout off during training).
        stall_every: From this global step on, every ``stall_every``-th training step also sleeps
            ``stall_seconds`` (a periodic I/O or synchronisation stall); 0: never.
        stall_seconds: How long each stall sleeps.
        freeze_in_train: Module-name prefixes that the model's ``train()`` override freezes
            (``requires_grad=False``), as plain-PyTorch code written for ``model.train()`` at each epoch does;
            Lightning never calls ``train()`` during fit.
        train_at_epoch_start: Call ``self.train()`` in ``on_train_epoch_start`` (what makes such an override run).
        eval_dropout: The transformer classifier applies ``F.dropout(x, eval_dropout)`` to its embeddings when in
            eval mode, with the function's default ``training=True``: validation is random.
        autocast_off: The transformer classifier's forward runs in ``torch.autocast(..., enabled=False)``: under
            ``precision="bf16-mixed"`` its matmuls stay float32.
        zero_input_every: From ``zero_input_from`` on, every ``zero_input_every``-th training step's tokens arrive
            as zeros (a transient corruption of a copy); 0: never.
        zero_input_from: The first global step ``zero_input_every`` may hit.
        zero_transfer_every: From ``zero_transfer_from`` on, every ``zero_transfer_every``-th training step the
            output of the transformer's first encoder layer (the hand-off to the second, as between two devices of
            a pipeline) arrives as zeros; 0: never.
        zero_transfer_from: The first global step ``zero_transfer_every`` may hit.
        zero_init_adapter: The transformer classifier adds a bottleneck adapter after its encoder whose
            up-projection starts at zero (LoRA-style): its output is all zeros until the first update.
        target_drift: The regression MLP's training targets are offset by this times the epoch (0 in the first
            epoch): a training pipeline whose target transform drifts from epoch to epoch. Validation, on the
            clean targets, worsens at every epoch while the training loss keeps up.
        seed: Seed of the model's initialisation.
    """

    model: str = "transformer"
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
    exclude_from_optimizer: tuple[str, ...] = ()
    hidden_activation: str = "relu"
    head_depth: int = 1
    attention_collapse_at_step: int | None = None
    dropout: float = 0.0
    optimizer_over_copy: bool = False
    manual: str = ""
    eval_at_epoch_start: bool = False
    stall_every: int = 0
    stall_seconds: float = 0.0
    freeze_in_train: tuple[str, ...] = ()
    train_at_epoch_start: bool = False
    eval_dropout: float = 0.0
    autocast_off: bool = False
    zero_input_every: int = 0
    zero_input_from: int = 0
    zero_transfer_every: int = 0
    zero_transfer_from: int = 0
    zero_init_adapter: bool = False
    target_drift: float = 0.0
    seed: int = 0


class DemoModule(pl.LightningModule):
    """What every demo model shares: the config, freezing, the NaN switch, the optimizer and its schedule.

    Subclasses build their layers in ``__init__`` and then call :meth:`_apply_freeze`; they implement
    :meth:`compute_loss`. Logs ``train_loss`` (step and epoch) and ``val_loss``.
    """

    def __init__(self, config: DemoConfig | None = None) -> None:
        super().__init__()
        self.config = config or DemoConfig()
        if self.config.manual not in ("", "no_zero_grad", "accumulate"):
            raise ValueError(
                f"Expected argument `manual` to be '', 'no_zero_grad' or 'accumulate', but got {self.config.manual!r}"
            )
        self.automatic_optimization = not self.config.manual

    def on_train_epoch_start(self) -> None:
        if self.config.eval_at_epoch_start:
            self.eval()  # the fault: Dropout (and BatchNorm) switched off for the whole epoch
        if self.config.train_at_epoch_start:
            self.train()

    def train(self, mode: bool = True) -> DemoModule:
        """``nn.Module.train``; with ``freeze_in_train`` it also freezes those parameters when training starts."""
        super().train(mode)
        if mode:
            for prefix in self.config.freeze_in_train:
                for name, p in self.named_parameters():
                    if name.startswith(prefix):
                        p.requires_grad_(False)
        return self

    def _apply_freeze(self) -> None:
        for prefix in self.config.freeze:
            for name, p in self.named_parameters():
                if name.startswith(prefix):
                    p.requires_grad_(False)

    def compute_loss(self, batch: Any) -> torch.Tensor:
        """The loss of a batch."""
        raise NotImplementedError

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.compute_loss(batch)
        every = self.config.stall_every
        if every and self.global_step >= every and self.global_step % every == 0:
            time.sleep(self.config.stall_seconds)
        if self.config.nan_at_step is not None and self.global_step == self.config.nan_at_step:
            loss = loss * math.nan
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        if self.config.manual:
            self._manual_step(loss, batch_idx)
        return loss

    def _manual_step(self, loss: torch.Tensor, batch_idx: int) -> None:
        opt: Any = self.optimizers()
        if self.config.manual == "accumulate":
            self.manual_backward(loss / 2)
            if batch_idx % 2 == 1:
                opt.step()
                opt.zero_grad()
            return
        self.manual_backward(loss)
        opt.step()  # the fault: no opt.zero_grad(), the gradients of every step pile up

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self.compute_loss(batch), prog_bar=True)

    def configure_optimizers(self) -> Any:
        c = self.config
        excluded = tuple(c.exclude_from_optimizer)
        params = [
            p for n, p in self.named_parameters() if p.requires_grad and not (excluded and n.startswith(excluded))
        ]
        if c.optimizer_over_copy:
            # the fault: the optimizer steps copies nobody uses (as when parameters are replaced after this call)
            params = [nn.Parameter(p.detach().clone()) for p in params]
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


class TinyTransformerClassifier(DemoModule):
    """A 2-layer ``nn.TransformerEncoder`` classifier over the synthetic task; [CLS] pooling.

    Logs ``train_loss`` (step and epoch), ``val_loss`` and ``val_acc``.
    """

    def __init__(self, config: DemoConfig | None = None) -> None:
        super().__init__(config)
        c = self.config
        torch.manual_seed(c.seed)
        self.embed = nn.Embedding(VOCAB_SIZE, c.d_model)
        self.pos = nn.Parameter(torch.randn(1, 64, c.d_model) * 0.02)
        layer = nn.TransformerEncoderLayer(
            c.d_model, c.nhead, dim_feedforward=2 * c.d_model, dropout=c.dropout, batch_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, c.num_layers, enable_nested_tensor=False)
        act: type[nn.Module] = {"relu": nn.ReLU, "sigmoid": nn.Sigmoid, "tanh": nn.Tanh}[c.hidden_activation]
        head: list[nn.Module] = []
        for _ in range(c.head_depth):
            head += [nn.Linear(c.d_model, c.d_model), act()]
        self.head = nn.Sequential(*head, nn.Linear(c.d_model, NUM_CLASSES))
        self.adapter: nn.Sequential | None = None
        if c.zero_init_adapter:
            up = nn.Linear(8, c.d_model)
            nn.init.zeros_(up.weight)
            nn.init.zeros_(up.bias)
            self.adapter = nn.Sequential(nn.Linear(c.d_model, 8), nn.ReLU(), up)
        if c.zero_transfer_every:
            self.encoder.layers[0].register_forward_hook(self._zero_transfer)
        self._apply_freeze()
        self._kill_handles: list[Any] = []

    def _zero_transfer(self, module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        c, step = self.config, self.global_step
        if self.training and step >= c.zero_transfer_from and step % c.zero_transfer_every == 0:
            return torch.zeros_like(output)  # the fault: this step's hand-off arrived as zeros
        return output

    def forward(self, tokens: torch.Tensor, padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        if self.config.autocast_off:
            with torch.autocast(device_type=tokens.device.type, enabled=False):  # the fault: no mixed precision
                return self._forward(tokens, padding_mask)
        return self._forward(tokens, padding_mask)

    def _forward(self, tokens: torch.Tensor, padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        c = self.config
        x = self.embed(tokens) + self.pos[:, : tokens.shape[1]]
        if c.eval_dropout and not self.training:
            x = nn.functional.dropout(x, c.eval_dropout)  # the fault: `training` defaults to True
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
        if self.adapter is not None:
            x = x + self.adapter(x)
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

    def compute_loss(self, batch: Any) -> torch.Tensor:
        tokens, mask, labels = batch
        return nn.functional.cross_entropy(self(tokens, mask), labels)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self._maybe_kill_hidden()
        c, step = self.config, self.global_step
        if c.zero_input_every and step >= c.zero_input_from and step % c.zero_input_every == 0:
            tokens, mask, labels = batch
            batch = (torch.zeros_like(tokens), mask, labels)  # the fault: this step's copy arrived as zeros
        return super().training_step(batch, batch_idx)

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


class RegressionMLP(DemoModule):
    """An MLP (``head_depth`` hidden layers of width ``d_model``) regressing noisy targets; MSE loss.

    Pairs with :class:`~lightning_diag.demo.synthetic.RegressionDataModule`.
    """

    def __init__(self, config: DemoConfig | None = None) -> None:
        super().__init__(config)
        c = self.config
        torch.manual_seed(c.seed)
        act: type[nn.Module] = {"relu": nn.ReLU, "sigmoid": nn.Sigmoid, "tanh": nn.Tanh}[c.hidden_activation]
        layers: list[nn.Module] = []
        width = REGRESSION_FEATURES
        for _ in range(max(c.head_depth, 1)):
            layers += [nn.Linear(width, c.d_model), act()]
            width = c.d_model
        self.net = nn.Sequential(*layers, nn.Linear(width, 1))
        self._apply_freeze()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).squeeze(-1)

    def compute_loss(self, batch: Any) -> torch.Tensor:
        x, y = batch
        if self.training and self.config.target_drift:
            y = y + self.config.target_drift * self.current_epoch  # the fault: only the training targets drift
        return nn.functional.mse_loss(self(x), y)


class TinyCausalLM(DemoModule):
    """A small causal language model: ``num_layers`` ``nn.TransformerEncoderLayer`` with a causal mask.

    Trained on next-token prediction over :class:`~lightning_diag.demo.synthetic.CausalLMDataModule` sequences.
    """

    def __init__(self, config: DemoConfig | None = None) -> None:
        super().__init__(config)
        c = self.config
        torch.manual_seed(c.seed)
        self.embed = nn.Embedding(LM_VOCAB_SIZE, c.d_model)
        self.pos = nn.Parameter(torch.randn(1, 64, c.d_model) * 0.02)
        layer = nn.TransformerEncoderLayer(
            c.d_model, c.nhead, dim_feedforward=2 * c.d_model, dropout=c.dropout, batch_first=True
        )
        self.decoder = nn.TransformerEncoder(layer, c.num_layers, enable_nested_tensor=False)
        self.lm_head = nn.Linear(c.d_model, LM_VOCAB_SIZE)
        self._apply_freeze()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        x = self.embed(tokens) + self.pos[:, :length]
        causal = nn.Transformer.generate_square_subsequent_mask(length, device=tokens.device)
        return self.lm_head(self.decoder(x, mask=causal, is_causal=True))

    def compute_loss(self, batch: Any) -> torch.Tensor:
        if isinstance(batch, dict):  # padded batches (Hugging Face style): labels shifted here, -100 ignored
            logits = self(batch["input_ids"][:, :-1])
            targets = batch["labels"][:, 1:]
            return nn.functional.cross_entropy(
                logits.reshape(-1, LM_VOCAB_SIZE), targets.reshape(-1), ignore_index=-100
            )
        (sequence,) = batch
        logits = self(sequence[:, :-1])
        return nn.functional.cross_entropy(logits.reshape(-1, LM_VOCAB_SIZE), sequence[:, 1:].reshape(-1))


class GRUClassifier(DemoModule):
    """A single-layer GRU over the classification task of the transformer; reads the state at [SEP].

    Pairs with :class:`~lightning_diag.demo.synthetic.SyntheticDataModule`; logs ``val_acc`` too.
    """

    def __init__(self, config: DemoConfig | None = None) -> None:
        super().__init__(config)
        c = self.config
        torch.manual_seed(c.seed)
        self.embed = nn.Embedding(VOCAB_SIZE, c.d_model)
        self.rnn = nn.GRU(c.d_model, 2 * c.d_model, batch_first=True)
        self.head = nn.Linear(2 * c.d_model, NUM_CLASSES)
        self._apply_freeze()

    def forward(self, tokens: torch.Tensor, padding_mask: torch.Tensor) -> torch.Tensor:
        states, _ = self.rnn(self.embed(tokens))
        last = (~padding_mask).sum(1) - 1  # the [SEP] position
        return self.head(states[torch.arange(tokens.shape[0], device=tokens.device), last])

    def compute_loss(self, batch: Any) -> torch.Tensor:
        tokens, mask, labels = batch
        return nn.functional.cross_entropy(self(tokens, mask), labels)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        tokens, mask, labels = batch
        logits = self(tokens, mask)
        self.log("val_loss", nn.functional.cross_entropy(logits, labels), prog_bar=True)
        self.log("val_acc", (logits.argmax(-1) == labels).float().mean())


#: Model shape name -> LightningModule class.
MODELS: dict[str, type[DemoModule]] = {
    "transformer": TinyTransformerClassifier,
    "mlp": RegressionMLP,
    "causal_lm": TinyCausalLM,
    "gru": GRUClassifier,
}


def build_model(config: DemoConfig) -> DemoModule:
    """The model of ``config.model``.

    Raises:
        ValueError: If ``config.model`` is not a key of :data:`MODELS`.
    """
    if config.model not in MODELS:
        raise ValueError(f"Expected argument `model` to be one of {sorted(MODELS)}, but got {config.model!r}")
    return MODELS[config.model](config)
