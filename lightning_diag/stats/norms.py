"""Fused, device-side gradient measures. No host synchronisation happens here.

Every function takes a list of tensors and returns a tensor on their device, so callers decide when (and
whether) to copy a result to the host. A sharded tensor (``DTensor``) is measured by this rank's local shard
(possibly empty): the result is this rank's, and a caller that needs the whole tensor's combines the ranks'
results (the non-finite guard's one collective does).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lightning_diag.stats.grad import local_tensor, per_tensor_norms

__all__ = ["all_finite", "fast_finite", "max_abs", "total_norm"]


def _local_nonempty(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    # An empty tensor (an empty local shard) adds nothing to any norm; the fused inf-norm kernel rejects it.
    local = [local_tensor(t) for t in tensors]
    return [t for t in local if t.numel() > 0]


def _device(tensors: Sequence[torch.Tensor]) -> torch.device | None:
    return local_tensor(tensors[0]).device if len(tensors) else None


def total_norm(tensors: Sequence[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
    """The norm of the concatenation of ``tensors`` (their local shards), with one fused pass per device/dtype
    group.

    Example:
        >>> float(total_norm([torch.tensor([3.0]), torch.tensor([4.0])]))
        5.0
    """
    nonempty = _local_nonempty(tensors)
    if len(nonempty) == 0:
        return torch.zeros((), device=_device(tensors))
    return torch.nn.utils.get_total_norm(nonempty, norm_type=norm_type, foreach=None)


def max_abs(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The largest absolute element over all ``tensors``; NaN if any element is NaN, Inf if any is Inf.

    Unlike the L2 norm this cannot overflow for large finite values, so it is the exact test for non-finite
    entries; on CPU it is about 13x slower than the fused L2 norm (see :func:`fast_finite`).
    """
    return total_norm(tensors, norm_type=float("inf"))


def all_finite(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """A 0-d boolean tensor: whether every element of every tensor is finite (exact, by :func:`max_abs`).

    Example:
        >>> bool(all_finite([torch.ones(2), torch.tensor([1.0, float("nan")])]))
        False
        >>> bool(all_finite([]))
        True
    """
    return torch.isfinite(max_abs(tensors))


def fast_finite(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """A 0-d boolean tensor from one fused L2 pass: ``True`` proves every element finite; ``False`` means a NaN or
    Inf, **or** a finite gradient whose squares overflow float32 (an L2 norm above about 1.8e19).

    A NaN or Inf element makes the norm NaN or Inf, so ``True`` is exact. Confirm a ``False`` with
    :func:`all_finite` before calling anything non-finite: the two together are exact, and the slow max-abs pass
    then runs only on the rare steps that fail the fast one. 16-bit tensors accumulate in float32, so their norm
    cannot overflow at float16's 65504.

    Example:
        >>> bool(fast_finite([torch.ones(3), torch.zeros(0)]))
        True
        >>> bool(fast_finite([torch.tensor([1.0, float("-inf")])]))
        False
        >>> bool(fast_finite([torch.full((4,), 1e30)])), bool(all_finite([torch.full((4,), 1e30)]))
        (False, True)
    """
    nonempty = _local_nonempty(tensors)
    if len(nonempty) == 0:
        return torch.ones((), dtype=torch.bool, device=_device(tensors))
    return torch.isfinite(per_tensor_norms(nonempty).sum())
