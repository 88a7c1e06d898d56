"""AnomalyAlarm: non-finite guard, loss-swing and validation-trend alerts, learning-rate and loss logging.

A thin adapter over three helpers it owns: the non-finite decisions are
:class:`~lightning_diag.rules.nonfinite.NonFinitePolicy` (pure), found and carried out by
:class:`~lightning_diag.callbacks.anomaly_alarm.nonfinite_guard.NonFiniteGuard`; localisation and rollback are
:class:`~.nonfinite_recovery.NonFiniteRecovery`; the training-loss periods and the trend
rules (``rules/loss_swing.py``, ``loss_stagnant.py``, ``val_decline.py``, ``val_fluctuation.py``) are
:class:`~lightning_diag.callbacks.anomaly_alarm.loss_trend.LossTrend`.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Literal

import pytorch_lightning as pl
import torch
from pytorch_lightning.trainer.states import TrainerFn

from lightning_diag.callbacks.anomaly_alarm.loss_trend import (
    LossTrend,
    TrendOutput,
    build_loss_sums,
    check_swing_window,
    trend_unit,
)
from lightning_diag.callbacks.anomaly_alarm.lr_logging import lr_scalars
from lightning_diag.callbacks.anomaly_alarm.nonfinite_guard import DeferredFindings, NonFiniteError, NonFiniteGuard
from lightning_diag.callbacks.anomaly_alarm.nonfinite_recovery import NonFiniteRecovery, RollbackSettings
from lightning_diag.callbacks.anomaly_alarm.quiet import QuietLossKeeping
from lightning_diag.callbacks.anomaly_alarm.runtime_checks import RuntimeChecks
from lightning_diag.callbacks.anomaly_alarm.silent_checks import ReplicaCheck, TrainModeCheck
from lightning_diag.callbacks.common.base import AlertHandler, RuleChoices, extract_loss
from lightning_diag.callbacks.common.preset import Detector, Preset
from lightning_diag.callbacks.common.reduction import FitReduction, Reduced
from lightning_diag.callbacks.common.shared import Shared
from lightning_diag.core.alerts import NonFiniteAction
from lightning_diag.core.registry import RuleSpec
from lightning_diag.core.tags import loss_tag
from lightning_diag.core.validation import check_bool, check_choice
from lightning_diag.rules.amp_not_applied import AmpRule
from lightning_diag.rules.catalog import NONFINITE_ROLLBACK, VAL_DECLINE
from lightning_diag.rules.eval_before_training import EvalBeforeTrainingRule
from lightning_diag.rules.eval_randomness import EvalRandomnessRule
from lightning_diag.rules.loss_outlier import LossOutlierRule
from lightning_diag.rules.loss_stagnant import STAGNANT_BASELINE_STEPS_KEY, LossStagnantRule
from lightning_diag.rules.loss_swing import LOSS_SWING, LOSS_SWING_WINDOW_STEPS_KEY, LossSwingRule
from lightning_diag.rules.nonfinite import (
    DEFAULT_MAX_SCALER_OVERFLOWS,
    DEFAULT_MAX_SKIPS,
    NONFINITE_ACTIONS,
    NONFINITE_LOSS_MAX_SKIPS_KEY,
    NonFinitePolicy,
)
from lightning_diag.rules.output_collapse import OUTPUT_COLLAPSE, OutputCollapseRule
from lightning_diag.rules.replicas import DDP_DESYNC, DESYNC_EVERY_N_STEPS_KEY, DesyncRule
from lightning_diag.rules.rollback import NONFINITE_ROLLBACK_SPEC, RollbackRule
from lightning_diag.rules.train_mode import EvalModeRule
from lightning_diag.rules.train_override_bypassed import TRAIN_OVERRIDE_BYPASSED, TrainOverrideRule
from lightning_diag.rules.val_decline import VAL_DECLINE_HIGHER_IS_BETTER_KEY, ValDeclineRule
from lightning_diag.rules.val_fluctuation import VAL_FLUCTUATION, ValFluctuationRule
from lightning_diag.rules.zero_output import ZERO_OUTPUT, ZeroOutputRule
from lightning_diag.stats.loss_sums import LossSums

__all__ = [
    "DEFAULT_MAX_SCALER_OVERFLOWS",
    "DEFAULT_MAX_SKIPS",
    "NONFINITE_ACTIONS",
    "AnomalyAlarm",
    "NonFiniteError",
]

#: The declared state a rollback snapshot keeps (the loss trend's: a rollback forgets the losses of the steps it
#: undoes), not the non-finite bookkeeping (counts, latch, rollbacks).
_SNAPSHOT_STATE = ("swing_rule", "stagnant_rule", "val_decline_rule", "val_fluctuation_rule", "loss_sums")


class AnomalyAlarm(QuietLossKeeping):
    r"""Stops training before a non-finite update, and alerts on loss swings and validation trends.

    Rules (exact definitions in ``docs/anomaly_alarm.md``):

    * ``nonfinite_loss`` / ``nonfinite_grad`` (critical): a NaN/Inf in the loss of any micro-batch since the last
      optimizer step, or in a gradient the optimizer is about to apply (after accumulation and AMP unscaling,
      before clipping). Checked on every optimizer step. With ``locate_nonfinite`` the failing step is replayed
      once and the alert's ``source`` is ``input``, the qualified name of the first module whose output (or
      gradient, "in backward") turned non-finite, or ``loss``.
    * ``nonfinite_rollback`` (warning, ``on_nonfinite="rollback"``): a non-finite step restored an in-memory
      snapshot and lowered the learning rates; names the step restored, the factor in force and the source.
    * ``loss_swing`` (warning): the training loss swings by more than ``loss_swing.threshold`` on
      ``loss_swing.patience`` consecutive epochs (or windows of ``swing_window`` steps), or the monitored validation
      loss swings up and down by as much on as many consecutive validation runs; the fields named here are
      set with ``rules=`` (docs/thresholds.md).
    * ``loss_stagnant`` (warning): after ``loss_stagnant.patience`` epochs (or windows) the training loss is not
      ``loss_stagnant.threshold`` below its initial level (the mean of the first ``loss_stagnant.baseline_steps``
      steps, the untrained model's loss: chance level for a classifier).
    * ``val_decline`` (warning): ``monitor`` worsens on ``val_decline.threshold`` consecutive validation runs.
    * ``val_fluctuation`` (warning): the validation fluctuation exceeds ``val_fluctuation.threshold`` times the
      training-loss fluctuation over the last ``val_fluctuation.window`` validation runs, and rises at least twice,
      by more than ``val_fluctuation.min_rise`` of its initial value in all, over them.
    * ``ddp_desync`` (critical): a parameter's checksum (L2 norm and sum) differs across its replicas by more than
      ``ddp_desync.threshold`` (every rank under DDP; for a ``DTensor``, the ranks along each ``Replicate`` mesh
      dimension: HSDP's replicate dimension, tensor-parallel biases and norms), checked every
      ``ddp_desync.every_n_steps`` optimizer steps with one ``all_gather`` per replica group; shards are never
      compared; names the first such parameter and the ranks.
    * ``eval_mode_in_training`` (warning): on logging steps, a Dropout (``p > 0``, in a part of the model with
      trainable parameters) or a BatchNorm whose parameters train is in eval mode during training (a host read of
      the modules' flags). A BatchNorm with frozen parameters in eval mode is one ``info``.
    * ``train_override_bypassed``, ``eval_randomness``, ``amp_not_applied``, ``loss_outlier``,
      ``eval_before_training`` (warning): the run-time checks of the set-up (one module each in ``rules/``,
      measured by :class:`~.runtime_checks.RuntimeChecks`); ``amp_not_applied.threshold``,
      ``loss_outlier.threshold``, ``loss_outlier.ratio`` and ``loss_outlier.window`` are set with ``rules=``.
    * ``zero_output`` (warning): a module whose outputs had both signs returns all zeros on a sampled step (a copy
      that arrived as zeros); ``output_collapse`` (warning): the model's outputs no longer depend on the input,
      their spread across the batch below ``output_collapse.threshold`` of their level on
      ``output_collapse.patience`` sampled steps (:mod:`lightning_diag.rules.output_collapse`; not measured at batch
      size 1).

    Logged metrics (TensorBoard, global rank zero):

    * ``diag/lr/<Optimizer>/group_<j>``: learning rate of every optimizer and parameter group (logging steps).
    * ``diag/loss/train_step``: the training loss (logging steps).
    * ``diag/loss/train_epoch``: mean training loss of the epoch (or window) over all ranks.
    * ``diag/loss/swing``: relative change of that mean from the previous epoch (or window).
    * ``diag/loss/val``: the monitored validation value; ``diag/loss/val_se``: the standard error ``loss_swing``
      judged it with.
    * ``diag/loss/train_fluctuation``, ``diag/loss/val_fluctuation``: the two fluctuations once the window is full.
    * ``diag/threshold/loss_swing``: ``loss_swing.threshold``, at the steps of ``diag/loss/swing``
      (dashboard line).
    * ``diag/replicas/max_rel_diff``, ``diag/replicas/agree``: the largest relative checksum difference across
      ranks, and 1 when it is within ``ddp_desync.threshold`` (DDP, at every check).

    Args:
        on_nonfinite: ``"stop"`` (default): the offending step changes no parameter and no optimizer state, a
            critical alert is written and ``trainer.fit`` returns; ``"raise"``: the same, then
            :class:`NonFiniteError`; ``"skip"``: the step is skipped and training goes on, until
            ``nonfinite_loss.max_skips`` steps were skipped, then as ``"stop"``; ``"warn"``: alert only, the update
            is applied; ``"rollback"``: the newest trustworthy snapshot is restored, the learning rates are
            multiplied by ``nonfinite_rollback.lr_factor`` and training goes on, up to
            ``nonfinite_rollback.max_rollbacks`` times, then as ``"stop"``.
        locate_nonfinite: Replay the first non-finite step of an episode once to name its source (the alert's
            ``source``); costs one extra forward and backward at failure, nothing on healthy steps but a
            reference to the batch and, for a model whose steps draw random numbers (dropout), a copy of the RNG
            state.
        monitor: Validation metric read from ``trainer.callback_metrics``.
        mode: ``"min"`` if lower ``monitor`` is better, ``"max"`` if higher is.
        swing_window: ``"epoch"`` (default) to compare epoch means of the training loss, or a number of optimizer
            steps to compare means over consecutive windows of that many steps (runs with one long epoch); the
            period of ``loss_swing`` and ``loss_stagnant``.
        rollback_device: Where ``on_nonfinite="rollback"`` keeps its snapshots: ``"cpu"`` (default) or
            ``"device"`` (the parameters' device: faster, costs device memory).
        log_every_n_steps: Logging interval for step-level tags; defaults to the trainer's.
        rules: Thresholds and settings by rule id, ``False`` to switch a rule off (docs/thresholds.md):
            ``{"loss_swing": {"threshold": 0.2}, "nonfinite_loss": {"max_skips": 3}, "nonfinite_rollback":
            {"every_n_steps": 100}, "ddp_desync": {"every_n_steps": 50}, "loss_outlier": {"threshold": 8},
            "val_fluctuation": False}``.
        on_alert: Called with every alert this callback raises.

    Attributes:
        policy: The non-finite policy (verdicts, skip and overflow counts, latch).
        guard: Finds non-finite steps on the device and carries out the policy's verdicts.
        loss_sums: The training-loss sums of the open periods, with declared (SUM) reductions.
        swing_rule, stagnant_rule, val_decline_rule, val_fluctuation_rule: The loss and validation trend rules.
        desync_rule, train_mode_rule, rollback_rule: ``ddp_desync``'s, ``eval_mode_in_training``'s and
            ``nonfinite_rollback``'s detectors (fed by :attr:`replicas`, :attr:`train_mode` and the guard).
        replicas, train_mode: The comparisons of the replicas and the look at the modules' modes, which feed them.

    Its checkpoint state is what it declares (its :attr:`preset` and ``add_rule``/``add_state``, saved by
    :meth:`DiagCallback.state_dict`): the rules above and the run-time checks' rules, the loss sums
    (``accumulators``), the policy (``nonfinite``), warn mode's pending findings (``pending_nonfinite``), the
    rollback count (``rollback``), the replica and train-mode rules (``replicas``, ``train_mode``), and the
    losses ``loss_outlier`` has not judged yet (``runtime_pending``); the sums and pending findings are saved merged
    over every rank.

    Raises:
        TypeError: If an argument has the wrong type.
        ValueError: If an argument is out of range or not one of its allowed values.
        NonFiniteError: During ``fit``, with ``on_nonfinite="raise"``, at the first non-finite step.

    Example:
        >>> alarm = AnomalyAlarm(on_nonfinite="skip", rules={"nonfinite_loss": {"max_skips": 3}})
        >>> alarm.on_nonfinite, alarm.thresholds()["nonfinite_loss.max_skips"]
        ('skip', 3.0)
        >>> rollback = AnomalyAlarm(on_nonfinite="rollback", rules={"nonfinite_rollback": {"every_n_steps": 100}})
        >>> rollback.rollback.every_n_steps
        100
    """

    #: Its logging batches read the step loss on the host (``diag/loss/train_step``): once for every reader.
    shared_requests = frozenset({Shared.STEP_LOSS})
    #: Alarms with another monitored metric or swing window are checkpointed apart.
    state_key_arguments = ("monitor", "swing_window")
    # In this order a validation run's alerts come as val_decline's, val_fluctuation's, then loss_swing's (its
    # validation view), and a closed period's as loss_swing's, then loss_stagnant's.
    preset = Preset(
        "AnomalyAlarm",
        (
            Detector(
                ValDeclineRule, "val_decline_rule", VAL_DECLINE, context=(("monitor", "monitor"), ("mode", "mode"))
            ),
            Detector(
                ValFluctuationRule, "val_fluctuation_rule", VAL_FLUCTUATION, context=(("monitor", "monitor"),)
            ),
            Detector(LossSwingRule, "swing_rule", "swing", context=(("unit", "trend_unit"),)),
            Detector(LossStagnantRule, "stagnant_rule", "stagnant", context=(("unit", "trend_unit"),)),
            Detector(NonFinitePolicy, "policy", "nonfinite", context=(("action", "on_nonfinite"),)),
            Detector(RollbackRule, "rollback_rule", "rollback"),
            Detector(DesyncRule, "desync_rule", "replicas"),
            Detector(EvalModeRule, "train_mode_rule", "train_mode"),
            Detector(TrainOverrideRule, "override_rule"),
            Detector(EvalRandomnessRule, "eval_random_rule"),
            Detector(AmpRule, "amp_rule"),
            Detector(LossOutlierRule, "outlier_rule"),
            Detector(EvalBeforeTrainingRule, "eval_before_rule"),
            Detector(ZeroOutputRule, "zero_rule"),
            Detector(OutputCollapseRule, "collapse_rule"),
        ),
    )
    # the detectors that parts of the alarm read besides feeding them, built by add_preset
    swing_rule: LossSwingRule
    stagnant_rule: LossStagnantRule
    val_fluctuation_rule: ValFluctuationRule
    policy: NonFinitePolicy
    rollback_rule: RollbackRule

    def __init__(
        self,
        *,
        on_nonfinite: NonFiniteAction = "stop",
        locate_nonfinite: bool = True,
        monitor: str = "val_loss",
        mode: Literal["min", "max"] = "min",
        swing_window: Literal["epoch"] | int = "epoch",
        rollback_device: Literal["cpu", "device"] = "cpu",
        log_every_n_steps: int | None = None,
        rules: RuleChoices | None = None,
        on_alert: AlertHandler | None = None,
    ) -> None:
        super().__init__(rules=rules, log_every_n_steps=log_every_n_steps, on_alert=on_alert)
        self.on_nonfinite: NonFiniteAction = check_choice("on_nonfinite", on_nonfinite, NONFINITE_ACTIONS)  # type: ignore[assignment]
        self.swing_window = check_swing_window(swing_window)
        self.locate_nonfinite = check_bool("locate_nonfinite", locate_nonfinite)
        if not isinstance(monitor, str) or not monitor:
            raise TypeError(f"Expected argument `monitor` to be a non-empty metric name, but got {monitor!r}")
        self.monitor = monitor
        self.mode: Literal["min", "max"] = check_choice("mode", mode, ("min", "max"))  # type: ignore[assignment]
        check_choice("rollback_device", rollback_device, ("cpu", "device"))
        #: The settings of ``on_nonfinite="rollback"``: ``nonfinite_rollback``'s fields and the snapshot device.
        self.rollback = RollbackSettings(**self._rule_fields(NONFINITE_ROLLBACK_SPEC), device=rollback_device)
        #: The unit of the loss trend's messages (a step or an epoch, from ``swing_window``).
        self.trend_unit = trend_unit(self.swing_window)
        # The declared detectors and state: built now and afresh at every fit, saved and restored by the base class.
        self.add_preset()
        #: Localisation of non-finite values and, with ``on_nonfinite="rollback"``, the snapshots.
        # (warn mode decides at a later logging step: no step is replayed, no batch kept)
        self.recovery = NonFiniteRecovery(
            locate=locate_nonfinite and self.on_nonfinite != "warn",
            rollback=self.on_nonfinite == "rollback",
            settings=self.rollback,
            rule=self.rollback_rule,
        )
        loss_sums = functools.partial(build_loss_sums, baseline_key=STAGNANT_BASELINE_STEPS_KEY)
        self.loss_sums: LossSums = self.add_rule("loss_sums", loss_sums, state_key="accumulators")
        self.deferred: DeferredFindings = self.add_state("deferred", DeferredFindings, state_key="pending_nonfinite")
        #: The run-time checks (``train_override_bypassed``, ``eval_randomness``, ``amp_not_applied``,
        #: ``loss_outlier``, ``eval_before_training``); their rules and pending losses are declared on this callback.
        self.runtime = RuntimeChecks(
            self, override_id=TRAIN_OVERRIDE_BYPASSED, zero_id=ZERO_OUTPUT, collapse_id=OUTPUT_COLLAPSE
        )
        #: ``ddp_desync``'s comparisons of the replicas, fed to :attr:`desync_rule`.
        self.replicas = ReplicaCheck(
            self, DDP_DESYNC, int(self.setting(DESYNC_EVERY_N_STEPS_KEY)), self.setting(DDP_DESYNC)
        )
        #: ``eval_mode_in_training``'s look at the Dropout and BatchNorm modules, fed to :attr:`train_mode_rule`.
        self.train_mode = TrainModeCheck(self)
        # What the quiet path reads instead of asking the trainer at every batch (set again at every fit's start):
        # whether Lightning hands on_train_batch_end its own detached clone of the loss (automatic optimization),
        # and whether several ranks train.
        self._private_losses = False
        self._several_ranks = False
        # The driver's batch count at this alarm's last training batch end: a step window closing in another
        # callback's batch end before this one's has not got this batch's loss yet (see `fit_reductions`).
        self._ended_batch = -1
        # Whether the current batch is one of the user's logging batches (found at its start, on the cadence axis).
        self._log_batch = True
        # Whether the recovery watches the current batch (its end then compares the RNG state), and whether the
        # run-time checks' batch start ran (their batch end is then due): both found at the batch's start.
        self._watched = False
        self._runtime_end = True
        # Whether the fit runs without a diagnostics session (then any batch end may log: see `is_logging_step`).
        self._no_session = False
        # The global step the current batch started at (``inf`` before a fit's first batch, whose start calls the
        # run-time checks): the batch start calls them only from their due step on.
        self._start_step: float = math.inf
        self._init_quiet()
        self._wire()

    def _rule_fields(self, spec: RuleSpec) -> dict[str, Any]:
        """A rule's fields in effect by name (``threshold`` and its settings; ints where the field is one)."""
        return {
            name: int(value) if spec.limit(name).integer else value
            for name in spec.fields
            for value in [self.setting(spec.key(name))]
        }

    def thresholds(self) -> dict[str, float]:
        """The thresholds in effect (see :meth:`DiagCallback.thresholds`).

        Example:
            >>> AnomalyAlarm(rules={"loss_swing": {"threshold": 0.2}}).thresholds()["loss_swing"]
            0.2
        """
        values = super().thresholds()
        values[VAL_DECLINE_HIGHER_IS_BETTER_KEY] = float(self.mode == "max")
        if isinstance(self.swing_window, int):
            values[LOSS_SWING_WINDOW_STEPS_KEY] = float(self.swing_window)
        if self.on_nonfinite != "skip":  # max_skips is in force only with that action
            values.pop(NONFINITE_LOSS_MAX_SKIPS_KEY, None)
        if self.on_nonfinite != "rollback":  # the rollback settings are in force only with that action
            for key in [k for k in values if k.startswith(f"{NONFINITE_ROLLBACK}.")]:
                del values[key]
        return values

    @property
    def rollbacks(self) -> int:
        """Rollbacks made in this fit (``on_nonfinite="rollback"``; kept across a resume)."""
        return self.recovery.rule.rollbacks

    @property
    def lr_scale(self) -> float:
        """The factor on every learning rate now in force: ``nonfinite_rollback.lr_factor ** rollbacks``."""
        return self.recovery.lr_scale

    # -- the helpers of one fit ---------------------------------------------------------------------------
    def _wire(self) -> None:
        """Connect the helpers to this fit's declared state (rebuilt by the base class at every fit; a resume then
        loads it in place)."""
        #: The training-loss periods and the validation values, fed to the loss and validation trend rules.
        self.trend = LossTrend(
            self.feed,
            self.loss_sums,
            swing=self.swing_rule,
            stagnant=self.stagnant_rule,
            fluctuation=self.val_fluctuation_rule,
            swing_window=self.swing_window,
            monitor=self.monitor,
            higher_is_better=self.mode == "max",
            swing_id=LOSS_SWING,
            decline_id=VAL_DECLINE,
            fluctuation_id=VAL_FLUCTUATION,
        )
        self.recovery.reset(self.rollback_rule)
        self.replicas.reset()
        self.train_mode.reset()
        #: Finds the non-finite steps and carries out :attr:`policy`'s verdicts.
        self.guard = NonFiniteGuard(self, self.policy, self.recovery, losses=self.loss_sums, deferred=self.deferred)
        self._note_loss = self.guard.note_loss
        self.guard.before_decide = self._hand_on  # a failing step's alert tells the last finite loss
        self.runtime.reset()
        self._keep_loss = self.runtime.keep_loss
        # The global step from which a batch end has more to do than keep its loss (see `_next_due`).
        self._due: float = 0

    def _next_due(self) -> float:
        """The global step from which a batch end must look at the step window, the snapshots or the replicas:
        every batch with rollback (the snapshots' trust test reads every loss) or several ranks (``ddp_desync``
        decides its own steps), else the end of the step window (``inf`` in epoch mode)."""
        if self.recovery.rollback_enabled or self._several_ranks:
            return 0
        return self.trend.window_end

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Start the step window and share restored loss sums over the ranks; take the first snapshot."""
        super().on_train_start(trainer, pl_module)
        self.trend.start(trainer)
        unsupported = self.recovery.start(trainer, pl_module, self._snapshot_state, self._restore_snapshot_state)
        if unsupported:
            self.notice(trainer, "rollback-unsupported", unsupported)
        self._private_losses = pl_module.automatic_optimization
        self.guard.keep_references = self._private_losses  # on_before_backward gets Lightning's own loss then
        self._several_ranks = trainer.world_size > 1
        self._due = self._next_due()
        self._log_batch = True
        self._no_session = self._session is None
        self._start_quiet(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Remove the learning-rate hooks of ``on_nonfinite="rollback"``; hand on the last quiet batches' losses."""
        self._hand_on()
        self.recovery.stop()
        self.runtime.stop()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Remove the learning-rate hooks and the run-time probes (also when ``fit`` raises: ``on_exception``
        calls this), then flush."""
        self._hand_on()
        self.recovery.stop()
        self.runtime.stop()
        super().teardown(trainer, pl_module, stage)

    def _snapshot_state(self) -> dict[str, Any]:
        self._hand_on()
        # One host read per snapshot (the loss sums' state reads the sums and the last finite loss together).
        return {name: getattr(self, name).state_dict() for name in _SNAPSHOT_STATE}

    def _restore_snapshot_state(self, state: dict[str, Any]) -> None:
        for name, value in state.items():
            getattr(self, name).load_state_dict(value)
        self.loss_sums.all_ranks = False  # this rank's own sums, not a checkpoint's all-rank ones

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Start a fit with fresh rules (a resume then loads their state)."""
        super().setup(trainer, pl_module, stage)
        if stage == TrainerFn.FITTING:
            self._wire()
            self.recovery.check_module(pl_module)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """Keep a reference to the batch (no copy) for the replay of a failing step, with a copy of the RNG state
        when the model's steps draw random numbers; on logging steps look for Dropout/BatchNorm modules left in eval
        mode.

        A batch that follows a quiet one takes a short start when it is quiet too (off the logging cadence, the step
        window and the run-time checks not due): the step axis counts it and the batch is kept for the replay. A
        quiet batch after the fit's first is never watched by the recovery (the watched batches are the first and
        the logging ones), and nothing between two batches changes what makes one quiet but the step axis. Any
        other batch takes the full start, which decides (:meth:`quiet_batch`); counting it again is a no-op."""
        driver = self._driver
        if self._hooks_off and self._kept and driver is not None:  # after a quiet batch: the short start if quiet too
            self.start_batch(trainer, pl_module, batch_idx)  # the driver's decision for the batch
            start = driver.step_axis.started_at
            if not self.on_cadence and start + 1 < self._due and start < self.runtime.start_due:
                self._start_step = start
                self._kept_step = start + 1 if driver.step_axis.pending else start
                self._kept = False  # kept at its backward
                self.recovery.on_batch_start(batch, batch_idx, False)  # never watched (see `quiet_batch`)
                return
        self._hand_on()
        if not self._kept:  # the last batch was quiet and had no backward
            self._missed_loss(trainer)
        self._batch_known = False
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        logging_step = self.on_cadence  # the user's logging batches
        self._log_batch = logging_step or self._no_session
        self._watched = self.recovery.on_batch_start(batch, batch_idx, logging_step)
        if logging_step:  # the train-mode check's steps (it tests the same)
            self.train_mode.on_batch_start(trainer, pl_module)
        runtime = self.runtime
        first, session = self._start_step == math.inf, self._session
        if session is not None:
            axis = session.step_axis
            start = self._start_step = axis.started_at
            self._kept_step = start + 1 if axis.pending else start  # the global step at the batch's end
        else:
            start = self._start_step = trainer.global_step
        # the first batch, the cadence batches (zero_output's and output_collapse's sampled steps: their batch end
        # is due then)
        self._runtime_end = first or logging_step or start >= runtime.start_due
        if self._runtime_end:
            runtime.on_train_batch_start(trainer, pl_module)
        self._decide_quiet(trainer)

    # -- non-finite guard --------------------------------------------------------------------------------
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        """Check the loss and the gradients about to be applied; block the step if the policy says so."""
        self.guard.before_optimizer_step(trainer, pl_module, optimizer)

    # -- loss trend and logging --------------------------------------------------------------------------
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Keep the loss for the loss sums and ``loss_outlier`` (a reference: no kernel, no host read); close the
        step window when it is due; on logging steps write the loss and learning rates."""
        self._hand_on()  # the quiet batches' losses first, in their order
        if self._several_ranks and self._driver is not None:
            self._ended_batch = self._driver.batches
        loss = outputs.get("loss") if type(outputs) is dict else outputs
        # Lightning's own detached clone under automatic optimization: kept by reference. Any other form is
        # reduced, converted and copied (and told once when it is not a 0-d tensor).
        private = self._private_losses
        if type(loss) is not torch.Tensor or loss.dim() or loss.dtype is not torch.float32 or loss.requires_grad:
            loss, problem = extract_loss(outputs)
            if problem is not None:
                self.notice(trainer, "loss:" + problem.split(":")[0], problem)
            private = False
        handed = private  # the loss as Lightning handed it: the batch's step loss others may have read already
        if loss is not None:
            if self._private_losses and trainer.accumulate_grad_batches > 1:
                loss = loss * trainer.accumulate_grad_batches  # Lightning hands callbacks the divided loss
                private, handed = True, False
            loss = self.loss_sums.add(loss, not private)
        step = trainer.global_step
        if step >= self._due:
            trend = self.trend
            if self._several_ranks and trend.reductions(trainer, "window"):  # the window closes: the driver reduces
                trend.reduced = self._reduced_at(trainer, pl_module, "window")
            out = trend.close_window(trainer, pl_module, step)
            trend.reduced = None
            if out is not None:
                self._send(trainer, out)
            if self.recovery.rollback_enabled:
                self.recovery.on_batch_end(trainer, pl_module, loss)
            if self._several_ranks:
                self.replicas.on_batch_end(trainer, pl_module)
            self._due = self._next_due()
        if self._watched:
            self.recovery.end_watch()
        # Only a batch found on the cadence at its start can be a logging one (outside a session: any batch).
        logging = self.is_logging_step(trainer) if self._log_batch else False
        if logging or self._runtime_end:
            self.runtime.on_train_batch_end(trainer, pl_module, loss, step, logging)
        elif loss is not None:
            self._keep_loss(loss, step)
        if not logging:
            return
        scale = self.recovery.lr_scale  # the rate the optimizer uses: the scheduler's times the rollback factor
        values = {name: lr * scale for name, lr in lr_scalars(trainer).items()}
        if loss is not None:
            # the batch's loss read on the host once: GradientFlowMonitor's measurement copy, offered to the driver
            known = self._driver.step_loss() if handed and self._driver is not None else None
            values[loss_tag("train_step")] = float(loss) if known is None else known
        self.writer.scalars(values, trainer.global_step)
        if self.on_nonfinite == "warn":
            self.guard.read_back(trainer, pl_module)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Close the epoch: its mean loss over all ranks feeds ``loss_swing`` in epoch mode."""
        self._hand_on()
        if not self._kept:
            self._missed_loss(trainer)
        reduced = self._reduced_at(trainer, pl_module, "epoch_end")  # the findings and the sums: one call
        if self.on_nonfinite == "warn":
            self.guard.read_back(trainer, pl_module, reduced)
        self.trend.reduced = reduced
        out = self.trend.close_period(trainer, pl_module, "epoch")
        self.trend.reduced = None
        self._send(trainer, out)

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Before the first training forward: look for components whose state only training updates."""
        self.runtime.on_validation_start(trainer, pl_module)

    def on_validation_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        """On the first batch of a validation run: watch for dropout applied in training mode."""
        self.runtime.on_validation_batch_start(pl_module, batch_idx, dataloader_idx)

    def on_validation_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        """Judge the dropout watch of the first batch; keep the monitored metric's value of the batch (from
        ``outputs``) for its standard error."""
        self.runtime.on_validation_batch_end(trainer)
        self.trend.on_validation_batch_end(trainer, outputs)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Feed the monitored validation value to ``val_decline`` and ``val_fluctuation``."""
        self._hand_on()
        self.trend.reduced = self._reduced_at(trainer, pl_module, "validation_end")
        out = self.trend.on_validation_end(trainer, pl_module)
        self.trend.reduced = None
        self._send(trainer, out)

    # -- reductions over the ranks during the fit ------------------------------------------------------------
    def fit_reductions(self, trainer: pl.Trainer, point: str) -> list[FitReduction]:
        """What the alarm reduces over the ranks at ``point`` of the fit, for the driver to reduce with every
        callback's (``Driver.reduce_at``): at the epoch's end warn mode's findings (when steps were checked since
        the last read-back) and the epoch's loss sums; at a step window's close its sums; at a validation's end the
        sums since the last one (with the initial period's where its mean may be taken). The quiet batches' losses
        are handed on first."""
        self._hand_on()
        driver = self._driver
        if point == "window" and (driver is None or self._ended_batch != driver.batches):
            # asked from another alarm's batch end before this one's: this batch's loss is not in its window yet,
            # so the window reduces its own sums at its own close (every rank decides this alike)
            return []
        out: list[FitReduction] = []
        deferred = self.deferred
        if point == "epoch_end" and self.on_nonfinite == "warn" and deferred.steps:
            out.append((deferred, tuple(deferred)))
        return out + self.trend.reductions(trainer, point)

    def _reduced_at(self, trainer: pl.Trainer, pl_module: pl.LightningModule, point: str) -> Reduced | None:
        """The driver's values over all ranks at ``point`` for every callback (``None``: one process, or no driver:
        each part reduces its own)."""
        driver = self._driver
        if driver is None or not self._several_ranks:
            return None
        return driver.reduce_at(trainer, point, pl_module.device)

    def _send(self, trainer: pl.Trainer, out: TrendOutput) -> None:
        """Send out what :attr:`trend` produced: notices, alerts, then scalars."""
        for key, message in out.notices:
            self.notice(trainer, key, message)
        self.record(out.alerts)
        if out.scalars:
            self.writer.scalars(out.scalars, out.step)
