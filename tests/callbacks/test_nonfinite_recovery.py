"""Non-finite localisation (``source``) and ``on_nonfinite="rollback"`` through real ``Trainer.fit`` runs."""

from __future__ import annotations

import math
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint

from lightning_diag import AnomalyAlarm
from tests import launch
from tests.callbacks.nonfinite_models import Regression
from tests.callbacks.tiny import FAST, TinyAttention


def _fit(model: pl.LightningModule, alarm: AnomalyAlarm, tmp_path: Any, **kwargs: Any) -> pl.Trainer:
    callbacks = [alarm, *kwargs.pop("callbacks", [])]
    ckpt_path = kwargs.pop("ckpt_path", None)
    trainer = pl.Trainer(default_root_dir=tmp_path, logger=False, callbacks=callbacks, **{**FAST, **kwargs})
    trainer.fit(model, ckpt_path=ckpt_path)
    return trainer


def _finite(model: torch.nn.Module) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in model.parameters())


# -- localisation -------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("fault", "source", "words"),
    [
        ("input", "input", ["batch[0]", "1 NaN"]),
        ("forward", "net.1", ["Faulty", "forward", "NaN from finite"]),
        ("backward", "net.1", ["Faulty", "in backward"]),
        ("loss", "loss", ["every module output is finite"]),
    ],
)
def test_localisation_names_the_source(tmp_path, fault, source, words):
    model = Regression(fault=fault, fault_steps=(3,))
    alarm = AnomalyAlarm(log_every_n_steps=1)
    _fit(model, alarm, tmp_path, max_steps=10)
    (alert,) = [a for a in alarm.alerts if a.rule.startswith("nonfinite")]
    assert alert.global_step == 3 and alert.source == source, alert.message
    for word in words:
        assert word in alert.message, alert.message
    assert _finite(model)


def test_localisation_off_keeps_the_old_sources(tmp_path):
    model = Regression(fault="forward", fault_steps=(3,))
    alarm = AnomalyAlarm(locate_nonfinite=False)
    _fit(model, alarm, tmp_path, max_steps=10)
    assert [a.source for a in alarm.alerts] == ["loss"]


@pytest.mark.parametrize("precision", ["bf16-mixed", "32-true"])
def test_localisation_with_accumulation_and_autocast(tmp_path, precision):
    model = Regression(fault="forward", fault_steps=(2,))
    alarm = AnomalyAlarm()
    _fit(model, alarm, tmp_path, max_steps=6, accumulate_grad_batches=2, precision=precision)
    (alert,) = alarm.alerts
    assert alert.source == "net.1", alert.message
    if precision == "bf16-mixed":
        assert "bfloat16" in alert.message


def _skip_run(tmp_path: Any, locate: bool) -> dict[str, torch.Tensor]:
    pl.seed_everything(7)
    model = Regression(fault="forward", fault_steps=(4, 9), noisy=True)
    alarm = AnomalyAlarm(on_nonfinite="skip", locate_nonfinite=locate)
    _fit(model, alarm, tmp_path, max_steps=14)
    assert len(alarm.alerts) == 2 and (alarm.alerts[0].source == "net.3") == locate
    return {**model.state_dict(), "rng": torch.rand(4)}


def test_replay_changes_nothing_a_skip_run_is_identical(tmp_path):
    with_replay = _skip_run(tmp_path / "a", True)
    without = _skip_run(tmp_path / "b", False)
    assert with_replay.keys() == without.keys()
    for key, value in with_replay.items():  # BatchNorm statistics, dropout masks, weights, RNG: bit for bit
        assert torch.equal(value, without[key]), key


# -- rollback -----------------------------------------------------------------------------------------------
class RecordRestore(pl.Callback):
    """After the alarm restored a snapshot: the parameters at that moment, and the snapshot."""

    def __init__(self, alarm: AnomalyAlarm) -> None:
        self.alarm, self.seen = alarm, 0
        self.restores: list[tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]] = []

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if self.alarm.rollbacks > self.seen:
            self.seen = self.alarm.rollbacks
            step = self.alarm.alerts[-1].message.split("snapshot of step ")[1].split()[0]
            snapshot = self.alarm.recovery.store.get(int(step)).model
            now = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}
            self.restores.append((now, {k: v.clone() for k, v in snapshot.items()}))


def test_burst_of_huge_batches_skip_cannot_recover_rollback_does(tmp_path):
    clean = Regression()
    _fit(clean, AnomalyAlarm(), tmp_path / "clean", max_epochs=3)
    burst = (40, 41, 42)

    skipped = Regression(burst=burst)
    skip_alarm = AnomalyAlarm(on_nonfinite="skip")
    trainer = _fit(skipped, skip_alarm, tmp_path / "skip", max_epochs=3)
    assert trainer.global_step < 3 * 32  # stopped at the skip limit: the weights stayed ruined
    assert any(a.source == "skip_limit" for a in skip_alarm.alerts)

    model = Regression(burst=burst)
    alarm = AnomalyAlarm(on_nonfinite="rollback", rules={"nonfinite_rollback": {"every_n_steps": 1, "snapshots": 4}})
    record = RecordRestore(alarm)
    trainer = _fit(model, alarm, tmp_path / "rollback", max_epochs=3, callbacks=[record])
    assert trainer.current_epoch == 3 and trainer.global_step == 3 * 32  # every epoch finished
    assert _finite(model)
    rollbacks = [a for a in alarm.alerts if a.rule == "nonfinite_rollback"]
    assert 1 <= len(rollbacks) <= 3 and all(a.severity == "warning" for a in rollbacks)
    assert not [a for a in alarm.alerts if a.severity == "critical"]
    first = rollbacks[0]
    assert "snapshot of step 40" in first.message and "x0.5" in first.message  # 41 was spiking: not trusted
    assert model.clean_loss() < max(10 * clean.clean_loss(), 1e-3)
    assert record.restores
    for now, snapshot in record.restores:  # bit for bit
        assert all(torch.equal(now[k], snapshot[k]) for k in snapshot)


def test_lr_spike_recovers_with_the_lowered_learning_rate(tmp_path):
    model = Regression(spike=(20, 12.0))
    alarm = AnomalyAlarm(on_nonfinite="rollback", rules={"nonfinite_rollback": {"every_n_steps": 5}})
    seen_lr: list[float] = []

    class LearningRates(pl.Callback):
        def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            seen_lr.append(optimizer.param_groups[0]["lr"])

    trainer = _fit(model, alarm, tmp_path, max_epochs=4, callbacks=[LearningRates()])
    assert trainer.global_step == 4 * 32 and _finite(model)
    assert alarm.rollbacks >= 1 and alarm.lr_scale == 0.5**alarm.rollbacks
    assert model.losses[-1] < 1e-3
    # the step uses the scheduler's rate times the factor; the scheduler's own value is left as it is
    assert seen_lr[-1] == pytest.approx(0.02 * 12.0 * alarm.lr_scale)
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.02 * 12.0)


def test_rollback_limit_stops_with_a_critical_alert(tmp_path):
    model = Regression(fault="loss", fault_steps=tuple(range(6, 40)))
    alarm = AnomalyAlarm(
        on_nonfinite="rollback", rules={"nonfinite_rollback": {"every_n_steps": 2, "max_rollbacks": 2}}
    )
    trainer = _fit(model, alarm, tmp_path, max_steps=40)
    assert [a.rule for a in alarm.alerts] == ["nonfinite_rollback", "nonfinite_rollback", "nonfinite_loss"]
    assert alarm.alerts[-1].severity == "critical" and alarm.alerts[-1].source == "rollback_limit"
    assert trainer.global_step < 40 and _finite(model)


def test_a_three_step_burst_survives_with_the_default_snapshots(tmp_path):
    # defaults: one snapshot every 50 steps, the first at step 0; a non-finite step right after a rollback used
    # to drop that only snapshot and stop the fit ("no older snapshot is left")
    model = Regression(fault="loss", fault_steps=(30, 31, 32))
    alarm = AnomalyAlarm(on_nonfinite="rollback")
    trainer = _fit(model, alarm, tmp_path, max_steps=60)
    rollbacks = [a for a in alarm.alerts if a.rule == "nonfinite_rollback"]
    assert [a.global_step for a in rollbacks] == [30, 31, 32]
    assert all("snapshot of step 0" in a.message for a in rollbacks)
    assert "the same one again" in rollbacks[1].message and "the same one again" in rollbacks[2].message
    assert not [a for a in alarm.alerts if a.severity == "critical"]
    assert trainer.global_step == 60 and _finite(model) and alarm.lr_scale == 0.5**3


def test_resume_keeps_the_rollback_count_and_factor(tmp_path):
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=50, save_top_k=-1)
    model = Regression(burst=(20, 21))
    alarm = AnomalyAlarm(on_nonfinite="rollback", rules={"nonfinite_rollback": {"every_n_steps": 1}})
    _fit(model, alarm, tmp_path, max_steps=50, callbacks=[ckpt], enable_checkpointing=True)
    assert alarm.rollbacks >= 1
    count, scale = alarm.rollbacks, alarm.lr_scale
    resumed = AnomalyAlarm(on_nonfinite="rollback", rules={"nonfinite_rollback": {"every_n_steps": 1}})
    (path,) = (tmp_path / "ckpt").glob("*step=50.ckpt")
    _fit(Regression(), resumed, tmp_path, max_steps=60, ckpt_path=str(path))
    assert (resumed.rollbacks, resumed.lr_scale) == (count, scale)


@pytest.mark.parametrize(
    ("kwargs", "error", "name"),
    [
        ({"lr_factor": 0.0}, ValueError, "lr_factor"),
        ({"lr_factor": 1.0}, ValueError, "lr_factor"),
        ({"lr_factor": "half"}, TypeError, "lr_factor"),
        ({"every_n_steps": 0}, ValueError, "every_n_steps"),
        ({"max_rollbacks": -1}, ValueError, "max_rollbacks"),
        ({"snapshots": 0}, ValueError, "snapshots"),
    ],
)
def test_invalid_rollback_configuration(kwargs, error, name):
    with pytest.raises(error, match=f"'nonfinite_rollback'\\]\\['{name}'\\]"):
        AnomalyAlarm(on_nonfinite="rollback", rules={"nonfinite_rollback": kwargs})
    with pytest.raises(ValueError, match=r"`rollback_device`.*'cpu', 'device'"):
        AnomalyAlarm(on_nonfinite="rollback", rollback_device="gpu")
    with pytest.raises(TypeError, match="`locate_nonfinite`"):
        AnomalyAlarm(on_nonfinite="rollback", locate_nonfinite="yes")


def test_the_recovery_asks_the_rollback_detector_of_the_alarms_preset():
    # the alarm reads the rollback settings (defaults included) from the rule's declaration and hands the recovery
    # its preset's detector; benchmarks/rollback_overhead.py times the alarm's recovery alone
    from lightning_diag.callbacks.anomaly_alarm.nonfinite_recovery import NonFiniteRecovery, RollbackSettings
    from lightning_diag.rules.rollback import DEFAULT_MAX_ROLLBACKS, DEFAULT_ROLLBACK_SNAPSHOTS

    rules = {"nonfinite_rollback": {"every_n_steps": 7, "lr_factor": 0.25, "max_rollbacks": 2}}
    alarm = AnomalyAlarm(on_nonfinite="rollback", rules=rules)
    assert alarm.rollback == RollbackSettings(every_n_steps=7, lr_factor=0.25, max_rollbacks=2, snapshots=3)
    assert AnomalyAlarm(on_nonfinite="rollback").rollback.max_rollbacks == DEFAULT_MAX_ROLLBACKS
    assert AnomalyAlarm(on_nonfinite="rollback").rollback.snapshots == DEFAULT_ROLLBACK_SNAPSHOTS
    with pytest.raises(TypeError, match="snapshots"):  # no default of its own: the declaration's only
        RollbackSettings(every_n_steps=7, lr_factor=0.25, max_rollbacks=2)  # type: ignore[call-arg]
    recovery = alarm.recovery
    assert recovery.rule is alarm.rollback_rule and recovery.lr_scale == 1.0 and recovery.rule.rollbacks == 0
    assert (alarm.rollback_rule.lr_factor, alarm.rollback_rule.max_rollbacks, alarm.rollback_rule.repeat_window) == (
        0.25, 2, 7
    )
    # the detector handed in is the one asked, again after a reset (a new fit's)
    alarm.rollback_rule.record(3, now=5)
    assert recovery.lr_scale == 0.25
    other = AnomalyAlarm(on_nonfinite="rollback", rules=rules)
    recovery = NonFiniteRecovery(locate=True, rollback=True, settings=alarm.rollback, rule=other.rollback_rule)
    assert recovery.lr_scale == 1.0
    recovery.reset(alarm.rollback_rule)
    assert recovery.rule is alarm.rollback_rule and recovery.lr_scale == 0.25


def test_rollback_needs_automatic_optimization(tmp_path):
    with pytest.raises(ValueError, match="on_nonfinite"):
        _fit(TinyAttention(returns="vector"), AnomalyAlarm(on_nonfinite="rollback"), tmp_path, max_steps=2)


def test_healthy_run_with_rollback_armed_is_quiet_and_unchanged(tmp_path):
    plain, armed = Regression(), Regression()
    _fit(plain, AnomalyAlarm(), tmp_path / "a", max_steps=30)
    alarm = AnomalyAlarm(on_nonfinite="rollback", rules={"nonfinite_rollback": {"every_n_steps": 5}})
    _fit(armed, alarm, tmp_path / "b", max_steps=30)
    assert not alarm.alerts and alarm.rollbacks == 0
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), armed.parameters(), strict=True))
    assert alarm.recovery.store.steps() == [20, 25, 30]
    assert math.isfinite(armed.losses[-1])


@pytest.mark.slow
def test_ddp_ranks_localise_and_roll_back_together(tmp_path):
    import json
    import sys
    from pathlib import Path

    script = Path(__file__).with_name("ddp_rollback_script.py")
    proc = launch.run([sys.executable, str(script), str(tmp_path)], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for rank in ranks:
        assert rank["step"] == 12 and rank["finite"] and rank["rollbacks"] == 1 and rank["lr_scale"] == 0.5
        # rank 0's own values were finite: it learns where from rank 1's replay
        assert [(a["rule"], a["source"], a["global_step"]) for a in rank["alerts"]] == [
            ("nonfinite_rollback", "net.1", 7)
        ]
        assert "snapshot of step 6" in rank["alerts"][0]["message"]
    assert ranks[0]["params"] == ranks[1]["params"]  # restored the same snapshot and went on in step
    records = [json.loads(x) for x in (tmp_path / "diag" / "alerts.jsonl").read_text().splitlines()]
    assert [r["rule"] for r in records] == ["nonfinite_rollback"]  # only global rank zero writes


def test_report_shows_the_localisation_and_the_rollbacks(tmp_path, capsys):
    from lightning_diag.cli import main

    alarm = AnomalyAlarm(on_nonfinite="rollback", rules={"nonfinite_rollback": {"every_n_steps": 2}})
    _fit(Regression(fault="forward", fault_steps=(5,)), alarm, tmp_path, max_steps=12)
    assert main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    check = next(x for x in out.splitlines() if "No NaN/Inf" in x)
    assert "nonfinite_rollback at step 5 (net.1)" in check and "1 rollback(s)" in check and "training went on" in check
    assert "| 5 | 0 | warning | nonfinite_rollback | net.1 |" in out  # the timeline


def test_the_alarm_pickles_for_ddp_spawn(tmp_path):
    import pickle

    alarm = AnomalyAlarm(on_nonfinite="rollback", rules={"nonfinite_rollback": {"every_n_steps": 2}})
    _fit(Regression(), alarm, tmp_path, max_steps=4)  # after a fit too (snapshots, hooks removed)
    for candidate in (AnomalyAlarm(on_nonfinite="rollback"), alarm):
        assert pickle.loads(pickle.dumps(candidate)).on_nonfinite == "rollback"


def test_a_fit_that_raises_leaves_no_hooks_on_the_optimizer(tmp_path):
    optimizers: list[torch.optim.Optimizer] = []

    class Crash(pl.Callback):
        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if trainer.global_step == 3:
                optimizers.extend(trainer.optimizers)
                raise RuntimeError("boom")

    alarm = AnomalyAlarm(on_nonfinite="rollback", rules={"nonfinite_rollback": {"every_n_steps": 2}})
    with pytest.raises(RuntimeError, match="boom"):
        _fit(Regression(), alarm, tmp_path, max_steps=10, callbacks=[Crash()])
    assert len(optimizers) == 1
    # while the fit ran, the rollback's learning-rate hooks were on the optimizer; none survives the exception
    assert not optimizers[0]._optimizer_step_pre_hooks and not optimizers[0]._optimizer_step_post_hooks


def test_the_hooks_are_on_the_optimizer_while_the_fit_runs(tmp_path):
    seen: list[int] = []

    class Count(pl.Callback):
        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            opt = trainer.optimizers[0]
            seen.append(len(opt._optimizer_step_pre_hooks) + len(opt._optimizer_step_post_hooks))

    trainer = _fit(Regression(), AnomalyAlarm(on_nonfinite="rollback"), tmp_path, max_steps=3, callbacks=[Count()])
    assert seen == [2, 2, 2]  # so the test above checks hooks that were there
    assert not trainer.optimizers[0]._optimizer_step_pre_hooks


# -- the RNG copy for the replay: only for steps that draw random numbers -------------------------------------
class _KeptCopies(pl.Callback):
    """Before each backward: the global step, and whether each kept micro-batch holds an RNG copy."""

    def __init__(self, alarm: AnomalyAlarm) -> None:
        self.alarm, self.seen = alarm, []

    def on_before_backward(self, trainer, pl_module, loss):
        self.seen.append((trainer.global_step, [rng is not None for *_, rng in self.alarm.recovery._batches]))


class _DropoutFrom(pl.Callback):
    """Switches the model's dropout on (p 0 -> 0.5) from global step ``step``: a model that starts drawing."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        for module in pl_module.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0 if trainer.global_step < self.step else 0.5


def test_the_rng_is_copied_only_on_watched_steps_while_the_model_draws_nothing(tmp_path):
    alarm = AnomalyAlarm(log_every_n_steps=5)
    kept = _KeptCopies(alarm)
    _fit(Regression(), alarm, tmp_path, max_steps=12, callbacks=[kept])
    assert not alarm.recovery.draws
    # the fit's first batch and the user's logging steps are watched (a copy to compare with at the batch end); none
    # else
    assert [step for step, copies in kept.seen if any(copies)] == [0, 4, 9]
    assert all(len(copies) == 1 for _, copies in kept.seen)  # the batch itself is always kept for a replay


def test_a_model_that_draws_keeps_a_copy_every_step_from_the_watched_step_that_saw_it(tmp_path):
    alarm = AnomalyAlarm(log_every_n_steps=5)
    kept = _KeptCopies(alarm)
    _fit(Regression(noisy=True), alarm, tmp_path, max_steps=12, callbacks=[_DropoutFrom(7), kept])
    assert alarm.recovery.draws
    # p = 0 draws nothing until step 7; the draws are seen at the next watched step (9), copies from step 10 on
    assert [step for step, copies in kept.seen if any(copies)] == [0, 4, 9, 10, 11]


def test_a_replay_of_a_drawing_model_starts_from_the_steps_rng(tmp_path):
    alarm = AnomalyAlarm(log_every_n_steps=50)
    kept = _KeptCopies(alarm)
    _fit(Regression(noisy=True), alarm, tmp_path, max_steps=6, callbacks=[kept])
    assert alarm.recovery.draws  # seen on the fit's first batch
    assert [step for step, copies in kept.seen if all(copies)] == list(range(6))
