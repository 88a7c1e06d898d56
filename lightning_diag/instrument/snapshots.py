"""In-memory snapshots for ``AnomalyAlarm(on_nonfinite="rollback")``: take them cheaply, restore them exactly.

A snapshot holds what a resume needs: the model's ``state_dict`` (parameters and buffers), every optimizer's state,
every LR scheduler's state, the AMP GradScaler's state and an opaque ``extra`` mapping (the alarm's own state).
Tensors are copied to the CPU (``device="cpu"``, the default: no accelerator memory is used) or cloned on their
own device (``device="device"``: faster, costs accelerator memory). Copies from an accelerator to the CPU are
``non_blocking``: the host does not wait for them; a CUDA event marks when they are complete and a restore waits
for it.

The store also watches the training loss on the device (a ring of the last ``loss_window`` step losses and the
mean since the previous snapshot, no host read) to mark each snapshot *spiking* when the mean loss since the
previous snapshot was above ``spike_factor`` times the running median: such snapshots are not trusted
(:mod:`lightning_diag.rules.rollback`).

Sharded models (FSDP2 ``fully_shard``, tensor parallelism, FSDP1; :func:`~lightning_diag.instrument.sharding.
is_sharded_module`): each rank copies its own shards only, with no collective. The snapshot holds the local tensor of
every parameter and buffer (``DTensor.to_local()``; FSDP1's flat parameters are local already) and of every
optimizer state entry, plus each param group's hyperparameters; a restore copies them back **in place** into the
same local tensors (``copy_``), so placements, FSDP's sharded storage and the optimizer's references are untouched,
and the state is bitwise the snapshot's. ``module.state_dict()`` is not used there: under FSDP1 it all-gathers
full tensors by default, and under every sharding a rank needs nothing but its own shards. Optimizer state that
did not exist at the snapshot (taken before the first step) is removed on restore, as in a fresh optimizer.

Nothing here imports Lightning; the callback hands in the objects.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch
from torch import nn

from lightning_diag.instrument.sharding import is_sharded_module, reshard_fsdp
from lightning_diag.stats.grad import is_dtensor, local_tensor

__all__ = ["DEFAULT_LOSS_WINDOW", "RollbackDevice", "Snapshot", "SnapshotStore"]

RollbackDevice = Literal["cpu", "device"]
#: Step losses the running median of the trust test is taken over.
DEFAULT_LOSS_WINDOW = 200


def _copy_tree(obj: Any, device: torch.device | str | None) -> Any:
    """A deep copy whose tensors are fresh copies (on ``device``, or on their own device for ``None``)."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        if device is None or torch.device(device) == t.device:
            return t.clone()
        return t.to(device, copy=True, non_blocking=True)
    if isinstance(obj, Mapping):
        return {k: _copy_tree(v, device) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_copy_tree(v, device) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_copy_tree(v, device) for v in obj)
    return copy.deepcopy(obj)


def _tree_bytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, Mapping):
        return sum(_tree_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tree_bytes(v) for v in obj)
    return 0


def _local_copy(t: torch.Tensor, device: torch.device | str | None) -> torch.Tensor:
    return _copy_tree(local_tensor(t.detach()), device)


def _sharded_model_state(module: nn.Module, device: torch.device | str | None) -> dict[str, torch.Tensor]:
    """Each parameter's and buffer's local shard, copied (no collective)."""
    reshard_fsdp(module)
    state = {name: _local_copy(p, device) for name, p in module.named_parameters()}
    state.update({name: _local_copy(b, device) for name, b in module.named_buffers()})
    return state


def _sharded_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device | str | None) -> dict[str, Any]:
    """The local shard of every optimizer state tensor by (group, index in group), and the groups' settings."""
    state: dict[tuple[int, int], dict[str, Any]] = {}
    for g, group in enumerate(optimizer.param_groups):
        for i, p in enumerate(group["params"]):
            entry = optimizer.state.get(p)
            if entry:
                state[(g, i)] = {
                    k: _local_copy(v, device) if isinstance(v, torch.Tensor) else copy.deepcopy(v)
                    for k, v in entry.items()
                }
    groups = [{k: copy.deepcopy(v) for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    return {"sharded": True, "state": state, "param_groups": groups}


def _as_param_layout(local: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """A saved local shard as a tensor laid out like ``param`` (a DTensor with its placements, if it is one)."""
    if not is_dtensor(param) or local.dim() == 0 or local.shape != local_tensor(param).shape:
        return local.to(local_tensor(param).device) if local.dim() else local
    from torch.distributed.tensor import DTensor

    dt: Any = param
    return DTensor.from_local(local.to(local_tensor(param).device), dt.device_mesh, dt.placements,
                              shape=param.shape, stride=param.stride())


def _restore_sharded_model(module: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    reshard_fsdp(module)
    with torch.no_grad():
        for name, t in [*module.named_parameters(), *module.named_buffers()]:
            local_tensor(t).copy_(state[name])


def _restore_sharded_optimizer(optimizer: torch.optim.Optimizer, saved: Mapping[str, Any]) -> None:
    with torch.no_grad():
        for g, group in enumerate(optimizer.param_groups):
            for i, p in enumerate(group["params"]):
                entry = saved["state"].get((g, i))
                if entry is None:
                    optimizer.state.pop(p, None)
                    continue
                current = optimizer.state.setdefault(p, {})
                for k in list(current):
                    if k not in entry:
                        del current[k]
                for k, v in entry.items():
                    now = current.get(k)
                    if isinstance(v, torch.Tensor) and isinstance(now, torch.Tensor):
                        local_tensor(now).copy_(v)
                    elif isinstance(v, torch.Tensor):  # an entry gone since: re-created from the saved shard
                        current[k] = _as_param_layout(v.clone(), p)
                    else:
                        current[k] = copy.deepcopy(v)
            for k, v in saved["param_groups"][g].items():
                group[k] = copy.deepcopy(v)


@dataclasses.dataclass
class Snapshot:
    """One saved training state.

    Attributes:
        step: The global step (optimizer steps done) the state belongs to.
        model: ``module.state_dict()``, copied (sharded models: each parameter's and buffer's local shard).
        optimizers: Each optimizer's ``state_dict()``, copied (sharded models: the local shards of its state).
        schedulers: Each LR scheduler's ``state_dict()``, copied.
        scaler: The GradScaler's ``state_dict()``, or ``None``.
        extra: Whatever the caller added (the alarm's state).
        spiking: A 0-dim bool tensor on the training device: the loss was spiking when it was taken.
        ready: A CUDA event recorded after the copies were queued, or ``None`` (copies already complete).
    """

    step: int
    model: dict[str, torch.Tensor]
    optimizers: list[dict[str, Any]]
    schedulers: list[dict[str, Any]]
    scaler: dict[str, Any] | None
    extra: dict[str, Any]
    spiking: torch.Tensor
    ready: Any = None
    sharded: bool = False

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data held."""
        return _tree_bytes(self.model) + _tree_bytes(self.optimizers)

    def wait(self) -> None:
        """Block until the (non-blocking) copies are complete."""
        if self.ready is not None:
            self.ready.synchronize()
            self.ready = None


class SnapshotStore:
    """Keeps the newest ``keep`` snapshots and judges which ones the loss was spiking at.

    Args:
        keep: Snapshots kept (the oldest is dropped when a new one is taken).
        device: ``"cpu"`` (copies offloaded to host memory) or ``"device"`` (clones on the training device).
        spike_factor: A snapshot is spiking when the mean loss since the previous one is above this multiple of
            the running median of the step losses.
        loss_window: Step losses the running median is taken over.

    Example:
        >>> net = nn.Linear(2, 1)
        >>> store = SnapshotStore(keep=2)
        >>> store.take(0, net, [], [], None)
        >>> with torch.no_grad():
        ...     _ = net.weight.add_(1.0)
        >>> _ = store.restore(0, net, [], [], None)
        >>> torch.equal(net.weight, store.get(0).model["weight"])
        True
    """

    def __init__(
        self,
        keep: int = 3,
        device: RollbackDevice = "cpu",
        spike_factor: float = 3.0,
        loss_window: int = DEFAULT_LOSS_WINDOW,
    ) -> None:
        self.keep = keep
        self.device = device
        self.spike_factor = float(spike_factor)
        self.loss_window = loss_window
        self.snapshots: list[Snapshot] = []
        self._losses: torch.Tensor | None = None
        self._seen = 0
        self._interval_count = 0

    # -- the loss -----------------------------------------------------------------------------------------
    def observe_loss(self, loss: torch.Tensor) -> None:
        """Record one step's loss (a 0-dim tensor) on its device: one copy into the ring, no host read."""
        value = loss.detach().reshape(())
        if self._losses is None or self._losses.device != value.device:
            self._losses = torch.full((self.loss_window,), float("nan"), device=value.device)
            self._interval_count = 0
        self._losses[self._seen % self.loss_window] = value
        self._seen += 1
        self._interval_count += 1

    def _spiking(self, fallback_device: torch.device) -> torch.Tensor:
        count = min(self._interval_count, self.loss_window)
        self._interval_count = 0
        if self._losses is None or count == 0:
            return torch.zeros((), dtype=torch.bool, device=fallback_device)
        ring = self._losses
        recent = ring[torch.arange(self._seen - count, self._seen, device=ring.device) % self.loss_window]
        finite = torch.isfinite(recent)
        mean = torch.where(finite, recent, torch.zeros_like(recent)).sum() / finite.sum().clamp(min=1)
        median = torch.nanmedian(torch.where(torch.isfinite(ring), ring, torch.full_like(ring, float("nan"))))
        return torch.isfinite(median) & (mean > self.spike_factor * median.abs())

    # -- snapshots ----------------------------------------------------------------------------------------
    def take(
        self,
        step: int,
        module: nn.Module,
        optimizers: Sequence[torch.optim.Optimizer],
        schedulers: Sequence[Any],
        scaler: Any,
        extra: Mapping[str, Any] | None = None,
    ) -> None:
        """Copy the training state at ``step`` (a snapshot at the same step replaces the older one)."""
        params = list(module.parameters())
        source = params[0].device if params else torch.device("cpu")
        target: torch.device | str | None = "cpu" if self.device == "cpu" else None
        # Queued before the non-blocking copies below: the spike flag stays on the device and the scaler's
        # state (``get_scale()`` reads back under fp16 AMP) must not wait for the snapshot's own copies.
        spiking = self._spiking(source)
        scaler_state = copy.deepcopy(scaler.state_dict()) if scaler is not None else None
        sharded = is_sharded_module(module)
        if sharded:
            model = _sharded_model_state(module, target)
            opt_states = [_sharded_optimizer_state(opt, target) for opt in optimizers]
        else:
            model = _copy_tree(module.state_dict(), target)
            opt_states = [_copy_tree(opt.state_dict(), target) for opt in optimizers]
        snap = Snapshot(
            step=step,
            model=model,
            optimizers=opt_states,
            schedulers=[copy.deepcopy(s.state_dict()) for s in schedulers],
            scaler=scaler_state,
            extra=copy.deepcopy(dict(extra or {})),
            spiking=spiking,
            sharded=sharded,
        )
        if source.type == "cuda" and target == "cpu":
            snap.ready = torch.cuda.Event()
            snap.ready.record()
        self.snapshots = [s for s in self.snapshots if s.step != step] + [snap]
        if len(self.snapshots) > self.keep:
            self.snapshots = self.snapshots[-self.keep :]

    def steps(self) -> list[int]:
        """The steps of the kept snapshots, oldest first."""
        return [s.step for s in self.snapshots]

    def trusted(self) -> list[bool]:
        """Whether each kept snapshot was taken while the loss was calm (one host read: failure path only)."""
        if not self.snapshots:
            return []
        flags = torch.stack([s.spiking.to(self.snapshots[0].spiking.device) for s in self.snapshots]).tolist()
        return [not f for f in flags]

    def get(self, step: int) -> Snapshot:
        """The snapshot of ``step``.

        Raises:
            KeyError: If no kept snapshot has that step.
        """
        for snap in self.snapshots:
            if snap.step == step:
                return snap
        raise KeyError(f"no snapshot of step {step} (kept: {self.steps()})")

    def drop_after(self, step: int) -> None:
        """Discard the snapshots taken after ``step``."""
        self.snapshots = [s for s in self.snapshots if s.step <= step]

    def restore(
        self,
        step: int,
        module: nn.Module,
        optimizers: Sequence[torch.optim.Optimizer],
        schedulers: Sequence[Any],
        scaler: Any,
    ) -> dict[str, Any]:
        """Put the snapshot of ``step`` back in place; return its ``extra`` mapping.

        Parameters are copied in place (optimizers keep referring to the same tensors); optimizer states are
        loaded from fresh copies, so the snapshot itself stays intact for a later rollback.

        Raises:
            KeyError: If no kept snapshot has that step.
        """
        snap = self.get(step)
        snap.wait()
        if snap.sharded:
            _restore_sharded_model(module, snap.model)
            for opt, state in zip(optimizers, snap.optimizers, strict=True):
                _restore_sharded_optimizer(opt, state)
        else:
            module.load_state_dict(snap.model)
            for opt, state in zip(optimizers, snap.optimizers, strict=True):
                opt.load_state_dict(_copy_tree(state, None))
        for sched, state in zip(schedulers, snap.schedulers, strict=True):
            sched.load_state_dict(copy.deepcopy(state))
        if scaler is not None and snap.scaler is not None:
            scaler.load_state_dict(copy.deepcopy(snap.scaler))
        # The trust test starts afresh from the restored state.
        self._interval_count = 0
        return copy.deepcopy(snap.extra)

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data held by all kept snapshots."""
        return sum(s.nbytes for s in self.snapshots)
