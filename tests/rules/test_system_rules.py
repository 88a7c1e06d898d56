import numpy as np
import pytest

from lightning_diag.rules.base import StepContext
from lightning_diag.rules.system import (
    DataloaderBoundRule,
    MemoryGrowthRule,
    StepFluctuationRule,
    StepPeriodicRule,
)

CTX = StepContext(epoch=0, global_step=100)


@pytest.mark.parametrize(
    ("intervals", "fires_at"),
    [
        ([(0.5, 1.0)] * 3, 2),  # half of the step waiting, three intervals: fires on the third
        ([(0.5, 1.0), (0.1, 1.0), (0.5, 1.0), (0.5, 1.0)], None),  # the streak was broken
        ([(0.2, 1.0)] * 5, None),  # below 25%
        ([(0.004, 0.006)] * 5, None),  # a large share of a tiny step: 0.4 ms per step is below min_wait_s
    ],
)
def test_dataloader_bound(intervals, fires_at):
    rule = DataloaderBoundRule()
    fired = [i for i, (w, s) in enumerate(intervals) if rule.update(CTX, w * 10, s * 10, 10)]
    assert fired == ([] if fires_at is None else [fires_at])


def test_periodic_rule_names_the_period_and_latches():
    rule = StepPeriodicRule()
    t = np.full(100, 0.02)
    t[4::10] = 0.2
    (alert,) = rule.update(CTX, t)
    assert alert.value == 10.0 and "every 10 steps" in alert.message and alert.threshold == 0.05
    assert rule.update(CTX, t) == []  # latched
    assert rule.update(CTX, np.full(100, 0.02)) == []  # missed once: the same event
    assert rule.update(CTX, t) == []
    assert all(rule.update(CTX, np.full(100, 0.02)) == [] for _ in range(3))  # cleared on 3 checks
    assert len(rule.update(CTX, t)) == 1


def test_periodic_rule_ignores_a_cheap_pattern_and_short_windows():
    rule = StepPeriodicRule()
    t = np.full(200, 0.02)
    t[::50] = 0.04  # 2x slow once every 50 steps: 1% of the time
    assert rule.update(CTX, t) == []
    t = np.full(40, 0.02)
    t[::5] = 0.2
    t[12] = 0.2  # fewer than MIN_STEPS and one slow step off the pattern: not certain
    assert rule.update(CTX, t) == []
    t = np.full(40, 0.02)
    t[::10] = 0.2
    t[20] = 0.02  # a position of the pattern not slow: not certain
    assert rule.update(CTX, t) == []


def test_periodic_rule_names_a_certain_pattern_in_a_short_window():
    # issue 23: a stall costing 70% of the time every 10 steps, three times in the 30 steps after the warm-up
    t = np.full(30, 0.01)
    t[9::10] = 0.3
    (alert,) = StepPeriodicRule().update(CTX, t)
    assert alert.value == 10.0 and "3 times in the last 30 steps" in alert.message
    assert StepPeriodicRule().update(CTX, t[:20]) == []  # twice is not certain


def test_utilization_dips():
    rule = StepPeriodicRule()
    u = np.full(120, 95.0)
    u[7::12] = 10.0
    (alert,) = rule.update_utilization(CTX, u)
    assert alert.source == "gpu_utilization" and alert.value == 12.0


def test_fluctuation_needs_patience_and_ignores_step_jitter():
    rule = StepFluctuationRule()
    jitter = np.tile([0.01, 0.03], 50)  # single steps vary 3x; every 10-step block is the same
    assert [rule.update(CTX, jitter)[1] for _ in range(5)] == [[]] * 5
    drifting = np.repeat([0.01, 0.02] * 5, 10)
    results = [rule.update(CTX, drifting) for _ in range(3)]
    assert [len(a) for _, a in results] == [0, 0, 1]
    assert results[-1][0] == pytest.approx(1 / 3) and results[-1][1][0].threshold == 0.15


def test_memory_growth_fires_on_a_leak_not_on_a_plateau():
    rule = MemoryGrowthRule()
    for i in range(7):
        assert rule.update(CTX, {"host_rss": 1e9 + i * 5e7, "cuda_allocated": 2e9}) == []
    (alert,) = rule.update(CTX, {"host_rss": 1e9 + 7 * 5e7, "cuda_allocated": 2e9})
    assert alert.source == "host_rss" and alert.value == pytest.approx(0.35)


def test_rule_state_round_trips():
    rule = MemoryGrowthRule()
    rule.update(CTX, {"host_rss": 1e9})
    other = MemoryGrowthRule()
    other.load_state_dict(rule.state_dict())
    assert other.history == {"host_rss": [1e9]}
    with pytest.raises(KeyError, match="history"):
        other.load_state_dict({"latch": []})
