"""The healthy long-run recipes of lightning_diag/demo/schedules.py (issue 44's calibration corpus): each does what
its name says (the schedule, the ramp, the unfreezing), converges, and the quiet ones stay quiet."""

from __future__ import annotations

from typing import Any

import pytest
import pytorch_lightning as pl

from lightning_diag.demo.run import default_callbacks, quiet
from lightning_diag.demo.schedules import SCENARIOS, build_scenario, run_scenario


class _Recorder(pl.Callback):
    """Each step's learning rate and batch size, and per epoch which parameters train."""

    def __init__(self) -> None:
        self.lrs: list[float] = []
        self.sizes: dict[int, set[int]] = {}
        self.trainable: dict[int, set[str]] = {}

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, i: int) -> None:
        self.lrs.append(float(trainer.optimizers[0].param_groups[0]["lr"]))
        self.sizes.setdefault(trainer.current_epoch, set()).add(int(batch[0].shape[0]))
        names = {n for n, p in pl_module.named_parameters() if p.requires_grad}
        self.trainable.setdefault(trainer.current_epoch, names)


def _run(name: str, tmp_path: Any) -> tuple[Any, _Recorder]:
    recorder = _Recorder()
    with quiet(1):
        result = run_scenario(name, [*default_callbacks(), recorder], root=str(tmp_path))
    return result, recorder


def test_steps_in_epoch_follow_ramps_curricula_and_limits() -> None:
    ramp = SCENARIOS["batch_ramp"]
    assert [ramp.steps_in_epoch(e) for e in range(8)] == [128, 64, 32, 16, 8, 4, 4, 4]
    curriculum = SCENARIOS["curriculum"]
    assert curriculum.steps_in_epoch(3) == 16 and curriculum.steps_in_epoch(4) == 32
    one = SCENARIOS["one_batch_epochs"]
    assert one.steps_in_epoch(0) == 1 and one.total_steps == 300
    with pytest.raises(ValueError, match="`name`"):
        build_scenario("warm_restart")


@pytest.mark.parametrize("name", ["cyclic_lr", "batch_ramp", "contrastive", "distillation"])
def test_quiet_scenarios_converge_without_a_warning(name: str, tmp_path: Any) -> None:
    result, recorder = _run(name, tmp_path)
    assert result.global_step == SCENARIOS[name].total_steps
    assert result.converged and result.epoch_losses[-1] < 0.9 * result.epoch_losses[0], result.epoch_losses
    assert result.serious == [], [a.format() for a in result.serious]
    if name == "cyclic_lr":  # triangular: from 1e-4 up to 4e-3 and back, a cycle every 4 epochs of 16 steps
        assert min(recorder.lrs) == pytest.approx(1e-4) and max(recorder.lrs) == pytest.approx(4e-3, rel=0.05)
        rises = sum(1 for a, b, c in zip(recorder.lrs, recorder.lrs[1:], recorder.lrs[2:], strict=False) if a > b < c)
        assert rises == 2
    if name == "batch_ramp":
        assert [recorder.sizes[e] for e in range(6)] == [{8}, {16}, {32}, {64}, {128}, {256}]


def test_unfreezing_trains_the_head_then_each_group_at_its_epoch(tmp_path: Any) -> None:
    result, recorder = _run("unfreezing", tmp_path)
    assert result.converged
    layer1, embed = "net.encoder.layers.1.linear1.weight", "net.embed.weight"
    assert "net.head.0.weight" in recorder.trainable[0]
    assert layer1 not in recorder.trainable[1] and embed not in recorder.trainable[1]
    assert layer1 in recorder.trainable[2] and embed not in recorder.trainable[3]
    assert layer1 in recorder.trainable[4] and embed in recorder.trainable[4]
    # a parameter that joins later is a healthy freeze, not a frozen layer
    assert not [a for a in result.serious if a.rule == "grad_frozen"]


def test_warm_restarts_jump_back_to_the_peak(tmp_path: Any) -> None:
    model, _, scenario, _ = build_scenario("warm_restarts")
    opt: Any = model.configure_optimizers()
    sched, optimizer = opt["lr_scheduler"]["scheduler"], opt["optimizer"]
    lrs = []
    for _ in range(6 * scenario.steps_in_epoch(0) + 1):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        sched.step()
    per_epoch = scenario.steps_in_epoch(0)
    assert lrs[0] == pytest.approx(scenario.lr) and lrs[2 * per_epoch] == pytest.approx(scenario.lr)
    assert lrs[2 * per_epoch - 1] < 0.01 * scenario.lr and lrs[6 * per_epoch] == pytest.approx(scenario.lr)
