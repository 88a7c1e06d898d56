"""Comparing replicas of parameters across ranks, and when to compare them (pure Python, no torch).

The numbers behind ``ddp_desync``: each member's relative difference from its replica group's first member, per
checksum (:func:`replica_differences`) and per parameter (:func:`member_differences`), the first parameter on
which each member differs (:func:`first_differences`), and the optimizer steps after which the replicas are
compared (:func:`check_due`). The checksums themselves are :func:`lightning_diag.stats.updates.parameter_checksums`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["check_due", "first_differences", "member_differences", "replica_differences"]


def check_due(step: int, every_n_steps: int) -> bool:
    """Whether the replicas are compared after optimizer step ``step``: at the powers of two below
    ``every_n_steps`` (1, 2, 4, 8, ...: a fault present from the start, a model never wrapped or a lossy
    all-reduce, shows within the first steps of even a short run), then at every multiple of ``every_n_steps``.

    Example:
        >>> [s for s in range(1, 301) if check_due(s, 100)]
        [1, 2, 4, 8, 16, 32, 64, 100, 200, 300]
        >>> [s for s in range(0, 9) if check_due(s, 2)]
        [1, 2, 4, 6, 8]
    """
    if step <= 0:
        return False
    if step % every_n_steps == 0:
        return True
    return step < every_n_steps and step & (step - 1) == 0


def replica_differences(checksums: Sequence[Sequence[float]]) -> list[list[float]]:
    """``[rank][value]``: each rank's relative difference from rank zero, value by value.

    A value that is NaN on both ranks is no difference (every replica holds the same non-finite weights: the
    non-finite rules' finding, not a desync); NaN on one of them is an infinite one.

    Example:
        >>> replica_differences([[2.0, 1.0], [2.0, 1.5]])
        [[0.0, 0.0], [0.0, 0.5]]
        >>> replica_differences([[float("nan"), 1.0], [float("nan"), 1.0], [1.0, 1.0]])
        [[0.0, 0.0], [0.0, 0.0], [inf, 0.0]]
    """
    ref = checksums[0]
    out = []
    for row in checksums:
        diffs = []
        for a, b in zip(row, ref, strict=True):
            if a == b or (math.isnan(a) and math.isnan(b)):
                diffs.append(0.0)
            elif not (math.isfinite(a) and math.isfinite(b)):
                diffs.append(math.inf)
            else:
                diffs.append(abs(a - b) / max(abs(b), 1e-12))
        out.append(diffs)
    return out


def member_differences(checksums: Sequence[Sequence[float]]) -> list[list[float]]:
    """``[member][parameter]``: each group member's relative difference from the first member, per parameter
    (the larger of its norm's and its sum's), from ``[member][2 * n]`` checksums (``n`` norms, then ``n`` sums).

    Example:
        >>> member_differences([[1.0, 2.0, 1.0, 2.0], [1.0, 2.0, 1.0, 3.0]])
        [[0.0, 0.0], [0.0, 0.5]]
    """
    diffs = replica_differences(checksums)
    n = len(checksums[0]) // 2 if checksums else 0
    return [[max(d[i], d[n + i]) for i in range(n)] for d in diffs]


def first_differences(
    diffs: Sequence[Sequence[float]], ranks: Sequence[int], params: Sequence[int], tolerance: float
) -> dict[int, tuple[int, int]]:
    """``{global rank: (parameter index, reference rank)}``: for each member of one replica group that differs from
    the group's first member by more than ``tolerance``, the first parameter on which it does.

    Args:
        diffs: ``[member][k]`` (:func:`member_differences`).
        ranks: The members' global ranks (the first is the reference).
        params: The model-order indices of the group's ``k`` parameters (ascending).
        tolerance: Relative difference above which a member differs.

    Example:
        >>> first_differences([[0.0, 0.0], [0.0, 0.5]], [2, 6], [3, 7], 1e-6)
        {6: (7, 2)}
    """
    out: dict[int, tuple[int, int]] = {}
    for rank, row in zip(ranks, diffs, strict=True):
        for index, value in zip(params, row, strict=True):
            if value > tolerance:
                out[rank] = (index, ranks[0])
                break
    return out
