import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_grad_norm_benchmark_runs_and_reports_a_ratio():
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "grad_norm.py"), "--repeats", "3"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("| GradientFlowMonitor")]
    assert len(rows) == 1 and rows[0].rstrip(" |").endswith("x")


def test_grad_norm_benchmark_rejects_bad_device():
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "grad_norm.py"), "--device", "tpu"], capture_output=True, text=True
    )
    assert out.returncode == 2 and "invalid choice" in out.stderr
