"""The driver: one per trainer, what every lightning_diag callback attached to it shares (issue 43).

A :class:`Driver` holds the trainer's session (:class:`~lightning_diag.callbacks.common.session.DiagSession`: the
run's folder, writer, alert log), its step axis (:class:`~lightning_diag.callbacks.common.step_axis.StepAxis`), the
measurements the attached callbacks requested for the current step
(:class:`~lightning_diag.callbacks.common.shared.SharedMeasurements`: computed once, whichever callback reads them
first) and the ordered list of the callbacks attached to it. A callback attaches in ``setup`` (:func:`attach`) and
detaches in ``teardown``; the driver lives as long as the trainer (a second ``fit`` on the same trainer continues
its step axis).

Once per training batch the driver moves the step axis and decides, for every attached callback, whether the batch
is on its logging cadence (:meth:`Driver.batch_started`, set as each callback's ``on_cadence``): the first attached
callback whose ``on_train_batch_start`` runs in the batch (the driver calls them in ``trainer.callbacks`` order
during a fit) triggers it, and the others read the decision: a callback whose :attr:`Driver.batches` count has
moved since its last batch start knows the batch is decided. The same decision names the shared measurements
requested for the batch: those of the callbacks on their cadence (their ``shared_requests``). The epoch's start is
the same (:meth:`Driver.epoch_started`, once per epoch).

During a fit the driver owns the Lightning hooks of
:data:`~lightning_diag.callbacks.common.batch_hooks.DISPATCHED_HOOKS` (the training batch, epoch and validation
hooks): from ``on_fit_start`` the first attached callback in
``trainer.callbacks`` order is the *host* (:attr:`Driver.host`). Lightning dispatches those hooks to the host only
(each one it holds on its instance is the driver's call of every attached callback's own hook, in list order);
on the other attached callbacks they are ``None`` on their own instances, which Lightning skips
(:mod:`lightning_diag.callbacks.common.batch_hooks`). A callback's quiet batches switch its part off in the driver
(:meth:`Driver.switch`), and a hook no callback runs in the batch is ``None`` on the host too. ``SystemMonitor``
times each part the driver calls (:meth:`Driver.time_parts`): no timer is put on any instance. The hooks are
given back at ``teardown`` (and at the first ``on_exception``, for every callback; a driver that still hosts a callback
set up on another trainer gives them back then, :meth:`Driver.release`); a callback detached in the middle of a fit
hands the hosting to the next one. A hook set to ``None`` on an instance before the fit has no part. User code must
not read, call or wrap these hook attributes of ours during a fit.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterable
from typing import Any, ClassVar, Protocol

import pytorch_lightning as pl
import torch

from lightning_diag.callbacks.common.batch_hooks import DISPATCHED_HOOKS
from lightning_diag.callbacks.common.reduction import (
    FitReduction,
    Reduced,
    SavedPart,
    reduce_saved,
    reduce_states,
)
from lightning_diag.callbacks.common.session import DiagSession, ThresholdSource, run_log_dir
from lightning_diag.callbacks.common.shared import NOTHING, Shared, SharedMeasurements, step_loss_shared
from lightning_diag.callbacks.common.step_axis import STEP_AXIS_KEY, StepAxis
from lightning_diag.instrument.forward_hooks import ForwardHooks

__all__ = ["AttachedCallback", "Driver", "PartWrap", "attach", "driver_of", "forward_hooks_of"]

#: What the driver calls for one callback's hook: ``wrap(callback, hook, part)`` returns the callable to call in
#: place of ``part`` (``SystemMonitor``'s timer of it, or ``part`` itself).
PartWrap = Callable[[Any, str, Callable[..., Any]], Callable[..., Any]]


class AttachedCallback(ThresholdSource, Protocol):
    """What the driver reads and sets on an attached callback (a
    :class:`~lightning_diag.callbacks.common.base.DiagCallback`)."""

    #: Whether the current training batch is on the callback's logging cadence: set by :meth:`Driver.batch_started`.
    on_cadence: bool
    #: The shared measurements the callback reads on the steps of its cadence (computed once for every reader).
    shared_requests: ClassVar[frozenset[Shared]]

    def every_n_steps(self, trainer: pl.Trainer) -> int:
        """The callback's logging interval."""
        ...


class Driver:
    """What is per trainer: the session, the step axis, the step's measurements and the attached callbacks.

    Attributes:
        step_axis: The user's step axis (one per trainer, kept across fits; saved once per checkpoint under
            :data:`~lightning_diag.callbacks.common.step_axis.STEP_AXIS_KEY`, :meth:`save_axis`).
        shared: The shared measurements requested for the current batch, and their values once computed
            (:class:`~lightning_diag.callbacks.common.shared.SharedMeasurements`).
        session: The session of the current run folder, while a callback is attached; else ``None``.
        callbacks: The attached callbacks, in ``trainer.callbacks`` order from ``on_fit_start`` (before: the order
            they attached in, which is Lightning's ``setup`` order, the same).
        batches: The training batches decided so far (:meth:`batch_started`): a callback that finds it where it
            was at its own last batch start is the first of the batch, and calls :meth:`batch_started`.
    """

    def __init__(self) -> None:
        self.step_axis = StepAxis()
        self.shared = SharedMeasurements()
        self.session: DiagSession | None = None
        self.callbacks: list[AttachedCallback] = []
        self.batches = 0
        self._epoch: tuple[int, int] | None = None  # (epoch, global step) of the last epoch start
        #: The callback Lightning dispatches the :data:`DISPATCHED_HOOKS` to during a fit (``None``: no fit).
        self.host: AttachedCallback | None = None
        #: What ``SystemMonitor`` wraps each part in (its timer), or ``None``.
        self.part_wrap: PartWrap | None = None
        #: What an attention recorder's methods are wrapped in (``SystemMonitor``'s timer), or ``None``.
        self.recorder_timing: Callable[[Callable[..., Any]], Callable[..., Any]] | None = None
        # while hosting: each attached callback, with the dispatched hooks its instance held (a callable put there
        # by someone else: it runs in place of the class's hook) ...
        self._held: dict[int, tuple[AttachedCallback, dict[str, Any]]] = {}
        # ... each callback's part of each hook (built when first needed), and the hooks switched off by callback
        self._parts: dict[tuple[int, str], Callable[..., Any]] | None = None
        self._off: dict[int, frozenset[str]] = {}
        self._loaded_axis: dict[str, Any] | None = None  # the axis state last resumed from (once per checkpoint)
        # the callback entries of the checkpoint last reduced (once per checkpoint; held, so that no later
        # checkpoint's entries can be taken for it): by design this keeps the last checkpoint's callbacks dict
        # alive until the next checkpoint (or the driver) replaces it
        self._reduced: dict[str, Any] | None = None
        # the point of the fit last reduced (`reduce_at`) and its merged values: once per point for every callback
        self._point: tuple[tuple[str, int, int, int], Reduced] | None = None
        # the attached callbacks grouped by logging interval, read at the fit's first batch
        self._cadence: list[_Interval] | None = None

    def attach(self, trainer: pl.Trainer, callback: AttachedCallback) -> DiagSession:
        """Attach ``callback`` (from its ``setup``, on every rank: :func:`run_log_dir` broadcasts from rank zero).

        Returns:
            The session of the trainer's current run folder (a new one when there is none or the folder changed),
            with one more user.
        """
        log_dir = run_log_dir(trainer)
        session = self.session
        if session is None or session.log_dir != log_dir:
            session = self.session = DiagSession(log_dir, trainer, trainer.is_global_zero, self.step_axis)
        session.users += 1
        if not any(cb is callback for cb in self.callbacks):
            self.callbacks.append(callback)
            self._changed()
        return session

    def detach(self, callback: AttachedCallback, session: DiagSession) -> None:
        """Detach ``callback``, a user of ``session`` (from its ``teardown``): each detach flushes the session's
        writer, the last user closes the session."""
        kept = [cb for cb in self.callbacks if cb is not callback]
        if len(kept) != len(self.callbacks):
            hosting = self.host is not None
            self._unhost()
            self.callbacks = kept
            self._off.pop(id(callback), None)
            self._changed()
            if hosting and kept:  # detached in the middle of a fit: the next callback hosts the others
                self._host()
        session.users -= 1
        if session.users <= 0:
            session.close()
            if self.session is session:
                self.session = None
        else:
            session.flush()

    def start_fit(self, trainer: pl.Trainer) -> None:
        """A fit starts (every attached callback's ``on_fit_start``; the first call does the work): fix the order
        of :attr:`callbacks` to ``trainer.callbacks``' and let the session record the thresholds in effect
        (:meth:`DiagSession.start_fit`)."""
        order = {id(cb): i for i, cb in enumerate(trainer.callbacks)}  # type: ignore[attr-defined]
        ordered = sorted(self.callbacks, key=lambda cb: order.get(id(cb), len(order)))
        if any(a is not b for a, b in zip(ordered, self.callbacks, strict=True)):
            self.callbacks = ordered
            self._changed()
        if self.callbacks and (
            self.host is not self.callbacks[0] or any(id(cb) not in self._held for cb in self.callbacks)
        ):
            self._unhost()
            self._host()
        self.shared.clear()
        self._point = None
        self.shared.loss_shared = step_loss_shared(trainer)
        if self.session is not None:
            self.session.start_fit(trainer, self.callbacks)

    # -- the step loss ---------------------------------------------------------------------------------------
    def offer_loss(self, value: float) -> None:
        """The current batch's training loss on the host, read by a callback in a host copy it made anyway (see
        :meth:`SharedMeasurements.offer_loss`): its later readers in the batch take it (:meth:`step_loss`)."""
        self.shared.offer_loss(self.batches, value)

    def step_loss(self) -> float | None:
        """The current batch's training loss on the host when a callback offered it (:meth:`offer_loss`), else
        ``None`` (the caller reads its own)."""
        return self.shared.step_loss(self.batches)

    # -- checkpoint state -----------------------------------------------------------------------------------
    def save_axis(self, checkpoint: dict[str, Any]) -> None:
        """Write the step axis into ``checkpoint`` under its top-level :data:`STEP_AXIS_KEY`, once (the first
        attached callback's ``on_save_checkpoint`` of the checkpoint; the others find it written)."""
        if STEP_AXIS_KEY not in checkpoint:
            checkpoint[STEP_AXIS_KEY] = self.step_axis.state_dict()

    def save_reduced(
        self, trainer: pl.Trainer, checkpoint: dict[str, Any], parts: Iterable[SavedPart], device: torch.device
    ) -> None:
        """Write what all ranks know of the declared state of the trainer's callbacks into ``checkpoint``, once (the
        first of them whose ``on_save_checkpoint`` runs with several ranks; the others find it done).

        Lightning fills ``checkpoint["callbacks"]`` from every callback's ``state_dict()`` before it calls any
        ``on_save_checkpoint``, so the first call merges every callback's part together
        (:func:`~lightning_diag.callbacks.common.reduction.reduce_saved`: one collective per reduction kind for all
        of them).

        Args:
            trainer: Its strategy communicates.
            checkpoint: The checkpoint being built.
            parts: The declared objects of every callback this driver serves (read only by the first call).
            device: Where the collectives run (the module's device).
        """
        saved = checkpoint.get("callbacks")
        if saved is None or saved is self._reduced:
            return
        self._reduced = saved
        reduce_saved(trainer, saved, parts, device)

    # -- reductions during the fit ----------------------------------------------------------------------------
    def reduce_at(self, trainer: pl.Trainer, point: str, device: torch.device) -> Reduced:
        """The values over all ranks of what every attached callback reduces at one ``point`` of the fit
        (``"epoch_end"``, ``"window"``, ``"validation_end"``), in one collective per reduction kind for all of them
        (:func:`~lightning_diag.callbacks.common.reduction.reduce_states`); the first callback asking at the point
        reduces, the others get the same results.

        Each attached callback with a ``fit_reductions(trainer, point)`` method names its ``(state, names)`` pairs
        there (it must hand on anything it still holds first: another callback may reduce for it). Every rank
        decides them from what all ranks know alike (counts, steps, settings), so every rank runs the same
        collectives. With one process nothing is asked or reduced (each callback reads its own values).

        Returns:
            The merged values of each pair by ``(id(state), names)`` (an empty mapping with one process).
        """
        if trainer.world_size <= 1:
            return {}
        key = (point, self.batches, trainer.global_step, trainer.current_epoch)
        if self._point is not None and self._point[0] == key:
            return self._point[1]
        requests: list[FitReduction] = []
        for cb in self.callbacks:
            ask = getattr(cb, "fit_reductions", None)
            if ask is not None:
                requests += ask(trainer, point)
        merged = reduce_states(trainer, [(state, names) for state, names in requests], device) if requests else []
        values = {(id(state), tuple(names)): value for (state, names), value in zip(requests, merged, strict=True)}
        self._point = (key, values)
        return values

    def load_axis(self, checkpoint: dict[str, Any]) -> None:
        """Resume the step axis from ``checkpoint``'s :data:`STEP_AXIS_KEY`, once per checkpoint (nothing when it
        has none: a checkpoint written without lightning_diag)."""
        state = checkpoint.get(STEP_AXIS_KEY)
        if state is not None and state is not self._loaded_axis:
            self._loaded_axis = state
            self.step_axis.load_state_dict(state)

    # -- the hooks -------------------------------------------------------------------------------------------
    def hosts(self, callback: AttachedCallback) -> bool:
        """Whether the driver dispatches ``callback``'s hooks (from ``on_fit_start`` to its ``teardown``)."""
        return id(callback) in self._held

    def runs(self, callback: AttachedCallback, hook: str) -> bool:
        """Whether the driver calls ``callback``'s ``hook`` on the current batch (not switched off, and defined).

        Read by the tests and benchmarks (what a quiet batch runs); the fit itself never asks."""
        if not self.hosts(callback):
            return False
        parts = self._built_parts()
        return hook not in self._off.get(id(callback), ()) and (id(callback), hook) in parts

    def switch(self, callback: AttachedCallback, hooks: Iterable[str], *, off: bool) -> bool:
        """Switch ``callback``'s part of ``hooks`` off (a quiet batch: the driver skips it) or back on.

        Returns:
            ``False`` when the driver does not dispatch ``callback``'s hooks (the callback switches its own).
        """
        if not self.hosts(callback):
            return False
        hooks = tuple(hooks)
        current = self._off.get(id(callback), frozenset())
        self._off[id(callback)] = current | frozenset(hooks) if off else current - frozenset(hooks)
        self._refresh(hooks)
        return True

    def time_parts(
        self,
        wrap: PartWrap | None,
        recorder: Callable[[Callable[..., Any]], Callable[..., Any]] | None = None,
    ) -> None:
        """Call each part through ``wrap(callback, hook, part)`` from now on (``SystemMonitor``'s timer; ``None``:
        the parts themselves), and have the attention recorders timed by ``recorder``."""
        self.part_wrap = wrap
        self.recorder_timing = recorder
        self._parts = None
        if self.host is not None:
            self._refresh(DISPATCHED_HOOKS)

    def release(self) -> None:
        """Give every hosted callback its dispatched hooks back (what its instance held before, else its class's).

        ``teardown`` and ``on_exception`` do it; a callback set up on another trainer calls it on the driver that
        still hosts it (a fit that ended without either: a user callback's ``on_exception`` raised before ours, a
        subclass's ``teardown`` without ``super()``), so that no call of this driver stays on an instance.
        """
        self._unhost()

    def _host(self) -> None:
        """Make the first attached callback the host: every attached callback's dispatched hooks ``None`` on its
        instance (what it held kept for :meth:`_unhost`, a ``None`` included: that hook has no part), the host's
        set to the driver's calls. A call this or another driver put there (a stale one) is not kept."""
        if not self.callbacks:
            return
        for cb in self.callbacks:
            self._held[id(cb)] = (
                cb,
                {h: vars(cb)[h] for h in DISPATCHED_HOOKS if h in vars(cb) and not _is_driver_call(vars(cb)[h], h)},
            )
            for hook in DISPATCHED_HOOKS:
                vars(cb)[hook] = None
        self.host = self.callbacks[0]
        self._parts = None
        self._refresh(DISPATCHED_HOOKS)

    def _unhost(self) -> None:
        """Give every callback its hooks back (what its instance held, else its class's)."""
        for cb, held in self._held.values():
            for hook in DISPATCHED_HOOKS:
                if hook in held:
                    vars(cb)[hook] = held[hook]
                else:
                    vars(cb).pop(hook, None)
        self._held = {}
        self._parts = None
        self.host = None

    def _built_parts(self) -> dict[tuple[int, str], Callable[..., Any]]:
        """Each hosted callback's part of each dispatched hook it defines: a callable its instance held, else its
        class's own hook (not one inherited from Lightning's ``Callback``, a no-op), through :attr:`part_wrap`."""
        parts = self._parts
        if parts is None:
            parts = self._parts = {}
            wrap = self.part_wrap
            for cb, held in self._held.values():
                for hook in DISPATCHED_HOOKS:
                    if hook in held and held[hook] is None:  # switched off on the instance: no part
                        continue
                    part = held.get(hook)
                    if part is None:
                        impl = getattr(type(cb), hook, None)
                        if impl is None or impl is getattr(pl.Callback, hook):
                            continue
                        part = impl.__get__(cb, type(cb))
                        if wrap is not None:
                            part = _mark(wrap(cb, hook, part))
                    parts[(id(cb), hook)] = part
        return parts

    def _refresh(self, hooks: Iterable[str]) -> None:
        """Set each of ``hooks`` on the host: ``None`` when no callback runs it, the one part that runs, or a call
        of every part that runs in list order."""
        host = self.host
        if host is None:
            return
        parts = self._built_parts()
        off = self._off
        for hook in hooks:
            calls = tuple(
                part
                for cb in self.callbacks
                if hook not in off.get(id(cb), ()) and (part := parts.get((id(cb), hook))) is not None
            )
            vars(host)[hook] = None if not calls else calls[0] if len(calls) == 1 else _dispatch(calls)

    def _changed(self) -> None:
        self._cadence = None
        self._epoch = None

    def batch_started(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch_idx: int) -> bool:
        """A training batch starts (the first attached callback's ``on_train_batch_start`` in the batch): move the
        step axis, count the batch in :attr:`batches` and set every attached callback's ``on_cadence``: whether
        :attr:`StepAxis.cadence_step <lightning_diag.callbacks.common.step_axis.StepAxis.cadence_step>` is a
        multiple of its logging interval (``every_n_steps(trainer)``, read once per fit); the batch's requested
        shared measurements are those of the callbacks on their cadence (:attr:`shared`).

        Returns:
            Whether this call decided (``False``: a second call in the same batch, which changes nothing).
        """
        axis = self.step_axis
        cadence = self._cadence
        if not axis.batch_started(trainer, pl_module, batch_idx) and cadence is not None:
            return False
        self.batches += 1
        if cadence is None:
            groups: dict[int, list[AttachedCallback]] = {}
            for cb in self.callbacks:
                groups.setdefault(cb.every_n_steps(trainer), []).append(cb)
            cadence = self._cadence = [_Interval(every, callbacks) for every, callbacks in groups.items()]
        count = axis.stepped + 1  # `axis.cadence_step`, without the property
        requested = NOTHING
        for interval in cadence:
            on = count % interval.every == 0
            if on is not interval.on:  # set only when it changes (a quiet run's batches leave it)
                interval.on = on
                for cb in interval.callbacks:
                    cb.on_cadence = on
            if on and interval.requests:
                requested = requested | interval.requests if requested else interval.requests
        if requested is not self.shared.requested:
            self.shared.decide(requested)
        return True

    def epoch_started(self, trainer: pl.Trainer) -> None:
        """A training epoch starts (every attached callback's ``on_train_epoch_start``; the first call of the epoch
        does the work): move the step axis past the previous epoch's last batch."""
        epoch = (trainer.current_epoch, trainer.global_step)
        if epoch != self._epoch:
            self._epoch = epoch
            self.step_axis.epoch_started(trainer)


def _dispatch(calls: tuple[Callable[..., Any], ...]) -> Callable[..., None]:
    """One hook's call of ``calls``, in order (what Lightning calls on the host)."""

    def dispatch(*args: Any, **kwargs: Any) -> None:
        for call in calls:
            call(*args, **kwargs)

    return _mark(dispatch)


#: The callables a driver put on a host's instance (:func:`_dispatch`'s, the timed parts), held weakly.
_DRIVER_CALLS: weakref.WeakSet[Callable[..., Any]] = weakref.WeakSet()


def _mark(call: Callable[..., Any]) -> Callable[..., Any]:
    """``call``, known as a driver's from now on (when it can be referenced weakly: a bound method is told apart by
    :func:`_is_driver_call` otherwise)."""
    with contextlib.suppress(TypeError):
        _DRIVER_CALLS.add(call)
    return call


def _is_driver_call(value: Any, hook: str) -> bool:
    """Whether ``value``, found on an instance's ``hook``, is a call a driver put there: a known one, or an attached
    callback's own class hook ``hook`` bound to it (a host's single part). Never kept as held by :meth:`Driver._host`.
    """
    if value in _DRIVER_CALLS:
        return True
    owner = getattr(value, "__self__", None)
    func = getattr(value, "__func__", None)
    return owner is not None and func is not None and func is getattr(type(owner), hook, None)


class _Interval:
    """The attached callbacks of one logging interval, the shared measurements they request on it, and the cadence
    last set on them (``None``: not yet)."""

    __slots__ = ("callbacks", "every", "on", "requests")

    def __init__(self, every: int, callbacks: list[AttachedCallback]) -> None:
        self.every = every
        self.callbacks = callbacks
        self.requests = frozenset().union(*(cb.shared_requests for cb in callbacks))
        self.on: bool | None = None


_DRIVERS: weakref.WeakKeyDictionary[pl.Trainer, Driver] = weakref.WeakKeyDictionary()


def driver_of(trainer: pl.Trainer) -> Driver | None:
    """The trainer's driver, once a lightning_diag callback attached to it; else ``None``."""
    return _DRIVERS.get(trainer)


def forward_hooks_of(trainer: pl.Trainer) -> ForwardHooks | None:
    """The forward hooks the trainer's driver owns (one pre-hook and one forward hook per module for every watch of a
    hooked step); ``None`` without a driver (a watch then hooks the modules through a set of its own)."""
    driver = _DRIVERS.get(trainer)
    return None if driver is None else driver.shared.hooks


def attach(trainer: pl.Trainer, callback: AttachedCallback) -> Driver:
    """Attach ``callback`` to the trainer's driver (created at the first call for a trainer, kept while the trainer
    lives); its :attr:`Driver.session` is then the session the callback writes to (:meth:`Driver.attach`)."""
    driver = _DRIVERS.get(trainer)
    if driver is None:
        driver = _DRIVERS[trainer] = Driver()
    driver.attach(trainer, callback)
    return driver
