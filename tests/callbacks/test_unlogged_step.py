"""The non-finite replay and the probes run the user's ``training_step`` without touching what the user logs.

A module that ``self.log``s (and counts its calls on ``self``) inside ``training_step`` is fitted without our
callbacks and with a probe and a rollback replay: the logged rows are the same at the steps not rolled back, the
live module's counter only counts the loop's steps, and neither the module's instance dictionary nor any class is
changed.
"""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_diag import AnomalyAlarm, SharpnessProbe
from lightning_diag.callbacks.common.unlogged import unlogged_copy
from tests.callbacks.nonfinite_models import Regression
from tests.output.logger_models import MemoryLogger

FAST: dict[str, Any] = dict(
    accelerator="cpu",
    enable_progress_bar=False,
    enable_model_summary=False,
    enable_checkpointing=False,
    num_sanity_val_steps=0,
    log_every_n_steps=1,
)


class Logging(Regression):
    """:class:`Regression` that logs a step/epoch count and a loss twin from ``training_step``, and validates."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.calls = 0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.calls += 1  # lands on the live module only when the loop runs the step
        loss = super().training_step(batch, batch_idx)  # self.log("train_loss", loss)
        self.log_dict({"calls": float(self.calls), "twin": loss.detach()}, on_step=True, on_epoch=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", (self(x) - y).pow(2).mean())

    def val_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(self.x[:32], self.y[:32]), batch_size=16)


class Results(pl.Callback):
    """The probe's result after each validation (this callback comes after the probe)."""

    def __init__(self, probe: SharpnessProbe) -> None:
        self.probe = probe
        self.seen: list[tuple[int, Any]] = []

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.seen.append((trainer.global_step, self.probe.last_result))


def _classes() -> dict[type, dict[str, Any]]:
    return {cls: dict(vars(cls)) for cls in (Logging, Regression, pl.LightningModule, torch.nn.Module)}


def _fit(model: Logging, callbacks: list[pl.Callback], root: Any, **kwargs: Any) -> tuple[pl.Trainer, MemoryLogger]:
    logger = MemoryLogger()
    trainer = pl.Trainer(default_root_dir=root, logger=logger, callbacks=callbacks, **{**FAST, **kwargs})
    trainer.fit(model)
    return trainer, logger


def _rows(logger: MemoryLogger, keys: set[str]) -> list[tuple[int | None, dict[str, float]]]:
    out = []
    for step, metrics in logger.user_metrics():
        mine = {k: v for k, v in metrics.items() if k in keys}
        if mine:
            out.append((step, mine))
    return out


def test_replay_and_probe_leave_the_logged_values_and_the_module_alone(tmp_path):
    burst = (40, 41, 42)
    plain = Logging(burst=burst)
    _, plain_log = _fit(plain, [], tmp_path / "plain", max_epochs=3)
    keys = {k for _, metrics in plain_log.user_metrics() for k in metrics}
    assert {"train_loss", "calls_step", "calls_epoch", "twin_step", "twin_epoch", "val_loss"} <= keys

    classes = _classes()
    model = Logging(burst=burst)
    before = set(vars(model))
    alarm = AnomalyAlarm(on_nonfinite="rollback", rules={"nonfinite_rollback": {"every_n_steps": 1, "snapshots": 4}})
    probe = SharpnessProbe(num_batches=1)
    results = Results(probe)
    trainer, log = _fit(model, [alarm, probe, results], tmp_path / "diag", max_epochs=3)

    # the replay ran (it located the non-finite value) and so did the probe, every epoch
    rollbacks = [a for a in alarm.alerts if a.rule == "nonfinite_rollback"]
    assert rollbacks and [step for step, _ in results.seen] == [32, 64, 96]
    assert all(result is not None for _, result in results.seen) and len({id(r) for _, r in results.seen}) == 3
    assert all("every module output is finite" in a.message for a in rollbacks)  # what the replay found
    first = min(a.global_step for a in rollbacks)
    assert first > 32  # the probe of epoch 0 ran before it
    ours, theirs = _rows(log, keys), _rows(plain_log, keys)
    kept = [row for row in ours if row[0] is not None and row[0] < first]
    assert kept and kept == [row for row in theirs if row[0] is not None and row[0] < first]
    assert any("calls_epoch" in m for _, m in kept) and any("val_loss" in m for _, m in kept)
    # the live module counted the loop's steps only, and its logged count says so to the end
    assert trainer.global_step == 3 * 32 and model.calls == plain.calls == 3 * 32
    assert [m["calls_step"] for _, m in ours if "calls_step" in m] == [float(n) for n in range(1, 3 * 32 + 1)]
    # nothing was added to, or left on, the module or any class
    assert before <= set(vars(model)) == set(vars(plain))
    assert "log" not in vars(model) and "log_dict" not in vars(model)
    after = _classes()
    for cls, attrs in classes.items():
        assert after[cls].keys() == attrs.keys() and all(after[cls][k] is v for k, v in attrs.items()), cls


def test_without_a_fault_rows_and_weights_are_identical(tmp_path):
    runs = []
    for callbacks in ([], [AnomalyAlarm(on_nonfinite="rollback"), SharpnessProbe(num_batches=2)]):
        model = Logging()
        _, log = _fit(model, callbacks, tmp_path / str(len(callbacks)), max_epochs=2)
        runs.append((model, log))
    (plain, plain_log), (model, log) = runs
    keys = {k for _, metrics in plain_log.user_metrics() for k in metrics}
    assert _rows(log, keys) == _rows(plain_log, keys) and len(_rows(log, keys)) > 2 * 32
    assert model.calls == plain.calls == 2 * 32
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), model.state_dict().values(), strict=True))


def test_the_copy_shares_the_module_and_silences_only_its_own_log() -> None:
    model = Logging()
    quiet = unlogged_copy(model)
    assert type(quiet) is Logging and quiet is not model
    assert quiet.net is model.net and dict(quiet.named_parameters()) == dict(model.named_parameters())
    assert quiet.log("x", 1.0) is None and quiet.log_dict({"x": 1.0}) is None
    assert "log" not in vars(model) and "log_dict" not in vars(model)
    x = torch.randn(3, 4)
    assert torch.equal(quiet(x), model(x))
    quiet.calls = 5  # an attribute the step sets on self stays on the copy
    assert model.calls == 0
