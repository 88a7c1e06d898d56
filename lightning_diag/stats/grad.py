"""Grouped gradient norms: one fused norm pass per device/dtype group, reduced into per-group norms.

These are the measures behind ``GradientFlowMonitor``. Nothing here copies to the host.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch

__all__ = ["grouped_norms", "per_tensor_norms"]


def per_tensor_norms(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of each tensor, as one float32 vector on the first tensor's device.

    Tensors are bucketed by (device, dtype) and each bucket takes one multi-tensor norm kernel
    (``torch._foreach_norm``, the kernel ``clip_grad_norm_`` uses), so the cost does not grow with a Python
    loop over tensors on the device side.

    Example:
        >>> per_tensor_norms([torch.tensor([3.0, 4.0]), torch.tensor([1.0])]).tolist()
        [5.0, 1.0]
    """
    if len(tensors) == 0:
        return torch.zeros(0)
    device = tensors[0].device
    buckets: dict[tuple[torch.device, torch.dtype], list[int]] = defaultdict(list)
    for i, t in enumerate(tensors):
        buckets[(t.device, t.dtype)].append(i)
    out = torch.empty(len(tensors), dtype=torch.float32, device=device)
    for indices in buckets.values():
        norms = torch._foreach_norm([tensors[i] for i in indices])
        stacked = torch.stack([n.to(device=device, dtype=torch.float32) for n in norms])
        out[torch.tensor(indices, device=device)] = stacked
    return out


def grouped_norms(norms: torch.Tensor, group_of: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Combine per-tensor L2 norms into per-group L2 norms: ``sqrt(sum of squares)`` within each group.

    Args:
        norms: Per-tensor norms, shape ``[n]``.
        group_of: Group index of each tensor, shape ``[n]``, values in ``[0, num_groups)``.
        num_groups: Number of groups.

    Example:
        >>> grouped_norms(torch.tensor([3.0, 4.0, 1.0]), torch.tensor([0, 0, 1]), 2).tolist()
        [5.0, 1.0]
    """
    squares = torch.zeros(num_groups, dtype=torch.float32, device=norms.device)
    squares.index_add_(0, group_of.to(norms.device), norms.float() ** 2)
    return squares.sqrt()
