"""Running sums of the training loss, kept on the device, with declared (SUM) reductions over processes.

:class:`~lightning_diag.AnomalyAlarm` feeds every training batch's loss to :meth:`LossSums.add`; a trend point
(epoch mean, window mean, the mean since the last validation run, the initial-loss baseline) is the sum over
all ranks divided by the count over all ranks. Both are ``SUM``-declared, so the DDP merge, the checkpoint
(the sums of every rank) and the resume (each rank takes an equal share) all follow from the declaration.
Never imports Lightning; nothing here reads a value back to the host.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from lightning_diag.stats.reduced import ReducedState, Reduction

__all__ = ["LOSS_PERIODS", "LossSums"]

#: The periods whose loss sums run side by side: the epoch, since the last validation run, the step window.
LOSS_PERIODS: tuple[str, ...] = ("epoch", "since_val", "window")


class LossSums(ReducedState):
    """``<period>_sum`` and ``<period>_count`` for each of :data:`LOSS_PERIODS` and ``initial``.

    Non-finite losses add nothing to the sums or the counts (they are the non-finite guard's business).

    Args:
        baseline_steps: Batches whose losses make the ``initial`` sums (the untrained model's loss).

    Example:
        >>> sums = LossSums(baseline_steps=1)
        >>> for v in (2.0, float("nan"), 4.0):
        ...     sums.add(torch.tensor(v))
        >>> LossSums.mean({k: float(v) for k, v in sums.state_dict().items()}, "epoch")
        3.0
        >>> sums.state_dict()["initial_sum"]
        2.0
    """

    def __init__(self, baseline_steps: int) -> None:
        super().__init__()
        for prefix in (*LOSS_PERIODS, "initial"):
            self.add_state(prefix + "_sum", 0.0, Reduction.SUM)
            self.add_state(prefix + "_count", 0.0, Reduction.SUM)
        self.baseline_steps = baseline_steps
        #: Batches counted into the ``initial`` sums so far (the same on every rank: not reduced).
        self.initial_batches = 0

    @staticmethod
    def names(prefix: str) -> tuple[str, str]:
        """``(sum, count)`` state names of a period."""
        return prefix + "_sum", prefix + "_count"

    def add(self, loss: torch.Tensor, finite: torch.Tensor | None = None) -> None:
        """Add a 0-d loss to every open period (and to the baseline while it is filling).

        ``finite`` is ``torch.isfinite(loss)`` when the caller has it already (it is computed otherwise).
        """
        if finite is None:
            finite = torch.isfinite(loss)
        clean = torch.where(finite, loss, 0.0)
        weight = finite.to(loss.dtype)
        prefixes = list(LOSS_PERIODS)
        if self.initial_batches < self.baseline_steps:
            self.initial_batches += 1
            prefixes.append("initial")
        for prefix in prefixes:
            total, count = self.names(prefix)
            self[total] = self[total] + clean
            self[count] = self[count] + weight

    @staticmethod
    def mean(totals: Mapping[str, float], prefix: str) -> float:
        """The mean loss of a period from (reduced) sums; ``nan`` if it counted nothing."""
        total, count = LossSums.names(prefix)
        return totals[total] / totals[count] if totals[count] > 0 else math.nan
