"""The calibration harness (benchmarks/calibration.py, issue 44): the table's maths on synthetic records, the plan,
the cache, and the CI subset run for real (its healthy runs quiet, its faults caught, its table well-formed)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from benchmarks import calibration as cal
from benchmarks.calibration_plan import EPOCH_LENGTHS, plan, twin_of
from tests.foreign.corpus import TIMING_RULES


def _record(
    key: str,
    expected: tuple[str, ...] = (),
    alerts: tuple[tuple[str, str, int, int], ...] = (),
    peaks: dict[str, float] | None = None,
    watched: tuple[str, ...] = ("grad_explode", "loss_swing"),
    **spec: Any,
) -> dict[str, Any]:
    base = {"key": key, "kind": "fault", "name": "none", "family": "baselines", "expected": list(expected),
            "onset_step": None, "onset_epoch": None, "epoch_len": None, "length_check": False}  # fmt: skip
    return {
        "spec": {**base, **spec},
        "measure_every": 5,
        "alerts": [{"rule": r, "severity": s, "step": st, "epoch": ep, "value": 1.0} for r, s, st, ep in alerts],
        "peaks": peaks or {},
        "watched": list(watched),
    }


def test_delay_counts_measurements_from_the_onset_both_included() -> None:
    step = _record("f", onset_step=30)
    assert cal.delay(step, {"step": 30, "epoch": 0}) == (1, "measurements")
    assert cal.delay(step, {"step": 34, "epoch": 0}) == (1, "measurements")
    assert cal.delay(step, {"step": 35, "epoch": 0}) == (2, "measurements")
    assert cal.delay(_record("g", onset_step=0), {"step": 4, "epoch": 0}) == (1, "measurements")
    assert cal.delay(_record("e", onset_epoch=1), {"step": 90, "epoch": 4}) == (4, "epochs")
    assert cal.delay(_record("h"), {"step": 3, "epoch": 0}) is None


def test_rule_row_counts_false_alarms_catches_delays_and_the_margin() -> None:
    records = [
        _record("h1", peaks={"grad_explode": 0.4}),
        _record("h2", peaks={"grad_explode": 0.7}, alerts=(("grad_explode", "info", 10, 0),)),  # info: no alarm
        _record("h3", peaks={"grad_explode": 1.5}, alerts=(("grad_explode", "warning", 12, 0),)),
        _record("h4", watched=("loss_swing",)),  # the rule's callback not attached: not seen
        _record("f1", ("grad_explode",), (("grad_explode", "warning", 44, 1),), onset_step=30, family="faults"),
        _record("f2", ("grad_explode",), (("grad_explode", "warning", 20, 0),), onset_step=30, family="faults"),
        _record("f3", ("grad_explode",), (("grad_explode", "warning", 30, 0),), onset_step=30, family="faults"),
        {"spec": {"key": "crash", "expected": [], "family": "baselines"}, "error": "RuntimeError: boom"},
    ]
    row = cal.rule_row("grad_explode", records)
    assert row["healthy"] == 3 and row["measured"] == 3
    assert row["false_alarm_runs"] == ["h3"]
    # f2's alert came before the onset: not a catch
    assert (row["faults"], row["caught"], row["missed"]) == (3, 2, ["f2"])
    assert (row["delay_median"], row["delay_worst"], row["delay_unit"]) == (2.0, 3, "measurements")
    assert (row["margin"], row["margin_run"]) == (1.5, "h3")


def test_rule_row_without_runs_reports_nothing_measured() -> None:
    row = cal.rule_row("loss_swing", [_record("h1", peaks={"grad_explode": 0.2})])
    assert row["healthy"] == 1 and row["measured"] == 0 and row["margin"] is None
    assert row["faults"] == 0 and row["delay_median"] is None


def test_length_check_needs_the_fault_caught_and_its_twin_quiet() -> None:
    twin = twin_of("explode")
    assert twin == "healthy_sgd"  # its description names `explode`
    assert twin_of("swing") == "healthy_regression"  # no named twin: the plainest healthy MLP
    records = [
        _record("t4", name=twin, epoch_len=4, length_check=True),
        _record(
            "f4",
            ("grad_explode",),
            (("grad_explode", "warning", 5, 0),),
            onset_step=0,
            name="explode",
            epoch_len=4,
            length_check=True,
        ),
        _record("t16", name=twin, epoch_len=16, length_check=True, alerts=(("grad_explode", "warning", 9, 0),)),
        _record("f16", ("grad_explode",), onset_step=0, name="explode", epoch_len=16, length_check=True),
        _record(
            "f64",
            ("grad_explode",),
            (("grad_explode", "critical", 5, 0),),
            onset_step=0,
            name="explode",
            epoch_len=64,
            length_check=True,
        ),
    ]
    check = cal.length_check("grad_explode", records)
    assert check == {"1": "-", "4": "ok", "16": "missed, twin fired", "64": "no twin", "256": "-"}


def test_render_is_a_well_formed_table_with_the_reasons() -> None:
    records = [
        _record("h1", peaks={"grad_explode": 0.25}),
        _record("f1", ("grad_explode",), (("grad_explode", "warning", 34, 1),), onset_step=30, family="faults"),
    ]
    rows = cal.table(records, ["grad_explode", "grad_frozen"])
    text = cal.render(rows, {"grad_explode": 10.0, "grad_frozen": None})
    lines = text.splitlines()
    columns = 7 + len(EPOCH_LENGTHS)
    assert all(cal.is_table_line(line, columns) for line in lines), text
    assert "0.25 (`h1`)" in lines[2] and "1 / 1" in lines[2] and "1 / 1 measurements" in lines[2]
    assert f"n/a: {cal.NO_THRESHOLD}" in lines[3] and "no fault in the matrices" in lines[3]
    assert not cal.is_table_line("| a | b", 2) and not cal.is_table_line("| a | b |", 3)


def test_load_cache_resumes_and_ignores_a_torn_line(tmp_path: Any) -> None:
    path = tmp_path / "runs.jsonl"
    path.write_text(json.dumps(_record("a")) + "\n" + json.dumps(_record("b")) + "\n" + '{"spec": {"ke')
    assert sorted(cal.load_cache(str(path))) == ["a", "b"]
    assert cal.load_cache(str(tmp_path / "missing.jsonl")) == {}


def test_plan_enumerates_the_libraries_and_rejects_an_unknown_subset() -> None:
    from benchmarks.calibration_probes import TASKS
    from lightning_diag.demo.corpus import CORPUS
    from lightning_diag.demo.faults import FAULTS
    from lightning_diag.demo.schedules import SCENARIOS
    from tests.foreign.corpus import ENTRIES

    full = plan("full")
    names = {(s.kind, s.name) for s in full}
    assert {("fault", f) for f in FAULTS} <= names
    assert {("corpus", c) for c in CORPUS} <= names
    assert {("schedule", s) for s in SCENARIOS} <= names and {("foreign", e) for e in ENTRIES} <= names
    assert {("probe", t) for t in TASKS} <= names
    # the opt-in probes that read predictions have healthy runs and faults of their own
    probed = [s for s in full if "ErrorAnalysis" in s.optin and "RobustnessProbe" in s.optin]
    assert sum(s.healthy for s in probed) >= 9
    assert {r for s in probed for r in s.expected} == {"error_cluster", "robustness_drop"}
    assert sum(s.healthy for s in full) >= 200
    lengths = {s.epoch_len for s in full if s.healthy and s.family == "baselines"}
    assert set(EPOCH_LENGTHS) <= lengths
    ci = plan("ci")
    assert {s.key for s in ci} < {s.key for s in full} and any(s.healthy for s in ci) and any(s.expected for s in ci)
    with pytest.raises(ValueError, match="subset"):
        plan("most")


def test_every_rule_of_the_registry_has_a_fault_in_the_full_plan() -> None:
    """Issue 44's "every fault caught, with its delay" needs a fault per rule: the matrices' faults, the probes'
    and the rule faults of ``benchmarks/calibration_faults.py``; the rules without one say why."""
    from benchmarks.calibration_faults import FAULTS, NO_FAULT, callbacks_for
    from lightning_diag.rules.catalog import ALL_RULES

    full = plan("full")
    faulted = {rule for s in full for rule in s.expected}
    assert faulted <= set(ALL_RULES)
    assert set(ALL_RULES) - faulted == set(NO_FAULT), sorted(set(ALL_RULES) - faulted - set(NO_FAULT))
    assert all(reason for reason in NO_FAULT.values()) and not set(NO_FAULT) & faulted
    rulefaults = [s for s in full if s.kind == "rulefault"]
    assert {s.name for s in rulefaults} == set(FAULTS)
    assert {(s.name, s.seed) for s in rulefaults} == {(name, seed) for name in FAULTS for seed in (0, 1)}
    # each has an onset (its delay is measured), is a fault of the "faults" family and expects a registry rule
    assert all((s.onset_step is None) != (s.onset_epoch is None) for s in rulefaults)
    assert all(s.family == "faults" and s.expected for s in rulefaults)
    assert 1 <= sum(s.kind == "rulefault" for s in plan("ci")) <= 2
    # each attaches the callback that owns its rule (a subclass counts, as in the harness's `watched`)
    for name, fault in FAULTS.items():
        owners = {k.__name__ for cb in callbacks_for(name) for k in type(cb).__mro__}
        assert {ALL_RULES[rule] for rule in fault.expected} <= owners, name


@pytest.mark.slow
def test_ci_subset_runs_quiet_healthy_runs_and_catches_its_faults(tmp_path: Any) -> None:
    cache, page, summary = tmp_path / "ci.jsonl", tmp_path / "calibration.md", tmp_path / "ci.json"
    assert cal.main(["--subset", "ci", "--cache", str(cache), "--write", str(page), "--json", str(summary)]) == 0
    records = [json.loads(line) for line in cache.read_text().splitlines()]
    assert len(records) == len(plan("ci")) and not [r["spec"]["key"] for r in records if "error" in r]
    healthy = [r for r in records if not r["spec"]["expected"]]
    # SystemMonitor's wall-clock rules follow the machine's load, not the model: listed, not asserted
    alarms = {r["spec"]["key"]: [a["rule"] for a in cal.serious(r) if a["rule"] not in TIMING_RULES] for r in healthy}
    assert not any(alarms.values()), alarms
    missed = [
        (r["spec"]["key"], rule) for r in records for rule in r["spec"]["expected"] if not cal.first_alert(r, rule)
    ]
    assert not missed
    text = page.read_text()
    assert text.startswith(cal.START) and text.rstrip().endswith(cal.END)
    tables = [line for line in text.splitlines() if line.startswith("| `")]
    assert len(tables) == len(json.loads(summary.read_text())["rules"])
    assert all(cal.is_table_line(line, 7 + len(EPOCH_LENGTHS)) for line in tables)


def test_rules_note_their_statistic_against_their_threshold() -> None:
    """The margin's source: a rule's ``peaks`` hold its statistic's largest excess (``Rule.observe``), 1.0 at the
    threshold, whether or not it alerted."""
    from lightning_diag.rules.base import StepContext
    from lightning_diag.rules.grad_collapse import GradCollapseRule
    from lightning_diag.rules.grad_norm_band import GradBandRule
    from lightning_diag.rules.measures import Measures
    from lightning_diag.rules.memory_growth import MemoryGrowthRule

    band = GradBandRule(patience=3, warmup_steps=0)
    def grads(rms: dict[str, float], w2: float) -> Measures:
        return Measures(grad_rms=rms, grad_relative={"w1": 1e-2, "w2": w2})

    band.judge(StepContext(0, 60), grads({"w1": 5.0, "w2": 0.5}, 5e-4))
    # explode: 5 against 10; vanish needs 3 measurements: none decided yet
    assert band.peaks == {"grad_explode": pytest.approx(0.5), "grad_vanish": 0.0}
    for step in (65, 70):
        band.judge(StepContext(0, step), grads({"w1": 5.0, "w2": 0.5}, 5e-4))
    # vanish: w2 is 2x below 1e-3 but only 0.2 of the way to 100x below the best-fed 1e-2, on all 3
    assert band.peaks == {"grad_explode": pytest.approx(0.5), "grad_vanish": pytest.approx(0.2)}
    fed = [(1e-7, 75), (5e-4, 80)]
    alerts = [a for w2, t in fed for a in band.judge(StepContext(0, t), grads({"w1": 5.0}, w2))]
    # one measurement past every bound (1e-7: 1e4x below 1e-3) among ones that are not: the window's weakest decides
    assert alerts == [] and band.peaks["grad_vanish"] == pytest.approx(0.2)
    starved = GradBandRule(patience=3, warmup_steps=0)
    # w2's update keeps pace: far from a vanishing gradient
    starved.judge(StepContext(0, 55), Measures(update_ratios={"w1": 1e-3, "w2": 1e-3}))
    for step in (60, 65, 70):
        starved.judge(StepContext(0, step), grads({"w1": 1.0}, 5e-4))
    assert starved.peaks["grad_vanish"] == pytest.approx(0.01)  # its update 100x short of 100x below the top
    collapse = GradCollapseRule(patience=3, baseline_measurements=1)
    assert collapse.judge(StepContext(0, 0), Measures(grad_norm=1.0)) == []
    norms = [Measures(grad_norm=n) for n in (0.005, 0.005, 0.02)]
    assert [a for i, m in enumerate(norms) for a in collapse.judge(StepContext(0, 5 + i), m)] == []
    # past its threshold twice, not on 3 consecutive measurements: the margin is the window's weakest, 0.01 / 0.02
    assert collapse.peaks == {"grad_collapse": pytest.approx(0.5)}
    memory = MemoryGrowthRule(threshold=0.1, window=3, rising_fraction=0.5)
    for i, value in enumerate([100.0, 102.0, 104.0]):
        memory.judge(StepContext(0, i), Measures(memory={"host_rss": value}))
    assert memory.peaks["memory_growth"] == pytest.approx(0.4, rel=0.05)  # grew 4% against 10%


def test_the_quiet_set_holds_what_the_wall_clock_rules_judge() -> None:
    long_run = {**_record("long"), "steps": cal.QUIET_MIN_STEPS}
    short_run = {**_record("short"), "steps": cal.QUIET_MIN_STEPS - 1}
    loader_bound = {**_record("loader"), "steps": 10, "oracle": {"dataloader_bound": {"share": 0.8, "data_s": 0.02}}}
    loader_near = {**_record("near"), "steps": 10, "oracle": {"dataloader_bound": {"share": 0.22, "data_s": 0.02}}}
    loader_quiet = {**_record("fast"), "steps": 10, "oracle": {"dataloader_bound": {"share": 0.1, "data_s": 0.02}}}
    timing_fault = _record("stall", (sorted(TIMING_RULES)[0],), family="faults")
    other_fault = _record("nan", ("nonfinite_loss",), family="faults")
    crashed = {**_record("crashed"), "steps": 500, "error": "RuntimeError"}
    records = [long_run, short_run, loader_bound, loader_near, loader_quiet, timing_fault, other_fault, crashed]
    assert cal.quiet_set(records) == ["long", "loader", "near", "stall"]
