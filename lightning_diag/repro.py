"""``lightning-diag repro --config CONFIG.yaml [--fraction 0.01]``: a LightningCLI configuration re-run on a
fraction of its data with every lightning_diag callback attached (seed 000's closing advice: reproduce a problem
on 1% of the data first), then its report."""

from __future__ import annotations

import math
from typing import Any

__all__ = ["all_callbacks", "run_repro"]


def all_callbacks() -> list[Any]:
    """One instance of every lightning_diag callback, with its defaults."""
    import lightning_diag as ld

    kinds = (ld.GradientFlowMonitor, ld.AnomalyAlarm, ld.AttentionEntropyMonitor, ld.DataDiagnostics,
             ld.SystemMonitor, ld.SharpnessProbe, ld.QuantizationProbe, ld.ErrorAnalysis, ld.RobustnessProbe)
    return [kind() for kind in kinds]


def _batches(loader_fn: Any) -> int | None:
    try:
        return len(loader_fn())
    except (TypeError, NotImplementedError, AttributeError):  # an iterable loader, or none defined
        return None


def run_repro(config: str, fraction: float = 0.01, extra_args: list[str] | None = None) -> str:
    """Fit the configuration on ``fraction`` of its train and validation batches (at least one of each) with
    every lightning_diag callback the configuration does not already have; return the run's log directory.

    The model and data classes come from the configuration's ``class_path`` entries (LightningCLI's subclass
    mode), so any ``fit`` configuration of ``LightningCLI`` works unchanged.
    """
    from pytorch_lightning.cli import LightningCLI

    cli = LightningCLI(
        None, None, subclass_mode_model=True, subclass_mode_data=True, run=False, save_config_callback=None,
        args=["--config", config, *(extra_args or [])],
    )
    trainer, model, data = cli.trainer, cli.model, cli.datamodule
    source = data if data is not None else model
    for limit, fn in (("limit_train_batches", "train_dataloader"), ("limit_val_batches", "val_dataloader")):
        total = _batches(getattr(source, fn, None))
        value: float | int = fraction if total is None else max(1, math.ceil(total * fraction))
        setattr(trainer, limit, value)
    present = {type(cb).__name__ for cb in trainer.callbacks}  # type: ignore[attr-defined]
    for cb in all_callbacks():
        if type(cb).__name__ not in present:
            trainer.callbacks.append(cb)  # type: ignore[attr-defined]
    trainer.fit(model, datamodule=data)
    return str(trainer.log_dir or trainer.default_root_dir)
