"""Fused, device-side gradient measures. No host synchronisation happens here.

Every function takes a list of tensors and returns a tensor on their device, so callers decide when (and
whether) to copy a result to the host.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["all_finite", "max_abs", "total_norm"]


def total_norm(tensors: Sequence[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
    """The norm of the concatenation of ``tensors``, computed with one fused pass per device/dtype group.

    Example:
        >>> float(total_norm([torch.tensor([3.0]), torch.tensor([4.0])]))
        5.0
    """
    # An empty tensor adds nothing to any norm (the fused inf-norm kernel rejects it outright).
    nonempty = [t for t in tensors if t.numel() > 0]
    if len(nonempty) == 0:
        return torch.zeros((), device=tensors[0].device if len(tensors) else None)
    return torch.nn.utils.get_total_norm(nonempty, norm_type=norm_type, foreach=None)


def max_abs(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The largest absolute element over all ``tensors``; NaN if any element is NaN, Inf if any is Inf.

    Unlike the L2 norm this cannot overflow for large finite values, so it is the right test for
    non-finite entries.
    """
    return total_norm(tensors, norm_type=float("inf"))


def all_finite(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """A 0-d boolean tensor: whether every element of every tensor is finite.

    Example:
        >>> bool(all_finite([torch.ones(2), torch.tensor([1.0, float("nan")])]))
        False
        >>> bool(all_finite([]))
        True
    """
    return torch.isfinite(max_abs(tensors))
