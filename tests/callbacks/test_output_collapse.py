"""AnomalyAlarm's ``output_collapse`` (issue 45, class 5) and batch size 1 (class 6): predictions that no longer
depend on the input are named at the first eligible measurements; confident classifiers, generative models whose
outputs vary little and batches of one sample stay quiet; ``zero_output`` no longer misreads one sample's dead
ReLU units as a corrupted copy."""

from __future__ import annotations

import logging

import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_diag import AnomalyAlarm
from lightning_diag.demo import build_fault, run_demo
from lightning_diag.instrument.output_watch import OutputSpreadWatch, spread_level

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


def _warnings(alerts, rule=None):
    return [a for a in alerts if a.severity != "info" and (rule is None or a.rule == rule)]


class _Head(pl.LightningModule):
    """A small MLP whose ``training_step`` calls ``self.net`` (not ``self``): the output is its last child's.
    ``constant``: a softmax over one output unit (every prediction exactly 1)."""

    def __init__(self, constant: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        last: list[nn.Module] = [nn.Linear(16, 1), nn.Softmax(-1)] if constant else [nn.Linear(16, 2)]
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), *last)
        self.loss_fn = nn.MSELoss()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return self.loss_fn(self.net(x)[:, 0], y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _loader(batch_size=8):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=g)
    return DataLoader(TensorDataset(x, x.sum(1)), batch_size=batch_size)


def _fit(tmp_path, model, alarm, max_steps=30, batch_size=8, **kwargs):
    trainer = pl.Trainer(max_steps=max_steps, default_root_dir=tmp_path, callbacks=[alarm], **{**FAST, **kwargs})
    trainer.fit(model, _loader(batch_size))
    return trainer


# -- the faults of the library and their healthy twins -------------------------------------------------------------
def test_label_scale_oracle_predictions_collapse_from_the_start(tmp_path):
    model, data, fault = build_fault("label_scale")
    spreads: dict[int, float] = {}

    def spy(module, args, output):
        if module.training:
            spreads[model.global_step] = float(output.std(0).max())

    model.register_forward_hook(spy)
    pl.seed_everything(0, verbose=False)  # as run_demo
    trainer = pl.Trainer(max_steps=60, default_root_dir=tmp_path, deterministic=True, **FAST)
    trainer.fit(model, datamodule=data)
    assert fault.onset_step == 0 and spreads[0] > 1e-2  # wrong labels from the first step; the output varies there
    late = [spreads[s] for s in range(45, 60)]
    assert max(late) < 1e-3 and late.count(0.0) >= 12  # every input gets the same output from step 45


@pytest.mark.parametrize(("fault", "step", "value"), [("label_scale", 39, 0.01), ("single_softmax", 14, 0.0)])
def test_collapse_faults_are_named_at_their_first_eligible_measurements(tmp_path, fault, step, value):
    result = run_demo(fault, root=str(tmp_path))
    hits = _warnings(result.alerts, "output_collapse")
    assert [(a.global_step, a.source) for a in hits] == [(step, "<root>")]  # patience 3, measured at 4, 9, 14, ...
    assert "no longer depend on the input" in hits[0].message and "relative spread of the inputs" in hits[0].message
    assert hits[0].value is not None and hits[0].value <= value  # label_scale: still narrowing at its 3rd step
    assert _warnings(result.alerts, "zero_output") == []  # dead ReLU units are not a corrupted copy


@pytest.mark.slow
@pytest.mark.parametrize("name", ["healthy_onehot_mse", "healthy_sigmoid", "healthy_confident", "healthy_denoiser"])
def test_healthy_twins_confident_classifiers_and_generative_outputs_stay_quiet(tmp_path, name):
    alarm = AnomalyAlarm()
    result = run_demo(name, root=str(tmp_path), callbacks=[alarm])
    assert [a.format() for a in _warnings(result.alerts)] == []
    rule = alarm.collapse_rule
    assert rule.checks == result.global_step // 5  # every sampled step (4, 9, 14, ...) measured
    assert 0 < rule.peaks["output_collapse"] < 0.2  # the margin: 5x and more below the threshold


# -- where the output comes from --------------------------------------------------------------------------------
def test_output_of_a_step_that_calls_a_child_is_the_childs_and_collapse_fires(tmp_path):
    alarm = AnomalyAlarm()
    _fit(tmp_path, _Head(constant=True), alarm, max_steps=16)
    hits = _warnings(alarm.alerts, "output_collapse")
    assert [(a.global_step, a.source) for a in hits] == [(14, "net")]  # measured at 4, 9, 14
    healthy = AnomalyAlarm()
    _fit(tmp_path, _Head(), healthy, max_steps=16)
    assert _warnings(healthy.alerts) == [] and healthy.collapse_rule.checks == 3 and healthy.collapse_rule.last > 0.1


def test_watch_prefers_the_lightning_modules_own_output_and_its_logits():
    class Wrapped(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Linear(3, 4)

        def forward(self, x):
            return {"loss": self.body(x).sum(), "logits": self.body(x) * 0 + 1.0}

    net = Wrapped()
    watch = OutputSpreadWatch(net)
    watch.start()
    x = torch.randn(5, 3)
    net(x)
    watch.stop()
    name, batch, stats = watch.take()
    values = [v.item() for v in stats]
    assert name == "<root>" and batch == 5 and values[:2] == [0.0, 1.0]  # the constant logits, not body's output
    assert values[2:] == pytest.approx([t.item() for t in spread_level(x)])  # and the input's spread and level
    assert watch.take() is None and not any(m._forward_hooks for m in net.modules())


def test_the_input_spread_is_unknown_for_token_ids_and_the_output_is_judged_alone():
    embed = nn.Embedding(10, 4)
    watch = OutputSpreadWatch(embed)
    watch.start()
    embed(torch.tensor([[1, 2], [3, 4]]))
    watch.stop()
    _, _, stats = watch.take()
    assert len(stats) == 2  # the output's spread and level alone: no floating-point input
    from lightning_diag.rules.base import StepContext
    from lightning_diag.rules.measures import Measures, OutputSpread
    from lightning_diag.rules.output_collapse import OutputCollapseRule

    alone, against = OutputCollapseRule(patience=1), OutputCollapseRule(patience=1)
    # 0.005 of the level, inputs unknown
    (alert,) = alone.judge(StepContext(0, 0), Measures(output_spread=OutputSpread(0.005, 1.0, 8, "<root>")))
    assert alert.value == pytest.approx(0.005 / 1.005) and "inputs' spread not known" in alert.message
    # the same outputs from inputs that are as narrow (a denoiser's cloud): they follow their inputs
    assert against.judge(StepContext(0, 0), Measures(output_spread=OutputSpread(0.005, 1.0, 8, "<root>", 0.02))) == []
    assert against.last == pytest.approx(0.005 / 1.005 / 0.02)
    assert [t.item() for t in spread_level(torch.tensor([2.0]))] == [0.0, 2.0]  # one sample: no spread


# -- batch size 1 (class 6) -------------------------------------------------------------------------------------
def test_batch_size_one_is_not_measured_and_said_once(tmp_path, caplog):
    alarm = AnomalyAlarm()
    with caplog.at_level(logging.INFO, logger="lightning_diag"):
        _fit(tmp_path, _Head(), alarm, max_steps=30, batch_size=1)
    assert _warnings(alarm.alerts) == []
    rule = alarm.collapse_rule
    assert (rule.checks, rule.unmeasured) == (0, 6)
    said = [r.getMessage() for r in caplog.records if "batches of one sample" in r.getMessage()]
    assert len(said) == 1


def test_one_samples_dead_relu_units_are_not_a_zero_output(tmp_path):
    """At batch size 1 a ReLU whose every unit is inactive for that one input returns all zeros: a plausible
    activation pattern, not a copy that arrived as zeros. A zero from a module with outputs of both signs is."""

    class Sparse(pl.LightningModule):
        def __init__(self, corrupt_at: int = -1):
            super().__init__()
            torch.manual_seed(0)
            self.first = nn.Linear(8, 4)
            self.act = nn.ReLU()
            self.last = nn.Linear(4, 1)
            self.corrupt_at = corrupt_at
            with torch.no_grad():
                self.first.bias.fill_(-1.0)  # about one sample in five: every unit inactive
            self.first.register_forward_hook(self._transfer)

        def _transfer(self, module, args, output):
            return torch.zeros_like(output) if self.global_step == self.corrupt_at else output  # arrived as zeros

        def training_step(self, batch, batch_idx):
            x, y = batch
            return ((self.last(self.act(self.first(x))).squeeze(-1) - y) ** 2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    zeros: list[int] = []
    healthy = AnomalyAlarm()
    model = Sparse()
    model.act.register_forward_hook(lambda m, a, o: zeros.append(int(not o.any())))
    _fit(tmp_path, model, healthy, max_steps=80, batch_size=1)
    assert sum(zeros) >= 5  # the oracle: single samples with every unit inactive do occur
    assert _warnings(healthy.alerts, "zero_output") == [] and "act" in healthy.zero_rule.zeroed
    assert "act" not in healthy.zero_rule.signed and "first" in healthy.zero_rule.signed

    faulty = AnomalyAlarm()
    _fit(tmp_path, Sparse(corrupt_at=59), faulty, max_steps=80, batch_size=1)  # a sampled step (4, 9, ..., 59)
    hits = _warnings(faulty.alerts, "zero_output")
    assert [(a.global_step, a.source) for a in hits] == [(59, "first")] and "`act`" not in hits[0].message


# -- the run is unchanged; switched off; resumed ------------------------------------------------------------------
def test_the_watch_leaves_the_trained_weights_bitwise_identical_and_removes_its_hooks(tmp_path):
    def train(callbacks):
        model = _Head()
        pl.seed_everything(0, verbose=False)
        trainer = pl.Trainer(max_steps=25, default_root_dir=tmp_path, callbacks=callbacks, deterministic=True, **FAST)
        trainer.fit(model, _loader())
        hooks = sum(len(m._forward_hooks) for m in model.modules())
        return {k: v.detach().clone() for k, v in model.state_dict().items()}, hooks

    (bare, bare_hooks), (watched, watched_hooks) = train([]), train([AnomalyAlarm()])
    assert bare.keys() == watched.keys() and all(torch.equal(bare[k], watched[k]) for k in bare)
    assert bare_hooks == watched_hooks == 0


def test_switched_off_installs_nothing(tmp_path):
    alarm = AnomalyAlarm(rules={"output_collapse": False})
    _fit(tmp_path, _Head(constant=True), alarm, max_steps=20)
    assert alarm.runtime.outputs._watch is None and _warnings(alarm.alerts, "output_collapse") == []
    with pytest.raises(ValueError, match="output_collapse"):
        AnomalyAlarm(rules={"output_collapse": {"patience": 0}})


def test_state_survives_a_resume(tmp_path):
    # patience 4: 2 collapsed measurements before the checkpoint (steps 4, 9) and 2 after it (14, 19)
    settings = {"output_collapse": {"patience": 4}}
    alarm = AnomalyAlarm(rules=settings)
    trainer = _fit(tmp_path, _Head(constant=True), alarm, max_steps=10)
    ckpt = tmp_path / "mid.ckpt"
    trainer.save_checkpoint(ckpt)
    assert alarm.collapse_rule.streak == 2 and _warnings(alarm.alerts) == []

    resumed = AnomalyAlarm(rules=settings)
    trainer2 = pl.Trainer(max_steps=20, default_root_dir=tmp_path, callbacks=[resumed], **FAST)
    trainer2.fit(_Head(constant=True), _loader(), ckpt_path=str(ckpt))
    assert [a.global_step for a in _warnings(resumed.alerts, "output_collapse")] == [19]


@pytest.mark.slow
def test_at_batch_size_one_no_batch_rule_misreads_one_sample(tmp_path):
    fault = run_demo("oscillation_bs1", root=str(tmp_path / "fault"))
    assert _warnings(fault.alerts, "zero_output") == _warnings(fault.alerts, "output_collapse") == []
    healthy = run_demo("healthy_bs1", root=str(tmp_path / "healthy"))
    assert [a.format() for a in _warnings(healthy.alerts)] == []


@pytest.mark.slow
def test_the_batch_size_one_oscillation_is_a_swing(tmp_path):
    # its validation loss swings 4.2 -> 10.8 -> 21.1 -> 12.9 on the same 128 samples (loss_swing's validation view)
    fault = run_demo("oscillation_bs1", root=str(tmp_path / "fault"))
    assert [(a.source, a.epoch) for a in _warnings(fault.alerts, "loss_swing")] == [("val_loss", 3)]


def test_spread_of_a_large_output_reads_a_strided_subset():
    big = torch.randn(4, 3, 50_000)
    big[:, :, ::3] = 1.0  # every third element equal across the batch
    full, sampled = spread_level(big, max_elements=10**9), spread_level(big, max_elements=1000)
    assert sampled[0].item() == pytest.approx(full[0].item(), rel=0.2)  # the same statistic, from 1/150 of it
    assert sampled[0].item() != full[0].item()  # read from the subset
    assert spread_level(big[:, :, ::3].contiguous(), max_elements=1000)[0].item() == 0.0
