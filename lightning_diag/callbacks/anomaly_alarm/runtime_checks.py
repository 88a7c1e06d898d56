"""AnomalyAlarm's checks of what the model does at run time: ``train()`` overrides Lightning bypasses, dropout in
evaluation, mixed precision not applied, per-step loss outliers, and components evaluated before training.

Measures with :mod:`lightning_diag.instrument.runtime_probes` (the probes) and feeds what it measured to the owning
callback's preset (:meth:`~lightning_diag.callbacks.common.preset.DeclaredDetectors.feed`), whose detectors (one
module each in :mod:`lightning_diag.rules`, named after the rule id) judge it; their state follows the declared path.

Cost: the probes run on one training batch per fit (the first) and on the first batch of each validation run; per
training step a reference to the 0-d loss the loss sums already keep is appended to a list (no kernel, no host
read), and the losses since the last logging step are read in one transfer on logging steps.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any

import pytorch_lightning as pl
import torch

from lightning_diag.callbacks.anomaly_alarm.output_collapse_check import OutputCollapseCheck
from lightning_diag.callbacks.anomaly_alarm.sampled_check import end_sampled_batch
from lightning_diag.callbacks.anomaly_alarm.zero_output_check import ZeroOutputCheck
from lightning_diag.instrument.runtime_probes import (
    DropoutWatch,
    MatmulDtypeProbe,
    train_override_effects,
    train_overriders,
    unconverged_spectral_norms,
)
from lightning_diag.rules.base import StepContext
from lightning_diag.rules.measures import AmpLayers, Measures, StepLosses, TrainOverrides, UntrainedInEval

if TYPE_CHECKING:  # pragma: no cover
    from lightning_diag.callbacks.common.base import DiagCallback

__all__ = ["MIXED_PRECISIONS", "PendingLosses", "RuntimeChecks"]

#: The owner's attribute holding ``loss_outlier``'s pending losses (state the checks declare on it).
PENDING_ATTRIBUTE = "pending_losses"

#: The ``Trainer(precision=...)`` values under which the matmul layers should compute in half precision.
MIXED_PRECISIONS = ("16-mixed", "bf16-mixed")


class PendingLosses:
    """The per-step training losses ``loss_outlier`` has not judged yet, with their global steps: references to
    0-d device copies (no kernel, no host read), after the host floats a checkpoint brought back.

    Declared on the alarm (``add_state``): a checkpoint saves them as host floats, the mean over ranks under DDP.
    """

    def __init__(self) -> None:
        self.losses: list[torch.Tensor] = []
        self.steps: list[int] = []
        self.restored: list[float] = []

    def add(self, loss: torch.Tensor, step: int) -> None:
        """Keep a reference to a 0-d loss of ``step``."""
        self.losses.append(loss)
        self.steps.append(step)

    def __bool__(self) -> bool:
        return bool(self.losses or self.restored)

    def values(self, trainer: pl.Trainer | None = None) -> torch.Tensor:
        """The losses, restored ones first, as one float tensor (with ``trainer`` under DDP, the mean over ranks:
        every rank must call it)."""
        device = self.losses[0].device if self.losses else torch.device("cpu")
        parts = [torch.tensor(self.restored, dtype=torch.float32, device=device)] if self.restored else []
        if self.losses:
            parts.append(torch.stack(self.losses).float())
        stacked = torch.cat(parts) if len(parts) > 1 else parts[0]
        if trainer is not None and trainer.world_size > 1:  # every rank judges the same numbers
            stacked = trainer.strategy.reduce(stacked, reduce_op="mean")
        return stacked

    def take(self, trainer: pl.Trainer) -> tuple[list[float], list[int]]:
        """The losses (one host read, the mean over ranks) and their steps; none are pending after."""
        values = self.values(trainer).tolist()
        steps, self.losses, self.steps, self.restored = self.steps, [], [], []
        return values, steps

    def state_dict(self) -> dict[str, list[float] | list[int]]:
        """``losses`` (host floats, one read) and ``steps``."""
        return {"losses": self.values().tolist() if self else [], "steps": list(self.steps)}

    def all_ranks_state_dict(self, trainer: pl.Trainer, device: torch.device) -> dict[str, list[float] | list[int]]:
        """:meth:`state_dict` with the mean of the losses over ranks (a collective: every rank calls it)."""
        return {"losses": self.values(trainer).tolist() if self else [], "steps": list(self.steps)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output: those steps are judged at the next logging step."""
        self.restored = [float(v) for v in state["losses"]]
        self.steps = [int(v) for v in state["steps"]]
        self.losses = []


class RuntimeChecks:
    """The run-time checks an :class:`~lightning_diag.AnomalyAlarm` owns; it calls the hooks below.

    Args:
        owner: The callback whose preset judges what the checks measure, and that records.
        override_id: The id of the rule judging the ``train()`` overrides (named in the warning of an override
            that could not be checked).
        zero_id: The id of the rule judging the sampled all-zero outputs.
        collapse_id: The id of the rule judging the sampled outputs' spread.

    The ids are handed in by the owner's preset module, which names the detectors; nothing here imports a rule.
    """

    def __init__(self, owner: DiagCallback, *, override_id: str, zero_id: str, collapse_id: str) -> None:
        self.owner = owner
        self.override_id = override_id
        # What is measured feeds the owner's preset (owner.feed): its detectors judge it.
        #: ``zero_output``'s watch of the modules' outputs on sampled steps.
        self.zero_outputs = ZeroOutputCheck(owner, zero_id)
        #: ``output_collapse``'s watch of the model's output on sampled steps.
        self.outputs = OutputCollapseCheck(owner, collapse_id)
        owner.add_state(PENDING_ATTRIBUTE, PendingLosses, state_key="runtime_pending")
        self.reset()

    def reset(self) -> None:
        """The start of a fit (the rules are rebuilt by the owner)."""
        self._first_batch_done = False
        self._trained_forward = False
        self._amp: MatmulDtypeProbe | None = None
        self._dropout: DropoutWatch | None = None
        # The owner's declared pending losses of this fit (restored in place at a resume).
        self._pending: PendingLosses = getattr(self.owner, PENDING_ATTRIBUTE)
        self.zero_outputs.reset()
        self.outputs.reset()
        #: The global step from which :meth:`on_train_batch_start` has something to do besides the owner's cadence
        #: batches (which it calls it on: ``zero_output``'s and ``output_collapse``'s sampled steps): the fit's first
        #: batch, then none. The owner does not call it on other batches.
        self.start_due: float = 0
        #: What :meth:`on_train_batch_end` does on a batch whose start did not call :meth:`on_train_batch_start` and
        #: that logs nothing (the owner calls this instead then): ``keep_loss(loss, step)`` keeps a reference to the
        #: batch's 0-d loss of global step ``step`` for ``loss_outlier`` (the pending losses' own ``add``).
        self.keep_loss = self._pending.add

    # -- training ------------------------------------------------------------------------------------------
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """On the owner's cadence batches: start the sampled checks' watches. On the fit's first training batch:
        compare ``train()`` overrides with what is in effect, and watch the matmul layers' dtypes under mixed
        precision."""
        self.zero_outputs.on_batch_start(trainer, pl_module)
        self.outputs.on_batch_start(trainer, pl_module)
        self.start_due = math.inf
        if self._first_batch_done:
            return
        self._first_batch_done = True
        ctx = self.owner.context(trainer)
        overriders = train_overriders(pl_module)
        if overriders:
            notes: list[str] = []
            to_eval, frozen = train_override_effects(pl_module, notes)
            for note in notes:  # once per fit: the check runs on the first batch only
                logging.getLogger("lightning_diag").warning(
                    "%s not checked for %s: %s", self.override_id, ", ".join(overriders), note
                )
            overrides = TrainOverrides(overriders, to_eval, frozen)
            self.owner.record(self.owner.feed(ctx, Measures(train_overrides=overrides)))
        if str(trainer.precision) in MIXED_PRECISIONS:
            self._amp = MatmulDtypeProbe(pl_module)
            self._amp.start()

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        loss: torch.Tensor | None,
        step: int,
        logging: bool,
    ) -> None:
        """Keep a reference to the batch's 0-d loss of global step ``step`` (the loss sums' own: no new kernel);
        judge the mixed-precision probe; on logging steps judge the losses."""
        self._trained_forward = True
        end_sampled_batch((self.zero_outputs, self.outputs), trainer, pl_module)  # one host read for both
        if self._amp is not None:
            probe, self._amp = self._amp, None
            probe.stop()
            amp = AmpLayers(probe.layers, probe.float32, str(trainer.precision))
            self.owner.record(self.owner.feed(self.owner.context(trainer), Measures(amp=amp)))
        pending = self._pending
        if loss is not None:
            pending.add(loss, step)
        if logging and pending:
            values, steps = pending.take(trainer)  # the one host read, on a logging step
            ctx = StepContext(trainer.current_epoch, trainer.global_step)
            losses = Measures(step_losses=StepLosses(values, steps))
            self.owner.record(self.owner.feed(ctx, losses))

    # -- validation ----------------------------------------------------------------------------------------
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Before any training forward: components whose state only training updates (spectral norm)."""
        if self._trained_forward or trainer.global_step > 0:
            return
        modules = unconverged_spectral_norms(pl_module)
        if modules:
            untrained = Measures(untrained_in_eval=UntrainedInEval(modules, trainer.sanity_checking))
            self.owner.record(self.owner.feed(self.owner.context(trainer), untrained))

    def on_validation_batch_start(self, pl_module: pl.LightningModule, batch_idx: int, dataloader_idx: int) -> None:
        """On the first batch of a validation run: watch for dropouts applied in training mode."""
        if batch_idx == 0 and dataloader_idx == 0 and self._dropout is None:
            self._dropout = DropoutWatch(pl_module)
            self._dropout.start()

    def on_validation_batch_end(self, trainer: pl.Trainer) -> None:
        """Judge what the dropout watch saw."""
        if self._dropout is None:
            return
        watch, self._dropout = self._dropout, None
        watch.stop()
        found = Measures(eval_dropouts=watch.found)
        self.owner.record(self.owner.feed(self.owner.context(trainer), found))

    def stop(self) -> None:
        """Remove whatever is installed (the end of a fit, or an exception in the middle of a batch)."""
        for probe in (self._amp, self._dropout):
            if probe is not None:
                probe.stop()
        self._amp = self._dropout = None
        self.zero_outputs.stop()
        self.outputs.stop()
