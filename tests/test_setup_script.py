"""scripts/setup.sh: the demo installs the package alone, the tests the extras; torch first; a stamp skips pip
(issue 46). Run against a fake ``.venv/bin/python`` that records its calls: no network, no pip."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

FAKE_PYTHON = """#!/usr/bin/env bash
echo "$*" >> "$(dirname "$0")/../calls.log"
case "$*" in
  *importlib.metadata*) echo "torch==2.13.0+cpu" ;;
esac
exit 0
"""


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "setup.sh", tmp_path / "scripts" / "setup.sh")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    python = tmp_path / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    return tmp_path


def _setup(repo: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    log = repo / ".venv" / "calls.log"
    log.unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    done = subprocess.run(["bash", "scripts/setup.sh", *args], cwd=repo, capture_output=True, text=True, env=env,
                          timeout=60)
    return done, log.read_text().splitlines() if log.exists() else []


def _installs(calls: list[str]) -> list[str]:
    return [c.split(" install ", 1)[1] for c in calls if "-m pip install" in c]


def test_the_demo_installs_torch_first_then_the_package_without_extras(repo):
    done, calls = _setup(repo, "demo")
    assert done.returncode == 0, done.stderr
    installs = _installs(calls)
    assert len(installs) == 2 and installs[0].endswith("torch==2.13.0")
    assert installs[1].endswith("-c .venv/.torch-constraint -e .")  # no extra: no [dev], [plots], [foreign]
    assert (repo / ".venv" / ".torch-constraint").read_text() == "torch==2.13.0+cpu\n"
    assert (repo / ".venv" / ".lightning-diag-demo").read_bytes() == (repo / "pyproject.toml").read_bytes()
    assert "setup (demo): installing torch==2.13.0 (CPU build)" in done.stdout


def test_a_second_run_calls_neither_pip_nor_python(repo):
    _setup(repo, "demo")
    done, calls = _setup(repo, "demo")
    assert done.returncode == 0 and calls == [] and done.stdout == ""


def test_the_tests_add_the_extras_held_at_the_installed_torch(repo):
    _setup(repo, "demo")
    done, calls = _setup(repo, "test")
    assert done.returncode == 0, done.stderr
    assert _installs(calls) == [
        "--quiet --no-compile --upgrade pip", "--quiet --no-compile -c .venv/.torch-constraint -e .[dev,plots,foreign]"
    ]
    assert _setup(repo)[1] == []  # no argument is "test", installed already
    assert _setup(repo, "demo")[1] == []  # the full install covers the demo


def test_a_changed_pyproject_reinstalls_and_a_bad_use_is_refused(repo):
    _setup(repo, "demo")
    with (repo / "pyproject.toml").open("a") as fh:
        fh.write("\n# changed\n")
    assert _installs(_setup(repo, "demo")[1])[-1].endswith("-e .")
    done, calls = _setup(repo, "docs")
    assert done.returncode == 2 and "usage: bash scripts/setup.sh [demo|test]" in done.stderr and calls == []


def test_demo_and_test_scripts_set_up_their_own_use():
    assert "bash scripts/setup.sh demo\n" in (ROOT / "scripts" / "demo.sh").read_text()
    assert "bash scripts/setup.sh test\n" in (ROOT / "scripts" / "test.sh").read_text()
    assert "bash scripts/test.sh" in (ROOT / ".ci" / "run").read_text()
