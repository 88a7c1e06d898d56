"""``grad_vanish`` on a healthy FT-Transformer-style tabular model: a small relative gradient is not vanishing when
the optimizer (AdamW) still moves the layer; the verdict reads the update the optimizer applied.

The feature tokenizer (one linear embedding per numeric feature, plus a [CLS] token; initialised N(0, 1)) has a
large norm and a gradient spread over 64 features: its ``||g||/||W||`` sits near 1e-3, hundreds of times below the
transformer blocks', while AdamW, which divides every gradient by its own running scale, moves it like any other
layer. Judged on the gradient alone that was ``grad_vanish`` on a model whose loss falls to a third.
"""

import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_diag import GradientFlowMonitor

pytestmark = pytest.mark.slow  # two 300-step fits of a 64-feature transformer: 2-7 minutes on 2 shared cores

FAST = dict(
    accelerator="cpu",
    enable_progress_bar=False,
    enable_model_summary=False,
    enable_checkpointing=False,
    logger=False,
    num_sanity_val_steps=0,
    log_every_n_steps=10,
)
FEATURES, D_MODEL = 64, 64


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class FeatureTokenizer(nn.Module):
    """Per-feature linear embeddings ``x_j * W_j + b_j`` and a learned [CLS] token in front."""

    def __init__(self, features, d_model):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(features, d_model))
        self.bias = nn.Parameter(torch.randn(features, d_model))
        self.cls = nn.Parameter(torch.randn(1, 1, d_model))

    def forward(self, x):
        tokens = x.unsqueeze(-1) * self.weight + self.bias
        return torch.cat([self.cls.expand(len(x), -1, -1), tokens], dim=1)


class FTTransformer(pl.LightningModule):
    """Feature tokenizer, 2 pre-norm transformer layers, a head on the [CLS] output; AdamW."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.tokenizer = FeatureTokenizer(FEATURES, D_MODEL)
        layer = nn.TransformerEncoderLayer(
            D_MODEL, 4, dim_feedforward=2 * D_MODEL, dropout=0.1, batch_first=True, norm_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Sequential(nn.LayerNorm(D_MODEL), nn.ReLU(), nn.Linear(D_MODEL, 2))
        self.losses = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.head(self.encoder(self.tokenizer(x))[:, 0]), y)
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3, weight_decay=1e-5)


def _data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3072, FEATURES, generator=g)
    y = ((x[:, 0] * x[:, 1] + torch.sin(2 * x[:, 2]) + x[:, 3] ** 2 - 1 + 0.5 * x[:, 4]) > 0).long()
    return DataLoader(TensorDataset(x, y), batch_size=128, shuffle=True, generator=g)


def _fit(tmp_path, monitor, steps=300):
    model = FTTransformer()
    pl.Trainer(default_root_dir=tmp_path, max_steps=steps, callbacks=[monitor], **FAST).fit(model, _data())
    return model


def test_healthy_tabular_transformer_is_not_vanishing(tmp_path):
    monitor = GradientFlowMonitor()
    model = _fit(tmp_path / "updates", monitor)
    # trained: the loss fell to well under half
    assert sum(model.losses[-20:]) / 20 < 0.5 * sum(model.losses[:20]) / 20
    assert [a.format() for a in monitor.alerts if a.severity != "info"] == []
    # the measurement is right: the tokenizer's gradient is small against the blocks', its update is not
    rule = monitor.band_rule
    blocks = max(v for k, v in rule.updates.items() if k.startswith("encoder."))
    assert rule.updates["tokenizer"] * rule.relative > blocks


def test_judged_on_the_gradient_alone_the_same_run_was_vanish(tmp_path):
    # without the update measurement (log_weight_norms=False) the rule falls back to the gradient: the old verdict
    monitor = GradientFlowMonitor(log_weight_norms=False)
    _fit(tmp_path, monitor)
    vanish = [a for a in monitor.alerts if a.rule == "grad_vanish"]
    assert vanish and vanish[0].source == "tokenizer", [a.format() for a in monitor.alerts]
