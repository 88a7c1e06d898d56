"""Issue 43: a measuring step reads the gradients once. ``GradientFlowMonitor``'s squared gradient norms stand for
the non-finite guard's pass at that step (through the trainer's step cache), and the guard stays exact: a NaN
gradient on a measuring step is still caught before the update, and huge finite gradients whose squared norms
overflow are still applied."""

from __future__ import annotations

import pytest
import pytorch_lightning as pl
import torch

from lightning_diag import AnomalyAlarm, GradientFlowMonitor
from lightning_diag.callbacks.anomaly_alarm import guard_pass
from lightning_diag.callbacks.common.driver import StepCache, gradient_squares_key
from lightning_diag.instrument.grad_measure import GradientSquares
from tests.callbacks.nonfinite_models import Regression
from tests.callbacks.test_guard_probe import HugeGradients
from tests.output.logger_models import FAST


class _Step(pl.Callback):
    """The global step of the current batch."""

    step = -1

    def on_train_batch_start(self, trainer: pl.Trainer, *args: object) -> None:
        self.step = trainer.global_step


def _count_passes(monkeypatch: pytest.MonkeyPatch, clock: _Step) -> dict[str, list[int]]:
    """At which steps the guard's pass read the gradients itself, and at which it used the measured squares."""
    seen: dict[str, list[int]] = {"own": [], "measured": []}
    clean, measured = guard_pass.OptimizerPass.clean, guard_pass.OptimizerPass.clean_measured

    def own(self, losses):
        seen["own"].append(clock.step)
        return clean(self, losses)

    def shared(self, losses, known):
        out = measured(self, losses, known)
        if out is not None:
            seen["measured"].append(clock.step)
        return out

    monkeypatch.setattr(guard_pass.OptimizerPass, "clean", own)
    monkeypatch.setattr(guard_pass.OptimizerPass, "clean_measured", shared)
    return seen


def test_a_measuring_step_reads_the_gradients_once(tmp_path, monkeypatch):
    clock = _Step()
    seen = _count_passes(monkeypatch, clock)
    flow, alarm = GradientFlowMonitor(), AnomalyAlarm()
    callbacks = [clock, flow, alarm]
    trainer = pl.Trainer(default_root_dir=tmp_path, max_steps=20, log_every_n_steps=5, callbacks=callbacks, **FAST)
    trainer.fit(Regression())
    # the guard's quick path starts at the second step (the first takes the full check); the measuring steps
    # (every 5th) use the squares GradientFlowMonitor measured, the others make their own pass
    assert seen["measured"] == [4, 9, 14, 19]
    assert seen["own"] == [s for s in range(1, 20) if s not in (4, 9, 14, 19)]
    assert [a.rule for a in alarm.alerts if a.severity.value in ("warning", "critical")] == []


def test_without_gradient_flow_every_step_makes_its_own_pass(tmp_path, monkeypatch):
    clock = _Step()
    seen = _count_passes(monkeypatch, clock)
    alarm = AnomalyAlarm()
    trainer = pl.Trainer(default_root_dir=tmp_path, max_steps=12, log_every_n_steps=5, callbacks=[clock, alarm], **FAST)
    trainer.fit(Regression())
    assert seen["measured"] == [] and seen["own"] == list(range(1, 12))


@pytest.mark.parametrize("order", ["flow first", "alarm first"])
def test_a_nan_gradient_on_a_measuring_step_is_stopped_before_the_update(tmp_path, order):
    flow, alarm = GradientFlowMonitor(), AnomalyAlarm()
    model = Regression(fault="backward", fault_steps=(9,))
    callbacks = [flow, alarm] if order == "flow first" else [alarm, flow]
    trainer = pl.Trainer(default_root_dir=tmp_path, max_steps=30, log_every_n_steps=5, callbacks=callbacks, **FAST)
    trainer.fit(model)
    assert [(a.rule, a.global_step) for a in alarm.alerts if a.severity.value == "critical"] == [("nonfinite_grad", 9)]
    assert trainer.should_stop and trainer.global_step == 10  # stopped after step 9, whose update was not applied
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_huge_finite_gradients_on_measuring_steps_are_applied(tmp_path):
    # every step is a measuring step; the squared norms (about 1e76) overflow float32: the exact check clears them
    alarm = AnomalyAlarm()
    model = HugeGradients()
    trainer = pl.Trainer(
        default_root_dir=tmp_path,
        max_steps=5,
        log_every_n_steps=1,
        logger=False,
        callbacks=[GradientFlowMonitor(), alarm],
        **FAST,
    )
    trainer.fit(model)
    assert trainer.global_step == 5 and not trainer.should_stop
    assert [a.rule for a in alarm.alerts if a.rule.startswith("nonfinite")] == []
    assert torch.isfinite(model.w).all() and bool((model.w != 0).all())


def test_measured_squares_of_changed_or_other_gradients_are_not_used():
    grads = [torch.ones(3), torch.ones(2)]
    known = GradientSquares.of(grads, torch.tensor([3.0, 2.0]))
    assert known.covers(list(reversed(grads)))
    assert not known.covers([grads[0], torch.ones(2)])  # another tensor
    grads[1].mul_(float("nan"))  # changed in place after it was measured
    assert not known.covers(grads)


def test_the_step_cache_keeps_one_step():
    cache = StepCache()
    opt = object()
    cache.put(3, gradient_squares_key(opt), "a")
    assert cache.get(3, gradient_squares_key(opt)) == "a"
    assert cache.get(3, gradient_squares_key(object())) is None
    cache.put(4, "other", "b")
    assert cache.get(3, gradient_squares_key(opt)) is None and cache.get(4, "other") == "b"
