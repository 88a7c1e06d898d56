"""Shared machinery for rules: latching, the step context, declared and checked state, and the one constructor
from settings (:meth:`Rule.from_settings`) that the callbacks and the report's replay both use."""

from __future__ import annotations

import abc
import dataclasses
import functools
import inspect
import math
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from lightning_diag.core.record import Alert, Severity
from lightning_diag.core.registry import RULES, SETTINGS, Limit, RuleSpec
from lightning_diag.rules.measures import field_names

if TYPE_CHECKING:  # pragma: no cover
    from lightning_diag.rules.measures import Measure, Measures

__all__ = [
    "OVERWHELMING",
    "WORSEN_FACTOR",
    "FromSettings",
    "Latch",
    "Rule",
    "StepContext",
    "excess",
    "list_names",
    "name_layers",
]

#: A class built from the settings (the return type of :meth:`FromSettings.from_settings`).
BuiltT = TypeVar("BuiltT", bound="FromSettings")

#: Sources named in an alert that groups several.
_SHOWN = 3


@dataclasses.dataclass(frozen=True)
class StepContext:
    """Where in training a value was measured."""

    epoch: int
    global_step: int


#: A latched condition alerts again while it persists once it has moved this factor further past its threshold
#: than at its last alert ("clearly worsened": a head at 0.4 nats against 0.5 alerts again at 0.04, a gradient at
#: 20 against 10 again at 200).
WORSEN_FACTOR = 10.0


#: A warm-up gives way to overwhelming evidence: a value this factor past its threshold (three orders of magnitude:
#: a relative gradient below 1e-6 where the threshold is 1e-3, a spread above 1e5 where it is 100) is judged during
#: the warm-up too. Healthy warm-ups stay far from it (the corpus's worst: a matrix 64x below its best-fed peer).
OVERWHELMING = 1e3


def excess(value: float, threshold: float, above: bool = True) -> float:
    """How far ``value`` is past ``threshold``, as a factor (``value / threshold`` for an upper bound, ``threshold
    / value`` for a lower one); ``nan`` where it cannot be told (a zero or non-finite value or threshold).

    Example:
        >>> excess(200.0, 10.0), excess(0.04, 0.5, above=False)
        (20.0, 12.5)
    """
    num, den = (value, threshold) if above else (threshold, value)
    if not (math.isfinite(num) and math.isfinite(den)) or den <= 0 or num < 0:
        return math.nan
    return num / den


class Latch:
    """Remembers which sources are in alarm so each alerts once per event.

    A source alerts when its condition becomes true. While it stays true it alerts again only when it has
    *clearly worsened*: its :func:`excess` past the threshold (passed as ``excess``) grew by ``worsen_factor``
    (:data:`WORSEN_FACTOR`) since its last alert. A source whose condition turns false is *cleared* only after
    ``clear_after`` consecutive updates without it; a condition that comes back sooner is the same event and stays
    silent. A rule whose condition needs ``patience`` consecutive measurements uses :meth:`for_patience`, so the
    condition must have been false on ``patience`` measurements before a new event can alert: a value that
    flickers around its threshold alerts once.

    Example:
        >>> latch = Latch()
        >>> [latch.update("layer1", c) for c in (False, True, True, False, True)]
        [False, True, False, False, True]
        >>> latch = Latch(clear_after=2)
        >>> [latch.update("head", c) for c in (True, False, True, False, False, True)]
        [True, False, False, False, False, True]
        >>> [latch.update("grad", True, excess=x) for x in (2.0, 5.0, 19.0, 20.0, 100.0)]
        [True, False, False, True, False]
    """

    def __init__(self, clear_after: int = 1, worsen_factor: float = WORSEN_FACTOR) -> None:
        self.clear_after = max(1, int(clear_after))
        self.worsen_factor = worsen_factor
        # source -> [excess at the last alert (nan: unknown), consecutive updates without the condition]
        self._active: dict[str, list[float]] = {}

    @classmethod
    def for_patience(cls, patience: int, worsen_factor: float = WORSEN_FACTOR) -> Latch:
        """The latch of a rule whose condition must hold on ``patience`` consecutive measurements.

        A new streak of ``patience`` measurements itself counts ``patience - 1`` updates without the alarm, so
        the latch clears after ``2 * patience - 1``: the condition was false on at least ``patience`` of them.
        """
        return cls(clear_after=2 * max(1, int(patience)) - 1, worsen_factor=worsen_factor)

    def holds(self, source: str) -> bool:
        """Whether an event of ``source`` has alerted and not cleared yet."""
        return source in self._active

    def update(self, source: str, active: bool, excess: float | None = None) -> bool:
        """Record the condition for ``source``; return ``True`` when it has just become active, or has clearly
        worsened (``excess`` grew by ``worsen_factor`` since the last alert)."""
        entry = self._active.get(source)
        if active:
            now = math.nan if excess is None else float(excess)
            if entry is None:
                self._active[source] = [now, 0.0]
                return True
            entry[1] = 0.0
            last = entry[0]
            if math.isfinite(now) and (not math.isfinite(last) or last <= 0):
                entry[0] = now  # the first known excess of this event: the reference for "worsened"
                return False
            if math.isfinite(now) and now >= last * self.worsen_factor:
                entry[0] = now
                return True
            return False
        if entry is not None:
            entry[1] += 1
            if entry[1] >= self.clear_after:
                del self._active[source]
        return False

    def clear(self, source: str) -> None:
        """Forget ``source`` at once (the event is over whatever ``clear_after`` says)."""
        self._active.pop(source, None)

    def is_active(self, source: str) -> bool:
        """Whether ``source`` is currently in alarm."""
        return source in self._active

    @property
    def active(self) -> frozenset[str]:
        """The sources currently in alarm."""
        return frozenset(self._active)

    def state_dict(self) -> dict[str, list[float | None]]:
        """Serializable state: each source in alarm with its excess at the last alert (``None``: unknown) and the
        updates it has been without its condition."""
        return {k: [v[0] if math.isfinite(v[0]) else None, v[1]] for k, v in sorted(self._active.items())}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output."""
        self._active = {str(k): [math.nan if v[0] is None else float(v[0]), float(v[1])] for k, v in state.items()}


@dataclasses.dataclass(frozen=True)
class _Field:
    """A ``thresholds()`` key that sets a parameter, with its declared default and allowed values."""

    key: str
    default: float
    limit: Limit


def _declared(key: str) -> _Field:
    """The declaration of a ``thresholds()`` key named in :attr:`FromSettings.setting_keys`.

    Raises:
        KeyError: If no rule or shared setting declares ``key``.
    """
    setting = SETTINGS.get(key)
    if setting is not None:
        return _Field(key, float(setting.default), setting.limit)
    rule_id, _, name = key.partition(".")
    spec = RULES.get(rule_id)
    if spec is None or (name and name not in spec.settings) or (not name and spec.threshold is None):
        raise KeyError(f"no rule or setting declares {key!r}")
    return _Field(key, spec.value({}, name or "threshold"), spec.limit(name or "threshold"))


class FromSettings:
    """What is built from its declarations: :meth:`from_settings` reads each ``__init__`` parameter that a
    declared threshold or setting sets from the thresholds in effect.

    Which ``thresholds()`` key sets which parameter (:meth:`settings_map`), in this order:

    1. :attr:`setting_keys`, where the class names the key of a parameter itself (a parameter named otherwise than
       its field, a setting shared by several rules such as ``grad.patience``, another rule's threshold);
    2. a parameter named ``threshold``: the threshold of the first spec of :attr:`specs`;
    3. a parameter named like a setting of a spec of :attr:`specs`: that setting of the first spec declaring it.

    A parameter set this way is an ``int`` where its default or annotation is (or its field's :class:`Limit` is
    integer), else a ``float``. Every other parameter (``unit``, ``monitor``, ``action``) takes the keyword
    argument of that name given to :meth:`from_settings`, else its default.
    """

    specs: ClassVar[tuple[RuleSpec, ...]] = ()
    #: ``{parameter: thresholds() key}`` for the parameters of ``__init__`` that rules 2 and 3 of the class
    #: docstring do not name (the key from the declaring module's constants: ``GRAD_PATIENCE_SETTING.key``).
    setting_keys: ClassVar[Mapping[str, str]] = {}

    @classmethod
    def settings_map(cls) -> dict[str, str]:
        """``{parameter: thresholds() key}``: the parameters of ``__init__`` that :meth:`from_settings` reads from
        the thresholds in effect, in the order of the signature (for a class with a ``from_settings`` of its own:
        the ones the generated one would read).

        Example:
            >>> from lightning_diag.rules.sharp_minimum import SharpMinimumRule
            >>> SharpMinimumRule.settings_map()
            {'threshold': 'sharp_minimum', 'patience': 'sharp_minimum.patience'}
        """
        return {name: field.key for name, field in cls._fields().items()}

    @classmethod
    def _fields(cls) -> dict[str, _Field]:
        """:meth:`settings_map` with each key's default and allowed values."""
        found: dict[str, _Field] = {}
        for name in inspect.signature(cls).parameters:
            if name in cls.setting_keys:
                found[name] = _declared(cls.setting_keys[name])
                continue
            if name == "threshold":
                spec = cls.specs[0] if cls.specs and cls.specs[0].threshold is not None else None
            else:
                spec = next((s for s in cls.specs if name in s.settings), None)
            if spec is not None:
                found[name] = _Field(spec.key(name), spec.value({}, name), spec.limit(name))
        return found

    @classmethod
    def from_settings(cls: type[BuiltT], thresholds: Mapping[str, float | None], *args: Any, **extra: Any) -> BuiltT:
        """The object with the thresholds and settings in effect: ``thresholds`` holds ``thresholds()`` keys
        (``"grad_vanish"``, ``"grad_vanish.relative"``, ``"grad.patience"``); a key it lacks (or maps to ``None``)
        takes its declared default. The callbacks build their rules with it from ``thresholds()``, the report's
        replay from the run's ``thresholds.json``: this is the one mapping from keys to parameters
        (:meth:`settings_map`). ``extra`` sets the parameters no setting sets (``unit="step"``); ``*args`` is in the
        signature only so that a subclass's own ``from_settings`` with other keywords type-checks as an override.

        Raises:
            TypeError: If ``extra`` names a parameter ``__init__`` lacks or one a setting sets, an argument is
                given by position, or a parameter without default is neither.
        """
        if args:
            raise TypeError(f"{cls.__name__}.from_settings takes the thresholds and keyword arguments only")
        parameters = inspect.signature(cls).parameters
        fields = cls._fields()
        for name in extra:
            if name not in parameters or name in fields:
                free = [p for p in parameters if p not in fields]
                reason = f"it is set by {fields[name].key!r}" if name in fields else f"it takes {free or 'none'}"
                raise TypeError(f"{cls.__name__}.from_settings got an unexpected keyword argument {name!r}; {reason}")
        kwargs: dict[str, Any] = dict(extra)
        for name, field in fields.items():
            given = thresholds.get(field.key)
            value = field.default if given is None else float(given)
            kwargs[name] = int(value) if _is_int(parameters[name], field.limit) else value
        variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
        unset = [
            n for n, p in parameters.items()
            if n not in kwargs and p.default is inspect.Parameter.empty and p.kind not in variadic
        ]
        if unset:
            raise TypeError(f"{cls.__name__}.from_settings needs the keyword arguments {unset}")
        return cls(**kwargs)


def _is_int(parameter: inspect.Parameter, limit: Limit) -> bool:
    """Whether the parameter takes an ``int`` (its default, annotation or field's limit says so)."""
    default = parameter.default
    return (
        limit.integer
        or parameter.annotation in (int, "int")
        or (isinstance(default, int) and not isinstance(default, bool))
    )


#: The judgment signature every rule shares.
_Judge = Callable[["Rule", StepContext, "Measures"], list[Alert]]


def _checked(judge: _Judge) -> _Judge:
    """``judge`` preceded by the check that the measures hold every measurement the rule needs."""

    @functools.wraps(judge)
    def checked(self: Rule, ctx: StepContext, m: Measures) -> list[Alert]:
        needs = self.needs
        if not m.holds_all(field_names(needs)):
            raise ValueError(
                f"{type(self).__name__}.judge: the measures lack {m.missing(needs)}; it needs "
                f"{sorted(n.value for n in needs)}"
            )
        if not needs and not m.holds_any(field_names(self.optional)):
            raise ValueError(
                f"{type(self).__name__}.judge: the measures hold none of {sorted(n.value for n in self.optional)}"
            )
        return judge(self, ctx, m)

    return checked


class Rule(FromSettings, abc.ABC):
    """Base class of the stateful detectors.

    Subclasses set :attr:`specs` (the declarations of the rule ids they raise, the first being
    :attr:`rule_id`), :attr:`severity` and :attr:`state_keys`, name the measurements they read in :attr:`needs`
    and :attr:`optional`, and implement :meth:`judge`; :meth:`~FromSettings.from_settings` builds them from their
    declarations (:class:`FromSettings`, with :attr:`~FromSettings.setting_keys` for the parameters their names do
    not tie to a field). Their state is the attributes named by ``state_keys`` plus the latch.
    :meth:`load_state_dict` names any key that is missing.
    """

    rule_id: ClassVar[str]
    severity: ClassVar[Severity] = Severity.WARNING
    state_keys: ClassVar[tuple[str, ...]] = ()
    #: The measurements (:class:`~lightning_diag.rules.measures.Measure`) :meth:`judge` cannot do without.
    needs: ClassVar[frozenset[Measure]] = frozenset()
    #: The measurements :meth:`judge` also reads where they were measured.
    optional: ClassVar[frozenset[Measure]] = frozenset()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.specs and "rule_id" not in cls.__dict__:
            cls.rule_id = cls.specs[0].rule_id
        own = cls.__dict__.get("judge")
        if own is not None and not getattr(own, "__isabstractmethod__", False):
            cls.judge = _checked(own)  # type: ignore[method-assign,assignment]

    @abc.abstractmethod
    def judge(self, ctx: StepContext, m: Measures) -> list[Alert]:
        """Judge the measurements ``m`` taken at ``ctx``; return the alerts raised. Every rule has this signature.

        Raises:
            ValueError: If ``m`` lacks a measurement the rule :attr:`needs`, or, for a rule that needs none, holds
                none of its :attr:`optional` ones (a caller's programming error).
        """

    def __init__(self) -> None:
        self.latch = Latch()
        #: The largest :func:`excess` each rule id's statistic reached in this fit (``1.0``: at its threshold;
        #: below 1: that fraction of the way). A reading for the calibration harness (its *margin*), filled by
        #: :meth:`observe`; not checkpoint state and never part of a decision.
        self.peaks: dict[str, float] = {}
        #: ``{source: excesses}``: each source's latest excesses, for :meth:`observe_held` (margins only).
        self.held: dict[str, list[float]] = {}

    def observe(self, value: float, threshold: float, *, above: bool = True, rule: str | None = None) -> None:
        """Note how close the statistic ``value`` came to ``threshold`` (a bound from above or below), for
        :attr:`peaks`. Call it on every measurement a rule judges, whether it alerts or not; a value that cannot
        be compared (:func:`excess` is ``nan``) is ignored.

        Example:
            >>> class _R(Rule):
            ...     rule_id = "demo"
            ...     def judge(self, ctx, m): return []
            >>> r = _R()
            >>> r.observe(4.0, 10.0); r.observe(0.5, 0.25, above=False); r.observe(float("nan"), 1.0)
            >>> r.peaks
            {'demo': 0.5}
        """
        x = excess(value, threshold, above)
        if math.isnan(x):
            return
        key = rule or self.rule_id
        if not x <= self.peaks.get(key, -math.inf):
            self.peaks[key] = x

    def observe_held(
        self, source: str, x: float, patience: int, cap: float = math.inf, rule: str | None = None
    ) -> None:
        """Note, for :attr:`peaks`, the excess that decides a rule needing ``patience`` consecutive measurements
        past its threshold: the smallest :func:`excess` ``x`` of ``source`` over its latest ``patience``
        measurements (0 before there are as many), at most ``cap``: the excess of the rule's other condition (0
        where a gate such as the warm-up or the loss's verdict does not hold; ``inf``: none). Its peak is above 1
        exactly where the rule's condition held; below 1 it is the room left. A ``nan`` excess (not judged)
        counts as 0.

        Example:
            >>> class _R(Rule):
            ...     rule_id = "demo"
            ...     def judge(self, ctx, m): return []
            >>> r = _R()
            >>> for x in (2.0, 0.5, 3.0, 4.0):
            ...     r.observe_held("fc", x, 2)
            >>> r.peaks
            {'demo': 3.0}
            >>> r.observe_held("fc", 9.0, 2, cap=0.0); r.peaks
            {'demo': 3.0}
        """
        window = [*self.held.get(source, []), 0.0 if math.isnan(x) else x][-patience:]
        self.held[source] = window
        decided = min(min(window), cap) if len(window) >= patience else 0.0
        key = rule or self.rule_id
        if not decided <= self.peaks.get(key, -math.inf):
            self.peaks[key] = decided

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
