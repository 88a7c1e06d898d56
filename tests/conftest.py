import logging
import warnings

import pytest


@pytest.fixture(autouse=True)
def _quiet():
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*enable_nested_tensor.*")
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    logging.getLogger("pytorch_lightning").setLevel(logging.WARNING)
    yield


@pytest.fixture(scope="session")
def nan_run(tmp_path_factory):
    """One `lightning-diag demo --fault nan` run shared by the report, dashboard and browser tests."""
    from lightning_diag.demo.run import run_demo

    root = tmp_path_factory.mktemp("nan_demo")
    result = run_demo(fault="nan", root=str(root))
    return result
