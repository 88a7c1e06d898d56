"""The loss-trend rules on the losses other libraries train: one-batch epochs, a large floor, a scheduled rise.

Each runs a real ``Trainer.fit`` with the default :class:`~lightning_diag.AnomalyAlarm` and checks which trend
alerts fired: healthy runs raise none, the faults the rules target (a dead optimizer) still fire.
"""

import math

import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_diag import AnomalyAlarm

TREND_RULES = {"loss_swing", "loss_stagnant", "val_decline", "val_fluctuation"}
FAST = dict(
    accelerator="cpu",
    enable_progress_bar=False,
    enable_model_summary=False,
    enable_checkpointing=False,
    logger=False,
    num_sanity_val_steps=0,
)


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _regression(n, noise, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    w = torch.linspace(-1.0, 1.0, 8)
    y = torch.tanh(x @ w) + noise * torch.randn(n, generator=g)
    return TensorDataset(x, y)


class _Regressor(pl.LightningModule):
    """A 2-layer MLP regressor; logs ``val_loss``."""

    def __init__(self, lr=3e-3):
        super().__init__()
        torch.manual_seed(0)
        self.lr = lr
        self.net = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x).squeeze(-1), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x).squeeze(-1), y))

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.lr)


def _loaders(n_train=512, noise=0.1, batch_size=16):
    train = DataLoader(
        _regression(n_train, noise, 0), batch_size=batch_size, shuffle=True, generator=torch.Generator().manual_seed(0)
    )
    return train, DataLoader(_regression(256, noise, 1), batch_size=256)


def _trend_alerts(alarm):
    return [a.format() for a in alarm.alerts if a.rule in TREND_RULES]


def test_one_batch_epochs_healthy_loss_falls_no_trend_rule_fires(tmp_path):
    # an epoch is one batch (limit_train_batches=1), validated every epoch: 40 epochs are 40 optimizer steps
    alarm = AnomalyAlarm()
    model = _Regressor(lr=1e-2)
    train, val = _loaders()
    trainer = pl.Trainer(default_root_dir=tmp_path, max_epochs=40, limit_train_batches=1, callbacks=[alarm], **FAST)
    trainer.fit(model, train, val)
    assert trainer.global_step == 40
    assert _trend_alerts(alarm) == []
    # the rules were fed: every one-batch epoch is a swing point, judged against the run's pooled step noise
    assert len(alarm.stagnant_rule.history) == 40
    assert len(alarm.swing_rule.recent) == 16 and alarm.swing_rule.last_t == alarm.swing_rule.last_t  # not nan
    assert len(alarm.val_decline_rule.history) > 1 and len(alarm.val_fluctuation_rule.val) == 40
    assert alarm.val_fluctuation_rule.window_runs() > alarm.val_fluctuation_rule.window  # widened to 20 steps
    # it learned: the validation loss fell
    assert alarm.val_fluctuation_rule.val[-1] < 0.7 * alarm.val_fluctuation_rule.val[0]


def test_one_batch_epochs_dead_optimizer_is_still_stagnant(tmp_path):
    # the fault loss_stagnant targets: an optimizer that updates nothing (lr 0); one-batch epochs, 60 steps
    alarm = AnomalyAlarm()
    train, val = _loaders()
    trainer = pl.Trainer(default_root_dir=tmp_path, max_epochs=60, limit_train_batches=1, callbacks=[alarm], **FAST)
    trainer.fit(_Regressor(lr=0.0), train, val)
    stagnant = [a for a in alarm.alerts if a.rule == "loss_stagnant"]
    assert len(stagnant) == 1 and stagnant[0].severity == "warning", _trend_alerts(alarm)
    assert stagnant[0].global_step == 50  # loss_stagnant.min_steps: not before 50 optimizer steps
    assert "flat" in stagnant[0].message


class _FloorModel(pl.LightningModule):
    """A loss with a large floor, as a VAE's ELBO has (the data's own entropy): 10 nats that no parameter can
    remove, plus a linear model's squared error (0.9 at the start), which plain SGD removes slowly."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(8, 1, bias=False)
        nn.init.zeros_(self.lin.weight)

    def loss(self, batch):
        x, y = batch
        return 10.0 + nn.functional.mse_loss(self.lin(x).squeeze(-1), y)

    def training_step(self, batch, batch_idx):
        return self.loss(batch)

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.loss(batch))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=2e-3)


def test_loss_with_a_large_floor_that_falls_8_percent_is_learning(tmp_path):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5120, 8, generator=g)
    y = x @ torch.full((8,), 0.9**0.5 / 8**0.5)
    train = DataLoader(TensorDataset(x[:4096], y[:4096]), batch_size=64, shuffle=True, generator=g)
    val = DataLoader(TensorDataset(x[4096:], y[4096:]), batch_size=1024)
    alarm = AnomalyAlarm()
    trainer = pl.Trainer(default_root_dir=tmp_path, max_steps=300, limit_train_batches=20, callbacks=[alarm], **FAST)
    trainer.fit(_FloorModel(), train, val)
    assert _trend_alerts(alarm) == []
    rule = alarm.stagnant_rule
    fall = 1.0 - rule.level / rule.baseline
    assert 0.03 < fall < rule.min_drop, fall  # falls, but less than 10%: the old rule fired here
    assert rule.settled and rule.last_trend < -rule.min_trend


class _WarmupVAE(pl.LightningModule):
    """A small VAE whose returned loss is reconstruction + beta * KL, beta warming up 0 -> 1 over 200 steps."""

    def __init__(self, warmup=200):
        super().__init__()
        torch.manual_seed(0)
        self.warmup = warmup
        self.encoder = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 8))
        self.decoder = nn.Sequential(nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 8))

    def elbo_terms(self, x):
        mu, logvar = self.encoder(x).chunk(2, dim=-1)
        z = mu + torch.randn_like(mu) * (0.5 * logvar).exp()
        recon = nn.functional.mse_loss(self.decoder(z), x, reduction="none").sum(-1).mean()
        kl = 0.5 * (mu.pow(2) + logvar.exp() - 1.0 - logvar).sum(-1).mean()
        return recon, kl

    def training_step(self, batch, batch_idx):
        recon, kl = self.elbo_terms(batch[0])
        beta = min(1.0, self.global_step / self.warmup)
        return recon + beta * kl

    def validation_step(self, batch, batch_idx):
        recon, kl = self.elbo_terms(batch[0])
        self.log("val_loss", recon + min(1.0, self.global_step / self.warmup) * kl)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=3e-3)


def test_loss_that_rises_while_a_kl_weight_warms_up_is_not_a_fault(tmp_path):
    g = torch.Generator().manual_seed(0)
    factors = torch.randn(1024, 2, generator=g)
    x = factors @ torch.randn(2, 8, generator=g) + 0.3 * torch.randn(1024, 8, generator=g)
    train = DataLoader(TensorDataset(x[:768]), batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(0))
    val = DataLoader(TensorDataset(x[768:]), batch_size=256)
    alarm = AnomalyAlarm()
    trainer = pl.Trainer(default_root_dir=tmp_path, max_steps=240, callbacks=[alarm], **FAST)
    trainer.fit(_WarmupVAE(), train, val)
    points = alarm.stagnant_rule.history
    assert len(points) == 10 and all(math.isfinite(p) for p in points)
    assert max(points[3:]) > points[1]  # the returned loss rises by design once beta grows
    assert _trend_alerts(alarm) == []
