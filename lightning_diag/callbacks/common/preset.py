"""Presets: a callback is a named list of detectors (issue 43); the detectors and state a callback declares.

Each public callback declares, in its main module, one :class:`Preset`: the detector classes it runs (each a
:class:`~lightning_diag.rules.base.FromSettings` whose ``specs`` declare its rule ids), the attribute that keeps
each one on the callback and the checkpoint key of its state. :meth:`DiagCallback.add_preset
<lightning_diag.callbacks.common.base.DiagCallback.add_preset>` builds them from the thresholds in effect (and
again at every fit); :meth:`DiagCallback.detector <lightning_diag.callbacks.common.base.DiagCallback.detector>`
hands the one of a class to the parts of the callback that feed it. The rule ids a callback owns are those of its
preset's detectors (``tests/callbacks/test_presets.py`` checks them against the registry and the docs).

:class:`DeclaredDetectors`, a base of every callback, keeps what it declares (the preset's detectors with
:meth:`~DeclaredDetectors.add_rule`, other state with :meth:`~DeclaredDetectors.add_state`): built now and afresh
at every fit, saved and restored under their checkpoint keys (the torchmetrics ``add_state`` pattern, one level up).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, TypeVar

from lightning_diag.core.record import Alert
from lightning_diag.rules.base import FromSettings, StepContext
from lightning_diag.rules.measures import Measure, Measures, fed_by

__all__ = ["DeclaredDetectors", "Detector", "Feed", "Preset", "StatefulRule"]


class StatefulRule(Protocol):
    """What :meth:`DiagCallback.add_rule` declares: a rule (or policy) whose state survives a resume."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> None: ...


#: The judgment every detector shares (its ``judge``), and what a measuring part calls to have its measurements
#: judged (:meth:`DeclaredDetectors.feed`): ``feed(ctx, m)`` judges ``m`` and returns the alerts.
Feed = Callable[[StepContext, Measures], list[Alert]]


RuleT = TypeVar("RuleT", bound=StatefulRule)


@dataclass(frozen=True)
class Detector:
    """One entry of a preset.

    Args:
        rule: The detector's class: its ``specs`` name the rule ids it raises, its ``from_settings`` builds it.
        attribute: The callback's attribute that keeps the detector.
        state_key: The checkpoint key of its state (default: ``attribute``).
        context: ``(keyword, attribute)`` pairs: ``from_settings`` gets the callback's ``attribute`` (read when
            the preset is added) as ``keyword``: what the detector needs besides its thresholds (the unit of its
            messages, the monitored metric, the non-finite action).
    """

    rule: type[FromSettings]
    attribute: str
    state_key: str = ""
    context: tuple[tuple[str, str], ...] = ()

    @property
    def key(self) -> str:
        """The checkpoint key of the detector's state."""
        return self.state_key or self.attribute

    @property
    def rule_ids(self) -> tuple[str, ...]:
        """The rule ids the detector raises, from its class's declarations."""
        return tuple(spec.rule_id for spec in self.rule.specs)

    def builder(self, callback: object) -> Callable[[Mapping[str, float]], Any]:
        """What builds the detector from the thresholds in effect, for ``callback`` (a partial, not a closure:
        the callback pickles, its declarations with it)."""
        return functools.partial(_build, self.rule, callback, self.context)


def _build(
    rule: type[FromSettings], callback: object, context: tuple[tuple[str, str], ...], thresholds: Mapping[str, float]
) -> Any:
    """``rule.from_settings(thresholds)`` with the callback's ``context`` attributes as they are now (a new fit
    sees a changed ``monitor``)."""
    return rule.from_settings(thresholds, **{keyword: getattr(callback, name) for keyword, name in context})


@dataclass(frozen=True, eq=False)
class Preset:
    """A callback's named list of detectors, in the order they are built and saved (compared and hashed as
    itself: each is one class attribute, and :meth:`fed_by`'s table is kept per preset).

    Args:
        name: The callback's class name (the ``owner`` of its rules' declarations).
        detectors: Its detectors.
    """

    name: str
    detectors: tuple[Detector, ...]

    @property
    def rule_ids(self) -> tuple[str, ...]:
        """Every rule id the preset's detectors raise, in preset order."""
        return tuple(rule_id for detector in self.detectors for rule_id in detector.rule_ids)

    def fed_by(self, present: frozenset[Measure]) -> tuple[Detector, ...]:
        """The detectors judged on measures holding ``present``, in preset order (see
        :func:`~lightning_diag.rules.measures.fed_by`; kept per set of measurements)."""
        return _fed_by(self, present)


@functools.lru_cache(maxsize=256)
def _fed_by(preset: Preset, present: frozenset[Measure]) -> tuple[Detector, ...]:
    """:meth:`Preset.fed_by`, kept per preset and set of measurements (a few of each per callback)."""
    return tuple(
        entry
        for entry in preset.detectors
        if fed_by(getattr(entry.rule, "needs", frozenset()), getattr(entry.rule, "optional", frozenset()), present)
    )


def _build_without_thresholds(factory: Callable[[], RuleT], thresholds: Mapping[str, float]) -> RuleT:
    """The builder :meth:`DiagCallback.add_state` declares: ``factory()`` (module level: the callback pickles)."""
    return factory()


class DeclaredDetectors:
    """The detectors and state a callback declares, rebuilt at every fit and saved under their keys.

    A subclass provides :meth:`thresholds` (the values in effect) and sets :attr:`preset`.
    """

    #: The detectors this callback runs, built by :meth:`add_preset`: the rule ids it owns are theirs.
    preset: ClassVar[Preset] = Preset("DiagCallback", ())

    def __init__(self) -> None:
        super().__init__()
        #: Declared rules and state: attribute name -> (builder from thresholds, checkpoint key).
        self._rule_declarations: dict[str, tuple[Callable[[Mapping[str, float]], StatefulRule], str]] = {}

    def thresholds(self) -> dict[str, float]:
        """The thresholds in effect, which build the declared rules (the callback's)."""
        raise NotImplementedError

    def add_rule(
        self, name: str, build: Callable[[Mapping[str, float]], RuleT], *, state_key: str | None = None
    ) -> RuleT:
        """Declare a rule: ``build(self.thresholds())`` now and at every new fit, kept as attribute ``name``,
        its state saved under ``state_key`` (default ``name``). Returns the rule built.

        ``build`` is the rule class's ``from_settings`` (or a ``functools.partial`` of it with the context a
        rule needs besides its thresholds, such as the unit of its messages).
        """
        self._rule_declarations[name] = (build, state_key or name)
        rule = build(self.thresholds())
        setattr(self, name, rule)
        return rule

    def add_preset(self) -> None:
        """Declare every detector of :attr:`preset` with :meth:`add_rule`, in its order (call it once the
        attributes its detectors' ``context`` names are set)."""
        for entry in self.preset.detectors:
            self.add_rule(entry.attribute, entry.builder(self), state_key=entry.key)

    def feed(self, ctx: StepContext, m: Measures) -> list[Alert]:
        """Judge ``m`` with every detector of :attr:`preset` that it feeds (all the measurements it needs, or for
        one that needs none, one it reads), in preset order; return their alerts (the caller records them).

        The part of a callback that measures names what it measured, not who reads it: a detector added to the
        preset that reads these measurements is judged with no change to that part.

        Raises:
            ValueError: If ``m`` feeds no detector of the preset (a measuring part's programming error, as a
                missing measurement is for ``judge``).
        """
        fed = self.preset.fed_by(m.present())
        if not fed:
            raise ValueError(
                f"{type(self).__name__}.feed: no detector of its preset reads {sorted(n.value for n in m.present())}"
            )
        alerts: list[Alert] = []
        for entry in fed:
            judge: Feed = getattr(self, entry.attribute).judge
            alerts += judge(ctx, m)
        return alerts

    def add_state(self, name: str, factory: Callable[[], RuleT], *, state_key: str | None = None) -> RuleT:
        """Declare state that no threshold builds (counters, pending findings): as :meth:`add_rule`, with
        ``factory()`` now and at every new fit, its state saved under ``state_key`` (default ``name``).

        What is declared here or with :meth:`add_rule` and is a
        :class:`~lightning_diag.stats.reduced.ReducedState`, or has an ``all_ranks_state_dict(trainer, device)``
        method, is saved merged over every rank (see :meth:`on_save_checkpoint`).
        """
        return self.add_rule(name, functools.partial(_build_without_thresholds, factory), state_key=state_key)

    def reset_rules(self) -> None:
        """Build every declared rule afresh from :meth:`thresholds` (a new fit; a resume then loads their state)."""
        values = self.thresholds()
        for name, (build, _key) in self._rule_declarations.items():
            setattr(self, name, build(values))

    @property
    def rule_state_keys(self) -> tuple[str, ...]:
        """The checkpoint keys of the declared rules, in declaration order."""
        return tuple(key for _build, key in self._rule_declarations.values())

    def rules_state_dict(self) -> dict[str, Any]:
        """Each declared rule's state under its ``state_key``."""
        return {key: getattr(self, name).state_dict() for name, (_b, key) in self._rule_declarations.items()}

    def load_rules_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`rules_state_dict` output.

        Raises:
            KeyError: If a declared rule's key is missing; the message names every missing key.
        """
        self.check_state_keys(dict(state), self.rule_state_keys)
        for name, (_build, key) in self._rule_declarations.items():
            getattr(self, name).load_state_dict(state[key])

    def rule_peaks(self) -> dict[str, float]:
        """The largest excess each rule id's statistic reached in this fit, over the declared rules
        (:attr:`Rule.peaks <lightning_diag.rules.base.Rule.peaks>`: 1.0 is the threshold): the calibration
        harness's margin. Rules that note no statistic are absent."""
        peaks: dict[str, float] = {}
        for name in self._rule_declarations:
            for rule_id, value in getattr(getattr(self, name), "peaks", {}).items():
                peaks[rule_id] = max(value, peaks.get(rule_id, value))
        return peaks

    def check_state_keys(self, state_dict: dict[str, Any], keys: Iterable[str]) -> None:
        """Raise ``KeyError`` naming every key of ``keys`` missing from a checkpointed ``state_dict``."""
        missing = [k for k in keys if k not in state_dict]
        if missing:
            raise KeyError(f"{type(self).__name__}.load_state_dict: missing state keys {missing}")
