"""``lightning-diag compare RUN_A RUN_B [...]``: what changed between runs, and where their training diverged.

Reads each run as the report does (:func:`lightning_diag.report.load.load_run`) plus its ``diag/run.json``
provenance, and puts side by side: the provenance differences (hyperparameters first), the checklist, the alert
counts per rule with the first alert of each, the final and best value of every ``diag/loss/...`` series, and
the step where the training-loss curves first diverge beyond their noise. Imports neither torch nor Lightning.
"""

from __future__ import annotations

import dataclasses
import html
import json
import math
import os
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lightning_diag.core.tags import LossSeries, loss_tag, prefix
from lightning_diag.report.checks import RunReport, diagnose
from lightning_diag.report.load import RunData, Series, load_run, read_json
from lightning_diag.report.text import clean, display, md
from lightning_diag.rules.rows import json_safe

__all__ = ["RUN_FILE", "Comparison", "compare_runs", "divergence_step", "flatten", "render_comparison"]

RUN_FILE = "run.json"
#: Provenance sections in the order differences are listed (hyperparameters first).
_ORDER = ("hyperparameters", "datamodule_hyperparameters", "trainer", "seed", "data", "git", "versions", "device")
#: Consecutive points the curves must stay apart for the divergence to count.
_SUSTAIN = 3
#: Distance, in noise units, that counts as apart.
_NOISE_UNITS = 3.0


def flatten(value: Any, key: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (lists are kept whole).

    Example:
        >>> flatten({"hyperparameters": {"lr": 0.1, "layers": [2, 2]}, "seed": 0})
        {'hyperparameters.lr': 0.1, 'hyperparameters.layers': [2, 2], 'seed': 0}
    """
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(flatten(v, f"{key}.{k}" if key else str(k)))
        return out
    return {key: value}


def _noise(points: Series) -> float:
    """The curve's noise σ, from its second differences (a smooth trend has none): for white noise
    x[i+1] − 2x[i] + x[i−1] has standard deviation √6·σ, and its median absolute value is 0.6745 of that."""
    values = [v for _, v in points if math.isfinite(v)]
    second = [abs(c - 2 * b + a) for a, b, c in zip(values, values[1:], values[2:], strict=False)]
    return statistics.median(second) / (0.6745 * math.sqrt(6)) if second else 0.0


def divergence_step(a: Series, b: Series) -> int | None:
    """The first step, among the steps both curves have, from which they stay more than 3 noise units apart
    (the sum of the two curves' noise σ, :func:`_noise`) for 3 consecutive points; ``None`` if never.

    Example:
        >>> same = [(s, 1.0 / (s + 1)) for s in range(20)]
        >>> other = [(s, v + (0.5 if s >= 12 else 0.0)) for s, v in same]
        >>> divergence_step(same, same), divergence_step(same, other)
        (None, 12)
    """
    left, right = dict(a), dict(b)
    steps = sorted(set(left) & set(right))
    if len(steps) < _SUSTAIN:
        return None
    scale = _NOISE_UNITS * (_noise(a) + _noise(b))
    floor = 1e-6 * max((abs(v) for v in (*left.values(), *right.values()) if math.isfinite(v)), default=1.0)
    limit = max(scale, floor)
    run = 0
    for i, s in enumerate(steps):
        x, y = left[s], right[s]
        apart = not (math.isfinite(x) and math.isfinite(y)) or abs(x - y) > limit
        run = run + 1 if apart else 0
        if run == _SUSTAIN:
            return steps[i - _SUSTAIN + 1]
    return None


@dataclasses.dataclass
class Comparison:
    """Runs compared.

    Attributes:
        reports: Each run's checklist and alerts (:class:`~lightning_diag.report.checks.RunReport`).
        provenance: Each run's ``diag/run.json`` (empty when it has none).
        differences: ``key -> [value per run]`` for every provenance key whose values differ, hyperparameters
            first.
        alert_counts: ``rule -> [count per run]``.
        first_alerts: ``rule -> ["step N (source)" or "" per run]``.
        metrics: ``series -> [(final, best) per run]`` for the ``diag/loss/...`` series.
        divergence: ``series -> step`` where each later run's curve first leaves the first run's (``None``: never).
    """

    reports: list[RunReport]
    provenance: list[dict[str, Any]]
    differences: dict[str, list[Any]]
    alert_counts: dict[str, list[int]]
    first_alerts: dict[str, list[str]]
    metrics: dict[str, list[tuple[float, float] | None]]
    divergence: dict[str, list[int | None]]

    @property
    def names(self) -> list[str]:
        """The runs' paths (bytes of a folder name that are not UTF-8 as U+FFFD)."""
        return [display(r.run.path) for r in self.reports]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict: non-finite numbers as strings (``"nan"``, ``"inf"``), as in the report's JSON."""
        return json_safe(
            {
                "runs": self.names,
                "differences": self.differences,
                "checklist": {
                    ch.id: [next((c.status for c in r.checks if c.id == ch.id), None) for r in self.reports]
                    for ch in self.reports[0].checks
                },
                "alert_counts": self.alert_counts,
                "first_alerts": self.first_alerts,
                "metrics": {k: [list(v) if v else None for v in vs] for k, vs in self.metrics.items()},
                "divergence": self.divergence,
                "problems": [p for r in self.reports for p in r.run.problems],
            }
        )


def _provenance(run: RunData) -> dict[str, Any]:
    """The run's ``diag/run.json`` (``{}`` when it has none); one that cannot be read is a line in its problems."""
    path = run.path / "diag" / RUN_FILE
    if not os.path.lexists(path):
        return {}
    try:
        data = read_json(path)
    except (OSError, ValueError) as err:
        run.problems.append(f"{display(path)}: could not be read ({clean(err)}); no provenance")
        return {}
    if not isinstance(data, dict):
        run.problems.append(f"{display(path)}: not a JSON object; no provenance")
        return {}
    return data


def _differences(provenance: Sequence[dict[str, Any]]) -> dict[str, list[Any]]:
    flat = [flatten(p) for p in provenance]
    keys = sorted(
        {k for f in flat for k in f},
        key=lambda k: (
            next((i for i, section in enumerate(_ORDER) if k == section or k.startswith(section + ".")), len(_ORDER)),
            k,
        ),
    )
    return {
        k: [f.get(k) for f in flat]
        for k in keys
        if len({json.dumps(f.get(k), sort_keys=True, default=str) for f in flat}) > 1
    }


def _metrics(runs: Sequence[RunData]) -> dict[str, list[tuple[float, float] | None]]:
    series = sorted({t for r in runs for t in r.tags(prefix("loss")) if "fluctuation" not in t and "swing" not in t})
    out: dict[str, list[tuple[float, float] | None]] = {}
    for tag in series:
        row: list[tuple[float, float] | None] = []
        for r in runs:
            values = [v for _, v in r.scalars.get(tag, []) if math.isfinite(v)]
            row.append((values[-1], min(values)) if values else None)
        out[tag] = row
    return out


def compare_runs(paths: Sequence[str | Path]) -> Comparison:
    """Load, diagnose and compare the runs at ``paths`` (at least two).

    Raises:
        ValueError: With fewer than two runs.
        NoDiagnosticsError: If a path holds no lightning_diag diagnostics.
    """
    from lightning_diag.report.load import NoDiagnosticsError

    if len(paths) < 2:
        raise ValueError("compare needs at least two runs")
    runs = [load_run(p) for p in paths]
    for r in runs:
        if not r.has_diagnostics:
            raise NoDiagnosticsError(f"no lightning_diag diagnostics in {r.path}")
    reports = [diagnose(r) for r in runs]
    provenance = [_provenance(r) for r in runs]
    rules = sorted({a.rule for r in runs for a in r.alerts})
    counts = {rule: [sum(a.rule == rule for a in r.alerts) for r in runs] for rule in rules}
    first: dict[str, list[str]] = {}
    for rule in rules:
        row = []
        for r in runs:
            hit = next((a for a in r.alerts if a.rule == rule), None)
            row.append(f"step {hit.global_step} ({hit.source})" if hit is not None else "")
        first[rule] = row
    divergence: dict[str, list[int | None]] = {}
    names: tuple[LossSeries, ...] = ("train_step", "train_window", "train_epoch")
    for name in names:
        tag = loss_tag(name)
        if all(r.scalars.get(tag) for r in runs):
            later: list[int | None] = [divergence_step(runs[0].scalars[tag], r.scalars[tag]) for r in runs[1:]]
            divergence[tag] = [None, *later]
            break
    return Comparison(reports, provenance, _differences(provenance), counts, first, _metrics(runs), divergence)


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _rows(c: Comparison) -> list[tuple[str, list[list[str]], list[str]]]:
    """Section title, rows, header: shared by markdown and HTML."""
    runs = [f"run {i + 1}" for i in range(len(c.reports))]
    sections: list[tuple[str, list[list[str]], list[str]]] = [
        ("Runs", [[f"run {i + 1}", n] for i, n in enumerate(c.names)], ["run", "path"]),
        (
            "Provenance differences (hyperparameters first)",
            [[k, *(_fmt(v) for v in vs)] for k, vs in c.differences.items()],
            ["key", *runs],
        ),
        (
            "Checklist",
            [
                [ch.title, *(next((_status(x) for x in r.checks if x.id == ch.id), "-") for r in c.reports)]
                for ch in c.reports[0].checks
            ],
            ["check", *runs],
        ),
        (
            "Alerts per rule (first alert)",
            [
                [
                    rule,
                    *(
                        f"{n} ({f})" if n else "0"
                        for n, f in zip(c.alert_counts[rule], c.first_alerts[rule], strict=True)
                    ),
                ]
                for rule in c.alert_counts
            ],
            ["rule", *runs],
        ),
        (
            "Final / best of each loss series",
            [[tag, *(f"{_fmt(v[0])} / {_fmt(v[1])}" if v else "-" for v in vs)] for tag, vs in c.metrics.items()],
            ["series", *runs],
        ),
        (
            "Training-loss divergence from run 1",
            [
                [tag, *("-" if i == 0 else ("never" if s is None else f"step {s}") for i, s in enumerate(steps))]
                for tag, steps in c.divergence.items()
            ],
            ["series", *runs],
        ),
    ]
    problems = [p for r in c.reports for p in r.run.problems]
    if problems:
        sections.append(("Problems", [[p] for p in problems], ["problem"]))
    return sections


def _h(text: object) -> str:
    return html.escape(clean(text))


def _status(check: Any) -> str:
    return {"pass": "PASS", "fail": "FAIL"}.get(check.status, check.status)


def render_comparison(c: Comparison, fmt: str = "md") -> str:
    """The comparison as markdown, JSON or a standalone HTML page."""
    if fmt == "json":
        return json.dumps(c.to_dict(), indent=2, default=lambda v: clean(v), allow_nan=False)
    sections = _rows(c)
    if fmt == "html":
        parts = [
            "<!doctype html><html><head><meta charset='utf-8'><title>lightning-diag compare</title>",
            "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse;margin-bottom:1.5em}"
            "td,th{border:1px solid #ccc;padding:4px 8px;text-align:left}th{background:#f3f3f3}</style>",
            "</head><body><h1>lightning-diag compare</h1>",
        ]
        for title, rows, header in sections:
            parts.append(f"<h2>{_h(title)}</h2>")
            if not rows:
                parts.append("<p>None.</p>")
                continue
            parts.append("<table><tr>" + "".join(f"<th>{_h(h)}</th>" for h in header) + "</tr>")
            parts += ["<tr>" + "".join(f"<td>{_h(cell)}</td>" for cell in row) + "</tr>" for row in rows]
            parts.append("</table>")
        return "\n".join([*parts, "</body></html>"])
    out = ["# lightning-diag compare", ""]
    for title, rows, header in sections:
        out += [f"## {title}", ""]
        if not rows:
            out += ["None.", ""]
            continue
        out.append("| " + " | ".join(md(h) for h in header) + " |")
        out.append("|" + "---|" * len(header))
        out += ["| " + " | ".join(md(cell) for cell in row) + " |" for row in rows]
        out.append("")
    return "\n".join(out).rstrip() + "\n"
