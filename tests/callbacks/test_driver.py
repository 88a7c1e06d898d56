"""The driver, one per trainer (issue 43): it holds the session, the step axis and the step cache, moves the axis once
per batch and decides every attached callback's logging cadence, whatever the number of callbacks and their
intervals; the axis survives a resume and two trainers keep their own drivers. During a fit it owns the Lightning
hooks (step 2): Lightning dispatches the training and validation hooks to the first attached callback only, which
runs every attached callback's own in list order; everything is given back at the end."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lightning_diag import AnomalyAlarm, AttentionEntropyMonitor, GradientFlowMonitor, SystemMonitor
from lightning_diag.callbacks.common.base import DiagCallback
from lightning_diag.callbacks.common.batch_hooks import DISPATCHED_HOOKS
from lightning_diag.callbacks.common.driver import Driver, driver_of
from lightning_diag.callbacks.common.step_axis import STEP_AXIS_KEY
from lightning_diag.stats.reduced import ReducedState, Reduction
from tests.output.logger_models import FAST, Regression

STEPS = 12


class _Cadence(pl.Callback):
    """Placed after the library's callbacks: records, at every batch start, each one's ``on_cadence`` (decided
    before this hook runs) and the user-axis count the interval divides."""

    def __init__(self, watched: list[DiagCallback]) -> None:
        self.watched = watched
        self.rows: list[tuple[int, tuple[bool, ...]]] = []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        driver = driver_of(trainer)
        assert driver is not None
        self.rows.append((driver.step_axis.cadence_step, tuple(cb.on_cadence for cb in self.watched)))


def _count_calls(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """What each call of ``Driver.batch_started`` answered (``True``: it decided for a new batch)."""
    answers: list[bool] = []
    original = Driver.batch_started

    def counted(self: Driver, *args: Any) -> bool:
        answer = original(self, *args)
        answers.append(answer)
        return answer

    monkeypatch.setattr(Driver, "batch_started", counted)
    return answers


def _fit(callbacks: list[pl.Callback], root: Any, steps: int = STEPS, **kwargs: Any) -> pl.Trainer:
    trainer = pl.Trainer(
        default_root_dir=root, max_steps=steps, log_every_n_steps=5, logger=False, callbacks=callbacks, **FAST
    )
    trainer.fit(Regression(), **kwargs)
    return trainer


@pytest.mark.parametrize("alarm_first", [False, True], ids=["monitors", "alarm-leads"])
def test_one_decision_per_batch_however_many_callbacks(tmp_path, monkeypatch, alarm_first):
    answers = _count_calls(monkeypatch)
    ours: list[DiagCallback] = [GradientFlowMonitor(), AttentionEntropyMonitor(), SystemMonitor()]
    if alarm_first:
        ours.insert(0, AnomalyAlarm())
    trainer = _fit([pl.Callback(), *ours], tmp_path)
    assert answers.count(True) == STEPS  # one decision per batch, by the first callback
    if not alarm_first:  # the alarm's short start asks again when it then takes the full one: answered False
        assert answers == [True] * STEPS
    driver = driver_of(trainer)
    assert driver is not None and driver.callbacks == [] and driver.batches == STEPS  # all detached at teardown
    assert driver.session is None and driver.step_axis.state_dict() == {"stepped": STEPS}


def test_callbacks_with_their_own_intervals_on_one_trainer(tmp_path):
    flow, alarm, attention = GradientFlowMonitor(log_every_n_steps=2), AnomalyAlarm(), AttentionEntropyMonitor(
        log_every_n_steps=3
    )
    ours: list[DiagCallback] = [flow, alarm, attention]
    cadence = _Cadence(ours)
    trainer = _fit([*ours, cadence], tmp_path)  # alarm: the trainer's 5
    assert [count for count, _ in cadence.rows] == list(range(1, STEPS + 1))
    expected = [(count, (count % 2 == 0, count % 5 == 0, count % 3 == 0)) for count in range(1, STEPS + 1)]
    assert cadence.rows == expected
    assert trainer.global_step == STEPS
    assert [a.rule for a in alarm.alerts + flow.alerts if a.severity.value in ("warning", "critical")] == []


class _Silent(DiagCallback):
    """A lightning_diag callback whose batch and epoch starts do not call ``super()`` (as a user's subclass may)."""

    def on_train_epoch_start(self, *args: Any) -> None:
        pass

    def on_train_batch_start(self, *args: Any) -> None:
        pass


def test_the_first_callback_that_starts_the_batch_decides(tmp_path):
    # the first lightning_diag callback in the list never starts a batch: the next one decides for every callback
    silent, flow, alarm = _Silent(log_every_n_steps=4), GradientFlowMonitor(log_every_n_steps=2), AnomalyAlarm()
    order: list[list[DiagCallback]] = []

    class Order(pl.Callback):
        def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
            driver = driver_of(trainer)
            assert driver is not None
            order.append(list(driver.callbacks))  # type: ignore[arg-type]

    cadence = _Cadence([silent, flow, alarm])
    _fit([silent, Order(), alarm, pl.Callback(), flow, cadence], tmp_path, steps=6)
    assert order == [[silent, alarm, flow]] * 6  # `trainer.callbacks` order
    expected = [(count, (count % 4 == 0, count % 2 == 0, count % 5 == 0)) for count in range(1, 7)]
    assert cadence.rows == expected


def test_a_resume_keeps_the_step_axis(tmp_path):
    # uninterrupted: 12 batches, intervals 4 (the monitor) and 5 (the trainer's, the alarm)
    whole = [GradientFlowMonitor(log_every_n_steps=4), AnomalyAlarm()]
    whole_cadence = _Cadence(whole)
    _fit([*whole, whole_cadence], tmp_path / "whole")
    # the same run stopped after 7 batches and resumed through `Trainer.fit(ckpt_path=...)` with new callbacks
    first = [GradientFlowMonitor(log_every_n_steps=4), AnomalyAlarm()]
    stopped = _fit(first, tmp_path / "first", steps=7)
    ckpt = tmp_path / "mid.ckpt"
    stopped.save_checkpoint(ckpt)
    assert torch.load(ckpt, weights_only=False)[STEP_AXIS_KEY] == {"stepped": 7}
    second = [GradientFlowMonitor(log_every_n_steps=4), AnomalyAlarm()]
    resumed_cadence = _Cadence(second)
    resumed = _fit([*second, resumed_cadence], tmp_path / "second", ckpt_path=str(ckpt))
    assert resumed_cadence.rows == whole_cadence.rows[7:]
    assert [count for count, _ in resumed_cadence.rows] == list(range(8, STEPS + 1))
    driver = driver_of(resumed)
    assert driver is not None and driver.step_axis.state_dict() == {"stepped": STEPS}


def test_two_trainers_have_their_own_drivers(tmp_path):
    a_callbacks, b_callbacks = [GradientFlowMonitor(), AnomalyAlarm()], [GradientFlowMonitor(log_every_n_steps=3)]
    a = pl.Trainer(default_root_dir=tmp_path / "a", max_steps=6, logger=False, callbacks=a_callbacks, **FAST)
    b = pl.Trainer(default_root_dir=tmp_path / "b", max_steps=4, logger=False, callbacks=b_callbacks, **FAST)
    seen: list[tuple[int, int]] = []

    class FitsB(pl.Callback):
        """Fits trainer ``b`` from inside ``a``'s third batch (a search run from a callback)."""

        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            if trainer.global_step == 3 and not seen:
                b.fit(Regression())
                da, db = driver_of(a), driver_of(b)
                assert da is not None and db is not None
                seen.append((da.step_axis.state_dict()["stepped"], db.step_axis.state_dict()["stepped"]))

    a.callbacks.append(FitsB())
    a.fit(Regression())
    assert seen == [(3, 4)]  # b's fit neither moved a's axis nor read it
    da, db = driver_of(a), driver_of(b)
    assert da is not None and db is not None and da is not db
    assert da.step_axis.state_dict() == {"stepped": 6} and db.step_axis.state_dict() == {"stepped": 4}
    # a second fit on the same trainer continues its axis
    b.fit_loop.epoch_loop.max_steps = 6
    b.fit(Regression())
    assert db.step_axis.state_dict() == {"stepped": 6} and driver_of(b) is db


def test_attach_and_detach_count_the_sessions_users(tmp_path):
    trainer = pl.Trainer(default_root_dir=tmp_path, logger=False, **FAST)
    flow, alarm = GradientFlowMonitor(), AnomalyAlarm()
    driver = Driver()
    first = driver.attach(trainer, flow)
    assert driver.attach(trainer, alarm) is first and driver.attach(trainer, flow) is first  # one session
    assert driver.callbacks == [flow, alarm] and first.users == 3
    driver.detach(flow, first)
    assert driver.callbacks == [alarm] and driver.session is first
    driver.detach(alarm, first)
    driver.detach(flow, first)
    assert driver.callbacks == [] and driver.session is None and first.users == 0


def test_hooks_called_without_a_session_use_the_global_step():
    flow = DiagCallback(log_every_n_steps=3)

    class Stub:
        global_step = 6
        log_every_n_steps = 50

    flow.on_train_batch_start(Stub(), None, None, 0)  # type: ignore[arg-type]
    assert flow.on_cadence
    Stub.global_step = 7
    flow.on_train_batch_start(Stub(), None, None, 0)  # type: ignore[arg-type]
    assert not flow.on_cadence


# -- step 2: the driver owns the hooks ----------------------------------------------------------------------------
class _Recorder(DiagCallback):
    """A lightning_diag callback that records, in a shared list, each training and validation hook it runs."""

    def __init__(self, name: str, calls: list[tuple[str, str]], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.name = name
        self.calls = calls

    def checkpoint_key(self) -> str:
        return f"_Recorder[{self.name}]"

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        super().on_train_batch_start(trainer, pl_module, *args)
        self.calls.append((self.name, "on_train_batch_start"))

    def on_train_batch_end(self, *args: Any) -> None:
        self.calls.append((self.name, "on_train_batch_end"))

    def on_validation_batch_end(self, *args: Any) -> None:
        self.calls.append((self.name, "on_validation_batch_end"))

    def on_train_epoch_end(self, *args: Any) -> None:
        self.calls.append((self.name, "on_train_epoch_end"))


class _User(pl.Callback):
    """A user's callback placed between two of ours: records its hooks, and what Lightning would call on ours."""

    def __init__(self, calls: list[tuple[str, str]], ours: list[DiagCallback]) -> None:
        self.calls = calls
        self.ours = ours
        self.callable: list[tuple[bool, ...]] = []

    def on_train_batch_start(self, *args: Any) -> None:
        self.calls.append(("user", "on_train_batch_start"))
        self.callable.append(tuple(callable(getattr(cb, hook)) for cb in self.ours for hook in DISPATCHED_HOOKS))

    def on_train_batch_end(self, *args: Any) -> None:
        self.calls.append(("user", "on_train_batch_end"))

    def on_validation_batch_end(self, *args: Any) -> None:
        self.calls.append(("user", "on_validation_batch_end"))


class _Validated(Regression):
    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.loss(batch)

    def val_dataloader(self) -> torch.utils.data.DataLoader:
        return self.train_dataloader()


class _CountingProfiler(pl.profilers.PassThroughProfiler):
    """Counts Lightning's callback hook dispatches (one profiler action per call of a callback's hook)."""

    def __init__(self) -> None:
        super().__init__()
        self.actions: dict[str, int] = {}

    def start(self, action_name: str) -> None:
        if action_name.startswith("[Callback]"):
            self.actions[action_name] = self.actions.get(action_name, 0) + 1


def test_the_first_callback_hosts_the_hooks_and_ours_run_together_at_its_place(tmp_path):
    calls: list[tuple[str, str]] = []
    a, b, c = (_Recorder(name, calls, log_every_n_steps=2) for name in "abc")
    user = _User(calls, [b, c])
    profiler = _CountingProfiler()
    trainer = pl.Trainer(
        default_root_dir=tmp_path, max_steps=4, logger=False, callbacks=[a, user, b, c], profiler=profiler,
        limit_val_batches=2, val_check_interval=4, **FAST,
    )
    trainer.fit(_Validated())
    starts = [name for name, hook in calls if hook == "on_train_batch_start"]
    assert starts == ["a", "b", "c", "user"] * 4  # our hooks together, at the host's place in the list
    ends = [name for name, hook in calls if hook == "on_train_batch_end"]
    assert ends == ["a", "b", "c", "user"] * 4
    assert [name for name, hook in calls if hook == "on_validation_batch_end"] == ["a", "b", "c", "user"] * 2
    assert [name for name, hook in calls if hook == "on_train_epoch_end"] == ["a", "b", "c"]
    # during the fit Lightning finds none of the others' dispatched hooks callable: it dispatches them to `a` only
    assert user.callable == [(False,) * (2 * len(DISPATCHED_HOOKS))] * 4
    dispatched = {
        (name.split("[")[2][0], name.rsplit(".", 1)[1]): n
        for name, n in profiler.actions.items()
        if name.startswith("[Callback]_Recorder[") and name.rsplit(".", 1)[1] in DISPATCHED_HOOKS
    }
    assert {who for who, _ in dispatched} == {"a"}
    assert dispatched["a", "on_train_batch_start"] == dispatched["a", "on_train_batch_end"] == 4
    assert profiler.actions["[Callback]_Recorder[b].on_fit_start"] == 1  # lifecycle hooks stay each callback's
    # given back: nothing of the driver's left on any instance, and the trainer's callbacks untouched
    assert trainer.callbacks[:4] == [a, user, b, c]
    for cb in (a, b, c):
        assert not set(vars(cb)) & set(DISPATCHED_HOOKS), cb.name
    driver = driver_of(trainer)
    assert driver is not None and driver.host is None and not driver.hosts(a)


def test_a_callback_used_alone_is_its_own_host(tmp_path):
    calls: list[tuple[str, str]] = []
    alone = _Recorder("alone", calls)
    hosted: list[bool] = []

    class Check(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            driver = driver_of(trainer)
            hosted.append(driver is not None and driver.host is alone)

    _fit([alone, Check()], tmp_path, steps=3)
    assert hosted == [True] * 3
    assert [hook for _, hook in calls].count("on_train_batch_end") == 3
    assert not set(vars(alone)) & set(DISPATCHED_HOOKS)


def test_a_callback_detached_mid_fit_hands_the_hosting_on(tmp_path):
    calls: list[tuple[str, str]] = []
    a, b = _Recorder("a", calls), _Recorder("b", calls)

    class Detach(pl.Callback):
        """Tears ``a`` (the host) down after the second batch, as an exception path of its own would."""

        def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
            if trainer.global_step == 2:
                a.teardown(trainer, pl_module, "fit")
                driver = driver_of(trainer)
                assert driver is not None and driver.host is b and driver.callbacks == [b]
                assert not driver.hosts(a) and "on_train_batch_end" not in vars(a)
                hosted.append(vars(b)["on_train_batch_end"])

    hosted: list[Any] = []
    _fit([a, b, Detach()], tmp_path, steps=5)
    # `a`, detached, is dispatched by Lightning itself again (its class's hooks, as before the driver); `b` hosts
    # its own: each runs once a batch, in list order
    ends = [name for name, hook in calls if hook == "on_train_batch_end"]
    assert ends == ["a", "b"] * 5
    assert hosted and hosted[0] is not None and hosted[0].__self__ is b  # b's own part, its only one
    for cb in (a, b):
        assert not set(vars(cb)) & set(DISPATCHED_HOOKS)


@pytest.mark.parametrize("count", [1, 2, 4], ids=["one", "two", "all"])
def test_a_resume_with_hosted_callbacks_continues_as_one_fit(tmp_path, count):
    def ours() -> list[DiagCallback]:
        every: list[DiagCallback] = [GradientFlowMonitor(log_every_n_steps=4), AnomalyAlarm(), SystemMonitor(),
                                     AttentionEntropyMonitor()]
        return every[:count]

    whole = ours()
    whole_cadence = _Cadence(whole)
    _fit([*whole, whole_cadence], tmp_path / "whole")
    first = ours()
    stopped = _fit(first, tmp_path / "first", steps=7)
    ckpt = tmp_path / "mid.ckpt"
    stopped.save_checkpoint(ckpt)
    saved = torch.load(ckpt, weights_only=False)
    assert saved[STEP_AXIS_KEY] == {"stepped": 7}
    assert set(saved["callbacks"]) >= {cb.state_key for cb in first}
    second = ours()
    resumed_cadence = _Cadence(second)
    _fit([*second, resumed_cadence], tmp_path / "second", ckpt_path=str(ckpt))
    assert resumed_cadence.rows == whole_cadence.rows[7:]
    for cb in second:
        assert not set(vars(cb)) & set(DISPATCHED_HOOKS)


def test_the_axis_is_written_and_resumed_once_per_checkpoint(tmp_path):
    # the checkpoint layout of every version: one top-level `lightning_diag_step_axis` beside each callback's state
    # under its `state_key` (main wrote the same key from every callback); one write, one resume, however many
    callbacks = [GradientFlowMonitor(), AnomalyAlarm(), SystemMonitor()]
    stopped = _fit(callbacks, tmp_path / "first", steps=5)
    driver = driver_of(stopped)
    assert driver is not None
    writes: list[dict[str, Any]] = []
    original = driver.step_axis.state_dict

    def counted() -> dict[str, Any]:
        state = original()
        writes.append(state)
        return state

    driver.step_axis.state_dict = counted  # type: ignore[method-assign]
    ckpt = tmp_path / "mid.ckpt"
    stopped.save_checkpoint(ckpt)
    assert writes == [{"stepped": 5}]
    saved = torch.load(ckpt, weights_only=False)
    assert saved[STEP_AXIS_KEY] == {"stepped": 5}
    assert {cb.state_key for cb in callbacks} <= set(saved["callbacks"])
    # a checkpoint as an earlier version wrote it (the same keys, the state of each callback untouched) resumes
    old = tmp_path / "old.ckpt"
    torch.save({**saved, STEP_AXIS_KEY: {"stepped": 5}}, old)
    resumed_callbacks = [GradientFlowMonitor(), AnomalyAlarm(), SystemMonitor()]
    cadence = _Cadence(resumed_callbacks)
    resumed = _fit([*resumed_callbacks, cadence], tmp_path / "second", steps=8, ckpt_path=str(old))
    assert [count for count, _ in cadence.rows] == [6, 7, 8]
    driver = driver_of(resumed)
    assert driver is not None and driver.step_axis.state_dict() == {"stepped": 8}
    # resumed once: a second load of the same state (the next callback's) changes nothing
    loaded = {STEP_AXIS_KEY: {"stepped": 3}}
    driver.load_axis(loaded)
    assert driver.step_axis.state_dict() == {"stepped": 3}
    driver.step_axis.load_state_dict({"stepped": 4})
    driver.load_axis(loaded)
    assert driver.step_axis.state_dict() == {"stepped": 4}
    assert driver.load_axis({}) is None and driver.step_axis.state_dict() == {"stepped": 4}


class _AsIfTwinRank:
    """`trainer.strategy` of rank 0 of two whose twin holds the same values: notes each collective."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def reduce(self, tensor: torch.Tensor, reduce_op: str) -> torch.Tensor:
        self.calls.append(reduce_op)
        return tensor * 2 if reduce_op == "sum" else tensor

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        self.calls.append("all_gather")
        return torch.stack([tensor, tensor])


def test_the_declared_state_is_reduced_once_per_checkpoint_for_every_callback():
    # the first callback's save reduces every callback's declared state (one collective per kind for all of them)
    # into its entry; the others' saves of the same checkpoint find it done, a new checkpoint is reduced again
    states = []
    for total, first in ((1.5, 7), (2.0, 3)):
        state = ReducedState()
        state.add_state("total", 0.0, Reduction.SUM)
        state.add_state("first", float("inf"), Reduction.MIN)
        state.add_state("seen", [], Reduction.CAT)
        state["total"], state["first"], state["seen"] = total, first, [total]
        states.append(state)
    strategy = _AsIfTwinRank()
    trainer: Any = SimpleNamespace(world_size=2, strategy=strategy)
    driver = Driver()
    read: list[str] = []

    def parts() -> Iterator[tuple[str, str, Any]]:
        for key, state in zip("AB", states, strict=True):
            read.append(key)
            yield key, "sums", state

    def checkpoint() -> dict[str, Any]:
        entries = {key: {"sums": {**state.state_dict(), "kept": 1}} for key, state in zip("AB", states, strict=True)}
        return {"callbacks": entries}

    saved = checkpoint()
    for _ in range(3):  # three callbacks save
        driver.save_reduced(trainer, saved, parts(), torch.device("cpu"))
    assert strategy.calls == ["sum", "min", "all_gather", "all_gather"] and read == ["A", "B"]
    assert saved["callbacks"] == {
        "A": {"sums": {"total": 3.0, "first": 7.0, "seen": [1.5, 1.5], "kept": 1}},
        "B": {"sums": {"total": 4.0, "first": 3.0, "seen": [2.0, 2.0], "kept": 1}},
    }
    again = checkpoint()
    driver.save_reduced(trainer, again, parts(), torch.device("cpu"))
    assert len(strategy.calls) == 8 and again["callbacks"] == saved["callbacks"]


# -- a fit that ends without our teardown, hooks switched off on an instance, the writer at each detach ---------------
class _FailingOnException(pl.Callback):
    """A user's callback whose ``on_exception`` raises: placed first, Lightning runs no other ``on_exception``."""

    def on_exception(self, *args: Any) -> None:
        raise ValueError("the user's on_exception fails")


class _NoTeardown(_Recorder):
    """A subclass whose ``teardown`` forgets ``super()``: it never detaches."""

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        pass


class _FailsAtStep(Regression):
    def __init__(self, at: int) -> None:
        super().__init__()
        self.at = at

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.global_step == self.at:
            raise RuntimeError("the model fails")
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("ending", ["user_on_exception_raises", "teardown_without_super"])
def test_instances_a_fit_left_hosted_run_each_hook_once_on_a_new_trainer(tmp_path, ending):
    calls: list[tuple[str, str]] = []
    if ending == "user_on_exception_raises":
        a, b = _Recorder("a", calls), _Recorder("b", calls)
        first = pl.Trainer(default_root_dir=tmp_path / "1", max_steps=6, logger=False,
                           callbacks=[_FailingOnException(), a, b], **FAST)
        with pytest.raises(ValueError, match="on_exception fails"):
            first.fit(_FailsAtStep(2))
    else:
        a, b = _Recorder("a", calls), _NoTeardown("b", calls)
        first = _fit([b, a], tmp_path / "1", steps=3)  # `b` hosts, and never gives the hooks back
    old = driver_of(first)
    assert old is not None and old.hosts(b)  # what the first fit left: the driver's calls on the instances
    calls.clear()
    second = _fit([a, b], tmp_path / "2", steps=3)
    assert [name for name, hook in calls if hook == "on_train_batch_start"] == ["a", "b"] * 3
    assert [name for name, hook in calls if hook == "on_train_batch_end"] == ["a", "b"] * 3
    assert [name for name, hook in calls if hook == "on_train_epoch_end"] == ["a", "b"]
    assert old.host is None and not old.hosts(a) and not old.hosts(b)  # the stale driver gave the hooks back
    new = driver_of(second)
    assert new is not None and new is not old
    if ending == "user_on_exception_raises":  # both tore down: nothing of either driver's left on the instances
        for cb in (a, b):
            assert not set(vars(cb)) & set(DISPATCHED_HOOKS), cb.name
    else:  # `b` never detaches from the new driver either; `a`, given back, is clean
        assert not set(vars(a)) & set(DISPATCHED_HOOKS)


def test_our_on_exception_gives_every_callbacks_hooks_back(tmp_path):
    calls: list[tuple[str, str]] = []
    a, b = _Recorder("a", calls), _Recorder("b", calls)
    trainer = pl.Trainer(default_root_dir=tmp_path, max_steps=6, logger=False,
                         callbacks=[a, _FailingOnException(), b], **FAST)
    with pytest.raises(ValueError, match="on_exception fails"):  # `b`'s on_exception never runs
        trainer.fit(_FailsAtStep(2))
    driver = driver_of(trainer)
    assert driver is not None and driver.host is None and not driver.hosts(b)
    assert not set(vars(a)) & set(DISPATCHED_HOOKS)
    # no call of the driver's left on `b` (only its own idle hooks, `None` until its next setup)
    assert "on_train_batch_end" not in vars(b) and "on_train_epoch_end" not in vars(b)
    assert all(vars(b)[hook] is None for hook in set(vars(b)) & set(DISPATCHED_HOOKS))


@pytest.mark.parametrize("host", [True, False], ids=["on_the_host", "on_another"])
def test_a_hook_set_to_none_on_an_instance_stays_off_and_none(tmp_path, host):
    calls: list[tuple[str, str]] = []
    a, b = _Recorder("a", calls), _Recorder("b", calls)
    off = a if host else b
    off.on_train_batch_end = None  # type: ignore[assignment]  # the library's own way of switching a hook off
    off.on_before_zero_grad = None  # type: ignore[assignment]  # an inherited no-op hook, switched off by the user
    _fit([a, b], tmp_path, steps=3)
    ends = [name for name, hook in calls if hook == "on_train_batch_end"]
    assert ends == [cb.name for cb in (a, b) if cb is not off] * 3
    assert [name for name, hook in calls if hook == "on_train_batch_start"] == ["a", "b"] * 3
    assert vars(off)["on_train_batch_end"] is None and vars(off)["on_before_zero_grad"] is None  # kept
    assert set(vars(off)) & set(DISPATCHED_HOOKS) == {"on_train_batch_end", "on_before_zero_grad"}
    other = b if host else a
    assert not set(vars(other)) & set(DISPATCHED_HOOKS)  # its idle hooks (inherited no-ops) given back


def test_each_detach_flushes_the_writer(tmp_path):
    """A callback that never detaches keeps the session open: the others' detach writes the run's events out."""
    calls: list[tuple[str, str]] = []
    flow = GradientFlowMonitor(log_every_n_steps=2)
    trainer = _fit([flow, _NoTeardown("stuck", calls)], tmp_path, steps=6)
    driver = driver_of(trainer)
    assert driver is not None and driver.session is not None  # still open: `stuck` is a user
    steps: set[int] = set()
    for folder in {p.parent for p in tmp_path.rglob("events.out.tfevents.*")}:
        acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            steps |= {e.step for e in acc.Scalars(tag)}
    assert steps and max(steps) >= 4  # the fit's last logged steps are in the file
