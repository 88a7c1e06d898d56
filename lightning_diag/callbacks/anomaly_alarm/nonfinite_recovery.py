"""Lightning side of non-finite localisation and rollback, used by :class:`~lightning_diag.AnomalyAlarm`.

:class:`NonFiniteRecovery` keeps, on healthy steps, only a reference to each micro-batch of the current optimizer
step and a copy of the RNG state it started with (``locate_nonfinite``), and with ``on_nonfinite="rollback"`` a
snapshot of the training state every ``RollbackSettings.every_n_steps`` optimizer steps. On a non-finite step the alarm
asks it to localise (:mod:`lightning_diag.instrument.nonfinite_locate`) and to roll back
(:mod:`lightning_diag.instrument.snapshots`, :mod:`lightning_diag.rules.rollback`).

DDP: the replay runs on one rank only (the lowest rank whose own loss was non-finite, else the lowest whose
gradients were), on the underlying LightningModule, not through the DDP wrapper: no gradient all-reduce is
triggered (gradients come from :func:`torch.autograd.grad`, which fires no DDP hook) and ``self.log`` calls of
``training_step`` are silenced during the replay (a ``sync_dist`` there would wait for the other ranks). Its
finding is broadcast to every rank. Models with ``SyncBatchNorm`` are not replayed (its forward is a
collective). The rollback decision, the snapshot chosen and its trust are agreed over all ranks.

Sharded training (FSDP2, tensor parallelism: ``DTensor`` parameters): the forward pass is itself a collective
(parameters are all-gathered, TP outputs all-reduced), so every rank replays its own micro-batches together,
forward only and without autograd, and the finding of the lowest rank whose loss was non-finite is broadcast. A
non-finite value that first appears in backward is not localised there (the alert names the parameters).

Rollback under sharding (FSDP2, tensor parallelism, FSDP1): snapshots hold each rank's own shards and are restored
in place on every rank at the agreed step (:mod:`lightning_diag.instrument.snapshots`). DeepSpeed's engine owns
the optimizer step and its partitioned state: ``"rollback"`` falls back to ``"stop"`` there, with a one-time
message.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Callable
from typing import Any, Protocol

import pytorch_lightning as pl
import torch

from lightning_diag.callbacks.common.base import extract_loss
from lightning_diag.callbacks.common.unlogged import unlogged_copy
from lightning_diag.core.validation import check_choice, check_int, check_number
from lightning_diag.instrument.nonfinite_locate import (
    NOT_FOUND,
    Localisation,
    find_nonfinite_in_batch,
    locate,
)
from lightning_diag.instrument.rng import RngState, device_generators
from lightning_diag.instrument.snapshots import RollbackDevice, SnapshotStore
from lightning_diag.rules.verdicts import RollbackChoice
from lightning_diag.stats.grad import is_dtensor

__all__ = ["NonFiniteRecovery", "RollbackSettings"]


class RollbackPolicy(Protocol):
    """What the recovery asks of its owner's rollback detector (``nonfinite_rollback``'s, a detector of the
    owner's preset): which snapshot to restore, and the count and learning-rate factor it keeps."""

    @property
    def rollbacks(self) -> int:
        """Rollbacks made in this fit."""

    @property
    def max_rollbacks(self) -> int:
        """Rollbacks allowed in one fit."""

    @property
    def lr_scale(self) -> float:
        """The factor on every learning rate now in force."""

    @property
    def spike_factor(self) -> float:
        """The snapshots' trust test: a snapshot after a mean loss above this multiple of the running median is
        not trusted (see :class:`~lightning_diag.instrument.snapshots.SnapshotStore`)."""

    def choose(self, steps: list[int], trusted: list[bool], now: int) -> RollbackChoice:
        """The snapshot to restore among ``steps`` (oldest first, with their trust) at global step ``now``."""

    def record(self, restored: int, now: int) -> float:
        """Count a rollback to ``restored`` made at ``now``; the new learning-rate factor."""


def _ignore(state: dict[str, Any]) -> None:
    """The default ``load_extra``: a module-level function, so the callback pickles (``ddp_spawn``)."""


def _schedulers(trainer: pl.Trainer) -> list[Any]:
    return [config.scheduler for config in trainer.lr_scheduler_configs]


def _engine_owns_step(trainer: pl.Trainer) -> bool:
    """DeepSpeed: the engine steps its own (ZeRO-partitioned) optimizer; no in-memory snapshot can restore it."""
    return type(trainer.strategy).__name__.startswith("DeepSpeed")


def _scaler(trainer: pl.Trainer) -> Any:
    return getattr(trainer.precision_plugin, "scaler", None)


@dataclasses.dataclass(frozen=True)
class RollbackSettings:
    """The settings of :class:`~lightning_diag.AnomalyAlarm`'s ``on_nonfinite="rollback"`` (built by the alarm from
    ``nonfinite_rollback``'s fields of ``rules=`` and ``rollback_device``).

    The fields are the settings of the ``nonfinite_rollback`` rule (registry keys
    ``nonfinite_rollback.<field>``); they are checked at construction and in force only with that action. They
    have no defaults here: the alarm reads them (defaults included) from the rule's declaration, through its
    thresholds, so they are written once.

    Attributes:
        every_n_steps: Optimizer steps between in-memory snapshots (and the window in which a second non-finite
            step goes back further than the last rollback).
        lr_factor: Every rollback multiplies the learning rates by this, in (0, 1), for the rest of the run, on
            top of the schedulers.
        max_rollbacks: Rollbacks allowed in one fit; the next non-finite step stops training.
        device: ``"cpu"`` keeps snapshots in host memory (non-blocking copies), ``"device"`` on the training
            device.
        snapshots: Snapshots kept.

    Raises:
        TypeError: If a value has the wrong type.
        ValueError: If a value is out of range or not one of its allowed values.

    Example:
        >>> RollbackSettings(every_n_steps=100, lr_factor=0.5, max_rollbacks=3, snapshots=3).device
        'cpu'
        >>> from lightning_diag import AnomalyAlarm
        >>> AnomalyAlarm(on_nonfinite="rollback", rules={"nonfinite_rollback": {"every_n_steps": 100}}).rollback
        RollbackSettings(every_n_steps=100, lr_factor=0.5, max_rollbacks=3, snapshots=3, device='cpu')
    """

    every_n_steps: int
    lr_factor: float
    max_rollbacks: int
    snapshots: int
    device: RollbackDevice = "cpu"

    def __post_init__(self) -> None:
        check_int("every_n_steps", self.every_n_steps, low=1)
        lr_factor = check_number(
            "lr_factor", self.lr_factor, low=0.0, high=1.0, low_inclusive=False, high_inclusive=False
        )
        object.__setattr__(self, "lr_factor", lr_factor)
        check_int("max_rollbacks", self.max_rollbacks, low=0)
        check_choice("device", self.device, ("cpu", "device"))
        check_int("snapshots", self.snapshots, low=1)


class NonFiniteRecovery:
    """Batch keeping, replay, snapshots and learning-rate scaling for one :class:`~lightning_diag.AnomalyAlarm`.

    Which snapshot to restore, the rollback count and the learning-rate factor in force are the owner's rollback
    detector's (``nonfinite_rollback``, a detector of its preset handed in at construction and again by
    :meth:`reset`: :class:`RollbackPolicy`); its alert is judged by the owner's preset, fed the
    :class:`~lightning_diag.rules.measures.Rollback` made. The alarm builds it; a benchmark timing it alone takes
    the alarm's (``AnomalyAlarm(on_nonfinite="rollback").recovery``).

    Args:
        locate: Replay the failing step to localise the first non-finite value.
        rollback: Keep snapshots and roll back on a non-finite step.
        settings: Snapshot interval, learning-rate factor, rollback budget, snapshot device and count.
        rule: The owner's rollback detector (its ``spike_factor`` is the snapshots' trust test).

    Example:
        >>> from lightning_diag import AnomalyAlarm
        >>> alarm = AnomalyAlarm(on_nonfinite="rollback", rules={"nonfinite_rollback": {"lr_factor": 0.25}})
        >>> alarm.recovery.rule is alarm.rollback_rule, alarm.recovery.lr_scale, alarm.recovery.rule.rollbacks
        (True, 1.0, 0)
    """

    def __init__(
        self,
        *,
        locate: bool,
        rollback: bool,
        settings: RollbackSettings,
        rule: RollbackPolicy,
    ) -> None:
        self.locate_enabled = locate
        self.rollback_enabled = rollback
        self.settings = settings
        self.every_n_steps = settings.every_n_steps
        self.spike_factor = rule.spike_factor
        #: The owner's rollback detector (its policy: :meth:`rollback` asks it), handed in again by :meth:`reset`
        #: at every fit.
        self.rule: RollbackPolicy = rule
        self.store = SnapshotStore(keep=settings.snapshots, device=settings.device, spike_factor=self.spike_factor)
        self._batches: collections.deque[tuple[Any, int, RngState | None]] = collections.deque(maxlen=1)
        self._hooks: list[Any] = []
        self._scaled: list[tuple[dict[str, Any], Any, Any]] = []
        self._last_snapshot: int | None = None
        self._can_replay = True
        # Whether each micro-batch is kept for a replay (``locate`` and a model that can be replayed).
        self._keeps = locate
        #: Whether a training step of this fit was seen drawing from torch's generators (see :meth:`on_batch_start`).
        self.draws = False
        #: The RNG copy of a watched batch until its end (:meth:`end_watch`), else ``None``.
        self.watching: RngState | None = None
        self._first = True
        self._generators: tuple[str, list[int]] = ("cpu", [])  # device_generators() at the fit's start
        self._device_module: Any = None
        self._sharded = False
        self._unsupported = False
        self._extra: Callable[[], dict[str, Any]] = dict
        self._load_extra: Callable[[dict[str, Any]], None] = _ignore

    # -- lifecycle ----------------------------------------------------------------------------------------
    def reset(self, rule: RollbackPolicy) -> None:
        """Start a fit afresh with ``rule``, the owner's rollback detector (restored in place at a resume)."""
        self.rule = rule
        self.spike_factor = rule.spike_factor
        self.store = SnapshotStore(
            keep=self.settings.snapshots, device=self.settings.device, spike_factor=self.spike_factor
        )
        self._batches.clear()
        self._last_snapshot = None
        self.draws = False
        self.watching = None
        self._first = True

    def check_module(self, pl_module: pl.LightningModule) -> None:
        """Refuse what rollback cannot do.

        Raises:
            ValueError: ``on_nonfinite="rollback"`` with manual optimization.
        """
        if self.rollback_enabled and not pl_module.automatic_optimization:
            raise ValueError(
                "`on_nonfinite='rollback'` needs automatic optimization; with manual optimization use "
                "'stop', 'raise', 'skip' or 'warn'"
            )
        self._can_replay = pl_module.automatic_optimization and not any(
            isinstance(m, torch.nn.SyncBatchNorm) for m in pl_module.modules()
        )
        self._keeps = self.locate_enabled and self._can_replay

    def start(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        extra: Callable[[], dict[str, Any]] = dict,
        load_extra: Callable[[dict[str, Any]], None] = _ignore,
    ) -> str | None:
        """Install the learning-rate hooks and take the first snapshot; return a message when rollback cannot run.

        Args:
            trainer: The trainer.
            pl_module: The model.
            extra: Called at each snapshot: the owner's own state to keep with it.
            load_extra: Called with that state when its snapshot is restored.
        """
        self.stop()
        self._extra, self._load_extra = extra, load_extra
        self._batches = collections.deque(maxlen=max(1, trainer.accumulate_grad_batches))
        # Which device generators each batch's RNG copy holds, looked up once: the model is on its device now.
        self._generators = device_generators()
        self._device_module = torch.get_device_module(self._generators[0]) if self._generators[1] else None
        self._unsupported = False
        # configure_model shards the model after the callbacks' setup (check_module): look again now.
        self._sharded = any(is_dtensor(p) for p in pl_module.parameters())
        if not self.rollback_enabled:
            return None
        if _engine_owns_step(trainer):
            self._unsupported = True
            return (
                "on_nonfinite='rollback' is not supported under DeepSpeed (its engine owns the optimizer step "
                "and the partitioned optimizer state): a non-finite step stops training instead"
            )
        for opt in trainer.optimizers:
            self._hooks.append(opt.register_step_pre_hook(self._scale_lr))
            self._hooks.append(opt.register_step_post_hook(self._unscale_lr))
        self._snapshot(trainer, pl_module)
        return None

    def stop(self) -> None:
        """Remove the hooks and forget the kept batches (snapshots are dropped with the next :meth:`reset`)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        self._batches.clear()

    # -- learning rate --------------------------------------------------------------------------------------
    def _scale_lr(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        scale = self.rule.lr_scale
        if scale == 1.0:
            return
        for group in optimizer.param_groups:
            lr = group.get("lr")
            if lr is not None:
                scaled = lr * scale
                group["lr"] = scaled
                self._scaled.append((group, scaled, lr))

    def _unscale_lr(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        # Groups replaced by a rollback in the middle of the step hold the snapshot's value: left alone.
        for group, scaled, lr in self._scaled:
            if group.get("lr") is scaled:
                group["lr"] = lr
        self._scaled.clear()

    @property
    def lr_scale(self) -> float:
        """The factor on every learning rate now in force (1.0 before any rollback)."""
        return self.rule.lr_scale

    # -- healthy steps ------------------------------------------------------------------------------------
    def on_batch_start(self, batch: Any, batch_idx: int, watch: bool = True) -> bool:
        """Keep a reference to the micro-batch (no copy) and, when the step needs it, a copy of the RNG state it
        starts with.

        A step needs the copy when it draws random numbers (dropout, a sampler in ``training_step``): a replay
        then draws the same. Whether the model's steps draw is watched on the fit's first batch and on the batches
        the caller marks with ``watch`` (its logging steps): the state at the batch's start against the state at
        its end (:meth:`end_watch`). Once a step was seen drawing, every micro-batch keeps its copy for the rest
        of the fit; until then the quiet steps keep none (a step that draws nothing replays the same from any
        state). A model that starts drawing later is seen at the next watched batch: a failing step before that
        is replayed with the generators' current state (the replay never changes the run's generators).

        Returns:
            Whether this batch is watched: then :meth:`end_watch` is due at its end (else it has nothing to do).
        """
        if not self._keeps:
            return False
        rng = None
        if self.draws or watch or self._first:
            rng = self._rng_state()
            if not self.draws:
                self.watching = rng
        self._first = False
        self._batches.append((batch, batch_idx, rng))
        return self.watching is not None

    def end_watch(self) -> None:
        """The end of a watched batch: whether its training step drew from torch's generators (then from now on
        every micro-batch keeps its copy)."""
        watched, self.watching = self.watching, None
        if watched is not None and not self.draws:
            now = self._rng_state()
            self.draws = not torch.equal(now.cpu, watched.cpu) or any(
                not torch.equal(now.devices[i], state) for i, state in watched.devices.items()
            )

    def _rng_state(self) -> RngState:
        """A copy of torch's generators (CPU, and the accelerator's initialised devices found at the fit's start):
        what :meth:`RngState.capture <lightning_diag.instrument.rng.RngState.capture>` takes without ``python``,
        looked up once per fit. Dropout and torch's samplers draw from these."""
        device_type, indices = self._generators
        module = self._device_module
        devices = {i: module.get_rng_state(i) for i in indices} if module is not None else {}
        return RngState(torch.default_generator.get_state(), device_type, devices)

    def on_step_checked(self) -> None:
        """The optimizer step's micro-batches are no longer needed."""
        self._batches.clear()

    def on_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor | None) -> None:
        """Feed the loss to the trust test; take a snapshot every ``every_n_steps`` optimizer steps."""
        if not self.rollback_enabled or self._unsupported:
            return
        if loss is not None:
            self.store.observe_loss(loss)
        step = trainer.global_step
        if step % self.every_n_steps == 0 and step != self._last_snapshot:
            self._snapshot(trainer, pl_module)

    def _snapshot(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        step = trainer.global_step
        self.store.take(step, pl_module, trainer.optimizers, _schedulers(trainer), _scaler(trainer), self._extra())
        self._last_snapshot = step

    # -- failure ------------------------------------------------------------------------------------------
    def localise(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss_bad: bool, grad_bad: bool
    ) -> Localisation:
        """Replay the failing step on one rank and share what it found with every rank (all ranks call this)."""
        if not self.locate_enabled:
            return NOT_FOUND
        world, rank = trainer.world_size, trainer.global_rank
        key = rank if loss_bad else world + rank if grad_bad else 2 * world
        if not self._batches or not self._can_replay:
            key = 2 * world
        if world > 1:
            key = int(trainer.strategy.reduce(torch.tensor(key, device=pl_module.device), reduce_op="min"))
        if key >= 2 * world:
            return NOT_FOUND
        source_rank = key % world
        # Sharded parameters exist only after configure_model (after the callbacks' setup): looked at here, on the
        # failure path. The replay is then a collective: every rank runs it.
        if world > 1 and any(is_dtensor(p) for p in pl_module.parameters()):
            shared = trainer.strategy.broadcast(
                self._replay(trainer, pl_module, collective=True).as_dict(), src=source_rank
            )
            return Localisation.from_dict(shared) if shared else NOT_FOUND
        finding = self._replay(trainer, pl_module).as_dict() if source_rank == rank else None
        if world > 1:
            finding = trainer.strategy.broadcast(finding, src=source_rank)
        return Localisation.from_dict(finding) if finding else NOT_FOUND

    def _replay(self, trainer: pl.Trainer, pl_module: pl.LightningModule, collective: bool = False) -> Localisation:
        """Replay the kept micro-batches; ``collective``: every rank runs every forward (sharded training), so the
        same collectives run everywhere whatever each rank finds."""
        batches = list(self._batches)
        for batch, _, _ in batches:
            found = find_nonfinite_in_batch(batch)
            if found is not None and not collective:
                return found
        if collective:
            return self._replay_forward(trainer, pl_module, batches)
        scaler = _scaler(trainer)
        scale = float(scaler.get_scale()) if scaler is not None and scaler.is_enabled() else 1.0
        for batch, batch_idx, rng in batches:
            found = locate(
                pl_module,
                functools.partial(_training_step_loss, pl_module, batch, batch_idx),
                rng_state=rng,
                context=trainer.precision_plugin.train_step_context,
                loss_scale=scale,
                root_name=type(pl_module).__name__,
            )
            if found.found:
                return found
        return NOT_FOUND

    def _replay_forward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batches: list[Any]) -> Localisation:
        first: Localisation = NOT_FOUND
        for batch, batch_idx, rng in batches:
            found = find_nonfinite_in_batch(batch)
            replayed = locate(
                pl_module,
                functools.partial(_training_step_loss, pl_module, batch, batch_idx),
                rng_state=rng,
                context=trainer.precision_plugin.train_step_context,
                root_name=type(pl_module).__name__,
                forward_only=True,
            )
            found = found if found is not None else replayed
            if not first.found and found.found:
                first = found
        _reshard(pl_module)
        return first

    def rollback(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> RollbackChoice:
        """Choose a snapshot over all ranks, restore it and count the rollback; ``step is None``: stop instead."""
        steps = self.store.steps()
        trusted = self.store.trusted()
        if trainer.world_size > 1 and trusted:
            untrusted = torch.tensor([0.0 if t else 1.0 for t in trusted], device=pl_module.device)
            trusted = [v == 0.0 for v in trainer.strategy.reduce(untrusted, reduce_op="sum").tolist()]
        now = trainer.global_step
        choice = self.rule.choose(steps, trusted, now=now)
        if choice.step is None:
            return choice
        extra = self.store.restore(choice.step, pl_module, trainer.optimizers, _schedulers(trainer), _scaler(trainer))
        if extra:
            self._load_extra(extra)
        self.store.drop_after(choice.step)
        self.rule.record(choice.step, now)
        self._last_snapshot = now  # no snapshot of the failed step: the next one is due in every_n_steps
        return choice


def _reshard(pl_module: pl.LightningModule) -> None:
    """Put FSDP2 modules back in their sharded state after a forward-only replay (no backward reshards the ones
    that keep their parameters gathered after forward, such as the root)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return
    for module in pl_module.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def _training_step_loss(pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> torch.Tensor | None:
    """``training_step`` once more, on an :func:`unlogged_copy` of the module (the replay must not log or sync)."""
    outputs = unlogged_copy(pl_module).training_step(batch, batch_idx)
    if isinstance(outputs, torch.Tensor):
        return outputs
    if isinstance(outputs, dict) and isinstance(outputs.get("loss"), torch.Tensor):
        return outputs["loss"]
    loss, _ = extract_loss(outputs)
    return loss
