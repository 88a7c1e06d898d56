"""The loss-trend side of :class:`~lightning_diag.AnomalyAlarm`: training-loss periods and validation trends.

:class:`LossTrend` keeps the training-loss sums of the open periods (the epoch, the step window, the run since
the last validation, the initial batches) on the device as :class:`~lightning_diag.stats.loss_sums.LossSums`,
takes their means over all ranks when a period closes (:func:`~lightning_diag.callbacks.common.reduction.reduce_state`)
and feeds them, with the monitored validation value, to the alarm's preset (its ``feed``: the trend rules
``loss_swing``, ``loss_stagnant``, ``val_decline``, ``val_fluctuation``, one module each in
:mod:`lightning_diag.rules`, judge what they read). The alarm declares the rules and the sums (so their state
follows its checkpoint), hands its ``feed``, the sums and what the logged scalars read to one :class:`LossTrend` per
fit and calls it from its hooks; each call returns the alerts and scalars (:class:`TrendOutput`) for the alarm to
send out, so nothing here reaches back into the alarm.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, Literal, Protocol, cast

import pytorch_lightning as pl
import torch
from pytorch_lightning.trainer.states import TrainerFn

from lightning_diag.callbacks.anomaly_alarm.lr_logging import learning_rates
from lightning_diag.callbacks.common.preset import Feed
from lightning_diag.callbacks.common.reduction import FitReduction, Reduced, reduce_state
from lightning_diag.core.record import Alert
from lightning_diag.core.registry import value_of
from lightning_diag.core.tags import LossSeries, loss_tag, threshold_tag
from lightning_diag.rules.base import StepContext
from lightning_diag.rules.measures import LossWindow, Measures, Validation
from lightning_diag.stats.loss_sums import LOSS_PERIODS, LossSums

__all__ = [
    "FluctuationReadings",
    "LossTrend",
    "StagnantReadings",
    "SwingReadings",
    "TrendOutput",
    "build_loss_sums",
    "check_swing_window",
    "mean_lr",
    "trend_unit",
]


class SwingReadings(Protocol):
    """What the logged scalars read of ``loss_swing``'s detector after it judged (never a decision)."""

    threshold: float
    last_change: float
    val_previous: list[float] | None


class StagnantReadings(Protocol):
    """What is read of ``loss_stagnant``'s detector: the initial loss it holds (``None``: none yet), which decides
    whether the initial period's mean is taken and is the scale of ``loss_swing``'s validation view (kept there:
    a checkpoint holds it only in that detector's state)."""

    baseline: float | None


class FluctuationReadings(Protocol):
    """What the logged scalars read of ``val_fluctuation``'s detector after it judged (never a decision)."""

    def measures(self) -> tuple[float, float]:
        """The training and validation fluctuations of the last full window (``nan`` before)."""
        ...


def mean_lr(trainer: pl.Trainer) -> float:
    """The mean learning rate over every optimizer's parameter groups (``nan`` without any)."""
    rates = list(learning_rates(trainer).values())
    return sum(rates) / len(rates) if rates else math.nan


def loader_batch_size(loaders: Any) -> int | None:
    """The ``batch_size`` of a data loader (the first of a list or mapping of them), or ``None`` when unknown
    (a batch sampler, an iterable without one)."""
    if isinstance(loaders, Mapping):
        loaders = next(iter(loaders.values()), None)
    elif isinstance(loaders, (list, tuple)):
        loaders = loaders[0] if loaders else None
    size = getattr(loaders, "batch_size", None)
    return size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else None


def batch_ratio(trainer: pl.Trainer) -> float:
    """The training batch size over the validation batch size, from the trainer's data loaders (1 where either
    is unknown): the variance of a validation batch's mean is a training step's times this.

    Example:
        >>> from types import SimpleNamespace
        >>> from torch.utils.data import DataLoader
        >>> batch_ratio(SimpleNamespace(train_dataloader=DataLoader(range(64), batch_size=8),
        ...                             val_dataloaders=[DataLoader(range(256), batch_size=256)]))
        0.03125
    """
    train = loader_batch_size(getattr(trainer, "train_dataloader", None))
    val = loader_batch_size(getattr(trainer, "val_dataloaders", None))
    return train / val if train is not None and val is not None else 1.0


def build_loss_sums(thresholds: Mapping[str, float], *, baseline_key: str) -> LossSums:
    """The loss sums of a fit, their ``initial`` period ``thresholds[baseline_key]`` batches long (the builder the
    alarm declares, with ``loss_stagnant.baseline_steps``'s key from its preset module)."""
    return LossSums(int(value_of(thresholds, baseline_key)))


def trend_unit(swing_window: Literal["epoch"] | int) -> str:
    """The period ``loss_swing`` and ``loss_stagnant`` name in their messages."""
    return "epoch" if swing_window == "epoch" else f"window of {swing_window} step"


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
    """Training-loss periods and what the trend rules read, for one fit of an :class:`~lightning_diag.AnomalyAlarm`.

    Nothing here reads the alarm: its ``feed`` and the loss sums come in (the rules and the sums are declared on the
    alarm, which saves and restores their state), and every call returns a :class:`TrendOutput` (alerts, scalars,
    notices) that the caller sends out. What is measured is named, not who reads it: a closed period is a
    :class:`~lightning_diag.rules.measures.LossWindow` (with the initial loss, once), a validation run a
    :class:`~lightning_diag.rules.measures.Validation` (with its orientation and whether it is a loss).

    Args:
        feed: Judges measures with the alarm's detectors that they feed, returns the alerts.
        loss_sums: The training-loss sums of the open periods, on the device, SUM-declared (merged over ranks),
            with the first step of the step window.
        swing: ``loss_swing``'s detector, read for the logged scalars after it judged.
        stagnant: ``loss_stagnant``'s detector, whose initial loss is read (:class:`StagnantReadings`).
        fluctuation: ``val_fluctuation``'s detector, read for the logged scalars after it judged.
        swing_window: ``"epoch"``, or the optimizer steps of one loss window (checked by the alarm).
        monitor: The validation metric read from ``trainer.callback_metrics``.
        higher_is_better: Whether a higher ``monitor`` is better (the alarm's ``mode="max"``).
        swing_id: ``loss_swing``'s id (its threshold is logged beside the swing).
        decline_id: ``val_decline``'s id, named with ``fluctuation_id`` where ``monitor`` was not logged.
        fluctuation_id: ``val_fluctuation``'s id, the name of its logged series.

    The ids are handed in by the alarm's preset module, which names the detectors; nothing here imports a rule.
    """

    def __init__(
        self,
        feed: Feed,
        loss_sums: LossSums,
        *,
        swing: SwingReadings,
        stagnant: StagnantReadings,
        fluctuation: FluctuationReadings,
        swing_window: Literal["epoch"] | int,
        monitor: str,
        higher_is_better: bool = False,
        swing_id: str,
        decline_id: str,
        fluctuation_id: str,
    ) -> None:
        self.feed = feed
        self.swing_id, self.decline_id, self.fluctuation_id = swing_id, decline_id, fluctuation_id
        self.swing = swing
        self.stagnant = stagnant
        self.fluctuation = fluctuation
        self.loss_sums = loss_sums
        self.swing_window = swing_window
        self.monitor = monitor
        self.higher_is_better = higher_is_better
        #: The mean learning rate in effect at the current period's first step (read when the last one closed, or
        #: at the start of training; ``nan``: none).
        self.lr_start = math.nan
        #: The monitored metric's value of each batch of the current validation run, as ``validation_step``
        #: returned it (references: no copy, no host read until the run ends).
        self.val_batches: list[torch.Tensor] = []
        #: The batches of the current validation run (whatever ``validation_step`` returned).
        self.val_batch_count = 0
        #: The values over all ranks the driver reduced at the current point of the fit for every callback
        #: (``Driver.reduce_at``, by ``(id(state), names)``), set by the alarm around a call; ``None``: reduce here.
        self.reduced: Reduced | None = None

    def start(self, trainer: pl.Trainer) -> None:
        """Start the step window, and share restored all-rank loss sums out over this run's ranks."""
        self.lr_start = mean_lr(trainer)
        sums = self.loss_sums
        if sums.window_start is None:
            sums.window_start = trainer.global_step
        if sums.all_ranks and trainer.world_size > 1:
            # Each rank takes its share, so the next all-reduce adds up to the saved sums again (whatever the
            # world size of the run that saved them).
            shared = sums.share(trainer.world_size, trainer.global_rank)
            for name in shared:
                sums[name] = shared[name]
        sums.all_ranks = False

    # -- training loss -----------------------------------------------------------------------------------
    @property
    def window_end(self) -> float:
        """The global step at which the step window closes (``inf`` in epoch mode, 0 before it started): until
        then a batch needs nothing of :meth:`close_window`."""
        if not isinstance(self.swing_window, int):
            return math.inf
        start = self.loss_sums.window_start
        return 0 if start is None else start + self.swing_window

    def close_window(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int) -> TrendOutput | None:
        """Close the step window when global step ``step`` is :attr:`window_end` or past it: what that produced,
        or ``None``."""
        # Optimizer steps, not batches: accumulation micro-batches (global_step unchanged) do not count.
        sums = self.loss_sums
        if not isinstance(self.swing_window, int):
            return None
        if sums.window_start is None:
            sums.window_start = step
        if step - sums.window_start >= self.swing_window:
            sums.window_start = step
            return self.close_period(trainer, pl_module, "window")
        return None

    def reductions(self, trainer: pl.Trainer, point: str) -> list[FitReduction]:
        """What :meth:`close_period` (``point``: ``"epoch_end"``, or ``"window"`` when the step window closes at
        this batch's end, :meth:`close_window`) and :meth:`on_validation_end` (``"validation_end"``) reduce over
        the ranks: the period's sums, with the initial period's when its mean may be taken (reduced with them; the
        initial sums start again only when it is). Decided from what every rank knows alike."""
        sums = self.loss_sums
        if point == "validation_end":
            if trainer.sanity_checking or trainer.state.fn != TrainerFn.FITTING:
                return []
            return [(sums, self.period_names("since_val"))]
        if point == "epoch_end":
            prefix = "epoch"
        elif point == "window" and isinstance(self.swing_window, int) and sums.window_start is not None:
            if trainer.global_step - sums.window_start < self.swing_window:
                return []
            prefix = "window"
        else:
            return []
        out: list[FitReduction] = [(sums, self.period_names(prefix))]
        swing_period = (prefix == "epoch") == (self.swing_window == "epoch")
        if swing_period and self.stagnant.baseline is None and sums.initial_batches > 0:
            out.append((sums, self.period_names("initial")))
        return out

    @staticmethod
    def period_names(prefix: str) -> tuple[str, ...]:
        """The names of a period's sums that :meth:`take_stats` reads."""
        return tuple(LossSums.spread_names(prefix) if prefix in LOSS_PERIODS else LossSums.names(prefix))

    def take_mean(self, trainer: pl.Trainer, pl_module: pl.LightningModule, prefix: str) -> float:
        """The mean loss of a period over all ranks; the period starts again."""
        return self.take_stats(trainer, pl_module, prefix)[0]

    def take_stats(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, prefix: str
    ) -> tuple[float, float, float]:
        """``(mean, variance, count)`` of a period's step losses over all ranks (the variance ``nan`` for
        ``initial`` and below 2 losses); the period starts again."""
        names = self.period_names(prefix)
        # one process: the sums' own float64 values in one stacked read (no conversion operator per value)
        totals = self.loss_sums.local_totals(names) if trainer.world_size <= 1 else None
        if totals is None and self.reduced is not None:  # reduced by the driver with every callback's at this point
            totals = self.reduced.get((id(self.loss_sums), names))
        if totals is None:
            totals = reduce_state(trainer, self.loss_sums, names, device=pl_module.device)
        self.loss_sums.reset(names)
        variance = LossSums.variance(totals, prefix) if prefix in LOSS_PERIODS else math.nan
        return LossSums.mean(totals, prefix), variance, totals[names[1]]

    def close_period(self, trainer: pl.Trainer, pl_module: pl.LightningModule, prefix: str) -> TrendOutput:
        """Close the epoch (``prefix="epoch"``) or step window (``"window"``): log its mean over all ranks, and
        feed ``loss_swing`` and ``loss_stagnant`` when it is the period ``swing_window`` names.

        Logged tags: ``diag/loss/train_epoch`` or ``diag/loss/train_window``; ``diag/loss/train_spread`` (the
        standard deviation of the period's step losses, when it has two or more), ``diag/loss/swing`` and
        ``diag/threshold/loss_swing``.
        """
        out = TrendOutput(step=trainer.global_step)
        mean, variance, count = self.take_stats(trainer, pl_module, prefix)
        if not math.isfinite(mean):
            return out
        out.scalars[loss_tag("train_epoch" if prefix == "epoch" else "train_window")] = mean
        if (prefix == "epoch") != (self.swing_window == "epoch"):
            return out
        if math.isfinite(variance):  # the noise loss_swing judged the point against (the report replays it)
            out.scalars[loss_tag("train_spread")] = math.sqrt(variance)
        lr = self.period_lr(trainer)
        initial = None  # the initial loss, until loss_stagnant holds one
        if self.stagnant.baseline is None and self.loss_sums.initial_batches > 0:
            initial = self.take_mean(trainer, pl_module, "initial")
        ctx = StepContext(epoch=trainer.current_epoch, global_step=trainer.global_step)
        out.alerts += self.feed(
            ctx, Measures(loss_window=LossWindow(mean, steps=count, variance=variance, lr=lr, initial=initial))
        )
        swing = self.swing
        if math.isfinite(swing.last_change):
            out.scalars[loss_tag("swing")] = swing.last_change
            out.scalars[threshold_tag(self.swing_id)] = swing.threshold
        return out

    def period_lr(self, trainer: pl.Trainer) -> float:
        """The learning rate of the period that closes now, and the start of the next one's.

        The mean over every optimizer's parameter groups. A scheduler stepped by epoch has already stepped when a
        callback's ``on_train_epoch_end`` runs (Lightning steps it after the epoch's last batch), so the period's
        rate is the one read at its start; with a scheduler stepped by step, the mean of its start and its end.
        """
        start, end = self.lr_start, mean_lr(trainer)
        self.lr_start = end
        by_step = any(config.interval == "step" for config in trainer.lr_scheduler_configs)
        if by_step and math.isfinite(start) and math.isfinite(end):
            return 0.5 * (start + end)
        return start

    # -- validation trend --------------------------------------------------------------------------------
    def on_validation_batch_end(self, trainer: pl.Trainer, outputs: Any) -> None:
        """Keep this batch's value of the monitored metric, from what ``validation_step`` returned (a scalar
        tensor, or a mapping holding the monitored name or ``"loss"``), for the standard error of the validation
        value (:meth:`validation_se`). A step that returns nothing gives no standard error: ``val_decline`` then
        judges without it. The tensor is kept by reference (no copy, no host read until the run ends)."""
        if trainer.sanity_checking or trainer.state.fn != TrainerFn.FITTING:
            return
        self.val_batch_count += 1
        value = self.batch_value(outputs)
        if value is not None:
            self.val_batches.append(value)

    def batch_value(self, outputs: Any) -> torch.Tensor | None:
        """The monitored metric's value in one ``validation_step``'s return, or ``None``: a mapping's entry under
        :attr:`monitor` (else ``"loss"`` when the monitored name is a loss), or the returned tensor itself when
        the monitored name is a loss; only a one-element tensor counts."""
        is_loss = "loss" in self.monitor
        if isinstance(outputs, Mapping):
            value = outputs.get(self.monitor, outputs.get("loss") if is_loss else None)
        else:
            value = outputs if is_loss else None
        if not isinstance(value, torch.Tensor) or value.numel() != 1:
            return None
        return value.detach()

    def validation_se(self) -> float:
        """The standard error of this validation run's value from its batches' values (``nan`` below 2 batches
        or when the step returned no value); the kept batches are dropped.

        The batches are the samples of the run (equal weights): with ``m_i`` the value of batch ``i`` and ``m``
        their mean over ``n`` batches, the variance of ``m`` is ``sum((m_i - m)^2) / (n (n - 1))``, which holds
        whatever the spread within a batch.
        """
        kept, self.val_batches = self.val_batches, []
        if len(kept) < 2:
            return math.nan
        values = torch.stack([v.reshape(()).double() for v in kept]).cpu().tolist()
        finite = [v for v in values if math.isfinite(v)]
        n = len(finite)
        if n < 2:
            return math.nan
        mean = sum(finite) / n
        return math.sqrt(sum((v - mean) ** 2 for v in finite) / (n * (n - 1)))

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> TrendOutput:
        """Feed the monitored validation value (with its standard error, :meth:`validation_se`): ``val_decline``,
        ``val_fluctuation``, ``loss_swing`` (a loss only) and ``loss_stagnant`` (the learning it tells) read it.

        Where ``validation_step`` returns no value, ``val_fluctuation`` takes the standard error of a mean over the
        run's validation batches, each validation sample as noisy as a training sample: ``sqrt(s^2 r / b)``,
        ``s^2`` the step-to-step noise variance of the training losses since the last validation run, ``b`` the
        validation batches over all ranks, ``r`` the training over the validation batch size (:func:`batch_ratio`).

        Logged tags: ``diag/loss/val``; ``diag/loss/train_fluctuation`` and ``diag/loss/val_fluctuation`` once
        the window is full.
        """
        out = TrendOutput(step=trainer.global_step)
        if trainer.sanity_checking or trainer.state.fn != TrainerFn.FITTING:
            return out
        train_mean, train_variance, train_count = self.take_stats(trainer, pl_module, "since_val")
        batches, self.val_batch_count = self.val_batch_count * max(trainer.world_size, 1), 0
        raw = trainer.callback_metrics.get(self.monitor)
        # Every rank must take part in the reduce below, so they first agree that the value exists everywhere.
        if not trainer.strategy.reduce_boolean_decision(raw is not None, all=True):
            available = sorted(k for k in trainer.callback_metrics if "val" in k) or sorted(trainer.callback_metrics)
            out.notices.append(
                (
                    "monitor-missing",
                    f"`{self.monitor}` was not logged during validation, so {self.decline_id} and "
                    f"{self.fluctuation_id} are off; log it with self.log({self.monitor!r}, ...) or pass monitor=... "
                    f"(logged: {available})",
                )
            )
            return out
        value = torch.as_tensor(raw, dtype=torch.float32, device=pl_module.device).detach().mean()
        val = float(trainer.strategy.reduce(value, reduce_op="mean"))
        # the value's standard error over all ranks (each rank's own batches; nan where one is unknown)
        se_local = torch.tensor(self.validation_se() ** 2, dtype=torch.float64, device=pl_module.device)
        se = math.sqrt(float(trainer.strategy.reduce(se_local, reduce_op="mean")) / max(trainer.world_size, 1))
        ctx = StepContext(epoch=trainer.current_epoch, global_step=trainer.global_step)
        fluctuation_se, se_df = se, batches - 1.0
        if not math.isfinite(se) and batches > 0 and math.isfinite(train_variance):
            # no batch values: each validation sample as noisy as a training sample
            fluctuation_se = math.sqrt(train_variance / batches * batch_ratio(trainer))
            se_df = train_count - 1.0
        higher = self.higher_is_better
        run = Validation(
            val, train=train_mean, se=se, noise_se=fluctuation_se, df=max(se_df, 1.0), lr=mean_lr(trainer),
            baseline=self.stagnant.baseline, metric=self.monitor, higher_is_better=higher,
            is_loss=not higher and "loss" in self.monitor,
        )
        out.alerts += self.feed(ctx, Measures(validation=run))
        if run.is_loss:  # the swing judged the value: the (pooled) standard error it judged it with
            judged = self.swing.val_previous
            if judged is not None and math.isfinite(judged[1]):
                out.scalars[loss_tag("val_se")] = math.sqrt(judged[1])  # the report replays it
        out.scalars[loss_tag("val")] = val
        train_f, val_f = self.fluctuation.measures()
        if math.isfinite(train_f) and math.isfinite(val_f):
            out.scalars[loss_tag("train_fluctuation")] = train_f
            out.scalars[loss_tag(cast(LossSeries, self.fluctuation_id))] = val_f  # the series is named after its rule
        return out
