"""Running sums of the training loss, kept on the device, with declared (SUM) reductions over processes.

:class:`~lightning_diag.AnomalyAlarm` feeds every training batch's loss to :meth:`LossSums.add`; a trend point
(epoch mean, window mean, the mean since the last validation run, the initial-loss baseline) is the sum over
all ranks divided by the count over all ranks. Both are ``SUM``-declared, so the DDP merge, the checkpoint
(the sums of every rank) and the resume (each rank takes an equal share) all follow from the declaration.
A batch's loss is only held until the next fold (every :data:`FOLD_EVERY` batches, or when a value is read):
the per-batch cost is one copy of a 0-d tensor. Never imports Lightning; nothing here reads a value back to the host.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from lightning_diag.stats.reduced import ReducedState, Reduction, host_values

__all__ = ["FOLD_EVERY", "LOSS_PERIODS", "LossSums"]

#: The periods whose loss sums run side by side: the epoch, since the last validation run, the step window.
LOSS_PERIODS: tuple[str, ...] = ("epoch", "since_val", "window")
#: Losses held (as 0-d copies) before they are folded into the sums in one stacked pass.
FOLD_EVERY = 64


class LossSums(ReducedState):
    """``<period>_sum`` and ``<period>_count`` for each of :data:`LOSS_PERIODS` and ``initial``; ``<period>_dsq`` and
    ``<period>_dn`` (the sum and count of the squared differences between successive step losses: their step-to-step
    noise, which a trend within the period barely moves) for each of :data:`LOSS_PERIODS`; the last
    finite loss, and where the periods stand (the batches of ``initial``, the first step of the step window).

    Non-finite losses add nothing to the sums or the counts (they are the non-finite guard's business).

    :meth:`add` keeps a copy of the 0-d loss (one small kernel per batch). The held losses are folded into
    the sums in one stacked pass (about 20 small operations) every :data:`FOLD_EVERY` batches, and whenever a
    value is read (``state[name]``, :meth:`state_dict`, :meth:`merge`, :meth:`share`, :meth:`reset`,
    :attr:`last_finite`), so a reader always sees every loss added so far. The sums are float64 (float32 on MPS).

    Args:
        baseline_steps: Batches whose losses make the ``initial`` sums (the untrained model's loss).

    Example:
        >>> sums = LossSums(baseline_steps=1)
        >>> for v in (2.0, float("nan"), 4.0):
        ...     _ = sums.add(torch.tensor(v))
        >>> LossSums.mean(sums.state_dict(), "epoch")
        3.0
        >>> sums.state_dict()["initial_sum"], float(sums.last_finite)
        (2.0, 4.0)
    """

    def __init__(self, baseline_steps: int) -> None:
        super().__init__()
        for prefix in (*LOSS_PERIODS, "initial"):
            self.add_state(prefix + "_sum", 0.0, Reduction.SUM)
            self.add_state(prefix + "_count", 0.0, Reduction.SUM)
        for prefix in LOSS_PERIODS:  # the step-to-step noise of the losses within a period (the loss rules')
            self.add_state(prefix + "_dsq", 0.0, Reduction.SUM)
            self.add_state(prefix + "_dn", 0.0, Reduction.SUM)
        # The last loss folded in (the predecessor of the next fold's first), and the periods it belongs to (a period
        # just reset has none: its first difference is with its own first loss).
        self._previous: torch.Tensor | None = None
        self._continues: set[str] = set()
        self.baseline_steps = baseline_steps
        #: Batches counted into the ``initial`` sums so far (the same on every rank: not reduced).
        self.initial_batches = 0
        self._held: list[torch.Tensor] = []
        # How many of the held losses (a prefix: the baseline is the first batches) belong to ``initial``.
        self._held_initial = 0
        self._last_finite: torch.Tensor | float = math.nan
        #: The copy of the last loss added (other per-step checks share it instead of copying again).
        self.latest: torch.Tensor | None = None
        #: The global step the current step window started at (``None``: not started; set by the caller).
        self.window_start: int | None = None
        #: Set by :meth:`load_state_dict`: the sums are those of every rank (a checkpoint), for the caller to share
        #: out over its ranks before the next merge.
        self.all_ranks = False

    @staticmethod
    def names(prefix: str) -> tuple[str, str]:
        """``(sum, count)`` state names of a period."""
        return prefix + "_sum", prefix + "_count"

    @staticmethod
    def spread_names(prefix: str) -> tuple[str, str, str, str]:
        """``(sum, count, squared differences, their count)`` state names of one of :data:`LOSS_PERIODS`."""
        return prefix + "_sum", prefix + "_count", prefix + "_dsq", prefix + "_dn"

    def add(self, loss: torch.Tensor, copy: bool = True) -> torch.Tensor:
        """Add a 0-d loss to every open period (and to the baseline while it is filling): a copy is kept,
        the sums take it at the next fold.

        Args:
            loss: The batch's 0-d loss.
            copy: ``False`` when nothing writes ``loss`` again (a detached clone of the caller's own, such as the
                one Lightning hands ``on_train_batch_end`` under automatic optimization): kept as it is, no kernel.

        Returns:
            The tensor kept (:attr:`latest`: the copy, or ``loss`` itself).
        """
        # A copy (one small kernel): a compiled model's outputs can live in memory its next call overwrites
        # (``torch.compile(mode="reduce-overhead")`` replays CUDA graphs into a static pool).
        latest = self.latest = loss.detach().clone() if copy else loss
        self._held.append(latest)
        if self.initial_batches < self.baseline_steps:
            self.initial_batches += 1
            self._held_initial += 1
        if len(self._held) >= FOLD_EVERY:
            self._fold()
        return latest

    @property
    def last_finite(self) -> torch.Tensor | float:
        """The last finite loss added (a 0-d tensor on the losses' device; ``nan`` before any), or the value
        assigned (a restore)."""
        self._fold()
        return self._last_finite

    @last_finite.setter
    def last_finite(self, value: torch.Tensor | float) -> None:
        self._fold()
        self._last_finite = value

    def _fold(self) -> None:
        """Add the held losses to the sums and update the last finite loss (no host read)."""
        if not self._held:
            return
        held, self._held = self._held, []
        initial, self._held_initial = self._held_initial, 0
        if len(held) == 1:
            values = held[0].reshape(1)
        elif all(v.dim() == 0 for v in held):  # the usual case: stacked as they are (a reshape each: 2 us apiece)
            values = torch.stack(held)
        else:
            values = torch.stack([v.reshape(()) for v in held])
        # float64 (MPS has none): the sums of float32 losses are then exact whatever the grouping of the folds
        # (a checkpoint's read folds early), and a long epoch's sum does not drift.
        values = values.to(torch.float32 if values.device.type == "mps" else torch.float64)
        finite = (values * 0) == 0  # torch.isfinite in two kernels
        clean = torch.where(finite, values, 0.0)
        weight = finite.to(values.dtype)
        parts = {prefix: (clean, weight) for prefix in LOSS_PERIODS}
        if initial:
            parts["initial"] = (clean[:initial], weight[:initial])
        totals: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        whole = (clean.sum(), weight.sum())
        for prefix, (c, w) in parts.items():
            totals[prefix] = whole if c is clean else (c.sum(), w.sum())
            total, count = self.names(prefix)
            self._values[total] = self._values[total] + totals[prefix][0]
            self._values[count] = self._values[count] + totals[prefix][1]
        self._fold_differences(values, finite)
        # The last finite value: the largest 1-based position of a finite one (0: none of them is finite).
        position = (weight * torch.arange(1, len(held) + 1, device=values.device, dtype=values.dtype)).max()
        latest = values.gather(0, (position.long() - 1).clamp(min=0).reshape(1)).reshape(())
        last = self._last_finite
        last = last.to(latest) if isinstance(last, torch.Tensor) else torch.full_like(latest, last)
        self._last_finite = torch.where(position > 0, latest, last)

    def _fold_differences(self, values: torch.Tensor, finite: torch.Tensor) -> None:
        """Add the squared differences between successive finite losses (with the last loss of the fold before for
        the periods it belongs to) to each period's ``_dsq`` and ``_dn`` (no host read)."""
        inner = (values[1:] - values[:-1]) ** 2
        inner_ok = finite[1:] & finite[:-1]
        inner_sum = torch.where(inner_ok, inner, 0.0).sum()
        inner_n = inner_ok.to(values.dtype).sum()
        with_edge = (inner_sum, inner_n)
        if self._previous is not None:
            previous = self._previous.to(values)
            edge_ok = finite[0] & ((previous * 0) == 0)
            edge = torch.where(edge_ok, (values[0] - previous) ** 2, 0.0)
            with_edge = (inner_sum + edge, inner_n + edge_ok.to(values.dtype))
        for prefix in LOSS_PERIODS:
            dsq, dn = prefix + "_dsq", prefix + "_dn"
            squares, count = with_edge if prefix in self._continues else (inner_sum, inner_n)
            self._values[dsq] = self._values[dsq] + squares
            self._values[dn] = self._values[dn] + count
        self._previous = values[-1]
        self._continues = set(LOSS_PERIODS)

    def __getitem__(self, name: str) -> Any:
        self._fold()
        return super().__getitem__(name)

    def local_totals(self, names: Iterable[str]) -> dict[str, float] | None:
        """This process's named values on the host, in one stacked copy (the held losses folded in first), when
        each is a float64 0-d tensor and all are on one device: the floats a one-process reduction gives (it
        converts each value to float64 and stacks them; here they are float64 already). ``None`` otherwise (a
        period that has counted nothing yet holds its Python default; float32 sums on MPS).

        Example:
            >>> sums = LossSums(baseline_steps=0)
            >>> sums.local_totals(LossSums.names("epoch")) is None  # nothing added: the defaults
            True
            >>> _ = sums.add(torch.tensor(2.0))
            >>> sums.local_totals(LossSums.names("epoch"))
            {'epoch_sum': 2.0, 'epoch_count': 1.0}
        """
        self._fold()
        names = list(names)
        values = [self._values[name] for name in names]
        if not values:
            return {}
        device = values[0].device if isinstance(values[0], torch.Tensor) else None
        for v in values:
            if type(v) is not torch.Tensor or v.dtype is not torch.float64 or v.dim() or v.device != device:
                return None
        return dict(zip(names, torch.stack(values).tolist(), strict=True))

    def reset(self, names: Iterable[str] | None = None) -> None:
        """Put the named values (all by default) back to their defaults, after folding the held losses in."""
        self._fold()
        super().reset(names)
        restarted = {p for p in LOSS_PERIODS if names is None or p + "_sum" in set(names)}
        self._continues -= restarted  # a period's first difference is within it

    def merge(self, other: ReducedState) -> ReducedState:
        """As :meth:`ReducedState.merge`, with the held losses of both folded in first."""
        self._fold()
        if isinstance(other, LossSums):
            other._fold()
        return super().merge(other)

    def share(self, world_size: int, rank: int) -> ReducedState:
        """As :meth:`ReducedState.share`, with the held losses folded in first."""
        self._fold()
        return super().share(world_size, rank)

    def state_dict(self) -> dict[str, Any]:
        """The sums (as :meth:`ReducedState.state_dict`, the held losses folded in first), ``last_finite``,
        ``initial_batches``, ``window_start``, and the last loss folded in with the periods it continues
        (``previous_loss``, ``continues``: the next step-to-step difference): one host read for all."""
        self._fold()
        previous = math.nan if self._previous is None else self._previous
        state = host_values(
            {**{name: self._values[name] for name in self.specs}, "last_finite": self._last_finite,
             "previous_loss": previous}
        )
        state["initial_batches"] = float(self.initial_batches)
        state["window_start"] = self.window_start
        state["continues"] = sorted(self._continues) if self._previous is not None else []
        return state

    def load_state_dict(self, state: Mapping[str, Any], strict: bool = True) -> None:
        """Restore :meth:`state_dict` output (as :meth:`ReducedState.load_state_dict` for the sums; a missing
        ``last_finite``, ``initial_batches`` or ``window_start`` is nan, 0 and ``None``, a missing ``previous_loss``
        starts the step-to-step differences afresh); the held losses are dropped
        (the restored sums replace them: a resume, or a rollback that undoes their steps). Sets :attr:`all_ranks`."""
        self._held, self._held_initial = [], 0
        previous = float(state.get("previous_loss", math.nan))
        self._previous = torch.tensor(previous, dtype=torch.float64) if math.isfinite(previous) else None
        self._continues = set(state.get("continues", [])) & set(LOSS_PERIODS) if self._previous is not None else set()
        super().load_state_dict(state, strict)
        self._last_finite = float(state.get("last_finite", math.nan))
        self.initial_batches = int(state.get("initial_batches", 0))
        start = state.get("window_start")
        self.window_start = None if start is None else int(start)
        self.all_ranks = True

    @staticmethod
    def mean(totals: Mapping[str, float], prefix: str) -> float:
        """The mean loss of a period from (reduced) sums; ``nan`` if it counted nothing."""
        total, count = LossSums.names(prefix)
        return totals[total] / totals[count] if totals[count] > 0 else math.nan

    @staticmethod
    def variance(totals: Mapping[str, float], prefix: str) -> float:
        """The step losses' noise variance of a period from (reduced) sums: half the mean squared difference between
        successive losses (von Neumann's estimator: a smooth trend within the period barely adds to it); ``nan``
        without a difference.

        Example:
            >>> LossSums.variance({"epoch_dsq": 8.0, "epoch_dn": 2.0}, "epoch")
            2.0
        """
        _, _, squares, count = LossSums.spread_names(prefix)
        n = totals[count]
        return totals[squares] / (2.0 * n) if n >= 1 else math.nan
