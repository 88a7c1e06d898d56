"""What the validation-end probes share: capturing a few validation batches, a sandbox that leaves the training
state exactly as it was, the module's loss on a batch, and rank-zero measurement with broadcast decisions.

A sharded model (FSDP2, tensor parallelism, FSDP1: :func:`~lightning_diag.instrument.sharding.is_sharded_module`;
and any model under DeepSpeed, whose ZeRO-3 gathers the partitioned parameters in forward) cannot
run a forward on rank zero alone (every forward is a collective: the other ranks would never join it, and rank
zero would wait forever). There every rank keeps its own first ``num_batches`` validation batches and measures at
once; the probe reduces its numbers over the ranks (:attr:`ValidationProbe.all_ranks`), global rank zero logs and
judges, and the decisions are broadcast as under DDP.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytorch_lightning as pl
import torch
from lightning_utilities.core.apply_func import apply_to_collection
from pytorch_lightning.trainer.states import TrainerFn

from lightning_diag.callbacks.common.base import AlertHandler, DiagCallback, RuleChoices
from lightning_diag.callbacks.common.unlogged import unlogged_copy
from lightning_diag.core.alerts import Alert
from lightning_diag.core.validation import check_callable, check_int
from lightning_diag.instrument.rng import preserved_rng
from lightning_diag.instrument.sharding import is_sharded_module, reshard_fsdp

__all__ = ["LossFn", "ProbeError", "ValidationProbe", "uses_deepspeed"]

#: ``loss_fn(pl_module, batch) -> loss``: a scalar tensor, or a dict with a ``"loss"`` tensor.
LossFn = Callable[[pl.LightningModule, Any], Any]


def uses_deepspeed(trainer: pl.Trainer) -> bool:
    """DeepSpeed (ZeRO-3 partitions the parameters: a forward gathers them, a collective)."""
    return type(trainer.strategy).__name__.startswith("DeepSpeed")


class ProbeError(RuntimeError):
    """The probe cannot measure this model (the message says why and what to do)."""


def _as_loss(out: Any, where: str) -> torch.Tensor:
    loss = out.get("loss") if isinstance(out, dict) else out
    if not isinstance(loss, torch.Tensor) or not loss.is_floating_point():
        kind = "a dict without a 'loss' tensor" if isinstance(out, dict) else type(out).__name__
        raise ProbeError(f"{where} returned {kind}; the probe needs a float tensor or a dict with 'loss' "
                         "(pass loss_fn=... to compute it)")
    return loss.float().mean() if loss.numel() != 1 else loss.float().reshape(())


class ValidationProbe(DiagCallback):
    """Base of the probes that measure the model on a few validation batches at validation end.

    On probe epochs (every ``every_n_epochs`` epochs, first validation of the epoch, fitting only, never the
    sanity check) the first ``num_batches`` batches of the first validation dataloader are kept; at validation
    end global rank zero measures (:meth:`measure`) inside :meth:`sandbox` and every rank takes the alerts and
    the rule state rank zero broadcasts. A sharded model under several processes is measured by every rank at
    once (:attr:`all_ranks`), each on its own batches, and the measure reduces its numbers over the ranks.

    Args:
        every_n_epochs: Probe every this many epochs.
        num_batches: Validation batches per probe.
        loss_fn: ``loss_fn(pl_module, batch)`` returning the loss (a scalar tensor or a dict with ``"loss"``);
            by default ``pl_module.training_step(batch, batch_idx)``, with ``self.log`` silenced.
        rules: The probe's rule's threshold and settings, or ``False`` to switch it off (docs/thresholds.md).
        on_alert: A callable receiving each :class:`~lightning_diag.core.alerts.Alert` as it is recorded (global
            rank zero, after it is written to ``alerts.jsonl``): send it to Slack, e-mail or a pager. A handler
            that raises is reported once per fit through the ``lightning_diag`` logger and never stops training.
    """

    extra_state_keys = ("last_probed_epoch",)

    def __init__(
        self,
        *,
        every_n_epochs: int = 1,
        num_batches: int = 2,
        loss_fn: LossFn | None = None,
        rules: RuleChoices | None = None,
        on_alert: AlertHandler | None = None,
    ) -> None:
        super().__init__(rules=rules, on_alert=on_alert)
        self.every_n_epochs = check_int("every_n_epochs", every_n_epochs, low=1)
        self.num_batches = check_int("num_batches", num_batches, low=1)
        check_callable("loss_fn", loss_fn, "a callable (pl_module, batch) -> loss")
        self.loss_fn = loss_fn
        self._batches: list[tuple[int, Any]] = []
        self._last_probed_epoch = -1
        #: Every rank measures (a sharded model under several processes); else global rank zero alone.
        self.all_ranks = False

    # -- what subclasses implement ----------------------------------------------------------------------
    def measure(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batches: list[tuple[int, Any]]) -> Any:
        """Measure on rank zero inside the sandbox; the result goes to :meth:`decide`. Raise ProbeError to skip.
        A user step runs on an :func:`unlogged_copy` of ``pl_module`` (as :meth:`loss_on` does), never on it."""
        raise NotImplementedError

    def decide(self, trainer: pl.Trainer, result: Any) -> list[Alert]:
        """Rank zero: log ``result`` and feed the rules; return the new alerts."""
        raise NotImplementedError

    def rule_state(self) -> dict[str, Any]:
        """The declared rules' state, broadcast from rank zero after a probe (and checkpointed)."""
        return self.rules_state_dict()

    def load_rule_state(self, state: dict[str, Any]) -> None:
        """Restore :meth:`rule_state` output."""
        self.load_rules_state_dict(state)

    # -- hooks --------------------------------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """A new fit has probed no epoch yet (a resumed one loads its state after this)."""
        super().setup(trainer, pl_module, stage)
        if stage == TrainerFn.FITTING:
            self._last_probed_epoch = -1
            self._batches = []

    def _probe_epoch(self, trainer: pl.Trainer) -> bool:
        return (
            trainer.state.fn == TrainerFn.FITTING
            and not trainer.sanity_checking
            and (trainer.current_epoch + 1) % self.every_n_epochs == 0
            and trainer.current_epoch != self._last_probed_epoch
        )

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Forget the batches of the previous validation run; see whether every rank must measure."""
        self._batches = []
        self.all_ranks = trainer.world_size > 1 and (is_sharded_module(pl_module) or uses_deepspeed(trainer))

    def on_validation_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        """Keep the first ``num_batches`` batches of the first dataloader on probe epochs (rank zero)."""
        if (
            dataloader_idx == 0
            and len(self._batches) < self.num_batches
            and (trainer.is_global_zero or self.all_ranks)
            and self._probe_epoch(trainer)
        ):
            self._batches.append((batch_idx, batch))

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Probe (rank zero), then share the decisions with every rank."""
        if not self._probe_epoch(trainer):
            return
        self._last_probed_epoch = trainer.current_epoch
        alerts: list[Alert] = []
        if self.all_ranks:
            alerts = self._probe_all_ranks(trainer, pl_module)
        elif trainer.is_global_zero:
            batches, self._batches = self._batches, []
            try:
                if not batches:
                    raise ProbeError("no validation batch was seen (limit_val_batches=0?): nothing to probe")
                if self.loss_fn is None and not pl_module.automatic_optimization:
                    raise ProbeError("`training_step` steps the optimizer itself under manual optimization: "
                                     "pass loss_fn=... so the probe can compute the loss without it")
                with self.sandbox(trainer, pl_module):
                    result = self.measure(trainer, pl_module, batches)
                alerts = self.decide(trainer, result)
            except ProbeError as err:
                self.notice(trainer, "probe-skipped", f"probe skipped: {err}")
            except Exception as err:  # the probe must never end a training run: say why once, go on
                self.notice(trainer, "probe-failed", f"probe skipped: computing the loss raised "
                            f"{type(err).__name__}: {err} (pass loss_fn=... if training_step cannot run here)")
        payload = trainer.strategy.broadcast((alerts, self.rule_state()), src=0)
        alerts, state = payload
        if not trainer.is_global_zero:
            self.load_rule_state(state)
        self.record(alerts)
        self.writer.flush()

    def _probe_all_ranks(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> list[Alert]:
        """Sharded model: every rank measures on its own batches at once (the measure reduces over the ranks)."""
        batches, self._batches = self._batches, []
        problem = ""
        if not batches:
            problem = "no validation batch was seen (limit_val_batches=0?): nothing to probe"
        elif self.loss_fn is None and not pl_module.automatic_optimization:
            problem = ("`training_step` steps the optimizer itself under manual optimization: pass loss_fn=... so "
                       "the probe can compute the loss without it")
        # Every rank enters the sharded forward, or none does.
        if not trainer.strategy.reduce_boolean_decision(not problem, all=True):
            self.notice(trainer, "probe-skipped", f"probe skipped: {problem or 'a rank saw no validation batch'}")
            return []
        try:
            with self.sandbox(trainer, pl_module):
                try:
                    result = self.measure(trainer, pl_module, batches)
                finally:
                    # FSDP2's root keeps the last forward's gathered weights (the SAM gap's were perturbed ones):
                    # training's next forward must gather the restored shards afresh
                    reshard_fsdp(pl_module)
        except ProbeError as err:  # raised by the measure's own checks, the same on every rank
            self.notice(trainer, "probe-skipped", f"probe skipped: {err}")
            return []
        except Exception as err:  # the same model and code on every rank: every rank gets here alike
            self.notice(trainer, "probe-failed", f"probe skipped: computing the loss raised "
                        f"{type(err).__name__}: {err} (pass loss_fn=... if training_step cannot run here)")
            return []
        return self.decide(trainer, result) if trainer.is_global_zero else []

    def mean_over_ranks(self, trainer: pl.Trainer, value: torch.Tensor) -> float:
        """``value`` averaged over the ranks when every rank measures (a host read), else as it is."""
        if self.all_ranks:
            value = trainer.strategy.reduce(value.detach().float().reshape(()).clone(), reduce_op="mean")
        return float(value)

    # -- helpers --------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def sandbox(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> Iterator[None]:
        """Eval mode, autograd enabled; training flags and every RNG restored after (the user's steps run on an
        :func:`unlogged_copy`, see :meth:`loss_on`)."""
        modes = [(m, m.training) for m in pl_module.modules()]
        pl_module.eval()
        try:
            with preserved_rng(), torch.inference_mode(False), torch.enable_grad():
                yield
        finally:
            for module, training in modes:
                module.training = training

    @staticmethod
    def own_batch(batch: Any) -> Any:
        """A copy of a captured batch usable by autograd (validation tensors are inference tensors)."""
        return apply_to_collection(batch, torch.Tensor, lambda t: t.clone())

    def loss_on(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> torch.Tensor:
        """The module's loss on one batch (``loss_fn`` or ``training_step``), under the trainer's precision; both
        run on an :func:`unlogged_copy` of the module, so its ``self.log`` calls reach no logged value (the copy
        is made here, not in :meth:`sandbox`: FSDP2 and the like know the live module only, and :meth:`measure`
        reshards or gathers through it)."""
        quiet = unlogged_copy(pl_module)
        with trainer.precision_plugin.forward_context():
            if self.loss_fn is not None:
                return _as_loss(self.loss_fn(quiet, batch), "`loss_fn`")
            return _as_loss(quiet.training_step(batch, batch_idx), "`training_step`")

    def mean_loss(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batches: list[tuple[int, Any]]
    ) -> torch.Tensor:
        """The mean loss over ``batches`` (already owned)."""
        losses = [self.loss_on(trainer, pl_module, b, i) for i, b in batches]
        return torch.stack(losses).mean()

    # -- state ----------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The rule state (the base class: the probe's rule under ``"rules"``) and the last probed epoch."""
        return {**super().state_dict(), "last_probed_epoch": self._last_probed_epoch}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output.

        Raises:
            KeyError: If a key is missing; the message names every missing key.
        """
        super().load_state_dict(state_dict)
        self._last_probed_epoch = int(state_dict["last_probed_epoch"])
