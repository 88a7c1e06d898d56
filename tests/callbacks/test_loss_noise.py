"""Issue 44: the loss rules judged against the run's own noise, at every epoch length.

``loss_swing`` on the alternating 40x learning rate (a variant of the fault library's ``swing``: the demo's
noisy-regression MLP, AdamW at 1e-3, batch 32) and its constant-rate twin; the schedules people train with
(cyclic rates, warm restarts, one-cycle) stay quiet; ``val_decline`` against the validation mean's standard
error; ``loss_outlier`` on heavy-tailed healthy losses, at batch size 1, and on five scattered zeroed batches.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_diag import AnomalyAlarm
from lightning_diag.demo.faults import build_fault
from lightning_diag.demo.models import DemoConfig, build_model
from lightning_diag.demo.schedules import SCENARIOS, run_scenario
from lightning_diag.demo.synthetic import RegressionDataModule
from tests.callbacks.loss_noise_models import ClusterMLP, cluster_loader
from tests.callbacks.tiny import FAST

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _serious(alarm: AnomalyAlarm) -> list[tuple[str, int]]:
    return [(a.rule, a.global_step) for a in alarm.alerts if a.severity != "info"]


def _fit(model: pl.LightningModule, tmp_path: Any, alarm: AnomalyAlarm, max_epochs: int, **loaders: Any) -> None:
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(
        max_epochs=max_epochs, default_root_dir=tmp_path, callbacks=[alarm], logger=False, log_every_n_steps=5, **FAST
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, **loaders)


def _swing_run(tmp_path: Any, steps: int, factor: float, epochs: int = 8, lr: float = 1e-3) -> AnomalyAlarm:
    """The demo's regression MLP (AdamW at ``lr``, batch 32) with epochs of ``steps`` steps; the rate ``factor``
    times higher every other epoch (1: the healthy twin)."""
    config = dataclasses.replace(
        DemoConfig(seed=0), model="mlp", d_model=64, head_depth=2, optimizer="adamw", lr=lr,
        lr_schedule="oscillate" if factor > 1 else "constant", oscillate_factor=factor,
    )
    alarm = AnomalyAlarm()
    data = RegressionDataModule(n_train=steps * 32, batch_size=32, seed=0)
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(max_epochs=epochs, default_root_dir=tmp_path, callbacks=[alarm], logger=False,
                         limit_val_batches=0, log_every_n_steps=5, **FAST)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(build_model(config), datamodule=data)
    return alarm


# -- loss_swing at every epoch length ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("steps", "epochs"), [(16, 8), (64, 8), pytest.param(256, 6, marks=pytest.mark.slow)]
)
def test_loss_swing_fires_on_the_alternating_rate_at_each_epoch_length(tmp_path, steps, epochs):
    alarm = _swing_run(tmp_path, steps, 40.0, epochs)
    assert [rule for rule, _ in _serious(alarm)] == ["loss_swing"]
    twin = _swing_run(tmp_path, steps, 1.0, epochs)
    assert _serious(twin) == []
    assert math.isfinite(twin.swing_rule.last_t)  # judged against its noise, and quiet


def test_loss_swing_fires_at_4_steps_an_epoch_where_the_loss_swings(tmp_path):
    """At 4 steps an epoch the 40x rate over a base of 1e-3 barely moves the epoch means (one excursion in 24
    epochs, no 3 swinging points: nothing to fire on); over 3e-3 the means rise and fall by 20-60% from epoch to
    epoch, and the seed's 3-point contract fires."""
    alarm = _swing_run(tmp_path, 4, 40.0, 24, lr=3e-3)
    assert [rule for rule, _ in _serious(alarm)] == ["loss_swing"]
    twin = _swing_run(tmp_path, 4, 1.0, 24, lr=3e-3)
    assert _serious(twin) == []


def test_loss_swing_is_quiet_on_hundreds_of_one_batch_epochs(tmp_path):
    alarm = AnomalyAlarm()
    _fit(ClusterMLP(lr=3e-3), tmp_path, alarm, 300, train_dataloaders=cluster_loader(32))
    assert alarm.swing_rule.last_t == alarm.swing_rule.last_t  # judged (not nan): the pooled noise was known
    assert _serious(alarm) == []


@pytest.mark.slow
def test_loss_swing_is_quiet_when_a_curriculum_adds_harder_data(tmp_path):
    # the demo curriculum (seed 3): from epoch 4 the set adds sequences twice as long, 16 -> 32 steps an epoch; the
    # loss rises on the new data (0.005 -> 0.012 -> 0.080) and falls back: one change of the data, not a swing
    alarm = AnomalyAlarm()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = run_scenario("curriculum", [alarm], root=str(tmp_path), seed=3)
    assert result.global_step == SCENARIOS["curriculum"].total_steps
    assert max(result.epoch_losses[4:]) > 2 * result.epoch_losses[3], result.epoch_losses  # the loss did rise
    assert [r for r, _ in _serious(alarm) if r == "loss_swing"] == []


def test_loss_swing_is_quiet_on_fresh_one_batch_epochs(tmp_path):
    """The calibration's ``one_batch_epochs`` schedule: 300 epochs of one batch drawn from 4096 examples (a fresh,
    noisy batch every epoch, unlike the memorised single batch above); its first seed fired at epoch 184."""
    from lightning_diag.demo.schedules import run_scenario

    alarm = AnomalyAlarm()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run_scenario("one_batch_epochs", callbacks=[alarm], root=str(tmp_path), seed=0)
    assert len(alarm.swing_rule.recent) == 16 and math.isfinite(alarm.swing_rule.last_t)
    assert [r for r, _ in _serious(alarm) if r == "loss_swing"] == []


def test_one_step_points_pool_the_step_variance_of_the_run():
    from lightning_diag.rules import LossSwingRule, StepContext
    from lightning_diag.rules.measures import LossWindow, Measures

    rule = LossSwingRule()
    for e, v in enumerate([1.0, 1.2, 1.0, 1.2, 1.0]):
        rule.judge(StepContext(e, e), Measures(loss_window=LossWindow(v)))
    # successive one-step points differ by 0.2: var(L[k] - L[k-1]) = 2 s^2, so the step variance is 0.04 / 2
    assert rule.pooled_step_variance() == pytest.approx((0.02, 4.0))


@pytest.mark.parametrize(
    ("tail", "fires"),
    [([1.0, 1.6, 2.6, 1.0], False), ([1.0, 2.6, 1.0, 2.6], True)],
    ids=["two-outlying-batches", "up-and-down"],
)
def test_one_step_points_swing_only_up_and_down(tail, fires):
    """One-batch points are single samples: two outlying batches in a row rise, rise and fall back; an up-and-down
    of the same size against the same calm noise is a swing."""
    from lightning_diag.rules import LossSwingRule, StepContext
    from lightning_diag.rules.measures import LossWindow, Measures

    calm = [1.0 + 0.05 * (-1) ** i for i in range(14)]
    rule, fired = LossSwingRule(), []
    for e, v in enumerate([*calm, *tail]):
        fired += rule.judge(StepContext(e, e), Measures(loss_window=LossWindow(v)))
    assert bool(fired) is fires


# -- the schedules people train with -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("schedule", "kwargs"),
    [
        ("cyclic", {"lr": 1e-2, "factor": 10.0, "cycle_steps": 16}),
        ("restarts", {"lr": 1e-2, "cycle_steps": 32}),
        ("onecycle", {"lr": 1e-2, "total_steps": 160}),
    ],
)
def test_scheduled_learning_rates_are_no_swing(tmp_path, schedule, kwargs):
    alarm = AnomalyAlarm()
    _fit(ClusterMLP(schedule=schedule, **kwargs), tmp_path, alarm, 10, train_dataloaders=cluster_loader(16 * 32))
    assert _serious(alarm) == []


def test_a_rise_with_the_rate_within_lr_ratio_is_the_schedule():
    from lightning_diag.rules import LossSwingRule, StepContext
    from lightning_diag.rules.measures import LossWindow, Measures

    def run(factor: float) -> list[int]:
        rule, fired = LossSwingRule(), []
        points = [1.0, 1.3, 1.0, 1.3, 1.0, 1.3]
        for e, (v, lr) in enumerate(zip(points, [1.0, factor] * 3, strict=True)):
            if rule.judge(StepContext(e, 16 * e), Measures(loss_window=LossWindow(v, steps=16, variance=0.01, lr=lr))):
                fired.append(e)
        return fired

    assert run(4.0) == []  # the loss rises and falls with a 4x cyclic rate: the schedule
    assert run(40.0) == [3]  # 40x between consecutive epochs: no schedule; fires at the 3rd swing


# -- val_decline against the validation mean's standard error ------------------------------------------------------
class _Drifting(ClusterMLP):
    """Validation loss = the model's loss times ``1 + drift * validation run`` (a controlled worsening)."""

    def __init__(self, drift: float) -> None:
        super().__init__(lr=1e-3)
        self.drift, self.runs, self.returns = drift, 0, True

    def on_validation_epoch_end(self) -> None:
        self.runs += 1

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor | None:
        x, y = batch
        with torch.no_grad():
            per_sample = nn.functional.cross_entropy(self.net(x), y, reduction="none")
        # a fixed reference loss (weights held still: lr 0), drifting by `drift` per run
        loss = per_sample.mean() * (1.0 + self.drift * self.runs)
        self.log("val_loss", loss, on_epoch=True)
        return loss if self.returns else None


@pytest.mark.parametrize(("drift", "fires"), [(0.0003, False), (0.05, True)])
def test_val_decline_compares_the_worsening_with_the_standard_error(tmp_path, drift, fires):
    model = _Drifting(drift)
    model.lr = 0.0  # the weights stay: only the drift moves the validation loss
    alarm = AnomalyAlarm()
    _fit(model, tmp_path, alarm, 8, train_dataloaders=cluster_loader(4 * 32),
         val_dataloaders=cluster_loader(4096, batch_size=64, seed=1))
    rule = alarm.val_decline_rule
    assert rule.streak >= 5  # worse on every run
    assert [r for r, _ in _serious(alarm) if r == "val_decline"] == (["val_decline"] if fires else [])
    assert math.isfinite(rule.previous_se or math.nan) and (rule.previous_se or 0) > 0


def test_val_decline_without_returned_values_counts_every_worsening(tmp_path):
    """A `validation_step` that only logs gives no standard error: the streak alone decides (the rule as before)."""
    model = _Drifting(0.0003)
    model.lr, model.returns = 0.0, False
    alarm = AnomalyAlarm()
    _fit(model, tmp_path, alarm, 8, train_dataloaders=cluster_loader(4 * 32),
         val_dataloaders=cluster_loader(4096, batch_size=64, seed=1))
    assert alarm.val_decline_rule.streak >= 5
    assert not math.isfinite(alarm.val_decline_rule.previous_se or math.nan)
    assert [r for r, _ in _serious(alarm) if r == "val_decline"] == ["val_decline"]


# -- loss_stagnant at short epochs ----------------------------------------------------------------------------------
@pytest.mark.parametrize(("fault", "fires"), [("shuffled_labels", True), ("none", False)])
def test_loss_stagnant_sees_memorisation_at_four_steps_an_epoch(tmp_path, fault, fires):
    """The fault library's shuffled labels (and its healthy twin) at 4 steps an epoch: 5 epochs are 20 steps, fewer
    than ``loss_stagnant.min_steps``; the training loss falls while validation does not improve on 5 runs."""
    model, data, _ = build_fault(fault)
    alarm = AnomalyAlarm()
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(max_epochs=5, limit_train_batches=4, default_root_dir=tmp_path, callbacks=[alarm],
                         logger=False, log_every_n_steps=5, **FAST)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, datamodule=data)
    assert trainer.global_step == 20
    assert [r for r, _ in _serious(alarm) if r == "loss_stagnant"] == (["loss_stagnant"] if fires else [])


# -- val_fluctuation against the validation noise ------------------------------------------------------------------
@pytest.mark.parametrize(("relative_se", "fires"), [(0.3, False), (0.01, True)])
def test_val_fluctuation_discounts_the_validation_noise(relative_se, fires):
    """A validation loss zig-zagging by 40% of its level fires when its standard error is 1% of it, not when it is
    30%: then the zig-zag is the validation set's own noise."""
    from lightning_diag.rules import StepContext, ValFluctuationRule
    from lightning_diag.rules.measures import Measures, Validation

    rule, fired = ValFluctuationRule(), []
    train = [1.0, 0.9, 0.8, 0.72, 0.65, 0.59]
    val = [1.0, 1.4, 0.9, 1.5, 0.9, 1.4]  # the window of the first five is judged at the sixth
    for i, (t, v) in enumerate(zip(train, val, strict=True)):
        fired += rule.judge(StepContext(i, 10 * i), Measures(validation=Validation(v, train=t, se=relative_se * v)))
    assert bool(fired) is fires
    assert math.isfinite(rule.last_noise)  # judged, and its margin noted: the ratio's excess where the rest holds
    assert (rule.peaks["val_fluctuation"] > 1) is fires


def test_val_fluctuation_is_quiet_on_two_batch_validations_at_four_steps_an_epoch(tmp_path):
    """The fault library's healthy deep tanh head at 4 steps an epoch, validated 20 times on 2 batches that its
    ``validation_step`` does not return: each validation batch is taken to be as noisy as a training step."""
    model, data, _ = build_fault("healthy_deep")
    alarm = AnomalyAlarm()
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(max_epochs=20, limit_train_batches=4, default_root_dir=tmp_path, callbacks=[alarm],
                         logger=False, log_every_n_steps=5, **FAST)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, datamodule=data)
    rule = alarm.val_fluctuation_rule
    assert math.isfinite(rule.last_noise) and rule.last_noise > 0  # the validation noise was known
    assert [r for r, _ in _serious(alarm) if r == "val_fluctuation"] == []


@pytest.mark.slow
@pytest.mark.parametrize(("momentum", "fires"), [(0.99, True), (0.1, False)])
def test_val_fluctuation_catches_keras_momentum_batchnorm_against_a_large_validation_batch(tmp_path, momentum, fires):
    """BatchNorm with Keras's momentum 0.99 (PyTorch keeps 1% of its running statistics: they follow the last
    batch of 8) makes validation on one batch of 256 jump; its ``validation_step`` returns nothing, so each
    validation sample is taken to be as noisy as a training sample (not a whole training step of 8). Caught at the
    run after the first full window (the sixth, step 384); PyTorch's own momentum is quiet."""
    from tests.callbacks.probe_models import ReluNet, dataset

    model = ReluNet(lr=3e-3, batchnorm=True, seed=0)
    norm = model.net[1]
    assert isinstance(norm, nn.BatchNorm1d)
    norm.momentum = momentum
    alarm = AnomalyAlarm()
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(max_epochs=6, default_root_dir=tmp_path, callbacks=[alarm], logger=False,
                         log_every_n_steps=50, **FAST)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, DataLoader(dataset(512, 0), batch_size=8, shuffle=True),
                    DataLoader(dataset(256, 1), batch_size=256))
    steps = [step for rule, step in _serious(alarm) if rule == "val_fluctuation"]
    assert steps == ([384] if fires else [])
    assert alarm.val_fluctuation_rule.last_noise < 0.2  # the noise of 256 samples, not of a step of 8


# -- loss_outlier --------------------------------------------------------------------------------------------------
def test_loss_outlier_catches_the_first_or_second_of_five_scattered_zeroed_batches(tmp_path):
    """The fault library's transformer, its tokens zeroed at steps 44, 55, 66, 77 and 88 (once it has learned)."""
    model, data, _ = build_fault("zero_input")
    config = dataclasses.replace(model.config, zero_input_every=11, zero_input_from=40)
    alarm = AnomalyAlarm(log_every_n_steps=5)
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(max_steps=95, default_root_dir=tmp_path, callbacks=[alarm], logger=False, **FAST)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(build_model(config), datamodule=data)
    outliers = [step for rule, step in _serious(alarm) if rule == "loss_outlier"]
    assert outliers and outliers[0] in (45, 56), outliers  # the step after the zeroed batch (its loss's step)


def test_loss_outlier_is_quiet_at_batch_size_1(tmp_path):
    alarm = AnomalyAlarm()
    model = ClusterMLP(lr=1e-2, optimizer="sgd")
    _fit(model, tmp_path, alarm, 1, train_dataloaders=cluster_loader(400, batch_size=1))
    assert [r for r, _ in _serious(alarm) if r == "loss_outlier"] == []


class _HeavyTailed(pl.LightningModule):
    """A linear regression on Student-t (df 2) targets: batch losses with a heavy tail."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x).squeeze(-1), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def test_loss_outlier_is_quiet_on_heavy_tailed_regression(tmp_path):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 8, generator=g)
    noise = torch.distributions.StudentT(2.0).sample((4096,))
    y = x[:, 0] + noise
    loader = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True, generator=g)
    alarm = AnomalyAlarm(log_every_n_steps=1)
    _fit(_HeavyTailed(), tmp_path, alarm, 1, train_dataloaders=loader)
    assert [r for r, _ in _serious(alarm) if r == "loss_outlier"] == []
    assert alarm.outlier_rule.peaks  # it judged the steps


# -- resume ---------------------------------------------------------------------------------------------------------
def test_the_noise_state_survives_a_resume(tmp_path):
    alarm = AnomalyAlarm()
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(max_epochs=3, default_root_dir=tmp_path, callbacks=[alarm], logger=False,
                         **{**FAST, "enable_checkpointing": True})
    trainer.fit(ClusterMLP(), train_dataloaders=cluster_loader(8 * 32))
    ckpt = tmp_path / "mid.ckpt"
    trainer.save_checkpoint(ckpt)
    saved = alarm.swing_rule.state_dict()
    assert saved["previous_noise"] is not None and len(saved["recent"]) == 3

    resumed = AnomalyAlarm()
    loaded: dict[str, Any] = {}
    original = resumed.load_state_dict

    def spy(state: Any) -> None:
        original(state)
        loaded.update(resumed.swing_rule.state_dict())

    resumed.load_state_dict = spy  # type: ignore[method-assign]
    trainer2 = pl.Trainer(max_epochs=4, default_root_dir=tmp_path, callbacks=[resumed], logger=False, **FAST)
    trainer2.fit(ClusterMLP(), train_dataloaders=cluster_loader(8 * 32), ckpt_path=str(ckpt))
    assert loaded["recent"] == saved["recent"] and loaded["previous_noise"] == saved["previous_noise"]
    assert len(resumed.swing_rule.recent) == 4
