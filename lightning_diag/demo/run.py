"""``lightning-diag demo``: train the tiny transformer with every callback attached and summarise the alerts."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers import TensorBoardLogger

from lightning_diag.callbacks.common.base import DiagCallback
from lightning_diag.core.alerts import Alert
from lightning_diag.demo.faults import Fault, build_fault

if TYPE_CHECKING:
    from lightning_diag.demo.corpus import CorpusEntry

__all__ = ["DemoResult", "default_callbacks", "fault_callbacks", "quiet", "run_demo"]


def default_callbacks() -> list[DiagCallback]:
    """One instance of every callback the library has, with default settings."""
    from lightning_diag.callbacks.anomaly_alarm.alarm import AnomalyAlarm
    from lightning_diag.callbacks.attention_entropy.monitor import AttentionEntropyMonitor
    from lightning_diag.callbacks.gradient_flow.monitor import GradientFlowMonitor

    return [GradientFlowMonitor(), AnomalyAlarm(), AttentionEntropyMonitor()]


def fault_callbacks(entry: Fault | CorpusEntry) -> list[DiagCallback]:
    """The callbacks a fault or corpus entry needs beyond :func:`default_callbacks` (its ``callbacks`` field),
    built."""
    import lightning_diag

    return [getattr(lightning_diag, name)(**kwargs) for name, kwargs in entry.callbacks]


@dataclasses.dataclass
class DemoResult:
    """What a demo run produced."""

    fault: str
    alerts: list[Alert]
    log_dir: str
    global_step: int
    epochs: int

    def summary(self) -> str:
        """A short text summary: the alerts, and where the logs are."""
        lines = [f"lightning-diag demo --fault {self.fault}: trained {self.global_step} steps ({self.epochs} epochs)"]
        serious = [a for a in self.alerts if a.severity != "info"]
        if not self.alerts:
            lines.append("alerts: none")
        else:
            lines.append(f"alerts: {len(self.alerts)} ({len(serious)} warning or critical)")
            lines += [f"  - {a.format()}" for a in self.alerts]
        lines.append(f"alert log:   {os.path.join(self.log_dir, 'diag', 'alerts.jsonl')}")
        lines.append(f"TensorBoard: tensorboard --logdir {self.log_dir}")
        return "\n".join(lines)


def run_demo(
    fault: str = "none",
    max_epochs: int | None = None,
    root: str | None = None,
    seed: int = 0,
    callbacks: list[Any] | None = None,
    **trainer_kwargs: Any,
) -> DemoResult:
    """Train the demo model with one injected fault (or none) and return the alerts.

    Args:
        fault: A name from :data:`~lightning_diag.demo.faults.FAULTS`.
        max_epochs: Epochs to train; defaults to the fault's own.
        root: Directory for logs (default ``./diag_runs``).
        seed: Seed of data, model and trainer.
        callbacks: Callbacks to attach instead of :func:`default_callbacks`.
        **trainer_kwargs: Passed on to :class:`pytorch_lightning.Trainer`.
    """
    model, data, entry = build_fault(fault, seed=seed)
    root = root or os.path.join(os.getcwd(), "diag_runs")
    cbs = [*default_callbacks(), *fault_callbacks(entry)] if callbacks is None else callbacks
    pl.seed_everything(seed, verbose=False)
    kwargs: dict[str, Any] = {
        "max_epochs": max_epochs or entry.max_epochs,
        "logger": TensorBoardLogger(root, name=fault),
        "callbacks": cbs,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "enable_checkpointing": False,
        "log_every_n_steps": 5,
        "accelerator": "cpu",
        "deterministic": True,
    }
    kwargs.update(entry.trainer)
    kwargs.update(trainer_kwargs)
    trainer = pl.Trainer(**kwargs)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        warnings.filterwarnings("ignore", message=".*enable_nested_tensor.*")
        # Lightning 2.6's own use of a torch pytree API that torch deprecated: nothing the demo's user can act on.
        warnings.filterwarnings("ignore", message=".*isinstance\\(treespec, LeafSpec\\).*")
        # The `batch_rows` fault's own broadcast, which torch warns about: the fault is the demo's to show, through
        # `batch_size_mismatch`, not through a warning the user cannot act on.
        warnings.filterwarnings("ignore", message="Using a target size .* different to the input size")
        trainer.fit(model, datamodule=data)
    alerts = sorted((a for cb in cbs for a in getattr(cb, "alerts", [])), key=lambda a: a.global_step)
    return DemoResult(fault, alerts, trainer.log_dir or root, trainer.global_step, trainer.current_epoch)


@contextlib.contextmanager
def quiet(threads: int) -> Iterator[None]:
    """Torch threads set, warnings and library logs silenced; all restored afterwards (for the benchmarks)."""
    names = ("pytorch_lightning", "lightning.pytorch", "lightning_fabric", "lightning_diag")
    levels = {name: logging.getLogger(name).level for name in names}
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore")
            for name in names:
                logging.getLogger(name).setLevel(logging.CRITICAL + 1)
            yield
    finally:
        torch.set_num_threads(before)
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)
