"""Symmetric INT8 fake quantization and the error measures of the quantization probe (pure torch).

Formulas (``b = 8`` bits, ``Q = 2^(b-1) - 1 = 127``):

- scale ``s = max|w| / Q`` over the whole tensor (per-tensor) or over each output channel, dimension 0
  (per-channel); a zero maximum gives ``s = 1``.
- ``q = clamp(round(w / s), -Q, Q)`` (``round`` half to even, as ``torch.round``); ``ŵ = q · s``.
- max quantization error in percent of the scale (seed 000 §5.1): ``max|w - ŵ| / s · 100``; per-channel, the
  largest over the channels of each channel's error over its own scale. Without clipping it is at most 50%.
- weight outlier ratio: ``max|w| / quantile(|w|, 0.99)``; input (activation) outlier ratio: the largest channel
  maximum over the median channel maximum.
- relative output MSE of a layer: the mean over its output channels ``c`` of ``Σ(y_c - ŷ_c)^2 / Σy_c^2``
  (noise-to-signal power per channel; sums over the batch and positions).

Dynamic activation quantization uses the same per-tensor formula on each input, with the scale computed from
that input (no clipping, no calibration).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch

__all__ = [
    "INT8_MAX",
    "QUANTILE_SAMPLE",
    "Granularity",
    "LayerErrorAccumulator",
    "channel_outlier_ratio",
    "fake_quantize",
    "max_error_pct_of_scale",
    "outlier_ratio",
    "quantize_symmetric",
    "relative_error",
]

Granularity = Literal["per_tensor", "per_channel"]
INT8_MAX = 127
#: The percentile of |w| an outlier is compared with.
OUTLIER_QUANTILE = 0.99
#: At most this many weights are sampled for the percentile (``torch.quantile``'s input limit is 2^24).
QUANTILE_SAMPLE = 1 << 20


def _scale(x: torch.Tensor, granularity: Granularity) -> torch.Tensor:
    x = x.detach().float()
    if granularity == "per_channel" and x.dim() > 1:
        amax = x.abs().reshape(x.shape[0], -1).amax(dim=1).reshape(-1, *([1] * (x.dim() - 1)))
    else:
        amax = x.abs().amax()
    scale = amax / INT8_MAX
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def quantize_symmetric(x: torch.Tensor, granularity: Granularity = "per_tensor") -> tuple[torch.Tensor, torch.Tensor]:
    """INT8 codes and scales of ``x`` (symmetric, zero point 0).

    Returns:
        ``(q, scale)``: ``q`` an ``int8`` tensor of ``x``'s shape; ``scale`` a 0-d tensor (per-tensor) or one of
        shape ``(C, 1, ...)`` broadcasting over ``x`` (per-channel, channel = dimension 0).

    Example:
        >>> q, s = quantize_symmetric(torch.tensor([-1.27, 0.5, 1.27]))
        >>> q.tolist(), round(float(s), 4)
        ([-127, 50, 127], 0.01)
    """
    scale = _scale(x, granularity)
    q = torch.clamp(torch.round(x.detach().float() / scale), -INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def fake_quantize(x: torch.Tensor, granularity: Granularity = "per_tensor") -> torch.Tensor:
    """``x`` quantized to INT8 and back (``q · s``), in ``x``'s dtype."""
    q, scale = quantize_symmetric(x, granularity)
    return (q.float() * scale).to(x.dtype)


def max_error_pct_of_scale(x: torch.Tensor, granularity: Granularity = "per_tensor") -> float:
    """Seed 000 §5.1's "max quantization error": ``max|x - x̂| / scale · 100`` (percent of the INT8 step).

    Example:
        >>> round(max_error_pct_of_scale(torch.tensor([1.27, 0.005])), 1)
        50.0
    """
    q, scale = quantize_symmetric(x, granularity)
    err = (x.detach().float() - q.float() * scale).abs() / scale
    return float(err.max()) * 100.0 if err.numel() else 0.0


def outlier_ratio(w: torch.Tensor, quantile: float = OUTLIER_QUANTILE) -> float:
    """``max|w| / quantile(|w|, q)``: how far the largest weight sits above the bulk (inf when the bulk is 0).

    Example:
        >>> w = torch.ones(1000); w[0] = 200.0
        >>> outlier_ratio(w)
        200.0
    """
    a = w.detach().float().abs().flatten()
    if a.numel() == 0:
        return 0.0
    if a.numel() > QUANTILE_SAMPLE:
        a_sample = a[torch.linspace(0, a.numel() - 1, QUANTILE_SAMPLE, device=a.device).long()]
    else:
        a_sample = a
    bulk = float(torch.quantile(a_sample, quantile))
    top = float(a.max())
    if bulk <= 0:
        return 0.0 if top <= 0 else float("inf")
    return top / bulk


def channel_outlier_ratio(
    x: torch.Tensor, channel_dim: int = -1, reduce_max: Callable[[torch.Tensor], torch.Tensor] | None = None
) -> float:
    """``max_c max|x_c| / median_c max|x_c|``: how far the loudest channel of an activation sits above a typical
    channel (what a per-tensor activation scale has to cover; SmoothQuant's outlier channels).

    ``reduce_max`` takes the per-channel maxima to their elementwise maximum over the ranks (data parallelism: the
    ratio of the global batch).

    Example:
        >>> x = torch.ones(4, 8); x[:, 2] = 50.0
        >>> channel_outlier_ratio(x)
        50.0
    """
    a = x.detach().float().abs()
    if a.dim() < 2 or a.numel() == 0:
        return 0.0
    amax = a.movedim(channel_dim, -1).reshape(-1, a.shape[channel_dim]).amax(dim=0)
    if reduce_max is not None:
        amax = reduce_max(amax)
    top, typical = float(amax.max()), float(amax.median())
    if typical <= 0:
        return 0.0 if top <= 0 else float("inf")
    return top / typical


def relative_error(reference: float, value: float, floor: float) -> float:
    """``|value - reference| / max(|reference|, floor)``.

    Example:
        >>> relative_error(2.0, 2.5, floor=0.01)
        0.25
    """
    return abs(value - reference) / max(abs(reference), floor)


class LayerErrorAccumulator:
    """Per-output-channel sums over batches of a layer's output error ``Σ(y - ŷ)^2`` and signal ``Σy^2``.

    Args:
        channel_dim: The output's channel dimension (``-1`` for ``nn.Linear``, ``1`` for ``nn.Conv*``).

    Example:
        >>> acc = LayerErrorAccumulator(channel_dim=-1)
        >>> acc.add(torch.tensor([[1.0, 100.0]]), torch.tensor([[0.0, 100.0]]))
        >>> acc.mse, acc.relative_mse
        (0.5, 0.5)
    """

    def __init__(self, channel_dim: int = -1) -> None:
        self.channel_dim = channel_dim
        self.squared_error: torch.Tensor | None = None
        self.signal: torch.Tensor | None = None
        self.count = 0

    def add(self, reference: torch.Tensor, quantized: torch.Tensor) -> None:
        """Add one batch of the float output and the quantized output."""
        ref = reference.detach().double()
        dim = self.channel_dim if ref.dim() > 1 else 0
        ref = ref.movedim(dim, -1).reshape(-1, ref.shape[dim]) if ref.dim() > 1 else ref.reshape(1, -1)
        diff = ref - (
            quantized.detach().double().movedim(dim, -1).reshape(ref.shape) if quantized.dim() > 1
            else quantized.detach().double().reshape(ref.shape)
        )
        err, sig = diff.pow(2).sum(dim=0), ref.pow(2).sum(dim=0)
        if self.squared_error is None or self.signal is None or self.squared_error.shape != err.shape:
            self.squared_error, self.signal = err, sig
        else:
            self.squared_error, self.signal = self.squared_error + err, self.signal + sig
        self.count += ref.numel()

    @property
    def mse(self) -> float:
        """Mean squared error of the output."""
        if self.squared_error is None or not self.count:
            return 0.0
        return float(self.squared_error.sum()) / self.count

    @property
    def relative_mse(self) -> float:
        """The mean over output channels of each channel's ``Σ(y - ŷ)^2 / Σy^2`` (channels whose output is
        exactly zero are left out), so that a channel with a large output does not hide the others' noise."""
        if self.squared_error is None or self.signal is None:
            return 0.0
        live = self.signal > 0
        if not bool(live.any()):
            return 0.0 if float(self.squared_error.sum()) == 0 else float("inf")
        return float((self.squared_error[live] / self.signal[live]).mean())
