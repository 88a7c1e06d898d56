"""AnomalyAlarm's ``zero_output``: a module whose output turns all-zero on a sampled step (a copy that arrived as
zeros). The fault's effect is proved by an oracle, the rule fires on the transition and never on a module that was
zero for a healthy reason (dead from the start, zero-initialised)."""

from __future__ import annotations

import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_diag import AnomalyAlarm
from lightning_diag.demo import build_fault, run_demo
from lightning_diag.instrument.output_watch import ZeroOutputWatch
from lightning_diag.rules.base import StepContext
from lightning_diag.rules.measures import Measures, ZeroOutputs
from lightning_diag.rules.zero_output import ZeroOutputRule
from tests import launch

FAST = {
    "accelerator": "cpu",
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "enable_checkpointing": False,
    "logger": False,
    "log_every_n_steps": 5,
}


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _warnings(alerts, rule="zero_output"):
    return [a for a in alerts if a.rule == rule and a.severity != "info"]


class _Split(pl.LightningModule):
    """Two halves and a hand-off between them; ``dead``: a ReLU branch dead from the start (bias -100), whose
    output is all zeros on every step for a reason that has nothing to do with corruption."""

    def __init__(self, corrupt_every: int = 0, corrupt_from: int = 20) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Sequential(nn.Linear(8, 16), nn.Tanh())
        self.second = nn.Linear(16, 1)
        self.dead = nn.Sequential(nn.Linear(8, 4), nn.ReLU())
        with torch.no_grad():
            self.dead[0].bias.fill_(-100.0)
        self.corrupt_every, self.corrupt_from = corrupt_every, corrupt_from
        self.first.register_forward_hook(self._transfer)

    def _transfer(self, module, args, output):
        step = self.global_step
        every, start = self.corrupt_every, self.corrupt_from
        if every and self.training and step >= start and (step - start) % every == 0:
            return torch.zeros_like(output)
        return output

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = self.first(x) + 0.0 * self.dead(x).sum()
        return ((self.second(h).squeeze(-1) - y) ** 2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _loader():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=g)
    return DataLoader(TensorDataset(x, x.sum(1)), batch_size=8)


def _fit(tmp_path, model, alarm, max_steps=40, **kwargs):
    trainer = pl.Trainer(max_steps=max_steps, default_root_dir=tmp_path, callbacks=[alarm], **{**FAST, **kwargs})
    trainer.fit(model, _loader())
    return trainer


# -- the oracle: the fault does what it says ----------------------------------------------------------------------
def test_zero_transfer_fault_zeroes_the_hand_off_on_its_steps_only(tmp_path):
    model, data, fault = build_fault("zero_transfer")
    zero_steps: dict[int, bool] = {}

    def spy(module, args, output):
        if module.training:
            zero_steps[model.global_step] = not bool(output.any())

    model.encoder.layers[0].register_forward_hook(spy)  # after the fault's hook: sees what layer 1 receives
    pl.Trainer(max_steps=70, default_root_dir=tmp_path, limit_val_batches=0, **FAST).fit(model, datamodule=data)
    assert fault.onset_step == 63
    assert sorted(s for s, zero in zero_steps.items() if zero) == [63, 66, 69]
    assert len(zero_steps) == 70


# -- the rule on its fault and its healthy twin (the fault library) -------------------------------------------------
def test_zero_transfer_is_one_alert_at_the_first_sampled_corrupted_step(tmp_path):
    result = run_demo("zero_transfer", root=str(tmp_path))
    hits = _warnings(result.alerts)
    # sampled every 5 steps on the logging cadence (4, 9, ...): the corrupted steps 63 and 66 are not, 69 is
    assert [(a.global_step, a.source) for a in hits] == [(69, "encoder.layers.0")]
    assert "arrived as zeros" in hits[0].message
    assert [a.global_step for a in _warnings(result.alerts, "loss_outlier")]  # the steps in between: loss_outlier


def test_zero_initialised_adapter_is_a_healthy_zero_to_nonzero_transition(tmp_path):
    model, data, _ = build_fault("healthy_zero_init")
    seen: list[bool] = []
    model.adapter[2].register_forward_hook(lambda m, a, o: seen.append(bool(o.any())) if m.training else None)
    alarm = AnomalyAlarm()
    every_step = {**FAST, "log_every_n_steps": 1}  # sampled from step 0 (the only one whose output is zero)
    pl.Trainer(max_steps=20, default_root_dir=tmp_path, callbacks=[alarm], limit_val_batches=0, **every_step).fit(
        model, datamodule=data
    )
    assert seen[0] is False and all(seen[1:])  # zero until the first update, then non-zero
    assert "adapter.2" in alarm.zero_rule.zeroed and _warnings(alarm.alerts) == []
    result = run_demo("healthy_zero_init", root=str(tmp_path / "demo"))
    assert [a.format() for a in result.alerts if a.severity != "info"] == []


def test_a_relu_dead_from_the_start_never_fires_a_transient_zero_does(tmp_path):
    healthy = AnomalyAlarm()
    _fit(tmp_path, _Split(), healthy)
    assert "dead.1" in healthy.zero_rule.zeroed and "dead.0" not in healthy.zero_rule.zeroed  # all-zero all along
    assert _warnings(healthy.alerts) == []

    faulty = AnomalyAlarm()
    _fit(tmp_path, _Split(corrupt_every=10, corrupt_from=19), faulty)  # sampled steps 4, 9, 14, 19, ...
    assert [(a.global_step, a.source) for a in _warnings(faulty.alerts)] == [(19, "first")]  # once per module


def test_switched_off_installs_nothing(tmp_path):
    alarm = AnomalyAlarm(rules={"zero_output": False})
    _fit(tmp_path, _Split(corrupt_every=10, corrupt_from=19), alarm, max_steps=25)  # 19: a sampled step
    assert alarm.runtime.zero_outputs._watch is None and _warnings(alarm.alerts) == []
    assert alarm.zero_rule.checks == 0


def test_threshold_sets_the_measurements_needed_before_a_transition(tmp_path):
    # sampled steps 4, 9, 14, 19, 24, ...: 4 measurements with both signs before the corrupted step 24
    alarm = AnomalyAlarm(rules={"zero_output": {"threshold": 5}})
    _fit(tmp_path, _Split(corrupt_every=10, corrupt_from=24), alarm)
    assert _warnings(alarm.alerts) == []
    enough = AnomalyAlarm(rules={"zero_output": {"threshold": 4}})
    _fit(tmp_path, _Split(corrupt_every=10, corrupt_from=24), enough)
    assert [(a.rule, a.global_step) for a in _warnings(enough.alerts)] == [("zero_output", 24)]
    with pytest.raises(ValueError, match="zero_output"):
        AnomalyAlarm(rules={"zero_output": {"threshold": 0}})


# -- no change to the run, and nothing left installed ---------------------------------------------------------------
def test_the_watch_leaves_the_trained_weights_bitwise_identical_and_removes_its_hooks(tmp_path):
    def train(callbacks):
        model = _Split(corrupt_every=10, corrupt_from=19)
        pl.seed_everything(0, verbose=False)
        trainer = pl.Trainer(max_steps=25, default_root_dir=tmp_path, callbacks=callbacks, deterministic=True, **FAST)
        trainer.fit(model, _loader())
        hooks = sum(len(m._forward_hooks) for m in model.modules())
        return {k: v.detach().clone() for k, v in model.state_dict().items()}, hooks

    (bare, bare_hooks), (watched, watched_hooks) = train([]), train([AnomalyAlarm()])
    assert bare.keys() == watched.keys() and all(torch.equal(bare[k], watched[k]) for k in bare)
    assert bare_hooks == watched_hooks == 1  # the fault's own hook only


def test_state_survives_a_resume(tmp_path):
    # threshold 10: 8 measurements before the checkpoint (steps 4..39) and 7 after it (44..74) reach it only together
    settings = {"zero_output": {"threshold": 10}}
    alarm = AnomalyAlarm(rules=settings)
    trainer = _fit(tmp_path, _Split(), alarm, max_steps=40)
    ckpt = tmp_path / "mid.ckpt"
    trainer.save_checkpoint(ckpt)
    assert alarm.zero_rule.nonzero["first"] == 8

    resumed = AnomalyAlarm(rules=settings)
    trainer2 = pl.Trainer(max_steps=80, default_root_dir=tmp_path, callbacks=[resumed], **FAST)
    trainer2.fit(_Split(corrupt_every=79, corrupt_from=79), _loader(), ckpt_path=str(ckpt))
    assert [a.global_step for a in _warnings(resumed.alerts)] == [79]
    assert resumed.zero_rule.nonzero["second"] == 16  # 8 measurements before the checkpoint, 8 after it


# -- the watch and the rule alone ---------------------------------------------------------------------------------
def test_watch_reads_tuple_outputs_and_skips_losses_integers_and_empty_outputs():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = nn.GRU(3, 4, batch_first=True)
            self.loss = nn.MSELoss()
            self.ids = nn.Identity()

        def forward(self, x):
            out, _ = self.rnn(x)
            self.ids(torch.zeros(2, dtype=torch.long))
            self.ids(torch.zeros(0))
            return self.loss(out, out)  # exactly 0

    net = Net()
    watch = ZeroOutputWatch(net)
    watch.start()
    net(torch.ones(2, 5, 3))
    watch.stop()
    ran, zero = watch.counts().tolist()
    by_name = dict(zip(watch.order, zip(ran, zero, strict=True), strict=True))
    assert "loss" not in by_name
    assert by_name["rnn"] == (1.0, 0.0) and by_name["ids"] == (0.0, 0.0) and by_name[""] == (1.0, 1.0)
    assert not watch.active and all(not m._forward_hooks for m in net.modules())


def test_rule_judges_transitions_and_round_trips_its_state():
    rule = ZeroOutputRule(history=2)
    ctx = StepContext(0, 0)
    assert rule.judge(ctx, Measures(zero_outputs=ZeroOutputs(["a", "b"], ["b"]))) == []  # b zero from the start
    assert rule.judge(ctx, Measures(zero_outputs=ZeroOutputs(["a", "b"], []))) == []
    assert rule.judge(ctx, Measures(zero_outputs=ZeroOutputs(["a", "b"], []))) == []
    alerts = rule.judge(StepContext(1, 30), Measures(zero_outputs=ZeroOutputs(["a", "b"], ["a", "b"])))
    assert [(a.source, a.global_step, a.value) for a in alerts] == [("a", 30, 1.0)]
    copy = ZeroOutputRule(history=2)
    copy.load_state_dict(rule.state_dict())
    assert copy.zeroed == ["b", "a"] and copy.judge(ctx, Measures(zero_outputs=ZeroOutputs(["a"], ["a"]))) == []


# -- under DDP: a zero on one rank is judged on every rank ----------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["zero", "healthy"])
def test_a_zero_output_on_one_ddp_rank_is_one_alert_on_every_rank(tmp_path, mode):
    import json
    import os
    import sys
    from pathlib import Path

    script = Path(__file__).with_name("ddp_zero_output_script.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = launch.run(
        [sys.executable, str(script), str(tmp_path), mode], timeout=300, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"zero-{mode}{r}.json").read_text()) for r in (0, 1)]
    for rank in ranks:
        hits = [(a["rule"], a["global_step"], a["source"]) for a in rank["alerts"] if a["rule"] == "zero_output"]
        assert hits == ([("zero_output", 19, "first")] if mode == "zero" else [])
        assert rank["checks"] == 6  # steps 4, 9, ..., 29


@pytest.mark.parametrize("threshold", [None, 0], ids=["extremes", "boolean-reductions"])
def test_the_watch_flags_equal_any_and_any_negative_of_every_output(threshold, monkeypatch):
    """``[ran, all_zero, signed]`` per module, read from each output's extremes (or, past the size limit, from two
    boolean reductions), equal those of ``values.any()`` and ``(values < 0).any()``: with +-0, NaN, infinities,
    denormals, half precision and a 0-d output, and with one module called several times."""
    import lightning_diag.instrument.output_watch as output_watch

    if threshold is not None:
        monkeypatch.setattr(output_watch, "EXTREMES_MAX_ELEMENTS", threshold)
    nan, inf = float("nan"), float("inf")
    outputs = {
        "zeros": [torch.tensor([0.0, -0.0])],
        "nan_zero": [torch.tensor([nan, 0.0])],
        "nan_negative": [torch.tensor([nan, -1.0, 0.0])],
        "nan_only": [torch.tensor([nan, nan])],
        "infinities": [torch.tensor([inf, 0.0]), torch.tensor([-inf, -0.0])],
        "denormal": [torch.tensor([-1e-45, 0.0])],
        "low_precision": [torch.tensor([0.0, -2.0], dtype=torch.float16), torch.tensor([0.0], dtype=torch.bfloat16)],
        "scalar": [torch.tensor(3.0)],
        "twice_zero_then_positive": [torch.zeros(4), torch.ones(4)],
        "relu": [torch.relu(torch.randn(64, 600))],
        "signed": [torch.randn(64, 600)],
    }

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.parts = nn.ModuleDict({name: nn.Identity() for name in outputs})

        def forward(self, x):
            for name, values in outputs.items():
                for v in values:
                    self.parts[name](v)
            return x

    net = Net()
    watch = ZeroOutputWatch(net)
    watch.start()
    net(torch.ones(2))
    watch.stop()
    ran, zero, signed = watch.counts(signs=True).tolist()
    got = dict(zip(watch.order, zip(ran, zero, signed, strict=True), strict=True))
    for name, values in outputs.items():
        all_zero = float(not any(bool(v.any()) for v in values))
        negative = float(any(bool((v < 0).any()) for v in values))
        assert got[f"parts.{name}"] == (1.0, all_zero, negative), name
    assert got["parts.zeros"] == (1.0, 1.0, 0.0) and got["parts.nan_negative"] == (1.0, 0.0, 1.0)
