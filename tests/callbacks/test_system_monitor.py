"""SystemMonitor scenario tests: real ``Trainer.fit`` runs with a slow dataset, a periodic stall, a leak, and a
healthy run with every callback. The timing tests run on a fake clock (``SystemMonitor.time_source``) that only
the test moves, so what they assert is exact; the callbacks' real cost is measured in benchmarks/cost_table.py."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import pytorch_lightning as pl
import torch

from lightning_diag import AnomalyAlarm, AttentionEntropyMonitor, GradientFlowMonitor, SystemMonitor
from lightning_diag.callbacks.base import DiagCallback
from lightning_diag.instrument.attention_record import AttentionRecorder
from tests.callbacks.system_models import FAST, MLP, Encoder, FakeTime, Recorder, StallEvery, Tick


@pytest.fixture(autouse=True)
def _quiet():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)
    yield
    torch.set_num_threads(before)


def on_fake_time(monitor: SystemMonitor) -> FakeTime:
    """Give ``monitor`` a clock that moves only when the test moves it."""
    clock = FakeTime()
    monitor.time_source = clock
    return clock


def spy(monkeypatch: pytest.MonkeyPatch) -> Recorder:
    """Capture every scalar SystemMonitor writes."""
    recorder = Recorder()
    monkeypatch.setattr(SystemMonitor, "writer", property(lambda self: recorder))
    return recorder


def rules(callback: Any) -> list[str]:
    return [a.rule for a in callback.alerts if a.severity != "info"]


def fit(model: pl.LightningModule, callbacks: list[Any], steps: int, **kwargs: Any) -> pl.Trainer:
    trainer = pl.Trainer(max_steps=steps, callbacks=callbacks, **{**FAST, **kwargs})
    trainer.fit(model)
    return trainer


def test_dataloader_bound_fires_on_a_sleepy_dataset(monkeypatch, tmp_path):
    rec = spy(monkeypatch)
    monitor = SystemMonitor(log_every_n_steps=4)
    clock = on_fake_time(monitor)
    fit(MLP(sleep_s=0.01, batch=4, clock=clock), [monitor, Tick(clock, 0.01)], 16, default_root_dir=tmp_path)
    assert rules(monitor) == ["dataloader_bound"]
    alert = monitor.alerts[0]
    assert alert.global_step == 12  # the third consecutive interval
    assert alert.value > 0.5 and "num_workers" in alert.message
    # 40 ms of (fake) waiting per step against 10 ms of compute; the run's first step has no wait
    shares = [v for _, v in rec.values["diag/system/data_wait_share"]]
    assert shares[1:] == pytest.approx([0.8] * (len(shares) - 1))
    waits = [v for _, v in rec.values["diag/system/data_wait_s"]]
    assert waits[0] == pytest.approx(0.03) and waits[1:] == pytest.approx([0.04] * (len(waits) - 1))
    assert rec.values["diag/system/samples_per_s"][-1][1] > 0


def test_periodic_stall_every_10th_step_is_named(monkeypatch, tmp_path):
    rec = spy(monkeypatch)
    monitor = SystemMonitor(log_every_n_steps=10, warmup_steps=5)
    clock = on_fake_time(monitor)
    fit(Encoder(), [monitor, Tick(clock, 0.02), StallEvery(10, 0.25, clock)], 85, default_root_dir=tmp_path)
    periodic = [a for a in monitor.alerts if a.rule == "step_time_periodic"]
    assert len(periodic) == 1, [a.format() for a in monitor.alerts]
    assert periodic[0].value == 10.0 and "every 10 steps" in periodic[0].message
    # the stall is the step's (a callback hook), not data waiting
    assert "dataloader_bound" not in rules(monitor)
    assert rec.values["diag/system/step_time_period"][-1][1] == 10.0


def test_a_loss_kept_with_its_graph_is_a_memory_leak(monkeypatch, tmp_path):
    spy(monkeypatch)
    from lightning_diag.instrument.memory import host_rss_bytes

    # The leak is sized against the process's RSS (larger late in a long pytest session), so it grows ~30% over
    # the default 8-interval window whatever the base: each step keeps ~1.2% of the RSS (two saved activations
    # of 256 floats per sample; measured 15% growth at half this size).
    batch = int(min(max(host_rss_bytes() * 0.024 / (4 * 256 * 4), 512), 16384))
    monitor = SystemMonitor(log_every_n_steps=3)
    model = MLP(features=64, hidden=256, batch=batch, leak=True, samples=16384)
    fit(model, [monitor], 30, default_root_dir=tmp_path)
    leak = [a for a in monitor.alerts if a.rule == "memory_growth"]
    assert leak and leak[0].source == "host_rss", ([a.format() for a in monitor.alerts], monitor.memory_rule.history)
    assert leak[0].value > 0.1 and "loss.item()" in leak[0].message
    model.kept.clear()


class Costly(DiagCallback):
    """A diagnostics callback whose every training-batch end costs 0.2 ms of (fake) time."""

    def __init__(self, clock: FakeTime) -> None:
        super().__init__()
        self.clock = clock

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.clock.advance(0.0002)


def test_healthy_run_with_every_callback_is_quiet_and_its_overhead_is_accounted(monkeypatch, tmp_path):
    rec = spy(monkeypatch)
    monitor = SystemMonitor()
    clock = on_fake_time(monitor)
    callbacks = [GradientFlowMonitor(), AttentionEntropyMonitor(), AnomalyAlarm(), Costly(clock), monitor]
    fit(Encoder(width=32, seq=16), [*callbacks, Tick(clock, 0.01)], 80, log_every_n_steps=40, default_root_dir=tmp_path)
    assert [a.format() for cb in callbacks for a in cb.alerts if a.severity != "info"] == []
    overhead = {k.rsplit("/", 1)[1]: [v for _, v in series] for k, series in rec.values.items() if "/overhead/" in k}
    assert set(overhead) == {
        "GradientFlowMonitor", "AttentionEntropyMonitor", "AnomalyAlarm", "Costly", "SystemMonitor", "AttentionRecorder"
    }
    # the fake clock moves only in Tick (10 ms per step, not a diagnostic) and in Costly (0.2 ms per step)
    assert overhead.pop("Costly") == pytest.approx([0.0002 / 0.0102] * 2)
    assert all(v == 0.0 for series in overhead.values() for v in series), overhead
    # the decomposition adds up to the step time
    (step, total), *_ = rec.values["diag/system/step_time_s"]
    assert total == pytest.approx(0.0102)
    parts = sum(dict(rec.values[f"diag/system/{k}_s"])[step] for k in ("data_wait", "forward_backward", "optimizer"))
    assert parts == pytest.approx(total, rel=1e-6)
    assert rec.values["diag/system/tokens_per_s"][-1][1] > rec.values["diag/system/samples_per_s"][-1][1]
    # every wrapper is gone after the fit
    assert all("on_train_batch_end" not in vars(cb) for cb in callbacks)
    assert not getattr(AttentionRecorder.add, "_diag_timed", False)


def test_state_survives_a_resume(tmp_path):
    monitor = SystemMonitor(log_every_n_steps=2, warmup_steps=0, memory_window=3)
    ckpt = pl.callbacks.ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=10, save_top_k=-1)
    kwargs = {**FAST, "enable_checkpointing": True, "default_root_dir": tmp_path}
    pl.Trainer(max_steps=10, callbacks=[monitor, ckpt], **kwargs).fit(MLP())
    assert monitor.steps_seen == 10
    assert monitor.step_window[-1][2] is True  # the step that saved is left out of the fluctuation test
    saved = torch.load(tmp_path / "epoch=0-step=10.ckpt", weights_only=False)["callbacks"]
    state = next(v for k, v in saved.items() if k.startswith("SystemMonitor"))
    # saved inside step 10, before its interval (steps 9-10) was reported
    assert state["steps_seen"] == 8 and len(state["window"]) == 8
    assert len(state["memory"]["history"]["host_rss"]) == 3
    resumed = SystemMonitor(log_every_n_steps=2, warmup_steps=0, memory_window=3)
    seen: dict[str, Any] = {}

    class Peek(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            seen.update(resumed.state_dict())

    trainer = pl.Trainer(max_steps=14, callbacks=[resumed, Peek()], **{**FAST, "default_root_dir": tmp_path})
    trainer.fit(MLP(), ckpt_path=tmp_path / "epoch=0-step=10.ckpt")
    assert seen["steps_seen"] == 8 and seen["window"] == state["window"]
    assert seen["memory"] == state["memory"] and seen["dataloader"] == state["dataloader"]
    assert resumed.steps_seen == 12  # steps 11-14 were added to the restored window
    assert [round(t, 9) for t, _, _ in list(resumed.step_window)[:8]] == [round(w[0], 9) for w in state["window"]]


@pytest.mark.parametrize(
    ("kwargs", "error", "needle"),
    [
        ({"dataloader_share": 1.5}, ValueError, "dataloader_share"),
        ({"dataloader_share": "x"}, TypeError, "dataloader_share"),
        ({"window": 10}, ValueError, "window"),
        ({"fluctuation_threshold": -0.1}, ValueError, "fluctuation_threshold"),
        ({"memory_window": 2}, ValueError, "memory_window"),
        ({"block_steps": 0}, ValueError, "block_steps"),
        ({"nvml": "yes"}, TypeError, "nvml"),
        ({"time_callbacks": 1}, TypeError, "time_callbacks"),
        ({"log_every_n_steps": 0}, ValueError, "log_every_n_steps"),
    ],
)
def test_bad_configuration_is_refused_at_construction(kwargs, error, needle):
    with pytest.raises(error, match=needle):
        SystemMonitor(**kwargs)


def test_thresholds_are_the_registry_defaults():
    from lightning_diag.core.registry import default_thresholds

    assert SystemMonitor().thresholds() == default_thresholds("SystemMonitor")


def test_the_page_lists_every_tag_rule_and_argument():
    import inspect
    import re
    from pathlib import Path

    page = (Path(__file__).resolve().parents[2] / "docs" / "system_monitor.md").read_text()
    for rule in ("dataloader_bound", "step_time_periodic", "step_time_fluctuation", "memory_growth"):
        assert f"**`{rule}`**" in page, rule
    for name in inspect.signature(SystemMonitor).parameters:
        if name not in ("log_every_n_steps", "nvml", "time_callbacks"):
            assert f"`{name}`" in page, name
    source = (Path(__file__).resolve().parents[2] / "lightning_diag" / "callbacks" / "system_monitor.py").read_text()
    for tag in re.findall(r'family_tag\("system", "(\w+)"\)', source):
        assert f"diag/system/{tag}" in page, tag
    assert "diag/overhead/<CallbackName>" in page and "Not run on hardware" in page


def test_sustained_step_time_changes_are_a_fluctuation(monkeypatch, tmp_path):
    from tests.callbacks.system_models import BusyBlocks

    rec = spy(monkeypatch)
    monitor = SystemMonitor(log_every_n_steps=10, warmup_steps=0)
    clock = on_fake_time(monitor)
    fit(MLP(), [monitor, Tick(clock, 0.001), BusyBlocks(clock=clock)], 80, default_root_dir=tmp_path)
    (alert,) = [a for a in monitor.alerts if a.rule == "step_time_fluctuation"]
    # judged from 50 kept steps (the run's first step is left out): checks at 60, 70, 80
    assert alert.global_step == 80 and alert.value > alert.threshold == 0.15
    assert len(rec.values["diag/system/step_time_fluctuation"]) == 3
    assert "step_time_periodic" not in rules(monitor)
