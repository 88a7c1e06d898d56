import numpy as np
import pytest

from lightning_diag.rules.base import StepContext
from lightning_diag.rules.dataloader_bound import DataloaderBoundRule
from lightning_diag.rules.measures import LoaderWait, Measures, StepTimes
from lightning_diag.rules.memory_growth import MemoryGrowthRule
from lightning_diag.rules.step_time_fluctuation import StepFluctuationRule
from lightning_diag.rules.step_time_periodic import StepPeriodicRule, explained_by_work, pattern_from_start

CTX = StepContext(epoch=0, global_step=100)


def _wait(wait_s, step_s, steps):
    """The measures of one interval's loader wait."""
    return Measures(loader_wait=LoaderWait(wait_s, step_s, steps))


def _times(times, **parts):
    """The measures of a window of step times (and the ``parts`` that explain some)."""
    return Measures(step_times=StepTimes(times, **parts))


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
    fired = [i for i, (w, s) in enumerate(intervals) if rule.judge(CTX, _wait(w * 10, s * 10, 10))]
    assert fired == ([] if fires_at is None else [fires_at])


def test_periodic_rule_names_the_period_and_latches():
    rule = StepPeriodicRule()
    t = np.full(100, 0.02)
    t[4::10] = 0.2
    (alert,) = rule.judge(CTX, _times(t))
    assert alert.value == 10.0 and "every 10 steps" in alert.message and alert.threshold == 0.05
    assert rule.judge(CTX, _times(t)) == []  # latched
    assert rule.judge(CTX, _times(np.full(100, 0.02))) == []  # missed once: the same event
    assert rule.judge(CTX, _times(t)) == []
    assert all(rule.judge(CTX, _times(np.full(100, 0.02))) == [] for _ in range(3))  # cleared on 3 checks
    assert len(rule.judge(CTX, _times(t))) == 1


def test_periodic_rule_ignores_a_cheap_pattern_and_short_windows():
    rule = StepPeriodicRule()
    t = np.full(200, 0.02)
    t[::50] = 0.04  # 2x slow once every 50 steps: 1% of the time
    assert rule.judge(CTX, _times(t)) == []
    t = np.full(40, 0.02)
    t[::5] = 0.2
    t[12] = 0.2  # fewer than MIN_STEPS and one slow step off the pattern: not certain
    assert rule.judge(CTX, _times(t)) == []
    t = np.full(40, 0.02)
    t[::10] = 0.2
    t[20] = 0.02  # a position of the pattern not slow: not certain
    assert rule.judge(CTX, _times(t)) == []


def test_periodic_rule_names_a_certain_pattern_in_a_short_window():
    # issue 23: a stall costing 70% of the time every 10 steps, three times in the 30 steps after the warm-up
    t = np.full(30, 0.01)
    t[9::10] = 0.3
    (alert,) = StepPeriodicRule().judge(CTX, _times(t))
    assert alert.value == 10.0 and "3 times in the last 30 steps" in alert.message
    assert StepPeriodicRule().judge(CTX, _times(t[:20])) == []  # twice is not certain


def test_the_warm_up_gives_way_to_an_overwhelming_stall_pattern():
    # issue 23: a stall costing 70% of the time every 10 steps, twice in the first 20 steps of the fit (nothing
    # after the 20-step warm-up yet): each stall is 24x the median step, together 70% of the time
    run = np.full(20, 0.02)
    run[9::10] = 0.49
    explained = [i == 0 for i in range(20)]
    (alert,) = StepPeriodicRule().judge(CTX, _times([], run_times=run, explained=explained))
    assert alert.value == 10.0 and "2 times in the last 20 steps" in alert.message and "70%" in alert.message
    rule = StepPeriodicRule()
    rule.judge(CTX, _times(run[:0], run_times=run, explained=explained))
    assert rule.last.period == 10
    assert StepPeriodicRule().judge(CTX, _times([])) == []  # without the run's steps: nothing to judge


@pytest.mark.parametrize(
    ("slow", "value", "explain", "found"),
    [
        ((9, 19), 0.49, (), 10),  # twice, 24x the median, 70% of the time
        ((9, 19), 0.15, (), 0),  # twice at 7.5x: not overwhelming
        ((4, 9, 14, 19), 0.05, (), 5),  # four times at 2.5x in step with the start, 18%: certain
        ((4, 9, 14), 0.05, (), 0),  # the position at 19 not slow
        ((9, 19), 0.49, (3,), 10),  # a slow step with a known cause (say after validation) is neutral
        ((9, 19, 3), 0.49, (), 0),  # an unexplained slow step off the pattern
        ((12,), 0.49, (), 0),  # once is no pattern
        ((14, 19), 0.49, (), 0),  # the first stall more than one period after the start
        ((0, 9, 19), 2.0, (0,), 10),  # the run's first step (compilation) is neutral
        ((10, 15), 0.49, (10, 15), 0),  # both slow steps explained (validation, epoch start): nothing
        ((1, 10), 0.49, (), 0),  # the first right after the start (autotuning): a start-up effect, not a pattern
        ((0, 7, 14), 0.49, (0,), 7),  # the first position is the run's (neutral) first step: the rest is certain
        ((7, 14), 0.49, (0,), 7),  # twice, the first step neutral: overwhelming
    ],
)
def test_pattern_from_start(slow, value, explain, found):
    run = np.full(20, 0.02)
    run[list(slow)] = value
    explained = [i in explain for i in range(20)]
    assert pattern_from_start(run, explained).period == found


def test_pattern_from_start_overwhelming_stalls_stand_out_of_a_noisy_machines_jitter():
    run = np.full(20, 0.02)
    run[[9, 19]] = 0.49  # two stalls, 24x the median, 69% of the time
    run[3] = 0.05  # one step 2.5x slow off the pattern (a busy machine)
    assert pattern_from_start(run, [False] * 20).period == 10
    run[3] = 0.3  # an unexplained 15x step off the pattern: no certain pattern
    assert pattern_from_start(run, [False] * 20).period == 0


def test_utilization_dips():
    rule = StepPeriodicRule()
    u = np.full(120, 95.0)
    u[7::12] = 10.0
    (alert,) = rule.judge(CTX, Measures(gpu_utilization=u))
    assert alert.source == "gpu_utilization" and alert.value == 12.0


def test_fluctuation_needs_patience_and_ignores_step_jitter():
    rule = StepFluctuationRule()
    jitter = np.tile([0.01, 0.03], 50)  # single steps vary 3x; every 10-step block is the same
    assert [rule.judge(CTX, Measures(compute_times=jitter)) for _ in range(5)] == [[]] * 5
    drifting = np.repeat([0.01, 0.02] * 5, 10)
    results = [rule.judge(StepContext(0, 100 + 10 * i), Measures(compute_times=drifting)) for i in range(3)]
    assert [len(a) for a in results] == [0, 0, 1]
    # every block moves by 0.01 s around a median of 0.015 s
    assert rule.last_value == pytest.approx(0.01 / (np.sqrt(2) * 0.015)) and results[-1][0].threshold == 0.15


def test_patience_counts_checks_a_block_apart_whatever_the_logging_interval():
    rule = StepFluctuationRule()
    drifting = np.repeat([0.01, 0.02] * 5, 10)
    # logging every 5 steps: checks at 100, 105, ..., the streak grows at 100, 110, 120
    fired = [s for s in range(100, 130, 5) if rule.judge(StepContext(0, s), Measures(compute_times=drifting))]
    assert fired == [120] and rule.streak == 3
    calm = np.repeat([0.01] * 10, 10)
    assert rule.judge(StepContext(0, 125), Measures(compute_times=calm)) == [] and rule.streak == 0


def test_fluctuation_state_round_trips_and_names_a_missing_key():
    rule = StepFluctuationRule()
    rule.judge(StepContext(0, 100), Measures(compute_times=np.repeat([0.01, 0.02] * 5, 10)))
    again = StepFluctuationRule()
    again.load_state_dict(rule.state_dict())
    assert (again.streak, again.counted_at) == (1, 100)
    partial = {k: v for k, v in rule.state_dict().items() if k != "counted_at"}
    with pytest.raises(KeyError, match="'counted_at'"):
        again.load_state_dict(partial)


def test_a_step_time_that_changes_level_once_is_no_fluctuation():
    rule = StepFluctuationRule()
    ramped = np.repeat([0.01] * 10 + [0.02] * 10, 10)  # the batch size doubled half-way through the window
    assert [rule.judge(CTX, Measures(compute_times=ramped)) for _ in range(5)] == [[]] * 5
    assert rule.last_value == 0.0


def test_memory_growth_fires_on_a_leak_not_on_a_plateau():
    rule = MemoryGrowthRule()
    for i in range(7):
        assert rule.judge(CTX, Measures(memory={"host_rss": 1e9 + i * 5e7, "cuda_allocated": 2e9})) == []
    (alert,) = rule.judge(CTX, Measures(memory={"host_rss": 1e9 + 7 * 5e7, "cuda_allocated": 2e9}))
    assert alert.source == "host_rss" and alert.value == pytest.approx(0.35)


def test_rule_state_round_trips():
    rule = MemoryGrowthRule()
    rule.judge(CTX, Measures(memory={"host_rss": 1e9}))
    other = MemoryGrowthRule()
    other.load_state_dict(rule.state_dict())
    assert other.history == {"host_rss": [1e9]}
    with pytest.raises(KeyError, match="history"):
        other.load_state_dict({"latch": []})


def test_dataloader_bound_alerts_once_per_fit_when_the_share_hovers_around_the_threshold():
    # pf_tft in the foreign corpus: ~15 ms of waiting in 55 ms steps (27%), dipping below 25% now and then (a heavy
    # step, a busy machine): one condition, one alert, however long the dips between
    rule = DataloaderBoundRule()
    shares = [0.27] * 4 + [0.2] * 6 + [0.28] * 4 + [0.1] * 10 + [0.3] * 4
    fired = [i for i, s in enumerate(shares) if rule.judge(CTX, _wait(s * 0.05 * 5, 0.05 * 5, 5))]
    assert fired == [2]


def test_a_step_slow_by_its_scheduled_work_is_explained_a_larger_stall_is_not():
    times = np.full(10, 0.004)
    work = np.full(10, 0.0002)
    times[[3, 6]] = [0.009, 0.109]  # 5 ms and 105 ms above the median
    work[[3, 6]] = 0.006  # both carried 6 ms of the diagnostics' and the loggers' work
    assert explained_by_work(times, work).tolist() == [i == 3 for i in range(10)]
    assert not explained_by_work(times, work[:5]).any()  # lengths differ: nothing is explained


@pytest.mark.parametrize(("stall", "fires"), [(0.0, False), (0.1, True)])
def test_the_logging_cadence_is_no_period_unless_a_stall_outgrows_the_work(stall, fires):
    # darts' NBEATS: every 5th step 2-5 ms slower than 4 ms steps, on steps that carried 4-6 ms of the
    # diagnostics' logging work: quiet; 100 ms more on the same steps is a stall
    times = np.full(100, 0.004)
    times[4::5] += 0.005 + stall
    work = np.full(100, 0.0002)
    work[4::5] = 0.006
    alerts = StepPeriodicRule().judge(CTX, _times(times, work=work))
    assert [a.value for a in alerts] == ([5.0] if fires else [])
    assert StepPeriodicRule().judge(CTX, _times(times)), "without the work measured, the cadence is a period"


def test_a_fluctuation_on_a_contended_machine_is_an_info_and_a_warning_once_it_outlasts_the_contention():
    rule = StepFluctuationRule()
    drifting = np.repeat([0.01, 0.02] * 5, 10)

    step = iter(range(100, 1000, 10))

    def judge(pressure):
        return rule.judge(StepContext(0, next(step)), Measures(compute_times=drifting, cpu_pressure=pressure))

    assert [judge(0.5) for _ in range(2)] == [[], []]  # patience holds under contention too
    (info,) = judge(0.5)
    assert (info.severity, info.source) == ("info", "step_time_contended")
    assert "waited for a CPU 50% of the time" in info.message and "look for" not in info.message
    assert judge(0.4) == []  # the same contended event
    (warning,) = judge(0.02)  # the machine is free again and the steps still fluctuate: the run's own
    assert (warning.severity, warning.source) == ("warning", "step_time")
    assert judge(None) == []  # latched; no pressure known judges as on a free machine
    assert judge(0.5) == []  # held as a warning: contention coming back reports nothing new


def test_a_warning_is_not_repeated_as_an_info_when_the_machine_becomes_contended():
    rule = StepPeriodicRule()
    t = np.full(100, 0.02)
    t[4::10] = 0.2
    (warning,) = rule.judge(CTX, Measures(step_times=StepTimes(t), cpu_pressure=0.01))
    assert warning.severity == "warning"
    assert [rule.judge(CTX, Measures(step_times=StepTimes(t), cpu_pressure=0.4)) for _ in range(5)] == [[]] * 5
    assert rule.judge(CTX, Measures(step_times=StepTimes(t), cpu_pressure=0.01)) == []  # contention cleared nothing


@pytest.mark.parametrize(
    ("pressure", "severity"), [(None, "warning"), (0.0, "warning"), (0.05, "warning"), (0.06, "info")]
)
def test_the_contention_line_is_a_share_above_five_percent(pressure, severity):
    rule = StepFluctuationRule(patience=1)
    (alert,) = rule.judge(CTX, Measures(compute_times=np.repeat([0.01, 0.02] * 5, 10), cpu_pressure=pressure))
    assert alert.severity == severity


def test_a_periodic_stall_on_a_contended_machine_is_an_info_and_its_margin_is_not_recorded():
    rule = StepPeriodicRule()
    t = np.full(100, 0.02)
    t[4::10] = 0.2
    (info,) = rule.judge(CTX, Measures(step_times=StepTimes(t), cpu_pressure=0.6))
    assert (info.severity, info.source, info.value) == ("info", "step_time_contended", 10.0)
    assert "waited for a CPU 60% of the time" in info.message
    assert rule.peaks == {}  # the warning's statistic was not in force
    (warning,) = rule.judge(CTX, Measures(step_times=StepTimes(t), cpu_pressure=0.01))
    assert (warning.severity, warning.source) == ("warning", "step_time")


#: What ``step_time_periodic`` judged at step 20 of ``baseline:healthy_train_override:L1:s0`` (one step an epoch,
#: a validation run every 4) while another process pinned to the run's CPU burned 0.1 s every 4th step (CPU
#: pressure 99.8%, other processes 1.57 CPUs): the 20 steps since the fit's start (ms), the scheduled work measured
#: on each (ms), nothing after the 20-step warm-up yet. Before the fix it warned: the window's pressure was not
#: known before the warm-up's end.
CONTENDED_RUN_MS = [30.2, 41.4, 26.1, 31.8, 47.5, 36.0, 36.6, 31.6, 74.9, 30.9,
                    32.2, 32.1, 62.2, 39.8, 33.0, 37.5, 57.3, 32.4, 28.7, 26.0]  # fmt: skip
CONTENDED_WORK_MS = [12.44, 1.0, 0.55, 0.66, 100.9, 12.64, 6.51, 3.32, 0.47, 57.47,
                     11.43, 0.63, 0.4, 0.37, 36.35, 6.88, 20.1, 4.88, 4.59, 44.48]  # fmt: skip


@pytest.mark.parametrize(
    ("run_pressure", "window_pressure", "severity", "source"),
    [
        (0.998, None, "info", "step_time_contended"),  # the warm-up's pressure is the run's: contended
        (0.998, 0.01, "info", "step_time_contended"),  # a later window's pressure does not judge the run's steps
        (0.02, None, "warning", "step_time"),  # the same pattern on a free machine still warns
        (0.02, 0.6, "warning", "step_time"),
        (None, None, "warning", "step_time"),  # no pressure known: judged as on a free machine
    ],
)
def test_a_pattern_since_the_fit_start_is_judged_by_the_pressure_over_those_steps(
    run_pressure, window_pressure, severity, source
):
    run = np.array(CONTENDED_RUN_MS) / 1e3
    times = StepTimes(
        [], run_times=run, explained=[i == 0 for i in range(20)], work=[],
        run_work=np.array(CONTENDED_WORK_MS) / 1e3, run_pressure=run_pressure,
    )  # fmt: skip
    rule = StepPeriodicRule()
    (alert,) = rule.judge(StepContext(19, 20), Measures(step_times=times, cpu_pressure=window_pressure))
    assert (alert.severity, alert.source, alert.value) == (severity, source, 4.0)
    assert "3 times in the last 20 steps" in alert.message
    assert ("waited for a CPU 100% of the time" in alert.message) == (severity == "info")
    assert (rule.peaks == {}) == (severity == "info")  # a contended judgment records no margin


def test_without_an_early_pattern_the_run_pressure_does_not_decide_where_its_end_is_latched():
    """A warning on a free machine, then judgments that find no pattern since the fit's start while the run's
    pressure is high (the window's unknown): the condition's end is latched on ``step_time`` (the run's pressure
    judges only the steps of a pattern it found), so the pattern found again on a free machine warns again."""
    run = np.array(CONTENDED_RUN_MS) / 1e3
    flat = np.full(20, 0.033)

    def judge(rule, step, times, run_pressure):
        t = StepTimes(
            [], run_times=times, explained=[i == 0 for i in range(20)], work=[],
            run_work=np.array(CONTENDED_WORK_MS) / 1e3, run_pressure=run_pressure,
        )  # fmt: skip
        return [(a.severity, a.source) for a in rule.judge(StepContext(step, step + 1), Measures(step_times=t))]

    rule = StepPeriodicRule()
    assert judge(rule, 19, run, 0.02) == [("warning", "step_time")]
    assert [judge(rule, 20 + k, flat, 0.9) for k in range(6)] == [[]] * 6
    assert not rule.latch.holds("step_time")  # the warning's condition ended
    assert judge(rule, 29, run, 0.02) == [("warning", "step_time")]


def test_waiting_for_data_on_a_contended_machine_is_an_info_then_a_warning_of_its_own():
    rule = DataloaderBoundRule()

    def judge(pressure):
        return rule.judge(CTX, Measures(loader_wait=LoaderWait(5.0, 10.0, 10), cpu_pressure=pressure))

    assert [judge(0.3), judge(0.3)] == [[], []]
    (info,) = judge(0.3)
    assert (info.severity, info.source) == ("info", "dataloader_contended")
    assert "waited for a CPU 30% of the time" in info.message and "num_workers" not in info.message
    assert rule.peaks == {}
    (warning,) = judge(None)  # the waiting goes on without contention: the loader's own
    assert (warning.severity, warning.source) == ("warning", "dataloader") and "num_workers" in warning.message
    assert judge(0.0) == []  # once per fit


def test_the_loader_margin_is_what_held_over_the_patience_not_one_interval():
    rule = DataloaderBoundRule()  # patience 3

    def judge(wait_s, pressure=None):
        return rule.judge(CTX, Measures(loader_wait=LoaderWait(wait_s, 10.0, 10), cpu_pressure=pressure))

    judge(9.0)  # one interval waiting 90% (a burst: a collection, another job's start)
    judge(0.5)
    judge(0.5)
    assert rule.peaks["dataloader_bound"] == pytest.approx(0.5 / 10.0 / 0.25)  # 20%: the held excess, not 3.6
    judge(6.0, pressure=0.3)  # contended: in the streak, but its excess not recorded
    judge(6.0)
    assert rule.peaks["dataloader_bound"] == pytest.approx(0.2)  # two intervals of the three held
    (alert,) = judge(6.0)  # the third: the streak holds, and so does the margin
    assert rule.peaks["dataloader_bound"] == pytest.approx(0.6 / 0.25) and alert.severity == "warning"
