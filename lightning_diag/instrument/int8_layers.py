"""The INT8 engines of one layer (torchao's, or a fake-quant forward) and the weight-only measures of a plain or
sharded weight: what :class:`~lightning_diag.callbacks.probes.quantization.QuantizationProbe` quantizes with."""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lightning_diag.instrument.sharded_quant import (
    global_batch_fake_quantize,
    sharded_fake_quantize,
    sharded_max_error_pct,
    sharded_outlier_ratio,
)
from lightning_diag.instrument.sharding import uses_fsdp1
from lightning_diag.stats.grad import is_dtensor
from lightning_diag.stats.quantization import Granularity, fake_quantize, max_error_pct_of_scale, outlier_ratio

__all__ = [
    "fake_layer",
    "full_activation",
    "full_weights",
    "max_error_pct",
    "quantized",
    "torchao_available",
    "torchao_layer",
    "weight_outlier_ratio",
]

_TORCHAO: Any = None


def torchao_available() -> bool:
    """Whether ``torchao`` imports (its import messages about optional GPU kernels are silenced)."""
    global _TORCHAO
    if _TORCHAO is None:
        loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
        levels = [lg.level for lg in loggers]
        for lg in loggers:
            lg.setLevel(logging.ERROR)
        try:
            import torchao.quantization as tq

            _TORCHAO = tq
        except Exception:  # an optional extra that fails to import (any error) is simply not used
            _TORCHAO = False
        finally:
            for lg, level in zip(loggers, levels, strict=True):
                lg.setLevel(level)
    return _TORCHAO is not False


def quantized(x: torch.Tensor, granularity: Granularity) -> torch.Tensor:
    """INT8 round trip; a DTensor (a tensor-parallel weight or activation) with the full tensor's scale."""
    return sharded_fake_quantize(x, granularity) if is_dtensor(x) else fake_quantize(x, granularity)


def full_activation(t: Any) -> Any:
    """A tensor-parallel layer's output (or input) as the full activation; any other value as it is."""
    return t.full_tensor() if is_dtensor(t) else t


def fake_layer(
    module: nn.Linear | nn.Conv1d | nn.Conv2d | nn.Conv3d, granularity: Granularity, activations: bool,
    all_ranks: bool = False,
) -> Callable[[torch.Tensor], Any]:
    """``module``'s forward with an INT8 round trip of its weight (and, with ``activations``, of its input: the
    global batch's scale when ``all_ranks``)."""

    def forward(x: torch.Tensor) -> torch.Tensor:
        # Quantized at each call, never stored: at most one layer's quantized weight exists at a time.
        weight = quantized(module.weight, granularity)
        if not activations:
            xq = x
        elif all_ranks:  # the activation scale of the global batch, as one process would take it
            xq = global_batch_fake_quantize(x)
        else:
            xq = quantized(x, "per_tensor")
        if isinstance(module, nn.Linear):
            return nn.functional.linear(xq, weight, module.bias)
        return module._conv_forward(xq, weight, module.bias)

    return forward


def torchao_layer(module: nn.Linear, granularity: Granularity, activations: bool) -> Callable[[torch.Tensor], Any]:
    """A copy of ``module`` quantized by torchao (:func:`torchao_available` first)."""
    tq = _TORCHAO
    gran = tq.PerTensor() if granularity == "per_tensor" else tq.PerRow()
    kind = tq.Int8DynamicActivationInt8WeightConfig if activations else tq.Int8WeightOnlyConfig
    # set_inductor_config=False: torchao would otherwise change torch._inductor's global config for the whole run
    config = kind(granularity=gran, set_inductor_config=False)
    layer = copy.deepcopy(module)
    tq.quantize_(layer, config)
    return layer


def full_weights(module: nn.Module, deepspeed: bool = False) -> contextlib.AbstractContextManager[Any]:
    """FSDP1 keeps flat local shards outside forward: its documented ``summon_full_params`` (read-only) gives the
    weight-only measures the layers' real weights; DeepSpeed ZeRO-3 likewise with ``deepspeed.zero.
    GatheredParameters`` (a no-op below stage 3). Neither is run here (both need CUDA in Lightning). FSDP2 and
    tensor parallelism need nothing: their DTensor weights are measured from the shards."""
    if deepspeed:
        import deepspeed as ds

        return ds.zero.GatheredParameters(list(module.parameters()), modifier_rank=None)
    if not uses_fsdp1(module):
        return contextlib.nullcontext()
    from torch.distributed.fsdp import FullyShardedDataParallel

    return FullyShardedDataParallel.summon_full_params(module, writeback=False)


def max_error_pct(w: torch.Tensor, granularity: Granularity) -> float:
    """The largest INT8 error of weight ``w`` in % of its scale (a sharded one's measured from its shards)."""
    return sharded_max_error_pct(w, granularity) if is_dtensor(w) else max_error_pct_of_scale(w, granularity)


def weight_outlier_ratio(w: torch.Tensor) -> float:
    """``max|w| / quantile(|w|, 0.99)`` of weight ``w`` (a sharded one's measured from its shards)."""
    return sharded_outlier_ratio(w) if is_dtensor(w) else outlier_ratio(w)
