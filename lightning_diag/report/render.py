"""Rendering ``lightning-diag report``: markdown, JSON and HTML. Imports neither torch nor Lightning.

Each run gets its section (checklist, alert timeline, plots, problems). Several runs also get the summary of
:mod:`lightning_diag.report.summary`, one line per run, the worst first: after the sections, or in markdown without
``details`` instead of them. JSON always holds every run and the summary.
"""

from __future__ import annotations

import base64
import html
import json
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Literal

from lightning_diag.core.alerts import ALERT_COLUMNS, alert_cells
from lightning_diag.report.checks import RunReport
from lightning_diag.report.plain import PLAIN_SOURCE
from lightning_diag.report.summary import SummaryLine, summarize
from lightning_diag.report.text import clean, md, url

__all__ = ["FORMATS", "Format", "render", "render_stream"]

Format = Literal["md", "json", "html"]
FORMATS: tuple[str, ...] = ("md", "json", "html")

_MARK = {"pass": "PASS", "fail": "FAIL", "not measured": "not measured"}


def _md_cell(text: object) -> str:
    return md(text)


def _e(text: object) -> str:
    """HTML-escaped, control characters removed."""
    return html.escape(clean(text))


def _link(path: Path, base: Path | None) -> str:
    """A plot's link: relative to the report's folder and URL-encoded, or its absolute path."""
    return url(os.path.relpath(path, base)) if base is not None else url(path)


def _about(rep: RunReport) -> str:
    """The sentence after a run's counts: its callbacks and thresholds, or a plain run's mapped tags."""
    run = rep.run
    if run.kind == "plain":
        tags = ", ".join(f"{role} = {tag}" for role, tag in run.mapping.items())
        return (
            f"A plain Lightning run (no lightning_diag callbacks), judged on its own logged series: {tags} "
            f"(change with --map ROLE=TAG). Thresholds: {PLAIN_SOURCE}."
        )
    return (
        f"Callbacks: {', '.join(sorted(run.callbacks)) or 'unknown'}. Thresholds: {run.threshold_source}. "
        f"Dashboard layout: {'yes' if run.has_layout else 'no'}."
    )


_SUMMARY_COLUMNS = ("verdict", "run", "judged on", "fail", "pass", "not measured", "alerts", "first finding")


def _summary_cells(line: SummaryLine) -> list[str]:
    judged = "its own losses (plain run)" if line.kind == "plain" else "lightning_diag diagnostics"
    return [
        line.verdict,
        line.run,
        judged,
        str(line.fail),
        str(line.passed),
        str(line.not_measured),
        str(line.alerts),
        line.finding,
    ]


def _md_summary(lines: Sequence[SummaryLine]) -> str:
    rows = [
        f"## Summary: {len(lines)} runs, the worst first",
        "",
        "| " + " | ".join(_SUMMARY_COLUMNS) + " |",
        "|" + "---|" * len(_SUMMARY_COLUMNS),
        *("| " + " | ".join(md(c) for c in _summary_cells(line)) + " |" for line in sorted(lines, key=SummaryLine.key)),
        "",
    ]
    return "".join("\n" + row for row in rows)


def _html_summary(lines: Sequence[SummaryLine]) -> str:
    rows = [f"<h2>Summary: {len(lines)} runs, the worst first</h2><table><tr>"]
    rows[0] += "".join(f"<th>{c}</th>" for c in _SUMMARY_COLUMNS) + "</tr>"
    rows += [
        "<tr>" + "".join(f"<td>{_e(c)}</td>" for c in _summary_cells(line)) + "</tr>"
        for line in sorted(lines, key=SummaryLine.key)
    ]
    rows.append("</table>")
    return "".join("\n" + row for row in rows)


def _md_run(rep: RunReport, plot_base: Path | None) -> list[str]:
    out: list[str] = []
    run = rep.run
    c = rep.counts
    out += [
        f"## Run {md(run.name)}",
        "",
        f"{c['fail']} fail, {c['pass']} pass, {c['not measured']} not measured. {md(_about(rep))}",
        "",
        "### Checklist",
        "",
        "| layer | check | status | measured | threshold | alerts | note |",
        "|---|---|---|---|---|---|---|",
    ]
    for ch in rep.checks:
        alerts = f"{ch.alerts} (first at step {ch.first_alert_step})" if ch.alerts else "0"
        out.append(
            f"| {_md_cell(ch.layer)} | {_md_cell(ch.title)} | **{_MARK[ch.status]}** | {_md_cell(ch.measured or '-')} "
            f"| {_md_cell(ch.threshold)} | {alerts} | {_md_cell(ch.note)} |"
        )
    out += ["", "### Alert timeline", ""]
    timeline = rep.timeline
    if not timeline:
        out.append("No alerts.")
    else:
        out += ["| " + " | ".join(ALERT_COLUMNS) + " |", "|" + "---|" * len(ALERT_COLUMNS)]
        out += ["| " + " | ".join(_md_cell(c) for c in alert_cells(a)) + " |" for a in timeline]
    if rep.plots:
        out += ["", "### Plots", ""]
        out += [f"![{md(p.stem)}]({_link(p, plot_base)})" for p in rep.plots]
    problems = [*run.problems, *([rep.plot_note] if rep.plot_note else [])]
    if problems:
        out += ["", "### Problems", ""]
        out += [f"- {md(problem)}" for problem in problems]
    out.append("")
    return out


_CSS = """body{font-family:sans-serif;margin:2em;max-width:1200px}table{border-collapse:collapse;margin:1em 0}
td,th{border:1px solid #ccc;padding:4px 8px;text-align:left;vertical-align:top;font-size:14px}
.pass{background:#e6f4ea}.fail{background:#fce8e6;font-weight:bold}.not-measured{color:#777}
img{max-width:100%;border:1px solid #ddd;margin:0.5em 0}"""


def _img_src(path: Path, base: Path | None) -> str:
    if base is not None:
        return html.escape(_link(path, base))
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    return f"data:image/png;base64,{data}"


_HTML_HEAD = [
    "<!doctype html><html><head><meta charset='utf-8'><title>lightning-diag report</title>",
    f"<style>{_CSS}</style></head><body><h1>lightning-diag report</h1>",
]
_HTML_TAIL = "</body></html>"


def _html_run(rep: RunReport, plot_base: Path | None) -> list[str]:
    e = _e
    out: list[str] = []
    run, c = rep.run, rep.counts
    out.append(f"<h2>Run <code>{e(run.name)}</code></h2>")
    out.append(f"<p>{c['fail']} fail, {c['pass']} pass, {c['not measured']} not measured. {e(_about(rep))}</p>")
    out.append("<h3>Checklist</h3><table><tr><th>layer</th><th>check</th><th>status</th><th>measured</th>")
    out.append("<th>threshold</th><th>alerts</th><th>note</th></tr>")
    for ch in rep.checks:
        cls = ch.status.replace(" ", "-")
        alerts = f"{ch.alerts} (first at step {ch.first_alert_step})" if ch.alerts else "0"
        out.append(
            f"<tr class='{cls}'><td>{e(ch.layer)}</td><td>{e(ch.title)}</td><td>{e(_MARK[ch.status])}</td>"
            f"<td>{e(ch.measured or '-')}</td><td>{e(ch.threshold)}</td><td>{alerts}</td><td>{e(ch.note)}</td></tr>"
        )
    out.append("</table><h3>Alert timeline</h3>")
    if not rep.timeline:
        out.append("<p>No alerts.</p>")
    else:
        out.append("<table><tr>" + "".join(f"<th>{c}</th>" for c in ALERT_COLUMNS) + "</tr>")
        for a in rep.timeline:
            out.append("<tr>" + "".join(f"<td>{e(c)}</td>" for c in alert_cells(a)) + "</tr>")
        out.append("</table>")
    if rep.plots:
        out.append("<h3>Plots</h3>")
        out += [f"<img alt='{e(p.stem)}' src='{_img_src(p, plot_base)}'>" for p in rep.plots]
    problems = [*run.problems, *([rep.plot_note] if rep.plot_note else [])]
    if problems:
        out.append("<h3>Problems</h3><ul>" + "".join(f"<li>{e(p)}</li>" for p in problems) + "</ul>")
    return out


def render_stream(
    reports: Iterable[RunReport], fmt: Format, plot_base: Path | None = None, details: bool = True
) -> Iterator[str]:
    """The document of :func:`render`, in pieces: a header, one piece per run as the run comes, a footer.

    Joined (``"".join``), the pieces are :func:`render`'s text; each run is rendered as soon as ``reports``
    yields it, so a generator of reports (:func:`~lightning_diag.report.iter_reports`) keeps one run in memory
    (and a summary line per run). Several runs end with the summary, one line per run, the worst first; in
    markdown without ``details`` it replaces the runs' sections (a single run keeps its section).
    """
    lines: list[SummaryLine] = []
    if fmt == "json":
        yield '{\n  "runs": ['
        for i, rep in enumerate(reports):
            lines.append(summarize(rep))
            body = json.dumps(rep.to_dict(), indent=2, allow_nan=False)
            yield ("," if i else "") + "\n" + "\n".join("    " + line for line in body.splitlines())
        summary = json.dumps([line.to_dict() for line in sorted(lines, key=SummaryLine.key)], indent=2)
        yield '\n  ],\n  "summary": ' + "\n".join(("  " if i else "") + x for i, x in enumerate(summary.splitlines()))
        yield "\n}"
        return
    if fmt == "html":
        yield "\n".join(_HTML_HEAD)
        for rep in reports:
            lines.append(summarize(rep))
            yield "".join("\n" + line for line in _html_run(rep, plot_base))
        if len(lines) > 1:
            yield _html_summary(lines)
        yield "\n" + _HTML_TAIL
        return
    yield "# lightning-diag report\n"
    held: str | None = None  # without details: the first run's section, shown only if it stays the only run
    for rep in reports:
        lines.append(summarize(rep))
        if details:
            yield "".join("\n" + line for line in _md_run(rep, plot_base))
        elif len(lines) == 1:
            held = "".join("\n" + line for line in _md_run(rep, plot_base))
        else:
            held = None
    if held is not None:
        yield held
    if len(lines) > 1:
        yield _md_summary(lines)
        if not details:
            yield "\nEach run's checklist: `lightning-diag report RUN`, or add `--details`.\n"


def render(reports: Sequence[RunReport], fmt: Format, plot_base: Path | None = None, details: bool = True) -> str:
    """The reports as markdown, JSON or HTML.

    Args:
        reports: One report per run.
        fmt: ``"md"``, ``"json"`` or ``"html"``.
        plot_base: Directory the report file is written to; plot links are made relative to it. ``None``
            embeds the plots in HTML (data URIs) and links them by absolute path in markdown.
        details: With several runs in markdown, each run's section before the summary (else the summary alone).
    """
    return "".join(render_stream(reports, fmt, plot_base, details))
