"""``lightning-diag repro --config CONFIG.yaml [--fraction 0.01]``: a LightningCLI configuration re-run on a
fraction of its data with every lightning_diag callback attached (seed 000's closing advice: reproduce a problem
on 1% of the data first), then its report.

Only run trusted configurations: as LightningCLI does, ``repro`` imports and runs whatever classes the
configuration's ``class_path`` entries name (model, data, callbacks, loggers), with the arguments it gives.
"""

from __future__ import annotations

import contextlib
import io
import math
import sys
from typing import Any

from lightning_diag.report.load import read_regular
from lightning_diag.report.text import clean, display

__all__ = ["ConfigError", "all_callbacks", "check_config", "run_repro"]


class ConfigError(ValueError):
    """A configuration ``repro`` cannot use; the message is one line naming the file and the problem."""


def check_config(config: str) -> dict[str, Any]:
    """Read ``config`` as YAML and return it, before LightningCLI sees it.

    Raises:
        ConfigError: If it is not a regular file, not UTF-8, not YAML (with the line and column), or not a
            mapping.
    """
    import yaml

    try:
        text = read_regular(config).decode("utf-8")
    except OSError as err:
        raise ConfigError(f"--config {display(config)}: cannot be read ({clean(err)})") from err
    except UnicodeDecodeError as err:
        raise ConfigError(f"--config {display(config)}: not UTF-8 text (byte {err.start})") from err
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or type(err).__name__
        raise ConfigError(f"--config {display(config)}: invalid YAML{where}: {clean(problem)}") from err
    except RecursionError as err:
        raise ConfigError(f"--config {display(config)}: invalid YAML: nested too deeply") from err
    if not isinstance(data, dict):
        raise ConfigError(
            f"--config {display(config)}: a LightningCLI configuration is a mapping (model:, data:, "
            f"trainer:), got {type(data).__name__}"
        )
    return data


def all_callbacks() -> list[Any]:
    """One instance of every lightning_diag callback, with its defaults."""
    import lightning_diag as ld

    kinds = (
        ld.GradientFlowMonitor,
        ld.AnomalyAlarm,
        ld.AttentionEntropyMonitor,
        ld.DataDiagnostics,
        ld.SystemMonitor,
        ld.SharpnessProbe,
        ld.QuantizationProbe,
        ld.ErrorAnalysis,
        ld.RobustnessProbe,
    )
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
    mode), so any ``fit`` configuration of ``LightningCLI`` works unchanged. Whatever a ``class_path`` names is
    imported and run: only run trusted configurations.

    Raises:
        ConfigError: If LightningCLI rejects the configuration (its usage is not printed; the error is kept).
    """
    from pytorch_lightning.cli import LightningCLI

    usage = io.StringIO()
    try:
        with contextlib.redirect_stderr(usage), contextlib.redirect_stdout(usage):
            cli = LightningCLI(
                None,
                None,
                subclass_mode_model=True,
                subclass_mode_data=True,
                run=False,
                save_config_callback=None,
                args=["--config", config, *(extra_args or [])],
            )
    except SystemExit as exit_:  # the parser printed its usage and an error: keep the error, in one line
        lines = [line.strip() for line in usage.getvalue().splitlines() if line.strip()]
        error = next((line for line in lines if line.startswith("error:")), lines[-1] if lines else f"exit {exit_}")
        raise ConfigError(f"--config {display(config)}: LightningCLI rejects it: {clean(error)[:500]}") from None
    sys.stderr.write(usage.getvalue())  # what the construction printed, when it went well
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
