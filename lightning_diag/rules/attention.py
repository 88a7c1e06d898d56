"""Attention rules (framework-free): ``attn_entropy_low``, ``attn_entropy_high``, ``attn_sink``.

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
(:data:`~lightning_diag.rules.base.WORSEN_FACTOR`) past ``low`` since its last alert. The ``info`` notes on
explained low entropy (causal attention sinks, one-to-one alignments) come once per module.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from lightning_diag.core.deprecation import renamed_constants
from lightning_diag.core.record import Alert, Severity
from lightning_diag.core.registry import RuleSpec, SettingSpec, default, register, register_setting
from lightning_diag.rules.base import Latch, Rule, StepContext, excess, name_layers

__all__ = [
    "ABRUPT_FALL",
    "ALIGNED_COVERAGE",
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
    "HIGH_HOLD_MARGIN",
    "LOSS_POINTS",
    "LOW_HOLD_FACTOR",
    "SINK_HOLD_MARGIN",
    "AttentionEntropyRule",
    "AttentionSinkRule",
    "LayerStats",
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
#: ``attn_entropy_low``: a low-entropy head whose queries' mean attention has at least this fraction of the
#: entropy ``min(queries, keys)`` one-hot rows can reach is a one-to-one alignment, not a collapse (measured: the
#: reversal alignment of the corpus's BART cross-attention 0.97..1.0, the collapsed heads of the Llama logit-growth
#: fault 0.56..0.75, every query on [CLS] 0).
ALIGNED_COVERAGE = 0.9
#: ``attn_entropy_low``: a head whose entropy fell by at least this factor from its last measurement above the band
#: to its first one in it fell abruptly (measured: the healthy nanoGPT copy heads at most 1.2x per measurement;
#: the demo attention fault 100x and more, the Llama logit-growth fault 5x and more).
ABRUPT_FALL = 2.0
#: ``attn_entropy_low``: sampled training losses averaged to tell whether the loss improved (one batch is noisy).
LOSS_POINTS = 3
#: ``attn_entropy_low`` hysteresis: a head in alarm stays in its event while its entropy is below this factor of
#: ``low`` (0.625 nats for 0.5): a head hovering around the threshold is one event, not one per crossing.
LOW_HOLD_FACTOR = 1.25
#: ``attn_entropy_high`` hysteresis: a head in alarm stays in its event while its entropy is above
#: ``uniform_fraction - HIGH_HOLD_MARGIN`` of uniform (0.85 for 0.9), whatever the absolute ``high``: the absolute
#: bound says whether a batch's sequences have room for diffuse attention, and the room changes from batch to batch
#: (measured: the fine-tune corpus's uniform entropy 2.45 .. 2.69 nats, 11.6 .. 14.7 keys, around the 2.5 bound),
#: the head's diffuseness does not (its frozen layer at 1.00 of uniform, the trained one at 0.97 .. 0.99).
HIGH_HOLD_MARGIN = 0.05
#: ``attn_sink`` hysteresis: a layer in alarm stays in its event while every head keeps more than ``sink_mass -
#: SINK_HOLD_MARGIN`` (0.4 for 0.5) on the special tokens (and twice its uniform share).
SINK_HOLD_MARGIN = 0.1
_SINK, _ALIGNED = ATTN_SINK, "aligned"
_COLLAPSE, _LEARNED = "collapse", "learned"


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


def _per_head(stats: LayerStats, values: Sequence[float]) -> list[float]:
    """``values`` (one per head), NaN where unknown (an empty sequence: not measured)."""
    n = len(stats.entropy)
    out = list(values)
    return out if len(out) == n else [math.nan] * n


def _first_mass(stats: LayerStats) -> list[float]:
    return _per_head(stats, stats.first_mass)


class AttentionEntropyRule(Rule):
    """``attn_entropy_low`` and ``attn_entropy_high``, per head.

    Example:
        >>> rule = AttentionEntropyRule(patience=2, warmup_steps=0)
        >>> spread = {"attn": LayerStats([1.8, 1.5], [2.7, 2.7], [0.0, 0.0], [0.1, 0.1])}
        >>> collapsed = {"attn": LayerStats([0.1, 1.5], [2.7, 2.7], [0.0, 0.0], [0.1, 0.1])}
        >>> feed = [(spread, 2.0), (collapsed, 2.5), (collapsed, 2.6), (collapsed, 2.6)]
        >>> [[(a.source, a.severity.value) for a in rule.update(x, StepContext(0, s), loss=loss)]
        ...  for s, (x, loss) in enumerate(feed)]
        [[], [], [('attn/head_0', 'warning')], []]
    """

    specs = (ATTN_ENTROPY_LOW_SPEC, ATTN_ENTROPY_HIGH_SPEC)
    state_keys = ("streaks", "heads", "losses")

    def __init__(
        self,
        low: float = DEFAULT_ENTROPY_LOW_THRESHOLD,
        high: float = DEFAULT_ENTROPY_HIGH_THRESHOLD,
        uniform_fraction: float = DEFAULT_ENTROPY_HIGH_UNIFORM_FRACTION,
        warmup_steps: int = DEFAULT_ENTROPY_HIGH_WARMUP_STEPS,
        patience: int = DEFAULT_ATTN_PATIENCE,
        sink_mass: float = DEFAULT_SINK_THRESHOLD,
    ) -> None:
        super().__init__()
        self.sink_mass = sink_mass
        self.low = low
        self.high = high
        self.uniform_fraction = uniform_fraction
        self.warmup_steps = warmup_steps
        self.patience = patience
        self.latch = Latch.for_patience(patience)
        self.streaks: dict[str, int] = {}
        # module/head_h -> [entropy and mean loss at its last measurement above the band, fall into the band]
        self.heads: dict[str, list[float]] = {}
        self.losses: list[float] = []

    @classmethod
    def from_settings(cls, thresholds: Mapping[str, float | None]) -> AttentionEntropyRule:
        """The rule with the thresholds in effect (see :meth:`Rule.from_settings`)."""
        return cls(
            ATTN_ENTROPY_LOW_SPEC.value(thresholds),
            ATTN_ENTROPY_HIGH_SPEC.value(thresholds),
            ATTN_ENTROPY_HIGH_SPEC.value(thresholds, "uniform_fraction"),
            int(ATTN_ENTROPY_HIGH_SPEC.value(thresholds, "warmup_steps")),
            int(ATTN_PATIENCE_SETTING.value(thresholds)),
            ATTN_SINK_SPEC.value(thresholds),
        )

    def update(self, layers: Mapping[str, LayerStats], ctx: StepContext, loss: float | None = None) -> list[Alert]:
        """Feed one measurement of every module's heads (and the training loss of the measured batch, when
        known); return the alerts raised.

        Latching and streaks are per (rule, module, head); the heads newly tripping one rule at this measurement
        make one alert naming them (count and the worst few), whose ``source`` is the worst head. Low heads are
        split into collapses (warnings) and learned sharp heads (``info``), see the module's docstring.
        """
        known = loss is not None and math.isfinite(loss)
        if known:
            self.losses = [*self.losses, float(loss)][-LOSS_POINTS:]  # type: ignore[arg-type]
        mean_loss = sum(self.losses) / len(self.losses) if known else math.nan
        notes = []
        tripped: dict[str, dict[str, tuple[float, float]]] = {
            _COLLAPSE: {}, _LEARNED: {}, ATTN_ENTROPY_HIGH: {}
        }  # fmt: skip
        judge_high = ctx.global_step >= self.warmup_steps
        for module, stats in layers.items():
            explained: dict[str, list[tuple[int, float, float]]] = {_SINK: [], _ALIGNED: []}
            heads = list(
                zip(stats.entropy, stats.uniform, _first_mass(stats), _per_head(stats, stats.coverage), strict=True)
            )
            judged = [h for h in heads if math.isfinite(h[0]) and math.isfinite(h[1]) and h[1] >= 2 * self.low]
            # every judged head of the layer on about one key, none of them explained: the layer collapsed
            whole_layer = len(judged) >= 2 and all(
                ent < self.low and not (stats.causal and first > self.sink_mass) and not cover >= ALIGNED_COVERAGE
                for ent, _, first, cover in judged
            )
            for h, (ent, uni, first, cover) in enumerate(heads):
                if not (math.isfinite(ent) and math.isfinite(uni)):
                    continue
                source = f"{module}/head_{h}"
                room = uni >= 2 * self.low
                low = room and ent < self.low
                # causal attention parked on the first visible key: an attention sink, not a collapse
                sink = low and stats.causal and first > self.sink_mass
                # each query on its own key (the queries together cover the keys): an alignment, not a collapse
                aligned = low and not sink and cover >= ALIGNED_COVERAGE
                low = low and not (sink or aligned)
                high = judge_high and ent > self.high and ent > self.uniform_fraction * uni
                kind = self._track(source, ent, mean_loss, room, low, whole_layer)
                checks = ((ATTN_ENTROPY_LOW, low), (ATTN_ENTROPY_HIGH, high), (_SINK, sink), (_ALIGNED, aligned))
                for rule, bad in checks:
                    key = f"{rule}:{source}"
                    if rule in explained:  # streaks kept only while running: the state stays small
                        streak = self.streaks.pop(key, 0) + 1 if bad else 0
                        if streak:
                            self.streaks[key] = streak
                        if streak >= self.patience:
                            explained[rule].append((h, ent, first if rule == _SINK else cover))
                        continue
                    if self.latch.is_active(key):  # hysteresis: an event in alarm holds on a looser bound
                        if rule == ATTN_ENTROPY_LOW:
                            bad = bad or (room and not (sink or aligned) and ent < LOW_HOLD_FACTOR * self.low)
                        else:
                            bad = bad or (judge_high and ent > (self.uniform_fraction - HIGH_HOLD_MARGIN) * uni)
                    self.streaks[key] = self.streaks.get(key, 0) + 1 if bad else 0
                    over = excess(ent, self.low, above=False) if rule == ATTN_ENTROPY_LOW else None
                    if self.latch.update(key, self.streaks[key] >= self.patience, excess=over):
                        tripped[kind if rule == ATTN_ENTROPY_LOW else rule][source] = (ent, uni)
            for kind, held in explained.items():
                # one note per module and kind, ever: the latch key is never cleared
                if held and self.latch.update(f"{kind}:{module}", True):
                    notes.append(self._note(kind, module, held, len(stats.entropy), ctx))
        alerts = [self._entropy_alert(kind, heads, ctx) for kind, heads in tripped.items() if heads]
        return alerts + notes

    def _track(self, source: str, ent: float, mean_loss: float, room: bool, low: bool, whole_layer: bool) -> str:
        """Keep the head's history; ``"collapse"`` or ``"learned"``: what a low-entropy alarm beginning now is."""
        if not low:
            if room and ent >= self.low:  # above the band: the reference an entry into it is compared with
                self.heads[source] = [ent, mean_loss, math.nan]
            return _LEARNED
        entry = self.heads.get(source)
        if entry is None:  # low from its first measurement: the fall was not seen, the loss is compared from here
            self.heads[source] = entry = [math.nan, mean_loss, math.inf]
        before, before_loss, fall = entry
        if math.isnan(fall):  # the first measurement in the band
            entry[2] = fall = before / ent if ent > 0 else math.inf
        if whole_layer:
            return _COLLAPSE
        improved = math.isfinite(mean_loss) and math.isfinite(before_loss) and mean_loss < before_loss
        return _COLLAPSE if fall >= ABRUPT_FALL and not improved else _LEARNED

    def _note(
        self, kind: str, module: str, heads: list[tuple[int, float, float]], total: int, ctx: StepContext
    ) -> Alert:
        """The ``info`` note on heads whose low entropy is explained (an attention sink or an alignment)."""
        named = ", ".join(f"head_{h} ({ent:.2g} nats, {v:.0%})" for h, ent, v in heads[:4])
        named += f" and {len(heads) - 4} more" if len(heads) > 4 else ""
        if kind == _SINK:
            what = (
                f"(causal attention) put more than {self.sink_mass:.0%} of their attention on the first key each "
                f"query may see: {named}. Their entropy is below {self.low:g} nats, but this is an attention sink, "
                "the usual resting place of a causal head with nothing to add (Xiao et al. 2023), not a collapse"
            )
            threshold = self.sink_mass
        else:
            what = (
                f"look at one key per query, a different key for each query (their queries together cover "
                f"{ALIGNED_COVERAGE:.0%} or more of the keys evenly): {named}. Their entropy is below {self.low:g} "
                "nats, but this is a one-to-one alignment (copying, reordering, a previous-token head), not a "
                "collapse onto a dominating position"
            )
            threshold = ALIGNED_COVERAGE
        return self._alert(
            ctx,
            f"{len(heads)} of {total} heads of `{module}` {what}",
            source=module,
            value=min(v for _, _, v in heads),
            threshold=threshold,
            rule=ATTN_ENTROPY_LOW,
            severity=Severity.INFO,
        )

    def _entropy_alert(self, kind: str, heads: Mapping[str, tuple[float, float]], ctx: StepContext) -> Alert:
        """One alert for the heads newly tripping ``kind`` (``"collapse"``, ``"learned"`` or
        ``attn_entropy_high``; ``{module/head_h: (entropy, uniform)}``)."""
        low = kind != ATTN_ENTROPY_HIGH
        rule = ATTN_ENTROPY_LOW if low else ATTN_ENTROPY_HIGH
        entropy = {source: ent for source, (ent, _) in heads.items()}
        worst = (min if low else max)(entropy, key=entropy.__getitem__)
        ent, uni = heads[worst]
        if len(heads) == 1:
            where = f"of `{worst}` is {ent:.3g} nats"
            uniform = f"uniform over its keys: {uni:.3g}"
            head = "the head"
        else:
            head = "each head"
            where = f"of {_name_heads(entropy, worst_first=not low)}"
            uniform = f"uniform over the keys of `{worst}`: {uni:.3g}"
        if kind == _COLLAPSE:
            message = (
                f"attention entropy {where}, below {self.low:g} ({uniform}) on {self.patience} consecutive "
                f"measurements, reached by an abrupt fall (more than {ABRUPT_FALL:g}x in one measurement) while the "
                f"loss did not improve, or by every head of the layer: {head} collapsed onto about one token; check "
                "for attention collapse (masks, a dominating position, growing attention logits, too high a "
                "learning rate)"
            )
            threshold = self.low
        elif kind == _LEARNED:
            message = (
                f"attention entropy {where}, below {self.low:g} ({uniform}) on {self.patience} consecutive "
                f"measurements: {head} sharpened onto about one token gradually, or while the loss improved (a "
                "previous-token, induction or copy head); information, not a collapse"
            )
            threshold = self.low
        else:
            message = (
                f"attention entropy {where}, above {self.high:g} and {ent / uni:.0%} of uniform ({uniform}) on "
                f"{self.patience} consecutive measurements after {self.warmup_steps} steps: {head} still attends "
                "evenly to everything; check its learning rate, whether its parameters are trained, and the "
                "positional information"
            )
            threshold = self.high
        # Diffuse attention is an info alert: averaging over every token is a legitimate learned solution (the
        # shipped demo task is solved that way), so it must never count as a warning on a healthy run; so is a
        # head that sharpened by learning.
        severity = Severity.WARNING if kind == _COLLAPSE else Severity.INFO
        return self._alert(ctx, message, source=worst, value=ent, threshold=threshold, rule=rule, severity=severity)


def _modules(sources: Mapping[str, object]) -> int:
    """How many modules the ``module/head_h`` sources belong to."""
    return len({source.rpartition("/head_")[0] for source in sources})


def _name_heads(values: Mapping[str, float], worst_first: bool) -> str:
    """``"8 heads in 1 module: `m/head_3` 0.01, ... and 5 more"`` (:func:`~lightning_diag.rules.base.name_layers`)."""
    n = _modules(values)
    return name_layers(values, worst_first=worst_first, noun=f"heads in {n} module{'s' if n > 1 else ''}")


class AttentionSinkRule(Rule):
    """``attn_sink``: every head of a layer puts most of its mass on the special tokens.

    Example:
        >>> rule = AttentionSinkRule(patience=1)
        >>> sink = {"attn": LayerStats([0.2, 0.3], [2.7, 2.7], [0.9, 0.8], [0.13, 0.13])}
        >>> [a.rule for a in rule.update(sink, StepContext(0, 5))]
        ['attn_sink']
    """

    specs = (ATTN_SINK_SPEC,)
    state_keys = ("streaks",)

    def __init__(self, sink_mass: float = DEFAULT_SINK_THRESHOLD, patience: int = DEFAULT_ATTN_PATIENCE) -> None:
        super().__init__()
        self.sink_mass = sink_mass
        self.patience = patience
        self.latch = Latch.for_patience(patience)
        self.streaks: dict[str, int] = {}

    @classmethod
    def from_settings(cls, thresholds: Mapping[str, float | None]) -> AttentionSinkRule:
        """The rule with the thresholds in effect (see :meth:`Rule.from_settings`)."""
        return cls(ATTN_SINK_SPEC.value(thresholds), int(ATTN_PATIENCE_SETTING.value(thresholds)))

    def update(self, layers: Mapping[str, LayerStats], ctx: StepContext) -> list[Alert]:
        """Feed one measurement of every module's heads; return the alerts raised.

        Latching and streaks are per module; the modules newly sinking at this measurement make one alert naming
        them (one for causal layers of attention-sink heads, ``info``; one for the others), whose ``source`` is
        the module whose heads sink most (largest least-mass).
        """
        causal: dict[str, float] = {}
        sunk_modules: dict[str, float] = {}
        first_least: dict[str, float] = {}
        for module, stats in layers.items():
            pairs = [
                (m, s)
                for m, s in zip(stats.special_mass, stats.special_share, strict=True)
                if math.isfinite(m) and math.isfinite(s)
            ]
            if not pairs:
                continue
            sunk = all(m > self.sink_mass and m > 2 * s for m, s in pairs)
            if self.latch.is_active(module):  # hysteresis: a sinking layer stays in its event on a looser bound
                sunk = sunk or all(m > self.sink_mass - SINK_HOLD_MARGIN and m > 2 * s for m, s in pairs)
            least = min(m for m, _ in pairs)
            self.streaks[module] = self.streaks.get(module, 0) + 1 if sunk else 0
            if self.latch.update(module, self.streaks[module] >= self.patience):
                first = _first_mass(stats)
                if stats.causal and all(f > self.sink_mass for f in first):  # NaN (unknown) compares False
                    causal[module] = least
                    first_least[module] = min(first)
                else:
                    sunk_modules[module] = least
        alerts = []
        if sunk_modules:
            alerts.append(self._sink_alert(sunk_modules, ctx))
        if causal:
            alerts.append(self._causal_note(causal, first_least, ctx))
        return alerts

    def _causal_note(self, least: Mapping[str, float], first: Mapping[str, float], ctx: StepContext) -> Alert:
        worst = max(least, key=least.__getitem__)
        if len(least) == 1:
            which = f"every head of `{worst}` (causal attention) puts"
            firsts = f"least: {first[worst]:.0%}"
        else:
            which = f"in {name_layers(least)} (causal attention; each layer's least head), every head puts"
            firsts = f"least in `{worst}`: {first[worst]:.0%}"
        return self._alert(
            ctx,
            f"{which} more than {self.sink_mass:.0%} of its attention on the first key each query may see "
            f"({firsts}) on {self.patience} consecutive measurements: a layer of attention-sink heads, the usual "
            "resting place of causal heads with nothing to add (Xiao et al. 2023); information, not a fault",
            source=worst,
            value=least[worst],
            threshold=self.sink_mass,
            severity=Severity.INFO,
        )

    def _sink_alert(self, least: Mapping[str, float], ctx: StepContext) -> Alert:
        worst = max(least, key=least.__getitem__)
        if len(least) == 1:
            which = f"every head of `{worst}` puts"
            mass = f"least: {least[worst]:.0%}"
        else:
            which = f"in {name_layers(least)} (each layer's least head), every head puts"
            mass = f"least in `{worst}`: {least[worst]:.0%}"
        return self._alert(
            ctx,
            f"{which} more than {self.sink_mass:.0%} of its attention on the special tokens ({mass}) on "
            f"{self.patience} consecutive measurements: the layer attends to [CLS]/[SEP] instead of the content; "
            "check masks, positional encodings and whether the layer still learns",
            source=worst,
            value=least[worst],
            threshold=self.sink_mass,
        )

# Names before issue 20's naming scheme, served with a DeprecationWarning for one release.
__getattr__ = renamed_constants(
    __name__,
    {
        "DEFAULT_ENTROPY_LOW": "DEFAULT_ENTROPY_LOW_THRESHOLD",
        "DEFAULT_ENTROPY_HIGH": "DEFAULT_ENTROPY_HIGH_THRESHOLD",
        "DEFAULT_UNIFORM_FRACTION": "DEFAULT_ENTROPY_HIGH_UNIFORM_FRACTION",
        "DEFAULT_ATTN_WARMUP_STEPS": "DEFAULT_ENTROPY_HIGH_WARMUP_STEPS",
        "DEFAULT_SINK_MASS": "DEFAULT_SINK_THRESHOLD",
    },
)
