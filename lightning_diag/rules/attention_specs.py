"""Attention rules (framework-free): ``attn_entropy_low``, ``attn_entropy_high``, ``attn_sink``: their declarations,
settings and the per-head statistics they are fed. The rules are in :mod:`lightning_diag.rules.attention_entropy`
and :mod:`lightning_diag.rules.attention_sink`.

Fed, at each measured step, with every attention module's per-head statistics
(:class:`~lightning_diag.stats.attention_probs.HeadStats` as host floats). Exact meaning (each condition must hold on
``patience`` consecutive measurements of that head or layer; latching is per (rule, module, head)):

* ``attn_entropy_low``: a head's entropy below ``low`` nats (seed 000 §3.2: 0.5): the head looks at about one
  key (e^0.5 = 1.6 keys). Judged only where the head had room to spread: where uniform attention over its allowed
  keys would have at least ``2 * low`` nats (about 3 keys), so short or heavily masked rows never count as collapse.
  Low entropy alone is not a fault: trained language models keep previous-token, induction and copy heads far below
  0.5 nats. A **collapse** is a change, and the rule tells one from learned sharpness when the head's alarm begins
  (its entropy at the last measurement before it entered the band and the training loss there are remembered):

  - *every* head of the module (two or more heads judged) is low at once: the layer lands on one key: a
    **warning**;
  - the head **fell abruptly** (its entropy at the last measurement above ``low`` was at least
    :data:`ABRUPT_FALL` = 2 times its entropy at the first measurement in the band) **and** the training loss did
    not improve meanwhile (the mean of the last :data:`LOSS_POINTS` sampled losses is not below its value at that
    last measurement above the band), or the loss is unknown: a **warning** (logit growth, a bad update, a mask
    bug change attention from one measurement to the next and hurt the loss);
  - a head low from its first measurement (its fall was not seen) is judged as an abrupt one: a warning unless the
    loss improved between that first measurement and the alarm (a pretrained or built-in sharp head);
  - otherwise (a gradual descent, or an abrupt one while the loss fell: an induction head forming, a learned phase
    change): an ``info`` alert, a learned sharp head.

  Its margin (:attr:`~lightning_diag.rules.base.Rule.peaks`, for the calibration harness) is that of the warning:
  ``low`` over the largest entropy of the head's latest measurements the warning needs, where the head is judged a
  collapse (0 for a learned sharp head, a sink or an alignment).

  Measured: the nanoGPT-style model of the tests (2 layers, d 64) learning two interleaved counters sharpens its
  heads over 35 measurements while its loss falls 3.3 -> 0.2; the head that ends in the band (0.44 .. 0.54 nats,
  not a one-to-one alignment: coverage 0.55) enters it at 1.16x per measurement: one ``info`` alert, where the
  seed's rule warned. The demo's ``attention`` fault (every query on [CLS] from step 30) and the corpus's Llama
  logit-growth fault (query and key weights x8 at step 100: every head of both layers at 0.03 .. 0.04 nats five
  steps later, the loss rising) are whole-layer collapses: warnings at their first judged measurement.
* ``attn_entropy_high`` (severity ``info``): a head's entropy above ``high`` nats (seed 000 §3.2: 2.5, about
  12 keys) **and** above ``uniform_fraction`` of the uniform entropy over its allowed keys: the head still
  spreads its mass (nearly) evenly over everything. The second condition makes the band mean the same for long
  sequences: uniform over 128 keys is 4.85 nats, and a head at 3 nats there (about 20 keys) is focused, not
  diffuse. With fewer than e^2.5 = 12 allowed keys a head cannot exceed 2.5 nats and the rule is silent. Not
  judged before ``warmup_steps``: a freshly initialised model attends almost uniformly by construction, which is
  not an anomaly. It is informational, never a warning: spreading attention evenly is a legitimate solution when
  the task needs an average (the shipped demo task is solved that way; its heads stay at about 0.95 of uniform),
  and a hint of an untrained or frozen attention block when it does not.
* ``attn_sink``: **every** head of a layer puts more than ``sink_mass`` of its attention on the special keys
  ([CLS]/[SEP], BOS) and more than twice what uniform attention would put there (so a 3-token sequence whose two
  special tokens hold 2/3 of the keys is not a sink). In causal attention, when every head also puts more than
  ``sink_mass`` on the first visible key, the layer is a layer of attention-sink heads (healthy, see above): the
  alert is ``info``. Bidirectional attention ([CLS]/[SEP], seed 000 §3.2) stays a warning.

Attention logits are not measured: a logit growth shows as the abrupt fall and the loss it costs.

One event, one alert: the heads (``attn_entropy_*``) or modules (``attn_sink``) newly tripping one rule at the
same measurement make one alert naming them (count and the worst few); its ``source`` is the worst head
(``module/head_h``) or module and its ``value`` the worst value. Latching stays per head (per module for
``attn_sink``; :meth:`~lightning_diag.rules.base.Latch.for_patience`): an event alerts once; a head alerts again
after it has been out of the band on ``patience`` measurements, or when its entropy has fallen another 10x
(:data:`~lightning_diag.rules.base.WORSEN_FACTOR`) past ``low`` since its last alert. A head (module) in alarm
holds its event on a looser bound (hysteresis), so a measurement moving around the threshold from batch to batch is
one event:
``attn_entropy_low`` while below :data:`LOW_HOLD_FACTOR` x ``low`` (0.625 nats), ``attn_entropy_high`` while above
``uniform_fraction -`` :data:`HIGH_HOLD_MARGIN` of uniform (0.85) whatever ``high`` (the batch's room for 2.5 nats
changes, the head's diffuseness does not: the fine-tune corpus alerted 5 times for 2 events without it),
``attn_sink`` while every head keeps more than ``sink_mass -`` :data:`SINK_HOLD_MARGIN` (0.4). The ``info`` notes on
explained low entropy (causal attention sinks, one-to-one alignments) come once per module.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from lightning_diag.core.registry import (
    COUNT,
    FRACTION,
    POSITIVE,
    STEPS,
    CheckSpec,
    Limit,
    RuleSpec,
    SettingSpec,
    default,
    register,
    register_setting,
)
from lightning_diag.core.tags import prefix
from lightning_diag.rules.records import LayerStats
from lightning_diag.rules.rows import Check, LoggedRun, finite_values, fmt, measure, run_threshold

__all__ = [
    "ATTN_ENTROPY_BAND_CHECK",
    "ATTN_ENTROPY_HIGH",
    "ATTN_ENTROPY_HIGH_SPEC",
    "ATTN_ENTROPY_LOW",
    "ATTN_ENTROPY_LOW_SPEC",
    "ATTN_MAX_QUERIES_SETTING",
    "ATTN_PATIENCE_SETTING",
    "ATTN_SAMPLE_SIZE_SETTING",
    "ATTN_SINK",
    "ATTN_SINK_CHECK",
    "ATTN_SINK_SPEC",
    "DEFAULT_ATTN_PATIENCE",
    "DEFAULT_ENTROPY_HIGH_THRESHOLD",
    "DEFAULT_ENTROPY_HIGH_UNIFORM_FRACTION",
    "DEFAULT_ENTROPY_HIGH_WARMUP_STEPS",
    "DEFAULT_ENTROPY_LOW_THRESHOLD",
    "DEFAULT_SINK_THRESHOLD",
    "ENTROPY_HIGH_UNIFORM_FRACTION_KEY",
    "ENTROPY_HIGH_WARMUP_STEPS_KEY",
    "first_mass",
    "per_head",
]

# -- declarations (one per rule id; the docs' thresholds table and the report read them) -----------------------
_ATTN = "AttentionEntropyMonitor"
ATTN_ENTROPY_LOW_SPEC = register(RuleSpec(
    "attn_entropy_low", _ATTN, "warning", 0.5, "a head's attention entropy below {threshold:g} nats",
    check="attn_entropy_band", source="seed 000 §3.2", limits={"threshold": POSITIVE},
))
ATTN_ENTROPY_HIGH_SPEC = register(RuleSpec(
    "attn_entropy_high", _ATTN, "info", 2.5,
    "a head's attention entropy above {threshold:g} nats and {uniform_fraction:g} of uniform",
    settings={"uniform_fraction": 0.9, "warmup_steps": 200}, check="attn_entropy_band", source="seed 000 §3.2",
    limits={"threshold": POSITIVE, "uniform_fraction": Limit(low=0.0, high=1.0), "warmup_steps": STEPS},
))
ATTN_SINK_SPEC = register(RuleSpec(
    "attn_sink", _ATTN, "warning", 0.5,
    "every head of a layer puts more than {threshold:g} of its mass on special tokens",
    check="attn_sink", source="seed 000 §3.2", limits={"threshold": FRACTION},
))
ATTN_ENTROPY_LOW = ATTN_ENTROPY_LOW_SPEC.rule_id
ATTN_ENTROPY_HIGH = ATTN_ENTROPY_HIGH_SPEC.rule_id
ATTN_SINK = ATTN_SINK_SPEC.rule_id
#: Their rows of the ``lightning-diag report`` checklist (registered in report order by
#: :mod:`lightning_diag.rules.catalog`).
ATTN_ENTROPY_BAND_CHECK = CheckSpec(
    "attn_entropy_band", "Model",
    "Attention entropy of every head above {attn_entropy_low:g} nats, and not above {attn_entropy_high:g} nats "
    "while near uniform ({attn_entropy_high__uniform_fraction:g} of it) "
    "after step {attn_entropy_high__warmup_steps:g}",
)
ATTN_SINK_CHECK = CheckSpec(ATTN_SINK, "Model",
                            "No layer whose every head puts more than {attn_sink:g} of its mass on [CLS]/[SEP]")
#: ``thresholds()`` keys of ``attn_entropy_high``'s settings (read by its rule).
ENTROPY_HIGH_UNIFORM_FRACTION_KEY = ATTN_ENTROPY_HIGH_SPEC.key("uniform_fraction")
ENTROPY_HIGH_WARMUP_STEPS_KEY = ATTN_ENTROPY_HIGH_SPEC.key("warmup_steps")
#: ``attn.patience``: consecutive measurements an attention condition must hold before it alerts.
ATTN_PATIENCE_SETTING = register_setting(
    SettingSpec("attn.patience", _ATTN, 2, None, (ATTN_ENTROPY_LOW, ATTN_ENTROPY_HIGH, ATTN_SINK), COUNT)
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
DEFAULT_ENTROPY_HIGH_UNIFORM_FRACTION = default(ENTROPY_HIGH_UNIFORM_FRACTION_KEY)
#: ``attn_entropy_high``: optimizer steps before the rule judges (a fresh model attends uniformly).
DEFAULT_ENTROPY_HIGH_WARMUP_STEPS = int(default(ENTROPY_HIGH_WARMUP_STEPS_KEY))
#: ``attn_sink``: attention mass on special tokens that every head of a layer must exceed ("most of its mass").
DEFAULT_SINK_THRESHOLD = default(ATTN_SINK)
#: Consecutive measurements an attention condition must hold before it alerts.
DEFAULT_ATTN_PATIENCE = int(ATTN_PATIENCE_SETTING.default)


def per_head(stats: LayerStats, values: Sequence[float]) -> list[float]:
    """``values`` (one per head), NaN where unknown (an empty sequence: not measured)."""
    n = len(stats.entropy)
    out = list(values)
    return out if len(out) == n else [math.nan] * n


def first_mass(stats: LayerStats) -> list[float]:
    """The mass on the first key each query may see, one per head (NaN where unknown)."""
    return per_head(stats, stats.first_mass)


# -- the report's attn_sink row -----------------------------------------------------------------------------------


@measure(ATTN_SINK)
def _measure_attn_sink(run: LoggedRun, check: Check) -> bool:
    mass = run_threshold(run, ATTN_SINK)
    check.threshold = f"smallest head's special-token mass <= {fmt(mass)}" if mass is not None else "not logged"
    check.threshold_value = {"value": mass} if mass is not None else {}
    values = [v for t in run.tags(prefix(ATTN_SINK)) for v in finite_values(run.scalars[t])]
    if values:
        check.measured = f"special-token mass up to {fmt(max(values))}"
        check.measured_value = {"max": max(values)}
    return bool(values)
