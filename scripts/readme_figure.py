"""Regenerate the README's picture: the report's loss plot of the demo's ``--fault nan`` run, with its alert.

Usage (the ``plots`` extra, as ``lightning-diag report --format html``; ``bash scripts/test.sh`` installs it)::

    python scripts/readme_figure.py                  # writes docs/demo_nan.png
    python scripts/readme_figure.py --fault swing --out /tmp/swing.png

It trains the demo (``lightning_diag.demo.run.run_demo``, about 15 s on a laptop CPU), draws the run's plots with
``lightning_diag.report.build_report`` (the PNGs of ``lightning-diag report --format html``), and stacks the loss
plot over the text of the run's warning and critical alerts, as the demo prints them.
"""

from __future__ import annotations

import argparse
import tempfile
import textwrap
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.image as mpimg
import matplotlib.pyplot as plt

from lightning_diag.demo.run import quiet, run_demo
from lightning_diag.report import build_report

ROOT = Path(__file__).resolve().parents[1]


def draw(fault: str, out: Path) -> Path:
    """Train the demo with ``fault``, draw its report plots, and write the loss plot and alerts to ``out``."""
    with tempfile.TemporaryDirectory() as tmp:
        with quiet(threads=1):
            result = run_demo(fault=fault, root=tmp)
        build_report(result.log_dir, plot_dir=Path(tmp) / "plots")
        loss_png = next((Path(tmp) / "plots").rglob("loss.png"))
        image = mpimg.imread(loss_png)
    serious = [a for a in result.alerts if a.severity != "info"]
    if not serious:
        raise SystemExit(f"readme_figure: the demo's --fault {fault} raised no warning or critical alert")
    lines = [f"$ bash scripts/demo.sh --fault {fault}"]
    for alert in serious:
        lines += textwrap.wrap(alert.format(), width=110, subsequent_indent="    ", max_lines=3, placeholder=" ...")
    height, width = image.shape[:2]
    text_h = 0.2 * (len(lines) + 1)  # inches, at 10 pt monospace
    fig = plt.figure(figsize=(width / 100, height / 100 + text_h), dpi=100)
    top = height / 100 / (height / 100 + text_h)
    ax = fig.add_axes((0.0, 1.0 - top, 1.0, top))
    ax.imshow(image)
    ax.axis("off")
    fig.text(0.015, (1.0 - top) * 0.95, "\n".join(lines), family="monospace", fontsize=9, va="top", color="#222222")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100, facecolor="white")
    plt.close(fig)
    return out


def main() -> None:
    """Parse the arguments and draw the figure."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fault", default="nan", help="the demo's --fault (default: nan)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "demo_nan.png", help="the PNG to write")
    args = parser.parse_args()
    print(f"readme_figure: wrote {draw(args.fault, args.out)}")


if __name__ == "__main__":
    main()
