"""Attention measures: per-head entropy over valid positions, mass on special tokens, head similarity.

Everything here works on device tensors and returns device tensors; nothing copies to the host. Probabilities
are ``[batch, heads, queries, keys]``.

Example:
    >>> probs = torch.full((1, 1, 2, 4), 0.25)  # uniform over 4 keys
    >>> stats = head_stats(probs)
    >>> round(float(stats.entropy[0]), 4), round(math.log(4), 4)
    (1.3863, 1.3863)
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

__all__ = ["HeadStats", "head_pca", "head_similarity", "head_stats", "row_entropy", "special_key_mask"]


class HeadStats(NamedTuple):
    """Per-head means over the valid query rows of the sampled sequences (each a ``[heads]`` tensor).

    Attributes:
        entropy: Attention entropy in nats.
        uniform: Entropy uniform attention over the same allowed keys would have (``ln`` of their number): the
            largest entropy the head could reach.
        special_mass: Attention mass on the special keys.
        special_share: Mass uniform attention would put on the special keys (their share of the allowed keys).
        rows: Number of valid query rows averaged over (the same for every head).
        first_mass: Attention mass on the first key each query row may see (the "attention sink" position of
            causal attention); ``None`` when not computed.
        causal: ``1.0`` when the visible-key count never shrinks and somewhere grows along the query axis (a
            causal mask, also with padding or a sliding window), else ``0.0`` (a 0-d tensor); ``None`` when not
            computed.
        coverage: How evenly the head's queries spread over the keys as a whole: the entropy of the mean of its
            valid rows (per sequence) over ``ln min(rows, keys)``, the most ``rows`` one-hot rows can reach. 1 for
            a one-to-one alignment (each query on its own key: copying, reversal, a previous-token head), near 0
            when every query piles onto the same key; ``None`` when not computed.
        distance: Mean |i − j| under each query's attention (query position i, key position j), averaged over the
            valid rows: how far back or ahead the head reads; ``None`` without query positions (cross-attention).
        distance_relative: The same, each row's distance over its sequence's number of valid keys (uniform
            attention over T keys gives (T² − 1)/(3T²), about 1/3); ``None`` with ``distance``.
    """

    entropy: torch.Tensor
    uniform: torch.Tensor
    special_mass: torch.Tensor
    special_share: torch.Tensor
    rows: torch.Tensor
    first_mass: torch.Tensor | None = None
    causal: torch.Tensor | None = None
    coverage: torch.Tensor | None = None
    distance: torch.Tensor | None = None
    distance_relative: torch.Tensor | None = None


def row_entropy(probs: torch.Tensor) -> torch.Tensor:
    """Entropy in nats of each distribution along the last dimension (``0 * log 0 = 0``).

    Example:
        >>> round(float(row_entropy(torch.tensor([0.5, 0.5]))), 4)
        0.6931
        >>> float(row_entropy(torch.tensor([1.0, 0.0, 0.0])))
        0.0
    """
    return 0.0 - torch.xlogy(probs, probs).sum(-1)  # 0.0 - x keeps a one-hot row at +0.0


def head_stats(
    probs: torch.Tensor,
    allowed: torch.Tensor | None = None,
    query_valid: torch.Tensor | None = None,
    special: torch.Tensor | None = None,
    query_positions: torch.Tensor | None = None,
) -> HeadStats:
    """Per-head attention statistics over valid positions only.

    Rows are renormalised to sum to one over their allowed keys, so weights scaled by dropout or rows with mass on
    masked keys are judged by their shape. A row is left out when its query is padding (``query_valid``), when
    it has no allowed key, or when its mass is zero or non-finite.

    Args:
        probs: Attention probabilities ``[B, H, L, S]``.
        allowed: Boolean, broadcastable to ``[B, H, L, S]``: ``True`` where a key may be attended (not padded,
            not masked). Default: every key.
        query_valid: Boolean ``[B, L]``: ``False`` for padded query rows. Default: every row.
        special: Boolean ``[B, S]``: ``True`` at special keys ([CLS], [SEP], BOS). Default: none.
        query_positions: ``[L]`` key-axis positions of the query rows (self-attention, where query ``i`` and key
            ``i`` are the same token); gives :attr:`HeadStats.distance`. Default: not computed.

    Returns:
        :class:`HeadStats` with ``[H]`` tensors (zeros, and ``rows == 0``, when no row is valid). Query rows are
        taken to be in increasing position order (as the capture subsamples them) for ``causal``.
    """
    if probs.dim() != 4:
        raise ValueError(f"Expected argument `probs` to be [batch, heads, queries, keys], but got {tuple(probs.shape)}")
    p = probs.detach().float()
    b, h, length, s = p.shape
    allow = torch.ones(1, 1, 1, s, dtype=torch.bool, device=p.device) if allowed is None else allowed.bool()
    p = torch.where(allow, p, torch.zeros((), device=p.device))
    mass = p.sum(-1, keepdim=True)
    n_allowed = allow.expand(b, h, length, s).sum(-1)
    valid = (n_allowed > 0) & torch.isfinite(mass.squeeze(-1)) & (mass.squeeze(-1) > 0)
    if query_valid is not None:
        valid = valid & query_valid.bool()[:, None, :]
    p = torch.where(valid[..., None], p / torch.where(valid[..., None], mass, torch.ones((), device=p.device)), 0.0)
    weight = valid.float()
    rows = weight.sum((0, 2))
    denom = rows.clamp_min(1.0)

    def mean(x: torch.Tensor) -> torch.Tensor:
        return (x * weight).sum((0, 2)) / denom

    entropy = mean(row_entropy(p))
    uniform = mean(torch.log(n_allowed.clamp_min(1).float()))
    first = allow.expand(b, h, length, s).to(torch.uint8).argmax(-1, keepdim=True)  # first allowed key of a row
    first_mass = mean(p.gather(-1, first).squeeze(-1))
    causal = _grows_along_queries(n_allowed, valid)
    coverage = _coverage(p, weight, allow.expand(b, h, length, s) & valid[..., None], rows)
    distance = relative = None
    if query_positions is not None:
        gap = (query_positions.to(p.device).float()[:, None] - torch.arange(s, device=p.device).float()).abs()
        per_row = (p * gap).sum(-1)  # [B, H, L]
        keys = allow.expand(b, h, length, s).any(2).sum(-1).clamp_min(1).float()  # valid keys per sequence
        distance, relative = mean(per_row), mean(per_row / keys[..., None])
    if special is None:
        zeros = torch.zeros(h, device=p.device)
        return HeadStats(entropy, uniform, zeros, zeros.clone(), rows, first_mass, causal, coverage, distance,
                         relative)
    spec = special.bool()[:, None, None, :]
    special_mass = mean((p * spec).sum(-1))
    special_share = mean((allow & spec).sum(-1).float() / n_allowed.clamp_min(1).float())
    return HeadStats(entropy, uniform, special_mass, special_share, rows, first_mass, causal, coverage, distance,
                     relative)


def _coverage(p: torch.Tensor, weight: torch.Tensor, seen: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Per head: entropy of each sequence's mean valid row over ``ln min(rows, keys)``, averaged over the
    sequences weighted by their valid rows (``[H]``; sequences with fewer than 2 rows or keys count 0)."""
    per_seq = weight.sum(-1)  # [B, H] valid rows
    marginal = (p * weight[..., None]).sum(2) / per_seq.clamp_min(1.0)[..., None]
    keys = seen.any(2).sum(-1).float()  # [B, H] keys some valid row may see
    room = torch.log(torch.minimum(per_seq, keys).clamp_min(1.0))
    ratio = torch.where(room > 0, row_entropy(marginal) / room.clamp_min(1e-12), torch.zeros((), device=p.device))
    return (ratio * per_seq).sum(0) / rows.clamp_min(1.0)


def _grows_along_queries(n_allowed: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``1.0`` when, over the valid rows of every ``[batch, head]``, the visible-key count never shrinks along the
    query axis and grows somewhere (a causal mask), else ``0.0``; a 0-d tensor, no host sync.

    Padded (invalid) rows are skipped: Hugging Face un-masks fully padded rows, which would break the pattern.

    Example:
        >>> causal = torch.tensor([[[1, 2, 3]]])
        >>> ok = torch.ones(1, 1, 3, dtype=torch.bool)
        >>> float(_grows_along_queries(causal, ok)), float(_grows_along_queries(causal.flip(-1), ok))
        (1.0, 0.0)
    """
    n = torch.where(valid, n_allowed, torch.zeros((), dtype=n_allowed.dtype, device=n_allowed.device))
    running = n.cummax(-1).values  # the largest count of any earlier valid row
    shrinks = (valid & (n < running)).any()
    big = torch.full((), torch.iinfo(n.dtype).max, dtype=n.dtype, device=n.device)
    low = torch.where(valid, n_allowed, big).amin(-1)
    grows = (valid.any(-1) & (running[..., -1] > low)).any()
    return (grows & ~shrinks).float()


def special_key_mask(
    key_valid: torch.Tensor,
    positions: tuple[int, ...] = (),
    token_ids: torch.Tensor | None = None,
    special_ids: tuple[int, ...] = (),
) -> torch.Tensor:
    """Boolean ``[B, S]`` mask of the special keys of each sequence.

    Args:
        key_valid: Boolean ``[B, S]``, ``True`` at real (non-padding) keys.
        positions: Positions counted among the valid keys of each sequence: ``0`` is the first valid key
            ([CLS] / BOS), ``-1`` the last ([SEP] / EOS).
        token_ids: ``[B, S]`` token ids; with ``special_ids``, keys holding one of those ids are special too.
        special_ids: Token ids that are special.

    Example:
        >>> valid = torch.tensor([[True, True, True, False]])
        >>> special_key_mask(valid, positions=(0, -1)).tolist()
        [[True, False, True, False]]
    """
    valid = key_valid.bool()
    b, s = valid.shape
    out = torch.zeros(b, s, dtype=torch.bool, device=valid.device)
    if positions:
        rank = valid.long().cumsum(-1) - 1  # index of each valid key among the valid keys
        count = valid.sum(-1, keepdim=True)
        for pos in positions:
            target = pos if pos >= 0 else count + pos
            out |= valid & (rank == target)
    if token_ids is not None and special_ids:
        ids = torch.tensor(special_ids, device=token_ids.device)
        out |= valid & torch.isin(token_ids, ids)
    return out


def head_similarity(maps: torch.Tensor) -> torch.Tensor:
    """Pearson correlation between heads: ``maps`` is ``[N, F]`` (one flattened attention map per head).

    A constant map has no defined correlation; its row and column are 0 (and 1 on the diagonal).

    Example:
        >>> m = torch.tensor([[1.0, 2.0, 3.0], [2.0, 4.0, 6.0], [3.0, 2.0, 1.0]])
        >>> head_similarity(m).round(decimals=4).tolist()
        [[1.0, 1.0, -1.0], [1.0, 1.0, -1.0], [-1.0, -1.0, 1.0]]
    """
    x = maps.detach().double()
    x = x - x.mean(-1, keepdim=True)
    norm = x.norm(dim=-1, keepdim=True)
    ok = norm > 1e-12 * max(1.0, math.sqrt(x.shape[-1]))
    x = torch.where(ok, x / torch.where(ok, norm, torch.ones_like(norm)), torch.zeros_like(x))
    corr = (x @ x.T).clamp(-1.0, 1.0)
    corr.fill_diagonal_(1.0)
    return corr.float()


def head_pca(maps: torch.Tensor, components: int = 2) -> torch.Tensor:
    """Project each head's flattened map onto the first principal components of all heads: ``[N, components]``.

    Signs are fixed so the largest-magnitude coordinate of each component is positive (a stable picture from step
    to step). Fewer heads than components give zero columns.
    """
    x = maps.detach().double()
    x = x - x.mean(0, keepdim=True)
    n = x.shape[0]
    out = torch.zeros(n, components, dtype=torch.float64, device=x.device)
    if n < 2:
        return out.float()
    u, sv, _ = torch.linalg.svd(x, full_matrices=False)
    k = min(components, u.shape[1])
    coords = u[:, :k] * sv[:k]
    flip = torch.sign(coords.gather(0, coords.abs().argmax(0, keepdim=True)))
    out[:, :k] = coords * torch.where(flip == 0, torch.ones_like(flip), flip)
    return out.float()
