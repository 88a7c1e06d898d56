"""QuantizationProbe: how much INT8 quantization of the Linear/Conv layers would cost, measured at validation end."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import statistics
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Literal

import pytorch_lightning as pl
import torch
from torch import nn

from lightning_diag.callbacks.common.base import AlertHandler, RuleChoices
from lightning_diag.callbacks.common.preset import Detector, Preset
from lightning_diag.callbacks.probes.probe import LossFn, ProbeError, ValidationProbe, uses_deepspeed
from lightning_diag.core.alerts import Alert
from lightning_diag.core.tags import quant_layer_tag, quant_tag
from lightning_diag.core.validation import check_bool, check_choice
from lightning_diag.instrument.int8_layers import (
    fake_layer,
    full_activation,
    full_weights,
    max_error_pct,
    torchao_available,
    torchao_layer,
    weight_outlier_ratio,
)
from lightning_diag.instrument.sharding import reshard_fsdp
from lightning_diag.rules.measures import Measures, QuantizationReading
from lightning_diag.rules.quantization_error import QUANTIZATION_ERROR, QuantizationErrorRule
from lightning_diag.stats.quantization import Granularity, LayerErrorAccumulator, channel_outlier_ratio, relative_error

__all__ = ["QuantizationProbe", "QuantizationResult", "torchao_available"]

Backend = Literal["auto", "fake", "torchao"]
#: A loss below this counts as this small when the end-to-end change is made relative to it.
LOSS_FLOOR = 0.05
_CONV = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
@dataclasses.dataclass(frozen=True)
class QuantizationResult:
    """One probe: per-layer measures under the judged scheme and per-channel, and the end-to-end change.

    Attributes:
        loss: The float validation loss (mean over the probe's batches).
        quantized_loss: The loss with every measured layer quantized.
        end_to_end: ``|quantized_loss - loss| / max(|loss|, LOSS_FLOOR)`` (0.05).
        relative_mse: Layer -> relative output MSE under the judged scheme.
        relative_mse_per_channel: Layer -> relative output MSE with per-channel weight scales.
        output_mse: Layer -> output MSE under the judged scheme.
        max_error_pct: Layer -> max weight quantization error in % of the scale (seed 000 §5.1).
        outliers: Layer -> ``max|w| / quantile(|w|, 0.99)``.
        input_outliers: Layer -> the largest over the batches of its input's loudest channel maximum over the
            median channel maximum (what a per-tensor activation scale has to cover).
        backend: ``"torchao"`` or ``"fake"`` (the engine of the Linear layers; Conv layers are always fake).
        change_noise: The standard error of the loss change, relative like ``end_to_end``: the standard deviation
            of the per-batch changes ``quantized - float`` over the square root of the batch count, over every
            rank's batches when sharded (``nan`` with one batch).
    """

    loss: float
    quantized_loss: float
    end_to_end: float
    relative_mse: dict[str, float]
    relative_mse_per_channel: dict[str, float]
    output_mse: dict[str, float]
    max_error_pct: dict[str, float]
    outliers: dict[str, float]
    input_outliers: dict[str, float]
    backend: str
    change_noise: float = math.nan


class QuantizationProbe(ValidationProbe):
    """Simulates INT8 quantization of a copy of the model's ``nn.Linear`` / ``nn.Conv1d/2d/3d`` layers.

    At the end of validation, every ``every_n_epochs`` epochs, global rank zero runs ``num_batches`` validation
    batches twice in eval mode: once in float, with forward hooks feeding each layer's own input to its quantized
    copy (per-layer output error, under the judged ``granularity`` and under per-channel scales), and once with
    every layer's output replaced by its quantized copy's (the end-to-end change of the loss). The model's
    parameters are never modified; the training state (parameters, gradients, optimizer, RNG, BatchNorm
    statistics) is exactly as before.

    Engines: ``backend="torchao"`` quantizes copies of the Linear layers with torchao (``Int8WeightOnlyConfig``,
    or ``Int8DynamicActivationInt8WeightConfig`` with ``activations``; ``PerTensor`` / ``PerRow`` granularity);
    Conv layers, which torchao's INT8 configs leave in float on CPU, always use the fake-quant path: symmetric
    INT8, ``s = max|w| / 127`` per tensor or per output channel, ``ŵ = clamp(round(w/s), -127, 127) · s``, inputs
    quantized per tensor with their own scale (dynamic). ``"auto"`` (default) uses torchao when it is installed
    (``pip install lightning-diag[quant]``), else the fake path; ``"fake"`` always the fake path.

    Sharded models (FSDP2, tensor parallelism; every rank measures at once on its own batches): the error is
    that of the full weight, measured from its shards without gathering it (see docs/quantization_probe.md): the
    INT8 scale is the full weight's absolute maximum (each shard's, one all-reduce MAX over the mesh dimensions
    that shard it), each rank quantizes its own shard, the layer's output error and signal sums are summed over
    the ranks, the losses averaged. The fake path is used there (torchao's modules take no DTensor weight).

    Cost per probe: 2 forwards on ``num_batches`` batches plus one quantized matmul/conv per layer and pass
    (x2 for the per-channel comparison); the fake path quantizes each weight at each call (one layer's copy at a
    time), the torchao path holds INT8 copies of the Linear layers (two with the per-channel comparison) for the
    probe's duration.

    Args:
        granularity: The judged weight scheme, ``"per_tensor"`` or ``"per_channel"``.
        activations: Also quantize each layer's input (dynamic, per tensor) - W8A8; else weight-only (W8A16).
        backend: ``"auto"``, ``"fake"`` or ``"torchao"`` (raises at construction when torchao is missing).
        every_n_epochs: Probe every this many epochs.
        num_batches: Validation batches per probe.
        loss_fn: ``loss_fn(pl_module, batch)`` returning the loss; default ``training_step(batch, batch_idx)``
            with ``self.log`` silenced.
        rules: ``{"quantization_error": {"threshold": ...}}``: the rule's threshold and settings
            (docs/thresholds.md), or ``False`` to switch it off.
        on_alert: A callable receiving each :class:`~lightning_diag.core.alerts.Alert` as it is recorded (global
            rank zero, after it is written to ``alerts.jsonl``): send it to Slack, e-mail or a pager. A handler
            that raises is reported once per fit through the ``lightning_diag`` logger and never stops training.

    Logged (TensorBoard, step = global step): ``diag/quant/end_to_end``, ``diag/quant/loss_float``,
    ``diag/quant/loss_int8``, ``diag/quant/worst_layer_ratio`` (largest relative MSE / median),
    ``diag/quant/max_error_pct`` (largest over the layers), ``diag/quant/change_noise`` (the standard error of the
    end-to-end change, with 2 or more batches), and per layer ``diag/quant/layer/<layer>/
    relative_mse``, ``.../relative_mse_per_channel``, ``.../output_mse``, ``.../max_error_pct``,
    ``.../outlier_ratio``, ``.../input_outlier_ratio``; ``diag/threshold/quantization_error``.

    Raises:
        TypeError: If an argument has the wrong type.
        ValueError: If an argument is out of range, or ``backend="torchao"`` without torchao installed.

    Example:
        >>> QuantizationProbe(backend="fake").thresholds()["quantization_error"]
        0.05
    """

    #: Unique per configuration, so several probes can sit on one trainer and be checkpointed.
    state_key_arguments = ("granularity", "activations", "backend", "every_n_epochs")
    preset = Preset(
        "QuantizationProbe",
        (
            Detector(QuantizationErrorRule, "rule", "rules"),
        ),
    )

    def __init__(
        self,
        *,
        granularity: Granularity = "per_tensor",
        activations: bool = True,
        backend: Backend = "auto",
        every_n_epochs: int = 1,
        num_batches: int = 2,
        loss_fn: LossFn | None = None,
        rules: RuleChoices | None = None,
        on_alert: AlertHandler | None = None,
    ) -> None:
        super().__init__(
            every_n_epochs=every_n_epochs, num_batches=num_batches, loss_fn=loss_fn, rules=rules, on_alert=on_alert
        )
        self.granularity: Granularity = check_choice(  # type: ignore[assignment]
            "granularity", granularity, ("per_tensor", "per_channel")
        )
        self.activations = check_bool("activations", activations)
        self.backend: Backend = check_choice("backend", backend, ("auto", "fake", "torchao"))  # type: ignore[assignment]
        if backend == "torchao" and not torchao_available():
            raise ValueError("Expected argument `backend` to be 'auto' or 'fake' when torchao is not installed "
                             "(pip install 'lightning-diag[quant]'), but got 'torchao'")
        # the probe's one rule, checkpointed under "rules"
        self.add_preset()
        self.last_result: QuantizationResult | None = None

    @property
    def engine(self) -> str:
        """The engine of the Linear layers: ``"torchao"`` or ``"fake"``."""
        if self.all_ranks:  # torchao's quantized modules do not take DTensor weights: the fake path, exact
            return "fake"
        return "torchao" if self.backend != "fake" and torchao_available() else "fake"

    def _quantizer(
        self, module: nn.Linear | nn.Conv1d | nn.Conv2d | nn.Conv3d, granularity: Granularity
    ) -> Callable[[torch.Tensor], Any]:
        if isinstance(module, nn.Linear) and self.engine == "torchao":
            return torchao_layer(module, granularity, self.activations)
        return fake_layer(module, granularity, self.activations, self.all_ranks)

    def measure(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batches: list[tuple[int, Any]]
    ) -> QuantizationResult:
        """Per-layer and end-to-end errors on the captured batches."""
        layers = {
            name: m for name, m in pl_module.named_modules()
            if isinstance(m, (nn.Linear, *_CONV)) and isinstance(getattr(m, "weight", None), torch.Tensor)
            and m.weight.is_floating_point()
        }
        if not layers:
            raise ProbeError("the module has no nn.Linear or nn.Conv1d/2d/3d layer to quantize")
        with torch.no_grad():
            judged = {n: self._quantizer(m, self.granularity) for n, m in layers.items()}
            channel = (
                judged if self.granularity == "per_channel"
                else {n: self._quantizer(m, "per_channel") for n, m in layers.items()}
            )
            input_outliers: dict[str, float] = {}
            acc = {n: LayerErrorAccumulator(-1 if isinstance(m, nn.Linear) else 1) for n, m in layers.items()}
            acc_channel = {n: LayerErrorAccumulator(-1 if isinstance(m, nn.Linear) else 1) for n, m in layers.items()}

            reduce_max = (
                (lambda t: trainer.strategy.reduce(t.contiguous(), reduce_op="max")) if self.all_ranks else None
            )

            def compare(name: str) -> Callable[..., None]:
                def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
                    if args and isinstance(args[0], torch.Tensor) and isinstance(output, torch.Tensor):
                        reference = full_activation(output)
                        acc[name].add(reference, full_activation(judged[name](args[0])))
                        ratio = channel_outlier_ratio(full_activation(args[0]), acc[name].channel_dim, reduce_max)
                        input_outliers[name] = max(input_outliers.get(name, 0.0), ratio)
                        if channel is not judged:
                            acc_channel[name].add(reference, full_activation(channel[name](args[0])))

                return hook

            def replace(name: str) -> Callable[..., Any]:
                def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
                    if args and isinstance(args[0], torch.Tensor) and isinstance(output, torch.Tensor):
                        return judged[name](args[0]).to(output.dtype)
                    return None

                return hook

            owned = [(i, self.own_batch(b)) for i, b in batches]
            # Sharded: the hooks run first (prepend), while FSDP2 still holds the gathered weight and before
            # tensor parallelism turns the output DTensor into a local tensor.
            first = self.all_ranks
            with _hooks(layers, compare, first):
                float_losses = self._batch_losses(trainer, pl_module, owned)
            with _hooks(layers, replace, first):
                quantized_losses = self._batch_losses(trainer, pl_module, owned)
            loss = self.mean_over_ranks(trainer, float_losses.mean())
            quantized_loss = self.mean_over_ranks(trainer, quantized_losses.mean())
            noise = _change_noise(trainer, quantized_losses - float_losses, self.all_ranks, loss)
            if self.all_ranks:
                _sum_over_ranks(trainer, [*acc.values(), *([] if channel is judged else acc_channel.values())])
                names = sorted(layers)
                peaks = torch.tensor([input_outliers.get(n, 0.0) for n in names], dtype=torch.float64,
                                     device=trainer.strategy.root_device)
                peaks = trainer.strategy.reduce(peaks, reduce_op="max") if peaks.numel() else peaks
                input_outliers = {n: v for n, v in zip(names, peaks.tolist(), strict=True) if n in input_outliers}
        if channel is judged:
            acc_channel = acc
        rel = {n: a.relative_mse for n, a in acc.items() if a.count}
        if self.all_ranks:
            reshard_fsdp(pl_module)  # weigh the shards, not the root's gathered copies of the last forward
        with full_weights(pl_module, uses_deepspeed(trainer)):
            max_error = {n: max_error_pct(layers[n].weight, self.granularity) for n in rel}
            outliers = {n: weight_outlier_ratio(layers[n].weight) for n in rel}
        if not rel:
            raise ProbeError("no nn.Linear/nn.Conv layer ran on a tensor input during the loss computation")
        return QuantizationResult(
            loss=loss,
            quantized_loss=quantized_loss,
            end_to_end=relative_error(loss, quantized_loss, LOSS_FLOOR),
            relative_mse=rel,
            relative_mse_per_channel={n: acc_channel[n].relative_mse for n in rel},
            output_mse={n: acc[n].mse for n in rel},
            max_error_pct=max_error,
            outliers=outliers,
            input_outliers={n: input_outliers.get(n, 0.0) for n in rel},
            backend=self.engine,
            change_noise=noise,
        )

    def _batch_losses(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batches: list[tuple[int, Any]]
    ) -> torch.Tensor:
        """The loss of each of ``batches`` (already owned), stacked (what ``mean_loss`` averages)."""
        return torch.stack([self.loss_on(trainer, pl_module, b, i).detach().float().reshape(()) for i, b in batches])

    def decide(self, trainer: pl.Trainer, result: QuantizationResult) -> list[Alert]:
        """Log the measurement and feed ``quantization_error``."""
        self.last_result = result
        finite = [v for v in result.relative_mse.values() if math.isfinite(v)]
        median = statistics.median(finite) if finite else 0.0
        worst = max(result.relative_mse.values())
        values = {
            quant_tag("end_to_end"): result.end_to_end,
            quant_tag("loss_float"): result.loss,
            quant_tag("loss_int8"): result.quantized_loss,
            quant_tag("worst_layer_ratio"): worst / median if median > 0 else 0.0,
            quant_tag("max_error_pct"): max(result.max_error_pct.values()),
            **self.threshold_lines(QUANTIZATION_ERROR),
        }
        if math.isfinite(result.change_noise):  # the report replays the rule with it
            values[quant_tag("change_noise")] = result.change_noise
        per_layer = {
            "relative_mse": result.relative_mse,
            "relative_mse_per_channel": result.relative_mse_per_channel,
            "output_mse": result.output_mse,
            "max_error_pct": result.max_error_pct,
            "outlier_ratio": result.outliers,
            "input_outlier_ratio": result.input_outliers,
        }
        for measure, by_layer in per_layer.items():
            values.update({quant_layer_tag(name, measure): v for name, v in by_layer.items()})
        self.writer.scalars(values, trainer.global_step)
        scheme = self.granularity.replace("_", "-") + (" W8A8" if self.activations else " weight-only")
        notes = {
            name: f"weights max/p99 {result.outliers[name]:.3g}, "
            f"input channels max/median {result.input_outliers[name]:.3g}"
            for name in result.relative_mse
        }
        reading = QuantizationReading(
            result.end_to_end, result.relative_mse, result.relative_mse_per_channel, scheme, notes, result.change_noise
        )
        return self.feed(self.context(trainer), Measures(quantization=reading))


def _change_noise(trainer: pl.Trainer, changes: torch.Tensor, all_ranks: bool, loss: float) -> float:
    """The standard error of the mean per-batch loss change ``quantized - float``, relative to ``loss``: the changes'
    sample standard deviation over the square root of their count; ``nan`` with fewer than 2 batches.

    When every rank measures, the batches are every data-parallel replica's: the ranks' mean change and mean squared
    change are averaged over the ranks (tensor-parallel ranks hold the same batches, so the mean over all ranks is
    the mean over the replicas) and the count is the local one times the replicas (``num_replicas`` of the
    strategy's ``distributed_sampler_kwargs``)."""
    c = changes.detach().double().reshape(-1)
    if c.numel() == 0:
        return math.nan
    n = float(c.numel())
    moments = torch.stack([c.mean(), (c * c).mean()])
    if all_ranks:
        moments = trainer.strategy.reduce(moments, reduce_op="mean")
        kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {}
        n *= int(kwargs.get("num_replicas", trainer.world_size))
    if n < 2:
        return math.nan
    mean, square = (float(v) for v in moments.tolist())
    variance = max(square - mean * mean, 0.0) * n / (n - 1)
    return math.sqrt(variance / n) / max(abs(loss), LOSS_FLOOR)


def _sum_over_ranks(trainer: pl.Trainer, accumulators: list[LayerErrorAccumulator]) -> None:
    """Each layer's error and signal sums and counts summed over the ranks (one all-reduce)."""
    live = [a for a in accumulators if a.squared_error is not None and a.signal is not None]
    if not live:
        return
    device = live[0].squared_error.device  # type: ignore[union-attr]
    counts = [torch.tensor([float(a.count)], dtype=torch.float64, device=device) for a in live]
    packed = torch.cat([torch.cat([a.squared_error, a.signal, c]) for a, c in zip(live, counts, strict=True)])  # type: ignore[list-item]
    packed = trainer.strategy.reduce(packed, reduce_op="sum")
    i = 0
    for a in live:
        n = a.squared_error.numel()  # type: ignore[union-attr]
        a.squared_error, a.signal = packed[i : i + n], packed[i + n : i + 2 * n]
        a.count = round(float(packed[i + 2 * n]))
        i += 2 * n + 1


@contextlib.contextmanager
def _hooks(
    layers: Mapping[str, nn.Module], make: Callable[[str], Callable[..., Any]], first: bool = False
) -> Iterator[None]:
    handles = [m.register_forward_hook(make(n), prepend=first) for n, m in layers.items()]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
