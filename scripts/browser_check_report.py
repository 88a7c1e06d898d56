#!/usr/bin/env python
"""Look at a run's ``lightning-diag report --format html`` in a real browser.

Writes the HTML report of LOGDIR with its plots into ``--out`` (``lightning-diag report LOGDIR --format html
--out OUT``), checks that every plot it links is a PNG on disk, has headless Chromium (Debian's ``chromium``
package, as ``browser_check.py`` uses for the dashboard) load the page and dump its DOM (the checklist table and
every ``<img>`` must be there), and screenshots the page into ``OUT/report.png``. Look at the PNG: the plots
must show lines and threshold lines, the checklist must be readable.

    python scripts/browser_check_report.py LOGDIR --out screenshots/

Prints a JSON summary. Exit codes: 0 done; 2 bad arguments; 3 Chromium is missing; 1 the check failed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import urllib.parse
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from browser_check import CHROMIUM_FLAGS, find_chromium, screenshot

_PNG = b"\x89PNG\r\n\x1a\n"


def dump_dom(chromium: str, url: str, wait_ms: int = 5000) -> str:
    """The DOM of ``url`` after Chromium loaded it (``--dump-dom``)."""
    with tempfile.TemporaryDirectory(prefix="diag-chromium-") as profile:
        cmd = [chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--virtual-time-budget={wait_ms}"]
        out = subprocess.run([*cmd, "--dump-dom", url], capture_output=True, text=True, timeout=180)
    if out.returncode != 0 or "<html" not in out.stdout:
        raise RuntimeError(f"Chromium could not load {url}: rc={out.returncode} {out.stderr[-800:]}")
    return out.stdout


def run_check(logdir: Path, out: Path, chromium: str, size: str = "1400,4000") -> dict:
    """Write the HTML report of ``logdir`` into ``out``, check it in Chromium, screenshot it; return a summary."""
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                                         os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "lightning_diag", "report", str(logdir), "--format", "html", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"lightning-diag report failed (rc={done.returncode}): {done.stderr[-1500:]}")
    page = out / "report.html"
    sources = re.findall(r"<img alt='[^']*' src='([^']+)'", page.read_text(encoding="utf-8"))
    if not sources:
        raise RuntimeError(f"{page} shows no plots")
    for src in sources:
        png = (out / urllib.parse.unquote(src)).resolve()  # links are URL-encoded
        if not png.is_file() or png.read_bytes()[:8] != _PNG:
            raise RuntimeError(f"{page} links {src}, which is not a PNG file")
    url = page.resolve().as_uri()
    dom = dump_dom(chromium, url)
    images = len(re.findall(r"<img ", dom))
    if images != len(sources):
        raise RuntimeError(f"Chromium's DOM has {images} images, the report {len(sources)}")
    for needle in ("<h3>Checklist</h3>", "<h3>Alert timeline</h3>", "<h3>Plots</h3>"):
        if needle not in dom:
            raise RuntimeError(f"Chromium's DOM lacks {needle}")
    shot = out / "report.png"
    screenshot(chromium, url, shot, size, 5000)
    plots = sorted(Path(s).name for s in sources)
    rows = dom.count("<tr class=")
    return {"plots": plots, "checklist_rows": rows, "images_in_dom": images, "screenshot": str(shot)}


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("logdir", help="a log directory with lightning_diag runs")
    parser.add_argument("--out", default="browser_check_report", help="directory for the report and screenshot")
    parser.add_argument("--size", default="1400,4000", help="browser window WIDTH,HEIGHT (default 1400,4000)")
    args = parser.parse_args(argv)
    logdir = Path(args.logdir)
    if not logdir.is_dir():
        print(f"browser_check_report: LOGDIR {args.logdir!r} is not a directory", file=sys.stderr)
        return 2
    chromium = find_chromium()
    if chromium is None:
        print("browser_check_report: Chromium not found (apt-get install chromium, or set $CHROMIUM)", file=sys.stderr)
        return 3
    try:
        summary = run_check(logdir, Path(args.out), chromium, args.size)
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as err:
        print(f"browser_check_report: FAILED: {err}", file=sys.stderr)
        return 1
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
