"""AnomalyAlarm: non-finite guard, loss-swing and validation-trend alerts, learning-rate and loss logging."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal

import pytorch_lightning as pl
import torch
from pytorch_lightning.trainer.states import TrainerFn

from lightning_diag._validation import check_choice, check_int, check_number
from lightning_diag.alerts import (
    LOSS_STAGNANT,
    LOSS_SWING,
    NONFINITE_GRAD,
    NONFINITE_LOSS,
    NONFINITE_ROLLBACK,
    VAL_DECLINE,
    VAL_FLUCTUATION,
    Alert,
    NonFiniteAction,
    Severity,
)
from lightning_diag.callbacks.base import DiagCallback, extract_loss
from lightning_diag.callbacks.nonfinite_recovery import NonFiniteRecovery
from lightning_diag.nonfinite_locate import Localisation
from lightning_diag.rollback import RollbackDevice
from lightning_diag.rules.anomaly import (
    DEFAULT_STAGNANT_BASELINE_STEPS,
    DEFAULT_STAGNANT_MIN_DROP,
    DEFAULT_STAGNANT_PATIENCE,
    DEFAULT_SWING_MIN_DELTA,
    DEFAULT_SWING_PATIENCE,
    DEFAULT_SWING_THRESHOLD,
    DEFAULT_VAL_DECLINE_MIN_DELTA,
    DEFAULT_VAL_DECLINE_PATIENCE,
    DEFAULT_VAL_FLUCTUATION_MIN,
    DEFAULT_VAL_FLUCTUATION_MIN_ABS,
    DEFAULT_VAL_FLUCTUATION_RATIO,
    DEFAULT_VAL_FLUCTUATION_WINDOW,
    LossStagnantRule,
    LossSwingRule,
    ValDeclineRule,
    ValFluctuationRule,
)
from lightning_diag.rules.base import Latch
from lightning_diag.rules.rollback import (
    DEFAULT_MAX_ROLLBACKS,
    DEFAULT_ROLLBACK_EVERY_N_STEPS,
    DEFAULT_ROLLBACK_KEEP,
    DEFAULT_ROLLBACK_LR_FACTOR,
)
from lightning_diag.stats.norms import all_finite
from lightning_diag.tensorboard import tag

__all__ = ["DEFAULT_MAX_SCALER_OVERFLOWS", "DEFAULT_MAX_SKIPS", "NONFINITE_ACTIONS", "AnomalyAlarm", "NonFiniteError"]

#: ``on_nonfinite="skip"``: skipped optimizer steps allowed in one fit before the alarm stops training.
DEFAULT_MAX_SKIPS = 5
#: With a GradScaler (``16-mixed``), consecutive overflow steps with a finite loss before ``nonfinite_grad``.
DEFAULT_MAX_SCALER_OVERFLOWS = 5
NONFINITE_ACTIONS: tuple[str, ...] = ("stop", "raise", "skip", "warn", "rollback")
_SHOWN_PARAMS = 5
_NOT_ROLLED_BACK = ("nonfinite_latch", "skips", "pending_nonfinite", "rollback")
_STATE_KEYS = (
    "swing",
    "stagnant",
    "val_decline",
    "val_fluctuation",
    "nonfinite_latch",
    "skips",
    "accumulators",
    "window_start",
    "last_finite_loss",
    "pending_nonfinite",
)
#: "No non-finite step seen" in the MIN-reduction of warn mode's first bad step.
_NO_STEP = 2**62


class NonFiniteError(RuntimeError):
    """Raised by :class:`AnomalyAlarm` with ``on_nonfinite="raise"`` instead of applying a non-finite update.

    Attributes:
        alert: The critical alert that was written before raising.
    """

    def __init__(self, alert: Alert) -> None:
        super().__init__(alert.message)
        self.alert = alert


class AnomalyAlarm(DiagCallback):
    r"""Stops training before a non-finite update, and alerts on loss swings and validation trends.

    Rules (exact definitions in ``docs/anomaly_alarm.md``):

    * ``nonfinite_loss`` / ``nonfinite_grad`` (critical): a NaN/Inf in the loss of any micro-batch since the last
      optimizer step, or in a gradient the optimizer is about to apply (after accumulation and AMP unscaling,
      before clipping). Checked on every optimizer step.
    * ``loss_swing`` (warning): the training loss swings by more than ``swing_threshold`` on ``swing_patience``
      consecutive epochs (or windows of ``swing_window`` steps).
    * ``loss_stagnant`` (warning): after ``stagnant_patience`` epochs (or windows) the training loss is not
      ``stagnant_min_drop`` below its initial level (the mean of the first ``stagnant_baseline_steps`` steps,
      the untrained model's loss: chance level for a classifier).
    * ``val_decline`` (warning): ``monitor`` worsens on ``val_decline_patience`` consecutive validation runs.
    * ``val_fluctuation`` (warning): the validation fluctuation exceeds ``val_fluctuation_ratio`` times the
      training-loss fluctuation over the last ``val_fluctuation_window`` validation runs.

    Logged metrics (TensorBoard, global rank zero):

    * ``diag/lr/<Optimizer>/group_<j>``: learning rate of every optimizer and parameter group (logging steps).
    * ``diag/loss/train_step``: the training loss (logging steps).
    * ``diag/loss/train_epoch``: mean training loss of the epoch (or window) over all ranks.
    * ``diag/loss/swing``: relative change of that mean from the previous epoch (or window).
    * ``diag/loss/val``: the monitored validation value.
    * ``diag/loss/train_fluctuation``, ``diag/loss/val_fluctuation``: the two fluctuations once the window is full.
    * ``diag/threshold/loss_swing``: ``swing_threshold``, at the steps of ``diag/loss/swing`` (dashboard line).

    Args:
        on_nonfinite: ``"stop"`` (default): the offending step changes no parameter and no optimizer state, a
            critical alert is written and ``trainer.fit`` returns; ``"raise"``: the same, then
            :class:`NonFiniteError`; ``"skip"``: the step is skipped and training goes on, until ``max_skips``
            steps were skipped, then as ``"stop"``; ``"warn"``: alert only, the update is applied.
        max_skips: With ``on_nonfinite="skip"``, skipped steps allowed in one fit.
        max_scaler_overflows: With a GradScaler (``16-mixed``), consecutive overflow steps with a finite loss
            (which the scaler skips by design) before ``nonfinite_grad`` fires.
        swing_threshold: Relative change of the loss that counts as a swing (0.10 = 10%).
        swing_patience: Consecutive swinging epochs (windows) before ``loss_swing`` fires.
        swing_min_delta: Absolute loss change below which nothing swings.
        swing_window: ``"epoch"`` to compare epoch means, or a number of optimizer steps to compare means over
            consecutive windows of that many steps (runs with one long epoch).
        stagnant_min_drop: ``loss_stagnant``: fraction of the initial loss the training loss must fall by.
        stagnant_patience: ``loss_stagnant``: epochs (or windows) the loss has to fall by ``stagnant_min_drop``.
        stagnant_baseline_steps: ``loss_stagnant``: first training batches whose mean loss is the initial loss.
        monitor: Validation metric read from ``trainer.callback_metrics``.
        mode: ``"min"`` if lower ``monitor`` is better, ``"max"`` if higher is.
        val_decline_patience: Consecutive worse validation runs before ``val_decline`` fires.
        val_decline_min_delta: Change that counts as worse.
        val_fluctuation_ratio: Multiple of the training fluctuation the validation fluctuation must exceed.
        val_fluctuation_window: Validation runs the fluctuations are measured over (at least 3).
        val_fluctuation_min: Validation fluctuation below which ``val_fluctuation`` never fires.
        val_fluctuation_min_range: Range (max - min, metric units) of the validation window below which
            ``val_fluctuation`` never fires (keeps converged runs with near-zero losses quiet).
        log_every_n_steps: Logging interval for step-level tags; defaults to the trainer's.

    Raises:
        TypeError: If an argument has the wrong type.
        ValueError: If an argument is out of range or not one of its allowed values.
        NonFiniteError: During ``fit``, with ``on_nonfinite="raise"``, at the first non-finite step.

    Example:
        >>> alarm = AnomalyAlarm(on_nonfinite="skip", max_skips=3)
        >>> alarm.on_nonfinite
        'skip'
    """

    def __init__(
        self,
        on_nonfinite: NonFiniteAction = "stop",
        max_skips: int = DEFAULT_MAX_SKIPS,
        max_scaler_overflows: int = DEFAULT_MAX_SCALER_OVERFLOWS,
        swing_threshold: float = DEFAULT_SWING_THRESHOLD,
        swing_patience: int = DEFAULT_SWING_PATIENCE,
        swing_min_delta: float = DEFAULT_SWING_MIN_DELTA,
        swing_window: Literal["epoch"] | int = "epoch",
        stagnant_min_drop: float = DEFAULT_STAGNANT_MIN_DROP,
        stagnant_patience: int = DEFAULT_STAGNANT_PATIENCE,
        stagnant_baseline_steps: int = DEFAULT_STAGNANT_BASELINE_STEPS,
        monitor: str = "val_loss",
        mode: Literal["min", "max"] = "min",
        val_decline_patience: int = DEFAULT_VAL_DECLINE_PATIENCE,
        val_decline_min_delta: float = DEFAULT_VAL_DECLINE_MIN_DELTA,
        val_fluctuation_ratio: float = DEFAULT_VAL_FLUCTUATION_RATIO,
        val_fluctuation_window: int = DEFAULT_VAL_FLUCTUATION_WINDOW,
        val_fluctuation_min: float = DEFAULT_VAL_FLUCTUATION_MIN,
        val_fluctuation_min_range: float = DEFAULT_VAL_FLUCTUATION_MIN_ABS,
        log_every_n_steps: int | None = None,
        locate_nonfinite: bool = True,
        rollback_every_n_steps: int = DEFAULT_ROLLBACK_EVERY_N_STEPS,
        rollback_lr_factor: float = DEFAULT_ROLLBACK_LR_FACTOR,
        max_rollbacks: int = DEFAULT_MAX_ROLLBACKS,
        rollback_device: RollbackDevice = "cpu",
        rollback_snapshots: int = DEFAULT_ROLLBACK_KEEP,
    ) -> None:
        super().__init__(log_every_n_steps=log_every_n_steps)
        self.on_nonfinite = check_choice("on_nonfinite", on_nonfinite, NONFINITE_ACTIONS)
        self.max_skips = check_int("max_skips", max_skips, low=0)
        self.max_scaler_overflows = check_int("max_scaler_overflows", max_scaler_overflows, low=1)
        check_number("swing_threshold", swing_threshold, low=0.0)
        check_int("swing_patience", swing_patience, low=1)
        check_number("swing_min_delta", swing_min_delta, low=0.0, low_inclusive=True)
        if swing_window != "epoch":
            bad_window = f"Expected argument `swing_window` to be 'epoch' or an int >= 1, but got {swing_window!r}"
            if isinstance(swing_window, bool) or not isinstance(swing_window, (int, str)):
                raise TypeError(bad_window)
            if isinstance(swing_window, str) or swing_window < 1:
                raise ValueError(bad_window)
        self.swing_window = swing_window
        self.stagnant_min_drop = check_number(
            "stagnant_min_drop", stagnant_min_drop, low=0.0, high=1.0, low_inclusive=True, high_inclusive=False
        )
        self.stagnant_patience = check_int("stagnant_patience", stagnant_patience, low=1)
        self.stagnant_baseline_steps = check_int("stagnant_baseline_steps", stagnant_baseline_steps, low=1)
        if not isinstance(monitor, str) or not monitor:
            raise TypeError(f"Expected argument `monitor` to be a non-empty metric name, but got {monitor!r}")
        self.monitor = monitor
        self.mode = check_choice("mode", mode, ("min", "max"))
        check_int("val_decline_patience", val_decline_patience, low=1)
        check_number("val_decline_min_delta", val_decline_min_delta, low=0.0, low_inclusive=True)
        check_number("val_fluctuation_ratio", val_fluctuation_ratio, low=0.0)
        check_int("val_fluctuation_window", val_fluctuation_window, low=3)
        check_number("val_fluctuation_min", val_fluctuation_min, low=0.0, low_inclusive=True)
        check_number("val_fluctuation_min_range", val_fluctuation_min_range, low=0.0, low_inclusive=True)

        self.swing_threshold = float(swing_threshold)
        self.swing_patience = swing_patience
        self.swing_min_delta = float(swing_min_delta)
        self.val_decline_patience = val_decline_patience
        self.val_decline_min_delta = float(val_decline_min_delta)
        self.val_fluctuation_ratio = float(val_fluctuation_ratio)
        self.val_fluctuation_window = val_fluctuation_window
        self.val_fluctuation_min = float(val_fluctuation_min)
        self.val_fluctuation_min_range = float(val_fluctuation_min_range)
        if not isinstance(locate_nonfinite, bool):
            raise TypeError(f"Expected argument `locate_nonfinite` to be a bool, but got {locate_nonfinite!r}")
        self.locate_nonfinite = locate_nonfinite
        self.rollback_every_n_steps = check_int("rollback_every_n_steps", rollback_every_n_steps, low=1)
        self.rollback_lr_factor = check_number(
            "rollback_lr_factor", rollback_lr_factor, low=0.0, high=1.0, low_inclusive=False, high_inclusive=False
        )
        self.max_rollbacks = check_int("max_rollbacks", max_rollbacks, low=0)
        self.rollback_device = check_choice("rollback_device", rollback_device, ("cpu", "device"))
        self.rollback_snapshots = check_int("rollback_snapshots", rollback_snapshots, low=1)
        self.recovery = NonFiniteRecovery(
            locate=locate_nonfinite,
            rollback=self.on_nonfinite == "rollback",
            every_n_steps=self.rollback_every_n_steps,
            lr_factor=float(self.rollback_lr_factor),
            max_rollbacks=self.max_rollbacks,
            device=rollback_device,
            keep=self.rollback_snapshots,
        )
        self._make_rules()
        self._nonfinite_latch = Latch()
        self._skips = 0
        self._reset_step_state()
        self._reset_accumulators()

    def thresholds(self) -> dict[str, float]:
        """The thresholds in effect (see :meth:`DiagCallback.thresholds`).

        Example:
            >>> AnomalyAlarm(swing_threshold=0.2).thresholds()["loss_swing"]
            0.2
        """
        values = {
            LOSS_SWING: self.swing_threshold,
            f"{LOSS_SWING}.patience": float(self.swing_patience),
            f"{LOSS_SWING}.min_delta": self.swing_min_delta,
            VAL_DECLINE: float(self.val_decline_patience),
            f"{VAL_DECLINE}.min_delta": self.val_decline_min_delta,
            f"{VAL_DECLINE}.higher_is_better": float(self.mode == "max"),
            VAL_FLUCTUATION: self.val_fluctuation_ratio,
            f"{VAL_FLUCTUATION}.window": float(self.val_fluctuation_window),
            f"{VAL_FLUCTUATION}.min": self.val_fluctuation_min,
            f"{VAL_FLUCTUATION}.min_range": self.val_fluctuation_min_range,
            f"{NONFINITE_GRAD}.max_scaler_overflows": float(self.max_scaler_overflows),
            LOSS_STAGNANT: self.stagnant_min_drop,
            f"{LOSS_STAGNANT}.patience": float(self.stagnant_patience),
            f"{LOSS_STAGNANT}.baseline_steps": float(self.stagnant_baseline_steps),
        }
        if isinstance(self.swing_window, int):
            values[f"{LOSS_SWING}.window_steps"] = float(self.swing_window)
        if self.on_nonfinite == "skip":
            values[f"{NONFINITE_LOSS}.max_skips"] = float(self.max_skips)
        if self.on_nonfinite == "rollback":
            values[f"{NONFINITE_ROLLBACK}.every_n_steps"] = float(self.rollback_every_n_steps)
            values[f"{NONFINITE_ROLLBACK}.lr_factor"] = float(self.rollback_lr_factor)
            values[f"{NONFINITE_ROLLBACK}.max_rollbacks"] = float(self.max_rollbacks)
        return values

    @property
    def rollbacks(self) -> int:
        """Rollbacks made in this fit (``on_nonfinite="rollback"``; kept across a resume)."""
        return self.recovery.rule.rollbacks

    @property
    def lr_scale(self) -> float:
        """The factor on every learning rate now in force: ``rollback_lr_factor ** rollbacks``."""
        return self.recovery.lr_scale

    # -- state -------------------------------------------------------------------------------------------
    def _make_rules(self) -> None:
        unit = "epoch" if self.swing_window == "epoch" else f"window of {self.swing_window} step"
        self.swing_rule = LossSwingRule(
            threshold=self.swing_threshold,
            patience=self.swing_patience,
            min_delta=self.swing_min_delta,
            unit=unit,
        )
        self.stagnant_rule = LossStagnantRule(
            min_drop=self.stagnant_min_drop, patience=self.stagnant_patience, unit=unit
        )
        self.val_decline_rule = ValDeclineRule(
            monitor=self.monitor,
            mode=self.mode,  # type: ignore[arg-type]
            patience=self.val_decline_patience,
            min_delta=self.val_decline_min_delta,
        )
        self.val_fluctuation_rule = ValFluctuationRule(
            ratio=self.val_fluctuation_ratio,
            window=self.val_fluctuation_window,
            min_fluctuation=self.val_fluctuation_min,
            monitor=self.monitor,
            min_abs=self.val_fluctuation_min_range,
        )

    def _reset_step_state(self) -> None:
        self._halted = False
        self._scaler_overflows = 0
        self._loss_bad: torch.Tensor | None = None  # NaN/Inf in a micro-batch loss since the last step
        self._last_finite_loss: torch.Tensor | float = math.nan
        # "warn" mode keeps its findings on the device until a logging step reads them (-1: none).
        self._pending_loss_step: torch.Tensor | None = None
        self._pending_grad_step: torch.Tensor | None = None
        self._deferred_steps = 0  # steps checked since the last read-back (the same count on every rank)

    def _reset_accumulators(self) -> None:
        self._acc: dict[str, torch.Tensor | float] = {
            "epoch_sum": 0.0,
            "epoch_count": 0.0,
            "since_val_sum": 0.0,
            "since_val_count": 0.0,
            "window_sum": 0.0,
            "window_count": 0.0,
            "initial_sum": 0.0,
            "initial_count": 0.0,
        }
        self._initial_batches = 0  # batches in the initial-loss baseline (the same count on every rank)
        # The global step the current step window started at; set at train start unless a checkpoint did.
        self._window_start: int | None = None
        # Set by load_state_dict: the accumulators hold the sums of every rank (see on_save_checkpoint).
        self._acc_restored = False

    @property
    def state_key(self) -> str:
        return self._generate_state_key(monitor=self.monitor, swing_window=self.swing_window)

    def state_dict(self) -> dict[str, Any]:
        """Rule histories, latches, the skip count, the partial loss sums and warn mode's pending findings.

        The loss sums here are this process's; a checkpoint saved by the trainer holds the sums of every rank
        (see :meth:`on_save_checkpoint`).
        """
        pending = [-1, -1]
        if self._pending_loss_step is not None and self._pending_grad_step is not None:
            pending = torch.stack([self._pending_loss_step, self._pending_grad_step]).tolist()
        acc = {k: float(v) for k, v in self._acc.items()}
        acc["initial_batches"] = float(self._initial_batches)
        return {
            "swing": self.swing_rule.state_dict(),
            "stagnant": self.stagnant_rule.state_dict(),
            "val_decline": self.val_decline_rule.state_dict(),
            "val_fluctuation": self.val_fluctuation_rule.state_dict(),
            "nonfinite_latch": self._nonfinite_latch.state_dict(),
            "skips": self._skips,
            "accumulators": acc,
            "window_start": self._window_start,
            "last_finite_loss": float(self._last_finite_loss),
            "pending_nonfinite": {
                "loss_step": int(pending[0]),
                "grad_step": int(pending[1]),
                "steps": self._deferred_steps,
            },
            "rollback": self.recovery.state_dict(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output.

        Raises:
            KeyError: If a key is missing; the message names every missing key.
        """
        self.check_state_keys(state_dict, _STATE_KEYS)
        self.swing_rule.load_state_dict(state_dict["swing"])
        self.stagnant_rule.load_state_dict(state_dict["stagnant"])
        self.val_decline_rule.load_state_dict(state_dict["val_decline"])
        self.val_fluctuation_rule.load_state_dict(state_dict["val_fluctuation"])
        self._nonfinite_latch.load_state_dict(state_dict["nonfinite_latch"])
        self._skips = int(state_dict["skips"])
        acc = dict(state_dict["accumulators"])
        self._initial_batches = int(acc.pop("initial_batches", 0))
        self._acc = {k: float(acc.get(k, 0.0)) for k in self._acc}
        self._acc_restored = True
        start = state_dict["window_start"]
        self._window_start = None if start is None else int(start)
        self._last_finite_loss = float(state_dict["last_finite_loss"])
        pending = state_dict["pending_nonfinite"]
        self._pending_loss_step = torch.tensor(int(pending["loss_step"]))
        self._pending_grad_step = torch.tensor(int(pending["grad_step"]))
        self._deferred_steps = int(pending["steps"])
        if "rollback" in state_dict:  # absent from checkpoints written before rollback existed
            self.recovery.load_state_dict(state_dict["rollback"])

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """Save what all ranks know, not rank zero's part: the partial loss sums over all ranks (SUM) and warn
        mode's first pending non-finite steps over all ranks (MIN).

        Lightning builds the checkpoint on every rank (only rank zero writes it), so the reductions run on all.
        """
        state = checkpoint.get("callbacks", {}).get(self.state_key)
        if state is None or trainer.world_size <= 1:
            return
        keys = list(self._acc)
        local = torch.tensor([float(self._acc[k]) for k in keys], dtype=torch.float64, device=pl_module.device)
        total = trainer.strategy.reduce(local, reduce_op="sum").tolist()
        state["accumulators"].update(zip(keys, total, strict=True))
        pending = state["pending_nonfinite"]
        steps = [pending["loss_step"], pending["grad_step"]]
        local_first = torch.tensor([s if s >= 0 else _NO_STEP for s in steps], device=pl_module.device)
        first = trainer.strategy.reduce(local_first, reduce_op="min").long().tolist()
        pending["loss_step"], pending["grad_step"] = (s if s < _NO_STEP else -1 for s in first)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Start the step window, and share restored all-rank loss sums out evenly over this run's ranks."""
        if self._window_start is None:
            self._window_start = trainer.global_step
        if self._acc_restored and trainer.world_size > 1:
            # The checkpoint holds the sums over all ranks: each rank takes an equal share, so the next
            # all-reduce adds up to them again (whatever the world size of the run that saved them).
            self._acc = {k: float(v) / trainer.world_size for k, v in self._acc.items()}
        self._acc_restored = False
        self.recovery.start(trainer, pl_module, self._rollback_state)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Remove the learning-rate hooks of ``on_nonfinite="rollback"``."""
        self.recovery.stop()

    def _rollback_state(self) -> dict[str, Any]:
        # The alarm's own loss-trend state goes into each snapshot; the non-finite bookkeeping does not.
        state = self.state_dict()
        for key in _NOT_ROLLED_BACK:
            state.pop(key, None)
        return state

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """Keep a reference to the batch (no copy) for the replay of a failing step."""
        if self.on_nonfinite != "warn":
            self.recovery.on_batch_start(batch, batch_idx)

    # -- lifecycle ---------------------------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Start a fit with fresh rules (a resume then loads their state)."""
        super().setup(trainer, pl_module, stage)
        if stage == TrainerFn.FITTING:
            self._make_rules()
            self._nonfinite_latch = Latch()
            self.recovery.reset()
            self.recovery.check_module(pl_module)
            self._skips = 0
            self._reset_step_state()
            self._reset_accumulators()

    # -- non-finite guard --------------------------------------------------------------------------------
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        """Remember, on the device, whether this micro-batch's loss is finite."""
        if not isinstance(loss, torch.Tensor):
            return
        bad = ~torch.isfinite(loss.detach()).all()
        self._loss_bad = bad if self._loss_bad is None else (self._loss_bad | bad)

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        """Check the loss and the gradients about to be applied; block the step if they are not finite."""
        try:
            self._check_step(trainer, pl_module, optimizer)
        finally:
            self.recovery.on_step_checked()

    def _check_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer) -> None:
        loss_bad = self._loss_bad
        self._loss_bad = None
        if self._halted:
            _drop_gradients(optimizer)
            return
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if not grads and loss_bad is None:
            return
        grad_bad = ~all_finite(grads).to(grads[0].device if grads else loss_bad.device)  # type: ignore[union-attr]
        if loss_bad is not None:
            loss_bad = loss_bad.to(grad_bad.device)
        if self.on_nonfinite == "warn":
            self._defer(trainer, loss_bad, grad_bad)
            return
        # Deciding not to apply an update is a host decision: one 2-element read per optimizer step.
        local_loss, local_grad = torch.stack(
            [loss_bad if loss_bad is not None else torch.zeros_like(grad_bad), grad_bad]
        ).tolist()
        strategy = trainer.strategy
        if not strategy.reduce_boolean_decision(bool(local_loss or local_grad), all=False):
            self._nonfinite_latch.update("loss", False)
            self._nonfinite_latch.update("gradients", False)
            self._scaler_overflows = 0
            return
        any_loss = strategy.reduce_boolean_decision(bool(local_loss), all=False)
        if not any_loss and getattr(trainer.precision_plugin, "scaler", None) is not None:
            # GradScaler skips overflow steps and lowers its scale by design: only a run of them is a fault.
            self._scaler_overflows += 1
            if self._scaler_overflows < self.max_scaler_overflows:
                return
        found = self.recovery.localise(trainer, pl_module, bool(local_loss), bool(local_grad))
        if self.on_nonfinite == "rollback":
            self._rollback(trainer, pl_module, optimizer, any_loss, found)
            return
        alert = self._nonfinite_alert(trainer, pl_module, any_loss, self.context(trainer).global_step, found)
        latched = [alert] if self._nonfinite_latch.update("loss" if any_loss else "gradients", True) else []
        if self.on_nonfinite == "raise":
            self.record([alert])
            self.writer.flush()
            raise NonFiniteError(alert)
        _drop_gradients(optimizer)
        if self.on_nonfinite == "skip":
            self._skips += 1
            self.record(latched)
            if self._skips > self.max_skips:
                self._stop(trainer)
                self.record(
                    [
                        Alert(
                            rule=alert.rule,
                            severity=Severity.CRITICAL,
                            message=f"{self._skips} optimizer steps had non-finite values, more than "
                            f"max_skips={self.max_skips}: training stopped before applying this one",
                            epoch=alert.epoch,
                            global_step=alert.global_step,
                            value=float(self._skips),
                            threshold=float(self.max_skips),
                            source="skip_limit",
                        )
                    ]
                )
            return
        self.record([alert])
        self._stop(trainer)

    def _rollback(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        optimizer: torch.optim.Optimizer,
        any_loss: bool,
        found: Localisation,
    ) -> None:
        ctx = self.context(trainer)
        choice, extra = self.recovery.rollback(trainer, pl_module)
        for opt in trainer.optimizers:
            _drop_gradients(opt)
        if choice.step is None:
            alert = self._nonfinite_alert(trainer, pl_module, any_loss, ctx.global_step, found)
            limit = dataclasses.replace(
                alert,
                message=f"{alert.message} No rollback: {choice.reason}; training stops.",
                source="rollback_limit",
                value=float(self.rollbacks),
                threshold=float(self.max_rollbacks),
            )
            self.record([limit])
            self._stop(trainer)
            return
        if extra:
            keep = {k: v for k, v in self.state_dict().items() if k in _NOT_ROLLED_BACK}
            self.load_state_dict({**extra, **keep})
            self._acc_restored = False
        what = "NaN/Inf in the loss" if any_loss else "NaN/Inf in a gradient"
        where = f"; {found.detail}" if found.found else ""
        source = found.source if found.found else ("loss" if any_loss else "gradients")
        self.record([self.recovery.rollback_alert(ctx, choice, what + where, source)])

    def _stop(self, trainer: pl.Trainer) -> None:
        self._halted = True
        trainer.should_stop = True
        for opt in trainer.optimizers:
            _drop_gradients(opt)

    def _defer(self, trainer: pl.Trainer, loss_bad: torch.Tensor | None, grad_bad: torch.Tensor) -> None:
        step = trainer.global_step
        device = grad_bad.device
        self._deferred_steps += 1
        if self._pending_grad_step is None or self._pending_loss_step is None:
            self._pending_grad_step = torch.full((), -1, dtype=torch.long, device=device)
            self._pending_loss_step = torch.full((), -1, dtype=torch.long, device=device)
        elif self._pending_grad_step.device != device:  # restored from a checkpoint onto the CPU
            self._pending_grad_step = self._pending_grad_step.to(device)
            self._pending_loss_step = self._pending_loss_step.to(device)
        self._pending_grad_step = torch.where(grad_bad & (self._pending_grad_step < 0), step, self._pending_grad_step)
        if loss_bad is not None:
            self._pending_loss_step = torch.where(
                loss_bad & (self._pending_loss_step < 0), step, self._pending_loss_step
            )

    def _flush_deferred(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._pending_grad_step is None or self._pending_loss_step is None or not self._deferred_steps:
            return  # nothing checked since the last read-back: no news, and the latch stays as it is
        self._deferred_steps = 0
        loss_step, grad_step = torch.stack([self._pending_loss_step, self._pending_grad_step]).tolist()
        self._pending_loss_step.fill_(-1)
        self._pending_grad_step.fill_(-1)
        strategy = trainer.strategy
        bad = strategy.reduce_boolean_decision(loss_step >= 0 or grad_step >= 0, all=False)
        if not bad:
            self._nonfinite_latch.update("loss", False)
            self._nonfinite_latch.update("gradients", False)
            return
        any_loss = strategy.reduce_boolean_decision(loss_step >= 0, all=False)
        # The first bad step over all ranks (MIN), so every rank's alert names the same step.
        local_first = [loss_step if loss_step >= 0 else _NO_STEP, grad_step if grad_step >= 0 else _NO_STEP]
        first_loss, first_grad = (
            strategy.reduce(torch.tensor(local_first, device=pl_module.device), reduce_op="min").long().tolist()
        )
        first = first_loss if any_loss else first_grad
        alert = self._nonfinite_alert(trainer, pl_module, any_loss, first if first < _NO_STEP else trainer.global_step)
        if self._nonfinite_latch.update(alert.source, True):
            self.record([alert])

    def _nonfinite_alert(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        loss_bad: bool,
        step: int,
        found: Localisation | None = None,
    ) -> Alert:
        lrs = _learning_rates(trainer)
        lr_text = ", ".join(f"{k}={v:.3g}" for k, v in lrs.items()) or "none"
        bad_params = _nonfinite_parameters(pl_module)
        params_text = ", ".join(bad_params) if bad_params else "none (the gradients are finite)"
        last = float(self._last_finite_loss)
        what = "the training loss is non-finite" if loss_bad else "a gradient is non-finite"
        action = {
            "stop": "the update was not applied and training stops",
            "raise": "the update was not applied; raising NonFiniteError",
            "skip": "the update was skipped",
            "warn": "the update was applied (on_nonfinite='warn')",
            "rollback": "the update was not applied and training stops",
        }[self.on_nonfinite]
        where = f" First non-finite value: {found.detail}." if found is not None and found.found else ""
        message = (
            f"{what} at epoch {trainer.current_epoch}, global step {step}: {action}. "
            f"Learning rates: {lr_text}. Non-finite gradients in: {params_text}. "
            f"Last finite loss: {last:.6g}.{where}"
        )
        source = "loss" if loss_bad else "gradients"
        if found is not None and found.found:
            source = found.source
        return Alert(
            rule=NONFINITE_LOSS if loss_bad else NONFINITE_GRAD,
            severity=Severity.CRITICAL,
            message=message,
            epoch=trainer.current_epoch,
            global_step=step,
            value=None,
            threshold=None,
            source=source,
        )

    # -- loss trend --------------------------------------------------------------------------------------
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Accumulate the loss on the device; on logging steps write the loss and learning rates."""
        loss, problem = extract_loss(outputs)
        if problem is not None:
            self.notice(trainer, "loss:" + problem.split(":")[0], problem)
        if loss is not None and pl_module.automatic_optimization and trainer.accumulate_grad_batches > 1:
            loss = loss * trainer.accumulate_grad_batches  # Lightning hands callbacks the divided loss
        if loss is not None:
            finite = torch.isfinite(loss)
            clean = torch.where(finite, loss, torch.zeros_like(loss))
            weight = finite.to(loss.dtype)
            for prefix in ("epoch", "since_val", "window"):
                self._acc[prefix + "_sum"] = self._acc[prefix + "_sum"] + clean
                self._acc[prefix + "_count"] = self._acc[prefix + "_count"] + weight
            if self._initial_batches < self.stagnant_baseline_steps:
                self._initial_batches += 1
                self._acc["initial_sum"] = self._acc["initial_sum"] + clean
                self._acc["initial_count"] = self._acc["initial_count"] + weight
            last = self._last_finite_loss
            self._last_finite_loss = torch.where(
                finite, loss, last if isinstance(last, torch.Tensor) else torch.full_like(loss, last)
            )
        # Optimizer steps, not batches: accumulation micro-batches (global_step unchanged) do not count.
        if isinstance(self.swing_window, int):
            if self._window_start is None:
                self._window_start = trainer.global_step
            if trainer.global_step - self._window_start >= self.swing_window:
                self._window_start = trainer.global_step
                self._close_window(trainer, pl_module, "window")
        self.recovery.on_batch_end(trainer, pl_module, loss, self._rollback_state)
        if not self.is_logging_step(trainer):
            return
        step = trainer.global_step
        scale = self.recovery.lr_scale
        values = {tag("lr", *name.split("/")): lr * scale for name, lr in _learning_rates(trainer).items()}
        if loss is not None:
            values[tag("loss", "train_step")] = float(loss)
        self.writer.scalars(values, step)
        if self.on_nonfinite == "warn":
            self._flush_deferred(trainer, pl_module)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Close the epoch: its mean loss over all ranks feeds ``loss_swing`` in epoch mode."""
        if self.on_nonfinite == "warn":
            self._flush_deferred(trainer, pl_module)
        self._close_window(trainer, pl_module, "epoch")

    def _reduced_mean(self, trainer: pl.Trainer, pl_module: pl.LightningModule, prefix: str) -> float:
        total = torch.stack(
            [
                torch.as_tensor(self._acc[prefix + "_sum"], dtype=torch.float32, device=pl_module.device),
                torch.as_tensor(self._acc[prefix + "_count"], dtype=torch.float32, device=pl_module.device),
            ]
        )
        total = trainer.strategy.reduce(total, reduce_op="sum")
        self._acc[prefix + "_sum"] = 0.0
        self._acc[prefix + "_count"] = 0.0
        loss_sum, count = total.tolist()
        return loss_sum / count if count > 0 else math.nan

    def _close_window(self, trainer: pl.Trainer, pl_module: pl.LightningModule, prefix: str) -> None:
        mean = self._reduced_mean(trainer, pl_module, prefix)
        if not math.isfinite(mean):
            return
        step = trainer.global_step
        self.writer.scalar(tag("loss", "train_epoch" if prefix == "epoch" else "train_window"), mean, step)
        if (prefix == "epoch") != (self.swing_window == "epoch"):
            return
        if self.stagnant_rule.baseline is None and self._initial_batches > 0:
            self.stagnant_rule.set_baseline(self._reduced_mean(trainer, pl_module, "initial"))
        ctx = self.context(trainer)
        self.record(self.swing_rule.update(mean, ctx) + self.stagnant_rule.update(mean, ctx))
        if math.isfinite(self.swing_rule.last_change):
            values = {tag("loss", "swing"): self.swing_rule.last_change, **self.threshold_lines(LOSS_SWING)}
            self.writer.scalars(values, step)

    # -- validation trend --------------------------------------------------------------------------------
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Feed the monitored validation value to ``val_decline`` and ``val_fluctuation``."""
        if trainer.sanity_checking or trainer.state.fn != TrainerFn.FITTING:
            return
        train_mean = self._reduced_mean(trainer, pl_module, "since_val")
        raw = trainer.callback_metrics.get(self.monitor)
        # Every rank must take part in the reduce below, so they first agree that the value exists everywhere.
        if not trainer.strategy.reduce_boolean_decision(raw is not None, all=True):
            available = sorted(k for k in trainer.callback_metrics if "val" in k) or sorted(trainer.callback_metrics)
            self.notice(
                trainer,
                "monitor-missing",
                f"`{self.monitor}` was not logged during validation, so val_decline and val_fluctuation are off; "
                f"log it with self.log({self.monitor!r}, ...) or pass monitor=... (logged: {available})",
            )
            return
        value = torch.as_tensor(raw, dtype=torch.float32, device=pl_module.device).detach().mean()
        val = float(trainer.strategy.reduce(value, reduce_op="mean"))
        ctx = self.context(trainer)
        alerts = self.val_decline_rule.update(val, ctx)
        alerts += self.val_fluctuation_rule.update(train_mean, val, ctx)
        self.record(alerts)
        values = {tag("loss", "val"): val}
        train_f, val_f = self.val_fluctuation_rule.measures()
        if math.isfinite(train_f) and math.isfinite(val_f):
            values[tag("loss", "train_fluctuation")] = train_f
            values[tag("loss", "val_fluctuation")] = val_f
        self.writer.scalars(values, ctx.global_step)


def _drop_gradients(optimizer: torch.optim.Optimizer) -> None:
    # torch optimizers skip parameters whose .grad is None: no parameter, moment or step count changes.
    for group in optimizer.param_groups:
        for p in group["params"]:
            p.grad = None


def _learning_rates(trainer: pl.Trainer) -> dict[str, float]:
    names: dict[str, int] = {}
    out: dict[str, float] = {}
    for opt in trainer.optimizers:
        base = type(opt).__name__
        n = names.get(base, 0)
        names[base] = n + 1
        name = base if n == 0 else f"{base}_{n}"
        for j, group in enumerate(opt.param_groups):
            lr = group.get("lr")
            if lr is not None:
                out[f"{name}/group_{j}"] = float(lr)
    return out


def _nonfinite_parameters(pl_module: pl.LightningModule) -> list[str]:
    # Only on the failure path: a per-parameter loop here is fine.
    bad = []
    for name, p in pl_module.named_parameters():
        if p.grad is not None and not bool(torch.isfinite(p.grad).all()):
            bad.append(name)
            if len(bad) >= _SHOWN_PARAMS:
                bad.append("...")
                break
    return bad
