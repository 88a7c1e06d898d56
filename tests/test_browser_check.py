"""The dashboard in a real browser: scripts/browser_check.py against the nan demo run."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import launch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "browser_check.py"
sys.path.insert(0, str(SCRIPT.parent))
from browser_check import find_chromium  # noqa: E402

CHROMIUM = find_chromium()
IN_CI = os.environ.get("CI") == "true"


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    # Chromium starts a tree of processes: launch.run kills the whole group if the check times out or fails
    return launch.run([sys.executable, str(SCRIPT), *args], env=env, timeout=500)


def test_dashboard_renders_in_chromium(nan_run, tmp_path):
    if CHROMIUM is None:
        message = "Chromium is not installed (apt-get install chromium, or set $CHROMIUM)"
        if IN_CI:  # CI installs it (scripts/setup.sh): a missing browser there is a broken set-up, not a skip
            pytest.fail(f"CI=true but {message}; scripts/setup.sh should have installed it")
        pytest.skip(message)
    out = _run(str(Path(nan_run.log_dir).parent), "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout)
    assert summary["categories"] == ["Gradients", "Attention", "Loss & LR"]
    charts = summary["series_per_chart"]
    assert charts["Gradients / RMS gradient per element, per layer (line: grad_explode)"] > 2
    assert charts["Gradients / gradient L2 norm per layer"] > 2
    assert charts["Loss & LR / training and validation loss"] == 3
    assert charts["Attention / attention entropy per head, nats"] == 8  # 2 layers x 4 heads
    assert {"diag/alerts/text_summary", "diag/thresholds/text_summary"} <= set(summary["text_tags"])
    for name in ("custom_scalars", "text"):
        png = tmp_path / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 50_000


def test_bad_logdir_is_rejected(tmp_path):
    out = _run(str(tmp_path / "missing"))
    assert out.returncode == 2 and "not a directory" in out.stderr
