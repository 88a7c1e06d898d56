"""The rule registry: one declaration per rule id, and the checklist rows of ``lightning-diag report``.

Every rule the library can raise is declared exactly once, next to the class that implements it (a module-level
``register(RuleSpec(...))`` in its ``lightning_diag.rules`` module, also set as the class's ``specs``), with the
callback that owns it, its severity, its default threshold and settings with their allowed values (:class:`Limit`),
a title with the threshold filled in, and the checklist row of ``lightning-diag report`` it belongs to.
:mod:`lightning_diag.rules.catalog` imports every declaring module and declares the checklist rows, so importing
it (the report does) gives the complete registry. ``ALL_RULES``, the rule-id
constants, the ``DEFAULT_*`` constants of ``rules/``, the callbacks' ``thresholds()`` and rules
(``Rule.from_settings``), the report's defaults, titles, replays and checklist, and the docs' thresholds table
check all derive from these declarations.

Declaring a new rule (in the rules module that implements it)::

    LABEL_IMBALANCE_SPEC = register(RuleSpec("label_imbalance", "DataDiagnostics", "warning", 0.1,
                                             "standard deviation of the class proportions above {threshold:g}",
                                             settings={"min_samples": 100},
                                             limits={"threshold": FRACTION, "min_samples": COUNT},
                                             check="data_label_balance", source="seed 000 §7.1"))
    LABEL_IMBALANCE = LABEL_IMBALANCE_SPEC.rule_id

The user sets a field with the owner's ``rules={"label_imbalance": {"threshold": 0.2}}`` (:func:`parse_rules`
checks it against the declaration), :meth:`DiagCallback.thresholds` reports the values in effect with no code of
its own (:func:`registry_thresholds`), and the rule class's ``from_settings(thresholds)`` builds the rule from
those values (the callbacks and the report's replay alike).
``check`` puts the rule in a checklist row (:data:`CHECKS`); a new row is a :class:`CheckSpec` declared beside its
rules and registered (:func:`register_check`) in report order by :mod:`lightning_diag.rules.catalog`, and where
its status needs more than "did its rules raise a warning" it gets a measure function in
the same module (:mod:`lightning_diag.rules.rows`).

This module imports nothing but the standard library and no declaring module (they import it), so the report
can read it without torch or Lightning.

Example:
    >>> import lightning_diag.rules.catalog  # loads every declaration
    >>> spec = RULES["grad_explode"]
    >>> spec.owner, spec.severity, spec.threshold
    ('GradientFlowMonitor', 'warning', 10.0)
    >>> spec.describe()
    "a layer's RMS gradient per element above 10"
    >>> spec.describe({"grad_explode": 5.0})
    "a layer's RMS gradient per element above 5"
    >>> CHECKS["grad_norm_band"].describe({"grad_vanish": 1e-4})
    'Gradient of every layer within 0.0001 (||g||/||W||) .. 10 (RMS per element)'
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import string
import sys
from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import Literal, TypeVar

__all__ = [
    "ANY_NON_NEGATIVE",
    "CHECKS",
    "COUNT",
    "FRACTION",
    "OWNERS",
    "POSITIVE",
    "RULES",
    "SETTINGS",
    "STEPS",
    "CheckSpec",
    "ChecklistLayer",
    "Limit",
    "ParsedRules",
    "RuleChoices",
    "RuleSpec",
    "SettingSpec",
    "SeverityName",
    "default",
    "default_thresholds",
    "describe",
    "owner_name",
    "owner_of",
    "parse_rules",
    "register",
    "register_check",
    "register_setting",
    "registry_thresholds",
    "rules_of",
    "settings_of",
    "value_of",
]

SeverityName = Literal["info", "warning", "critical"]
_Spec = TypeVar("_Spec")
ChecklistLayer = Literal["Data", "Model", "Training", "Deployment"]


@dataclasses.dataclass(frozen=True)
class Limit:
    """The allowed values of a threshold or setting: a finite number in a range, or an int.

    Example:
        >>> Limit(low=0.0, high=1.0, high_inclusive=False).check("threshold", 0.5)
        0.5
        >>> Limit(low=1, integer=True).text()
        'an int >= 1'
    """

    low: float | None = None
    high: float | None = None
    low_inclusive: bool = False
    high_inclusive: bool = True
    integer: bool = False

    def text(self) -> str:
        """The allowed values in words (``"a number > 0 and <= 1"``)."""
        parts = []
        if self.low is not None:
            parts.append(f"{'>=' if self.low_inclusive or self.integer else '>'} {self.low:g}")
        if self.high is not None:
            parts.append(f"{'<=' if self.high_inclusive or self.integer else '<'} {self.high:g}")
        return f"{'an int' if self.integer else 'a number'} {' and '.join(parts) if parts else '(finite)'}"

    def check(self, name: str, value: object) -> float:
        """``value`` as a float (an int for an integer field, an integral float accepted: YAML and jsonargparse
        may hand either).

        Raises:
            TypeError: If ``value`` is not a real number (bools are rejected), or not integral for an int field.
            ValueError: If it is non-finite or out of range.
        """
        message = f"Expected `{name}` to be {self.text()}, but got {value!r}"
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(message)
        v = float(value)
        if self.integer and not (math.isfinite(v) and v.is_integer()):
            raise TypeError(message)
        ok = math.isfinite(v)
        if ok and self.low is not None:
            ok = v >= self.low if self.low_inclusive or self.integer else v > self.low
        if ok and self.high is not None:
            ok = v <= self.high if self.high_inclusive or self.integer else v < self.high
        if not ok:
            raise ValueError(message)
        return float(int(v)) if self.integer else v


#: The limit of a field that declares none: any finite number ``>= 0``.
ANY_NON_NEGATIVE = Limit(low=0.0, low_inclusive=True)
#: A fraction in ``(0, 1)``, an int ``>= 1``, an int ``>= 0``, a number ``> 0``: the common limits.
FRACTION = Limit(low=0.0, high=1.0, high_inclusive=False)
COUNT = Limit(low=1, integer=True)
STEPS = Limit(low=0, integer=True)
POSITIVE = Limit(low=0.0)


@dataclasses.dataclass(frozen=True)
class RuleSpec:
    """The declaration of one rule.

    Attributes:
        rule_id: The rule id alerts carry (public contract: never renamed).
        owner: The name of the callback class that raises it.
        severity: The severity of its alerts (some rules also raise ``info`` hints; this is the main one).
        threshold: The default value alerts carry as ``threshold``, or ``None`` for rules without a number
            (non-finite checks).
        title: What the rule detects, as a :meth:`str.format` template over the thresholds in effect:
            ``{threshold}`` is this rule's threshold, ``{<setting>}`` one of its settings (or of its owner's
            shared settings, :func:`register_setting`) and ``{<other_rule>}`` another rule's threshold
            (``"{grad_vanish:g} .. {grad_explode:g}"``).
        settings: Default values of the settings that qualify the rule (patience, windows), written to
            ``thresholds()`` as ``"<rule_id>.<setting>"``.
        check: The id of the ``lightning-diag report`` checklist row the rule belongs to (:data:`CHECKS`), or
            ``None`` for a rule shown under "Other".
        source: Where the default comes from (``"seed 000 §3.1"``), or ``""`` for the project's own choice.
        limits: ``"threshold"`` or a setting name -> its allowed values (:class:`Limit`); a field without one
            takes any finite number ``>= 0``. The user sets the fields through the owner's ``rules=``
            (:func:`parse_rules`).
    """

    rule_id: str
    owner: str
    severity: SeverityName
    threshold: float | None
    title: str
    settings: Mapping[str, float] = dataclasses.field(default_factory=dict)
    check: str | None = None
    source: str = ""
    limits: Mapping[str, Limit] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.severity not in ("info", "warning", "critical"):
            raise ValueError(f"`severity` can be info, warning or critical, got {self.severity!r}")
        unknown = set(self.limits) - set(self.fields)
        if unknown:
            raise ValueError(f"`limits` of {self.rule_id!r} name no threshold or setting: {sorted(unknown)}")
        object.__setattr__(self, "settings", MappingProxyType(dict(self.settings)))
        object.__setattr__(self, "limits", MappingProxyType(dict(self.limits)))

    @property
    def fields(self) -> tuple[str, ...]:
        """The names a user sets in ``rules={rule_id: {...}}``: ``"threshold"`` (for a rule with one) and the
        settings."""
        return (*(("threshold",) if self.threshold is not None else ()), *self.settings)

    def limit(self, name: str) -> Limit:
        """The allowed values of ``"threshold"`` or a setting."""
        return self.limits.get(name, ANY_NON_NEGATIVE)

    def key(self, name: str) -> str:
        """The ``thresholds()`` key of ``"threshold"`` or a setting name."""
        return self.rule_id if name == "threshold" else f"{self.rule_id}.{name}"

    def value(self, thresholds: Mapping[str, float | None], name: str = "threshold") -> float:
        """The value in effect of ``"threshold"`` or a setting: ``thresholds[self.key(name)]``, else the default.

        Raises:
            KeyError: If ``name`` is neither ``"threshold"`` (of a rule with one) nor a declared setting.
        """
        given = thresholds.get(self.key(name))
        if given is not None:
            return float(given)
        fallback = self.threshold if name == "threshold" else self.settings[name]
        if fallback is None:
            raise KeyError(f"rule {self.rule_id!r} has no threshold")
        return float(fallback)

    def defaults(self) -> dict[str, float]:
        """``{rule_id: threshold, "rule_id.setting": value}``: the entries this rule adds to ``thresholds()``."""
        values: dict[str, float] = {}
        if self.threshold is not None:
            values[self.rule_id] = float(self.threshold)
        values.update({f"{self.rule_id}.{k}": float(v) for k, v in self.settings.items()})
        return values

    def describe(self, thresholds: Mapping[str, float] | None = None) -> str:
        """The title with the thresholds in effect filled in (the defaults where ``thresholds`` lacks one)."""
        return describe(self.title, thresholds, self)


@dataclasses.dataclass(frozen=True)
class SettingSpec:
    """A setting shared by several rules of one callback (``grad.patience``), written to ``thresholds()``.

    Attributes:
        key: The ``thresholds()`` key (``"<family>.<name>"``).
        owner: The callback it belongs to.
        default: Its default value.
        argument: The owner's constructor argument (and attribute) that sets it, for a setting of what the
            callback measures (``sample_size``); ``None`` for one set through ``rules={"<family>": {...}}``.
        rules: The rule ids it qualifies.
        limit: Its allowed values.
    """

    key: str
    owner: str
    default: float
    argument: str | None = None
    rules: tuple[str, ...] = ()
    limit: Limit = ANY_NON_NEGATIVE

    def value(self, thresholds: Mapping[str, float | None]) -> float:
        """The value in effect: ``thresholds[self.key]``, else the default."""
        given = thresholds.get(self.key)
        return float(self.default if given is None else given)

    @property
    def name(self) -> str:
        """The part after the dot: the field name titles use (``{patience}``)."""
        return self.key.rsplit(".", 1)[-1]


@dataclasses.dataclass(frozen=True)
class CheckSpec:
    """One row of the ``lightning-diag report`` checklist (seed 000 §7.1).

    Attributes:
        check_id: Stable row id (``grad_norm_band``); rules join it with ``RuleSpec(check=...)``.
        layer: ``Data``, ``Model``, ``Training`` or ``Deployment``.
        title: What is checked, a template filled like :attr:`RuleSpec.title` (any rule's threshold or setting).
        threshold: The criterion in words for rows no rule decides yet (``"< 0.1"``), else ``""``.
        threshold_value: The same as a number, for such rows.
    """

    check_id: str
    layer: ChecklistLayer
    title: str
    threshold: str = ""
    threshold_value: float | None = None

    @property
    def rules(self) -> tuple[str, ...]:
        """The rule ids declared with ``check=`` this row, in declaration order."""
        return tuple(s.rule_id for s in _RULES.values() if s.check == self.check_id)

    def describe(self, thresholds: Mapping[str, float] | None = None) -> str:
        """The title with the thresholds in effect filled in."""
        return describe(self.title, thresholds)


def describe(template: str, thresholds: Mapping[str, float] | None = None, spec: RuleSpec | None = None) -> str:
    """Fill a title template with the thresholds in effect (the registry's defaults where one is missing).

    Fields: ``{<rule_id>}`` (a threshold), ``{<rule_id>__<setting>}`` (a setting of any rule), and for a rule's
    own title ``{threshold}`` and ``{<setting>}`` (its settings and its owner's shared settings).

    Example:
        >>> describe("{grad_vanish:g} .. {grad_explode:g}", {"grad_explode": 20.0})
        '0.001 .. 20'
        >>> describe("{val_fluctuation__window:g} runs")
        '5 runs'
    """
    given = dict(thresholds or {})
    fields: dict[str, float] = {}
    for rule in _RULES.values():
        if rule.threshold is not None:
            fields[rule.rule_id] = float(given.get(rule.rule_id, rule.threshold))
        for name, value in rule.settings.items():
            fields[f"{rule.rule_id}__{name}"] = float(given.get(rule.key(name), value))
    if spec is not None:
        fields["threshold"] = fields.get(spec.rule_id, float("nan"))
        for setting in _SETTINGS.values():
            if setting.owner == spec.owner and (not setting.rules or spec.rule_id in setting.rules):
                fields[setting.name] = float(given.get(setting.key, setting.default))
        for name, value in spec.settings.items():
            fields[name] = float(given.get(spec.key(name), value))
    return string.Formatter().vformat(template, (), fields)


_RULES: dict[str, RuleSpec] = {}
_SETTINGS: dict[str, SettingSpec] = {}
_CHECKS: dict[str, CheckSpec] = {}
#: Where each entry was declared: (declaring module, running number), by table and key. The tables are kept sorted
#: by it, so their order is the modules' names, then the declaration order inside each module: the same whatever
#: order the declaring modules were imported in.
_ORIGINS: dict[str, tuple[str, int]] = {}
_SEQUENCE = itertools.count()
#: Every declared rule, by id, in declaration order by declaring module name (read-only view; the order does not
#: depend on the order the modules were imported in).
RULES: Mapping[str, RuleSpec] = MappingProxyType(_RULES)
#: Every shared setting, by key, ordered as :data:`RULES` (read-only view).
SETTINGS: Mapping[str, SettingSpec] = MappingProxyType(_SETTINGS)
#: Every checklist row, by id, in checklist order (read-only view).
CHECKS: Mapping[str, CheckSpec] = MappingProxyType(_CHECKS)


class _Owners(Mapping[str, str]):
    """Rule id -> owner callback, a live view of the registry (``rules.catalog.ALL_RULES``)."""

    def __getitem__(self, rule_id: str) -> str:
        return _RULES[rule_id].owner

    def __iter__(self) -> Iterator[str]:
        return iter(_RULES)

    def __len__(self) -> int:
        return len(_RULES)

    def __repr__(self) -> str:
        return repr(dict(self))


#: Rule id -> the callback that raises it (live: includes rules registered later).
OWNERS: Mapping[str, str] = _Owners()


def _declare(table: dict[str, _Spec], kind: str, key: str, spec: _Spec, module: str) -> None:
    """Put ``spec`` in ``table`` under ``key`` and keep the table in declaration order by module name (a repeated
    identical declaration keeps its first place)."""
    origin = f"{kind}:{key}"
    if origin not in _ORIGINS:
        _ORIGINS[origin] = (module, next(_SEQUENCE))
    table[key] = spec
    ordered = sorted(table.items(), key=lambda item: _ORIGINS[f"{kind}:{item[0]}"])
    table.clear()
    table.update(ordered)


def _caller() -> str:
    """The name of the module that called the ``register*`` function calling this."""
    return str(sys._getframe(2).f_globals.get("__name__", ""))


def register(spec: RuleSpec) -> RuleSpec:
    """Declare a rule. Declaring the same id twice with a different declaration is an error.

    Raises:
        ValueError: If ``spec.rule_id`` is already declared differently.
    """
    existing = _RULES.get(spec.rule_id)
    if existing is not None and existing != spec:
        raise ValueError(f"rule id {spec.rule_id!r} is already declared by {existing.owner}")
    _declare(_RULES, "rule", spec.rule_id, spec, _caller())
    return spec


def register_setting(spec: SettingSpec) -> SettingSpec:
    """Declare a setting shared by several rules of one callback.

    Raises:
        ValueError: If ``spec.key`` is already declared differently.
    """
    existing = _SETTINGS.get(spec.key)
    if existing is not None and existing != spec:
        raise ValueError(f"setting {spec.key!r} is already declared by {existing.owner}")
    _declare(_SETTINGS, "setting", spec.key, spec, _caller())
    return spec


def register_check(spec: CheckSpec) -> CheckSpec:
    """Declare a checklist row (rows appear in declaration order within their layer).

    Raises:
        ValueError: If ``spec.check_id`` is already declared differently, or ``spec.layer`` is unknown.
    """
    if spec.layer not in ("Data", "Model", "Training", "Deployment"):
        raise ValueError(f"`layer` can be Data, Model, Training or Deployment, got {spec.layer!r}")
    existing = _CHECKS.get(spec.check_id)
    if existing is not None and existing != spec:
        raise ValueError(f"check {spec.check_id!r} is already declared")
    _declare(_CHECKS, "check", spec.check_id, spec, _caller())
    return spec


def rules_of(owner: str) -> tuple[RuleSpec, ...]:
    """The rules a callback owns, in declaration order (by declaring module name, then within each module).

    Example:
        >>> [s.rule_id for s in rules_of("AttentionEntropyMonitor")]
        ['attn_logit_growth', 'attn_entropy_low', 'attn_entropy_high', 'attn_sink']
    """
    return tuple(s for s in _RULES.values() if s.owner == owner)


def settings_of(owner: str) -> tuple[SettingSpec, ...]:
    """The shared settings of a callback, in declaration order."""
    return tuple(s for s in _SETTINGS.values() if s.owner == owner)


def owner_of(rule_id: str) -> str | None:
    """The callback that raises ``rule_id``, or ``None`` for an unknown id."""
    spec = _RULES.get(rule_id)
    return spec.owner if spec is not None else None


def default_thresholds(owner: str | None = None) -> dict[str, float]:
    """The default ``thresholds()`` entries of one callback's rules and shared settings, or of every rule.

    Example:
        >>> default_thresholds("GradientFlowMonitor")["grad_layer_spread"]
        100.0
        >>> default_thresholds("GradientFlowMonitor")["grad.patience"]
        3.0
    """
    values: dict[str, float] = {}
    for spec in _RULES.values():
        if owner is None or spec.owner == owner:
            values.update(spec.defaults())
    for setting in _SETTINGS.values():
        if owner is None or setting.owner == owner:
            values[setting.key] = float(setting.default)
    return values


#: ``rules=`` of every callback: rule id -> ``{field: value}`` (``"threshold"`` or a setting name), ``False`` or
#: ``None`` to switch the rule off, ``True`` for its defaults; a family of shared settings (``"grad"``) ->
#: ``{setting: value}``. The nested form of the ``thresholds.json`` keys.
RuleChoices = Mapping[str, Mapping[str, float] | bool | None]


@dataclasses.dataclass(frozen=True)
class ParsedRules:
    """Validated ``rules=``: the values set (``thresholds()`` keys) and the rule ids switched off."""

    values: Mapping[str, float] = dataclasses.field(default_factory=dict)
    off: frozenset[str] = frozenset()


def owner_name(cls: type) -> str:
    """The class in ``cls``'s method resolution order that owns rules or shared settings (a subclass of a library
    callback owns its base's rules), or ``""``."""
    return next((k.__name__ for k in cls.__mro__ if rules_of(k.__name__) or settings_of(k.__name__)), "")


def parse_rules(owner: str, rules: object) -> ParsedRules:
    """Check a callback's ``rules=`` against the declarations of its rules and shared settings.

    Raises:
        TypeError: If ``rules`` is not a mapping, an entry not a mapping, bool or None, or a value not a number.
        ValueError: If it names a rule the owner does not raise, a field the rule does not declare, or a value
            out of its declared range; the message names the allowed ones.

    Example:
        >>> import lightning_diag.rules.catalog
        >>> parsed = parse_rules("GradientFlowMonitor", {"grad_vanish": {"threshold": 1e-4}, "grad_explode": False})
        >>> dict(parsed.values), sorted(parsed.off)
        ({'grad_vanish': 0.0001}, ['grad_explode'])
        >>> parse_rules("GradientFlowMonitor", {"grad": {"patience": 5}}).values["grad.patience"]
        5.0
    """
    if rules is None:
        return ParsedRules()
    specs = {s.rule_id: s for s in rules_of(owner)}
    families: dict[str, dict[str, SettingSpec]] = {}
    for setting in settings_of(owner):
        if setting.argument is None:
            family, _, name = setting.key.rpartition(".")
            families.setdefault(family, {})[name] = setting
    allowed = ", ".join([*specs, *families])
    shape = "a mapping of rule id to {field: value}, or to False to switch the rule off"
    if not isinstance(rules, Mapping):
        raise TypeError(f"Expected argument `rules` to be {shape} ({allowed}), but got {rules!r}")
    values: dict[str, float] = {}
    off: set[str] = set()
    for key, choice in rules.items():
        spec = specs.get(key)
        if spec is None and key not in families:
            raise ValueError(f"`rules` of {owner} can name {allowed}; got {key!r}")
        if choice is None or choice is False:
            if spec is None:
                raise ValueError(f"`rules[{key!r}]` is a family of settings, not a rule: it cannot be switched off")
            off.add(key)
            continue
        if choice is True:
            continue
        if not isinstance(choice, Mapping):
            raise TypeError(f"Expected `rules[{key!r}]` to be a mapping of field to value, True, False or None, "
                            f"but got {choice!r}")
        fields = spec.fields if spec is not None else tuple(families[key])
        for name, value in choice.items():
            if name not in fields:
                raise ValueError(f"`rules[{key!r}]` can set {', '.join(fields) or 'nothing'}; got {name!r}")
            limit = spec.limit(name) if spec is not None else families[key][name].limit
            full = spec.key(name) if spec is not None else f"{key}.{name}"
            values[full] = limit.check(f"rules[{key!r}][{name!r}]", value)
    return ParsedRules(values, frozenset(off))


def registry_thresholds(callback: object, parsed: ParsedRules | None = None) -> dict[str, float]:
    """The ``thresholds()`` of a callback instance: the defaults of its class's declared rules and shared
    settings, the values its ``rules=`` set (``parsed``), and the shared settings read from the constructor
    arguments their declarations name. A rule switched off has no entry.

    Example:
        >>> import lightning_diag.rules.catalog
        >>> class GradientFlowMonitor: ...
        >>> values = registry_thresholds(GradientFlowMonitor(), parse_rules("GradientFlowMonitor",
        ...                              {"grad_vanish": {"threshold": 1e-4}, "grad": {"patience": 5}}))
        >>> values["grad_vanish"], values["grad_explode"], values["grad.patience"]
        (0.0001, 10.0, 5.0)
    """
    owner = owner_name(type(callback))
    parsed = parsed or ParsedRules()
    values = default_thresholds(owner)
    for setting in settings_of(owner):
        if setting.argument is not None:
            given = getattr(callback, setting.argument, None)
            values[setting.key] = float(setting.default if given is None else given)
    values.update(parsed.values)
    for rule_id in parsed.off:
        spec = _RULES[rule_id]
        for key in [spec.rule_id, *(spec.key(name) for name in spec.settings)]:
            values.pop(key, None)
    return values


def default(key: str) -> float:
    """The default of one ``thresholds()`` key (``"loss_swing"``, ``"loss_swing.patience"``, ``"grad.patience"``).

    The ``DEFAULT_*`` constants of ``rules/`` are read with it.

    Raises:
        KeyError: If no rule or shared setting declares ``key``.

    Example:
        >>> default("loss_swing.patience")
        3.0
    """
    values = default_thresholds()
    if key not in values:
        raise KeyError(f"no rule or setting declares {key!r}")
    return values[key]


def value_of(thresholds: Mapping[str, float | None], key: str) -> float:
    """The value in effect of one ``thresholds()`` key: ``thresholds[key]``, else its declared default (a module
    that reads another's setting takes the key from the declaring module's ``*_KEY`` constant).

    Raises:
        KeyError: If ``thresholds`` lacks ``key`` and no rule or shared setting declares it.

    Example:
        >>> value_of({"loss_swing.patience": 5.0}, "loss_swing.patience"), value_of({}, "loss_swing.patience")
        (5.0, 3.0)
    """
    given = thresholds.get(key)
    return default(key) if given is None else float(given)
