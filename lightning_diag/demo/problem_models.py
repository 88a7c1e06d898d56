"""Model shapes of the published training problems (issue 45): plain deep MLPs on a binary task.

The older literature on training problems (AUTOTRAINER, DeepDiagnosis/DeepLocalize, UMLAUT) built its detectors on
plain feed-forward nets: a stack of narrow sigmoid layers whose early layers get no gradient, a deep ReLU stack
whose units die, tanh layers saturated by unscaled inputs, a learning rate far too small. Each shape here pairs with
:class:`BinaryDataModule`, a binary task over 16 standardized features whose ``scale`` multiplies the inputs (the
"unscaled inputs" fault). The fault library (:mod:`lightning_diag.demo.faults`) turns the switches; it imports this
module, which registers the shapes in :data:`~lightning_diag.demo.models.MODELS` and their data module in
:data:`~lightning_diag.demo.synthetic.DATA_MODULES`.

* ``"plain_mlp"``: :class:`PlainMLP`, ``head_depth`` hidden layers of width ``d_model`` with ``hidden_activation``
  and PyTorch's default initialisation.
* ``"dead_relu_mlp"``: :class:`DeadReluMLP`, the same with every hidden bias initialised to :data:`DEAD_BIAS`:
  most ReLU units are inactive for every input from the first step.
* ``"residual_mlp"``: :class:`ResidualMLP`, ``head_depth`` pre-activation residual ReLU blocks (the healthy deep
  twin of the dead one).

Example:
    >>> model = PROBLEM_MODELS["plain_mlp"](DemoConfig(model="plain_mlp", head_depth=2))
    >>> [type(m).__name__ for m in model.net][:3]
    ['Linear', 'ReLU', 'Linear']
"""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_diag.demo.models import MODELS, DemoConfig, DemoModule
from lightning_diag.demo.synthetic import DATA_MODULES

__all__ = [
    "BINARY_FEATURES",
    "DEAD_BIAS",
    "PROBLEM_DATA_MODULES",
    "PROBLEM_MODELS",
    "BinaryDataModule",
    "DeadReluMLP",
    "PlainMLP",
    "ResidualMLP",
    "make_binary_dataset",
]

#: Input features of the binary task.
BINARY_FEATURES = 16
#: Initial bias of :class:`DeadReluMLP`'s hidden layers (pre-activations sit well below zero).
DEAD_BIAS = -1.0

_ACTIVATIONS: dict[str, type[nn.Module]] = {"relu": nn.ReLU, "sigmoid": nn.Sigmoid, "tanh": nn.Tanh}


def make_binary_dataset(n: int, seed: int, scale: float = 1.0) -> TensorDataset:
    """``n`` examples ``TensorDataset(x [n, 16], y [n])``: ``y = 1`` where ``x @ a + sin(2 x @ b) > 0``.

    ``a`` and ``b`` are fixed (seed 4321) so training and validation sets share the function; ``x`` is standard
    normal, multiplied by ``scale`` after the labels are drawn (inputs left on the scale of their raw units).
    """
    fixed = torch.Generator().manual_seed(4321)
    a = torch.randn(BINARY_FEATURES, generator=fixed) / BINARY_FEATURES**0.5
    b = torch.randn(BINARY_FEATURES, generator=fixed) / BINARY_FEATURES**0.5
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, BINARY_FEATURES, generator=g)
    y = ((x @ a + torch.sin(2.0 * (x @ b))) > 0).long()
    return TensorDataset(x * scale, y)


class BinaryDataModule(pl.LightningDataModule):
    """The binary task of :func:`make_binary_dataset`.

    Args:
        n_train: Training examples.
        n_val: Validation examples.
        batch_size: Batch size of both loaders.
        seed: Seed of the generator (validation uses ``seed + 1``).
        scale: Multiplier of the inputs (1: standardized).
    """

    def __init__(
        self, n_train: int = 1024, n_val: int = 256, batch_size: int = 32, seed: int = 0, scale: float = 1.0
    ) -> None:
        super().__init__()
        self.n_train, self.n_val, self.batch_size, self.seed, self.scale = n_train, n_val, batch_size, seed, scale

    def setup(self, stage: str | None = None) -> None:
        self.train_set = make_binary_dataset(self.n_train, self.seed, self.scale)
        self.val_set = make_binary_dataset(self.n_val, self.seed + 1, self.scale)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(self.seed)
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, generator=g)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size)


class PlainMLP(DemoModule):
    """A plain MLP classifier: ``head_depth`` hidden layers of width ``d_model`` with ``hidden_activation``, a
    2-way output; cross-entropy. Logs ``val_acc`` too."""

    def __init__(self, config: DemoConfig | None = None) -> None:
        super().__init__(config)
        c = self.config
        torch.manual_seed(c.seed)
        if c.hidden_activation not in _ACTIVATIONS:
            raise ValueError(
                f"Expected argument `hidden_activation` to be one of {sorted(_ACTIVATIONS)}, "
                f"but got {c.hidden_activation!r}"
            )
        self.net = self._build(c)
        self._apply_freeze()

    def _build(self, c: DemoConfig) -> nn.Sequential:
        act = _ACTIVATIONS[c.hidden_activation]
        layers: list[nn.Module] = []
        width = BINARY_FEATURES
        for _ in range(max(c.head_depth, 1)):
            layers += [nn.Linear(width, c.d_model), act()]
            width = c.d_model
        return nn.Sequential(*layers, nn.Linear(width, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def compute_loss(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.log("val_loss", nn.functional.cross_entropy(logits, y), prog_bar=True)
        self.log("val_acc", (logits.argmax(-1) == y).float().mean())


class DeadReluMLP(PlainMLP):
    """:class:`PlainMLP` whose hidden biases start at :data:`DEAD_BIAS`: with standardized inputs most ReLU units
    are inactive for every input, and the gradient of most weights is exactly zero."""

    def _build(self, c: DemoConfig) -> nn.Sequential:
        net = super()._build(c)
        linears = [m for m in net if isinstance(m, nn.Linear)]
        with torch.no_grad():
            for layer in linears[:-1]:
                layer.bias.fill_(DEAD_BIAS)
        return net


class _Block(nn.Module):
    """``x + W2 relu(W1 x)``: a pre-activation residual block (``W2`` starts small)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, width)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(width, width)
        with torch.no_grad():
            self.fc2.weight.mul_(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.act(self.fc1(x)))


class ResidualMLP(PlainMLP):
    """``head_depth`` residual ReLU blocks of width ``d_model`` between an input projection and the output."""

    def _build(self, c: DemoConfig) -> nn.Sequential:
        blocks = [_Block(c.d_model) for _ in range(max(c.head_depth, 1))]
        return nn.Sequential(nn.Linear(BINARY_FEATURES, c.d_model), *blocks, nn.Linear(c.d_model, 2))


#: Model shape name -> LightningModule class (registered in :data:`~lightning_diag.demo.models.MODELS`).
PROBLEM_MODELS: dict[str, type[DemoModule]] = {
    "plain_mlp": PlainMLP,
    "dead_relu_mlp": DeadReluMLP,
    "residual_mlp": ResidualMLP,
}
#: Model shape name -> its data module.
PROBLEM_DATA_MODULES: dict[str, type[pl.LightningDataModule]] = dict.fromkeys(PROBLEM_MODELS, BinaryDataModule)
# ``build_model`` and ``build_fault`` find them there (the fault library imports this module).
MODELS.update(PROBLEM_MODELS)
DATA_MODULES.update(PROBLEM_DATA_MODULES)
