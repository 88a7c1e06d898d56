"""Tiny models, the shipped synthetic task and the fault library (demo, tests, benchmarks)."""

from lightning_diag.demo.faults import FAULTS, Fault, build_fault
from lightning_diag.demo.models import DemoConfig, TinyTransformerClassifier
from lightning_diag.demo.run import DemoResult, default_callbacks, run_demo
from lightning_diag.demo.synthetic import SyntheticDataModule, make_dataset

__all__ = [
    "FAULTS",
    "DemoConfig",
    "DemoResult",
    "Fault",
    "SyntheticDataModule",
    "TinyTransformerClassifier",
    "build_fault",
    "default_callbacks",
    "make_dataset",
    "run_demo",
]
