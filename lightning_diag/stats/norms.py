"""Fused, device-side gradient measures. No host synchronisation happens here.

Every function takes a list of tensors and returns a tensor on their device, so callers decide when (and
whether) to copy a result to the host. A sharded tensor (``DTensor``) is measured by this rank's local shard
(possibly empty): the result is this rank's, and a caller that needs the whole tensor's combines the ranks'
results (the non-finite guard's one collective does).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch

from lightning_diag.stats.grad import local_tensor, per_tensor_norms

__all__ = [
    "SUM_MIN_ELEMENTS",
    "all_finite",
    "fast_finite",
    "finite_probe",
    "max_abs",
    "nonfinite_flag",
    "norm_sum",
    "sums_pay",
    "total_norm",
]

#: The dtypes torch's CPU GradScaler check reads (:func:`nonfinite_flag`); others take the max-abs pass.
_CHECKED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
#: A 1.0 "inverse scale" for that check (it multiplies by it: 1.0 leaves every value as it is).
_ONE = torch.ones(1, dtype=torch.float32)
#: Mean elements per tensor from which :func:`finite_probe` sums each tensor on the CPU rather than running the
#: fused check-and-unscale: one operator per tensor (a few µs of dispatch) against half the pass's time per element
#: (0.07 ns an element on one thread, break-even near 35,000 elements).
SUM_MIN_ELEMENTS = 65536


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
    return torch.isfinite(norm_sum(tensors))


@torch.no_grad()
def norm_sum(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The sum of the L2 norms of ``tensors`` (their local shards), a 0-d float32 tensor on the first one's device
    (0 for none): finite exactly when :func:`fast_finite` is ``True``.

    One multi-tensor norm kernel per device/dtype group and one sum, without placing each norm at its index (what
    :func:`~lightning_diag.stats.grad.per_tensor_norms` does for callers that need them apart).

    Example:
        >>> float(norm_sum([torch.tensor([3.0, 4.0]), torch.tensor([1.0])]))
        6.0
    """
    nonempty = _local_nonempty(tensors)
    if len(nonempty) == 0:
        return torch.zeros((), device=_device(tensors))
    device, dtype = nonempty[0].device, nonempty[0].dtype
    if all(t.device == device and t.dtype == dtype for t in nonempty):
        # 16-bit tensors accumulate in float32: a float16 norm overflows past 65504.
        wide = torch.float32 if dtype in (torch.float16, torch.bfloat16) else None
        total = torch.stack(torch._foreach_norm(nonempty, 2, dtype=wide)).sum()
        return total if total.dtype == torch.float32 else total.to(torch.float32)
    return per_tensor_norms(nonempty).sum()


@torch.no_grad()
def nonfinite_flag(tensors: Sequence[torch.Tensor], found: torch.Tensor | None = None) -> torch.Tensor:
    """A 1-element float32 tensor that is 1.0 when any element of ``tensors`` is NaN or +-Inf and 0.0 otherwise:
    exact (huge finite values are finite), no host read.

    * CPU tensors: torch's own GradScaler check (``torch._amp_foreach_non_finite_check_and_unscale_`` with an
      inverse scale of 1.0: every value is written back unchanged, as ``GradScaler.unscale_`` does to the
      gradients), one pass that on one thread costs what the L2 norm does and 10-20x less than the max-abs one.
    * other devices, and dtypes that check does not read: the fused max-abs pass (:func:`all_finite`).

    Tensors are grouped by device and dtype in C++ (no per-tensor Python).

    Args:
        tensors: The tensors (this rank's local shards: pass ``local_tensor`` of a ``DTensor``): gradients or
            detached values, as the CPU check writes them back.
        found: A 1-element float32 tensor to OR the result into, on the first tensor's device.

    Example:
        >>> nonfinite_flag([torch.ones(3), torch.full((2,), 3e38)]).tolist()
        [0.0]
        >>> nonfinite_flag([torch.ones(3), torch.tensor([1.0, float("-inf")], dtype=torch.bfloat16)]).tolist()
        [1.0]
    """
    if found is None:
        device = local_tensor(tensors[0]).device if len(tensors) else torch.device("cpu")
        found = torch.zeros(1, dtype=torch.float32, device=device)
    if not len(tensors):
        return found
    try:
        groups = torch._C._group_tensors_by_device_and_dtype([list(tensors)], False)
        for (device, dtype), (lists, _) in groups.items():
            group = cast("list[torch.Tensor]", lists[0])  # no None: none was passed in
            if device.type == "cpu" and found.device.type == "cpu" and dtype in _CHECKED_DTYPES:
                torch._amp_foreach_non_finite_check_and_unscale_(group, found, _ONE)
            else:
                found.logical_or_((~all_finite(group)).to(found.device))
    except RuntimeError:
        # Tensors the fused kernels refuse (sparse gradients, a `.grad` set by hand to an expanded tensor, whose
        # elements share memory): one exact test per tensor, on this rare path only.
        found.logical_or_(torch.stack([_nonfinite_any(t).to(found.device) for t in tensors]).any())
    return found


def _nonfinite_any(tensor: torch.Tensor) -> torch.Tensor:
    values = tensor.coalesce().values() if tensor.is_sparse else tensor
    return ~torch.isfinite(values).all()


def sums_pay(tensors: Sequence[torch.Tensor], extra: int = 0) -> bool:
    """Whether :func:`finite_probe` sums each of ``tensors`` on the CPU (plus ``extra`` 0-d tensors, such as the
    step's losses): they average :data:`SUM_MIN_ELEMENTS` elements or more."""
    return sum(t.numel() for t in tensors) >= SUM_MIN_ELEMENTS * (len(tensors) + extra)


@torch.no_grad()
def finite_probe(
    tensors: Sequence[torch.Tensor], found: torch.Tensor | None = None, sums: bool | None = None
) -> torch.Tensor:
    """One fast pass: a 1-element float32 tensor that is 0.0 only if every element of ``tensors`` is finite
    (no host read).

    0.0 proves every element finite. Anything else (1.0, NaN) means a NaN or Inf, **or** finite values whose sum
    (CPU, large tensors) or L2 norm (other devices) overflowed: confirm it with the exact :func:`nonfinite_flag`
    before calling anything non-finite. The confirmation runs only on the rare steps that fail this pass.

    * CPU, tensors of :data:`SUM_MIN_ELEMENTS` elements or more on average: each tensor's sum (float32
      accumulation, read only, vectorised; a NaN or Inf anywhere makes it non-finite), their sum times 0. Half the
      time of the check below on the 1.1M-parameter MLP (80 against 150 µs on one thread), which writes every
      value back; it costs one operator per tensor, so many small tensors keep the check below.
    * CPU, smaller tensors: :func:`nonfinite_flag` itself (exact, one fused operator).
    * other devices: the sum of the fused multi-tensor L2 norms (:func:`norm_sum`, one launch per dtype, read
      only) times 0: 0 when finite, NaN when not.

    Args:
        tensors: The tensors (this rank's local shards).
        found: On CPU, the 1-element float32 flag to write the result into and return (a caller's, reused: a clean
            step then allocates nothing; zeroed for the fused check, which ORs into it); ignored otherwise (left
            as it is).
        sums: On CPU, whether to sum each tensor, when the caller knows (:func:`sums_pay`, once per list of
            parameters): the per-call count of elements is then skipped. ``None``: counted here.

    Example:
        >>> finite_probe([torch.ones(3), torch.tensor(2.0, dtype=torch.float16)]).tolist()
        [0.0]
        >>> finite_probe([torch.ones(3), torch.tensor([1.0, float("nan")])]).tolist()
        [1.0]
        >>> big = torch.zeros(SUM_MIN_ELEMENTS)
        >>> finite_probe([big, big]).tolist(), finite_probe([big, big.index_fill(0, torch.tensor([7]), float("-inf"))])
        ([0.0], tensor([nan]))
    """
    if len(tensors) and local_tensor(tensors[0]).device.type == "cpu":
        if sums if sums is not None else sums_pay(tensors):
            try:
                each = torch.stack([t.sum(dtype=torch.float32) for t in tensors])
                if found is not None and found.device.type == "cpu":
                    return torch.sum(each, 0, True, out=found).mul_(0)
                return (each.sum() * 0).reshape(1)
            except RuntimeError:  # tensors a sum refuses, or on several devices: the fused check decides
                pass
        return nonfinite_flag(tensors, found if found is not None and found.device.type == "cpu" else None)
    return (norm_sum(tensors) * 0).reshape(1)
