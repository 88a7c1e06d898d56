"""Issue 43: a measuring step reads the gradients once. The driver measures the squared gradient (and weight) norms
that ``GradientFlowMonitor`` requests on its measuring steps, once, for whichever callback reads them first: they
stand for the non-finite guard's pass at that step in either order of the callbacks, and the guard stays exact: a
NaN gradient on a measuring step is still caught before the update, and huge finite gradients whose squared norms
overflow are still applied."""

from __future__ import annotations

import math

import pytest
import pytorch_lightning as pl
import torch

from lightning_diag import AnomalyAlarm, GradientFlowMonitor
from lightning_diag.callbacks.anomaly_alarm import guard_pass
from lightning_diag.callbacks.common.driver import driver_of
from lightning_diag.callbacks.common.shared import Shared, SharedMeasurements
from lightning_diag.instrument import grad_measure
from lightning_diag.instrument.grad_measure import GradientSquares
from tests.callbacks.nonfinite_models import Regression
from tests.callbacks.test_guard_probe import HugeGradients
from tests.output.logger_models import FAST, MemoryLogger

ORDERS = ("flow first", "alarm first")


def _ordered(order: str, flow: GradientFlowMonitor, alarm: AnomalyAlarm) -> list[pl.Callback]:
    return [flow, alarm] if order == "flow first" else [alarm, flow]


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


def _count_norms(monkeypatch: pytest.MonkeyPatch, clock: _Step, model: pl.LightningModule) -> list[tuple[int, int]]:
    """``(step, gradients in the list)`` of each multi-tensor norm call of ``grad_measure`` that reads a gradient
    of ``model`` (the driver's measurement, or a callback's own one)."""
    calls: list[tuple[int, int]] = []
    norms = grad_measure.per_tensor_norms

    def counted(tensors):
        grads = {id(p.grad) for p in model.parameters() if p.grad is not None}
        read = sum(id(t) in grads for t in tensors)
        if read:
            calls.append((clock.step, read))
        return norms(tensors)

    monkeypatch.setattr(grad_measure, "per_tensor_norms", counted)
    return calls


@pytest.mark.parametrize("order", ORDERS)
def test_a_measuring_step_reads_the_gradients_once(tmp_path, monkeypatch, order):
    clock = _Step()
    seen = _count_passes(monkeypatch, clock)
    model = Regression()
    norms = _count_norms(monkeypatch, clock, model)
    flow, alarm = GradientFlowMonitor(), AnomalyAlarm()
    callbacks = [clock, *_ordered(order, flow, alarm)]
    trainer = pl.Trainer(default_root_dir=tmp_path, max_steps=20, log_every_n_steps=5, callbacks=callbacks, **FAST)
    trainer.fit(model)
    # the guard's quick path starts at the second step (the first takes the full check); the measuring steps
    # (every 5th) use the squares the driver measured, the others make their own pass
    assert seen["measured"] == [4, 9, 14, 19]
    assert seen["own"] == [s for s in range(1, 20) if s not in (4, 9, 14, 19)]
    # one read of the gradients' norms per measuring step, every gradient of the model at once, whichever callback
    # reads first (step 0: GradientFlowMonitor's baseline of the untrained model, no request)
    n_grads = len(list(model.parameters()))
    assert norms == [(0, n_grads), (4, n_grads), (9, n_grads), (14, n_grads), (19, n_grads)]
    assert [a.rule for a in alarm.alerts if a.severity.value in ("warning", "critical")] == []


def test_without_gradient_flow_every_step_makes_its_own_pass(tmp_path, monkeypatch):
    clock = _Step()
    seen = _count_passes(monkeypatch, clock)
    alarm = AnomalyAlarm()
    trainer = pl.Trainer(default_root_dir=tmp_path, max_steps=12, log_every_n_steps=5, callbacks=[clock, alarm], **FAST)
    trainer.fit(Regression())
    assert seen["measured"] == [] and seen["own"] == list(range(1, 12))


@pytest.mark.parametrize("order", ORDERS)
def test_a_nan_gradient_on_a_measuring_step_is_stopped_before_the_update(tmp_path, order):
    flow, alarm = GradientFlowMonitor(), AnomalyAlarm()
    model = Regression(fault="backward", fault_steps=(9,))
    callbacks = _ordered(order, flow, alarm)
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


def _two_layers() -> tuple[grad_measure.ParamIndex, list[torch.nn.Parameter]]:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    named = list(net.named_parameters())
    params = [p for _, p in named]
    for p in params:
        p.grad = torch.randn(p.shape)
    return grad_measure.ParamIndex([n for n, _ in named], params, False, dict(net.named_modules())), params


def test_a_gather_of_the_shared_squares_makes_its_index_once(monkeypatch):
    """Two parameter groups (decay: the weights, no decay: the biases): the optimizer's order is not the
    monitor's, so its rows are gathered; the index tensor (a host-to-device copy on an accelerator) is made at
    the first measuring step and reused at the next, with the values of the monitor's own measurement."""
    index, params = _two_layers()
    chosen = list(range(len(params)))
    optimizer_order = [params[0], params[2], params[1], params[3]]
    made: list[torch.Tensor] = []
    rows_index = grad_measure.ParamIndex.rows_index

    def spy(self, rows, device):
        made.append(rows_index(self, rows, device))
        return made[-1]

    monkeypatch.setattr(grad_measure.ParamIndex, "rows_index", spy)
    for _ in range(2):  # two measuring steps, each with the driver's new record
        known = GradientSquares.measure(optimizer_order, weights=True)
        m = grad_measure.measure_step(index, chosen, None, known=known)
        own = grad_measure.measure_step(index, chosen, None)
        assert (m.total, m.norms, m.rms, m.relative, m.blocks) == (
            own.total, own.norms, own.rms, own.relative, own.blocks,
        )  # fmt: skip
        assert m.weight_squares is not None and own.weight_squares is not None
        assert torch.equal(m.weight_squares, own.weight_squares)
    assert len(made) == 2 and made[0] is made[1]
    assert made[0].tolist() == [0, 2, 1, 3]


def test_shared_squares_on_another_device_are_not_used():
    """A record whose squares are on another device than the measured gradients (faked with the meta device) is
    measured again on the gradients' device, as the guard's pass does, and its total is left unset."""
    index, params = _two_layers()
    grads = [p.grad for p in params]
    n = len(grads)
    other = GradientSquares.of(grads, torch.ones(n, device="meta"), torch.ones(n, device="meta"))  # type: ignore[arg-type]
    m = grad_measure.measure_step(index, list(range(n)), None, known=other)
    own = grad_measure.measure_step(index, list(range(n)), None)
    assert (m.total, m.norms, m.relative) == (own.total, own.norms, own.relative)
    assert math.isnan(other.total)


#: The learning rate's factor from step 20: the loss overflows at step 27, a step no callback measures (on a measuring
#: step that fails, the alarm placed first stops the update before GradientFlowMonitor measures it: the order of the
#: hooks, not of a measurement).
SPIKE = 15.0


class _OwnFlow(GradientFlowMonitor):
    """``GradientFlowMonitor`` measuring its own squared norms (as before the driver shared them)."""

    def shared_gradient_squares(self, trainer: pl.Trainer, optimizer: torch.optim.Optimizer) -> None:
        return None


class _OwnAlarm(AnomalyAlarm):
    """``AnomalyAlarm`` whose guard makes its own pass over the gradients at every step."""

    def shared_gradient_squares(self, trainer: pl.Trainer, optimizer: torch.optim.Optimizer) -> None:
        return None


class _TwoGroups(Regression):
    """:class:`Regression` with the usual AdamW-style split: the weights in one parameter group, the biases in
    another (the optimizer's order of the parameters is not the model's)."""

    def configure_optimizers(self):
        named = list(self.named_parameters())
        opt = torch.optim.SGD(
            [
                {"params": [p for n, p in named if n.endswith("weight")]},
                {"params": [p for n, p in named if not n.endswith("weight")], "lr": self.lr / 2},
            ],
            lr=self.lr,
        )
        assert self.spike is not None
        at, factor = self.spike
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: factor if s >= at else 1.0)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _fit_in_order(
    root, order: str, every: int = 5, own: bool = False, groups: int = 1
) -> tuple[list, list, list[torch.Tensor]]:
    """A fit with both callbacks in ``order`` (a fault: a learning-rate spike at step 20); with ``own``, each
    callback measures its own squared norms; ``groups``: the optimizer's parameter groups (1 or 2)."""
    flow, alarm = (_OwnFlow(), _OwnAlarm()) if own else (GradientFlowMonitor(), AnomalyAlarm())
    logger = MemoryLogger()
    model = (Regression if groups == 1 else _TwoGroups)(spike=(20, SPIKE))
    trainer = pl.Trainer(
        default_root_dir=root,
        max_steps=40,
        log_every_n_steps=every,
        logger=logger,
        callbacks=_ordered(order, flow, alarm),
        **FAST,
    )
    trainer.fit(model)
    alerts = [(a.rule, a.global_step, a.severity, a.value) for a in (*flow.alerts, *alarm.alerts)]
    # every logged value (the user's and the diagnostics'), as (step, tag, value): the callbacks' writes of one step
    # reach the logger in their order
    values = sorted((step if step is not None else -1, k, v) for step, m in logger.calls for k, v in m.items())
    return alerts, values, [p.detach().clone() for p in model.parameters()]


def test_the_order_of_the_callbacks_changes_no_value_alert_or_weight(tmp_path):
    first = _fit_in_order(tmp_path / "a", "flow first")
    second = _fit_in_order(tmp_path / "b", "alarm first")
    alerts, values, weights = first
    assert alerts and any("grad_norm" in tag for _, tag, _ in values)  # something to compare
    assert alerts == second[0]
    assert values == second[1]  # bit for bit
    assert all(torch.equal(a, b) for a, b in zip(weights, second[2], strict=True))


@pytest.mark.parametrize("groups", [1, 2])
def test_the_shared_record_changes_no_value_alert_or_weight_against_own_measurements(tmp_path, monkeypatch, groups):
    """The driver's one record read by both callbacks against each callback measuring its own squared norms (the
    guard's own pass at every step, ``GradientFlowMonitor``'s own norms), with one parameter group and with two
    (the monitor then gathers its rows from the record): every alert, logged value and final weight is identical."""
    gathers: list[list[int]] = []
    rows_index = grad_measure.ParamIndex.rows_index

    def spy(self, rows, device):
        gathers.append(rows)
        return rows_index(self, rows, device)

    monkeypatch.setattr(grad_measure.ParamIndex, "rows_index", spy)
    shared = _fit_in_order(tmp_path / "shared", "alarm first", groups=groups)
    # one parameter group: the record's rows are the monitor's; two: gathered at each measuring step
    if groups == 2:
        assert len(gathers) >= 5 and all(rows == gathers[0] != sorted(rows) for rows in gathers)
    else:
        assert not gathers
    own = _fit_in_order(tmp_path / "own", "alarm first", own=True, groups=groups)
    alerts, values, weights = shared
    assert alerts and any("grad_norm" in tag for _, tag, _ in values)  # something to compare
    assert alerts == own[0]
    assert values == own[1]  # bit for bit
    assert all(torch.equal(a, b) for a, b in zip(weights, own[2], strict=True))


def test_shared_measurements_are_measured_once_a_step_and_only_when_requested():
    w = torch.nn.Parameter(torch.tensor([3.0, 4.0]))
    v = torch.nn.Parameter(torch.tensor([1.0]))
    opt = torch.optim.SGD([w, v], lr=0.1)
    w.grad, v.grad = torch.tensor([1.0, 0.0]), torch.tensor([2.0])
    shared = SharedMeasurements()
    assert shared.gradient_squares(opt, 3) is None  # nothing requested: the reader measures its own
    shared.decide(frozenset({Shared.GRADIENT_SQUARES, Shared.WEIGHT_SQUARES}))
    found = shared.gradient_squares(opt, 3)
    assert found is not None and shared.gradient_squares(opt, 3) is found  # the same object for every reader
    assert found.squares.tolist() == [1.0, 4.0] and found.weights is not None and found.weights.tolist() == [25.0, 1.0]
    assert found.rows_of([v.grad, w.grad]) == [1, 0] and found.covers([w.grad, v.grad])
    assert shared.gradient_squares(opt, 4) is not found  # another step: measured again
    shared.decide(frozenset({Shared.GRADIENT_SQUARES}))
    assert shared.gradient_squares(opt, 5).weights is None  # the weights only when requested
    w.grad = None
    v.grad = None
    assert shared.gradient_squares(opt, 6) is None  # no gradient: nothing to share
    shared.decide(frozenset())
    assert shared.gradient_squares(opt, 7) is None


class _Requests(pl.Callback):
    """The driver's requested measurements at each optimizer step."""

    def __init__(self) -> None:
        self.seen: dict[int, frozenset[Shared]] = {}

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer) -> None:
        driver = driver_of(trainer)
        assert driver is not None
        self.seen[trainer.global_step] = driver.shared.requested


def test_the_requests_follow_the_requesting_callbacks_own_cadence(tmp_path):
    seen = _Requests()
    flow, alarm = GradientFlowMonitor(log_every_n_steps=4), AnomalyAlarm(log_every_n_steps=3)
    trainer = pl.Trainer(default_root_dir=tmp_path, max_steps=12, logger=False, callbacks=[alarm, flow, seen], **FAST)
    trainer.fit(Regression())
    squares = frozenset({Shared.GRADIENT_SQUARES, Shared.WEIGHT_SQUARES})
    # GradientFlowMonitor's cadence steps (global steps 3, 7, 11): the squares and the step loss; the alarm's
    # (global steps 2, 5, 8, 11): the step loss only
    assert {step for step, requested in seen.seen.items() if requested & squares} == {3, 7, 11}
    assert all(requested & squares in (squares, frozenset()) for requested in seen.seen.values())
    assert {step for step, requested in seen.seen.items() if Shared.STEP_LOSS in requested} == {2, 3, 5, 7, 8, 11}
