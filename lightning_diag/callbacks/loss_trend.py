"""The loss-trend side of :class:`~lightning_diag.AnomalyAlarm`: training-loss periods and validation trends.

:class:`LossTrend` keeps the training-loss sums of the open periods (the epoch, the step window, the run since
the last validation, the initial batches) on the device as :class:`~lightning_diag.stats.loss_sums.LossSums`,
takes their means over all ranks when a period closes (:func:`~lightning_diag.callbacks.reduction.reduce_state`)
and feeds them, with the monitored validation value, to the trend rules of :mod:`lightning_diag.rules.anomaly`
(``loss_swing``, ``loss_stagnant``, ``val_decline``, ``val_fluctuation``). The alarm owns one per fit and calls
it from its hooks; the alerts and scalars go out through the alarm (``record``, ``writer``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal, cast

import pytorch_lightning as pl
import torch
from pytorch_lightning.trainer.states import TrainerFn

from lightning_diag.callbacks.reduction import reduce_state
from lightning_diag.core.tags import LossSeries, loss_tag
from lightning_diag.rules.anomaly import (
    LOSS_STAGNANT_SPEC,
    LOSS_SWING,
    VAL_DECLINE,
    VAL_FLUCTUATION,
    LossStagnantRule,
    LossSwingRule,
    ValDeclineRule,
    ValFluctuationRule,
)
from lightning_diag.stats.loss_sums import LossSums

if TYPE_CHECKING:
    from lightning_diag.callbacks.anomaly_alarm import AnomalyAlarm

__all__ = ["TREND_STATE_KEYS", "LossTrend", "check_swing_window"]

#: The keys :meth:`LossTrend.state_dict` returns (a part of the alarm's checkpoint state).
TREND_STATE_KEYS = ("swing", "stagnant", VAL_DECLINE, VAL_FLUCTUATION, "accumulators", "window_start")


def check_swing_window(swing_window: object) -> Literal["epoch"] | int:
    """``swing_window`` if it is ``"epoch"`` or an int >= 1.

    Raises:
        TypeError: If it is neither a string nor an int (a bool is not an int here).
        ValueError: If it is another string, or an int below 1.
    """
    if swing_window == "epoch":
        return "epoch"
    bad_window = f"Expected argument `swing_window` to be 'epoch' or an int >= 1, but got {swing_window!r}"
    if isinstance(swing_window, bool) or not isinstance(swing_window, (int, str)):
        raise TypeError(bad_window)
    if isinstance(swing_window, str) or swing_window < 1:
        raise ValueError(bad_window)
    return swing_window


class LossTrend:
    """Training-loss periods and the four trend rules, for one fit of an :class:`~lightning_diag.AnomalyAlarm`.

    Args:
        owner: The alarm whose settings (``swing_*``, ``stagnant_*``, ``monitor``, ``mode``, ``val_*``: its
            constructor arguments, already checked) configure the rules, and whose ``record``, ``writer``,
            ``context``, ``notice`` and ``threshold_lines`` the alerts and scalars go out through.

    Attributes:
        swing_rule, stagnant_rule, val_decline_rule, val_fluctuation_rule: The rules (fresh ones per fit).
        loss_sums: The training-loss sums of the open periods, on the device, SUM-declared (merged over ranks).
        window_start: The global step the current step window started at; set at train start unless a checkpoint
            did.
        sums_restored: Set by :meth:`load_state_dict`: the sums are those of every rank, to be shared out over
            this run's ranks at train start.
    """

    def __init__(self, owner: AnomalyAlarm) -> None:
        self.owner = owner
        self.swing_window = owner.swing_window
        self.monitor = owner.monitor
        unit = "epoch" if self.swing_window == "epoch" else f"window of {self.swing_window} step"
        settings = owner.thresholds()  # the rules' declarations name the owner's arguments
        self.swing_rule = LossSwingRule.from_settings(settings, unit=unit)
        self.stagnant_rule = LossStagnantRule.from_settings(settings, unit=unit)
        self.val_decline_rule = ValDeclineRule.from_settings(
            settings, monitor=owner.monitor, mode=owner.mode  # type: ignore[arg-type]
        )
        self.val_fluctuation_rule = ValFluctuationRule.from_settings(settings, monitor=owner.monitor)
        self.loss_sums = LossSums(int(LOSS_STAGNANT_SPEC.value(settings, "baseline_steps")))
        self.window_start: int | None = None
        self.sums_restored = False

    # -- state -------------------------------------------------------------------------------------------
    def state_dict(self, sums: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The rule histories and latches, this process's partial loss sums and the window start.

        Args:
            sums: The loss sums already read back (:func:`~lightning_diag.stats.reduced.host_values`), so a
                caller can read them together with its own values; by default they are read here.
        """
        accumulators = dict(sums) if sums is not None else self.loss_sums.state_dict()
        accumulators["initial_batches"] = float(self.loss_sums.initial_batches)
        return {
            "swing": self.swing_rule.state_dict(),
            "stagnant": self.stagnant_rule.state_dict(),
            VAL_DECLINE: self.val_decline_rule.state_dict(),
            VAL_FLUCTUATION: self.val_fluctuation_rule.state_dict(),
            "accumulators": accumulators,
            "window_start": self.window_start,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the :data:`TREND_STATE_KEYS` of ``state_dict`` (other keys are ignored)."""
        self.swing_rule.load_state_dict(state_dict["swing"])
        self.stagnant_rule.load_state_dict(state_dict["stagnant"])
        self.val_decline_rule.load_state_dict(state_dict[VAL_DECLINE])
        self.val_fluctuation_rule.load_state_dict(state_dict[VAL_FLUCTUATION])
        accumulators = dict(state_dict["accumulators"])
        self.loss_sums.initial_batches = int(accumulators.pop("initial_batches", 0))
        self.loss_sums.load_state_dict(accumulators, strict=False)
        self.sums_restored = True
        start = state_dict["window_start"]
        self.window_start = None if start is None else int(start)

    def all_rank_sums(self, trainer: pl.Trainer, device: torch.device) -> dict[str, Any]:
        """The loss sums of every rank, merged by their declared reductions (a collective: call on all ranks)."""
        return reduce_state(trainer, self.loss_sums, device=device)

    def start(self, trainer: pl.Trainer) -> None:
        """Start the step window, and share restored all-rank loss sums out over this run's ranks."""
        if self.window_start is None:
            self.window_start = trainer.global_step
        if self.sums_restored and trainer.world_size > 1:
            # Each rank takes its share, so the next all-reduce adds up to the saved sums again (whatever the
            # world size of the run that saved them).
            initial_batches = self.loss_sums.initial_batches
            shared = self.loss_sums.share(trainer.world_size, trainer.global_rank)
            self.loss_sums.load_state_dict(shared.state_dict())
            self.loss_sums.initial_batches = initial_batches
        self.sums_restored = False

    # -- training loss -----------------------------------------------------------------------------------
    def on_train_batch(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor | None) -> None:
        """Add the batch's loss (on the device) and close the step window when it is full."""
        if loss is not None:
            self.loss_sums.add(loss)
        # Optimizer steps, not batches: accumulation micro-batches (global_step unchanged) do not count.
        if isinstance(self.swing_window, int):
            if self.window_start is None:
                self.window_start = trainer.global_step
            if trainer.global_step - self.window_start >= self.swing_window:
                self.window_start = trainer.global_step
                self.close_period(trainer, pl_module, "window")

    def take_mean(self, trainer: pl.Trainer, pl_module: pl.LightningModule, prefix: str) -> float:
        """The mean loss of a period over all ranks; the period starts again."""
        names = LossSums.names(prefix)
        totals = reduce_state(trainer, self.loss_sums, names, device=pl_module.device)
        self.loss_sums.reset(names)
        return LossSums.mean(totals, prefix)

    def close_period(self, trainer: pl.Trainer, pl_module: pl.LightningModule, prefix: str) -> None:
        """Close the epoch (``prefix="epoch"``) or step window (``"window"``): log its mean over all ranks, and
        feed ``loss_swing`` and ``loss_stagnant`` when it is the period ``swing_window`` names.

        Logged tags: ``diag/loss/train_epoch`` or ``diag/loss/train_window``; ``diag/loss/swing`` and
        ``diag/threshold/loss_swing``.
        """
        owner = self.owner
        mean = self.take_mean(trainer, pl_module, prefix)
        if not math.isfinite(mean):
            return
        step = trainer.global_step
        owner.writer.scalar(loss_tag("train_epoch" if prefix == "epoch" else "train_window"), mean, step)
        if (prefix == "epoch") != (self.swing_window == "epoch"):
            return
        if self.stagnant_rule.baseline is None and self.loss_sums.initial_batches > 0:
            self.stagnant_rule.set_baseline(self.take_mean(trainer, pl_module, "initial"))
        ctx = owner.context(trainer)
        owner.record(self.swing_rule.update(mean, ctx) + self.stagnant_rule.update(mean, ctx))
        if math.isfinite(self.swing_rule.last_change):
            values = {loss_tag("swing"): self.swing_rule.last_change, **owner.threshold_lines(LOSS_SWING)}
            owner.writer.scalars(values, step)

    # -- validation trend --------------------------------------------------------------------------------
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Feed the monitored validation value to ``val_decline`` and ``val_fluctuation``.

        Logged tags: ``diag/loss/val``; ``diag/loss/train_fluctuation`` and ``diag/loss/val_fluctuation`` once
        the window is full.
        """
        if trainer.sanity_checking or trainer.state.fn != TrainerFn.FITTING:
            return
        owner = self.owner
        train_mean = self.take_mean(trainer, pl_module, "since_val")
        raw = trainer.callback_metrics.get(self.monitor)
        # Every rank must take part in the reduce below, so they first agree that the value exists everywhere.
        if not trainer.strategy.reduce_boolean_decision(raw is not None, all=True):
            available = sorted(k for k in trainer.callback_metrics if "val" in k) or sorted(trainer.callback_metrics)
            owner.notice(
                trainer,
                "monitor-missing",
                f"`{self.monitor}` was not logged during validation, so val_decline and val_fluctuation are off; "
                f"log it with self.log({self.monitor!r}, ...) or pass monitor=... (logged: {available})",
            )
            return
        value = torch.as_tensor(raw, dtype=torch.float32, device=pl_module.device).detach().mean()
        val = float(trainer.strategy.reduce(value, reduce_op="mean"))
        ctx = owner.context(trainer)
        alerts = self.val_decline_rule.update(val, ctx)
        alerts += self.val_fluctuation_rule.update(train_mean, val, ctx)
        owner.record(alerts)
        values = {loss_tag("val"): val}
        train_f, val_f = self.val_fluctuation_rule.measures()
        if math.isfinite(train_f) and math.isfinite(val_f):
            values[loss_tag("train_fluctuation")] = train_f
            values[loss_tag(cast(LossSeries, VAL_FLUCTUATION))] = val_f  # the series is named after its rule
        owner.writer.scalars(values, ctx.global_step)
