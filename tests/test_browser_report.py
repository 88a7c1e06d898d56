"""The HTML report in a real browser: scripts/browser_check_report.py against the nan demo run."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import launch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "browser_check_report.py"
sys.path.insert(0, str(SCRIPT.parent))
from browser_check import find_chromium  # noqa: E402

CHROMIUM = find_chromium()


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    # Chromium starts a tree of processes: launch.run kills the whole group if the check times out or fails
    return launch.run([sys.executable, str(SCRIPT), *args], env=env, timeout=500)


@pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed (apt-get install chromium, or set $CHROMIUM)")
def test_html_report_renders_in_chromium(nan_run, tmp_path):
    out = _run(str(Path(nan_run.log_dir).parent), "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout)
    assert summary["plots"] == ["attn_entropy.png", "grad_norms.png", "loss.png"]
    assert summary["images_in_dom"] == 3
    assert summary["checklist_rows"] >= 10
    png = Path(summary["screenshot"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 100_000


def test_bad_logdir_is_rejected(tmp_path):
    out = _run(str(tmp_path / "missing"))
    assert out.returncode == 2 and "not a directory" in out.stderr
