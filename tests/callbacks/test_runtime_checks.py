"""AnomalyAlarm's run-time checks: train() overrides Lightning bypasses, dropout in evaluation, mixed precision not
applied, per-step loss outliers and spectral norms evaluated before training. Each fault's effect is proved by an
oracle (what the model really did), each rule fires on its fault and stays quiet on the healthy twin."""

from __future__ import annotations

import pytest
import pytorch_lightning as pl
import torch
from torch import nn

from benchmarks.calibration_faults import SpectralCritic, critic_loader
from lightning_diag import AnomalyAlarm
from lightning_diag.demo import build_fault, run_demo
from lightning_diag.instrument.runtime_probes import (
    DropoutWatch,
    MatmulDtypeProbe,
    train_override_effects,
    unconverged_spectral_norms,
)
from lightning_diag.rules.loss_outlier import LossOutlierRule, judge_losses
from lightning_diag.rules.measures import Measures, StepLosses

FAST = {
    "accelerator": "cpu",
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "enable_checkpointing": False,
    "logger": False,
}


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _warnings(alerts, rule):
    return [a for a in alerts if a.rule == rule and a.severity != "info"]


# -- oracles: the faults do what they say ------------------------------------------------------------------------
def test_train_override_fault_trains_the_parameters_its_override_freezes(tmp_path):
    model, data, _ = build_fault("train_override")
    before = model.embed.weight.detach().clone()
    pl.Trainer(max_steps=3, default_root_dir=tmp_path, limit_val_batches=0, **FAST).fit(model, datamodule=data)
    assert model.embed.weight.requires_grad and not torch.equal(model.embed.weight, before)  # meant to be frozen


def test_eval_dropout_fault_makes_two_evaluations_of_one_batch_disagree():
    model, data, _ = build_fault("eval_dropout")
    data.setup("fit")
    tokens, mask, _ = next(iter(data.val_dataloader()))
    model.eval()
    with torch.no_grad():
        assert not torch.equal(model(tokens, mask), model(tokens, mask))
    healthy, _, _ = build_fault("healthy_dropout")
    healthy.eval()
    with torch.no_grad():
        assert torch.equal(healthy(tokens, mask), healthy(tokens, mask))


def test_autocast_off_fault_computes_in_float32_under_bf16_autocast():
    model, data, _ = build_fault("autocast_off")
    data.setup("fit")
    tokens, mask, _ = next(iter(data.train_dataloader()))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert model(tokens, mask).dtype == torch.float32
        healthy, _, _ = build_fault("healthy_bf16_mixed")
        assert healthy(tokens, mask).dtype == torch.bfloat16


# -- the rules on their faults and healthy twins (the fault library) -----------------------------------------------
@pytest.mark.parametrize(
    ("fault", "rule", "step", "words"),
    [
        ("train_override", "train_override_bypassed", 0, "embed.weight"),
        ("eval_dropout", "eval_randomness", 0, "p=0.1"),
        ("autocast_off", "amp_not_applied", 1, "bf16-mixed"),
        ("zero_input", "loss_outlier", 61, "untrained model's level"),
    ],
)
def test_each_runtime_fault_is_one_alert_naming_its_cause(tmp_path, fault, rule, step, words):
    result = run_demo(fault, root=str(tmp_path))
    hits = _warnings(result.alerts, rule)
    assert [a.global_step for a in hits] == [step]
    assert words in hits[0].message


@pytest.mark.parametrize("fault", ["healthy_train_override", "healthy_bf16_mixed", "healthy_dropout"])
def test_runtime_healthy_twins_raise_no_warning(tmp_path, fault):
    result = run_demo(fault, root=str(tmp_path))
    assert [a.format() for a in result.alerts if a.severity != "info"] == []


# -- no change to the run ------------------------------------------------------------------------------------------
def test_the_override_check_leaves_the_trained_weights_bitwise_identical(tmp_path):
    def train(callbacks):
        model, data, _ = build_fault("train_override")
        pl.seed_everything(0, verbose=False)
        trainer = pl.Trainer(max_steps=4, default_root_dir=tmp_path, callbacks=callbacks, deterministic=True, **FAST)
        trainer.fit(model, datamodule=data)
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    bare, watched = train([]), train([AnomalyAlarm()])
    assert bare.keys() == watched.keys() and all(torch.equal(bare[k], watched[k]) for k in bare)


def test_train_override_effects_puts_every_flag_back_and_ignores_a_failing_override():
    class Broken(nn.Linear):
        def train(self, mode=True):
            raise RuntimeError("user bug")

    net = nn.Sequential(nn.Linear(2, 2), Broken(2, 2))
    assert train_override_effects(net) == ([], [])
    assert all(m.training for m in net.modules()) and all(p.requires_grad for p in net.parameters())

    class FreezeBN(nn.Module):
        def __init__(self):
            super().__init__()
            self.bn, self.fc = nn.BatchNorm1d(2), nn.Linear(2, 2)

        def train(self, mode=True):
            super().train(mode)
            self.bn.eval()
            return self

    net2 = FreezeBN()
    assert train_override_effects(net2) == (["bn"], [])
    assert net2.bn.training  # put back


# -- the probes ----------------------------------------------------------------------------------------------------
def test_dropout_watch_sees_functional_module_and_sdpa_dropout_only_in_training_mode():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.drop, self.fc = nn.Dropout(0.2), nn.Linear(4, 4)

        def forward(self, x):
            q = self.fc(self.drop(x)).reshape(1, 1, 2, 2)
            y = nn.functional.scaled_dot_product_attention(q, q, q, dropout_p=0.3)
            return nn.functional.dropout(y, 0.1, training=self.training)

    net = Net().eval()
    watch = DropoutWatch(net)
    watch.start()
    net(torch.ones(1, 4))
    watch.stop()
    assert watch.found == {"": 0.3}  # the attention's dropout_p ignores eval mode; the others follow it
    net.drop.train()  # a Dropout module left in training mode during evaluation
    watch.start()
    net(torch.ones(1, 4))
    watch.stop()
    assert watch.found == {"drop": 0.2, "": 0.3}
    assert not watch.active


def test_matmul_probe_reads_the_compute_dtype_under_autocast():
    net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Conv1d(1, 1, 1))
    probe = MatmulDtypeProbe(net)
    probe.start()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        net[0](torch.ones(2, 4))
        with torch.autocast("cpu", enabled=False):
            net[2](torch.ones(1, 1, 3))
    probe.stop()
    assert probe.layers == {"0": 20, "2": 2} and probe.float32 == {"2": 2}


def loss_outliers(*args, **kwargs):
    """``(index, loss, median)`` of the outliers :func:`judge_losses` finds."""
    return [(i, x, med) for i, x, excess, med in judge_losses(*args, **kwargs) if excess > 1.0]


def test_loss_outliers_need_history_and_the_untrained_level():
    steady = [0.05 + 0.01 * (i % 3) for i in range(32)]
    ((index, loss, median),) = loss_outliers(steady, [1.5], 10.0, 2.0, 32, floor=0.7)
    assert (index, loss) == (0, 1.5) and median == pytest.approx(0.06)
    assert loss_outliers(steady, [0.4], 10.0, 2.0, 32, floor=0.7) == []  # a hard batch near convergence
    assert loss_outliers(steady[:7], [1.5], 10.0, 2.0, 32, floor=0.7) == []  # fewer than window / 4 before it
    assert loss_outliers(steady[:8], [1.5], 10.0, 2.0, 32, floor=0.7) != []  # 8: judged, against a stricter bound
    assert loss_outliers(steady, [float("nan"), 0.06], 10.0, 2.0, 32) == []  # non-finite: other rules' concern
    falling = [2.0 * 0.9**i for i in range(32)]
    assert loss_outliers(falling, [falling[-1] * 0.9], 10.0, 2.0, 32, floor=0.7) == []


def test_loss_outlier_rule_state_round_trips():
    rule = LossOutlierRule(window=8)  # the untrained level: the median of the first window / 4 = 2 steps
    rule.judge(_ctx(5), Measures(step_losses=StepLosses([1.0, 0.5, 0.4, 0.3, 0.3], [1, 2, 3, 4, 5])))
    copy = LossOutlierRule(window=8)
    copy.load_state_dict(rule.state_dict())
    assert copy.history == rule.history and copy.initial == rule.initial == 0.75


def _ctx(step):
    from lightning_diag.rules.base import StepContext

    return StepContext(0, step)


# -- spectral norm evaluated before training ---------------------------------------------------------------------
def test_validation_before_the_first_training_forward_of_a_spectral_norm_is_flagged(tmp_path):
    model = SpectralCritic()
    assert unconverged_spectral_norms(model) == ["fc"]
    alarm = AnomalyAlarm()
    pl.Trainer(default_root_dir=tmp_path, callbacks=[alarm], **FAST).validate(model, critic_loader())
    hits = [a for a in alarm.alerts if a.rule == "eval_before_training"]
    assert [(a.severity, a.source) for a in hits] == [("warning", "fc")]

    alarm = AnomalyAlarm()  # in fit, the sanity check sees it first: information only
    trainer = pl.Trainer(max_steps=4, default_root_dir=tmp_path, callbacks=[alarm], **FAST)
    trainer.fit(model, critic_loader(), critic_loader())
    hits = [a for a in alarm.alerts if a.rule == "eval_before_training"]
    assert [a.severity for a in hits] == ["info"]
    assert unconverged_spectral_norms(model) == []  # trained: quiet from now on

    alarm = AnomalyAlarm()
    pl.Trainer(default_root_dir=tmp_path, callbacks=[alarm], **FAST).validate(model, critic_loader())
    assert [a for a in alarm.alerts if a.rule == "eval_before_training"] == []


def test_runtime_rule_state_survives_a_resume(tmp_path):
    model, data, _ = build_fault("zero_input")
    alarm = AnomalyAlarm(log_every_n_steps=5)
    trainer = pl.Trainer(
        max_steps=40, default_root_dir=tmp_path, callbacks=[alarm], **{**FAST, "enable_checkpointing": True}
    )
    trainer.fit(model, datamodule=data)
    ckpt = tmp_path / "mid.ckpt"
    trainer.save_checkpoint(ckpt)
    history, initial = list(alarm.outlier_rule.history), alarm.outlier_rule.initial
    assert initial is not None and len(history) == 32

    model2, data2, _ = build_fault("zero_input")
    resumed = AnomalyAlarm(log_every_n_steps=5)
    loaded = {}
    original = resumed.load_state_dict

    def spy(state):
        original(state)
        loaded.update(history=list(resumed.outlier_rule.history), initial=resumed.outlier_rule.initial)

    resumed.load_state_dict = spy  # type: ignore[method-assign]
    trainer2 = pl.Trainer(max_steps=70, default_root_dir=tmp_path, callbacks=[resumed], **FAST)
    trainer2.fit(model2, datamodule=data2, ckpt_path=str(ckpt))
    assert loaded == {"history": history, "initial": initial}
    assert [a.global_step for a in _warnings(resumed.alerts, "loss_outlier")] == [61]
