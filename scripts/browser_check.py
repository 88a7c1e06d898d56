#!/usr/bin/env python
"""Look at a run's lightning_diag dashboard in a real browser.

Starts ``tensorboard --logdir LOGDIR`` on localhost, checks over HTTP that the custom-scalars layout and the
alert / threshold texts are served, then screenshots the Custom Scalars and Text pages with headless Chromium
(Debian's ``chromium`` package) into ``--out``. Look at the PNGs: the charts must show lines, not
"no matching tags".

    python scripts/browser_check.py LOGDIR --out screenshots/

Exit codes: 0 done; 2 bad arguments; 3 a prerequisite is missing (Chromium); 1 the check failed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

CHROMIUM_NAMES = ("chromium", "chromium-browser")
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
)
PAGES = {"custom_scalars": "#custom_scalars", "text": "#text"}
EXPECTED_CATEGORIES = ("Gradients", "Attention", "Loss & LR")


def find_chromium() -> str | None:
    """The Chromium executable on PATH (``$CHROMIUM`` first), or ``None``."""
    for name in (os.environ.get("CHROMIUM"), *CHROMIUM_NAMES):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get_json(url: str) -> object:
    with urllib.request.urlopen(url, timeout=10) as response:  # localhost only
        return json.loads(response.read().decode("utf-8"))


def _wait_for_layout(base: str, deadline: float) -> dict:
    last_error = "no answer"
    while time.time() < deadline:
        try:
            layout = _get_json(f"{base}/data/plugin/custom_scalars/layout")
            if isinstance(layout, dict) and layout.get("category"):
                return layout
            last_error = "TensorBoard answered with an empty layout (still loading?)"
        except (urllib.error.URLError, OSError, ValueError) as err:
            last_error = str(err)
        time.sleep(1.0)
    raise RuntimeError(f"TensorBoard served no custom-scalars layout in time: {last_error}")


def _text_tags(base: str) -> list[str]:
    listing = _get_json(f"{base}/data/plugin/text/tags")
    tags: list[str] = []
    if isinstance(listing, dict):
        for run_tags in listing.values():
            tags += list(run_tags)
    return tags


def _chart_data(base: str, layout: dict) -> dict[str, int]:
    """For every chart of the layout, how many of its series TensorBoard serves (summed over runs)."""
    runs = _get_json(f"{base}/data/runs")
    counts: dict[str, int] = {}
    for category in layout["category"]:
        for chart in category.get("chart", []):
            title = f"{category['title']} / {chart['title']}"
            if "multiline" in chart:
                regexes = chart["multiline"].get("tag", [])
            else:
                series = chart.get("margin", {}).get("series", [])
                regexes = ["^" + re.escape(s["value"]) + "$" for s in series]
            found = 0
            for run in runs if isinstance(runs, list) else []:
                for regex in regexes:
                    query = urllib.parse.urlencode({"run": run, "tag": regex})
                    answer = _get_json(f"{base}/data/plugin/custom_scalars/scalars?{query}")
                    if isinstance(answer, dict):
                        found += len(answer.get("tag_to_events", {}))
            counts[title] = found
    return counts


def screenshot(chromium: str, url: str, path: Path, size: str, wait_ms: int) -> None:
    """Screenshot ``url`` into ``path`` with a fresh Chromium profile."""
    with tempfile.TemporaryDirectory(prefix="diag-chromium-") as profile:
        cmd = [
            chromium,
            *CHROMIUM_FLAGS,
            f"--user-data-dir={profile}",
            f"--window-size={size}",
            f"--virtual-time-budget={wait_ms}",
            f"--screenshot={path}",
            url,
        ]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    if out.returncode != 0 or not path.is_file() or path.stat().st_size < 10_000:
        raise RuntimeError(f"Chromium made no usable screenshot of {url}: rc={out.returncode} {out.stderr[-800:]}")


def run_check(logdir: Path, out: Path, chromium: str, size: str = "1600,2200", wait_ms: int = 20000) -> dict:
    """Serve ``logdir`` with TensorBoard, check the dashboard data, screenshot its pages; return a summary."""
    out.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    log = open(out / "tensorboard.log", "w", encoding="utf-8")  # noqa: SIM115 - closed in finally
    cmd = [sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir), "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--load_fast", "false", "--reload_interval", "2"]
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        layout = _wait_for_layout(base, time.time() + 90)
        categories = [c.get("title") for c in layout["category"]]
        missing = [c for c in EXPECTED_CATEGORIES if c not in categories]
        if missing:
            raise RuntimeError(f"layout lacks the categories {missing}; it has {categories}")
        charts = _chart_data(base, layout)
        for category in categories:
            if not any(n for title, n in charts.items() if title.startswith(f"{category} / ")):
                raise RuntimeError(f"no chart of {category!r} has data: {charts}")
        texts = _text_tags(base)
        if not any(t.startswith("diag/thresholds") for t in texts):
            raise RuntimeError(f"no diag/thresholds text is served; text tags: {texts}")
        shots = {}
        for name, fragment in PAGES.items():
            path = out / f"{name}.png"
            screenshot(chromium, f"{base}/{fragment}", path, size, wait_ms)
            shots[name] = str(path)
        return {"categories": categories, "series_per_chart": charts, "text_tags": texts, "screenshots": shots}
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("logdir", help="a log directory with lightning_diag runs")
    parser.add_argument(
        "--out", default="browser_check", help="directory for the screenshots (default: ./browser_check)"
    )
    parser.add_argument("--size", default="1600,2200", help="browser window WIDTH,HEIGHT (default 1600,2200)")
    parser.add_argument("--wait-ms", type=int, default=20000, help="virtual time the page gets to load (ms)")
    args = parser.parse_args(argv)
    logdir = Path(args.logdir)
    if not logdir.is_dir():
        print(f"browser_check: LOGDIR {args.logdir!r} is not a directory", file=sys.stderr)
        return 2
    chromium = find_chromium()
    if chromium is None:
        print("browser_check: Chromium not found (apt-get install chromium, or set $CHROMIUM)", file=sys.stderr)
        return 3
    try:
        summary = run_check(logdir, Path(args.out), chromium, args.size, args.wait_ms)
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as err:
        print(f"browser_check: FAILED: {err}", file=sys.stderr)
        return 1
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
