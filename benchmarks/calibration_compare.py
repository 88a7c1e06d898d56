"""Two calibration caches compared on the runs both hold: what a change to the rules did (issues 43 and 44).

    PYTHONPATH=. .venv/bin/python benchmarks/calibration_compare.py BEFORE.jsonl AFTER.jsonl
    PYTHONPATH=. .venv/bin/python benchmarks/calibration_compare.py BEFORE.jsonl AFTER.jsonl --steps

Prints a markdown table, one row per rule whose counts differ: healthy runs with a false alarm before and after,
fault runs that expect the rule and missed it before and after. With ``--steps`` it also lists every run and rule
whose first warning/critical alert moved, appeared or vanished (the "same detections and the same alert steps"
check of a refactor). Wall-clock rules are compared like the others; read them against the machine's load.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.calibration import false_alarms, first_alert, load_cache, serious


def _shared(before: Mapping[str, Any], after: Mapping[str, Any]) -> list[str]:
    return sorted(k for k in before.keys() & after.keys() if "error" not in before[k] and "error" not in after[k])


def counts(records: Mapping[str, Any], keys: Sequence[str]) -> dict[str, list[int]]:
    """Per rule: ``[healthy runs with a false alarm, fault runs that missed it]`` over ``keys``."""
    out: dict[str, list[int]] = {}
    for key in keys:
        record = records[key]
        expected = record["spec"]["expected"]
        if not expected:
            for rule in {a["rule"] for a in serious(record)}:
                out.setdefault(rule, [0, 0])[0] += bool(false_alarms(record, rule))
        for rule in expected:
            out.setdefault(rule, [0, 0])[1] += first_alert(record, rule) is None
    return out


def comparison(before: Mapping[str, Any], after: Mapping[str, Any]) -> str:
    """The markdown table of the rules whose counts differ (an empty-table note where none do)."""
    keys = _shared(before, after)
    old, new = counts(before, keys), counts(after, keys)
    healthy = sum(not after[k]["spec"]["expected"] for k in keys)
    lines = [
        f"{len(keys)} runs in both ({healthy} healthy):",
        "",
        "| rule | healthy runs with a false alarm before | after | fault runs missed before | after |",
        "|---|---|---|---|---|",
    ]
    rows = 0
    for rule in sorted(old.keys() | new.keys()):
        a, b = old.get(rule, [0, 0]), new.get(rule, [0, 0])
        if a != b:
            rows += 1
            lines.append(f"| `{rule}` | {a[0]} | {b[0]} | {a[1]} | {b[1]} |")
    if not rows:
        lines.append("| (no rule's counts changed) | | | | |")
    return "\n".join(lines)


def moved(before: Mapping[str, Any], after: Mapping[str, Any]) -> list[str]:
    """Each run and rule whose first warning/critical alert step differs (``None``: it did not fire)."""
    out = []
    for key in _shared(before, after):
        rules = {a["rule"] for a in serious(before[key])} | {a["rule"] for a in serious(after[key])}
        for rule in sorted(rules):
            old = next((a["step"] for a in serious(before[key]) if a["rule"] == rule), None)
            new = next((a["step"] for a in serious(after[key]) if a["rule"] == rule), None)
            if old != new:
                out.append(f"- `{key}` `{rule}`: step {old} -> {new}")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("before", help="the earlier cache (JSON lines)")
    parser.add_argument("after", help="the later cache (JSON lines)")
    parser.add_argument("--steps", action="store_true", help="also list every first-alert step that moved")
    args = parser.parse_args(argv)
    before, after = load_cache(args.before), load_cache(args.after)
    print(comparison(before, after))
    if args.steps:
        lines = moved(before, after)
        print(f"\n{len(lines)} first alerts moved, appeared or vanished:")
        print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
