"""Finding or making the TensorBoard writer, and tag naming.

Scalars go through the trainer's :class:`~pytorch_lightning.loggers.TensorBoardLogger` writer when there is
one, so they land in the same run as the user's own metrics; otherwise the library opens its own
:class:`~torch.utils.tensorboard.SummaryWriter` at ``<trainer.log_dir>/diag``. Only global rank zero writes.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from typing import Any

import pytorch_lightning as pl
from pytorch_lightning.loggers import TensorBoardLogger

from lightning_diag.alerts import Alert

__all__ = ["DiagWriter", "alert_markdown", "sanitize_tag", "tag"]

log = logging.getLogger("lightning_diag")

TAG_PREFIX = "diag"
_BAD_TAG_CHARS = re.compile(r"[^A-Za-z0-9_.\-/]")


def _tensorboard_logger_types() -> tuple[type, ...]:
    """``TensorBoardLogger`` of ``pytorch_lightning``, and of the unified ``lightning`` package once it is in use."""
    types: list[type] = [TensorBoardLogger]
    if "lightning.pytorch" in sys.modules:  # never import the unified package for a user who does not use it
        from lightning.pytorch.loggers import TensorBoardLogger as UnifiedTensorBoardLogger

        types.append(UnifiedTensorBoardLogger)
    return tuple(types)


def sanitize_tag(part: str) -> str:
    """Make one tag component safe for TensorBoard (letters, digits, ``_ . - /``)."""
    return _BAD_TAG_CHARS.sub("_", part) or "_"


def tag(*parts: str) -> str:
    """Build a ``diag/...`` tag from components.

    Example:
        >>> tag("grad_norm", "encoder.layers.0")
        'diag/grad_norm/encoder.layers.0'
    """
    return "/".join([TAG_PREFIX, *(sanitize_tag(p) for p in parts)])


def alert_markdown(alert: Alert) -> str:
    """A markdown table row block for one alert, as shown in TensorBoard's Text tab."""
    value = "" if alert.value is None else f"{alert.value:.4g}"
    threshold = "" if alert.threshold is None else f"{alert.threshold:.4g}"
    message = alert.message.replace("|", "\\|").replace("\n", " ")
    return (
        "| severity | rule | source | epoch | step | value | threshold | message |\n"
        "|---|---|---|---|---|---|---|---|\n"
        f"| {alert.severity.value} | {alert.rule} | {alert.source} | {alert.epoch} | {alert.global_step} "
        f"| {value} | {threshold} | {message} |"
    )


class DiagWriter:
    """A thin, rank-aware wrapper over a ``SummaryWriter``.

    Args:
        experiment: The writer to use (a ``SummaryWriter`` or anything with its methods), or ``None`` to
            write nothing.
        owned: Whether this object opened the writer and must close it.
    """

    def __init__(self, experiment: Any | None, owned: bool = False) -> None:
        self.experiment = experiment
        self.owned = owned

    @classmethod
    def for_trainer(cls, trainer: pl.Trainer, log_dir: str) -> DiagWriter:
        """The trainer's TensorBoard writer, or a new one at ``<log_dir>/diag``; a no-op off rank zero."""
        if not trainer.is_global_zero:
            return cls(None)
        tensorboard_loggers = _tensorboard_logger_types()
        for lg in trainer.loggers:
            if isinstance(lg, tensorboard_loggers):
                return cls(getattr(lg, "experiment", None))
        from torch.utils.tensorboard import SummaryWriter

        path = os.path.join(log_dir, "diag")
        os.makedirs(path, exist_ok=True)
        return cls(SummaryWriter(log_dir=path), owned=True)

    @property
    def active(self) -> bool:
        """Whether anything is written."""
        return self.experiment is not None

    def scalar(self, name: str, value: float, step: int) -> None:
        """Write one scalar."""
        if self.experiment is not None:
            self.experiment.add_scalar(name, value, global_step=step)

    def scalars(self, values: dict[str, float], step: int) -> None:
        """Write several scalars, each under its own tag."""
        if self.experiment is not None:
            for name, value in values.items():
                self.experiment.add_scalar(name, value, global_step=step)

    def text(self, name: str, text: str, step: int) -> None:
        """Write markdown text."""
        if self.experiment is not None:
            self.experiment.add_text(name, text, global_step=step)

    def histogram(self, name: str, values: Any, step: int) -> None:
        """Write a histogram of a tensor or array."""
        if self.experiment is not None:
            self.experiment.add_histogram(name, values, global_step=step)

    def image(self, name: str, image: Any, step: int, dataformats: str = "HWC") -> None:
        """Write an image (uint8 or float array)."""
        if self.experiment is not None:
            self.experiment.add_image(name, image, global_step=step, dataformats=dataformats)

    def flush(self) -> None:
        """Flush pending events to disk."""
        if self.experiment is not None and hasattr(self.experiment, "flush"):
            self.experiment.flush()

    def close(self) -> None:
        """Flush, and close the writer if this object opened it."""
        if self.experiment is None:
            return
        self.flush()
        if self.owned:
            self.experiment.close()
        self.experiment = None
