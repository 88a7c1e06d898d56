"""Shared machinery for rules: latching, the step context, declared and checked state, and the one constructor
from settings (:meth:`Rule.from_settings`) that the callbacks and the report's replay both use."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar, TypeVar

from lightning_diag.core.record import Alert, Severity
from lightning_diag.core.registry import RuleSpec

__all__ = ["Latch", "Rule", "StepContext", "list_names", "name_layers"]

#: A rule class (the return type of :meth:`Rule.from_settings`).
RuleT = TypeVar("RuleT", bound="Rule")

#: Sources named in an alert that groups several.
_SHOWN = 3


@dataclasses.dataclass(frozen=True)
class StepContext:
    """Where in training a value was measured."""

    epoch: int
    global_step: int


class Latch:
    """Remembers which sources are in alarm so each alerts once per episode.

    A source alerts when its condition becomes true, and again only after it has cleared.

    Example:
        >>> latch = Latch()
        >>> [latch.update("layer1", c) for c in (False, True, True, False, True)]
        [False, True, False, False, True]
    """

    def __init__(self) -> None:
        self._active: set[str] = set()

    def update(self, source: str, active: bool) -> bool:
        """Record the condition for ``source``; return ``True`` only when it has just become active."""
        if active:
            if source in self._active:
                return False
            self._active.add(source)
            return True
        self._active.discard(source)
        return False

    def is_active(self, source: str) -> bool:
        """Whether ``source`` is currently in alarm."""
        return source in self._active

    @property
    def active(self) -> frozenset[str]:
        """The sources currently in alarm."""
        return frozenset(self._active)

    def state_dict(self) -> list[str]:
        """Serializable state."""
        return sorted(self._active)

    def load_state_dict(self, state: Iterable[str]) -> None:
        """Restore :meth:`state_dict` output."""
        self._active = set(state)


class Rule:
    """Base class of the stateful detectors.

    Subclasses set :attr:`specs` (the declarations of the rule ids they raise, the first being
    :attr:`rule_id`), :attr:`severity` and :attr:`state_keys`, and implement :meth:`from_settings`; their state is
    the attributes named by ``state_keys`` plus the latch. :meth:`load_state_dict` names any key that is missing.
    """

    specs: ClassVar[tuple[RuleSpec, ...]] = ()
    rule_id: ClassVar[str]
    severity: ClassVar[Severity] = Severity.WARNING
    state_keys: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.specs and "rule_id" not in cls.__dict__:
            cls.rule_id = cls.specs[0].rule_id

    @classmethod
    def from_settings(cls: type[RuleT], thresholds: Mapping[str, float | None]) -> RuleT:
        """The rule with the thresholds and settings in effect: ``thresholds`` holds ``thresholds()`` keys
        (``"grad_vanish"``, ``"grad_vanish.relative"``, ``"grad.patience"``); a key it lacks (or maps to
        ``None``) takes its declared default. The callbacks build their rules with it from ``thresholds()``, the
        report's replay from the run's ``thresholds.json``: this is the one mapping from keys to parameters.
        """
        raise NotImplementedError(f"{cls.__name__} declares no from_settings")

    def __init__(self) -> None:
        self.latch = Latch()

    def _alert(
        self,
        ctx: StepContext,
        message: str,
        source: str,
        value: float | None,
        threshold: float | None,
        rule: str | None = None,
        severity: Severity | None = None,
    ) -> Alert:
        return Alert(
            rule=rule or self.rule_id,
            severity=severity or self.severity,
            message=message,
            epoch=ctx.epoch,
            global_step=ctx.global_step,
            value=None if value is None else float(value),
            threshold=None if threshold is None else float(threshold),
            source=source,
        )

    def state_dict(self) -> dict[str, Any]:
        """The declared state keys and the latch."""
        state = {key: _copy(getattr(self, key)) for key in self.state_keys}
        state["latch"] = self.latch.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output.

        Raises:
            KeyError: If a declared key is missing; the message names every missing key.
        """
        missing = [k for k in (*self.state_keys, "latch") if k not in state]
        if missing:
            raise KeyError(f"{type(self).__name__}.load_state_dict: missing state keys {missing}")
        for key in self.state_keys:
            setattr(self, key, _copy(state[key]))
        self.latch.load_state_dict(state["latch"])


def _copy(value: Any) -> Any:
    if isinstance(value, list):
        return [_copy(v) for v in value]
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    return value


def name_layers(
    values: Mapping[str, float], worst_first: bool = True, shown: int = _SHOWN, noun: str = "layers"
) -> str:
    """``"3 layers: `a` 1e-05, `b` 2e-05 and 1 more"``: a count and the worst few (largest or smallest first).

    One alert for many sources tripping one rule at once names them this way (``noun`` counts them: ``"layers"``,
    ``"heads"``).

    Example:
        >>> name_layers({"a": 3.0, "b": 1.0, "c": 2.0, "d": 0.5}, shown=2)
        '4 layers: `a` 3, `c` 2 and 2 more'
        >>> name_layers({"a": 3.0})
        '`a` 3'
        >>> name_layers({"m/head_0": 0.1, "m/head_1": 0.2}, worst_first=False, noun="heads")
        '2 heads: `m/head_0` 0.1, `m/head_1` 0.2'
    """
    order = sorted(values, key=values.__getitem__, reverse=worst_first)
    parts = ", ".join(f"`{k}` {values[k]:.3g}" for k in order[:shown])
    if len(order) == 1:
        return parts
    more = f" and {len(order) - shown} more" if len(order) > shown else ""
    return f"{len(order)} {noun}: {parts}{more}"


def list_names(names: Iterable[str], shown: int = _SHOWN, noun: str = "layers") -> str:
    """``"3 layers: `a`, `b`, `c`"``: a count and the first few names (sorted), for alerts without a value per source.

    Example:
        >>> list_names(["b", "a", "c", "d"], shown=2)
        '4 layers: `a`, `b` and 2 more'
        >>> list_names(["a"])
        '`a`'
    """
    order = sorted(names)
    parts = ", ".join(f"`{k}`" for k in order[:shown])
    if len(order) == 1:
        return parts
    more = f" and {len(order) - shown} more" if len(order) > shown else ""
    return f"{len(order)} {noun}: {parts}{more}"
