"""DiagCallback, the base of every lightning_diag callback: declared rules, their checkpoint state, alerts, notices.

What is per trainer (the session: writer, alert log, run folder; the user's step axis; the step's measurements; the
per-batch cadence decision) is the trainer's driver, :mod:`lightning_diag.callbacks.common.driver`.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import pytorch_lightning as pl
import torch
from pytorch_lightning.trainer.states import TrainerFn

from lightning_diag.callbacks.common.batch_hooks import inherited_batch_hooks, switch_off, switch_on
from lightning_diag.callbacks.common.driver import Driver
from lightning_diag.callbacks.common.driver import attach as _attach
from lightning_diag.callbacks.common.outputs import extract_loss
from lightning_diag.callbacks.common.preset import DeclaredDetectors
from lightning_diag.callbacks.common.reduction import SavedPart, reduce_saved
from lightning_diag.callbacks.common.session import DiagSession
from lightning_diag.callbacks.common.shared import NOTHING, Shared
from lightning_diag.core.alerts import Alert
from lightning_diag.core.log_handler import ensure_handler
from lightning_diag.core.registry import ParsedRules, RuleChoices, default, owner_name, parse_rules, registry_thresholds
from lightning_diag.core.tags import threshold_tag
from lightning_diag.core.validation import check_callable, check_int
from lightning_diag.instrument.grad_measure import GradientSquares
from lightning_diag.output.writer import DiagWriter
from lightning_diag.rules.base import StepContext
from lightning_diag.stats.reduced import ReducedState

__all__ = ["AlertHandler", "DiagCallback", "RuleChoices", "extract_loss"]

#: ``on_alert=``: called with each :class:`~lightning_diag.core.alerts.Alert` as it is recorded (global rank zero).
AlertHandler = Callable[[Alert], object]

log = logging.getLogger("lightning_diag")


class _StateKey:
    """:attr:`DiagCallback.state_key`: :meth:`DiagCallback.checkpoint_key`, unless the instance holds the key (a
    non-data descriptor: an instance attribute of the same name wins, with no call)."""

    def __get__(self, obj: DiagCallback | None, objtype: type | None = None) -> Any:
        return self if obj is None else obj.checkpoint_key()


class DiagCallback(DeclaredDetectors, pl.Callback):
    """Base of the library's callbacks.

    A subclass declares its detectors once, as its :attr:`preset` (:mod:`lightning_diag.callbacks.common.preset`)::

        preset = Preset("GradientFlowMonitor", (Detector(GradBandRule, "band_rule", "band"), ...))

    and builds them in its constructor with ``self.add_preset()`` (the torchmetrics ``add_state`` pattern, one
    level up; :class:`~lightning_diag.callbacks.common.preset.DeclaredDetectors`). From that declaration the base
    class derives:
    :meth:`state_dict` / :meth:`load_state_dict` (each rule's state under its ``state_key``, a missing key
    named), the fresh rules of a new fit (rebuilt from :meth:`thresholds` in :meth:`setup`), and
    :attr:`state_key` (from :attr:`state_key_arguments`). :meth:`thresholds` comes from the rule registry.
    State beyond the rules is added by extending :meth:`state_dict` / :meth:`load_state_dict` and listing its
    keys in :attr:`extra_state_keys`. One that overrides ``on_fit_start`` calls
    ``super().on_fit_start(trainer, pl_module)``, which writes the thresholds and the dashboard layout.

    Series are written on the user's step axis (:class:`~lightning_diag.callbacks.common.step_axis.StepAxis`: the
    step Lightning logs ``self.log`` values at), which the trainer's driver
    (:class:`~lightning_diag.callbacks.common.driver.Driver`) moves from the first attached callback's
    ``on_train_epoch_start`` / ``on_train_batch_start`` and this base class saves in ``save_checkpoint_state`` /
    ``on_load_checkpoint``: a subclass that overrides one of these hooks calls ``super()`` first, as with every hook
    of this class.

    Args:
        rules: The thresholds and settings of this callback's rules, by rule id, and switches: ``{"grad_vanish":
            {"threshold": 1e-4}, "grad_explode": False}``; a family of shared settings by its name
            (``{"grad": {"patience": 5}}``). ``False`` or ``None`` switches a rule off (its alerts are not raised);
            a field not given keeps its default. The nested form of the ``thresholds.json`` keys
            (docs/thresholds.md lists every rule's fields, defaults and allowed values).
        log_every_n_steps: The logging interval (default: the trainer's ``log_every_n_steps``).
        on_alert: A callable receiving each :class:`~lightning_diag.core.alerts.Alert` as it is recorded, on
            global rank zero, after it is written to ``alerts.jsonl`` (Slack, e-mail, a pager). A handler that
            raises is reported once per fit through the ``lightning_diag`` logger and never stops training.

    Attributes:
        alerts: The alerts this callback raised in the current fit, in order.

    Raises:
        TypeError: If ``rules`` or one of its values has the wrong type, or ``on_alert`` is not callable.
        ValueError: If ``rules`` names a rule or field this callback does not have, or a value out of its range.
    """

    #: Constructor arguments (attributes, or ``"<argument>.<field>"`` of a settings object) that tell two
    #: instances' checkpoint state apart (``state_key``, keyed by the last name); empty:
    #: the class name.
    state_key_arguments: ClassVar[tuple[str, ...]] = ()
    #: Checkpoint keys a subclass saves besides its declared rules (checked by :meth:`load_state_dict`).
    extra_state_keys: ClassVar[tuple[str, ...]] = ()
    #: Per-batch hooks this callback needs only on the batches it works in: on a batch :meth:`quiet_batch` calls
    #: quiet they are switched off until the next batch's start (see :meth:`on_train_batch_start`).
    batch_hooks: ClassVar[tuple[str, ...]] = ()
    #: The shared measurements this callback reads on the steps of its logging cadence: its driver computes each
    #: once a step for every reader (:meth:`shared_gradient_squares`).
    shared_requests: ClassVar[frozenset[Shared]] = NOTHING

    def __init__(
        self,
        *,
        rules: RuleChoices | None = None,
        log_every_n_steps: int | None = None,
        on_alert: AlertHandler | None = None,
    ) -> None:
        super().__init__()
        #: ``rules=``, checked against the declarations: the values set and the rules switched off.
        self.rule_choices: ParsedRules = parse_rules(owner_name(type(self)), rules)
        if log_every_n_steps is not None:
            check_int("log_every_n_steps", log_every_n_steps, low=1)
        check_callable("on_alert", on_alert, "a callable taking an Alert")
        self.log_every_n_steps = log_every_n_steps
        self.on_alert = on_alert
        self._on_alert_failed = False
        self.alerts: list[Alert] = []
        self._session: DiagSession | None = None
        # the trainer's driver, from `setup` on (kept after `teardown`: `trainer.save_checkpoint` after `fit`)
        self._driver: Driver | None = None
        self._notices: set[str] = set()
        self._last_logged_step = -1
        #: Whether the current training batch is on this callback's logging cadence (``cadence_step(trainer) %
        #: every_n_steps(trainer) == 0``), decided once per batch for every callback of the trainer by its driver
        #: (:meth:`Driver.batch_started <lightning_diag.callbacks.common.driver.Driver.batch_started>`): the one
        #: test a quiet step's later hooks make.
        self.on_cadence = False
        self._cadence_every: int | None = None  # every_n_steps(trainer) outside a session, read once per fit
        self._batches_seen = -1  # the driver's count of decided batches at this callback's last batch start
        self._hooks_off = False  # whether the batch hooks are switched off (a quiet batch)
        self._hooks_saved: dict[str, Any] = {}  # what the instance held for them (another's wrappers)
        self._idle_hooks: list[str] = []  # the inherited no-op batch hooks, None on the instance during a fit
        # threshold_lines' values by the rules asked, kept from a fit's setup to its teardown (thresholds() is fixed
        # for a fit: thresholds.json records it once at its start)
        self._lines: dict[tuple[str, ...], dict[str, float]] = {}

    # -- checkpoint state --------------------------------------------------------------------------------
    def checkpoint_key(self) -> str:
        """The checkpoint key (:attr:`state_key`): the class name, with the :attr:`state_key_arguments` values
        when it declares some."""
        if not self.state_key_arguments:
            return pl.Callback.state_key.fget(self)  # type: ignore[attr-defined]
        # "loss_trend.swing_window": a settings field, keyed by its name
        current = tuple(operator.attrgetter(path)(self) for path in self.state_key_arguments)
        names = [path.rsplit(".", 1)[-1] for path in self.state_key_arguments]
        return self._generate_state_key(**dict(zip(names, current, strict=True)))

    #: The checkpoint key, :meth:`checkpoint_key`. Lightning reads it at every hook call of every callback (its
    #: profiler's label), about twenty times a step: from a fit's ``setup`` to its ``teardown`` it is a plain
    #: instance attribute (this class attribute is a non-data descriptor, which an instance attribute shadows).
    state_key = _StateKey()

    def state_dict(self) -> dict[str, Any]:
        """Each declared rule's state under its ``state_key`` (a subclass adds its :attr:`extra_state_keys`)."""
        return self.rules_state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output.

        Raises:
            KeyError: If a key is missing; the message names every missing one.
        """
        self.check_state_keys(state_dict, (*self.rule_state_keys, *self.extra_state_keys))
        self.load_rules_state_dict(state_dict)

    # -- session ---------------------------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Attach to the trainer's driver and its diagnostics session; a new fit starts with no alerts."""
        ensure_handler()
        self._lines = {}
        stale = self._driver
        driver = self._driver = _attach(trainer, self)
        if stale is not None and stale is not driver and stale.hosts(self):
            stale.release()  # a fit on another trainer ended without our teardown: its driver gives the hooks back
        switch_on(self, self._idle_hooks, {})  # left `None` by such a fit
        self._idle_hooks = []
        self._session = driver.session if driver is not None else None
        self._batches_seen = driver.batches if driver is not None else -1
        if stage == TrainerFn.FITTING:
            self.switch_batch_hooks(off=False)
            # the per-batch hooks it inherits as no-ops: not dispatched by Lightning during the fit
            self._idle_hooks = [
                h for h in inherited_batch_hooks(self) if h not in self.batch_hooks and h not in vars(self)
            ]
            switch_off(self, self._idle_hooks)
            self.alerts = []
            self._on_alert_failed = False
            self._notices = set()
            self._last_logged_step = -1
            self.on_cadence = False
            self._cadence_every = None
            self.reset_rules()
            # Lightning reads `state_key` at every hook call of every callback: fixed for the fit from here
            self.__dict__["state_key"] = self.checkpoint_key()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Detach from the trainer's driver (the last callback's detach flushes and closes the session, once per
        trainer)."""
        self.__dict__.pop("state_key", None)
        self._lines = {}
        self.switch_batch_hooks(off=False)
        if self._session is not None:
            if self._driver is not None:  # the last callback of the trainer to detach flushes and closes the session
                self._driver.detach(self, self._session)
            self._session = None
        # after the driver gave the hooks back (it keeps the idle hooks' `None` while it hosts)
        switch_on(self, self._idle_hooks, {})
        self._idle_hooks = []

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        """Lightning skips ``teardown`` when ``fit`` raises: give back every callback's hooks (the first of the
        trainer's lightning_diag callbacks to see the exception: the others' ``on_exception`` may not run), flush and
        release the session here."""
        if self._driver is not None:
            self._driver.release()
        self.teardown(trainer, pl_module, "exception")

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Fix the order of the trainer's lightning_diag callbacks (``trainer.callbacks``'), record the thresholds in
        effect and write the dashboard layout (once per fit, rank zero)."""
        if self._session is not None and self._driver is not None:
            self._driver.start_fit(trainer)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Write the run's provenance, ``diag/run.json`` (once per fit, rank zero)."""
        if self._session is not None:
            self._session.record_run(trainer)

    # -- the step axis ---------------------------------------------------------------------------------------
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Move the user's step axis past the previous epoch's last batch (the driver's, once per epoch)."""
        if self._session is not None and self._driver is not None:
            self._driver.epoch_started(trainer)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """On the first lightning_diag callback of the batch, let the driver count the batch on the user's step
        axis and decide, once for the batch, whether it is on each callback's logging cadence (:attr:`on_cadence`,
        :meth:`start_batch`); on every callback, switch :attr:`batch_hooks` off for a quiet batch. Outside a session
        (hooks called directly), the cadence is ``trainer.global_step``'s.

        On a batch :meth:`quiet_batch` calls quiet, each of :attr:`batch_hooks` is switched off
        (:meth:`switch_batch_hooks`: skipped by the trainer's driver during a fit, else ``None`` on the instance),
        so neither the hook nor Lightning's dispatch of it runs
        (:mod:`lightning_diag.callbacks.common.batch_hooks`); the next batch that needs them gets them back. Only the
        first and last batch of a quiet run switch;
        ``teardown`` switches them back on.
        """
        driver = self._driver
        if driver is not None and self._session is not None:  # `start_batch`, inlined (every batch)
            batches = driver.batches
            if batches == self._batches_seen:  # the first of the batch: the others read its decision
                driver.batch_started(trainer, pl_module, batch_idx)
                batches = driver.batches
            self._batches_seen = batches
        else:
            every = self._cadence_every
            if every is None:
                every = self._cadence_every = self.every_n_steps(trainer)
            self.on_cadence = trainer.global_step % every == 0
        if self.batch_hooks:
            off = self.quiet_batch(trainer)
            if off is not self._hooks_off:
                self.switch_batch_hooks(off=off)

    def start_batch(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch_idx: int) -> None:
        """During a session: have the driver decide the batch (:meth:`Driver.batch_started
        <lightning_diag.callbacks.common.driver.Driver.batch_started>`) unless another callback did already, which
        its count of decided batches tells (moved since this callback's last batch start)."""
        driver = self._driver
        assert driver is not None
        batches = driver.batches
        if batches == self._batches_seen:
            driver.batch_started(trainer, pl_module, batch_idx)
            batches = driver.batches
        self._batches_seen = batches

    def quiet_batch(self, trainer: pl.Trainer) -> bool:
        """Whether the current batch needs none of :attr:`batch_hooks` (asked at its start, after the step axis
        moved). Default: it is off this callback's logging cadence."""
        return not self.on_cadence

    def switch_batch_hooks(self, *, off: bool) -> None:
        """Switch :attr:`batch_hooks` off or back on: in the trainer's driver while it dispatches this callback's
        hooks (:meth:`Driver.switch <lightning_diag.callbacks.common.driver.Driver.switch>`), else ``None`` on the
        instance, which Lightning skips (:mod:`lightning_diag.callbacks.common.batch_hooks`)."""
        if off == self._hooks_off:
            return
        driver = self._driver
        if driver is None or not driver.switch(self, self.batch_hooks, off=off):
            if off:
                self._hooks_saved = switch_off(self, self.batch_hooks)
            else:
                switch_on(self, self.batch_hooks, self._hooks_saved)
                self._hooks_saved = {}
        self._hooks_off = off

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """Save this callback's part of the checkpoint (:meth:`save_checkpoint_state`), through the driver's
        :attr:`~lightning_diag.callbacks.common.driver.Driver.part_wrap` (``SystemMonitor``'s timer) when it has
        one."""
        driver = self._driver
        wrap = driver.part_wrap if driver is not None else None
        save = self.save_checkpoint_state
        (save if wrap is None else wrap(self, "on_save_checkpoint", save))(trainer, pl_module, checkpoint)

    def save_checkpoint_state(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """Save the step axis (the trainer's driver writes the checkpoint's top-level
        :data:`~lightning_diag.callbacks.common.step_axis.STEP_AXIS_KEY` once,
        :meth:`Driver.save_axis <lightning_diag.callbacks.common.driver.Driver.save_axis>`); with several ranks, save
        what all ranks know of the declared state, not rank zero's part (:meth:`saved_parts`): a
        :class:`~lightning_diag.stats.reduced.ReducedState`'s values merged by their declared reductions, and the
        ``all_ranks_state_dict(trainer, device)`` of one that has it.

        The trainer's driver does it once per checkpoint for every lightning_diag callback of the trainer it serves
        (:meth:`Driver.save_reduced <lightning_diag.callbacks.common.driver.Driver.save_reduced>`: one collective
        per reduction kind for all of them), also after ``teardown`` (``trainer.save_checkpoint`` after ``fit``); a
        callback never set up reduces its own. Lightning builds the checkpoint on every rank (only rank zero writes
        it), so the reductions run on all.
        """
        driver = self._driver
        if driver is not None:
            driver.save_axis(checkpoint)
        if trainer.world_size <= 1:
            return
        if driver is None:
            reduce_saved(trainer, checkpoint.get("callbacks", {}), self.saved_parts(), pl_module.device)
            return
        callbacks: list[pl.Callback] = trainer.callbacks  # type: ignore[attr-defined]
        served = (cb for cb in callbacks if isinstance(cb, DiagCallback) and cb._driver is driver)
        driver.save_reduced(trainer, checkpoint, (part for cb in served for part in cb.saved_parts()), pl_module.device)

    def saved_parts(self) -> list[SavedPart]:
        """The declared objects whose checkpoint state is merged over the ranks: ``(state_key, key, object)`` of
        each declared :class:`~lightning_diag.stats.reduced.ReducedState` and each one with an
        ``all_ranks_state_dict(trainer, device)``, in declaration order."""
        parts: list[SavedPart] = []
        for name, (_build, key) in self._rule_declarations.items():
            declared = getattr(self, name)
            if isinstance(declared, ReducedState) or hasattr(declared, "all_ranks_state_dict"):
                parts.append((self.state_key, key, declared))
        return parts

    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """Resume the step axis (the driver's, once per checkpoint)."""
        if self._session is not None and self._driver is not None:
            self._driver.load_axis(checkpoint)

    def thresholds(self) -> dict[str, float]:
        """The thresholds this callback judges by: rule id -> threshold, and ``"<rule>.<setting>"`` -> value.

        A rule id maps to the number its alerts carry as ``threshold``; dotted keys are the settings that
        qualify it (patience, windows). Written once per fit to ``<log_dir>/diag/thresholds.json`` and the
        ``diag/thresholds`` text; ``lightning-diag report`` judges the run against them.

        Built from the rule registry (:mod:`lightning_diag.core.registry`): every rule and shared setting the
        registry declares for this class (by class name, then its bases'), with the values ``rules=`` set (the
        defaults elsewhere); a rule switched off has no entry. A subclass adds entries the registry cannot know
        (conditional ones) by extending ``super().thresholds()``.
        """
        return registry_thresholds(self, self.rule_choices)

    def setting(self, key: str) -> float:
        """The value in effect of one ``thresholds()`` key (``"grad.warmup_steps"``), set or default, whether or
        not its rule is switched off: for the callback's own measuring."""
        given = self.rule_choices.values.get(key)
        return default(key) if given is None else given

    def threshold_lines(self, *rules: str) -> dict[str, float]:
        """``diag/threshold/<rule>`` reference values to write beside a series, for the dashboard's charts.

        Built from :meth:`thresholds` once per fit for each set of ``rules`` (a measuring step asks for the same
        ones every time; ``setup`` and ``teardown`` forget them).
        """
        lines = self._lines.get(rules)
        if lines is None:
            values = self.thresholds()
            lines = self._lines[rules] = {threshold_tag(rule): values[rule] for rule in rules if rule in values}
        return dict(lines)

    def shared_gradient_squares(self, trainer: pl.Trainer, optimizer: torch.optim.Optimizer) -> GradientSquares | None:
        """The squared norms of ``optimizer``'s gradients at the current step, computed once by the driver for every
        callback that reads them (:meth:`SharedMeasurements.gradient_squares
        <lightning_diag.callbacks.common.shared.SharedMeasurements.gradient_squares>`); ``None`` when no attached
        callback on its cadence requested them in this batch, or before ``setup``."""
        driver = self._driver
        if driver is None or not driver.shared.requested:  # a quiet step: no trainer property read (52 ns, not 625)
            return None
        return driver.shared.gradient_squares(optimizer, trainer.global_step)

    @property
    def writer(self) -> DiagWriter:
        """The writer of the current session (a no-op outside one): ``scalar``/``scalars`` reach every logger of
        the trainer; ``text``, ``image``, ``histogram`` and ``custom_scalars`` its TensorBoard writer."""
        return self._session.writer if self._session is not None else DiagWriter(None)

    # -- helpers for subclasses --------------------------------------------------------------------------
    @staticmethod
    def context(trainer: pl.Trainer) -> StepContext:
        """The trainer's epoch and global step."""
        return StepContext(epoch=trainer.current_epoch, global_step=trainer.global_step)

    def record(self, alerts: Iterable[Alert]) -> list[Alert]:
        """Keep alerts in :attr:`alerts`, write them to the alert log and hand each to ``on_alert`` (rank zero
        only). Alerts of rules switched off by ``rules=`` are dropped."""
        batch = [a for a in alerts if a.rule not in self.rule_choices.off]
        if batch:
            self.alerts.extend(batch)
            if self._session is not None:
                self._session.alert_log.write(batch)
                if self.on_alert is not None and self._session.is_global_zero:
                    for alert in batch:
                        self._call_on_alert(alert)
        return batch

    def _call_on_alert(self, alert: Alert) -> None:
        # A failing handler (a Slack outage) must never stop training: reported once per fit, then kept quiet.
        assert self.on_alert is not None
        try:
            self.on_alert(alert)
        except Exception as err:  # any error of user code
            if not self._on_alert_failed:
                self._on_alert_failed = True
                log.warning(
                    "%s: the on_alert handler raised %r on %s; training goes on (reported once per fit)",
                    type(self).__name__,
                    err,
                    alert.rule,
                )

    def notice(self, trainer: pl.Trainer, key: str, message: str) -> None:
        """Log an informational message once per fit (rank zero only)."""
        if key in self._notices:
            return
        self._notices.add(key)
        if trainer.is_global_zero:
            log.info("%s: %s", type(self).__name__, message)

    def every_n_steps(self, trainer: pl.Trainer) -> int:
        """The logging interval: this callback's own, or the trainer's ``log_every_n_steps``."""
        # Lightning sets `log_every_n_steps` on the trainer at init (0 with barebones=True).
        return self.log_every_n_steps or int(getattr(trainer, "log_every_n_steps", 0) or 50)

    def cadence_step(self, trainer: pl.Trainer) -> int:
        """The count the logging interval divides on the user's cadence
        (:attr:`StepAxis.cadence_step <lightning_diag.callbacks.common.step_axis.StepAxis.cadence_step>`): measuring
        when ``cadence_step(trainer) % every_n_steps(trainer) == 0`` writes on the steps of the user's
        ``self.log`` values, whatever the optimizers or accumulation. ``trainer.global_step`` outside a session."""
        return self._session.step_axis.cadence_step if self._session is not None else trainer.global_step

    def is_logging_step(self, trainer: pl.Trainer) -> bool:
        """Whether the current batch (at its end) is one to log, once per batch: one Lightning writes the user's
        step metrics at (:meth:`StepAxis.logs <lightning_diag.callbacks.common.step_axis.StepAxis.logs>`)."""
        if self._session is None:
            step = trainer.global_step
            if step == self._last_logged_step or step % self.every_n_steps(trainer) != 0:
                return False
            self._last_logged_step = step
            return True
        axis = self._session.step_axis
        if axis.step == self._last_logged_step or not axis.logs(self.every_n_steps(trainer)):
            return False
        self._last_logged_step = axis.step
        return True
