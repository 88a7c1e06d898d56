"""benchmarks/calibration_compare.py: two caches compared on the runs both hold."""

from __future__ import annotations

from typing import Any

from benchmarks.calibration_compare import comparison, counts, moved


def _record(key: str, expected: tuple[str, ...], alerts: list[tuple[str, str, int]], **spec: Any) -> dict[str, Any]:
    return {
        "spec": {"key": key, "expected": list(expected), "onset_step": None, "onset_epoch": None, **spec},
        "alerts": [{"rule": r, "severity": s, "step": step, "epoch": 0} for r, s, step in alerts],
    }


BEFORE = {
    "h1": _record("h1", (), [("loss_swing", "warning", 40), ("attn_sink", "info", 10)]),
    "h2": _record("h2", (), []),
    "f1": _record("f1", ("grad_explode",), [("grad_vanish", "warning", 12)]),
    "gone": _record("gone", (), [("loss_swing", "warning", 5)]),
}
AFTER = {
    "h1": _record("h1", (), [("attn_sink", "info", 10)]),
    "h2": _record("h2", (), [("dead_units", "warning", 30)]),
    "f1": _record("f1", ("grad_explode",), [("grad_explode", "critical", 15), ("grad_vanish", "warning", 12)]),
    "crashed": {"spec": {"key": "crashed", "expected": []}, "error": "RuntimeError: boom"},
}


def test_counts_are_false_alarms_on_healthy_runs_and_misses_on_faults() -> None:
    assert counts(BEFORE, ["h1", "h2", "f1"]) == {"loss_swing": [1, 0], "grad_explode": [0, 1]}
    # an info alert is no false alarm; an unexpected rule on a fault run is not counted as one either
    assert counts(AFTER, ["h1", "h2", "f1"]) == {"dead_units": [1, 0], "grad_explode": [0, 0]}


def test_comparison_lists_only_the_rules_whose_counts_changed_on_shared_runs() -> None:
    text = comparison(BEFORE, AFTER)
    assert text.startswith("3 runs in both (2 healthy):")  # "gone" and "crashed" are not in both
    assert "| `loss_swing` | 1 | 0 | 0 | 0 |" in text
    assert "| `dead_units` | 0 | 1 | 0 | 0 |" in text
    assert "| `grad_explode` | 0 | 0 | 1 | 0 |" in text
    assert "grad_vanish" not in text and "attn_sink" not in text
    assert "no rule's counts changed" in comparison(BEFORE, BEFORE)


def test_moved_names_each_first_alert_that_moved_appeared_or_vanished() -> None:
    assert moved(BEFORE, AFTER) == [
        "- `f1` `grad_explode`: step None -> 15",
        "- `h1` `loss_swing`: step 40 -> None",
        "- `h2` `dead_units`: step None -> 30",
    ]
    assert moved(BEFORE, BEFORE) == []
