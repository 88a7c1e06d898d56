"""The loss-trend side of :class:`~lightning_diag.AnomalyAlarm`: training-loss periods and validation trends.

:class:`LossTrend` keeps the training-loss sums of the open periods (the epoch, the step window, the run since
the last validation, the initial batches) on the device as :class:`~lightning_diag.stats.loss_sums.LossSums`,
takes their means over all ranks when a period closes (:func:`~lightning_diag.callbacks.reduction.reduce_state`)
and feeds them, with the monitored validation value, to the trend rules of :mod:`lightning_diag.rules.anomaly`
(``loss_swing``, ``loss_stagnant``, ``val_decline``, ``val_fluctuation``). The alarm owns one per fit, built from
its thresholds (``thresholds()``), and calls it from its hooks; each call returns the alerts and scalars
(:class:`TrendOutput`) for the alarm to send out, so nothing here reaches back into the alarm.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, Literal, cast

import pytorch_lightning as pl
import torch
from pytorch_lightning.trainer.states import TrainerFn

from lightning_diag.callbacks.reduction import reduce_state
from lightning_diag.core.record import Alert
from lightning_diag.core.registry import value_of
from lightning_diag.core.tags import LossSeries, loss_tag, threshold_tag
from lightning_diag.rules.anomaly import (
    LOSS_SWING,
    LOSS_SWING_SPEC,
    STAGNANT_BASELINE_STEPS_KEY,
    VAL_DECLINE,
    VAL_FLUCTUATION,
    LossStagnantRule,
    LossSwingRule,
    ValDeclineRule,
    ValFluctuationRule,
)
from lightning_diag.rules.base import StepContext
from lightning_diag.stats.loss_sums import LossSums

__all__ = ["TREND_STATE_KEYS", "LossTrend", "TrendOutput", "check_swing_window"]

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


@dataclasses.dataclass
class TrendOutput:
    """What one :class:`LossTrend` call produced, for its owner to send out (alerts, scalars, notices).

    Attributes:
        alerts: New alerts, to record.
        scalars: Tag -> value, to write at ``step``.
        step: The global step of the scalars.
        notices: ``(key, message)`` pairs to show once each (a missing ``monitor``).
    """

    alerts: list[Alert] = dataclasses.field(default_factory=list)
    scalars: dict[str, float] = dataclasses.field(default_factory=dict)
    step: int = 0
    notices: list[tuple[str, str]] = dataclasses.field(default_factory=list)

    def extend(self, other: TrendOutput) -> None:
        """Add ``other``'s alerts, scalars and notices (scalars of one step only: ``other``'s step wins)."""
        self.alerts += other.alerts
        self.scalars.update(other.scalars)
        self.notices += other.notices
        self.step = other.step


class LossTrend:
    """Training-loss periods and the four trend rules, for one fit of an :class:`~lightning_diag.AnomalyAlarm`.

    Nothing here reads the alarm: the settings come in, and every call returns a :class:`TrendOutput` (alerts,
    scalars, notices) that the caller sends out.

    Args:
        thresholds: The alarm's ``thresholds()``: the rules' thresholds and settings in effect.
        swing_window: ``"epoch"``, or the optimizer steps of one loss window (checked by the alarm).
        monitor: The validation metric read from ``trainer.callback_metrics``.
        mode: ``"min"`` if lower ``monitor`` is better, ``"max"`` if higher is.

    Attributes:
        swing_rule, stagnant_rule, val_decline_rule, val_fluctuation_rule: The rules (fresh ones per fit).
        loss_sums: The training-loss sums of the open periods, on the device, SUM-declared (merged over ranks).
        window_start: The global step the current step window started at; set at train start unless a checkpoint
            did.
        sums_restored: Set by :meth:`load_state_dict`: the sums are those of every rank, to be shared out over
            this run's ranks at train start.
    """

    def __init__(
        self,
        thresholds: Mapping[str, float],
        *,
        swing_window: Literal["epoch"] | int,
        monitor: str,
        mode: Literal["min", "max"],
    ) -> None:
        self.swing_window = swing_window
        #: ``loss_swing``'s threshold, drawn beside the swing series.
        self.swing_threshold = LOSS_SWING_SPEC.value(thresholds)
        self.monitor = monitor
        unit = "epoch" if self.swing_window == "epoch" else f"window of {self.swing_window} step"
        self.swing_rule = LossSwingRule.from_settings(thresholds, unit=unit)
        self.stagnant_rule = LossStagnantRule.from_settings(thresholds, unit=unit)
        self.val_decline_rule = ValDeclineRule.from_settings(thresholds, monitor=monitor, mode=mode)
        self.val_fluctuation_rule = ValFluctuationRule.from_settings(thresholds, monitor=monitor)
        self.loss_sums = LossSums(int(value_of(thresholds, STAGNANT_BASELINE_STEPS_KEY)))
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
    def on_train_batch(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        loss: torch.Tensor | None,
    ) -> TrendOutput | None:
        """Add the batch's 0-d loss (a 0-d copy: the sums fold it in later, on the device) and close the step
        window when it is full: what that produced, or ``None`` when the step only added its loss."""
        if loss is not None:
            self.loss_sums.add(loss)
        # Optimizer steps, not batches: accumulation micro-batches (global_step unchanged) do not count.
        if isinstance(self.swing_window, int):
            if self.window_start is None:
                self.window_start = trainer.global_step
            if trainer.global_step - self.window_start >= self.swing_window:
                self.window_start = trainer.global_step
                return self.close_period(trainer, pl_module, "window")
        return None

    def take_mean(self, trainer: pl.Trainer, pl_module: pl.LightningModule, prefix: str) -> float:
        """The mean loss of a period over all ranks; the period starts again."""
        names = LossSums.names(prefix)
        totals = reduce_state(trainer, self.loss_sums, names, device=pl_module.device)
        self.loss_sums.reset(names)
        return LossSums.mean(totals, prefix)

    def close_period(self, trainer: pl.Trainer, pl_module: pl.LightningModule, prefix: str) -> TrendOutput:
        """Close the epoch (``prefix="epoch"``) or step window (``"window"``): log its mean over all ranks, and
        feed ``loss_swing`` and ``loss_stagnant`` when it is the period ``swing_window`` names.

        Logged tags: ``diag/loss/train_epoch`` or ``diag/loss/train_window``; ``diag/loss/swing`` and
        ``diag/threshold/loss_swing``.
        """
        out = TrendOutput(step=trainer.global_step)
        mean = self.take_mean(trainer, pl_module, prefix)
        if not math.isfinite(mean):
            return out
        out.scalars[loss_tag("train_epoch" if prefix == "epoch" else "train_window")] = mean
        if (prefix == "epoch") != (self.swing_window == "epoch"):
            return out
        if self.stagnant_rule.baseline is None and self.loss_sums.initial_batches > 0:
            self.stagnant_rule.set_baseline(self.take_mean(trainer, pl_module, "initial"))
        ctx = StepContext(epoch=trainer.current_epoch, global_step=trainer.global_step)
        out.alerts += self.swing_rule.update(mean, ctx) + self.stagnant_rule.update(mean, ctx)
        if math.isfinite(self.swing_rule.last_change):
            out.scalars[loss_tag("swing")] = self.swing_rule.last_change
            out.scalars[threshold_tag(LOSS_SWING)] = self.swing_threshold
        return out

    # -- validation trend --------------------------------------------------------------------------------
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> TrendOutput:
        """Feed the monitored validation value to ``val_decline`` and ``val_fluctuation``.

        Logged tags: ``diag/loss/val``; ``diag/loss/train_fluctuation`` and ``diag/loss/val_fluctuation`` once
        the window is full.
        """
        out = TrendOutput(step=trainer.global_step)
        if trainer.sanity_checking or trainer.state.fn != TrainerFn.FITTING:
            return out
        train_mean = self.take_mean(trainer, pl_module, "since_val")
        raw = trainer.callback_metrics.get(self.monitor)
        # Every rank must take part in the reduce below, so they first agree that the value exists everywhere.
        if not trainer.strategy.reduce_boolean_decision(raw is not None, all=True):
            available = sorted(k for k in trainer.callback_metrics if "val" in k) or sorted(trainer.callback_metrics)
            out.notices.append(
                (
                    "monitor-missing",
                    f"`{self.monitor}` was not logged during validation, so {VAL_DECLINE} and {VAL_FLUCTUATION} are"
                    f" off; log it with self.log({self.monitor!r}, ...) or pass monitor=... (logged: {available})",
                )
            )
            return out
        value = torch.as_tensor(raw, dtype=torch.float32, device=pl_module.device).detach().mean()
        val = float(trainer.strategy.reduce(value, reduce_op="mean"))
        ctx = StepContext(epoch=trainer.current_epoch, global_step=trainer.global_step)
        self.stagnant_rule.observe_validation(val, self.val_decline_rule.mode)
        out.alerts += self.val_decline_rule.update(val, ctx, train_mean)
        out.alerts += self.val_fluctuation_rule.update(train_mean, val, ctx)
        out.scalars[loss_tag("val")] = val
        train_f, val_f = self.val_fluctuation_rule.measures()
        if math.isfinite(train_f) and math.isfinite(val_f):
            out.scalars[loss_tag("train_fluctuation")] = train_f
            out.scalars[loss_tag(cast(LossSeries, VAL_FLUCTUATION))] = val_f  # the series is named after its rule
        return out
