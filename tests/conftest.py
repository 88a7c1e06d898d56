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
