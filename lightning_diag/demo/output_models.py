"""Demo models for the published problem classes of the outputs (issue 45): outputs that ignore their inputs, a
classifier trained at batch size 1, attention logits that grow without qk-layernorm.

Each shape pairs a model with its data module (:data:`OUTPUT_SHAPES`); :func:`~lightning_diag.demo.faults.
build_fault` finds them by ``DemoConfig.model``:

* ``"blobs"``: :class:`BlobClassifier`, an MLP classifier over 4 Gaussian clusters in 8 dimensions
  (:class:`BlobsDataModule`); cross-entropy over 4 logits. ``optimizer="sgd_momentum"`` trains it with SGD and
  momentum 0.9 (the batch-size-1 oscillation fault).
* ``"blobs_label_scale"``: :class:`LabelScaleClassifier`, the same MLP with a softmax inside, regressed under an
  MSE on the class ids divided by 255 (the fault: labels scaled wrongly for the loss); ``"blobs_onehot_mse"`` is
  its healthy twin, regressed on one-hot labels.
* ``"blobs_single_softmax"``: :class:`SingleUnitClassifier`, a binary classifier whose one output unit goes
  through a softmax inside the model (Keras' ``Dense(1, activation="softmax")``): every prediction is exactly 1;
  ``"blobs_sigmoid"`` is its healthy twin (a sigmoid).
* ``"blobs_denoiser"``: :class:`BlobDenoiser`, a generative model whose outputs legitimately vary little: it
  restores points of a cloud of small spread around a large offset from noisy copies.
* ``"lm_no_qk_norm"``: :class:`QKCausalLM`, a causal transformer language model with its own attention through
  ``scaled_dot_product_attention`` and no qk-layernorm (``qk_norm=True`` adds one, as the published fix does).

Example:
    >>> model, data = OUTPUT_SHAPES["blobs"]
    >>> model.__name__, data.__name__
    ('BlobClassifier', 'BlobsDataModule')
"""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_diag.demo.models import DemoConfig, DemoModule
from lightning_diag.demo.synthetic import LM_VOCAB_SIZE, CausalLMDataModule

__all__ = [
    "BLOB_CLASSES",
    "BLOB_FEATURES",
    "OUTPUT_SHAPES",
    "BlobClassifier",
    "BlobDenoiser",
    "BlobsDataModule",
    "LabelScaleClassifier",
    "OneHotMSEClassifier",
    "QKCausalLM",
    "QKNormCausalLM",
    "SigmoidClassifier",
    "SingleUnitClassifier",
    "make_blobs",
]

#: Classes of the blob task.
BLOB_CLASSES = 4
#: Features of the blob task.
BLOB_FEATURES = 8
#: The denoiser's cloud: an offset of this size on every feature ...
_DENOISE_OFFSET = 3.0
#: ... and this spread of the points around it.
_DENOISE_SPREAD = 0.05


def make_blobs(n: int, seed: int) -> TensorDataset:
    """``n`` examples ``TensorDataset(x [n, 8], labels [n])``: 4 Gaussian clusters (unit spread) whose centres
    (fixed, seed 4321) lie about 2.5 apart, so the classes overlap a little.

    Example:
        >>> x, y = make_blobs(6, seed=0).tensors
        >>> tuple(x.shape), y.dtype
        ((6, 8), torch.int64)
    """
    centres = torch.randn(BLOB_CLASSES, BLOB_FEATURES, generator=torch.Generator().manual_seed(4321)) * 0.9
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, BLOB_CLASSES, (n,), generator=g)
    x = centres[labels] + torch.randn(n, BLOB_FEATURES, generator=g)
    return TensorDataset(x, labels)


class BlobsDataModule(pl.LightningDataModule):
    """Train/validation loaders over :func:`make_blobs`.

    Args:
        n_train: Training examples.
        n_val: Validation examples.
        batch_size: Batch size of both loaders.
        seed: Seed of the generator (validation uses ``seed + 1``).
    """

    def __init__(self, n_train: int = 512, n_val: int = 128, batch_size: int = 32, seed: int = 0) -> None:
        super().__init__()
        self.n_train, self.n_val, self.batch_size, self.seed = n_train, n_val, batch_size, seed

    def setup(self, stage: str | None = None) -> None:
        self.train_set = make_blobs(self.n_train, self.seed)
        self.val_set = make_blobs(self.n_val, self.seed + 1)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(self.seed)
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, generator=g)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=max(self.batch_size, 32))


def _mlp(config: DemoConfig, outputs: int) -> nn.Sequential:
    act: type[nn.Module] = {"relu": nn.ReLU, "sigmoid": nn.Sigmoid, "tanh": nn.Tanh}[config.hidden_activation]
    layers: list[nn.Module] = []
    width = BLOB_FEATURES
    for _ in range(max(config.head_depth, 1)):
        layers += [nn.Linear(width, config.d_model), act()]
        width = config.d_model
    return nn.Sequential(*layers, nn.Linear(width, outputs))


class BlobClassifier(DemoModule):
    """An MLP classifier (``head_depth`` hidden layers of ``d_model``) over the blobs; cross-entropy.

    Logs ``train_loss``, ``val_loss`` and ``val_acc``. ``optimizer="sgd_momentum"``: SGD with momentum 0.9.
    """

    outputs = BLOB_CLASSES

    def __init__(self, config: DemoConfig | None = None) -> None:
        super().__init__(config)
        torch.manual_seed(self.config.seed)
        self.net = _mlp(self.config, self.outputs)
        self._apply_freeze()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def loss_and_predictions(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The loss of a batch and the predicted classes."""
        x, labels = batch
        logits = self(x)
        return nn.functional.cross_entropy(logits, labels), logits.argmax(-1)

    def compute_loss(self, batch: Any) -> torch.Tensor:
        return self.loss_and_predictions(batch)[0]

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        loss, predicted = self.loss_and_predictions(batch)
        self.log("val_loss", loss, prog_bar=True)
        self.log("val_acc", (predicted == batch[1]).float().mean())

    def configure_optimizers(self) -> Any:
        c = self.config
        if c.optimizer == "sgd_momentum":
            return torch.optim.SGD(self.parameters(), lr=c.lr, momentum=0.9, weight_decay=c.weight_decay)
        return super().configure_optimizers()


class LabelScaleClassifier(BlobClassifier):
    """A softmax over the 4 classes inside the model (Keras' ``Dense(4, activation="softmax")``) trained under an
    MSE against the class id divided by 255, broadcast over the classes (the fault: labels scaled as pixels are):
    the best the model can do is the same near-uniform output for every input."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).softmax(-1)

    def target(self, labels: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """What the probabilities are regressed on."""
        return (labels.float() / 255.0)[:, None].expand_as(probs)

    def loss_and_predictions(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        x, labels = batch
        probs = self(x)
        return nn.functional.mse_loss(probs, self.target(labels, probs)), probs.argmax(-1)


class OneHotMSEClassifier(LabelScaleClassifier):
    """Healthy twin of :class:`LabelScaleClassifier`: the softmax regressed on one-hot labels under the MSE."""

    def target(self, labels: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        return nn.functional.one_hot(labels, probs.shape[-1]).to(probs.dtype)


class SingleUnitClassifier(BlobClassifier):
    """A binary classifier (class id odd or even) whose one output unit goes through ``activation`` inside the
    model: ``"softmax"`` (the fault: a softmax over one unit is exactly 1 for every input) or ``"sigmoid"``."""

    outputs = 1
    activation = "softmax"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.net(x)
        return out.softmax(-1) if self.activation == "softmax" else out.sigmoid()

    def loss_and_predictions(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        x, labels = batch
        prob = self(x).squeeze(-1)
        target = (labels % 2).float()
        return nn.functional.binary_cross_entropy(prob, target), (prob > 0.5).long() + 2 * (labels // 2)


class SigmoidClassifier(SingleUnitClassifier):
    """Healthy twin of :class:`SingleUnitClassifier`: the one unit goes through a sigmoid."""

    activation = "sigmoid"


class BlobDenoiser(BlobClassifier):
    """Restores points of a small cloud (spread 0.05 around 3.0 on every feature) from copies with noise 0.05:
    a generative model whose outputs vary little across a batch compared with their level."""

    outputs = BLOB_FEATURES

    def loss_and_predictions(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        x, labels = batch
        clean = _DENOISE_OFFSET + _DENOISE_SPREAD * x
        g = torch.Generator(device=x.device).manual_seed(int(labels.sum()))
        noisy = clean + _DENOISE_SPREAD * torch.randn(clean.shape, generator=g, device=x.device)
        return nn.functional.mse_loss(self(noisy), clean), labels

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self.loss_and_predictions(batch)[0], prog_bar=True)


class _QKAttention(nn.Module):
    """Causal self-attention through ``scaled_dot_product_attention``, optionally with qk-layernorm."""

    def __init__(self, d_model: int, heads: int, qk_norm: bool) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        head_dim = d_model // heads
        self.q_norm: nn.Module = nn.LayerNorm(head_dim) if qk_norm else nn.Identity()
        self.k_norm: nn.Module = nn.LayerNorm(head_dim) if qk_norm else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).reshape(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        q, k = self.q_norm(q), self.k_norm(k)
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(b, t, d))


class _Block(nn.Module):
    def __init__(self, d_model: int, heads: int, qk_norm: bool) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.attn = _QKAttention(d_model, heads, qk_norm)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class QKCausalLM(DemoModule):
    """A pre-norm causal transformer language model (``num_layers`` blocks of ``d_model``, ``nhead`` heads) with
    its attention through ``scaled_dot_product_attention``; ``qk_norm`` layer-normalises queries and keys.

    Without qk-layernorm, at a high learning rate, the attention logits grow until the attention is one-hot
    (Dehghani et al. 2023; Wortsman et al. 2023).
    """

    qk_norm = False

    def __init__(self, config: DemoConfig | None = None) -> None:
        super().__init__(config)
        c = self.config
        torch.manual_seed(c.seed)
        self.embed = nn.Embedding(LM_VOCAB_SIZE, c.d_model)
        self.pos = nn.Parameter(torch.randn(1, 64, c.d_model) * 0.02)
        self.blocks = nn.ModuleList(_Block(c.d_model, c.nhead, self.qk_norm) for _ in range(c.num_layers))
        self.norm = nn.LayerNorm(c.d_model)
        self.lm_head = nn.Linear(c.d_model, LM_VOCAB_SIZE)
        self._apply_freeze()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[:, : tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.norm(x))

    def compute_loss(self, batch: Any) -> torch.Tensor:
        (sequence,) = batch
        logits = self(sequence[:, :-1])
        return nn.functional.cross_entropy(logits.reshape(-1, LM_VOCAB_SIZE), sequence[:, 1:].reshape(-1))


class QKNormCausalLM(QKCausalLM):
    """Healthy twin of :class:`QKCausalLM`: the same model with qk-layernorm."""

    qk_norm = True


#: Model shape name -> (LightningModule class, data module class), beside
#: :data:`~lightning_diag.demo.models.MODELS`.
OUTPUT_SHAPES: dict[str, tuple[type[DemoModule], type[pl.LightningDataModule]]] = {
    "blobs": (BlobClassifier, BlobsDataModule),
    "blobs_label_scale": (LabelScaleClassifier, BlobsDataModule),
    "blobs_onehot_mse": (OneHotMSEClassifier, BlobsDataModule),
    "blobs_single_softmax": (SingleUnitClassifier, BlobsDataModule),
    "blobs_sigmoid": (SigmoidClassifier, BlobsDataModule),
    "blobs_denoiser": (BlobDenoiser, BlobsDataModule),
    "lm_no_qk_norm": (QKCausalLM, CausalLMDataModule),
    "lm_qk_norm": (QKNormCausalLM, CausalLMDataModule),
}
