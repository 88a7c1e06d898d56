"""The calibration harness (issue 44): every rule's false alarms and margin on a large healthy set, and its catches
and detection delay on every fault, per rule in one table.

    PYTHONPATH=. .venv/bin/python benchmarks/calibration.py --subset ci               # ~2-3 min on 2 cores
    PYTHONPATH=. .venv/bin/python benchmarks/calibration.py --jobs 2 --write docs/calibration.md   # the full set
    PYTHONPATH=. .venv/bin/python benchmarks/calibration.py --rules grad_vanish,loss_swing --cache runs.jsonl

The runs (:mod:`benchmarks.calibration_plan`) are trained ``--jobs`` at a time (processes, one torch thread
each); each record is appended to the ``--cache`` JSON-lines file as it finishes, so an interrupted run resumes
where it stopped (delete the file, or pass another, to start over). The output is a markdown table per rule
(``--write`` puts it between the markers of a page, or writes the page) and a JSON summary (``--json``).

Per rule:

* **healthy runs**: the healthy runs whose callbacks include the rule's owner (and how many of them measured its
  statistic);
* **false alarms**: the healthy runs where it raised a warning or a critical; for a rule with an oracle
  (:mod:`benchmarks.calibration_oracle`: ``dataloader_bound``, whose alarm on a healthy run may be true), only
  those the oracle measured quiet; the runs it measured past the threshold by a clear margin are findings to catch
  (caught or missed, in the faults-caught cell and a note under the table), those near it count neither way;
* **faults caught**: the fault runs that expect it, and those where it fired at or after the onset;
* **delay**: median and worst, in the rule's measurements from the onset to its first alert. Step faults count
  the logging steps (``log_every_n_steps=5``: the gradient, attention, update and data rules measure there) from
  the onset to the alert, both included; epoch faults count epochs (the loss rules' points; the validation rules'
  runs, one per epoch there), the onset's included;
* **margin**: the largest excess its statistic reached on a healthy run (``Rule.observe``: 1.0 is the threshold;
  0.5 half-way there), with the run; "n/a" with the reason where the rule has no single threshold;
* **per epoch length**: at 1, 4, 16, 64 and 256 steps an epoch, whether the rule's faults fired it and their
  healthy twins stayed quiet (``ok``), or what failed.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import os
import statistics
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.calibration_oracle import AMBIGUOUS, ORACLES, TRUE_FACTOR, TRUE_FINDING, oracle_excess, verdict
from benchmarks.calibration_plan import EPOCH_LENGTHS, FAMILIES, RunSpec, execute, plan, twin_of
from lightning_diag.rules.dataloader_bound import DATALOADER_BOUND
from tests.foreign.corpus import TIMING_RULES

START, END = "<!-- calibration:start -->", "<!-- calibration:end -->"
SERIOUS = ("warning", "critical")
#: Why a rule's statistic has no single threshold to measure a margin against.
NO_THRESHOLD = "an event, not a statistic against a threshold"


# ------------------------------------------------------------------------------------------- the maths


def first_alert(record: Mapping[str, Any], rule: str) -> Mapping[str, Any] | None:
    """The rule's first warning/critical alert at or after the record's onset (any, for a run without one)."""
    spec = record["spec"]
    for a in record.get("alerts", []):
        if a["rule"] != rule or a["severity"] not in SERIOUS:
            continue
        if spec.get("onset_step") is not None and a["step"] < spec["onset_step"]:
            continue
        if spec.get("onset_epoch") is not None and a["epoch"] < spec["onset_epoch"]:
            continue
        return a
    return None


def delay(record: Mapping[str, Any], alert: Mapping[str, Any]) -> tuple[int, str] | None:
    """``(measurements, unit)`` from the record's onset to ``alert``, both included; ``None`` without an onset.

    Example:
        >>> rec = {"spec": {"onset_step": 30, "onset_epoch": None}, "measure_every": 5}
        >>> delay(rec, {"step": 34, "epoch": 1}), delay(rec, {"step": 40, "epoch": 2})
        ((1, 'measurements'), (3, 'measurements'))
        >>> delay({"spec": {"onset_step": None, "onset_epoch": 1}}, {"step": 70, "epoch": 4})
        (4, 'epochs')
    """
    spec = record["spec"]
    if spec.get("onset_step") is not None:
        every = int(record.get("measure_every", 5))
        first = -(-int(spec["onset_step"]) // every)
        return max(1, int(alert["step"]) // every - first + 1), "measurements"
    if spec.get("onset_epoch") is not None:
        return int(alert["epoch"]) - int(spec["onset_epoch"]) + 1, "epochs"
    return None


def serious(record: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The record's warning and critical alerts."""
    return [a for a in record.get("alerts", []) if a["severity"] in SERIOUS]


def infos(record: Mapping[str, Any], rule: str) -> list[Mapping[str, Any]]:
    """The ``info`` alerts of ``rule`` on a record (a wall-clock rule's finding on a contended machine)."""
    return [a for a in record.get("alerts", []) if a["rule"] == rule and a["severity"] == "info"]


def false_alarms(record: Mapping[str, Any], rule: str) -> list[Mapping[str, Any]]:
    """The warning/critical alerts of ``rule`` on a healthy record."""
    return [a for a in serious(record) if a["rule"] == rule]


def _threshold(rule: str) -> float | None:
    from lightning_diag.core.registry import RULES

    return RULES[rule].threshold if rule in RULES else None


def rule_row(rule: str, records: Sequence[Mapping[str, Any]], threshold: float | None = None) -> dict[str, Any]:
    """The table row of ``rule`` over ``records`` (crashed runs excluded; they are listed apart).

    For a rule with an oracle (:mod:`benchmarks.calibration_oracle`), the healthy runs it measured loader-bound by
    a clear margin (``true finding``) are findings: an alarm there is a detection (``oracle_caught``), no alarm a
    miss (``oracle_missed``); the ``ambiguous`` ones count neither way; both are left out of the false alarms and
    of the margin. ``threshold``: the rule's (default: the registry's).
    """
    done = [r for r in records if "error" not in r]
    healthy = [r for r in done if not r["spec"]["expected"] and rule in r.get("watched", [])]
    if threshold is None:
        threshold = _threshold(rule)
    verdicts = {r["spec"]["key"]: verdict(r, rule, threshold) for r in healthy}
    found = [r for r in healthy if verdicts[r["spec"]["key"]] == TRUE_FINDING]
    unclear = [r for r in healthy if verdicts[r["spec"]["key"]] == AMBIGUOUS]
    quiet = [r for r in healthy if r not in found and r not in unclear]
    measured = [r for r in healthy if rule in r.get("peaks", {})]
    alarms = [r for r in quiet if false_alarms(r, rule)]
    faults = [r for r in done if rule in r["spec"]["expected"]]
    delays: list[int] = []
    units: set[str] = set()
    caught = []
    for r in faults:
        a = first_alert(r, rule)
        if a is None:
            continue
        caught.append(r)
        d = delay(r, a)
        if d is not None:
            delays.append(d[0])
            units.add(d[1])
    margin = max(((r["peaks"][rule], r["spec"]["key"]) for r in measured if r in quiet), default=None)
    return {
        "rule": rule,
        "healthy": len(healthy),
        "measured": len(measured),
        "false_alarm_runs": [r["spec"]["key"] for r in alarms],
        "false_alarm_values": [next(a.get("value") for a in false_alarms(r, rule)) for r in alarms],
        "faults": len(faults),
        "caught": len(caught),
        "missed": [r["spec"]["key"] for r in faults if r not in caught],
        "delay_median": statistics.median(delays) if delays else None,
        "delay_worst": max(delays) if delays else None,
        "delay_unit": "/".join(sorted(units)),
        "margin": None if margin is None else margin[0],
        "margin_run": None if margin is None else margin[1],
        "lengths": length_check(rule, done),
        "oracle": None if rule not in ORACLES else oracle_counts(rule, threshold, found, unclear, verdicts, healthy),
    }


def oracle_counts(
    rule: str,
    threshold: float | None,
    found: Sequence[Mapping[str, Any]],
    unclear: Sequence[Mapping[str, Any]],
    verdicts: Mapping[str, str | None],
    healthy: Sequence[Mapping[str, Any]],
) -> dict[str, Any]:
    """The oracle's part of a row: the healthy runs it measured, its true findings caught, said as an ``info``
    (``contended``: the rule's finding on a machine other processes kept busy, the wall-clock rules' way of not
    blaming the run for the machine's load; counted neither way, the quiet run judges them) and missed, its
    ambiguous runs, and its excess per measured run."""
    said = [r for r in found if not false_alarms(r, rule) and infos(r, rule)]
    return {
        "measured": sum(verdicts[r["spec"]["key"]] is not None for r in healthy),
        "caught": [r["spec"]["key"] for r in found if false_alarms(r, rule)],
        "contended": [r["spec"]["key"] for r in said],
        "missed": [r["spec"]["key"] for r in found if not false_alarms(r, rule) and r not in said],
        "ambiguous": [r["spec"]["key"] for r in unclear],
        "excess": {r["spec"]["key"]: oracle_excess(r, rule, threshold) for r in healthy if verdicts[r["spec"]["key"]]},
    }


def length_check(rule: str, records: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    """Per epoch length: ``"ok"`` (every fault of the rule at that length fired it, every healthy twin stayed
    quiet of it), the failures (``"missed"``, ``"twin fired"``), or ``"-"`` where no fault of the rule runs."""
    checked = [r for r in records if r["spec"].get("length_check")]
    out: dict[str, str] = {}
    for length in EPOCH_LENGTHS:
        at = [r for r in checked if r["spec"].get("epoch_len") == length]
        faults = [r for r in at if rule in r["spec"]["expected"]]
        if not faults:
            out[str(length)] = "-"
            continue
        twins = {twin_of(r["spec"]["name"]) for r in faults if r["spec"]["kind"] == "fault"}
        quiet_twins = [r for r in at if not r["spec"]["expected"] and r["spec"]["name"] in twins]
        problems = []
        if any(first_alert(r, rule) is None for r in faults):
            problems.append("missed")
        if any(false_alarms(r, rule) for r in quiet_twins):
            problems.append("twin fired")
        if len({r["spec"]["name"] for r in quiet_twins}) < len(twins):
            problems.append("no twin")
        out[str(length)] = ", ".join(problems) or "ok"
    return out


def table(records: Sequence[Mapping[str, Any]], rules: Iterable[str]) -> list[dict[str, Any]]:
    """One row per rule, in ``rules`` order."""
    return [rule_row(rule, records) for rule in rules]


# ------------------------------------------------------------------------------------------- rendering


def _margin_cell(row: Mapping[str, Any], has_threshold: bool) -> str:
    if not has_threshold:
        return f"n/a: {NO_THRESHOLD}"
    if row["margin"] is None:
        return "n/a: not measured on a healthy run" if row["healthy"] else "n/a: no healthy run watched it"
    return f"{row['margin']:.3g} (`{row['margin_run']}`)"


def _delay_cell(row: Mapping[str, Any]) -> str:
    if row["delay_median"] is None:
        return "-"
    unit = row["delay_unit"] or "measurements"
    return f"{row['delay_median']:g} / {row['delay_worst']} {unit}"


def _oracle_cell(row: Mapping[str, Any]) -> str:
    """What the faults-caught cell adds for a rule with an oracle: its true findings on healthy runs caught."""
    oracle = row.get("oracle")
    if not oracle or not oracle["measured"]:
        return ""
    contended = oracle.get("contended", [])
    found = len(oracle["caught"]) + len(oracle["missed"]) + len(contended)
    if not found:
        return "; no healthy run the oracle finds"
    text = f"{len(oracle['caught'])} / {found} healthy runs the oracle finds"
    if contended:
        text += f" ({len(contended)} said as an info on a contended machine)"
    if oracle["missed"]:
        text = f"**{text}** (missed: {', '.join(f'`{k}`' for k in oracle['missed'][:3])})"
    return f"; {text}"


def _oracle_runs(
    keys: Sequence[str], rule: str, excess: Mapping[str, float], by_key: Mapping[str, Mapping[str, Any]]
) -> str:
    """The runs ``keys``, each with the oracle's excess and share and the rule's own peak excess."""
    out = []
    for key in keys:
        measured = by_key[key]["oracle"][rule]
        peak = by_key[key].get("peaks", {}).get(rule)
        out.append(
            f"`{key}` (oracle {excess[key]:.2f}: share {measured['share']:.0%}, {measured['data_s'] * 1e3:.1f} ms"
            " of data a step; the rule's peak " + ("not measured" if peak is None else f"{peak:.2f}") + ")"
        )
    return ", ".join(out) or "none"


def oracle_note(rows: Sequence[Mapping[str, Any]], records: Sequence[Mapping[str, Any]]) -> list[str]:
    """A paragraph per rule of ``rows`` with an oracle: how many healthy runs it measured, its true findings (caught
    or missed) and its ambiguous runs, each with the oracle's share and the rule's own peak excess."""
    by_key = {r["spec"]["key"]: r for r in records}
    lines: list[str] = []
    for row in rows:
        oracle = row.get("oracle")
        if not oracle or not oracle["measured"]:
            continue
        rule = row["rule"]
        contended = oracle.get("contended", [])
        found = [*oracle["caught"], *contended, *oracle["missed"]]
        lines += [
            f"Oracle of `{rule}` (`benchmarks/calibration_oracle.py`, measured without lightning_diag after each"
            f" fit): {oracle['measured']} of {row['healthy']} healthy runs measured. Above {TRUE_FACTOR:g}x the"
            f" threshold (a true finding: an alarm is a detection, no alarm a miss): {len(found)}, caught"
            f" {len(oracle['caught'])}, said as an info on a contended machine {len(contended)}:"
            f" {_oracle_runs(found, rule, oracle['excess'], by_key)}. Within"
            f" {TRUE_FACTOR:g}x of it either way (ambiguous, counted neither way): {len(oracle['ambiguous'])}:"
            f" {_oracle_runs(oracle['ambiguous'], rule, oracle['excess'], by_key)}. The others are quiet by the"
            " oracle: an alarm there is a false alarm, and the margin is theirs.",
            "",
        ]
    return lines


def render(rows: Sequence[Mapping[str, Any]], thresholds: Mapping[str, float | None]) -> str:
    """The markdown table of ``rows`` (``thresholds``: each rule's default, ``None`` for a rule without one)."""
    head = [
        "rule",
        "threshold",
        "healthy runs (measured)",
        "runs with a false alarm",
        "faults caught",
        "delay median / worst",
        "margin (run)",
        *(f"L={n}" for n in EPOCH_LENGTHS),
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        rule = row["rule"]
        thr = thresholds.get(rule)
        alarms = str(len(row["false_alarm_runs"]))
        if row["false_alarm_runs"]:
            shown = ", ".join(f"`{k}`" for k in row["false_alarm_runs"][:4])
            more = f" and {len(row['false_alarm_runs']) - 4} more" if len(row["false_alarm_runs"]) > 4 else ""
            alarms = f"**{alarms}**: {shown}{more}"
        caught = f"{row['caught']} / {row['faults']}" if row["faults"] else "no fault in the matrices"
        if row["missed"]:
            caught = f"**{caught}** (missed: {', '.join(f'`{k}`' for k in row['missed'][:3])})"
        caught += _oracle_cell(row)
        cells = [
            f"`{rule}`",
            "-" if thr is None else f"{thr:g}",
            f"{row['healthy']} ({row['measured']})",
            alarms,
            caught,
            _delay_cell(row),
            _margin_cell(row, thr is not None),
            *(row["lengths"][str(n)] for n in EPOCH_LENGTHS),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def is_table_line(line: str, columns: int) -> bool:
    """Whether ``line`` is a markdown table row (or the header's separator) of ``columns`` cells."""
    return line.startswith("|") and line.endswith("|") and line.count("|") == columns + 1


def summary(records: Sequence[Mapping[str, Any]], rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Counts over the records: healthy runs per family, fault runs, crashes, seconds."""
    done = [r for r in records if "error" not in r]
    families: dict[str, int] = {}
    for r in done:
        if not r["spec"]["expected"]:
            families[r["spec"]["family"]] = families.get(r["spec"]["family"], 0) + 1
    return {
        "healthy_runs": sum(families.values()),
        "families": families,
        "fault_runs": sum(1 for r in done if r["spec"]["expected"]),
        "crashed": {r["spec"]["key"]: r["error"] for r in records if "error" in r},
        "run_seconds": round(sum(float(r.get("seconds", 0.0)) for r in records), 1),
        "rules": list(rows),
    }


# ------------------------------------------------------------------------------------------- running


def load_cache(path: str) -> dict[str, dict[str, Any]]:
    """The records already in the JSON-lines ``path``, by run key (a torn last line is ignored)."""
    out: dict[str, dict[str, Any]] = {}
    if not os.path.exists(path):
        return out
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            out[record["spec"]["key"]] = record
    return out


def _init_worker() -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)


#: Optimizer steps a healthy run needs for the step-time rules to judge it (20 of warm-up, 8 blocks of 10, and a
#: block for the patience to count a second check): the quiet run's healthy runs have at least these.
QUIET_MIN_STEPS = 70


def quiet_set(records: Iterable[Mapping[str, Any]]) -> list[str]:
    """The run keys of the quiet run of the wall-clock rules, from a full run's records: every healthy run the
    step-time rules judge (:data:`QUIET_MIN_STEPS` steps or more), every healthy run whose ``dataloader_bound``
    oracle is above the quiet band (a finding to catch, or ambiguous: judged on a free machine), and every fault
    of a wall-clock rule (``TIMING_RULES``)."""
    keys = []
    for r in records:
        if "error" in r:
            continue
        spec = r["spec"]
        if spec["expected"]:
            if any(rule in TIMING_RULES for rule in spec["expected"]):
                keys.append(spec["key"])
            continue
        excess = oracle_excess(r, DATALOADER_BOUND, _threshold(DATALOADER_BOUND))
        if (r.get("steps") or 0) >= QUIET_MIN_STEPS or (excess is not None and excess >= 1 / TRUE_FACTOR):
            keys.append(spec["key"])
    return keys


def solo(spec: RunSpec) -> bool:
    """Whether ``spec`` runs alone: a fault of a wall-clock rule (``TIMING_RULES``), measured as a user's run
    would be, with no other run of the harness on the machine (on a contended machine those rules say so in an
    ``info`` instead of a warning)."""
    return any(rule in TIMING_RULES for rule in spec.expected)


def run_all(specs: Sequence[RunSpec], cache: str, jobs: int, log: Any = sys.stderr) -> list[dict[str, Any]]:
    """The records of ``specs``: those in ``cache`` as they are, the others run ``jobs`` at a time and appended;
    the :func:`solo` runs after them, one at a time."""
    # a record of a worker that died (the pool broke) says nothing about its run: it runs again
    done = {k: r for k, r in load_cache(cache).items() if not r.get("worker_died")}
    todo = [s for s in specs if s.key not in done]
    log.write(f"calibration: {len(specs)} runs, {len(specs) - len(todo)} cached, {len(todo)} to run\n")
    start = time.perf_counter()
    if not todo:
        return [done[s.key] for s in specs]
    os.makedirs(os.path.dirname(os.path.abspath(cache)), exist_ok=True)
    ctx = multiprocessing.get_context("spawn")
    count = 0
    with open(cache, "a", encoding="utf-8") as out:
        for batch, workers in (([s for s in todo if not solo(s)], jobs), ([s for s in todo if solo(s)], 1)):
            if not batch:
                continue
            with concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker) as pool:
                futures = {pool.submit(execute, s): s for s in batch}
                for fut in concurrent.futures.as_completed(futures):
                    spec = futures[fut]
                    try:
                        record = fut.result()
                    except Exception as err:  # a worker that died: the record says so
                        record = {
                            "spec": spec_dict(spec), "error": f"{type(err).__name__}: {err}", "worker_died": True
                        }
                    out.write(json.dumps(record) + "\n")
                    out.flush()
                    done[spec.key] = record
                    count += 1
                    serious = [a["rule"] for a in record.get("alerts", []) if a["severity"] in SERIOUS]
                    log.write(
                        f"[{count}/{len(todo)} {time.perf_counter() - start:.0f}s] {spec.key}"
                        f"{' (alone)' if workers == 1 and jobs > 1 else ''} "
                        f"{record.get('seconds', 0):.1f}s {record.get('error') or serious}\n"
                    )
                    log.flush()
    return [done[s.key] for s in specs]


def spec_dict(spec: RunSpec) -> dict[str, Any]:
    """The JSON form of ``spec``."""
    import dataclasses

    return dataclasses.asdict(spec)


def _rules(selected: str | None) -> tuple[list[str], dict[str, float | None]]:
    from lightning_diag.core.registry import RULES
    from lightning_diag.rules.catalog import ALL_RULES

    rules = list(ALL_RULES)
    if selected:
        wanted = [r.strip() for r in selected.split(",") if r.strip()]
        unknown = sorted(set(wanted) - set(rules))
        if unknown:
            raise SystemExit(f"--rules: unknown rule ids {unknown}; known: {', '.join(rules)}")
        rules = [r for r in rules if r in wanted]
    return rules, {r: RULES[r].threshold for r in rules}


def section(
    records: Sequence[Mapping[str, Any]],
    rules: Sequence[str],
    thresholds: Mapping[str, float | None],
    command: str,
    missing: int = 0,
) -> str:
    """The page's generated section: the counts, the owners' tables, the crashed runs."""
    from lightning_diag.rules.catalog import ALL_RULES

    rows = table(records, rules)
    info = summary(records, rows)
    lines = [
        START,
        "",
        f"Generated by `{command}`: {len(records)} runs ({info['healthy_runs']} healthy, "
        f"{info['fault_runs']} with a fault), {info['run_seconds'] / 60:.0f} minutes of run time"
        + (f"; **{missing} planned runs did not run** (the time ran out)." if missing else "."),
        "",
    ]
    lines += ["| healthy family | runs |", "|---|---|"]
    lines += [f"| {FAMILIES.get(k, k)} | {n} |" for k, n in info["families"].items()]
    lines.append("")
    owners: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        owners.setdefault(ALL_RULES[row["rule"]], []).append(row)
    for owner, owned in owners.items():
        lines += [f"### {owner}", "", render(owned, thresholds), ""]
        lines += oracle_note(owned, records)
    lines += findings(records, rules, thresholds)
    if info["crashed"]:
        lines += ["Runs that raised (left out of the tables):", ""]
        lines += [f"- `{k}`: {v}" for k, v in info["crashed"].items()]
        lines.append("")
    lines.append(END)
    return "\n".join(lines)


def load_note(record: Mapping[str, Any]) -> str:
    """The machine's load over a run, for a line of the findings: its CPU pressure and the CPUs other processes
    used (what the wall-clock rules' verdicts depend on); empty where the record has neither."""
    pressure, others = record.get("cpu_pressure"), record.get("cpu_others")
    return ("" if pressure is None else f"; CPU pressure over the run {pressure:.0%}") + (
        "" if others is None else f", other processes {others:.2f} CPUs"
    )


def findings(
    records: Sequence[Mapping[str, Any]], rules: Sequence[str], thresholds: Mapping[str, float | None]
) -> list[str]:
    """The false alarms (each: the run, the step, the alert's value against the threshold, the rule's peak on the
    run) and the faults missed, one line each, for the page."""
    lines: list[str] = []
    wanted = set(rules)
    for r in records:
        if "error" in r or r["spec"]["expected"]:
            continue
        for rule in sorted(wanted & set(ORACLES)):
            found = rule in r.get("watched", []) and verdict(r, rule, thresholds.get(rule)) == TRUE_FINDING
            if found and not false_alarms(r, rule):
                kind = "said as an info on a contended machine" if infos(r, rule) else "missed"
                lines.append(
                    f"- {kind}: `{rule}` on `{r['spec']['key']}` (healthy, but its oracle reads"
                    f" {oracle_excess(r, rule, thresholds.get(rule)):.2f} of the threshold{load_note(r)})"
                )
        for a in serious(r):
            if a["rule"] not in wanted:
                continue
            value = "" if a.get("value") is None else f", value {a['value']:.4g}"
            thr = thresholds.get(a["rule"])
            peak = r.get("peaks", {}).get(a["rule"])
            said = verdict(r, a["rule"], thr)
            kind = {TRUE_FINDING: "detection (the oracle agrees)", AMBIGUOUS: "ambiguous alarm"}.get(
                str(said), "false alarm"
            )
            oracle = "" if said is None else f"; oracle {oracle_excess(r, a['rule'], thr):.2f} of the threshold"
            lines.append(
                f"- {kind}: `{a['rule']}` on `{r['spec']['key']}` at step {a['step']} (epoch {a['epoch']})"
                + value
                + ("" if thr is None else f" against {thr:g}")
                + ("" if peak is None else f"; peak excess on the run {peak:.3g}")
                + load_note(r)
                + oracle
            )
    for r in records:
        if "error" in r:
            continue
        for rule in r["spec"]["expected"]:
            if rule in wanted and first_alert(r, rule) is None:
                fired = sorted({a["rule"] for a in serious(r)})
                noted = sorted({a["rule"] for a in r.get("alerts", []) if a["severity"] == "info"} & {rule})
                lines.append(
                    f"- missed: `{rule}` on `{r['spec']['key']}` (fired instead: {', '.join(fired) or 'nothing'})"
                    + ("; an info instead (the machine was contended)" if noted else "")
                    + load_note(r)
                )
    return ["Every alarm on a healthy run and every missed fault:", "", *lines, ""] if lines else []


def write_page(path: str, text: str) -> None:
    """Replace the marked section of ``path`` by ``text`` (or write ``text`` as the page if it has none)."""
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            page = f.read()
        if START in page and END in page:
            text = page[: page.index(START)] + text + page[page.index(END) + len(END) :]
    with open(path, "w", encoding="utf-8") as f:
        f.write(text if text.endswith("\n") else text + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--subset", choices=("ci", "full"), default="full", help="the runs (default: full)")
    parser.add_argument("--jobs", type=int, default=2, help="processes (one torch thread each; default 2)")
    parser.add_argument(
        "--cache", default=None, help="JSON-lines cache (default: diag_runs/calibration/<subset>.jsonl)"
    )
    parser.add_argument("--rules", default=None, help="comma-separated rule ids to tabulate (default: every rule)")
    parser.add_argument("--write", default=None, help="markdown page to write the section into")
    parser.add_argument("--json", default=None, help="file to write the JSON summary to")
    parser.add_argument("--only", default=None, help="comma-separated texts: run only the runs whose key has one")
    parser.add_argument("--first", type=int, default=None, help="run only the first N runs (priority order)")
    parser.add_argument(
        "--quiet-from",
        default=None,
        help="a full run's cache: run only its quiet set (quiet_set: the runs the wall-clock rules judge), one at a"
        " time on an otherwise idle machine",
    )
    parser.add_argument(
        "--render-only", action="store_true", help="tabulate the cached records without running the missing runs"
    )
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs must be >= 1, got {args.jobs}")
    rules, thresholds = _rules(args.rules)
    specs = plan(args.subset)
    if args.only:
        parts = [p for p in args.only.split(",") if p]
        specs = [s for s in specs if any(p in s.key for p in parts)]
    if args.quiet_from:
        chosen = set(quiet_set(load_cache(args.quiet_from).values()))
        specs = [s for s in specs if s.key in chosen]
    if args.first is not None:
        specs = specs[: args.first]
    cache = args.cache or os.path.join("diag_runs", "calibration", f"{args.subset}.jsonl")
    if args.render_only:
        cached = load_cache(cache)
        records = [cached[s.key] for s in specs if s.key in cached]
        sys.stderr.write(f"calibration: {len(records)} of {len(specs)} runs cached; the others are left out\n")
    else:
        records = run_all(specs, cache, args.jobs)
    command = f"PYTHONPATH=. .venv/bin/python benchmarks/calibration.py --subset {args.subset} --jobs {args.jobs}"
    text = section(records, rules, thresholds, command, missing=len(specs) - len(records))
    if args.write:
        write_page(args.write, text)
    else:
        print(text)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(summary(records, table(records, rules)), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
