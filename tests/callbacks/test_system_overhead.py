"""SystemMonitor's self-reported cost (``diag/overhead/*``, issue 37 §3): sampled timing of the per-batch hooks,
its stated uncertainty, and the timing's own cost. Real ``Trainer.fit`` runs on a fake clock that only the test
moves (and, here, that costs a known amount per read), so every expected value is exact on any machine."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import pytorch_lightning as pl
import torch

from lightning_diag import SystemMonitor
from lightning_diag.callbacks.common.base import DiagCallback
from tests.callbacks.system_models import FAST, MLP, FakeTime, Tick

STEP_S = 0.01  # the training's own (fake) time per batch


@pytest.fixture(autouse=True)
def _quiet():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)
    yield
    torch.set_num_threads(before)


class CountingTime(FakeTime):
    """A fake time source whose training-thread clock counts its reads, each costing ``read_s`` of CPU time."""

    def __init__(self, read_s: float = 0.0) -> None:
        super().__init__()
        self.read_s = read_s
        self.reads = 0

    def thread(self) -> float:
        now = self.cpu_now
        self.reads += 1
        self.advance(self.read_s)
        return now


class Writer:
    """Keeps every scalar SystemMonitor writes and, at each write, the clock's reads and CPU time."""

    def __init__(self, clock: CountingTime) -> None:
        self.clock = clock
        self.values: dict[str, dict[int, float]] = {}
        self.marks: dict[int, tuple[int, float]] = {}

    def scalars(self, values: dict[str, float], step: int) -> None:
        self.marks[step] = (self.clock.reads, self.clock.cpu_now)
        for k, v in values.items():
            self.values.setdefault(k, {})[step] = float(v)


class Costs(DiagCallback):
    """A diagnostics callback costing ``cost(step)`` seconds of (fake) CPU time at every batch start and end."""

    def __init__(self, clock: FakeTime, cost: Any) -> None:
        super().__init__()
        self.clock = clock
        self.cost = cost
        self.spent: dict[int, float] = {}  # global step at batch start -> seconds spent in that batch

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self._spend(trainer.global_step)

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self._spend(trainer.global_step - 1)

    def _spend(self, step: int) -> None:
        seconds = self.cost(step) / 2
        self.clock.advance(seconds)
        self.spent[step] = self.spent.get(step, 0.0) + seconds


def run(monkeypatch: pytest.MonkeyPatch, tmp_path: Any, cost: Any, steps: int, read_s: float = 0.0, **kwargs: Any):
    clock = CountingTime(read_s)
    writer = Writer(clock)
    monkeypatch.setattr(SystemMonitor, "writer", property(lambda self: writer))
    monitor = SystemMonitor(**kwargs)
    monitor.time_source = clock
    costs = Costs(clock, cost)
    trainer = pl.Trainer(
        max_steps=steps,
        callbacks=[costs, monitor, Tick(clock, STEP_S)],
        log_every_n_steps=50,
        default_root_dir=tmp_path,
        **FAST,
    )
    trainer.fit(MLP(samples=16 * steps))
    return writer, costs, clock


def test_a_constant_cost_is_reported_exactly_with_most_batches_untimed(monkeypatch, tmp_path):
    writer, _, _ = run(monkeypatch, tmp_path, lambda step: 0.0004, 200)
    shares = writer.values["diag/overhead/Costs"]
    assert list(shares) == [50, 100, 150, 200]
    # every batch costs 0.4 ms over a 10 ms step: sampled or not, the estimate is exact, its error zero
    assert all(v == pytest.approx(0.0004 / (STEP_S + 0.0004)) for v in shares.values()), shares
    assert all(v == pytest.approx(0.0) for v in writer.values["diag/system/overhead_stderr/Costs"].values())
    # the batches around the logging steps and one in 8 of the others are timed: under a quarter of them
    timed = list(writer.values["diag/system/overhead_timed_batches"].values())
    assert all(0.1 < t < 0.25 for t in timed), timed
    assert writer.values["diag/overhead/SystemMonitor"][100] == pytest.approx(0.0)


def test_an_irregular_cost_is_estimated_within_its_stated_error(monkeypatch, tmp_path):
    # 0.1 ms on every 7th step (off the logging schedule), nothing elsewhere: the sampled estimate of each
    # interval stands within three standard errors of the truth, and is exact with every batch timed
    def cost(step: int) -> float:
        return 0.0001 if step % 7 == 3 else 0.0

    sampled, costs, _ = run(monkeypatch, tmp_path / "sampled", cost, 400)
    exact, _, _ = run(monkeypatch, tmp_path / "exact", cost, 400, overhead_sample_every=1)
    errors = []
    for end in range(100, 401, 50):
        # the interval reported at `end` holds the batches that started at steps end-50 .. end-1
        spent = sum(costs.spent.get(s, 0.0) for s in range(end - 50, end))
        truth = spent / (50 * STEP_S + spent)
        assert exact.values["diag/overhead/Costs"][end] == pytest.approx(truth)
        estimate = sampled.values["diag/overhead/Costs"][end]
        stderr = sampled.values["diag/system/overhead_stderr/Costs"][end]
        assert stderr > 0
        assert abs(estimate - truth) <= 3 * stderr + 1e-9, (end, estimate, truth, stderr)
        errors.append(estimate - truth)
    # unbiased: over the run the errors largely cancel
    assert abs(sum(errors) / len(errors)) < 0.5 * max(abs(e) for e in errors) + 1e-9


def test_the_timing_s_own_cost_is_in_the_report(monkeypatch, tmp_path):
    # each clock read costs 20 µs of the training thread's time and the callbacks cost nothing: everything the
    # callbacks are reported to take is the timing, and it must add up to what the reads cost
    writer, _, clock = run(monkeypatch, tmp_path, lambda step: 0.0, 250, read_s=20e-6)
    for start, end in ((100, 150), (150, 200), (200, 250)):
        reads = writer.marks[end][0] - writer.marks[start][0]
        span = writer.marks[end][1] - writer.marks[start][1]
        reported = sum(v[end] for k, v in writer.values.items() if k.startswith("diag/overhead/"))
        assert reported * span == pytest.approx(reads * clock.read_s, rel=0.05), (start, end)
    # timing only sampled batches reads the clock far less than timing every one
    every, _, _ = run(monkeypatch, tmp_path / "every", lambda step: 0.0, 250, overhead_sample_every=1)
    sampled_reads = writer.marks[250][0] - writer.marks[100][0]
    assert sampled_reads < 0.4 * (every.marks[250][0] - every.marks[100][0])


def test_heavy_batches_are_counted_even_when_untimed_and_preemption_is_not(monkeypatch, tmp_path):
    # 3 ms of work every 32nd step (a periodic flush off the logging schedule: 7 in 8 of them fall on untimed
    # batches) is counted in full; 5 ms that another process takes inside a hook on every 20th step (wall time
    # only) is not counted at all
    def cost(step: int) -> float:
        return 0.003 if step % 32 == 5 else 0.0

    preempted = []

    def steal(step: int) -> None:
        if step % 20 == 13:
            preempted.append(step)
            clock.advance(0.005, cpu=False)

    clock = CountingTime()
    writer = Writer(clock)
    monkeypatch.setattr(SystemMonitor, "writer", property(lambda self: writer))
    monitor = SystemMonitor()
    monitor.time_source = clock
    costs = Costs(clock, lambda step: (steal(step), cost(step))[1])
    trainer = pl.Trainer(
        max_steps=400,
        callbacks=[costs, monitor, Tick(clock, STEP_S)],
        log_every_n_steps=50,
        default_root_dir=tmp_path,
        **FAST,
    )
    trainer.fit(MLP(samples=16 * 400))
    assert preempted
    for end in range(100, 401, 50):
        spent = sum(costs.spent.get(s, 0.0) for s in range(end - 50, end))
        truth = spent / (50 * STEP_S + spent)
        assert writer.values["diag/overhead/Costs"][end] == pytest.approx(truth, abs=1e-9), end


@pytest.mark.parametrize(("value", "error"), [(0, ValueError), (2.5, TypeError), (True, TypeError)])
def test_a_bad_sampling_interval_is_refused(value, error):
    with pytest.raises(error, match="overhead_sample_every"):
        SystemMonitor(overhead_sample_every=value)
