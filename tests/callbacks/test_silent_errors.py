"""Silent training errors through real Trainer.fit runs: update_none, update_stale, grad_not_zeroed
(GradientFlowMonitor), eval_mode_in_training (AnomalyAlarm), their healthy counterparts, and resume."""

import copy

import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_diag import AnomalyAlarm, GradientFlowMonitor
from lightning_diag.demo import build_fault
from tests import launch

FAST = dict(
    enable_progress_bar=False,
    enable_model_summary=False,
    enable_checkpointing=False,
    accelerator="cpu",
    log_every_n_steps=2,
    logger=False,
    num_sanity_val_steps=0,
    limit_val_batches=0,
)
NEW_RULES = {"update_none", "update_stale", "grad_not_zeroed", "eval_mode_in_training", "ddp_desync"}


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class _Net(pl.LightningModule):
    """Linear -> [BatchNorm] -> ReLU -> Dropout -> Linear regression, with switches for the faults.

    Args:
        bug: ``"copy"`` (optimizer over a copy), ``"lr_zero"``, ``"no_zero_grad"`` (manual, no zero_grad),
            ``"eval"`` (``self.eval()`` in ``on_train_epoch_start``), or ``None``.
        manual: ``"plain"`` (backward, step, zero_grad) or ``"accumulate"`` (backward on every batch, step and
            zero_grad every second batch), or ``None`` (automatic optimization).
        lr: AdamW learning rate.
        batchnorm: Add a BatchNorm1d; ``"frozen"`` freezes it (``requires_grad=False``, eval mode each epoch).
    """

    def __init__(self, bug=None, manual=None, lr=1e-2, batchnorm=None, dropout=0.1):
        super().__init__()
        torch.manual_seed(0)
        self.bug, self.lr, self.batchnorm = bug, lr, batchnorm
        self.automatic_optimization = manual is None and bug != "no_zero_grad"
        self.manual = manual or ("plain" if bug == "no_zero_grad" else None)
        self.first = nn.Linear(8, 32)
        self.norm = nn.BatchNorm1d(32) if batchnorm else nn.Identity()
        self.drop = nn.Dropout(dropout)
        self.last = nn.Linear(32, 1)
        if batchnorm == "frozen":
            self.norm.requires_grad_(False)

    def forward(self, x):
        return self.last(self.drop(torch.relu(self.norm(self.first(x)))))

    def _loss(self, batch):
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def on_train_epoch_start(self):
        if self.bug == "eval":
            self.eval()
        if self.batchnorm == "frozen":
            self.norm.eval()

    def training_step(self, batch, batch_idx):
        if self.automatic_optimization:
            return self._loss(batch)
        opt = self.optimizers()
        loss = self._loss(batch)
        if self.manual == "accumulate":
            self.manual_backward(loss / 2)
            if batch_idx % 2 == 1:
                opt.step()
                opt.zero_grad()
        else:
            self.manual_backward(loss)
            opt.step()
            if self.bug != "no_zero_grad":
                opt.zero_grad()
        return loss

    def configure_optimizers(self):
        params = list(self.parameters())
        if self.bug == "copy":
            params = [copy.deepcopy(p) for p in params]
        params = [p for p in params if p.requires_grad]
        return torch.optim.AdamW(params, lr=0.0 if self.bug == "lr_zero" else self.lr)


def _data(n=64, dtype=torch.float32):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 8, generator=g)
    y = x[:, :1] * 0.5 + 0.1 * torch.randn(n, 1, generator=g)
    return DataLoader(TensorDataset(x.to(dtype), y.to(dtype)), batch_size=8)


@pytest.fixture(autouse=True)
def _root(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


def _fit(model, callbacks, steps=12, data=None, **kwargs):
    trainer = pl.Trainer(max_steps=steps, callbacks=callbacks, default_root_dir=".", **{**FAST, **kwargs})
    trainer.fit(model, data if data is not None else _data())
    return trainer


def _new(callbacks):
    return [(a.rule, a.severity, a.source) for cb in callbacks for a in cb.alerts if a.rule in NEW_RULES]


def _serious(callbacks):
    return [a.format() for cb in callbacks for a in cb.alerts if a.severity != "info"]


def test_optimizer_over_a_copy_is_update_none_naming_the_cause():
    cbs = [GradientFlowMonitor(), AnomalyAlarm()]
    _fit(_Net(bug="copy"), cbs)
    hits = [a for a in cbs[0].alerts if a.rule == "update_none"]
    assert len(hits) == 1 and hits[0].severity == "warning", _serious(cbs)
    assert hits[0].global_step == 5  # measured at steps 1, 3, 5 (the user's cadence, 2): patience 3
    assert "copy of the model" in hits[0].message and "2 layers" in hits[0].message
    assert not [a for a in cbs[0].alerts if a.rule == "grad_frozen"]


def test_a_learning_rate_of_zero_is_update_none():
    cbs = [GradientFlowMonitor()]
    _fit(_Net(bug="lr_zero"), cbs)
    (hit,) = [a for a in cbs[0].alerts if a.rule == "update_none"]
    assert "learning rate of its parameter group is 0" in hit.message


def test_bf16_weights_with_a_tiny_learning_rate_are_update_stale():
    cbs = [GradientFlowMonitor()]
    _fit(_Net(lr=1e-6, dropout=0.0), cbs, precision="bf16-true")
    hits = [a for a in cbs[0].alerts if a.rule in ("update_stale", "update_none")]
    assert [a.rule for a in hits] == ["update_stale"], _serious(cbs)
    assert hits[0].value > 0.5 and "fp32 master weights" in hits[0].message


def test_bf16_weights_with_a_usual_learning_rate_are_healthy():
    cbs = [GradientFlowMonitor(), AnomalyAlarm()]
    _fit(_Net(lr=1e-2, dropout=0.0), cbs, precision="bf16-true")
    assert _new(cbs) == []


@pytest.mark.slow
@pytest.mark.parametrize(("name", "steps", "expected"), [("healthy_bf16", 120, []), ("bf16_tiny_lr", 20, [14])])
def test_a_converging_bf16_run_loses_half_its_updates_and_stays_quiet(tmp_path, name, steps, expected):
    # the fault library's healthy bf16 MLP (AdamW 3e-3) over 120 steps of 16 an epoch: from about step 45 on, more
    # than half of a layer's sampled elements stay unchanged while its loss keeps falling (Adam's steps for the
    # noise-dominated elements round away); at 1e-6 every update rounds away from the start
    model, data, fault = build_fault(name)
    cbs = [GradientFlowMonitor()]
    trainer = pl.Trainer(
        default_root_dir=tmp_path, logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, log_every_n_steps=5, max_steps=steps, limit_train_batches=16,
        limit_val_batches=0, callbacks=cbs, **fault.trainer,
    )  # fmt: skip
    trainer.fit(model, datamodule=data)
    assert [a.global_step for a in cbs[0].alerts if a.rule == "update_stale"] == expected, _serious(cbs)
    if name == "healthy_bf16":  # a share above 50% was judged (against `certain`: the loss falls), and quiet
        assert 0.5 / 0.95 < cbs[0].update_rule.peaks["update_stale"] < 1


def test_manual_optimization_without_zero_grad_is_grad_not_zeroed():
    cbs = [GradientFlowMonitor(), AnomalyAlarm()]
    _fit(_Net(bug="no_zero_grad"), cbs)
    hits = [a for a in cbs[0].alerts if a.rule == "grad_not_zeroed"]
    assert len(hits) == 1 and hits[0].global_step == 3, _serious(cbs)  # fingerprint at step 1, read at step 3
    assert "zero_grad" in hits[0].message


@pytest.mark.parametrize(
    "model, kwargs",
    [
        (lambda: _Net(), {}),
        (lambda: _Net(manual="plain"), {}),
        (lambda: _Net(manual="accumulate"), {}),
        (lambda: _Net(), {"accumulate_grad_batches": 2}),
        (lambda: _Net(), {"gradient_clip_val": 0.01}),
        (lambda: _Net(batchnorm="trained"), {}),
    ],
    ids=["automatic", "manual", "manual_accumulation", "accumulate_grad_batches", "clipping", "batchnorm"],
)
def test_healthy_runs_raise_none_of_the_new_rules(model, kwargs):
    cbs = [GradientFlowMonitor(), AnomalyAlarm()]
    _fit(model(), cbs, steps=10, **kwargs)
    assert _new(cbs) == []
    assert cbs[0].update_rule.streaks == {} or all(v == 0 for v in cbs[0].update_rule.streaks.values())


def test_model_eval_in_on_train_epoch_start_is_eval_mode_in_training():
    cbs = [GradientFlowMonitor(), AnomalyAlarm()]
    _fit(_Net(bug="eval", batchnorm="trained"), cbs)
    hits = [a for a in cbs[1].alerts if a.rule == "eval_mode_in_training"]
    assert [(a.severity, a.global_step) for a in hits] == [("warning", 1)], _serious(cbs)  # first measured: 1
    assert "`drop`" in hits[0].message and "`norm`" in hits[0].message and "on_train_epoch_start" in hits[0].message


def test_a_frozen_batchnorm_in_eval_mode_is_one_info():
    cbs = [GradientFlowMonitor(expect_frozen=["norm.*"]), AnomalyAlarm()]
    _fit(_Net(batchnorm="frozen"), cbs)
    hits = [a for a in cbs[1].alerts if a.rule == "eval_mode_in_training"]
    assert [(a.severity, a.source) for a in hits] == [("info", "norm")]
    assert _serious(cbs) == []


def test_a_frozen_backbone_in_eval_mode_is_healthy():
    class Backbone(_Net):
        def __init__(self):
            super().__init__()
            self.first.requires_grad_(False)
            self.body = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.2))
            self.body.requires_grad_(False)

        def forward(self, x):
            return super().forward(self.body(x))

        def on_train_epoch_start(self):
            self.body.eval()

    cbs = [GradientFlowMonitor(expect_frozen=["first.*", "body.*"]), AnomalyAlarm()]
    _fit(Backbone(), cbs)
    assert _new(cbs) == []


def test_update_and_mode_state_survive_a_resume(tmp_path):
    gfm, alarm = GradientFlowMonitor(), AnomalyAlarm()
    trainer = pl.Trainer(max_steps=4, callbacks=[gfm, alarm], default_root_dir=tmp_path, **FAST)
    trainer.fit(_Net(bug="copy"), _data())
    assert gfm.update_rule.streaks  # 2 of 3 measurements (steps 1, 3): not yet alerted
    trainer.save_checkpoint(tmp_path / "mid.ckpt")
    saved = dict(gfm.update_rule.streaks)
    gfm2, alarm2 = GradientFlowMonitor(), AnomalyAlarm()
    trainer = pl.Trainer(max_steps=6, callbacks=[gfm2, alarm2], default_root_dir=tmp_path, **FAST)
    trainer.fit(_Net(bug="copy"), _data(), ckpt_path=tmp_path / "mid.ckpt")
    hits = [a for a in gfm2.alerts if a.rule == "update_none"]
    # step 5 is the first measurement after the resume: it alerts only because the streak of 2 was restored
    assert [a.global_step for a in hits] == [5]
    assert set(saved) <= set(gfm2.update_rule.latch.active)
    assert "replicas" in alarm2.state_dict() and "train_mode" in alarm2.state_dict()


def test_bad_configuration_names_the_argument():
    with pytest.raises(ValueError, match=r"rules\['update_stale'\]\['threshold'\]"):
        GradientFlowMonitor(rules={"update_stale": {"threshold": 1.5}})
    with pytest.raises(ValueError, match=r"rules\['update_none'\]\['sample_size'\]"):
        GradientFlowMonitor(rules={"update_none": {"sample_size": -1}})
    with pytest.raises(ValueError, match=r"rules\['ddp_desync'\]\['every_n_steps'\]"):
        AnomalyAlarm(rules={"ddp_desync": {"every_n_steps": 0}})
    with pytest.raises(ValueError, match=r"rules\['ddp_desync'\]\['threshold'\]"):
        AnomalyAlarm(rules={"ddp_desync": {"threshold": -1.0}})
    with pytest.raises(TypeError):
        GradientFlowMonitor(0.5)  # keyword-only


def test_thresholds_report_the_new_arguments():
    values = GradientFlowMonitor(
        rules={"update_stale": {"threshold": 0.7}, "update_none": {"sample_size": 8}}
    ).thresholds()
    assert values["update_stale"] == 0.7 and values["update_none.sample_size"] == 8.0
    values = AnomalyAlarm(rules={"ddp_desync": {"every_n_steps": 10, "threshold": 1e-4}}).thresholds()
    assert values["ddp_desync"] == 1e-4 and values["ddp_desync.every_n_steps"] == 10.0


class _LoRA(pl.LightningModule):
    """A frozen base (Linear, Dropout in train mode) with trainable low-rank adapters, B initialised to zero."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.base = nn.Linear(8, 8)
        self.base.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(2, 8) * 0.1)
        self.lora_b = nn.Parameter(torch.zeros(8, 2))
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(8, 1)
        self.head.requires_grad_(False)

    def forward(self, x):
        h = self.base(x) + self.drop(x) @ self.lora_a.T @ self.lora_b.T
        return self.head(torch.relu(h))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW([self.lora_a, self.lora_b], lr=1e-2)


def test_a_lora_style_frozen_base_is_healthy():
    cbs = [GradientFlowMonitor(expect_frozen=["base.*", "head.*"]), AnomalyAlarm()]
    _fit(_LoRA(), cbs, steps=10)
    assert _new(cbs) == []


def test_latched_silent_alerts_are_not_repeated_after_a_resume(tmp_path):
    class Both(_Net):
        def on_train_epoch_start(self):
            self.eval()

    gfm, alarm = GradientFlowMonitor(), AnomalyAlarm()
    trainer = pl.Trainer(max_steps=5, callbacks=[gfm, alarm], default_root_dir=tmp_path, **FAST)
    trainer.fit(Both(bug="no_zero_grad"), _data())
    assert {a.rule for a in gfm.alerts + alarm.alerts} >= {"grad_not_zeroed", "eval_mode_in_training"}
    trainer.save_checkpoint(tmp_path / "mid.ckpt")
    gfm2, alarm2 = GradientFlowMonitor(), AnomalyAlarm()
    trainer = pl.Trainer(max_steps=8, callbacks=[gfm2, alarm2], default_root_dir=tmp_path, **FAST)
    trainer.fit(Both(bug="no_zero_grad"), _data(), ckpt_path=tmp_path / "mid.ckpt")
    assert [a.rule for a in gfm2.alerts + alarm2.alerts if a.rule in NEW_RULES] == []
    assert alarm2.train_mode_rule.latch.active == {"trained"} and gfm2.not_zeroed_rule.latch.active


class _GAN(pl.LightningModule):
    """A tiny GAN (generator 4 -> 8, discriminator 8 -> 1), manual optimization with two optimizers.

    Args:
        style: ``"toggle"`` (Lightning's example: ``toggle_optimizer``, step, ``zero_grad`` after each step),
            ``"zero_first"`` (no toggle: each optimizer's ``zero_grad`` right before its own backward, so the
            discriminator's last gradients are still there, and added to, during the generator's backward), or
            ``"no_zero_grad"`` (no toggle, no ``zero_grad`` at all: the fault).
    """

    def __init__(self, style):
        super().__init__()
        torch.manual_seed(0)
        self.style = style
        self.automatic_optimization = False
        self.gen = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
        self.disc = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        real, _ = batch
        g_opt, d_opt = self.optimizers()
        bce = nn.functional.binary_cross_entropy_with_logits
        z = torch.randn(real.shape[0], 4)
        for opt, part in ((g_opt, "gen"), (d_opt, "disc")):
            if self.style == "toggle":
                self.toggle_optimizer(opt)
            if self.style == "zero_first":
                opt.zero_grad()
            fake = self.gen(z)
            if part == "gen":
                loss = bce(self.disc(fake), torch.ones(real.shape[0], 1))
            else:
                loss = bce(self.disc(real), torch.ones(real.shape[0], 1)) + bce(
                    self.disc(fake.detach()), torch.zeros(real.shape[0], 1)
                )
            self.manual_backward(loss)
            opt.step()
            if self.style == "toggle":
                opt.zero_grad()
                self.untoggle_optimizer(opt)

    def configure_optimizers(self):
        return torch.optim.Adam(self.gen.parameters(), lr=1e-3), torch.optim.Adam(self.disc.parameters(), lr=1e-3)


@pytest.mark.parametrize("style", ["toggle", "zero_first"])
def test_gan_style_two_optimizers_are_healthy(style):
    cbs = [GradientFlowMonitor(), AnomalyAlarm()]
    trainer = _fit(_GAN(style), cbs, steps=16)
    assert trainer.global_step == 16
    assert [a for a in cbs[0].alerts if a.rule == "grad_not_zeroed"] == [], _serious(cbs)
    assert cbs[0].not_zeroed_rule.checks >= 3  # verdicts were read, and were healthy


def test_gan_style_without_zero_grad_is_grad_not_zeroed_naming_both_optimizers():
    cbs = [GradientFlowMonitor()]
    _fit(_GAN("no_zero_grad"), cbs, steps=16)
    hits = [a for a in cbs[0].alerts if a.rule == "grad_not_zeroed"]
    # each optimizer steps once per batch (global steps 2b, 2b+1), both are measured in the batches the user's
    # metrics are logged at (1, 3, ...): watched from batch 1's steps, caught at their steps in batch 2, read
    # after batch 3's measured steps (step 7)
    assert [(a.global_step, a.severity) for a in hits] == [(7, "warning")], _serious(cbs)
    assert "optimizer 0 (Adam)" in hits[0].message and "optimizer 1 (Adam)" in hits[0].message
    assert "`disc.0`" in hits[0].message and "`gen.0`" in hits[0].message


def test_manual_accumulation_over_four_backwards_is_healthy():
    class Accumulate(_Net):
        def training_step(self, batch, batch_idx):
            opt = self.optimizers()
            loss = self._loss(batch)
            self.manual_backward(loss / 4)
            if batch_idx % 4 == 3:
                opt.step()
                opt.zero_grad(set_to_none=False)  # zeros, not None: also zeroed
            return loss

    cbs = [GradientFlowMonitor(log_every_n_steps=1), AnomalyAlarm()]
    trainer = _fit(Accumulate(manual="plain"), cbs, steps=4, data=_data(n=160))
    assert trainer.global_step == 4
    assert _new(cbs) == [] and cbs[0].not_zeroed_rule.checks >= 2


def test_no_zero_grad_from_a_later_step_on_is_caught_within_a_measuring_interval():
    class Onset(_Net):
        def training_step(self, batch, batch_idx):
            opt = self.optimizers()
            loss = self._loss(batch)
            self.manual_backward(loss)
            opt.step()
            if self.global_step <= 4:  # zero_grad stops after the step that made global step 4
                opt.zero_grad()
            return loss

    cbs = [GradientFlowMonitor(log_every_n_steps=2)]
    _fit(Onset(manual="plain"), cbs, steps=14)
    hits = [a for a in cbs[0].alerts if a.rule == "grad_not_zeroed"]
    # the gradients of measured step 5 (the user's cadence: 1, 3, 5, ...) are the first left in `.grad`; step 6
    # applies them again (the onset), its verdict is read with the next measurement, at step 7
    assert [a.global_step for a in hits] == [7], _serious(cbs)
    assert "optimizer 0 (AdamW)" in hits[0].message and "`first`, `last`" in hits[0].message


def test_grad_not_zeroed_verdict_survives_a_resume(tmp_path):
    gfm = GradientFlowMonitor()
    trainer = pl.Trainer(max_steps=3, callbacks=[gfm], default_root_dir=tmp_path, **FAST)
    trainer.fit(_Net(bug="no_zero_grad"), _data())
    # step 1 was measured and watched; step 2 applied its gradients again: a verdict not read before step 3
    assert gfm.state_dict()["zeroed"] == {
        "verdicts": [{"optimizer": 0, "params": ["first.weight", "first.bias", "last.weight", "last.bias"]}],
        "watches": [],  # step 2's verdict closed step 1's watch; the next one opens at step 3
    }
    assert [a for a in gfm.alerts if a.rule == "grad_not_zeroed"] == []
    trainer.save_checkpoint(tmp_path / "mid.ckpt")
    gfm2 = GradientFlowMonitor()
    trainer = pl.Trainer(max_steps=4, callbacks=[gfm2], default_root_dir=tmp_path, **FAST)
    trainer.fit(_Net(bug="no_zero_grad"), _data(), ckpt_path=tmp_path / "mid.ckpt")
    # read at step 3 as without the resume (without the saved verdict: step 3 watched, alert at step 5)
    (hit,) = [a for a in gfm2.alerts if a.rule == "grad_not_zeroed"]
    assert hit.global_step == 3 and "`first`, `last`" in hit.message
    partial = {k: v for k, v in gfm.state_dict().items() if k != "zeroed"}
    with pytest.raises(KeyError, match="zeroed"):
        GradientFlowMonitor().load_state_dict(partial)


def test_an_open_grad_not_zeroed_watch_survives_a_resume(tmp_path):
    # a checkpoint at step 2 falls between step 1's measured step (the watch opens) and step 2's step (its verdict)
    model = _Net(bug="no_zero_grad")
    gfm = GradientFlowMonitor()
    trainer = pl.Trainer(max_steps=2, callbacks=[gfm], default_root_dir=tmp_path, **FAST)
    trainer.fit(model, _data())
    (watch,) = gfm.state_dict()["zeroed"]["watches"]
    assert watch["optimizer"] == 0 and watch["armed_at"] == 1 and watch["params"][0] == "first.weight"
    assert all(watch["stale"]) and not any(watch["added"])  # step 1's gradients are left over, nothing added yet
    trainer.save_checkpoint(tmp_path / "open.ckpt")
    # the resumed run starts with every `.grad` None (Lightning's fit, even on the same model object): what was
    # left over is lost in the reload, so the restored watch closes at step 2 without a verdict (a healthy one
    # would release a latched alert), read at step 3 as one check; the watch opened at step 3 closes at step 4,
    # after this fit's last step
    gfm3 = GradientFlowMonitor()
    trainer = pl.Trainer(max_steps=4, callbacks=[gfm3], default_root_dir=tmp_path, **FAST)
    trainer.fit(model, _data(), ckpt_path=tmp_path / "open.ckpt")
    assert gfm3.not_zeroed_rule.checks == 1 and gfm3.alerts == [] and not gfm3.not_zeroed_rule.latch.active


def test_a_latched_grad_not_zeroed_is_not_released_by_the_reload(tmp_path):
    # measured at steps 1, 3, 5, 7 (every 2); the run never zeroes: alerted once, at step 3
    straight = GradientFlowMonitor()
    _fit(_Net(bug="no_zero_grad"), [straight], steps=8)
    assert [a.global_step for a in straight.alerts if a.rule == "grad_not_zeroed"] == [3]
    # a checkpoint at step 4: latched, with step 3's watch open; the resumed run starts with every `.grad` None
    gfm = GradientFlowMonitor()
    trainer = pl.Trainer(max_steps=4, callbacks=[gfm], default_root_dir=tmp_path, **FAST)
    trainer.fit(_Net(bug="no_zero_grad"), _data())
    assert gfm.state_dict()["zeroed"]["watches"] and gfm.not_zeroed_rule.latch.active
    trainer.save_checkpoint(tmp_path / "latched.ckpt")
    gfm2 = GradientFlowMonitor()
    trainer = pl.Trainer(max_steps=8, callbacks=[gfm2], default_root_dir=tmp_path, **FAST)
    trainer.fit(_Net(bug="no_zero_grad"), _data(), ckpt_path=tmp_path / "latched.ckpt")
    # step 3's watch closes at step 4 without a verdict (read at 5); the watch opened at step 5 finds the
    # gradients not zeroed (read at 7): the same event, still latched, and as many checks as the straight run
    assert [a.global_step for a in gfm2.alerts if a.rule == "grad_not_zeroed"] == []
    assert gfm2.not_zeroed_rule.latch.active and gfm2.not_zeroed_rule.checks == straight.not_zeroed_rule.checks


def test_zero_grad_watch_criterion_on_tensors():
    from lightning_diag.callbacks.gradient_flow.silent_updates import ZeroGradWatch

    def run(steps):
        w = nn.Parameter(torch.ones(16))
        w.grad = torch.ones(16)
        watch = ZeroGradWatch()
        watch.arm(0, [0], [w])
        for action in steps:
            if action == "backward":
                watch.before_backward([w])
                w.grad = w.grad + 1 if w.grad is not None else torch.ones(16)
                watch.after_backward([w])
            elif action == "untouched":  # a backward that does not reach w (toggle_optimizer, outside the graph)
                watch.before_backward([w])
                watch.after_backward([w])
            elif action == "zero":
                w.grad = None
            elif action == "zeros":
                w.grad = torch.zeros(16)
        watch.before_step(0)
        return [flags.tolist() for _, _, flags in watch.verdicts]

    assert run(["backward"]) == [[True]]  # no zero_grad
    assert run(["untouched", "zero", "backward"]) == [[False]]  # GAN with toggle_optimizer
    assert run(["backward", "zero", "backward"]) == [[False]]  # GAN, zero_grad right before its own backward
    assert run(["zeros", "backward", "backward"]) == [[False]]  # accumulation after zero_grad(set_to_none=False)
    assert run(["untouched"]) == [[False]]  # left over but never added to: not applied twice
    watch = ZeroGradWatch()
    watch.arm(1, [0], [nn.Parameter(torch.ones(2))], step=3)
    watch.expire(before=3)
    assert set(watch.watches) == {1}
    watch.expire(before=4)
    assert watch.watches == {} and watch.verdicts == []


def test_zero_grad_watch_reads_nothing_once_every_gradient_was_none():
    """``zero_grad(set_to_none=True)`` before a backward (Lightning's loop): the watch's flags are set without reading
    the gradients, and no later backward of the watch is read; the flags and the verdict are those of reading them."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from lightning_diag.callbacks.gradient_flow.silent_updates import ZeroGradWatch
    from lightning_diag.stats.updates import segment_any

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(str(func))
            return func(*args, **(kwargs or {}))

    params = [nn.Parameter(torch.ones(16)), nn.Parameter(torch.ones(3))]
    for p in params:
        p.grad = torch.ones_like(p)
    watch = ZeroGradWatch()
    watch.arm(0, [0, 1], params)
    w = watch.watches[0]
    # what reading them computes: no sampled element of a None gradient is non-zero
    expected = w.stale & segment_any(w.sample.gather([None, None]) != 0, w.sample.segment, w.sample.count)
    for p in params:
        p.grad = None
    with Ops() as ops:
        watch.before_backward(params)
    assert ops.names == ["aten.zero_.default"]
    assert torch.equal(w.stale, expected) and w.stale.tolist() == [False, False]
    for p in params:
        p.grad = torch.full_like(p, 2.0)
    with Ops() as ops:
        watch.after_backward(params)
        watch.before_backward(params)  # an accumulated micro-batch: its gradients are not read either
        watch.after_backward(params)
    assert ops.names == []
    watch.before_step(0)
    assert [flags.tolist() for _, _, flags in watch.verdicts] == [[False, False]]
    # one gradient still set: read as before (a GAN's other optimizer left its gradients)
    params[0].grad = None
    watch.arm(0, [0, 1], params)
    watch.before_backward(params)
    params[1].grad = params[1].grad + 1
    watch.after_backward(params)
    watch.before_step(0)
    assert watch.verdicts[-1][2].tolist() == [False, True]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["no_zero_grad", "healthy"])
def test_grad_not_zeroed_under_ddp_every_rank_decides_together(tmp_path, mode):
    import json
    import sys
    from pathlib import Path

    script = Path(__file__).with_name("ddp_zeroed_script.py")
    proc = launch.run([sys.executable, str(script), str(tmp_path), mode], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"{mode}{r}.json").read_text()) for r in (0, 1)]
    # measured on the user's cadence (every 2: steps 1, 3, 5): watched at step 1, read at step 3 as on one process
    expected = [3] if mode == "no_zero_grad" else []
    for rank in ranks:
        assert [a["global_step"] for a in rank["alerts"]] == expected and rank["checks"] >= 2
    records = [json.loads(x) for x in (tmp_path / "diag" / "alerts.jsonl").read_text().splitlines()] if (
        tmp_path / "diag" / "alerts.jsonl").exists() else []
    assert [r["global_step"] for r in records if r["rule"] == "grad_not_zeroed"] == expected  # rank zero, once
