"""The rule registry: one declaration per rule id.

Every rule the library can raise is declared here exactly once, with the callback that owns it, its severity,
its default threshold and settings, a title with the threshold filled in, and the checklist row of
``lightning-diag report`` it belongs to. ``ALL_RULES``, the callbacks' ``thresholds()``, the report's defaults
and titles, and the docs' thresholds table all derive from these declarations.

This module imports nothing but the standard library, so the report can read it without torch or Lightning.

Example:
    >>> spec = RULES["grad_explode"]
    >>> spec.owner, spec.severity, spec.threshold
    ('GradientFlowMonitor', 'warning', 10.0)
    >>> spec.describe()
    "a layer's gradient above 10"
    >>> spec.describe({"grad_explode": 5.0})
    "a layer's gradient above 5"
"""

from __future__ import annotations

import dataclasses
import string
from collections.abc import Mapping
from types import MappingProxyType
from typing import Literal

__all__ = [
    "RULES",
    "RuleSpec",
    "SeverityName",
    "default_thresholds",
    "owner_of",
    "register",
    "rules_of",
]

SeverityName = Literal["info", "warning", "critical"]


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
            ``{threshold}`` is this rule's threshold, ``{<setting>}`` one of its settings and ``{<other_rule>}``
            another rule's threshold (``"{grad_vanish:g} .. {grad_explode:g}"``).
        settings: Default values of the settings that qualify the rule (patience, windows), written to
            ``thresholds()`` as ``"<rule_id>.<setting>"``.
        check: The id of the ``lightning-diag report`` checklist row the rule belongs to, or ``None`` for a
            rule shown under "Other".
        source: Where the default comes from (``"seed 000 §3.1"``), or ``""`` for the project's own choice.
    """

    rule_id: str
    owner: str
    severity: SeverityName
    threshold: float | None
    title: str
    settings: Mapping[str, float] = dataclasses.field(default_factory=dict)
    check: str | None = None
    source: str = ""

    def __post_init__(self) -> None:
        if self.severity not in ("info", "warning", "critical"):
            raise ValueError(f"`severity` can be info, warning or critical, got {self.severity!r}")
        object.__setattr__(self, "settings", MappingProxyType(dict(self.settings)))

    def defaults(self) -> dict[str, float]:
        """``{rule_id: threshold, "rule_id.setting": value}``: the entries this rule adds to ``thresholds()``."""
        values: dict[str, float] = {}
        if self.threshold is not None:
            values[self.rule_id] = float(self.threshold)
        values.update({f"{self.rule_id}.{k}": float(v) for k, v in self.settings.items()})
        return values

    def describe(self, thresholds: Mapping[str, float] | None = None) -> str:
        """The title with the thresholds in effect filled in (the defaults where ``thresholds`` lacks one)."""
        given = dict(thresholds or {})
        fields: dict[str, float] = {}
        for spec in RULES.values():
            if spec.threshold is not None:
                fields[spec.rule_id] = float(given.get(spec.rule_id, spec.threshold))
        fields["threshold"] = fields.get(self.rule_id, float("nan"))
        for key, value in self.settings.items():
            fields[key] = float(given.get(f"{self.rule_id}.{key}", value))
        return string.Formatter().vformat(self.title, (), fields)


_RULES: dict[str, RuleSpec] = {}
#: Every declared rule, by id (read-only view).
RULES: Mapping[str, RuleSpec] = MappingProxyType(_RULES)


def register(spec: RuleSpec) -> RuleSpec:
    """Declare a rule. Declaring the same id twice with a different declaration is an error.

    Raises:
        ValueError: If ``spec.rule_id`` is already declared differently.
    """
    existing = _RULES.get(spec.rule_id)
    if existing is not None and existing != spec:
        raise ValueError(f"rule id {spec.rule_id!r} is already declared by {existing.owner}")
    _RULES[spec.rule_id] = spec
    return spec


def rules_of(owner: str) -> tuple[RuleSpec, ...]:
    """The rules a callback owns, in declaration order.

    Example:
        >>> [s.rule_id for s in rules_of("AttentionEntropyMonitor")]
        ['attn_entropy_low', 'attn_entropy_high', 'attn_sink']
    """
    return tuple(s for s in _RULES.values() if s.owner == owner)


def owner_of(rule_id: str) -> str | None:
    """The callback that raises ``rule_id``, or ``None`` for an unknown id."""
    spec = _RULES.get(rule_id)
    return spec.owner if spec is not None else None


def default_thresholds(owner: str | None = None) -> dict[str, float]:
    """The default ``thresholds()`` entries of one callback's rules, or of every rule.

    Example:
        >>> default_thresholds("GradientFlowMonitor")["grad_layer_spread"]
        100.0
    """
    values: dict[str, float] = {}
    for spec in _RULES.values():
        if owner is None or spec.owner == owner:
            values.update(spec.defaults())
    return values


# -- declarations ---------------------------------------------------------------------------------------------
# One block per callback. Defaults are the seeds' numbers (DESIGN.md's thresholds table); the rules/ modules'
# DEFAULT_* constants are these values, read from here.

_ALARM = "AnomalyAlarm"
register(RuleSpec("nonfinite_loss", _ALARM, "critical", None, "NaN/Inf in the loss", check="nonfinite",
                  source="seed 000 §4.2"))
register(RuleSpec("nonfinite_grad", _ALARM, "critical", None, "NaN/Inf in a gradient before the optimizer step",
                  settings={"max_scaler_overflows": 5}, check="nonfinite", source="seed 000 §4.2"))
register(RuleSpec("loss_swing", _ALARM, "warning", 0.10,
                  "training loss swings by more than {threshold:.0%} on {patience:g} consecutive epochs",
                  settings={"patience": 3, "min_delta": 1e-3}, check="loss_swing", source="seed 001 §1.2"))
register(RuleSpec("val_decline", _ALARM, "warning", 5.0,
                  "validation metric worsens on {threshold:g} consecutive validation runs",
                  settings={"min_delta": 0.0}, check="val_decline", source="seed 001 §1.2"))
register(RuleSpec("val_fluctuation", _ALARM, "warning", 2.0,
                  "validation-loss fluctuation above {threshold:g}x the training-loss fluctuation",
                  settings={"window": 5, "min": 0.15, "min_range": 0.01}, check="val_fluctuation",
                  source="seed 000 §4.1"))
register(RuleSpec("loss_stagnant", _ALARM, "warning", 0.10,
                  "training loss has not fallen {threshold:.0%} below its initial value after {patience:g} points",
                  settings={"patience": 4, "baseline_steps": 5}))

_GRAD = "GradientFlowMonitor"
register(RuleSpec("grad_vanish", _GRAD, "warning", 1e-3,
                  "a weight matrix's ||g||/||W|| below {threshold:g} and {relative:g}x below the best-fed block "
                  "matrix, after step {warmup_steps:g}",
                  settings={"relative": 100.0, "warmup_steps": 50}, check="grad_norm_band",
                  source="seed 000 §3.1"))
register(RuleSpec("grad_explode", _GRAD, "warning", 1e1, "a layer's RMS gradient per element above {threshold:g}",
                  check="grad_norm_band", source="seed 000 §3.1"))
register(RuleSpec("grad_layer_spread", _GRAD, "warning", 100.0,
                  "largest / smallest ||g||/||W|| of one role across blocks above {threshold:g}",
                  settings={"warmup_steps": 50}, check="grad_spread", source="seed 000 §3.1"))
register(RuleSpec("grad_collapse", _GRAD, "warning", 0.01,
                  "blocks' gradient norm below {threshold:g} of its early baseline (converged: info; dead or "
                  "vanished: warning)",
                  settings={"baseline_measurements": 5, "converged_fraction": 0.1}, check="grad_collapse",
                  source="seed 001 §1.2"))
register(RuleSpec("grad_frozen", _GRAD, "warning", None,
                  "a trainable parameter that cannot learn (in no optimizer, or never gets a gradient); "
                  "requires_grad=False is an info"))

_ATTN = "AttentionEntropyMonitor"
register(RuleSpec("attn_entropy_low", _ATTN, "warning", 0.5, "a head's attention entropy below {threshold:g} nats",
                  check="attn_entropy_band", source="seed 000 §3.2"))
register(RuleSpec("attn_entropy_high", _ATTN, "info", 2.5,
                  "a head's attention entropy above {threshold:g} nats and {uniform_fraction:g} of uniform",
                  settings={"uniform_fraction": 0.9, "warmup_steps": 200}, check="attn_entropy_band",
                  source="seed 000 §3.2"))
register(RuleSpec("attn_sink", _ATTN, "warning", 0.5,
                  "every head of a layer puts more than {threshold:g} of its mass on special tokens",
                  check="attn_sink", source="seed 000 §3.2"))
