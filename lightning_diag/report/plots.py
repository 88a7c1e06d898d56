"""PNG plots for ``lightning-diag report`` (needs matplotlib: ``pip install 'lightning-diag[plots]'``).

Drawing only: the values come from :class:`~lightning_diag.report.load.RunData`, read by the report. Each plot is
drawn when its series exist: ``grad_norms.png`` (global and per-layer gradient norms, log scale, with the
``grad_vanish`` / ``grad_explode`` thresholds), ``attn_entropy.png`` (per-head entropy heatmap over time) and
``loss.png`` (training and validation loss, with the steps of warning and critical alerts).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

import matplotlib

matplotlib.use("Agg")  # files only; must come before pyplot
import matplotlib.pyplot as plt
import numpy as np

from lightning_diag.core.tags import attn_head, grad_layer, grad_total_tag
from lightning_diag.rules.catalog import ATTN_ENTROPY_HIGH, ATTN_ENTROPY_LOW, GRAD_EXPLODE, GRAD_VANISH

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
    fig, ax = plt.subplots(figsize=(9, 5))
    for name, series in sorted(layers.items()):
        ax.plot(*_xy(series), linewidth=0.8, alpha=0.6, label=name)
    if total:
        ax.plot(*_xy(total), color="black", linewidth=2.0, label="total")
    for key, color in ((GRAD_VANISH, "tab:blue"), (GRAD_EXPLODE, "tab:red")):
        if key in run.thresholds:
            ax.axhline(run.thresholds[key], color=color, linestyle="--", linewidth=1.2, label=f"{key} threshold")
    ax.set_yscale("log")
    ax.set_xlabel("global step")
    ax.set_ylabel("gradient L2 norm")
    ax.set_title("Gradient norms: global and per layer")
    if len(layers) <= 12:
        ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


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
    ax.set_xlabel("global step")
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
    ax.set_xlabel("global step")
    ax.set_ylabel("loss")
    ax.set_title("Loss (dotted lines: alerts)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def draw_run(run: RunData, out_dir: Path) -> list[Path]:
    """Draw every plot the run has data for into ``out_dir``; return the files written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, draw in (("grad_norms", _grad_norms), ("attn_entropy", _attn_heatmap), ("loss", _loss)):
        path = out_dir / f"{name}.png"
        if draw(run, path):
            written.append(path)
    return written
