"""Finding or making the TensorBoard writer, tag naming, and the custom-scalars dashboard layout.

Scalars go through the trainer's :class:`~pytorch_lightning.loggers.TensorBoardLogger` writer when there is
one, so they land in the same run as the user's own metrics; otherwise the library opens its own
:class:`~torch.utils.tensorboard.SummaryWriter` at ``<trainer.log_dir>/diag``. Only global rank zero writes.

At fit start the library writes :func:`dashboard_layout` (TensorBoard's Custom Scalars tab) and the thresholds
in effect (:func:`thresholds_markdown`, Text tab, tag ``diag/thresholds``). Threshold reference series are
scalars under ``diag/threshold/<rule>``, written by a callback at the steps of the series they belong to, so a
margin chart can use them as its band.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import pytorch_lightning as pl
from pytorch_lightning.loggers import TensorBoardLogger

from lightning_diag.alerts import Alert, alert_table_markdown
from lightning_diag.tags import (
    ALERTS_TAG,
    GRAD_LAYER_PATTERN,
    GRAD_TOTAL_PATTERN,
    TAG_PREFIX,
    THRESHOLDS_TAG,
    grad_total_tag,
    sanitize_tag,
    tag,
    threshold_tag,
)

__all__ = [
    "ALERTS_TAG",
    "MAX_ALERT_ROWS",
    "TAG_PREFIX",
    "THRESHOLDS_TAG",
    "DiagWriter",
    "alert_markdown",
    "alerts_markdown",
    "dashboard_layout",
    "sanitize_tag",
    "tag",
    "threshold_tag",
    "thresholds_markdown",
]

log = logging.getLogger("lightning_diag")

#: Rows of the alert table shown in TensorBoard; older alerts stay in ``alerts.jsonl``.
MAX_ALERT_ROWS = 200


def _tensorboard_logger_types() -> tuple[type, ...]:
    """``TensorBoardLogger`` of ``pytorch_lightning``, and of the unified ``lightning`` package once it is in use."""
    types: list[type] = [TensorBoardLogger]
    if "lightning.pytorch" in sys.modules:  # never import the unified package for a user who does not use it
        from lightning.pytorch.loggers import TensorBoardLogger as UnifiedTensorBoardLogger

        types.append(UnifiedTensorBoardLogger)
    return tuple(types)


def alert_markdown(alert: Alert) -> str:
    """A markdown table of one alert, as shown in TensorBoard's Text tab."""
    return "\n".join(alert_table_markdown([alert]))


def alerts_markdown(alerts: Sequence[Alert], max_rows: int = MAX_ALERT_ROWS) -> str:
    """Every alert so far as one markdown table, newest first (TensorBoard's Text tab).

    The library rewrites the whole table under ``diag/alerts`` at each new alert, so the entry of the latest
    step always holds the full list (TensorBoard keeps only a sample of older text entries).

    Example:
        >>> from lightning_diag.alerts import Severity
        >>> older = Alert("loss_swing", Severity.WARNING, "swings", 2, 40, 0.2, 0.1, "train_loss")
        >>> newer = Alert("nonfinite_loss", Severity.CRITICAL, "NaN", 3, 61, None, None, "loss")
        >>> table = alerts_markdown([older, newer])
        >>> table.index("nonfinite_loss") < table.index("loss_swing")
        True
    """
    # Newest first; alerts of one step in reverse order of writing.
    ordered = [a for _, a in sorted(enumerate(alerts), key=lambda ia: (ia[1].global_step, ia[0]), reverse=True)]
    shown = ordered[:max_rows]
    lines = [
        f"**{len(alerts)} alert{'s' if len(alerts) != 1 else ''}, newest first**",
        "",
        *alert_table_markdown(shown),
    ]
    if len(ordered) > len(shown):
        lines += ["", f"{len(ordered) - len(shown)} older alerts are in `diag/alerts.jsonl`."]
    return "\n".join(lines)


def thresholds_markdown(by_callback: Mapping[str, Mapping[str, float]]) -> str:
    """The thresholds in effect, one table row per callback and rule (or ``rule.setting``).

    Example:
        >>> print(thresholds_markdown({"GradientFlowMonitor": {"grad_explode": 10.0}}))
        | callback | rule or setting | value |
        |---|---|---|
        | GradientFlowMonitor | grad_explode | 10 |
    """
    lines = ["| callback | rule or setting | value |", "|---|---|---|"]
    for callback, values in by_callback.items():
        lines += [f"| {callback} | {key} | {value:.6g} |" for key, value in values.items()]
    return "\n".join(lines)


def dashboard_layout(rules: Collection[str]) -> dict[str, dict[str, list[Any]]]:
    """The custom-scalars layout for the rules in effect, in the form ``SummaryWriter.add_custom_scalars`` takes.

    Sections: ``Gradients`` (when a ``grad_*`` rule is in effect), ``Attention`` (an ``attn_*`` rule) and
    ``Loss & LR`` (a loss or validation rule). Multiline charts select tags by regular expression (matched
    from the start of the tag); their ``diag/threshold/<rule>`` series draw the thresholds as reference lines.
    The global gradient norm is a margin chart whose band is ``grad_vanish`` .. ``grad_explode``.

    Example:
        >>> sorted(dashboard_layout(["grad_explode", "loss_swing"]))
        ['Gradients', 'Loss & LR']
        >>> dashboard_layout(["grad_explode"])["Gradients"]["global gradient norm (band: grad_vanish .. grad_explode)"]
        ['Margin', ['diag/grad_norm/total', 'diag/threshold/grad_vanish', 'diag/threshold/grad_explode']]
    """
    p = TAG_PREFIX
    layout: dict[str, dict[str, list[Any]]] = {}
    if any(r.startswith("grad_") for r in rules):
        layout["Gradients"] = {
            "global gradient norm (band: grad_vanish .. grad_explode)": [
                "Margin",
                [grad_total_tag(), threshold_tag("grad_vanish"), threshold_tag("grad_explode")],
            ],
            "global gradient norm per optimizer": ["Multiline", [GRAD_TOTAL_PATTERN]],
            "gradient norm per layer (lines: grad_vanish, grad_explode)": [
                "Multiline",
                [GRAD_LAYER_PATTERN, f"{p}/threshold/grad_(vanish|explode)$"],
            ],
            "update-to-weight ratio per layer": ["Multiline", [f"{p}/update_ratio/"]],
            "weight norm per layer": ["Multiline", [f"{p}/weight_norm/"]],
        }
    if any(r.startswith("attn_") for r in rules):
        layout["Attention"] = {
            "attention entropy per layer, mean over heads, nats (lines: attn_entropy_low, attn_entropy_high)": [
                "Multiline",
                [f"{p}/attn_entropy/.*/mean$", f"{p}/threshold/attn_entropy_(low|high)$"],
            ],
            "attention entropy per head, nats": ["Multiline", [f"{p}/attn_entropy/.*/head_[0-9]+$"]],
            "attention mass on special tokens, smallest head (line: attn_sink)": [
                "Multiline",
                [f"{p}/attn_sink/", f"{p}/threshold/attn_sink$"],
            ],
        }
    if any(r.startswith(("loss_", "val_", "nonfinite_")) for r in rules):
        layout["Loss & LR"] = {
            "training and validation loss": ["Multiline", [f"{p}/loss/(train_step|train_epoch|train_window|val)$"]],
            "loss swing: relative change of the mean loss (line: loss_swing)": [
                "Multiline",
                [f"{p}/loss/swing$", f"{p}/threshold/loss_swing$"],
            ],
            "fluctuation: validation vs training": ["Multiline", [f"{p}/loss/(train|val)_fluctuation$"]],
            "learning rate per optimizer and group": ["Multiline", [f"{p}/lr/"]],
        }
    return layout


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

    def custom_scalars(self, layout: dict[str, dict[str, list[Any]]]) -> None:
        """Write a custom-scalars layout (see :func:`dashboard_layout`)."""
        if self.experiment is not None and layout:
            self.experiment.add_custom_scalars(layout)

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
