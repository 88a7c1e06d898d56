"""What :class:`~lightning_diag.GradientFlowMonitor` writes from its measurements.

Split out of :mod:`lightning_diag.callbacks.gradient_flow.monitor`: a measured step's scalars under their ``diag/`` tags
(``grad_norm``, ``grad_rms``, ``grad_relative``, ``grad_blocks``), its gradient histograms (``grad_hist``,
counted on the device off the CPU) and, after the optimizer step, the weight norms and update ratios and the
``{layer: update ratio}`` the gradient rules observe. The callback decides when; nothing here runs on a quiet
step.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from lightning_diag.core.tags import (
    grad_blocks_tag,
    grad_hist_tag,
    grad_norm_tag,
    grad_relative_tag,
    grad_rms_tag,
    grad_total_tag,
    update_ratio_tag,
)
from lightning_diag.instrument.grad_measure import ParamIndex, StepMeasurement, update_norms, update_ratio_values
from lightning_diag.output.writer import DiagWriter
from lightning_diag.stats.histogram import cpu_histogram, tensorboard_histogram

__all__ = [
    "HISTOGRAM_MIN_STEPS",
    "histogram_due",
    "histogram_interval",
    "layer_update_ratios",
    "step_scalars",
    "update_values_from",
    "update_vector",
    "write_histogram",
    "write_histograms",
]


def step_scalars(m: StepMeasurement, position: int) -> dict[str, float]:
    """The scalars of one measured step of the optimizer at ``position``, by tag.

    With several optimizers ``diag/grad_norm/total`` is the first optimizer's (the others' get their own tags), and
    ``diag/grad_blocks/norm`` is the first optimizer's only.
    """
    values = {grad_total_tag(position): m.total}
    values.update({grad_norm_tag(layer): v for layer, v in m.norms.items()})
    values.update({grad_rms_tag(layer): v for layer, v in m.rms.items()})
    values.update({grad_relative_tag(layer): v for layer, v in m.relative.items()})
    if position == 0 and m.has_matrices:
        values[grad_blocks_tag()] = m.blocks
    return values


#: The fewest steps between two gradient histograms at the default interval (``histogram_every_n_steps=None``):
#: unchanged at Lightning's default ``log_every_n_steps=50`` (10 intervals of 50), and 5x fewer histograms at 10
#: (each costs 10-45 ms on a 1.1M-parameter model's CPU gradients; ``wandb.watch`` defaults to every 1000 steps).
HISTOGRAM_MIN_STEPS = 500


def histogram_interval(histogram_every_n_steps: int | None, every_n_steps: int) -> int:
    """The steps between two gradient histograms: ``histogram_every_n_steps`` when given (``0``: never); by default
    the smallest multiple of the measuring interval ``every_n_steps`` that is both 10 intervals or more and
    :data:`HISTOGRAM_MIN_STEPS` or more (a multiple, so that a histogram step is a measuring step).

    Example:
        >>> histogram_interval(None, 50), histogram_interval(None, 10), histogram_interval(None, 30)
        (500, 500, 510)
        >>> histogram_interval(None, 100), histogram_interval(100, 10), histogram_interval(0, 10)
        (1000, 100, 0)
    """
    if histogram_every_n_steps is not None:
        return histogram_every_n_steps
    return every_n_steps * max(10, -(-HISTOGRAM_MIN_STEPS // every_n_steps))


def histogram_due(histogram_every_n_steps: int | None, every_n_steps: int, cadence_step: int) -> bool:
    """Whether a measured step at ``cadence_step`` writes histograms: every :func:`histogram_interval` steps.

    Example:
        >>> histogram_due(None, 50, 500), histogram_due(None, 10, 100), histogram_due(None, 10, 500)
        (True, False, True)
        >>> histogram_due(10, 5, 50), histogram_due(0, 5, 50)
        (True, False)
    """
    every = histogram_interval(histogram_every_n_steps, every_n_steps)
    return bool(every) and cadence_step % every == 0


def write_histograms(
    writer: DiagWriter, index: ParamIndex, chosen: list[int], norms: dict[str, float], step: int
) -> None:
    """``diag/grad_hist/<parameter>`` of the ``chosen`` parameters (each with a gradient) whose layer's norm is
    finite (TensorBoard cannot bin NaN/Inf: ``AnomalyAlarm``'s business)."""
    for i in chosen:
        if not math.isfinite(norms[index.layers[index.layer_of[i]]]):
            continue
        write_histogram(writer, grad_hist_tag(index.names[i]), index.params[i].grad.detach(), step)  # type: ignore[union-attr]


def write_histogram(writer: DiagWriter, tag: str, grad: torch.Tensor, step: int) -> None:
    """One gradient histogram, as ``SummaryWriter.add_histogram`` writes it."""
    # On an accelerator the buckets are counted on the device (no copy of the gradient to the host, no host
    # sort); on the CPU a float32 gradient's buckets come from a table of its bits (no sort, the same fields as
    # add_histogram's), any other add_histogram itself.
    if grad.device.type == "cpu":
        data = cpu_histogram(grad)
        if data is None:
            writer.histogram(tag, grad, step)
            return
    else:
        data = tensorboard_histogram(grad)
    if data is not None:
        writer.histogram_raw(tag, data, step)


def update_vector(
    index: ParamIndex,
    pending: list[tuple[list[int], list[torch.Tensor], torch.Tensor | None]],
    reduce: Callable[[torch.Tensor], torch.Tensor] | None,
) -> tuple[list[list[int]], torch.Tensor | None]:
    """The device half of the update values: the chosen positions of each pending step and one float32 vector
    of their :func:`~lightning_diag.instrument.grad_measure.update_norms`, in order (``None`` when none is pending),
    to read on the host with the batch end's other values."""
    parts = [update_norms(index, chosen, before, reduce, squares) for chosen, before, squares in pending]
    if not parts:
        return [], None
    device = parts[0].device
    vector = parts[0] if len(parts) == 1 else torch.cat([p.to(device) for p in parts])
    return [chosen for chosen, _, _ in pending], vector


def update_values_from(index: ParamIndex, chosen: list[list[int]], host: list[float]) -> dict[str, float]:
    """``diag/weight_norm/<layer>`` and ``diag/update_ratio/<layer>`` of the steps measured in a batch, from the
    host values ``host`` of :func:`update_vector`'s vector."""
    size = 2 * len(index.layers)
    values: dict[str, float] = {}
    for k, positions in enumerate(chosen):
        values.update(update_ratio_values(index, positions, host[k * size : (k + 1) * size]))
    return values


def layer_update_ratios(index: ParamIndex, values: dict[str, float]) -> dict[str, float]:
    """``{layer: update ratio}`` from :func:`update_values_from`' output (the layers that have one)."""
    tags = {update_ratio_tag(layer): layer for layer in index.layers}
    return {tags[k]: v for k, v in values.items() if k in tags}
