"""GradientFlowMonitor: per-layer gradient norms, weight norms and update ratios; vanishing/exploding alerts.

The callback's settings, declared rules, cadence and hooks. Which parameters it measures (and which cannot learn) is
:mod:`~lightning_diag.callbacks.gradient_flow.params`, what it writes from a measurement
:mod:`~.writes`, its silent-update checks :mod:`~.silent_updates`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.trainer.states import TrainerFn

from lightning_diag.callbacks.common.base import AlertHandler, DiagCallback, RuleChoices
from lightning_diag.callbacks.common.driver import forward_hooks_of
from lightning_diag.callbacks.common.outputs import loss_scale
from lightning_diag.callbacks.common.preset import Detector, Preset
from lightning_diag.callbacks.common.shared import Shared
from lightning_diag.callbacks.gradient_flow.params import (
    ParamSelector,
    build_param_index,
    check_param_selector,
    stuck_parameters,
    zero_gradient_ids,
)
from lightning_diag.callbacks.gradient_flow.silent_updates import (
    ZEROED_STATE_KEY,
    SilentUpdateChecks,
    optimizer_position,
)
from lightning_diag.callbacks.gradient_flow.writes import (
    histogram_due,
    layer_update_ratios,
    step_scalars,
    update_values_from,
    update_vector,
    write_histograms,
)
from lightning_diag.core.tags import (
    act_grad_norm_tag,
    dead_units_tag,
    saturation_tag,
    weight_norm_tag,
    zero_grad_tag,
)
from lightning_diag.core.validation import check_bool, check_int, check_names
from lightning_diag.instrument.act_grads import ActivationGradients
from lightning_diag.instrument.activation_watch import MIN_ROWS, ActivationWatch
from lightning_diag.instrument.attention_capture import is_compiled
from lightning_diag.instrument.grad_measure import DEFAULT_LOGIT_PROJECTIONS, ParamIndex, WeightCopies, measure_step
from lightning_diag.rules.activations import ACTIVATION_SATURATION, DEAD_UNITS, ActivationRule
from lightning_diag.rules.base import StepContext
from lightning_diag.rules.grad_collapse import GradCollapseRule
from lightning_diag.rules.grad_frozen import GradFrozenRule
from lightning_diag.rules.grad_layer_spread import GradSpreadRule
from lightning_diag.rules.grad_norm_band import GRAD_EXPLODE, GRAD_VANISH, GradBandRule, sgd_step_scale
from lightning_diag.rules.grad_not_zeroed import GradNotZeroedRule
from lightning_diag.rules.measures import Measures, WeightNorms
from lightning_diag.rules.records import ActivationReading
from lightning_diag.rules.update_size import UpdateSizeRule
from lightning_diag.rules.updates_applied import UPDATE_SAMPLE_SIZE_KEY, UPDATE_STALE, UpdateRule

__all__ = ["GradientFlowMonitor"]


class GradientFlowMonitor(SilentUpdateChecks, DiagCallback):
    r"""Per-layer gradient flow in TensorBoard, with vanishing, exploding, spread and collapse alerts.

    Measured in ``on_before_optimizer_step``: the gradients the optimizer is about to apply, after gradient
    accumulation and AMP unscaling, **before** gradient clipping. Only on measured steps (every
    ``log_every_n_steps`` optimizer steps); other steps cost one integer comparison. On a measured step the norms
    of every selected gradient take one multi-tensor kernel per device/dtype group, are summed per layer on the
    device and copied to the host once.

    Under sharded training (``ModelParallelStrategy``: FSDP2, tensor parallelism, both, HSDP) every quantity is
    that of the full, unsharded gradient, computed from the local shards: per-layer sums of squares on the device,
    weighted so that replicated copies count once, and one all-reduce per measured step (see
    :mod:`lightning_diag.instrument.grad_measure`); nothing is gathered. Histograms are not written then.

    A *layer* is the module that owns the parameters (``encoder.layers.0.linear1`` for its weight and bias), or
    each parameter with ``per_parameter=True``.

    Logged metrics (global rank zero):

    * ``diag/grad_norm/total``: L2 norm of all selected gradients.
    * ``diag/grad_norm/<layer>``: L2 norm of the layer's gradients.
    * ``diag/grad_rms/<layer>``: RMS gradient per element of the layer (``grad_explode``'s quantity).
    * ``diag/grad_relative/<layer>``: ``||g_W|| / ||W||`` of a comparable weight matrix (``grad_vanish`` and
      ``grad_layer_spread``'s quantity).
    * ``diag/grad_blocks/norm``: L2 norm of the blocks' weight-matrix gradients (``grad_collapse``'s quantity).
    * ``diag/weight_norm/<layer>``: L2 norm of the layer's parameters (``log_weight_norms``).
    * ``diag/update_ratio/<layer>``: ``||W_after - W_before|| / ||W_before||`` of the measured step
      (``log_weight_norms``; SageMaker Debugger's WeightUpdateRatio).
    * ``diag/grad_hist/<layer>``: gradient histograms every ``histogram_every_n_steps`` steps.
    * ``diag/act_grad_norm/<module>``: L2 norm of the gradient of the module's output (``activation_grads``),
      summed over the micro-batches of the measured step.
    * ``diag/threshold/grad_vanish``, ``diag/threshold/grad_explode``: the two thresholds, at the steps of
      ``diag/grad_norm/total`` (the dashboard's reference lines beside ``grad_rms`` and ``grad_relative``).
    * ``diag/updates/<layer>``: share of the layer's sampled elements with a non-zero gradient that the measured
      optimizer step left unchanged (``update_none`` / ``update_stale``'s quantity; 0 in a healthy fp32 run).
    * ``diag/act_dead/<layer>``: share of the layer's units inactive for every sample of the measured batch, for a
      layer followed by a ReLU-family activation (``dead_units``' quantity); ``diag/grad_zero/<layer>``: share of
      exactly-zero entries of its weight gradient.
    * ``diag/act_saturated/<layer>``: share of the inputs of the bounded activation after the layer beyond its
      linear range (``activation_saturation``'s quantity).

    Rules (exact meaning in :mod:`lightning_diag.rules.grad_norm_band`, ``grad_layer_spread``, ``grad_collapse``,
    ``grad_frozen`` and ``docs/gradient_flow.md``):
    ``grad_explode`` (a layer's RMS gradient per element above ``grad_explode.threshold``), ``grad_vanish`` (a weight
    matrix's ``||g||/||W||`` below ``grad_vanish.threshold`` and 100x below the best-fed block matrix, after
    ``grad.warmup_steps``), ``grad_layer_spread`` (largest / smallest ``||g||/||W||`` of one role across blocks
    above ``grad_layer_spread.threshold``, after ``grad.warmup_steps``), ``grad_collapse`` (the blocks'
    weight-matrix gradient norm below ``grad_collapse.threshold`` times its baseline; the message says converged (an
    ``info``), dead network or vanished, from the training loss). Attention query/key projections
    (``logit_projections``) and embeddings are not compared. Layers that trip one rule at one measurement make one
    alert.
    ``grad_frozen``: a layer with parameters that cannot learn while the rest of the model does: trainable but
    in no optimizer (a warning, at the first measurement), no gradient at all (a warning, on ``patience``
    consecutive measurements), or ``requires_grad=False`` (deliberate freezing: one ``info``). Parameters
    matching ``expect_frozen`` are never reported; with a :class:`~pytorch_lightning.callbacks.BaseFinetuning`
    callback attached, frozen and excluded parameters are that callback's business and only ``no_grad`` is
    checked.
    ``update_none``: a layer with non-zero gradients whose every sampled element the optimizer step leaves
    unchanged on ``patience`` consecutive measurements (the message names the likely cause: no model parameter in
    any optimizer, a learning rate of 0, an update dropped). ``update_stale``: in a bf16/fp16 layer, more than
    ``update_stale.threshold`` of the sampled elements with a non-zero gradient unchanged (updates rounding to zero).
    Measured on measured steps only: ``update_none.sample_size`` evenly spaced elements of every parameter are read on
    the device before the step (``on_before_optimizer_step``) and compared after it (``on_train_batch_end``), one
    host read.
    ``grad_not_zeroed``: a backward added to gradients left in ``.grad`` from before their own optimizer's
    measured step, and that optimizer's next step applied the sum (no ``zero_grad`` in between; GAN-style
    optimizers whose parameters keep their gradients through the other's backward are healthy). Watched from
    each measured step of an optimizer to its next step: 8 elements per parameter of ``.grad`` read on the device
    around every backward (``on_before_backward`` / ``on_after_backward``), the verdict read with the next
    measurement (see :mod:`.silent_updates`). On a quiet step with no watch open the
    three hooks test an empty dictionary and return.

    The published training problems (issue 45; exact meaning in :mod:`lightning_diag.rules.activations`,
    :mod:`lightning_diag.rules.update_size` and ``docs/gradient_flow.md``): ``dead_units`` (more than
    ``dead_units.threshold`` of a layer's units inactive for every sample of the measured batch; ``grad_vanish``
    defers to it), ``activation_saturation`` (more than ``activation_saturation.threshold`` of a bounded
    activation's inputs beyond its linear range; the likely cause named), both read by forward pre-hooks attached
    for measured forwards only (:mod:`lightning_diag.instrument.activation_watch`; not on a compiled model), and
    ``update_too_small`` (the median ``||ΔW||/||W||`` below ``update_too_small.threshold`` at every measurement
    since the fit began while the loss does not fall). ``grad_vanish`` also catches a plain deep stack whose
    relative gradient decays with depth whatever an adaptive optimizer's update.

    Args:
        log_every_n_steps: Measure every this many optimizer steps; defaults to the trainer's interval.
        params: Parameter names as ``fnmatch`` patterns (``["encoder.*"]``), or a predicate
            ``(name, parameter) -> bool``; default: every trainable parameter.
        per_parameter: Report each parameter instead of each owning module.
        histogram_every_n_steps: Interval of gradient histograms; ``None`` (default) is 10 times the
            measuring interval and at least 500 steps (the smallest multiple of the measuring interval that is
            both: 500 at ``log_every_n_steps`` 10 or 50, 510 at 30, 1000 at 100), ``0`` turns them off.
        activation_grads: Opt-in activation-gradient norms (seed 000 §3.1): ``True`` for every module that owns
            parameters, or a list of module-name patterns. Hooks are attached only for measured steps and
            removed before the optimizer step.
        log_weight_norms: Also log weight norms and update-to-weight ratios (one parameter copy on measured
            steps).
        logit_projections: Last name components of attention query/key projections, not compared by
            ``grad_vanish`` / ``grad_layer_spread`` (default: ``q``, ``k``, ``query``, ``key``, ``q_proj``,
            ``k_proj``, ``q_lin``, ``k_lin``, ``wq``, ``wk``, ``to_q``, ``to_k``).
        expect_frozen: Parameter-name ``fnmatch`` patterns of parameters frozen (or left out of the optimizer)
            on purpose: ``grad_frozen`` ignores them.
        rules: Thresholds and settings by rule id, ``False`` to switch a rule off (docs/thresholds.md):
            ``{"grad_vanish": {"threshold": 1e-4}, "grad": {"patience": 5, "warmup_steps": 100}}``. Among them
            ``grad.warmup_steps`` (no ``grad_vanish`` / ``grad_layer_spread`` before this step, default 50),
            ``grad.patience`` (default 3) and ``update_none.sample_size`` (elements sampled per parameter for
            ``update_none`` / ``update_stale``, default 32; 0 turns both off).
        on_alert: A callable receiving each :class:`~lightning_diag.core.alerts.Alert` as it is recorded (global
            rank zero, after it is written to ``alerts.jsonl``): send it to Slack, e-mail or a pager. A handler
            that raises is reported once per fit through the ``lightning_diag`` logger and never stops training.

    Raises:
        TypeError: If an argument has the wrong type.
        ValueError: If an argument is out of range.
    """

    #: Switched off on quiet batches (:meth:`quiet_batch`): Lightning then skips them.
    batch_hooks = ("on_before_backward", "on_after_backward", "on_before_optimizer_step", "on_train_batch_end")
    #: A measured step reads the squared norms of the gradients and the weights from the driver (measured once, also
    #: for the non-finite guard's check of that step).
    #: Its measurement's host copy carries the step's loss, which it offers to the batch's later readers.
    shared_requests = frozenset({Shared.GRADIENT_SQUARES, Shared.WEIGHT_SQUARES, Shared.STEP_LOSS})
    preset = Preset(
        "GradientFlowMonitor",
        (
            Detector(GradBandRule, "band_rule", "band"),
            Detector(GradSpreadRule, "spread_rule", "spread"),
            Detector(GradCollapseRule, "collapse_rule", "collapse"),
            Detector(GradFrozenRule, "frozen_rule", "frozen"),
            Detector(UpdateRule, "update_rule", "updates"),
            Detector(GradNotZeroedRule, "not_zeroed_rule", "not_zeroed"),
            Detector(ActivationRule, "activation_rule", "activations"),
            Detector(UpdateSizeRule, "update_size_rule", "update_size"),
        ),
    )
    #: The rule whose threshold the update sampling writes beside its shares (:class:`SilentUpdateChecks`).
    stale_id = UPDATE_STALE
    # the detectors whose state this reads (whether step 0 is measured for grad_collapse's baseline; the dead
    # layers grad_vanish defers to); every detector is fed, see `feed`
    band_rule: GradBandRule
    collapse_rule: GradCollapseRule
    activation_rule: ActivationRule

    def __init__(
        self,
        *,
        log_every_n_steps: int | None = None,
        params: ParamSelector | None = None,
        per_parameter: bool = False,
        histogram_every_n_steps: int | None = None,
        log_weight_norms: bool = True,
        activation_grads: bool | Sequence[str] = False,
        expect_frozen: Sequence[str] = (),
        logit_projections: Sequence[str] = DEFAULT_LOGIT_PROJECTIONS,
        rules: RuleChoices | None = None,
        on_alert: AlertHandler | None = None,
    ) -> None:
        super().__init__(rules=rules, log_every_n_steps=log_every_n_steps, on_alert=on_alert)
        check_param_selector(params)
        self.params = params
        self.per_parameter = check_bool("per_parameter", per_parameter)
        if not isinstance(activation_grads, bool) and (
            isinstance(activation_grads, str) or not all(isinstance(p, str) for p in activation_grads)
        ):
            raise TypeError(
                "Expected argument `activation_grads` to be True, False or a list of module-name patterns,"
                f" but got {activation_grads!r}"
            )
        self.activation_grads = activation_grads
        self.expect_frozen = check_names("expect_frozen", expect_frozen, "parameter-name patterns")
        self._act = ActivationGradients()
        self.log_weight_norms = check_bool("log_weight_norms", log_weight_norms)
        if histogram_every_n_steps is not None:
            check_int("histogram_every_n_steps", histogram_every_n_steps, low=0)
        self.histogram_every_n_steps = histogram_every_n_steps
        self.logit_projections = check_names(
            "logit_projections", logit_projections, "module names (last name component)"
        )
        #: Elements sampled per parameter for ``update_none`` / ``update_stale`` (``update_none.sample_size``).
        self.update_sample_size = int(self.setting(UPDATE_SAMPLE_SIZE_KEY))
        self._reset_update_state()
        self._loss: torch.Tensor | None = None
        self._loss_exact = False  # whether `_loss` is one micro-batch's float32 0-d loss, as Lightning handed it
        self.add_preset()
        self._watch = ActivationWatch()
        self._compiled: bool | None = None  # whether the model runs through torch.compile (known at its first batch)
        self._measured_loss: float | None = None  # the training loss of the step whose update is pending
        self._index: ParamIndex | None = None
        # (chosen parameter positions, their values before the optimizer step) of each step measured in this batch
        self._before: list[tuple[list[int], list[torch.Tensor], torch.Tensor | None]] = []
        self._copies = WeightCopies()  # the buffers of those values, filled again at each measured step
        self._measured_interval: dict[int, int] = {}
        self._past_initial = False  # past the first optimizer step of the fit (or its baseline is known)
        self._idle = False  # whether the next batch off the cadence has nothing to do (see `quiet_batch`)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """A new fit starts with fresh rules (the base class; a resume then loads their state) and no index."""
        super().setup(trainer, pl_module, stage)
        if stage == TrainerFn.FITTING:
            self._index = None
            self._before = []
            self._copies.clear()
            self._measured_interval = {}
            self._loss = None
            self._measured_loss = None
            self._compiled = None
            self._watch.detach()
            self._watch.readings({})  # drop what an earlier fit left
            self._past_initial = False
            self._idle = False
            self._reset_update_state()

    def state_dict(self) -> dict[str, Any]:
        """The rules' state, and ``grad_not_zeroed``'s watches and unread verdicts (by parameter name)."""
        return {**super().state_dict(), ZEROED_STATE_KEY: self._zeroed_state()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output.

        Raises:
            KeyError: If a key is missing; the message names every missing key.
        """
        self.check_state_keys(state_dict, (ZEROED_STATE_KEY,))
        state = dict(state_dict)
        zeroed = state.pop(ZEROED_STATE_KEY)
        super().load_state_dict(state)
        self._load_zeroed_state(zeroed)
        self._idle = False  # the restored watches decide at the next batch's end

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Remove activation-gradient hooks a fit that raised mid-step left on the model, drop the reused weight
        buffers, then release the session."""
        self._act.detach()
        self._watch.detach()
        self._copies.clear()
        super().teardown(trainer, pl_module, stage)

    def _build_index(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> ParamIndex:
        """The index of the selected trainable parameters (``params``), with a notice when there is none."""
        index = build_param_index(
            pl_module, self.params, self.per_parameter, self.logit_projections, trainer.world_size
        )
        if not index.params:
            self.notice(
                trainer,
                "no-params",
                "no trainable parameter matches `params`; gradient flow is not measured"
                if self.params is not None
                else "the model has no trainable parameters; gradient flow is not measured",
            )
        return index

    @staticmethod
    def _reduce(trainer: pl.Trainer) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """A SUM over all ranks (``None`` in one process): every rank then takes the same decisions."""
        if trainer.world_size <= 1:
            return None
        return functools.partial(trainer.strategy.reduce, reduce_op="sum")

    def quiet_batch(self, trainer: pl.Trainer) -> bool:
        """Nothing to do in this batch's backward, optimizer step and end: off the cadence, and idle since the
        last batch whose hooks ran (:meth:`_still_busy`; nothing changes while they are off)."""
        return self._idle and not self.on_cadence

    def _still_busy(self) -> bool:
        """Whether the next batch has work even off the cadence: the fit's first optimizer step not yet passed, a
        ``grad_not_zeroed`` watch open, undecided or restored, activation hooks attached, or an update pending."""
        return bool(
            not self._past_initial
            or self._zero.watches
            or self._zero_undecided
            or self._zero_restored is not None
            or self._act.attached
            or self._watch.attached
            or self._watch.pending
            or self._stepped
            or self._before
        )

    def _measuring(self, trainer: pl.Trainer) -> bool:
        return self.on_cadence  # the user's logging cadence, decided at the batch's start

    def _initial(self, trainer: pl.Trainer) -> bool:
        """The first optimizer step of a fresh fit, off the user's cadence: measured for ``grad_collapse``'s
        baseline only (the untrained model's gradient and loss), nothing written (no row off the user's axis)."""
        if self._past_initial:
            return False
        if self.collapse_rule.baseline is not None or trainer.global_step > 0:
            self._past_initial = True  # from here on: one attribute test per call
            return False
        return not self.on_cadence

    def _measured_position(self, trainer: pl.Trainer, optimizer: torch.optim.Optimizer) -> int | None:
        """The optimizer's position in ``trainer.optimizers`` if this step is measured, else ``None``."""
        # One optimizer: the steps of the batches on the user's logging cadence. Several (manual optimization,
        # which steps them in turn): each optimizer's first step in such a batch, so all are measured there.
        optimizers = trainer.optimizers
        if len(optimizers) <= 1:
            return 0 if self._measuring(trainer) else None
        if not self._measuring(trainer):
            return None
        position = optimizer_position(trainer, optimizer)
        interval = self.cadence_step(trainer)
        if self._measured_interval.get(position) == interval:
            return None
        self._measured_interval[position] = interval
        return position

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """Attach the activation-gradient hooks and the activation watch (``dead_units``,
        ``activation_saturation``) when the coming optimizer step is a measured one."""
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        if not self._measuring(trainer):
            return
        if self._watching(trainer, pl_module):
            self._watch.attach(pl_module, forward_hooks_of(trainer))  # the driver's hooks: one per module
        if not self.activation_grads or self._act.attached:
            return
        self._act.attach(pl_module, self.activation_grads, lambda key, message: self.notice(trainer, key, message))

    def _watching(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> bool:
        """Whether the activation watch runs: ``dead_units`` or ``activation_saturation`` is on, and the model does
        not run through ``torch.compile`` (hooks attached and removed every measured step would recompile it)."""
        if {DEAD_UNITS, ACTIVATION_SATURATION} <= set(self.rule_choices.off):
            return False
        if self._compiled is None:
            self._compiled = is_compiled(pl_module)
            if self._compiled:
                self.notice(
                    trainer,
                    "compiled-activations",
                    f"the model runs through torch.compile: its activations are not watched ({DEAD_UNITS} and "
                    f"{ACTIVATION_SATURATION} are not measured)",
                )
        return not self._compiled

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        """On measured steps: keep the loss (a device tensor, summed over micro-batches) for ``grad_collapse``.

        While an optimizer's measured step is watched (until that optimizer's next step): read a few elements of
        its parameters' ``.grad`` (``grad_not_zeroed``; device only). The activation watch's hooks come off here:
        its forward is over.
        """
        if self._watch.attached:
            self._watch.detach()
        if self._zero_restored is not None or self._zero.watches:
            self._zero_before_backward(lambda: self._build_index(trainer, pl_module))
        if not (self.on_cadence or self._initial(trainer)):
            return
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            return
        value = loss.detach().float().reshape(())
        self._loss_exact = self._loss is None and loss.dtype is torch.float32 and not loss.dim()
        self._loss = value if self._loss is None else self._loss + value

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """While a measured step is watched: did this backward add to gradients left from before that step?"""
        self._zero_after_backward()

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        """On measured steps: per-layer gradient norms, rules, and a weight snapshot for the update ratio."""
        if self._act.attached:
            act_norms = self._act.flush()
            if act_norms:
                self.writer.scalars({act_grad_norm_tag(n): v for n, v in act_norms.items()}, trainer.global_step)
        if self._zero.watches or self._zero_undecided:
            self._zero_before_step(trainer, optimizer)  # the verdict of this optimizer's watch, if it has one
        if not self.on_cadence and self._past_initial:  # a quiet step: nothing to measure
            return
        position = self._measured_position(trainer, optimizer)
        if position is None:
            if self._initial(trainer) and optimizer_position(trainer, optimizer) == 0:
                self._measure_initial(trainer, pl_module, optimizer)
            return
        if self._index is None:
            self._index = self._build_index(trainer, pl_module)
        index = self._index
        self._stepped = True
        if self.update_sample_size:
            self._sample_updates(trainer, optimizer, index, position)
        in_opt = {id(p) for group in optimizer.param_groups for p in group["params"]}
        chosen = [i for i, p in enumerate(index.params) if p.grad is not None and id(p) in in_opt]
        self._zero_arm(trainer, position, chosen)
        if not chosen:
            return
        # the activation watch's statistics of this step ride in the measurement's one host copy
        act = self._watch.take() if self._watch.pending or self._watch.too_few_rows else None
        # the squared norms of the gradients and weights: the driver's, measured once for every reader of the step
        known = self.shared_gradient_squares(trainer, optimizer)
        loss = _unscaled(trainer, self._loss)
        m = measure_step(index, chosen, loss, self._reduce(trainer), None if act is None else act.values, known)
        exact = self._loss_exact and self._loss is not None
        self._loss = None
        step = trainer.global_step
        values = step_scalars(m, position)
        values.update(self.threshold_lines(GRAD_VANISH, GRAD_EXPLODE))
        self.writer.scalars(values, step)
        ctx = self.context(trainer)
        if act is not None:
            found = ActivationWatch.finish(act, m.extra)
            self._judge_activations(trainer, found, ctx, m.loss if position == 0 else None)
        grads = Measures(grad_rms=m.rms, grad_relative=m.relative, blocks=index.block_layers, layer_roles=index.roles)
        self.record(self.feed(ctx, grads))
        if position == 0:  # one baseline of one quantity: the first optimizer's
            self.record(self.feed(ctx, Measures(grad_norm=m.blocks, loss=m.loss)))
            self._measured_loss = m.loss
            if exact and m.loss is not None and self._driver is not None:  # the batch's loss, read in the host copy
                self._driver.offer_loss(m.loss)
        zero = zero_gradient_ids(index, chosen, m.norms)
        stuck = stuck_parameters(trainer, pl_module, self.params, self.expect_frozen, in_opt, zero)
        names = [n for n, _ in pl_module.named_parameters()]
        self.record(self.feed(ctx, Measures(stuck_params=stuck, param_names=names)))
        on_hist = histogram_due(self.histogram_every_n_steps, self.every_n_steps(trainer), self.cadence_step(trainer))
        if on_hist and self.writer.active and index.sharded:
            # A histogram of a local shard would misrepresent the gradient, and binning the full one needs a gather.
            self.notice(
                trainer,
                "sharded-histograms",
                "gradient histograms are not written under sharded training (DTensor parameters); norms are exact",
            )
        elif on_hist and self.writer.active:
            write_histograms(self.writer, index, chosen, m.norms, step)
        if self.log_weight_norms:
            copies = self._copies.take((position, *chosen), [index.params[i] for i in chosen])
            self._before.append((chosen, copies, m.weight_squares))  # the weights' norms: measured already

    def _judge_activations(
        self,
        trainer: pl.Trainer,
        found: tuple[list[ActivationReading], float | None],
        ctx: StepContext,
        loss: float | None,
    ) -> None:
        """The activation watch's readings of the measured forward and the inputs' RMS (``found``, read with the
        step's measurement), written and judged with the step's training loss; the layers whose units are dead now
        make ``grad_vanish`` defer."""
        readings, input_rms = found
        if self._watch.too_few_rows:
            self._watch.too_few_rows = False
            self.notice(
                trainer,
                "dead-units-rows",
                f"dead units are not counted on batches with fewer than {MIN_ROWS} rows per unit (batch size 1): a "
                "unit inactive for one sample is not dead",
            )
        values = {}
        for r in readings:
            if r.dead is not None:
                values[dead_units_tag(r.layer)] = r.dead
            if r.zero_grad is not None:
                values[zero_grad_tag(r.layer)] = r.zero_grad
            if r.saturated is not None:
                values[saturation_tag(r.layer)] = r.saturated
        if values:
            self.writer.scalars(values, trainer.global_step)
        self.record(self.feed(ctx, Measures(activations=readings, input_rms=input_rms, loss=loss)))
        if DEAD_UNITS not in self.rule_choices.off:
            certain = self.activation_rule.certain
            now = {r.layer for r in readings if r.dead is not None and r.dead > certain}
            self.band_rule.observe_dead(now | self.activation_rule.dead_layers())

    def _measure_initial(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        """Step 0 of a fresh fit when the user's first logging step comes later: the blocks' gradient norm and the
        loss join ``grad_collapse``'s baseline (a fault from the first step on, such as a learning rate that kills
        the network within a few steps, leaves only this measurement of the healthy model). Nothing is written:
        the user's metrics are not logged at this step."""
        if self._index is None:
            self._index = self._build_index(trainer, pl_module)
        index = self._index
        in_opt = {id(p) for group in optimizer.param_groups for p in group["params"]}
        chosen = [i for i, p in enumerate(index.params) if p.grad is not None and id(p) in in_opt]
        loss, self._loss = self._loss, None
        if not chosen:
            return
        m = measure_step(index, chosen, _unscaled(trainer, loss), self._reduce(trainer))
        self.record(self.feed(self.context(trainer), Measures(grad_norm=m.blocks, loss=m.loss)))
        if m.weight_squares is not None:  # grad_explode between measurements: the weights' norms at step 0
            sizes = _layer_sizes(index, chosen)
            squares = dict.fromkeys(sizes, 0.0)
            for i, sq in zip(chosen, m.weight_squares.tolist(), strict=True):  # once per fit
                squares[index.layers[index.layer_of[i]]] += sq
            norms = {k: v**0.5 for k, v in squares.items()}
            weights = WeightNorms(norms, sizes, sgd_step_scale(optimizer.param_groups))
            self.record(self.feed(self.context(trainer), Measures(weight_norms=weights)))

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """After a measured step: weight norms and update-to-weight ratios per layer, and the update rules with
        the ``grad_not_zeroed`` verdicts (one host read)."""
        self._end_batch(trainer)
        self._idle = not self._still_busy()

    def _end_batch(self, trainer: pl.Trainer) -> None:
        """The work of :meth:`on_train_batch_end`."""
        if self._watch.attached:  # a batch without a backward (training_step returned None): no hook past it
            self._watch.detach()
        chosen: list[list[int]] = []
        vector = None  # the update ratios on the device: read with the update rules' counts, in one host copy
        if self._before and self._index is not None:
            pending, self._before = self._before, []
            chosen, vector = update_vector(self._index, pending, self._reduce(trainer))
            self._copies.release()
        host = None
        if self._stepped and self._index is not None:
            self._stepped = False
            host = self._judge_updates(trainer, vector)
        if vector is None or self._index is None:
            return
        values = update_values_from(self._index, chosen, vector.tolist() if host is None else host)
        self.writer.scalars(values, max(trainer.global_step - 1, 0))  # the step that was measured
        # the update ratios: grad_vanish, grad_layer_spread and grad_collapse also ask whether the layers' updates
        # are starved (an adaptive optimizer rescales gradients), update_size judges them
        ratios = layer_update_ratios(self._index, values)
        weights = None
        if len(trainer.optimizers) == 1:  # grad_explode between measurements: the weights against the last reading
            sizes = _layer_sizes(self._index, [i for positions in chosen for i in positions])
            norms = {k: values[weight_norm_tag(k)] for k in sizes if weight_norm_tag(k) in values}
            weights = WeightNorms(norms, sizes, sgd_step_scale(trainer.optimizers[0].param_groups))
        loss, self._measured_loss = self._measured_loss, None
        measured = StepContext(trainer.current_epoch, max(trainer.global_step - 1, 0))  # the step of the ratios
        self.record(self.feed(measured, Measures(weight_norms=weights, update_ratios=ratios, loss=loss)))


def _layer_sizes(index: ParamIndex, chosen: list[int]) -> dict[str, int]:
    """``{layer: elements}`` of the ``chosen`` parameters (measured steps only)."""
    sizes: dict[str, int] = {}
    for i in chosen:
        layer = index.layers[index.layer_of[i]]
        sizes[layer] = sizes.get(layer, 0) + index.numel[i]
    return sizes


def _unscaled(trainer: pl.Trainer, loss: torch.Tensor | None) -> torch.Tensor | None:
    """The step's kept loss without a gradient scaler's factor (``on_before_backward`` hands it scaled)."""
    if loss is None:
        return None
    scale = loss_scale(trainer)
    return loss if scale is None else loss / scale
