"""``grad_explode`` and ``grad_vanish`` (framework-free): one detector, the band every layer's gradient should stay
in (the ``grad_norm_band`` row of the report), fed by :class:`~lightning_diag.GradientFlowMonitor`.

The seed's band (1e-3 .. 1e1) is applied to quantities where it detects faults rather than architecture (the
measurements behind each choice are in ``docs/gradient_flow.md``):

* ``grad_explode``: a layer's **RMS gradient per element** (``||g|| / sqrt(numel)``) above ``explode_threshold``
  on one measurement. Raw L2 norms grow with the number of positions a layer is summed over (a ViT patch
  embedding reaches 21, BERT's token-type embedding 12, in healthy runs); per element they stay below 1.1.
  Between two measurements, under plain SGD (a parameter group with ``momentum``, ``dampening`` and ``nesterov``:
  ``torch.optim.SGD``, no weight decay), the weights' norms bound the gradient the steps in between applied (the
  measure ``weight_norms``, judged by :meth:`GradBandRule.judge`): a layer's weights moved by at least ``| ||W_b|| -
  ||W_a|| |`` over ``k`` steps of at most ``lr / (1 - momentum)`` times a gradient each, so some gradient since the
  fit began had an RMS per element of at least ``| ||W_b|| - ||W_a|| | (1 - momentum) / (lr k sqrt(numel))``. That
  lower bound above ``explode_threshold`` is an explosion the measurements fell between (the fault library's
  ``explode`` with seed 1: RMS 46 and 20550 at steps 2 and 3, every unit of the head dead by the measurement at step
  4). Weights changed outside the optimizer between two readings (pruning, a reload) count as a move.
* ``grad_vanish``: a **weight matrix's relative gradient** ``||g_W|| / ||W||`` below ``vanish_threshold`` *and*
  more than ``relative`` times below the largest relative gradient of the blocks' matrices (the best-fed block),
  on ``patience`` consecutive measurements after ``warmup_steps``, while that block itself is above
  ``vanish_threshold``. Matrices starved while a block still learns are vanishing; all of them small together
  is a converged (or dead) model, ``grad_collapse``'s question.
  During the warm-up only overwhelming evidence counts: a matrix whose relative gradient is positive but below
  ``vanish_threshold`` / :data:`~lightning_diag.rules.base.OVERWHELMING` (1e-6) and more than ``relative`` x 1000
  (1e5) times below the best-fed block matrix (a 12-layer sigmoid MLP's first layer, 1e-12 of its last: caught at
  its ``patience``-th measurement instead of after the warm-up). Exactly zero gradients (the zero-initialised
  partner of a LoRA pair) wait for the warm-up.
  Attention query/key projections are not compared (their gradient flows only through the softmax and is 1e-5
  at initialisation, attention being uniform), nor are embeddings (sparse rows).
  A matrix whose update the optimizer keeps normal-sized (Adam rescales a small gradient) is cleared, except in a
  plain deep stack whose relative gradient decays with depth (:meth:`GradBandRule.depth_decay`: a role in at least
  :data:`DEPTH_CHAIN` blocks spanning ``relative`` x 1000 and falling towards the input). While some layer's units
  are dead (``dead_units``' condition, :meth:`GradBandRule.observe_dead`) nothing is raised: the gradient stops at
  dead units, a different repair.

When several layers cross one threshold at the same measurement they make one alert naming them (count and the
worst few); a layer crossing it later, while others are still in alarm, joins that event silently. Non-finite
values are AnomalyAlarm's business and are skipped.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any, ClassVar

from lightning_diag.core.record import Alert
from lightning_diag.core.registry import POSITIVE, RULES, CheckSpec, Limit, RuleSpec, default, register
from lightning_diag.rules.base import OVERWHELMING, Latch, Rule, StepContext, excess, name_layers
from lightning_diag.rules.grad_frozen import GRAD_PATIENCE_SETTING, GRADIENT_FLOW
from lightning_diag.rules.grad_settings import DEFAULT_GRAD_PATIENCE, DEFAULT_GRAD_WARMUP_STEPS, GRAD_WARMUP_SETTING
from lightning_diag.rules.measures import Measure, Measures, WeightNorms
from lightning_diag.rules.rows import (
    Check,
    LoggedRun,
    band_threshold,
    finite_values,
    fmt,
    layer_series,
    measure,
    per_layer_series,
    replay,
    updates_by_step,
    values_by_step,
)
from lightning_diag.stats.layer_roles import block_position, role_of

__all__ = [
    "DEFAULT_EXPLODE_THRESHOLD",
    "DEFAULT_VANISH_RELATIVE",
    "DEFAULT_VANISH_THRESHOLD",
    "DEPTH_CHAIN",
    "DEPTH_CORRELATION",
    "GRAD_EXPLODE",
    "GRAD_EXPLODE_SPEC",
    "GRAD_NORM_BAND_CHECK",
    "GRAD_VANISH",
    "GRAD_VANISH_SPEC",
    "GradBandRule",
    "rank_correlation",
    "sgd_step_scale",
]

GRAD_VANISH_SPEC = register(
    RuleSpec(
        "grad_vanish",
        GRADIENT_FLOW,
        "warning",
        1e-3,
        "a weight matrix's ||g||/||W|| below {threshold:g} and {relative:g}x below the best-fed block matrix, after "
        "step {warmup_steps:g}",
        settings={"relative": 100.0},
        check="grad_norm_band",
        source="seed 000 §3.1",
        limits={"threshold": POSITIVE, "relative": Limit(low=1.0, low_inclusive=True)},
    )
)
GRAD_EXPLODE_SPEC = register(
    RuleSpec(
        "grad_explode",
        GRADIENT_FLOW,
        "warning",
        1e1,
        "a layer's RMS gradient per element above {threshold:g}",
        check="grad_norm_band",
        source="seed 000 §3.1",
        limits={"threshold": POSITIVE},
    )
)
GRAD_VANISH = GRAD_VANISH_SPEC.rule_id
GRAD_EXPLODE = GRAD_EXPLODE_SPEC.rule_id
#: Its row of the ``lightning-diag report`` checklist (registered in report order by
#: :mod:`lightning_diag.rules.catalog`).
GRAD_NORM_BAND_CHECK = CheckSpec("grad_norm_band", "Model",
                                 "Gradient of every layer within {grad_vanish:g} (||g||/||W||) .. {grad_explode:g} "
                                 "(RMS per element)")

#: ``grad_vanish``: a weight matrix's ``||g|| / ||W||`` below this (seed 000 §3.1's 1e-3).
DEFAULT_VANISH_THRESHOLD = default(GRAD_VANISH)
#: ``grad_vanish``: ... and this many times below the best-fed block matrix (``grad_vanish.relative``).
DEFAULT_VANISH_RELATIVE = default(GRAD_VANISH_SPEC.key("relative"))
#: ``grad_explode``: a layer's RMS gradient per element above this (seed 000 §3.1's 1e1).
DEFAULT_EXPLODE_THRESHOLD = default(GRAD_EXPLODE)
#: ``grad_vanish``'s depth test: a role repeated in at least this many blocks is a stack whose decay can be read.
DEPTH_CHAIN = 4
#: ``grad_vanish``'s depth test: the rank correlation between a matrix's block position and its relative gradient
#: at least this (the gradient falls, block after block, towards the input).
DEPTH_CORRELATION = 0.8


def sgd_step_scale(groups: Sequence[Mapping[str, Any]]) -> tuple[float, float] | None:
    """``(lr, momentum)`` of an optimizer whose parameter groups are all plain SGD (``momentum``, ``dampening`` and
    ``nesterov`` keys, as ``torch.optim.SGD`` has) with one learning rate and momentum and no weight decay, else
    ``None``: an adaptive optimizer (Adam rescales each element) or weight decay does not bound the update by the
    gradient alone.

    Example:
        >>> sgd_step_scale([{"lr": 6.0, "momentum": 0.0, "dampening": 0, "nesterov": False, "weight_decay": 0}])
        (6.0, 0.0)
        >>> sgd_step_scale([{"lr": 1e-3, "betas": (0.9, 0.999), "weight_decay": 0.01}]) is None
        True
    """
    scales = set()
    for g in groups:
        if not {"momentum", "dampening", "nesterov"} <= set(g) or g.get("weight_decay", 0) or g.get("maximize"):
            return None
        lr, momentum = g.get("lr"), g.get("momentum")
        if not isinstance(lr, (int, float)) or not isinstance(momentum, (int, float)) or lr <= 0:
            return None
        scales.add((float(lr), float(momentum)))
    if len(scales) != 1:
        return None
    lr, momentum = scales.pop()
    return (lr, momentum) if 0 <= momentum < 1 else None


def rank_correlation(values: list[float]) -> float:
    """Spearman's rank correlation between position (0, 1, ...) and ``values`` (1: strictly increasing); tied
    values share their average rank, so a flat run of equal values is no trend.

    Example:
        >>> rank_correlation([1e-7, 1e-5, 1e-3, 1e-1]), rank_correlation([4.0, 3.0, 2.0, 1.0])
        (1.0, -1.0)
        >>> round(rank_correlation([1e-7, 0.1, 0.1, 0.1, 0.1, 0.1]), 2)
        0.65
    """
    n = len(values)
    if n < 2:
        return 0.0
    order = sorted(range(n), key=values.__getitem__)
    rank = [0.0] * n
    start = 0
    while start < n:
        end = start
        while end + 1 < n and values[order[end + 1]] == values[order[start]]:
            end += 1
        for j in range(start, end + 1):
            rank[order[j]] = (start + end) / 2
        start = end + 1
    mean = (n - 1) / 2
    cov = sum((r - mean) * (i - mean) for i, r in enumerate(rank))
    spread = sum((r - mean) ** 2 for r in rank) * sum((i - mean) ** 2 for i in range(n))
    return cov / spread**0.5 if spread > 0 else 0.0


class GradBandRule(Rule):
    """``grad_explode`` (RMS gradient per element, any layer) and ``grad_vanish`` (relative gradient of a
    weight matrix, starved against its peers). Latched per layer; the layers that trip a rule at one
    measurement make one alert whose ``source`` is the worst of them.

    Example:
        >>> rule = GradBandRule(patience=2, warmup_steps=0)
        >>> ms = [Measures(grad_rms={"fc": r}) for r in (1.0, 50.0, 60.0, 70.0)]
        >>> [len(rule.judge(StepContext(0, i), m)) for i, m in enumerate(ms)]
        [0, 1, 0, 0]
    """

    specs = (GRAD_VANISH_SPEC, GRAD_EXPLODE_SPEC)
    setting_keys: ClassVar[Mapping[str, str]] = {
        "vanish_threshold": GRAD_VANISH,
        "explode_threshold": GRAD_EXPLODE,
        "patience": GRAD_PATIENCE_SETTING.key,
        "warmup_steps": GRAD_WARMUP_SETTING.key,
    }
    optional = frozenset(
        {
            Measure.GRAD_RMS,
            Measure.GRAD_RELATIVE,
            Measure.BLOCKS,
            Measure.LAYER_ROLES,
            Measure.WEIGHT_NORMS,
            Measure.UPDATE_RATIOS,
        }
    )
    state_keys = ("streaks", "updates", "unreached", "weights")

    def __init__(
        self,
        vanish_threshold: float = DEFAULT_VANISH_THRESHOLD,
        explode_threshold: float = DEFAULT_EXPLODE_THRESHOLD,
        patience: int = DEFAULT_GRAD_PATIENCE,
        relative: float = DEFAULT_VANISH_RELATIVE,
        warmup_steps: int = DEFAULT_GRAD_WARMUP_STEPS,
    ) -> None:
        super().__init__()
        self.relative = relative
        self.vanish_threshold = vanish_threshold
        self.explode_threshold = explode_threshold
        self.patience = patience
        self.latch = Latch.for_patience(patience)
        self.warmup_steps = warmup_steps
        self.streaks: dict[str, int] = {}
        #: ``{layer: ||ΔW|| / ||W||}``: the relative update the optimizer applied at the last measured step
        #: (:meth:`_observe_updates`); empty when the owner does not measure updates.
        self.updates: dict[str, float] = {}
        #: Matrices whose relative gradient has been exactly 0 at every measurement since the first one (``None``
        #: before it): the loss never reached them (``grad_frozen``'s information), so they are not vanishing.
        self.unreached: list[str] | None = None
        #: Layers whose units are dead at the current measurement (:meth:`observe_dead`): ``grad_vanish`` defers to
        #: ``dead_units`` while any is (dead units pass no gradient; a different repair).
        self.dead: list[str] = []
        #: ``{layer: [||W||, step]}`` at the last measurement whose weights were read (``weight_norms``).
        self.weights: dict[str, list[float]] = {}

    def _weights(self, ctx: StepContext, w: WeightNorms) -> list[Alert]:
        """Judge each layer's weight norm before the optimizer step of a measurement (``sizes``: its elements;
        ``sgd``: :func:`sgd_step_scale` of its optimizer, ``None``: not plain SGD); return a ``grad_explode`` alert
        when the weights moved since the last reading by more than a gradient of RMS ``explode_threshold`` could
        have moved them (see the module's docstring): an explosion between two measurements.

        Example:
            >>> from lightning_diag.rules.measures import WeightNorms
            >>> rule = GradBandRule()
            >>> rule.judge(StepContext(0, 0), Measures(weight_norms=WeightNorms({"fc": 8.0}, {"fc": 64}, (6.0, 0.0))))
            []
            >>> moved = Measures(weight_norms=WeightNorms({"fc": 9e5}, {"fc": 64}, (6.0, 0.0)))
            >>> [a.rule for a in rule.judge(StepContext(0, 4), moved)]
            ['grad_explode']
        """
        norms, sizes, sgd = w.norms, w.sizes, w.sgd
        bounds: dict[str, float] = {}
        for layer, norm in norms.items():
            last, size = self.weights.get(layer), sizes.get(layer, 0)
            if sgd is not None and last is not None and ctx.global_step > last[1] and size > 0:
                lr, momentum = sgd
                steps = ctx.global_step - last[1]
                bounds[layer] = abs(norm - last[0]) * (1.0 - momentum) / (lr * steps * math.sqrt(size))
        self.weights = {k: [float(v), float(ctx.global_step)] for k, v in norms.items() if math.isfinite(v)}
        self.observe(max(bounds.values(), default=math.nan), self.explode_threshold, rule=GRAD_EXPLODE)
        exploding = {k: v for k, v in bounds.items() if math.isfinite(v) and v > self.explode_threshold}
        new = self._trip(GRAD_EXPLODE, exploding, set(exploding), needed=1)  # clean layers: the measured path's
        if not new:
            return []
        worst = max(new, key=new.__getitem__)
        return [
            self._alert(
                ctx,
                f"exploding gradients between two measurements: the weights of {name_layers(new)} moved since the "
                f"last reading by more than plain SGD at learning rate {sgd[0] if sgd else 0:g} can move them with "
                f"gradients of RMS {self.explode_threshold:g} per element (the value: the smallest RMS gradient that "
                "explains the move, at some step in between): lower the learning rate or clip gradients",
                source=worst,
                value=new[worst],
                threshold=self.explode_threshold,
                rule=GRAD_EXPLODE,
            )
        ]

    def observe_reached(self, relative: Mapping[str, float]) -> set[str]:
        """Advance the never-reached bookkeeping with one measurement; return the layers never reached so far.

        A layer is never reached when its relative gradient was exactly 0 at every measurement of it since the
        first measurement of the fit (an input that is always zero or empty, an output that nothing downstream
        depends on, such as a softmax over one element). A layer that had a gradient once is never again.
        """
        zeros = {k for k, v in relative.items() if v == 0.0}
        if self.unreached is None:
            self.unreached = sorted(zeros)
        else:
            self.unreached = [k for k in self.unreached if k in zeros or k not in relative]
        return set(self.unreached)

    def _observe_updates(self, ratios: Mapping[str, float]) -> None:
        """Note the relative update ``||W_after - W_before|| / ||W_before||`` each layer got at the last measured
        optimizer step; ``grad_vanish`` then also needs the layer's *update* to be starved."""
        self.updates = {k: float(v) for k, v in ratios.items() if math.isfinite(v)}

    def observe_dead(self, layers: Collection[str]) -> None:
        """Note the layers whose units are dead at this measurement (``dead_units``' condition); while any is,
        ``grad_vanish`` raises nothing: the gradient stops at dead units, not at depth."""
        self.dead = sorted(layers)

    def depth_decay(self, relative: Mapping[str, float], roles: Mapping[str, str]) -> dict[str, str]:
        """``{matrix: role}`` of the stacks whose relative gradient decays with depth: a role repeated in at least
        :data:`DEPTH_CHAIN` blocks, its relative gradients spanning more than ``relative`` x
        :data:`~lightning_diag.rules.base.OVERWHELMING` (1e5) from its best-fed to its least-fed block, and falling
        towards the input (rank correlation of block position and relative gradient at least
        :data:`DEPTH_CORRELATION`). The textbook vanishing gradient of a plain deep stack (8 sigmoid layers: the
        first at 1e-7 of the last); an adaptive optimizer rescales such a gradient into a normal-sized update, so
        the update test does not clear these matrices.
        """
        chains: dict[str, list[str]] = {}
        for layer, v in relative.items():
            if v > 0 and layer in roles:
                chains.setdefault(roles[layer], []).append(layer)
        out: dict[str, str] = {}
        for role, members in chains.items():
            if len(members) < DEPTH_CHAIN:
                continue
            members.sort(key=block_position)
            values = [relative[k] for k in members]
            if max(values) < self.relative * OVERWHELMING * min(values):
                continue
            if rank_correlation(values) >= DEPTH_CORRELATION:
                out.update(dict.fromkeys(members, role))
        return out

    def update_starved(self, starved: Mapping[str, float], blocks: Collection[str] | None) -> dict[str, float]:
        """The gradient-starved layers whose last update is starved too (more than ``relative`` times below the
        largest relative update of the blocks' matrices); a layer whose update is not known keeps its verdict.

        With an adaptive optimizer (Adam, AdamW, RMSprop, Adagrad) the update is the gradient divided by its own
        running scale: a matrix whose gradient is small by its architecture (a feature tokenizer with a large
        initialisation, a layer fed small inputs) moves as fast as any other, and is not vanishing. With SGD the
        update is the learning rate times the gradient, so both tests agree.
        """
        if not starved or not self.updates:
            return dict(starved)
        reference = max((v for k, v in self.updates.items() if blocks is None or k in blocks), default=0.0)
        return {
            k: v for k, v in starved.items() if k not in self.updates or self.updates[k] * self.relative < reference
        }

    def vanish_excess(
        self, rel: Mapping[str, float], reference: float, factor: float, blocks: Collection[str] | None
    ) -> float:
        """How far the most starved matrix is past all of ``grad_vanish``'s bounds at once (the smallest of its
        excesses past the absolute threshold, the gap to ``reference`` and, when known, the gap of its update to
        the blocks' largest): above 1 on a measurement that counts toward the alarm; ``nan`` when none is known."""
        top = max((v for k, v in self.updates.items() if blocks is None or k in blocks), default=0.0)
        worst = math.nan
        for k, v in rel.items():
            x = excess(v * factor, self.vanish_threshold, False)
            x = min(x, excess(v * self.relative * factor, reference, False))
            if k in self.updates and top > 0:
                x = min(x, excess(self.updates[k] * self.relative, top, False))
            if x > worst or math.isnan(worst):
                worst = x
        return worst

    def judge(self, ctx: StepContext, m: Measures) -> list[Alert]:
        """Judge one measurement of the gradients (``m.grad_rms`` and what comes with it, below) or of the weights
        before a measured step (``m.weight_norms``: an explosion between two measurements, see :meth:`_weights`);
        return the alerts raised. The update ratios of a measured step (``m.update_ratios``) are noted after the
        weights are judged (:meth:`_observe_updates`)."""
        alerts = [] if m.weight_norms is None else self._weights(ctx, m.weight_norms)
        if m.update_ratios is not None:
            self._observe_updates(m.update_ratios)
        if m.grad_rms is not None:
            alerts += self._gradients(ctx, m)
        return alerts

    def _gradients(self, ctx: StepContext, m: Measures) -> list[Alert]:
        """Judge one measurement of the gradients; return the alerts raised.

        Args:
            ctx: Where the measurement was taken.
            m: ``grad_rms``: ``{layer: RMS gradient per element}`` of every measured layer (``grad_explode``);
                ``grad_relative``: ``{layer: ||g_W|| / ||W||}`` of the comparable weight matrices
                (``grad_vanish``; ``None`` or empty: no vanishing check); ``blocks``: the matrices of the repeated
                blocks, whose largest relative gradient is the reference a starved matrix is compared with
                (``None``: every matrix of ``grad_relative``); ``layer_roles``: ``{matrix: role}``
                (:func:`role_of`) for the depth test (:meth:`depth_decay`; ``None``: none).
        """
        rms, relative, blocks, roles = m.grad_rms or {}, m.grad_relative, m.blocks, m.layer_roles
        exploding = {k: v for k, v in rms.items() if math.isfinite(v) and v > self.explode_threshold}
        self.observe(max(rms.values(), default=math.nan), self.explode_threshold, rule=GRAD_EXPLODE)
        starved: dict[str, float] = {}
        rel = {k: v for k, v in (relative or {}).items() if math.isfinite(v)}
        if rel:
            unreached = self.observe_reached(rel)  # never reached by the loss: grad_frozen's information
            rel = {k: v for k, v in rel.items() if k not in unreached}
        reference = max((v for k, v in rel.items() if blocks is None or k in blocks), default=0.0)
        early = ctx.global_step < self.warmup_steps
        # a reference that is itself below the threshold is a converged or dead model: grad_collapse's question
        decaying: dict[str, str] = {}
        judged = bool(rel) and reference >= self.vanish_threshold and not self.dead
        # during the warm-up only overwhelming evidence counts (OVERWHELMING past both thresholds)
        factor = OVERWHELMING if early else 1.0
        if rel:
            # the margin: the most starved matrix's excess, held over `patience` measurements (0 where not judged)
            held = self.vanish_excess(rel, reference, factor, blocks) if judged else 0.0
            self.observe_held("vanish", held, self.patience, rule=GRAD_VANISH)
        if judged:
            starved = {
                k: v
                for k, v in rel.items()
                if v < self.vanish_threshold / factor
                and v * self.relative * factor < reference
                and (v > 0 or not early)
            }
            # a gradient that decays with depth down a stack is vanishing whatever the update (Adam rescales it)
            decaying = {k: r for k, r in self.depth_decay(rel, roles).items() if k in starved} if roles else {}
            starved = {**self.update_starved(starved, blocks), **{k: starved[k] for k in decaying}}
        alerts = []
        explode_new = self._trip(GRAD_EXPLODE, exploding, set(rms), needed=1)
        if explode_new:
            worst = max(explode_new, key=explode_new.__getitem__)
            alerts.append(
                self._alert(
                    ctx,
                    f"RMS gradient per element above {self.explode_threshold:g} in "
                    f"{name_layers(explode_new)}: lower the learning rate, clip gradients or check the loss scale",
                    source=worst,
                    value=explode_new[worst],
                    threshold=self.explode_threshold,
                    rule=GRAD_EXPLODE,
                )
            )
        # A starved layer has worsened when its gap to the best-fed block has grown, not when a batch with small
        # gradients everywhere lowers every relative gradient at once (grad_collapse's business).
        gaps = {k: excess(v * self.relative, reference, above=False) for k, v in starved.items()}
        vanish_new = self._trip(GRAD_VANISH, starved, set(rel), self.patience, gaps)
        if vanish_new:
            worst = min(vanish_new, key=vanish_new.__getitem__)
            during = f" (during the {self.warmup_steps}-step warm-up: {OVERWHELMING:g}x past both)" if early else ""
            alerts.append(
                self._alert(
                    ctx,
                    f"relative gradient ||g||/||W|| below {self.vanish_threshold:g} and over "
                    f"{self.relative:g}x below the best-fed block matrix ({reference:.3g}){during} on "
                    f"{self.patience} consecutive measurements in {name_layers(vanish_new, worst_first=False)}"
                    + self._depth_text(worst, decaying, rel)
                    + (
                        f", and their last update ||ΔW||/||W|| ({self.updates[worst]:.3g}) over {self.relative:g}x "
                        "below the blocks' largest too"
                        if worst in self.updates and worst not in decaying
                        else ""
                    )
                    + ": gradients vanish "
                    "before they reach these layers; check saturating activations, depth without residuals or "
                    "normalisation, a too-small init",
                    source=worst,
                    value=vanish_new[worst],
                    threshold=self.vanish_threshold,
                    rule=GRAD_VANISH,
                )
            )
        return alerts

    @staticmethod
    def _depth_text(worst: str, decaying: Mapping[str, str], rel: Mapping[str, float]) -> str:
        """How the gradient of the worst matrix's stack decays with depth, for the message (empty if it does not)."""
        role = decaying.get(worst)
        if role is None:
            return ""
        starved = sum(1 for r in decaying.values() if r == role)
        chain = sorted((k for k in rel if role_of(k) == role and rel[k] > 0), key=block_position)
        first, last = chain[0], chain[-1]
        return (
            f"; along the stack `{role}` ({len(chain)} blocks, {starved} starved) the relative gradient falls "
            f"{rel[last] / rel[first]:.3g}x from `{last}` ({rel[last]:.3g}) to `{first}` ({rel[first]:.3g}): it "
            "vanishes with depth (an adaptive optimizer rescales it into normal-sized updates, but of a gradient "
            "that carries almost no signal)"
        )

    def _trip(
        self,
        rule: str,
        bad: Mapping[str, float],
        seen: set[str],
        needed: int,
        gaps: Mapping[str, float] | None = None,
    ) -> dict[str, float]:
        """Advance the streaks of ``rule``; return the layers whose alarm has just begun, with their values.

        While some layers of ``rule`` are in alarm, a layer whose alarm begins joins that event without a new alert
        (vanishing gradients spread down a stack over a few measurements); a layer already in alarm that has
        clearly worsened alerts again: its ``gaps`` value (default: how far its value is past the threshold) grew
        by the latch's worsening factor.
        """
        ongoing = {k for k in self.latch.active if k.startswith(f"{rule}:")}
        new = {}
        for layer in seen | {k.split(":", 1)[1] for k in self.streaks if k.startswith(f"{rule}:")}:
            key = f"{rule}:{layer}"
            if layer in bad:
                self.streaks[key] = self.streaks.get(key, 0) + 1
            else:
                self.streaks.pop(key, None)
            if layer not in seen and layer not in bad:
                continue  # not measured this time: keep the latch as it is
            over = None
            if gaps is not None:
                over = gaps.get(layer)
            elif layer in bad:
                explode = rule == GRAD_EXPLODE
                threshold = self.explode_threshold if explode else self.vanish_threshold
                over = excess(bad[layer], threshold, above=explode)
            if self.latch.update(key, self.streaks.get(key, 0) >= needed, excess=over):
                if ongoing and key not in ongoing:
                    continue  # joins the event in progress
                new[layer] = bad[layer]
        return new


# -- the report's grad_norm_band row ---------------------------------------------------------------------------


@measure("grad_norm_band")
def _measure_grad_band(run: LoggedRun, check: Check) -> bool:
    band_threshold(check, run, GRAD_VANISH, GRAD_EXPLODE)
    check.threshold = "; ".join(RULES[r].describe(run.thresholds) for r in check.rules)
    rms = [v for series in layer_series(run, "grad_rms").values() for v in finite_values(series)]
    relative = [v for series in layer_series(run, "grad_relative").values() for v in finite_values(series)]
    if rms or relative:  # the scale-free quantities the rules judge (issue 11)
        parts = []
        if rms:
            parts.append(f"RMS gradient per element up to {fmt(max(rms))}")
        if relative:
            parts.append(f"||g||/||W|| of the matrices down to {fmt(min(relative))}")
        check.measured = "; ".join(parts)
        check.measured_value = {
            k: v for k, v in (("max", max(rms, default=None)), ("min", min(relative, default=None))) if v is not None
        }
        return True
    layers = per_layer_series(run)  # a run logged before the scale-free tags: raw L2 norms, for information
    values = [v for series in layers.values() for v in finite_values(series)]
    if values:
        lo, hi = min(values), max(values)
        check.measured = f"layer L2 norms {fmt(lo)} .. {fmt(hi)} over {len(layers)} layers (not what the rules judge)"
        check.measured_value = {"min": lo, "max": hi}
    return bool(values)


def _blocks(layers: Iterable[str]) -> set[str] | None:
    """The layers inside repeated blocks (an index in the name), or ``None`` (all) when there are none."""
    inside = {layer for layer in layers if role_of(layer) != layer}
    return inside or None


@replay("grad_norm_band")
def _replay_grad_band(run: LoggedRun) -> list[Alert]:
    rule = GradBandRule.from_settings(run.thresholds)
    rms = values_by_step(layer_series(run, "grad_rms").items())
    relative = values_by_step(layer_series(run, "grad_relative").items())
    blocks = _blocks(layer_series(run, "grad_relative"))
    updates = updates_by_step(run)
    alerts: list[Alert] = []
    for step in sorted(set(rms) | set(relative)):
        grads = Measures(grad_rms=rms.get(step, {}), grad_relative=relative.get(step), blocks=blocks)
        alerts += rule.judge(StepContext(0, step), grads)
        if step in updates:
            alerts += rule.judge(StepContext(0, step), Measures(update_ratios=updates[step]))
    return alerts
