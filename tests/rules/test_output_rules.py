"""Unit tests of issue 45's output rules: ``output_collapse``, ``attn_logit_growth`` and ``zero_output``'s signs."""

import math

import pytest

import lightning_diag.rules.catalog  # noqa: F401  (the complete registry)
from lightning_diag.core.registry import parse_rules
from lightning_diag.rules.attention_logits import ATTN_LOGIT_GROWTH, AttentionLogitRule
from lightning_diag.rules.base import StepContext
from lightning_diag.rules.measures import Measures, OutputSpread, ZeroOutputs
from lightning_diag.rules.output_collapse import OUTPUT_COLLAPSE, OutputCollapseRule
from lightning_diag.rules.zero_output import ZeroOutputRule
from lightning_diag.stats.spread import relative_spread


def _ctx(step):
    return StepContext(0, step)


def _spread(spread, level, batch, source):
    """The measures of one sampled output: its spread and level over `batch` samples, from module `source`."""
    return Measures(output_spread=OutputSpread(spread, level, batch, source))


# -- output_collapse ---------------------------------------------------------------------------------------------
def test_relative_spread_is_zero_for_equal_outputs_and_undefined_for_all_zero_ones():
    assert relative_spread(0.0, 0.25) == 0.0
    assert relative_spread(0.5, -0.5) == pytest.approx(0.5)
    assert math.isnan(relative_spread(0.0, 0.0)) and math.isnan(relative_spread(math.nan, 1.0))


def test_collapse_fires_after_patience_consecutive_low_spreads_and_names_the_source():
    rule = OutputCollapseRule(threshold=1e-3, patience=3)
    feed = [(0.3, 0.2), (0.1, 0.2), (0.0, 0.25), (1e-5, 0.25), (0.0, 0.25)]
    out = [rule.judge(_ctx(5 * i), _spread(s, lv, 32, "net")) for i, (s, lv) in enumerate(feed)]
    assert [len(a) for a in out] == [0, 0, 0, 0, 1]
    alert = out[-1][0]
    assert (alert.rule, alert.global_step, alert.source, alert.value) == (OUTPUT_COLLAPSE, 20, "net", 0.0)
    assert "no longer depend on the input" in alert.message and "0.6" in alert.message  # the early value
    assert rule.judge(_ctx(25), _spread(0.0, 0.25, 32, "net")) == []  # one event


def test_a_spread_that_recovers_resets_the_streak():
    rule = OutputCollapseRule(threshold=1e-3, patience=3)
    for i, spread in enumerate((0.0, 0.0, 0.1, 0.0, 0.0)):
        assert rule.judge(_ctx(i), _spread(spread, 1.0, 16, "<root>")) == []
    assert rule.streak == 2


def test_a_spread_hovering_at_the_threshold_is_one_event_until_it_clearly_recovers():
    rule = OutputCollapseRule(threshold=1e-2, patience=3)
    # a batch of two samples: alike outputs whose spread flickers just above the threshold now and then
    hovering = [0.005, 0.004, 0.006, 0.02, 0.003, 0.012, 0.004, 0.005, 0.015, 0.002, 0.003, 0.004]
    fired = [i for i, v in enumerate(hovering) if rule.judge(_ctx(i), _spread(v, 1.0, 2, "<root>"))]
    assert fired == [2]
    recovered = [rule.judge(_ctx(20 + i), _spread(0.5, 1.0, 2, "<root>")) for i in range(5)]  # 2 x patience - 1 above
    assert recovered == [[]] * 5
    again = [i for i in range(3) if rule.judge(_ctx(30 + i), _spread(0.001, 1.0, 2, "<root>"))]
    assert again == [2]  # a new event after a clear recovery


def test_constant_from_the_first_measurement_fires_and_says_so():
    rule = OutputCollapseRule(threshold=1e-3, patience=2)
    rule.judge(_ctx(0), _spread(0.0, 1.0, 8, "<root>"))
    (alert,) = rule.judge(_ctx(5), _spread(0.0, 1.0, 8, "<root>"))
    assert "from the first measurement on" in alert.message


@pytest.mark.parametrize("spread", [0.011, 0.5])
def test_outputs_that_vary_a_little_or_a_lot_stay_quiet_and_report_their_margin(spread):
    rule = OutputCollapseRule()
    assert rule.threshold == 0.01  # the documented default
    for i in range(10):
        assert rule.judge(_ctx(i), _spread(spread, 1.0 - spread, 32, "<root>")) == []
    assert rule.peaks[OUTPUT_COLLAPSE] == pytest.approx(0.01 / spread)  # the calibration harness's margin


def test_batch_of_one_and_all_zero_outputs_are_not_measured():
    rule = OutputCollapseRule(patience=1)
    assert rule.judge(_ctx(0), _spread(0.0, 0.7, 1, "<root>")) == []
    assert rule.judge(_ctx(5), _spread(0.0, 0.0, 32, "<root>")) == []
    assert (rule.unmeasured, rule.checks, rule.streak) == (2, 0, 0)


def test_collapse_state_round_trips_and_settings_are_validated():
    rule = OutputCollapseRule(patience=3)
    for i in range(2):
        rule.judge(_ctx(i), _spread(0.0, 0.5, 32, "<root>"))
    copy = OutputCollapseRule(patience=3)
    copy.load_state_dict(rule.state_dict())
    assert copy.streak == 2 and len(copy.judge(_ctx(3), _spread(0.0, 0.5, 32, "<root>"))) == 1
    built = OutputCollapseRule.from_settings({OUTPUT_COLLAPSE: 0.01, f"{OUTPUT_COLLAPSE}.patience": 5})
    assert (built.threshold, built.patience) == (0.01, 5)
    with pytest.raises(ValueError, match="output_collapse"):
        parse_rules("AnomalyAlarm", {OUTPUT_COLLAPSE: {"threshold": 2.0}})


# -- attn_logit_growth -------------------------------------------------------------------------------------------
def _feed(rule, feed, module):
    """``rule``'s alerts at each of ``feed``'s peak logits of ``module``, one measurement a step."""
    return [rule.judge(_ctx(s), Measures(attention_logit_peaks={module: p})) for s, p in enumerate(feed)]


def test_logit_growth_fires_when_large_and_growing_and_once_per_event():
    rule = AttentionLogitRule(threshold=50.0, growth=1.5, patience=1)
    peaks = [Measures(attention_logit_peaks={"a": p, "b": 8.0}) for p in (2.0, 30.0, 95.0, 180.0, 400.0)]
    out = [rule.judge(_ctx(s), m) for s, m in enumerate(peaks)]
    assert [[(x.rule, x.source, x.global_step) for x in alerts] for alerts in out] == [
        [], [], [(ATTN_LOGIT_GROWTH, "a", 2)], [], []
    ]
    assert "3.17x" in out[2][0].message and "qk-layernorm" in out[2][0].message


def test_large_but_stable_or_slowly_drifting_logits_stay_quiet():
    rule = AttentionLogitRule(threshold=50.0, growth=1.5, patience=1)
    for s, p in enumerate((60.0, 70.0, 65.0, 80.0, 75.0, 90.0, math.nan, 100.0)):
        assert rule.judge(_ctx(s), Measures(attention_logit_peaks={"sharp": p})) == []
    # the margin is the weaker condition while rising, the growth over the largest recent peak: 60 -> 70, 1.17x
    assert rule.peaks[ATTN_LOGIT_GROWTH] == pytest.approx(70.0 / 60.0 / 1.5)


def test_a_scattering_peak_is_judged_against_its_recent_largest_not_the_one_before():
    # Lightning's demo transformer (foreign corpus), encoder layer 0, seed 4, steps 379-424: one-hot attention from
    # init and logits of 400-780 that scatter from batch to batch; the last one is 1.81x the one before it
    scatter = (478.3, 417.9, 492.6, 436.4, 460.2, 515.1, 517.9, 489.4, 395.4, 717.0)
    quiet = AttentionLogitRule(threshold=50.0)
    assert _feed(quiet, scatter, "enc") == [[]] * len(scatter)
    assert quiet.peaks[ATTN_LOGIT_GROWTH] == pytest.approx(717.0 / 517.9 / 2.0)  # 1.38x the largest of 8: 0.69
    # the former judgement (1.5x over the one measurement before) called that scatter a growth
    old = AttentionLogitRule(threshold=50.0, growth=1.5, window=1)
    out = _feed(old, scatter, "enc")
    assert [len(a) for a in out] == [0] * 9 + [1] and "1.81x the largest of its 1" in out[-1][0].message
    # a real growth over the same history fires at once: 3.7x the largest of the 8 before
    grown = AttentionLogitRule(threshold=50.0)
    out = _feed(grown, (*scatter[:-1], 1900.0), "enc")
    assert [len(a) for a in out] == [0] * 9 + [1] and out[-1][0].value == 1900.0


def test_the_window_forgets_a_high_start():
    # logits that fell from 60 to 20 and then grow: the reference is the largest of the last `window` peaks only
    rule = AttentionLogitRule(threshold=50.0, window=4)
    feed = (60.0, 40.0, 20.0, 21.0, 20.0, 19.0, 70.0)
    out = _feed(rule, feed, "m")
    assert [len(a) for a in out] == [0] * 6 + [1]
    assert "3.33x the largest of its 4 measurement(s) up to 1 before (21;" in out[-1][0].message
    sticky = AttentionLogitRule(threshold=50.0, window=8)  # 60 is still within its window: 70 is 1.17x it
    assert _feed(sticky, feed, "m") == [[]] * len(feed)


def test_the_window_is_a_declared_setting():
    built = AttentionLogitRule.from_settings({ATTN_LOGIT_GROWTH: 50.0, f"{ATTN_LOGIT_GROWTH}.window": 3})
    assert (built.window, built.patience, built.growth) == (3, 1, 2.0)
    assert AttentionLogitRule.from_settings({ATTN_LOGIT_GROWTH: 50.0}).window == 8
    with pytest.raises(ValueError, match="window"):
        parse_rules("AttentionEntropyMonitor", {ATTN_LOGIT_GROWTH: {"window": 0}})


def test_growth_below_the_level_stays_quiet_and_patience_needs_steady_growth():
    rule = AttentionLogitRule(threshold=50.0)
    peaks = [Measures(attention_logit_peaks={"m": p}) for p in (1.0, 4.0, 16.0, 40.0)]
    assert all(rule.judge(_ctx(s), m) == [] for s, m in enumerate(peaks))
    slow = AttentionLogitRule(threshold=50.0, growth=2.0, patience=2)
    feed = (30.0, 50.0, 45.0, 90.0, 130.0)  # a dip breaks the run; 45 -> 90 -> 130 is 2.6x the 50 before it
    out = _feed(slow, feed, "m")
    assert [len(a) for a in out] == [0, 0, 0, 0, 1]
    higher = AttentionLogitRule(threshold=50.0, growth=2.0, patience=2)  # 70 before the dip: 130 is 1.86x it
    assert _feed(higher, (30.0, 70.0, 45.0, 90.0, 130.0), "m") == [[]] * 5


def test_logit_rule_state_round_trips():
    rule = AttentionLogitRule(threshold=50.0)
    rule.judge(_ctx(0), Measures(attention_logit_peaks={"m": 30.0}))
    copy = AttentionLogitRule.from_settings({ATTN_LOGIT_GROWTH: 50.0})
    copy.load_state_dict(rule.state_dict())
    assert [a.source for a in copy.judge(_ctx(1), Measures(attention_logit_peaks={"m": 60.0}))] == ["m"]


# -- zero_output: only modules whose outputs had both signs are judged --------------------------------------------
def test_zero_output_skips_rectifier_outputs_when_signs_are_known():
    rule = ZeroOutputRule(history=2)
    ran = ["relu", "linear"]
    for s in range(3):
        assert rule.judge(_ctx(s), Measures(zero_outputs=ZeroOutputs(ran, [], ["linear"]))) == []
    alerts = rule.judge(_ctx(3), Measures(zero_outputs=ZeroOutputs(ran, ["relu", "linear"], [])))
    assert [a.source for a in alerts] == ["linear"]
    assert rule.signed == ["linear"]
    unsigned = ZeroOutputRule(history=2)  # signs not measured: every module judged, as before
    for s in range(3):
        unsigned.judge(_ctx(s), Measures(zero_outputs=ZeroOutputs(ran, [])))
    alerts = unsigned.judge(_ctx(3), Measures(zero_outputs=ZeroOutputs(ran, ["relu"])))
    assert sorted(a.source for a in alerts) == ["relu"]
