"""The custom-scalars dashboard layout and the TensorBoard text tables (tags are in :mod:`lightning_diag.core.tags`).

Where things are written is :class:`lightning_diag.output.writer.DiagWriter`: scalars to
every logger of the trainer, the rest to the trainer's TensorBoard writer when there is one, otherwise to a
:class:`~torch.utils.tensorboard.SummaryWriter` the library opens at ``<trainer.log_dir>/diag``. Only global
rank zero writes.

At fit start the library writes :func:`dashboard_layout` (TensorBoard's Custom Scalars tab) and the thresholds
in effect (:func:`thresholds_markdown`, Text tab, tag ``diag/thresholds``). Threshold reference series are
scalars under ``diag/threshold/<rule>``, written by a callback at the steps of the series they belong to, so a
chart draws them as reference lines over the same steps.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from lightning_diag.core.alerts import Alert, alert_table_markdown
from lightning_diag.core.registry import owner_of
from lightning_diag.core.tags import (
    GRAD_LAYER_PATTERN,
    GRAD_TOTAL_PATTERN,
    TAG_PREFIX,
)
from lightning_diag.rules.catalog import (
    ATTN_ENTROPY_HIGH,
    ATTN_ENTROPY_LOW,
    ATTN_SINK,
    DATA_LEAKAGE,
    DATA_VOCAB_SHIFT,
    DATALOADER_BOUND,
    DDP_DESYNC,
    GRAD_COLLAPSE,
    GRAD_EXPLODE,
    GRAD_VANISH,
    LABEL_IMBALANCE,
    LOSS_ON_PADDING,
    LOSS_SWING,
    POSITION_OVERFLOW,
    QUANTIZATION_ERROR,
    SHARP_MINIMUM,
    STEP_TIME_FLUCTUATION,
    UPDATE_NONE,
    UPDATE_STALE,
)

__all__ = ["MAX_ALERT_ROWS", "alerts_markdown", "dashboard_layout", "thresholds_markdown"]

log = logging.getLogger("lightning_diag")

#: Rows of the alert table shown in TensorBoard; older alerts stay in ``alerts.jsonl``.
MAX_ALERT_ROWS = 200


def alerts_markdown(alerts: Sequence[Alert], max_rows: int = MAX_ALERT_ROWS) -> str:
    """Every alert so far as one markdown table, newest first (TensorBoard's Text tab).

    The library rewrites the whole table under ``diag/alerts`` at each new alert, so the entry of the latest
    step always holds the full list (TensorBoard keeps only a sample of older text entries).

    Example:
        >>> from lightning_diag.core.alerts import Severity
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


def _judged(title: str, series: str, rule: str) -> dict[str, list[Any]]:
    """A chart of ``series`` with ``rule``'s threshold drawn as a line: ``{"<title> (line: <rule>)": [...]}``."""
    return {f"{title} (line: {rule})": ["Multiline", [series, f"{TAG_PREFIX}/threshold/{rule}$"]]}


def dashboard_layout(rules: Collection[str]) -> dict[str, dict[str, list[Any]]]:
    """The custom-scalars layout for the rules in effect, in the form ``SummaryWriter.add_custom_scalars`` takes.

    Sections: ``Gradients`` (when a ``grad_*`` rule is in effect), ``Attention`` (an ``attn_*`` rule),
    ``Loss & LR`` (a loss or validation rule), ``Data`` (a ``data_*`` rule or ``label_imbalance``), ``Probes``
    (``sharp_minimum``, ``quantization_error``) and ``System`` (a SystemMonitor rule). Multiline charts select tags
    by regular expression (matched from the start of the tag); their ``diag/threshold/<rule>`` series draw the
    thresholds as reference lines beside the quantity each rule judges: ``grad_explode`` beside the RMS gradient
    per element, ``grad_vanish`` beside ``||g|| / ||W||`` of the weight matrices.

    Example:
        >>> sorted(dashboard_layout(["grad_explode", "loss_swing"]))
        ['Gradients', 'Loss & LR']
        >>> dashboard_layout(["grad_explode"])["Gradients"]["RMS gradient per element, per layer (line: grad_explode)"]
        ['Multiline', ['diag/grad_rms/', 'diag/threshold/grad_explode$']]
    """
    p = TAG_PREFIX
    layout: dict[str, dict[str, list[Any]]] = {}
    if any(r.startswith("grad_") for r in rules):
        layout["Gradients"] = {
            **_judged("RMS gradient per element, per layer", f"{p}/grad_rms/", GRAD_EXPLODE),
            **_judged("relative gradient ||g|| / ||W|| per weight matrix", f"{p}/grad_relative/", GRAD_VANISH),
            f"gradient norm of the blocks' weight matrices ({GRAD_COLLAPSE} baseline)": [
                "Multiline",
                [f"{p}/grad_blocks/norm$"],
            ],
            "global gradient norm per optimizer": ["Multiline", [GRAD_TOTAL_PATTERN]],
            "gradient L2 norm per layer": ["Multiline", [GRAD_LAYER_PATTERN]],
            "update-to-weight ratio per layer": ["Multiline", [f"{p}/update_ratio/"]],
            "weight norm per layer": ["Multiline", [f"{p}/weight_norm/"]],
        }
    if any(r.startswith("attn_") for r in rules):
        layout["Attention"] = {
            f"attention entropy per layer, mean over heads, nats (lines: {ATTN_ENTROPY_LOW}, {ATTN_ENTROPY_HIGH})": [
                "Multiline",
                [f"{p}/attn_entropy/.*/mean$", f"{p}/threshold/({ATTN_ENTROPY_LOW}|{ATTN_ENTROPY_HIGH})$"],
            ],
            "attention entropy per head, nats": ["Multiline", [f"{p}/attn_entropy/.*/head_[0-9]+$"]],
            **_judged("attention mass on special tokens, smallest head", f"{p}/{ATTN_SINK}/", ATTN_SINK),
        }
    if any(r.startswith(("loss_", "val_", "nonfinite_")) and r != LOSS_ON_PADDING for r in rules):
        layout["Loss & LR"] = {
            "training and validation loss": ["Multiline", [f"{p}/loss/(train_step|train_epoch|train_window|val)$"]],
            **_judged("loss swing: relative change of the mean loss", f"{p}/loss/swing$", LOSS_SWING),
            "fluctuation: validation vs training": ["Multiline", [f"{p}/loss/(train|val)_fluctuation$"]],
            "learning rate per optimizer and group": ["Multiline", [f"{p}/lr/"]],
        }
    if any(owner_of(r) == "SystemMonitor" for r in rules):
        layout["System"] = {
            "step time and its parts, seconds per optimizer step": [
                "Multiline",
                [f"{p}/system/(step_time|data_wait|forward_backward|optimizer)_s$"],
            ],
            **_judged("data waiting / step time", f"{p}/system/data_wait_share$", DATALOADER_BOUND),
            **_judged("step-time fluctuation", f"{p}/system/{STEP_TIME_FLUCTUATION}$", STEP_TIME_FLUCTUATION),
            "throughput": ["Multiline", [f"{p}/system/(samples|tokens)_per_s$"]],
            "memory, MiB": ["Multiline", [f"{p}/system/.*_mib$"]],
            "GPU (NVML)": ["Multiline", [f"{p}/system/gpu_"]],
            "step time per rank": ["Multiline", [f"{p}/system/rank_[0-9]+/"]],
            "diagnostics' own share of the time, per callback": ["Multiline", [f"{p}/overhead/"]],
        }
    layout.update(_data_section(rules))
    layout.update(_probes_layout(rules))
    _add_silent_charts(layout, rules)
    return layout


def _add_silent_charts(layout: dict[str, dict[str, list[Any]]], rules: Collection[str]) -> None:
    """The silent-error charts (issue 22), in the sections of their callbacks: the share of sampled elements a
    step left unchanged in ``Gradients`` (``update_none`` / ``update_stale``), the replicas' checksum agreement in
    ``Loss & LR`` (``ddp_desync``, AnomalyAlarm's).

    Example:
        >>> layout = dashboard_layout(["ddp_desync"])
        >>> [k for k in layout["Loss & LR"] if "replica" in k]
        ['replica agreement: largest relative checksum difference across ranks (line: ddp_desync)']
    """
    p = TAG_PREFIX
    if any(r in rules for r in (UPDATE_NONE, UPDATE_STALE)):
        layout.setdefault("Gradients", {})[
            f"share of sampled elements a step left unchanged, per layer ({UPDATE_NONE}; line: {UPDATE_STALE})"
        ] = ["Multiline", [f"{p}/updates/", f"{p}/threshold/{UPDATE_STALE}$"]]
    if DDP_DESYNC in rules:
        chart = "replica agreement: largest relative checksum difference across ranks"
        layout.setdefault("Loss & LR", {}).update(_judged(chart, f"{p}/replicas/max_rel_diff$", DDP_DESYNC))


def _probes_layout(rules: Collection[str]) -> dict[str, dict[str, list[Any]]]:
    """The ``Probes`` section (SharpnessProbe, QuantizationProbe), when ``sharp_minimum`` or
    ``quantization_error`` is in effect."""
    p = TAG_PREFIX
    charts: dict[str, list[Any]] = {}
    if SHARP_MINIMUM in rules:
        charts.update(_judged("SAM gap L(w+eps) - L(w)", f"{p}/sharpness/gap$", SHARP_MINIMUM))
        charts["SAM gap relative to the loss"] = ["Multiline", [f"{p}/sharpness/relative_gap$"]]
        charts["SAM gap per layer (that layer perturbed alone)"] = ["Multiline", [f"{p}/sharpness/layer/"]]
    if QUANTIZATION_ERROR in rules:
        charts.update(_judged("INT8: end-to-end relative loss change", f"{p}/quant/end_to_end$", QUANTIZATION_ERROR))
        charts["INT8: relative output MSE per layer"] = ["Multiline", [f"{p}/quant/layer/.*/relative_mse$"]]
        charts["INT8: worst layer / median layer"] = ["Multiline", [f"{p}/quant/worst_layer_ratio$"]]
        charts["INT8: weight outliers (max / 99th percentile) per layer"] = [
            "Multiline", [f"{p}/quant/layer/.*/outlier_ratio$"]]
    return {"Probes": charts} if charts else {}


def _data_section(rules: Collection[str]) -> dict[str, dict[str, list[Any]]]:
    """The ``Data`` section: shown when a rule of DataDiagnostics (``data_*``, ``label_imbalance``) is in effect.

    Example:
        >>> sorted(_data_section(["label_imbalance"])["Data"])[0]
        'label balance: std of class proportions per split (line: label_imbalance)'
    """
    if not any(owner_of(r) == "DataDiagnostics" for r in rules):
        return {}
    p = TAG_PREFIX
    return {
        "Data": {
            **_judged(
                "label balance: std of class proportions per split", f"{p}/data/(train|val)/label_std$", LABEL_IMBALANCE
            ),
            **_judged("vocabulary shift: KL(val || train), nats", f"{p}/data/vocab_kl$", DATA_VOCAB_SHIFT),
            **_judged(
                "leakage: share of validation samples copying training ones",
                f"{p}/data/(leaked_fraction|exact_copies|near_copies)$",
                DATA_LEAKAGE,
            ),
            "unseen and rare validation tokens": ["Multiline", [f"{p}/data/(oov_share|val_rare_share)$"]],
            f"padding ratio per split, and share of label positions that are padding ({LOSS_ON_PADDING})": [
                "Multiline", [f"{p}/data/(train|val)/padding_ratio$", f"{p}/data/train/padding_label_share$"]],
            f"positions the longest sample uses, per split ({POSITION_OVERFLOW})": [
                "Multiline", [f"{p}/data/(train|val)/max_positions$"]],
        }
    }

