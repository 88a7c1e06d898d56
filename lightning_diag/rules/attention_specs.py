"""Declarations of the attention rules (``attn_entropy_low``, ``attn_entropy_high``, ``attn_sink``), their
settings and the per-head statistics they are fed; the rules are in :mod:`lightning_diag.rules.attention_entropy`
and :mod:`lightning_diag.rules.attention_sink`, their exact meaning in :mod:`lightning_diag.rules.attention`."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

from lightning_diag.core.registry import RuleSpec, SettingSpec, default, register, register_setting

__all__ = [
    "ATTN_ENTROPY_HIGH",
    "ATTN_ENTROPY_HIGH_SPEC",
    "ATTN_ENTROPY_LOW",
    "ATTN_ENTROPY_LOW_SPEC",
    "ATTN_MAX_QUERIES_SETTING",
    "ATTN_PATIENCE_SETTING",
    "ATTN_SAMPLE_SIZE_SETTING",
    "ATTN_SINK",
    "ATTN_SINK_SPEC",
    "DEFAULT_ATTN_PATIENCE",
    "DEFAULT_ENTROPY_HIGH_THRESHOLD",
    "DEFAULT_ENTROPY_HIGH_UNIFORM_FRACTION",
    "DEFAULT_ENTROPY_HIGH_WARMUP_STEPS",
    "DEFAULT_ENTROPY_LOW_THRESHOLD",
    "DEFAULT_SINK_THRESHOLD",
    "LayerStats",
    "first_mass",
    "per_head",
]

# -- declarations (one per rule id; the docs' thresholds table and the report read them) -----------------------
_ATTN = "AttentionEntropyMonitor"
ATTN_ENTROPY_LOW_SPEC = register(RuleSpec(
    "attn_entropy_low", _ATTN, "warning", 0.5, "a head's attention entropy below {threshold:g} nats",
    check="attn_entropy_band", source="seed 000 §3.2", arguments={"threshold": "entropy_low_threshold"},
))
ATTN_ENTROPY_HIGH_SPEC = register(RuleSpec(
    "attn_entropy_high", _ATTN, "info", 2.5,
    "a head's attention entropy above {threshold:g} nats and {uniform_fraction:g} of uniform",
    settings={"uniform_fraction": 0.9, "warmup_steps": 200}, check="attn_entropy_band", source="seed 000 §3.2",
    arguments={"threshold": "entropy_high_threshold", "uniform_fraction": "entropy_high_uniform_fraction",
               "warmup_steps": "entropy_high_warmup_steps"},
))
ATTN_SINK_SPEC = register(RuleSpec(
    "attn_sink", _ATTN, "warning", 0.5,
    "every head of a layer puts more than {threshold:g} of its mass on special tokens",
    check="attn_sink", source="seed 000 §3.2", arguments={"threshold": "sink_threshold"},
))
ATTN_ENTROPY_LOW = ATTN_ENTROPY_LOW_SPEC.rule_id
ATTN_ENTROPY_HIGH = ATTN_ENTROPY_HIGH_SPEC.rule_id
ATTN_SINK = ATTN_SINK_SPEC.rule_id
#: ``attn.patience``: consecutive measurements an attention condition must hold before it alerts.
ATTN_PATIENCE_SETTING = register_setting(
    SettingSpec("attn.patience", _ATTN, 2, "patience", (ATTN_ENTROPY_LOW, ATTN_ENTROPY_HIGH, ATTN_SINK))
)
#: ``attn.sample_size``: sequences of the batch measured on a sampled step (the callback's sampling).
ATTN_SAMPLE_SIZE_SETTING = register_setting(SettingSpec("attn.sample_size", _ATTN, 8, "sample_size"))
#: ``attn.max_queries``: query positions per sequence measured on a sampled step (evenly spaced).
ATTN_MAX_QUERIES_SETTING = register_setting(SettingSpec("attn.max_queries", _ATTN, 64, "max_queries"))

#: ``attn_entropy_low``: a head's attention entropy below this many nats (seed 000 §3.2).
DEFAULT_ENTROPY_LOW_THRESHOLD = default(ATTN_ENTROPY_LOW)
#: ``attn_entropy_high``: a head's attention entropy above this many nats (seed 000 §3.2).
DEFAULT_ENTROPY_HIGH_THRESHOLD = default(ATTN_ENTROPY_HIGH)
#: ``attn_entropy_high``: ... and above this fraction of the entropy of uniform attention over its keys.
DEFAULT_ENTROPY_HIGH_UNIFORM_FRACTION = default(ATTN_ENTROPY_HIGH_SPEC.key("uniform_fraction"))
#: ``attn_entropy_high``: optimizer steps before the rule judges (a fresh model attends uniformly).
DEFAULT_ENTROPY_HIGH_WARMUP_STEPS = int(default(ATTN_ENTROPY_HIGH_SPEC.key("warmup_steps")))
#: ``attn_sink``: attention mass on special tokens that every head of a layer must exceed ("most of its mass").
DEFAULT_SINK_THRESHOLD = default(ATTN_SINK)
#: Consecutive measurements an attention condition must hold before it alerts.
DEFAULT_ATTN_PATIENCE = int(ATTN_PATIENCE_SETTING.default)


class LayerStats(NamedTuple):
    """One attention module's per-head statistics at one measured step (host floats, one per head).

    ``first_mass`` (mass on the first key each query may see; empty when unknown) and ``causal`` (whether the
    module's mask is causal) tell an attention sink of causal attention from a collapse.
    """

    entropy: Sequence[float]
    uniform: Sequence[float]
    special_mass: Sequence[float]
    special_share: Sequence[float]
    first_mass: Sequence[float] = ()
    causal: bool = False
    coverage: Sequence[float] = ()


def per_head(stats: LayerStats, values: Sequence[float]) -> list[float]:
    """``values`` (one per head), NaN where unknown (an empty sequence: not measured)."""
    n = len(stats.entropy)
    out = list(values)
    return out if len(out) == n else [math.nan] * n


def first_mass(stats: LayerStats) -> list[float]:
    """The mass on the first key each query may see, one per head (NaN where unknown)."""
    return per_head(stats, stats.first_mass)
