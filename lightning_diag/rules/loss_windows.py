"""The training loss's own verdict on whether a model learns: its first and its latest measurements compared.

Shared by ``update_too_small`` (:mod:`lightning_diag.rules.update_size`) and ``dead_units``
(:mod:`lightning_diag.rules.activations`): a condition that only matters while the model does not learn asks
:meth:`LossWindows.not_learning`. Framework-free.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

__all__ = ["LossWindows"]


class LossWindows:
    """The first ``size`` training losses measured in a fit and the latest ``size``.

    Example:
        >>> w = LossWindows(2)
        >>> for loss in (0.69, 0.70, 0.69):
        ...     w.add(loss)
        >>> w.not_learning(0.1)  # 3 losses: the two windows still overlap
        False
        >>> w.add(0.68); w.not_learning(0.1)
        True
        >>> w.add(0.3); w.add(0.3); w.not_learning(0.1)
        False
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self.early: list[float] = []
        self.recent: list[float] = []
        self.seen = 0

    def add(self, loss: float | None) -> None:
        """Note one measured training loss (``None`` or non-finite: ignored)."""
        if loss is None or not math.isfinite(loss):
            return
        if len(self.early) < self.size:
            self.early.append(float(loss))
        self.recent = [*self.recent, float(loss)][-self.size :]
        self.seen += 1

    @property
    def initial(self) -> float | None:
        """The median of the first ``size`` losses (``None`` before there are as many)."""
        return statistics.median(self.early) if len(self.early) >= self.size else None

    @property
    def latest(self) -> float | None:
        """The median of the latest ``size`` losses (``None`` before there are as many)."""
        return statistics.median(self.recent) if len(self.recent) >= self.size else None

    def not_learning(self, fall: float) -> bool:
        """Whether the loss has fallen less than ``fall`` (a fraction) below its initial median, judged once the two
        windows no longer overlap (``2 x size`` losses); ``False`` before."""
        initial, latest = self.initial, self.latest
        if self.seen < 2 * self.size or initial is None or latest is None:
            return False
        return initial > 0 and latest >= (1.0 - fall) * initial

    def state_dict(self) -> dict[str, Any]:
        """Serializable state."""
        return {"early": list(self.early), "recent": list(self.recent), "seen": self.seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output."""
        self.early = [float(v) for v in state["early"]]
        self.recent = [float(v) for v in state["recent"]]
        self.seen = int(state["seen"])
