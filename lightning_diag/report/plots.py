"""PNG plots for ``lightning-diag report`` (needs matplotlib: ``pip install 'lightning-diag[plots]'``).

Drawing only: the values come from :class:`~lightning_diag.report.load.RunData`, read by the report. Each plot is
drawn when its series exist:

* ``grad_norms.png``: global and per-layer gradient L2 norms (log scale); beside them each gradient rule's
  threshold over the quantity it judges, as on the dashboard: ``grad_explode`` over the RMS gradient per element
  (``diag/grad_rms/<layer>``), ``grad_vanish`` over ``||g|| / ||W||`` (``diag/grad_relative/<layer>``);
* ``attn_entropy.png``: per-head entropy heatmap over time;
* ``loss.png``: training and validation loss, with the steps of warning and critical alerts;
* ``system.png``, ``data.png``, ``probes.png``: the charts of the dashboard's System, Data and Probes sections
  that have data, each with the thresholds of the rules it names.

The charts of the last three (and the gradient rules' panels) are those of
:func:`lightning_diag.output.dashboard.dashboard_layout`: the tags each selects and the rule whose threshold it
draws are defined once, there and in :mod:`lightning_diag.core.tags`.
"""

from __future__ import annotations

import contextlib
import math
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import matplotlib

matplotlib.use("Agg")  # files only; must come before pyplot
import matplotlib.pyplot as plt
import numpy as np

from lightning_diag.core.tags import attn_head, grad_layer, grad_total_tag, threshold_rule, threshold_tag
from lightning_diag.output.dashboard import dashboard_layout
from lightning_diag.report.text import clean, display
from lightning_diag.rules.catalog import ALL_RULES, ATTN_ENTROPY_HIGH, ATTN_ENTROPY_LOW

if TYPE_CHECKING:
    from lightning_diag.report.load import RunData

__all__ = ["draw_run"]

_HEAD = "diag/attn_entropy/"


def _xy(points: list[tuple[int, float]]) -> tuple[list[int], list[float]]:
    return [s for s, _ in points], [v if math.isfinite(v) else math.nan for _, v in points]


def _grad_norms(run: RunData, path: Path) -> bool:
    total = run.scalars.get(grad_total_tag(), [])
    layers = {grad_layer(t): s for t, s in run.scalars.items() if grad_layer(t) is not None}
    if not total and not layers:
        return False
    judged = [c for c in _charts(run, "Gradients") if c.rules]  # RMS (grad_explode), relative (grad_vanish)
    fig, axes = plt.subplots(1, 1 + len(judged), figsize=(9 + 5 * len(judged), 5), squeeze=False)
    ax = axes[0][0]
    for name, series in sorted(layers.items()):
        ax.plot(*_xy(series), linewidth=0.8, alpha=0.6, label=name)
    if total:
        ax.plot(*_xy(total), color="black", linewidth=2.0, label="total")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("gradient L2 norm")
    ax.set_title("Gradient norms: global and per layer")
    if len(layers) <= 12:
        ax.legend(fontsize=7, loc="best")
    for chart, ax in zip(judged, axes[0][1:], strict=True):
        _draw_chart(ax, run, chart)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


class _Chart:
    """One dashboard chart: its title, the series it selects from the run, and the rules whose thresholds it
    draws (from its ``diag/threshold/<rule>`` patterns)."""

    def __init__(self, title: str, series: dict[str, list[tuple[int, float]]], rules: list[str]) -> None:
        self.title = title
        self.series = series
        self.rules = rules


def _charts(run: RunData, section: str) -> list[_Chart]:
    """The charts of a dashboard section with data in ``run``, in the dashboard's order."""
    known = sorted({*ALL_RULES, *(k for k in run.thresholds if "." not in k)})
    out = []
    for title, (_kind, patterns) in dashboard_layout(known).get(section, {}).items():
        compiled = [re.compile(p) for p in patterns]
        series = {
            t: s for t, s in run.scalars.items() if threshold_rule(t) is None and any(c.match(t) for c in compiled)
        }
        if not series:
            continue
        rules = [r for r in known if r in run.thresholds and any(c.match(threshold_tag(r)) for c in compiled)]
        out.append(_Chart(title, series, rules))
    return out


_THRESHOLD_COLORS = ("tab:red", "tab:blue", "tab:purple", "tab:brown")


def _draw_chart(ax: Any, run: RunData, chart: _Chart) -> None:
    """Draw a chart's series and its rules' thresholds: lines over the steps, or bars when every series is one
    measurement of the same step (DataDiagnostics' fit-start statistics)."""
    names = sorted(chart.series)
    steps = {s for points in chart.series.values() for s, _ in points}
    values = [v for s in chart.series.values() for _, v in s if math.isfinite(v)]
    if len(steps) == 1 and all(len(chart.series[t]) == 1 for t in names):
        heights = [_xy(chart.series[t])[1][0] for t in names]
        bars = ax.bar(range(len(names)), heights, color="tab:gray")
        ax.bar_label(bars, fmt="%.3g", fontsize=7)
        ax.set_xticks(range(len(names)), [t.split("/", 2)[-1] for t in names], rotation=20, ha="right", fontsize=7)
        ax.set_xlabel(f"measured at step {next(iter(steps))}")
    else:
        few = max(len(s) for s in chart.series.values()) <= 3
        for tag in names:
            ax.plot(
                *_xy(chart.series[tag]),
                marker="o" if few else None,
                markersize=4,
                linewidth=1.0,
                label=tag.split("/", 2)[-1],
            )
        ax.set_xlabel("step")
    for rule, color in zip(chart.rules, _THRESHOLD_COLORS, strict=False):
        ax.axhline(run.thresholds[rule], color=color, linestyle="--", linewidth=1.2, label=f"{rule} threshold")
        values.append(run.thresholds[rule])
    positive = [v for v in values if v > 0]
    if positive and len(positive) == len(values) and max(positive) / min(positive) > 100:
        ax.set_yscale("log")
    ax.set_title(chart.title, fontsize=9)
    if ax.get_legend_handles_labels()[0] and len(chart.series) + len(chart.rules) <= 12:
        ax.legend(fontsize=7, loc="best")


def _section(section: str) -> Any:
    """The drawing function of a dashboard section: one panel per chart with data, three panels a row."""

    def draw(run: RunData, path: Path) -> bool:
        charts = _charts(run, section)
        if not charts:
            return False
        cols = min(3, len(charts))
        rows = math.ceil(len(charts) / cols)
        fig, axes = plt.subplots(rows, cols, figsize=(5.5 * cols, 4 * rows), squeeze=False)
        for ax in axes.flat[len(charts) :]:
            ax.set_visible(False)
        for chart, ax in zip(charts, axes.flat, strict=False):
            _draw_chart(ax, run, chart)
        fig.suptitle(section)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return True

    return draw


def _attn_heatmap(run: RunData, path: Path) -> bool:
    heads = {t: attn_head(t) for t in run.scalars}
    rows = sorted((t for t, h in heads.items() if h is not None), key=lambda t: heads[t] or ("", 0))
    if not rows:
        return False
    steps = sorted({s for t in rows for s, _ in run.scalars[t]})
    col = {s: i for i, s in enumerate(steps)}
    grid = np.full((len(rows), len(steps)), np.nan)
    for i, t in enumerate(rows):
        for s, v in run.scalars[t]:
            grid[i, col[s]] = v
    fig, ax = plt.subplots(figsize=(9, max(3.0, 0.25 * len(rows) + 1.5)))
    image = ax.imshow(grid, aspect="auto", interpolation="nearest", cmap="viridis")
    ax.set_yticks(range(len(rows)), [t.removeprefix(_HEAD) for t in rows], fontsize=6)
    ticks = np.linspace(0, len(steps) - 1, min(len(steps), 10)).astype(int)
    ax.set_xticks(ticks, [str(steps[i]) for i in ticks])
    ax.set_xlabel("step")
    band = [run.thresholds.get(k) for k in (ATTN_ENTROPY_LOW, ATTN_ENTROPY_HIGH)]
    suffix = f" (band {band[0]:g} .. {band[1]:g})" if None not in band else ""
    ax.set_title(f"Attention entropy per head, nats{suffix}")
    fig.colorbar(image, ax=ax, label="entropy (nats)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def _loss(run: RunData, path: Path) -> bool:
    names = ("train_step", "train_epoch", "train_window", "val")
    series = {n: run.scalars[f"diag/loss/{n}"] for n in names if f"diag/loss/{n}" in run.scalars}
    if not series:
        return False
    fig, ax = plt.subplots(figsize=(9, 5))
    for name, points in series.items():
        ax.plot(*_xy(points), marker="o" if name != "train_step" else None, markersize=3, label=name)
    for alert in run.alerts:
        if alert.severity != "info":
            color = "red" if alert.severity == "critical" else "orange"
            ax.axvline(alert.global_step, color=color, linestyle=":", linewidth=1.2)
            ax.annotate(
                alert.rule,
                (alert.global_step, 1.0),
                xycoords=("data", "axes fraction"),
                rotation=90,
                fontsize=7,
                va="top",
                ha="right",
                color=color,
            )
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("Loss (dotted lines: alerts)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def draw_run(run: RunData, out_dir: Path) -> list[Path]:
    """Draw every plot the run has data for into ``out_dir``; return the files written.

    A plot that fails (a series tag holding matplotlib mathtext such as ``$\\foo$``, a full disk) is skipped
    with a line in ``run.problems``; the others are drawn. A folder that cannot be created skips them all,
    said the same way.
    """
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        run.problems.append(f"{display(out_dir)}: plots skipped, the folder cannot be created ({clean(err)})")
        return []
    written = []
    drawings = (
        ("grad_norms", _grad_norms),
        ("attn_entropy", _attn_heatmap),
        ("loss", _loss),
        ("system", _section("System")),
        ("data", _section("Data")),
        ("probes", _section("Probes")),
    )
    for name, draw in drawings:
        path = out_dir / f"{name}.png"
        open_before = set(plt.get_fignums())
        try:
            if draw(run, path):
                written.append(path)
        except Exception as err:  # one bad plot is skipped, never the report
            for number in set(plt.get_fignums()) - open_before:
                plt.close(number)
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)
            why = clean(f"{type(err).__name__}: {err}")[:300]
            run.problems.append(f"{display(path)}: plot skipped ({why})")
    return written
