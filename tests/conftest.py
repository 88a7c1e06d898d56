import logging
import warnings
from pathlib import Path

import pytest

from tests import launch

ROOT = Path(__file__).resolve().parents[1]
# Where a run without `default_root_dir` (or with `logger=False` and no root) would write: never from a test.
STRAY_DIRS = ("diag", "diag_runs", "lightning_logs")


def _stray_files():
    bases = {ROOT, Path.cwd()}
    return {str(p) for base in bases for name in STRAY_DIRS if (base / name).is_dir() for p in (base / name).rglob("*")}


@pytest.fixture(scope="session", autouse=True)
def _no_process_left():
    """At the end of the session, fail if a process the suite launched (tests/launch.py) is still alive; kill it."""
    yield
    left = launch.leftovers()
    launch.kill_all()
    assert not left, f"processes launched by the suite still alive at its end ({{group: pids}}): {left}"


@pytest.fixture(autouse=True)
def _quiet():
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*enable_nested_tensor.*")
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    logging.getLogger("pytorch_lightning").setLevel(logging.WARNING)
    yield


@pytest.fixture(autouse=True)
def _no_output_in_the_repository(request):
    """Fail a test that writes run output into the working directory instead of ``tmp_path``."""
    before = _stray_files()
    yield
    written = sorted(_stray_files() - before)
    assert not written, f"{request.node.nodeid} wrote {written[:5]}: give the Trainer default_root_dir=tmp_path"


@pytest.fixture(scope="session")
def nan_run(tmp_path_factory):
    """One `lightning-diag demo --fault nan` run shared by the report, dashboard and browser tests."""
    from lightning_diag.demo.run import run_demo

    root = tmp_path_factory.mktemp("nan_demo")
    result = run_demo(fault="nan", root=str(root))
    before = sorted(str(p) for p in root.rglob("*"))
    yield result
    # read-only use: a test that needs to add to the run works on a copy (shutil.copytree into its tmp_path)
    added = sorted(set(str(p) for p in root.rglob("*")) - set(before))
    assert not added, f"a test wrote into the shared nan_run folder: {added[:5]}"
