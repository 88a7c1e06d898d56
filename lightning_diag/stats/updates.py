"""Sampled elements of parameters across an optimizer step, and parameter checksums (pure torch).

The measures behind ``update_none`` / ``update_stale`` (a fixed, evenly spaced sample of each parameter's elements,
read before and after the step), ``grad_not_zeroed`` (a few elements of ``.grad`` around each watched backward,
:func:`segment_any`) and ``ddp_desync`` (one checksum per parameter). Nothing here copies to the host.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lightning_diag.stats.grad import local_tensor as grad_local_tensor

__all__ = [
    "ElementSample", "detached_local", "parameter_checksums", "sample_positions", "segment_any", "unchanged_counts",
]


def detached_local(t: torch.Tensor) -> torch.Tensor:
    """The local part of a tensor (:func:`lightning_diag.stats.grad.local_tensor`), detached: the samples here
    read weights and gradients, never a graph."""
    return grad_local_tensor(t).detach()


def sample_positions(numel: int, size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``min(numel, size)`` evenly spaced positions in a flattened tensor of ``numel`` elements.

    Example:
        >>> sample_positions(10, 4).tolist()
        [0, 3, 6, 9]
        >>> sample_positions(2, 4).tolist()
        [0, 1]
    """
    count = min(numel, size)
    if count <= 0:
        return torch.zeros(0, dtype=torch.long, device=device)
    return torch.linspace(0, numel - 1, count, device=device).round().long()


class ElementSample:
    """A fixed sample of elements of several tensors, gathered into one flat float32 vector.

    Built once for a list of tensors (their shapes fix the positions); :meth:`gather` reads the sampled elements of
    the same tensors (or of their gradients) at any time, on the device, one small kernel per tensor.

    Example:
        >>> a, b = torch.arange(10.0), torch.ones(3)
        >>> sample = ElementSample([a, b], size=2)
        >>> sample.gather([a, b]).tolist(), sample.segment.tolist()
        ([0.0, 9.0, 1.0, 1.0], [0, 0, 1, 1])
    """

    def __init__(self, tensors: Sequence[torch.Tensor], size: int) -> None:
        device = detached_local(tensors[0]).device if tensors else torch.device("cpu")
        self.positions = [sample_positions(detached_local(t).numel(), size, detached_local(t).device) for t in tensors]
        counts = [len(p) for p in self.positions]
        #: Which tensor each sampled element belongs to.
        self.segment = torch.repeat_interleave(
            torch.arange(len(counts), device=device), torch.tensor(counts, dtype=torch.long, device=device)
        )
        self.count = len(counts)

    def gather(self, tensors: Sequence[torch.Tensor | None]) -> torch.Tensor:
        """The sampled elements of ``tensors`` (``None`` reads as zeros), as one float32 vector.

        Read outside autograd rather than from ``detach()``-ed views: the same values, one dispatched operator fewer
        per tensor (a tenth of a measuring step's operators on the 1.1M MLP). When every tensor is ``None`` (the
        gradients after ``zero_grad(set_to_none=True)``) the zeros are one tensor, not one per tensor.
        """
        device = self.segment.device
        if all(t is None for t in tensors):
            if len(tensors) != len(self.positions):
                raise ValueError(f"expected {len(self.positions)} tensors, got {len(tensors)}")
            return torch.zeros(len(self.segment), device=device)
        parts = []
        with torch.no_grad():
            for t, pos in zip(tensors, self.positions, strict=True):
                if t is None:
                    parts.append(torch.zeros(len(pos), device=device))
                    continue
                # take: the elements of the flattened tensor, one operator (a third of reshape + index_select +
                # float + to on the measuring step's 10 tensors of the 1.1M MLP)
                part = torch.take(grad_local_tensor(t), pos)
                parts.append(part if part.dtype is torch.float32 and part.device == device else part.float().to(device))
            return torch.cat(parts) if parts else torch.zeros(0, device=device)


def unchanged_counts(
    before: torch.Tensor, after: torch.Tensor, grads: torch.Tensor, segment: torch.Tensor, count: int
) -> torch.Tensor:
    """``[2, count]``: per tensor, the sampled elements with a finite non-zero gradient, and how many of those the
    step left unchanged (``after == before`` bit for bit, as float32 views of the weights).

    Example:
        >>> before, after = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1.0, 2.5, 3.0])
        >>> unchanged_counts(before, after, torch.tensor([0.1, 0.1, 0.0]), torch.tensor([0, 0, 1]), 2).tolist()
        [[2.0, 0.0], [1.0, 0.0]]
    """
    live = torch.isfinite(grads) & (grads != 0)
    same = live & (after == before)
    # both counts in one index_add over the stacked flags (sums of ones: exact in any order)
    return torch.zeros(2, count, device=before.device).index_add_(1, segment, torch.stack([live, same]).float())


def parameter_checksums(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One checksum per tensor: its L2 norm and its plain sum, as a float64 ``[2, n]`` on the first one's device.

    Two numbers per parameter make a change that keeps one of them (a sign flip keeps the norm) still visible.

    Example:
        >>> parameter_checksums([torch.tensor([3.0, -4.0])]).tolist()
        [[5.0], [-1.0]]
    """
    if not tensors:
        return torch.zeros(2, 0, dtype=torch.float64)
    local = []
    for t in tensors:
        x = detached_local(t)
        if x.is_complex():
            x = torch.view_as_real(x)
        local.append(x if x.is_floating_point() else x.double())  # integer parameters (frozen counters)
    device = local[0].device
    norms = torch.stack([n.to(device=device, dtype=torch.float64) for n in torch._foreach_norm(local)])
    sums = torch.stack([t.sum(dtype=torch.float64).to(device) for t in local])
    return torch.stack([norms, sums])


def segment_any(mask: torch.Tensor, segment: torch.Tensor, count: int) -> torch.Tensor:
    """Per tensor (``segment`` as in :class:`ElementSample`), whether any of its sampled elements is set in
    ``mask``: a bool vector of ``count`` on the device.

    Example:
        >>> segment_any(torch.tensor([False, True, False]), torch.tensor([0, 0, 1]), 2).tolist()
        [True, False]
    """
    out = torch.zeros(count, device=mask.device)
    out.index_add_(0, segment.to(mask.device), mask.float())
    return out > 0
