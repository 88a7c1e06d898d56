"""Attention distance (issue 25): exact on uniform attention, through a real fit, from the entropy's probabilities."""

import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.nn import functional as F

from lightning_diag import AttentionEntropyMonitor
from lightning_diag.output.writer import set_logger_series
from lightning_diag.stats.attention_probs import head_stats
from tests.callbacks.tiny import FAST

T, HEADS, WIDTH = 8, 2, 8


class UniformAttention(pl.LightningModule):
    """Self-attention whose queries are zero: every query spreads its attention evenly over the T keys."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(16, WIDTH)
        self.attn = nn.Module()
        self.attn.value = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, 1)
        self.ids = torch.randint(0, 16, (16, T))

    def forward(self, ids):
        x = self.embed(ids)
        v = self.attn.value(x).view(x.shape[0], T, HEADS, WIDTH // HEADS).transpose(1, 2)
        out = F.scaled_dot_product_attention(torch.zeros_like(v), v, v)
        return self.head(out.transpose(1, 2).reshape(x.shape[0], T, WIDTH).mean(1))

    def training_step(self, batch, batch_idx):
        return self(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(self.ids), batch_size=4)


def test_uniform_attention_over_t_keys_has_distance_t2_minus_1_over_3t(tmp_path):
    monitor = AttentionEntropyMonitor(log_every_n_steps=1)
    logger = pl.loggers.CSVLogger(tmp_path)
    set_logger_series("all", logger)  # the per-head series too, not only the summary
    pl.Trainer(max_steps=2, callbacks=[monitor], logger=logger, log_every_n_steps=1, **FAST).fit(UniformAttention())
    lines = (tmp_path / "lightning_logs" / "version_0" / "metrics.csv").read_text().splitlines()
    columns = lines[0].split(",")
    rows = [dict(zip(columns, line.split(","), strict=True)) for line in lines[1:]]

    def logged(tag):
        return [float(r[tag]) for r in rows if r[tag]]

    name = next(c for c in columns if c.startswith("diag/attn_distance/")).split("/")[2]
    for h in range(HEADS):
        values = logged(f"diag/attn_distance/{name}/head_{h}")
        relative = logged(f"diag/attn_distance_relative/{name}/head_{h}")
        assert len(values) == 2 and all(v == pytest.approx((T * T - 1) / (3 * T), rel=1e-6) for v in values)
        assert len(relative) == 2 and all(v == pytest.approx((T * T - 1) / (3 * T * T), rel=1e-6) for v in relative)


def test_distance_of_hand_made_attention():
    probs = torch.zeros(1, 2, 4, 4)
    probs[0, 0] = torch.eye(4)  # each query on itself: distance 0
    probs[0, 1, torch.arange(1, 4), torch.arange(0, 3)] = 1.0  # previous token: distance 1 ...
    probs[0, 1, 0, 0] = 1.0  # ... except the first query, on itself
    stats = head_stats(probs, query_positions=torch.arange(4))
    assert stats.distance.tolist() == pytest.approx([0.0, 0.75])
    assert head_stats(probs).distance is None  # no positions (cross-attention): not computed


def test_the_report_names_the_long_range_heads(tmp_path):
    from lightning_diag.report import build_report

    pl.Trainer(max_steps=2, callbacks=[AttentionEntropyMonitor(log_every_n_steps=1)], default_root_dir=tmp_path,
               log_every_n_steps=1, **FAST).fit(UniformAttention())
    (report,) = build_report(tmp_path)
    row = next(c for c in report.checks if c.id == "attn_range")
    assert row.status == "pass" and row.measured_value == {"heads": HEADS, "long_range": HEADS, "local": 0}
    assert "head_0" in row.measured
