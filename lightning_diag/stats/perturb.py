"""Token-level perturbations for the robustness probe (seed 000 §2.1): typos and shuffled words, on token ids.

Pure torch. Each function perturbs about ``rate`` of the real (non-padding) positions of a ``[B, L]`` id tensor,
with its own generator so the draw is reproducible and leaves the global RNG untouched.
"""

from __future__ import annotations

import torch

__all__ = ["adjacent_swaps", "random_replacements"]


def _positions(ids: torch.Tensor, mask: torch.Tensor | None, rate: float, generator: torch.Generator) -> torch.Tensor:
    real = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
    draw = torch.rand(ids.shape, generator=generator, device="cpu").to(ids.device) < rate
    return draw & real


def random_replacements(
    ids: torch.Tensor, rate: float, vocab_size: int, generator: torch.Generator, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """``ids`` with about ``rate`` of the real positions replaced by a different random id in ``[0, vocab_size)``
    (a typo at token level).

    Example:
        >>> g = torch.Generator().manual_seed(0)
        >>> ids = torch.arange(1000).reshape(10, 100) % 50
        >>> out = random_replacements(ids, 0.05, 50, g)
        >>> changed = (out != ids).float().mean().item()
        >>> 0.02 < changed < 0.08, bool((out < 50).all())
        (True, True)
    """
    where = _positions(ids, mask, rate, generator)
    offset = torch.randint(1, max(vocab_size, 2), ids.shape, generator=generator).to(ids.device)
    return torch.where(where, (ids + offset) % max(vocab_size, 2), ids)


def adjacent_swaps(
    ids: torch.Tensor, rate: float, generator: torch.Generator, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """``ids`` with about ``rate`` of the real positions swapped with their right neighbour (shuffled words);
    a swap needs both positions real and never overlaps another.

    Example:
        >>> g = torch.Generator().manual_seed(0)
        >>> ids = torch.arange(200).reshape(2, 100)
        >>> out = adjacent_swaps(ids, 0.05, g)
        >>> bool((out.sort(-1).values == ids).all()), bool((out != ids).any())
        (True, True)
    """
    out = ids.clone()
    if ids.shape[-1] < 2:
        return out
    real = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
    start = _positions(ids, mask, rate, generator)[..., :-1] & real[..., 1:]
    # Only even or only odd starts per row keep swaps disjoint; the parity is drawn per row.
    parity = torch.randint(0, 2, (ids.shape[0], 1), generator=generator).to(ids.device)
    cols = torch.arange(ids.shape[-1] - 1, device=ids.device)
    start &= (cols % 2) == parity
    left, right = out[..., :-1].clone(), out[..., 1:].clone()
    out[..., :-1] = torch.where(start, right, out[..., :-1])
    out[..., 1:] = torch.where(start, left, out[..., 1:])
    return out
