"""``attn_entropy_low`` and ``attn_entropy_high``: per-head entropy collapse, learned sharpness and diffusion
(framework-free; the exact meaning is in :mod:`lightning_diag.rules.attention_specs`)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import ClassVar

from lightning_diag.core.record import Alert, Severity
from lightning_diag.core.registry import RULES
from lightning_diag.core.tags import attn_head, attn_mean, attn_uniform_tag, loss_tag
from lightning_diag.rules.attention_specs import (
    ATTN_ENTROPY_HIGH,
    ATTN_ENTROPY_HIGH_SPEC,
    ATTN_ENTROPY_LOW,
    ATTN_ENTROPY_LOW_SPEC,
    ATTN_PATIENCE_SETTING,
    ATTN_SINK,
    DEFAULT_ATTN_PATIENCE,
    DEFAULT_ENTROPY_HIGH_THRESHOLD,
    DEFAULT_ENTROPY_HIGH_UNIFORM_FRACTION,
    DEFAULT_ENTROPY_HIGH_WARMUP_STEPS,
    DEFAULT_ENTROPY_LOW_THRESHOLD,
    DEFAULT_SINK_THRESHOLD,
    first_mass,
    per_head,
)
from lightning_diag.rules.base import Latch, Rule, StepContext, excess, name_layers
from lightning_diag.rules.measures import Measure, Measures
from lightning_diag.rules.records import LayerStats
from lightning_diag.rules.rows import (
    Check,
    LoggedRun,
    Series,
    band_threshold,
    finite_values,
    fmt,
    measure,
    replay,
    values_by_step,
)

__all__ = [
    "ABRUPT_FALL",
    "ALIGNED_COVERAGE",
    "HIGH_HOLD_MARGIN",
    "LOSS_POINTS",
    "LOW_HOLD_FACTOR",
    "AttentionEntropyRule",
]

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
#: ``attn_entropy_low``: extra measurements a whole layer peaked since its first measurement waits for the sampled
#: loss to fall below its level at that first measurement before it is called a collapse (a run whose loss stays
#: flat for its first tens of steps, as Lightning's demo transformer's does for 30, learns with such a layer).
START_HOLD = 8
#: ``attn_entropy_low`` hysteresis: a head in alarm stays in its event while its entropy is below this factor of
#: ``low`` (0.625 nats for 0.5): a head hovering around the threshold is one event, not one per crossing.
LOW_HOLD_FACTOR = 1.25
#: ``attn_entropy_high`` hysteresis: a head in alarm stays in its event while its entropy is above
#: ``uniform_fraction - HIGH_HOLD_MARGIN`` of uniform (0.85 for 0.9), whatever the absolute ``high``: the absolute
#: bound says whether a batch's sequences have room for diffuse attention, and the room changes from batch to batch
#: (measured: the fine-tune corpus's uniform entropy 2.45 .. 2.69 nats, 11.6 .. 14.7 keys, around the 2.5 bound),
#: the head's diffuseness does not (its frozen layer at 1.00 of uniform, the trained one at 0.97 .. 0.99).
HIGH_HOLD_MARGIN = 0.05
_SINK, _ALIGNED = ATTN_SINK, "aligned"
_COLLAPSE, _LEARNED = "collapse", "learned"


class AttentionEntropyRule(Rule):
    """``attn_entropy_low`` and ``attn_entropy_high``, per head.

    Example:
        >>> from lightning_diag.rules.records import LayerStats
        >>> rule = AttentionEntropyRule(patience=2, warmup_steps=0)
        >>> spread = {"attn": LayerStats([1.8, 1.5], [2.7, 2.7], [0.0, 0.0], [0.1, 0.1])}
        >>> collapsed = {"attn": LayerStats([0.1, 1.5], [2.7, 2.7], [0.0, 0.0], [0.1, 0.1])}
        >>> feed = [(spread, 2.0), (collapsed, 2.5), (collapsed, 2.6), (collapsed, 2.6)]
        >>> [[(a.source, a.severity.value) for a in rule.judge(StepContext(0, s), Measures(attention=x, loss=loss))]
        ...  for s, (x, loss) in enumerate(feed)]
        [[], [], [('attn/head_0', 'warning')], []]
    """

    specs = (ATTN_ENTROPY_LOW_SPEC, ATTN_ENTROPY_HIGH_SPEC)
    setting_keys: ClassVar[Mapping[str, str]] = {
        "low": ATTN_ENTROPY_LOW, "high": ATTN_ENTROPY_HIGH, "patience": ATTN_PATIENCE_SETTING.key,
        "sink_mass": ATTN_SINK,
    }
    needs = frozenset({Measure.ATTENTION})
    optional = frozenset({Measure.LOSS})
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

    def judge(self, ctx: StepContext, m: Measures) -> list[Alert]:
        """Judge one measurement of every module's heads (and the training loss of the measured batch, when
        known); return the alerts raised.

        Latching and streaks are per (rule, module, head); the heads newly tripping one rule at this measurement
        make one alert naming them (count and the worst few), whose ``source`` is the worst head. Low heads are
        split into collapses (warnings) and learned sharp heads (``info``), see the module's docstring.
        """
        layers, loss = m.attention or {}, m.loss
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
                zip(stats.entropy, stats.uniform, first_mass(stats), per_head(stats, stats.coverage), strict=True)
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
                # the margin of the warning: the largest entropy of the latest measurements it needs, where the
                # head's fall is a collapse (a learned sharp head is an info, a sink or an alignment a note)
                need_low = self.patience + (START_HOLD if kind == _COLLAPSE and self._from_start(source) else 0)
                self.observe_held(
                    source,
                    excess(ent, self.low, above=False) if room and not (sink or aligned) else math.nan,
                    need_low,
                    math.inf if kind == _COLLAPSE else 0.0,
                    rule=ATTN_ENTROPY_LOW,
                )
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
                    # peaked from the start: give the loss time to show it learns
                    need = need_low if rule == ATTN_ENTROPY_LOW else self.patience
                    over = excess(ent, self.low, above=False) if rule == ATTN_ENTROPY_LOW else None
                    if self.latch.update(key, self.streaks[key] >= need, excess=over):
                        tripped[kind if rule == ATTN_ENTROPY_LOW else rule][source] = (ent, uni)
            for kind, held in explained.items():
                # one note per module and kind, ever: the latch key is never cleared
                if held and self.latch.update(f"{kind}:{module}", True):
                    notes.append(self._note(kind, module, held, len(stats.entropy), ctx))
        alerts = [self._entropy_alert(kind, heads, ctx) for kind, heads in tripped.items() if heads]
        return alerts + notes

    def _from_start(self, source: str) -> bool:
        """Whether the head has been below the band since its first measurement (no fall was seen), in a run whose
        sampled loss is known."""
        entry = self.heads.get(source)
        return entry is not None and math.isnan(entry[0]) and math.isfinite(entry[1])  # with a loss to follow

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
        improved = math.isfinite(mean_loss) and math.isfinite(before_loss) and mean_loss < before_loss
        # A whole layer on about one key is a collapse, unless it has been so since its first measurement while the
        # loss improves: attention peaked by construction (inputs scaled up, as Lightning's demo transformer does),
        # which the model learns with, not a fall the run went through.
        if whole_layer and not (math.isnan(before) and improved):
            return _COLLAPSE
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


# -- the report's attn_entropy_band row (declared in attention_specs.py, which this module imports) --------------


@measure("attn_entropy_band")
def _measure_attn_band(run: LoggedRun, check: Check) -> bool:
    low, high = band_threshold(check, run, ATTN_ENTROPY_LOW, ATTN_ENTROPY_HIGH)
    check.threshold = "; ".join(RULES[r].describe(run.thresholds) for r in check.rules)
    heads = [t for t in run.scalars if attn_head(t)] or [t for t in run.scalars if attn_mean(t)]
    values = [v for t in heads for v in finite_values(run.scalars[t])]
    if values:
        what = "heads" if attn_head(heads[0]) else "layer means"
        check.measured = f"entropy {fmt(min(values))} .. {fmt(max(values))} nats over {len(heads)} {what}"
        check.measured_value = {"min": min(values), "max": max(values)}
        above = sum(1 for v in values if high is not None and v > high)
        if above and high is not None:
            check.add_note(
                f"{above} measurements above {fmt(high)} nats ({ATTN_ENTROPY_HIGH}): an info hint at most, and only "
                "when near uniform after warm-up, since diffuse attention can be a learned solution"
            )
    missing = [rule for rule, v in ((ATTN_ENTROPY_LOW, low), (ATTN_ENTROPY_HIGH, high)) if v is None]
    if values and missing:
        check.add_note(f"the run logged no {' or '.join(missing)} threshold")
    return bool(values)


@replay("attn_entropy_band")
def _replay_attn_band(run: LoggedRun) -> list[Alert]:
    rule = AttentionEntropyRule.from_settings(run.thresholds)
    heads: dict[str, dict[int, Series]] = {}
    for name, points in run.scalars.items():
        parsed = attn_head(name)
        if parsed is not None:
            heads.setdefault(parsed[0], {})[parsed[1]] = points
    # The first-key mass and key coverage that explain an attention sink or an alignment are not logged: a module
    # the run's own rule explained (its `info` note) is fed as explained (full key coverage), so the replay does not
    # fail it on its low-entropy heads, before the heads tripping together are grouped into one alert.
    explained = {a.source for a in run.alerts if a.rule == ATTN_ENTROPY_LOW and a.severity == Severity.INFO}
    alerts: list[Alert] = []
    by_step: dict[int, dict[str, LayerStats]] = {}
    for module, head_points in heads.items():
        uniform = dict(run.scalars.get(attn_uniform_tag(module), []))
        n = max(head_points) + 1
        for step, values in values_by_step((str(h), s) for h, s in head_points.items()).items():
            entropy = [values.get(str(h), math.nan) for h in range(n)]
            uni = uniform.get(step, math.inf)  # not logged: the low rule judges alone
            cover = [1.0] * n if module in explained else ()
            by_step.setdefault(step, {})[module] = LayerStats(
                entropy, [uni] * n, [math.nan] * n, [math.nan] * n, coverage=cover
            )
    # the training loss at the measured steps tells a collapse from learned sharpness, as in the run
    losses = dict(run.scalars.get(loss_tag("train_step"), []))
    for step, layers in sorted(by_step.items()):
        alerts += rule.judge(StepContext(0, step), Measures(attention=layers, loss=losses.get(step)))
    # the replay's own notes on those modules restate the run's: not returned
    return [a for a in alerts if not (a.rule == ATTN_ENTROPY_LOW and a.severity == Severity.INFO)]
