"""Two trainers in one process, each with every callback (issue 43): fitting in turn and one inside the other (a
hyper-parameter search run from a callback), neither affects the other (the same alerts and logged rows as each
fit alone), and no class or function the fits touch is changed (nothing patched that the library does not own)."""

from __future__ import annotations

import logging
import sys
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from torch import nn

import lightning_diag
from lightning_diag import (
    AnomalyAlarm,
    AttentionEntropyMonitor,
    DataDiagnostics,
    GradientFlowMonitor,
    SystemMonitor,
    SystemProfiler,
)
from lightning_diag.callbacks.common.base import DiagCallback
from lightning_diag.instrument.attention_record import AttentionRecorder
from tests.callbacks.system_models import Encoder, FakeTime, StallEvery, Tick
from tests.output.logger_models import MemoryLogger

#: Series that depend on the machine, not on the run (the process's memory).
MACHINE = ("diag/system/host_rss_mib",)


class Model(Encoder):
    """The system tests' small transformer encoder, its batches in order (no draw from the global generator, which
    the other fit moves)."""

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(self.data, batch_size=self.batch, shuffle=False)


class Frozen(Model):
    """The encoder with a ``train()`` override that freezes the embedding (which Lightning never calls): its fit
    raises ``train_override_bypassed``."""

    def train(self, mode: bool = True) -> Frozen:
        super().train(mode)
        self.embed.requires_grad_(not mode)
        return self


class FitInside(pl.Callback):
    """Runs ``fit()`` (another trainer's whole fit) at the end of batch ``step`` of this trainer's, and ``check()``
    before and after it (in the middle of this trainer's fit)."""

    def __init__(self, step: int, fit: Any, check: Any) -> None:
        self.step = step
        self.fit = fit
        self.check = check
        self.checks: list[Any] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            self.checks.append(self.check())
            self.fit()
            self.checks.append(self.check())


def _callbacks(clock: FakeTime) -> list[pl.Callback]:
    monitor = SystemMonitor()
    monitor.time_source = clock  # the timings are exact: only this run's Tick moves its clock
    return [GradientFlowMonitor(), AnomalyAlarm(), AttentionEntropyMonitor(), DataDiagnostics(), monitor]


class Run:
    """One trainer with every callback, on its own fake clock, its own logger and its own folder."""

    def __init__(self, root: Any, name: str, width: int, profiled: bool) -> None:
        self.clock = FakeTime()
        self.logger = MemoryLogger()
        self.callbacks = [*_callbacks(self.clock), Tick(self.clock, 0.01)]
        if width == 32:  # run A: a stall every 5 steps (before the monitor: in the step with or without profiler)
            self.callbacks.insert(0, StallEvery(5, 0.2, self.clock))
        self.model = (Model if width == 32 else Frozen)(width=width, seq=16, samples=512)
        self.trainer = pl.Trainer(
            max_steps=24,
            log_every_n_steps=4,
            accelerator="cpu",
            callbacks=self.callbacks,
            logger=self.logger,
            default_root_dir=str(root / name),
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
            profiler=SystemProfiler() if profiled else None,
        )

    def fit(self) -> None:
        self.trainer.fit(self.model)

    def outcome(self) -> tuple[list[tuple[str, str, int]], list[tuple[int | None, dict[str, float]]]]:
        """Every callback's alerts (rule, severity, step) and every row logged, machine-dependent series left out."""
        alerts = [
            (a.rule, a.severity, a.global_step)
            for cb in self.callbacks
            if isinstance(cb, DiagCallback)
            for a in cb.alerts
        ]
        rows = [(step, {k: v for k, v in m.items() if k not in MACHINE}) for step, m in self.logger.calls]
        return alerts, rows


def _classes(runs: list[Run]) -> list[type]:
    """Every class the fits involve: callbacks, trainer, loggers, profilers, modules (the MROs up to object)."""
    objects: list[Any] = [AttentionRecorder, pl.Trainer, pl.LightningModule, nn.Module, pl.Callback]
    for run in runs:
        objects += [run.trainer, run.logger, run.trainer.profiler, *run.callbacks, *run.model.modules()]
    classes: dict[type, None] = {}
    for obj in objects:
        for cls in (obj if isinstance(obj, type) else type(obj)).__mro__:
            if cls is not object:
                classes[cls] = None
    return list(classes)


def _snapshot(classes: list[type]) -> dict[str, Any]:
    """Each class's own attributes by identity, and the attention functions torch resolves."""
    shot: dict[str, Any] = {f"{c.__module__}.{c.__qualname__}": dict(vars(c)) for c in classes}
    functional = torch.nn.functional
    shot["functions"] = {
        "F.scaled_dot_product_attention": functional.scaled_dot_product_attention,
        "torch._C._nn.scaled_dot_product_attention": torch._C._nn.scaled_dot_product_attention,
        "F.softmax": functional.softmax,
        "torch.softmax": torch.softmax,
        "Tensor.softmax": torch.Tensor.softmax,
        "F.multi_head_attention_forward": functional.multi_head_attention_forward,
    }
    return shot


def _same(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """The names whose attributes differ (added, removed, or another object)."""
    changed = []
    for owner, attrs in before.items():
        now = after[owner]
        changed += [f"{owner}.{k}" for k in attrs.keys() | now.keys() if attrs.get(k, None) is not now.get(k, None)]
    return sorted(changed)


def _no_instance_patches(runs: list[Run], ours: bool = True) -> list[str]:
    """Instance attributes that shadow a method of their class (a wrapper), of lightning_diag's callbacks too unless
    ``ours`` is false (during a fit their hooks carry SystemMonitor's timers: the library's own objects)."""
    found = []
    for run in runs:
        objects = [run.trainer, run.logger, run.trainer.profiler, run.model, *run.model.modules(), *run.callbacks]
        for obj in objects if ours else [o for o in objects if not isinstance(o, DiagCallback)]:
            for name, value in vars(obj).items():
                if callable(getattr(type(obj), name, None)) and value is not getattr(type(obj), name):
                    found.append(f"{type(obj).__name__}.{name}")
            found += [f"{type(obj).__name__}.recorder_timing" for _ in [0] if "recorder_timing" in vars(obj)]
    return found


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)
    yield
    torch.set_num_threads(before)


@pytest.mark.slow
@pytest.mark.parametrize("profiled", [False, True], ids=["plain", "profiler"])
def test_two_trainers_fitting_in_turn_and_one_inside_the_other_do_not_affect_each_other(tmp_path, profiled):
    # each fit alone, in a fresh pair of trainers
    alone_a, alone_b = Run(tmp_path, "alone_a", 32, profiled), Run(tmp_path, "alone_b", 16, profiled)
    alone_a.fit()
    alone_b.fit()
    expected_a, expected_b = alone_a.outcome(), alone_b.outcome()
    assert expected_a[1] and expected_b[1]  # rows were logged
    assert expected_a != expected_b  # two different runs: the comparison below can tell them apart
    assert ("step_time_periodic", "warning") in {a[:2] for a in expected_a[0]}
    assert ("train_override_bypassed", "warning", 0) in expected_b[0]
    assert "train_override_bypassed" not in {a[0] for a in expected_a[0]}
    assert "step_time_periodic" not in {a[0] for a in expected_b[0]}

    # in turn, on one pair; then B's fit inside A's, at A's 10th step (after every hook of A's batch)
    first, second = Run(tmp_path, "turn_a", 32, profiled), Run(tmp_path, "turn_b", 16, profiled)
    outer, inner = Run(tmp_path, "outer_a", 32, profiled), Run(tmp_path, "inner_b", 16, profiled)
    runs = [first, second, outer, inner]
    classes = _classes(runs)
    before = _snapshot(classes)
    inside = FitInside(10, inner.fit, lambda: (_same(before, _snapshot(classes)), _no_instance_patches(runs, False)))
    outer.callbacks.append(inside)
    outer.trainer.callbacks.append(inside)  # type: ignore[attr-defined]

    first.fit()
    second.fit()
    outer.fit()
    assert inner.trainer.state.finished and inner.trainer.global_step == 24

    assert _same(before, _snapshot(classes)) == []
    assert _no_instance_patches(runs) == []
    # in the middle of A's fit, before and after B's: no class changed, no object but the library's own wrapped
    assert inside.checks == [([], [])] * 2
    assert first.outcome() == expected_a and second.outcome() == expected_b
    assert outer.outcome() == expected_a and inner.outcome() == expected_b
    # every callback of both trainers logged (the rows compared hold each one's series)
    tags = {k.split("/")[1] for _, m in expected_a[1] for k in m if k.startswith("diag/")}
    assert {"grad_norm", "system", "attn_entropy", "loss"} <= tags, tags
    assert "lightning_diag" in sys.modules and lightning_diag.SystemProfiler is SystemProfiler
