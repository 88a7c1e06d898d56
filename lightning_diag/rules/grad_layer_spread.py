"""``grad_layer_spread`` (framework-free): blocks of one kind learn at very different speeds, fed by
:class:`~lightning_diag.GradientFlowMonitor`.

The seed's number is applied to a quantity where it detects faults rather than architecture (the measurements
behind the choice are in ``docs/gradient_flow.md``).

``grad_layer_spread``: between comparable matrices **of the same role in different blocks** (``layers.*.fc1``
against ``layers.*.fc1``), largest / smallest relative gradient above ``spread_ratio`` on ``patience``
consecutive measurements after ``warmup_steps`` (during the warm-up: above ``spread_ratio`` x 1000). A LayerNorm
against the LM head is architecture; block 0 against block 11 of the same kind is gradient flow.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import ClassVar

from lightning_diag.core.record import Alert
from lightning_diag.core.registry import CheckSpec, Limit, RuleSpec, default, register
from lightning_diag.rules.base import OVERWHELMING, Latch, Rule, StepContext, excess
from lightning_diag.rules.grad_frozen import GRAD_PATIENCE_SETTING, GRADIENT_FLOW
from lightning_diag.rules.grad_settings import DEFAULT_GRAD_PATIENCE, DEFAULT_GRAD_WARMUP_STEPS, GRAD_WARMUP_SETTING
from lightning_diag.rules.measures import Measure, Measures
from lightning_diag.rules.rows import (
    Check,
    LoggedRun,
    fmt,
    layer_series,
    measure,
    per_layer_series,
    replay,
    run_threshold,
    updates_by_step,
    values_by_step,
)
from lightning_diag.stats.layer_roles import role_of

__all__ = [
    "DEFAULT_LAYER_SPREAD_THRESHOLD",
    "GRAD_LAYER_SPREAD",
    "GRAD_LAYER_SPREAD_SPEC",
    "GRAD_SPREAD_CHECK",
    "GradSpreadRule",
]

GRAD_LAYER_SPREAD_SPEC = register(
    RuleSpec(
        "grad_layer_spread",
        GRADIENT_FLOW,
        "warning",
        100.0,
        "largest / smallest ||g||/||W|| of one role across blocks above {threshold:g}",
        check="grad_spread",
        source="seed 000 §3.1",
        limits={"threshold": Limit(low=1.0)},
    )
)
GRAD_LAYER_SPREAD = GRAD_LAYER_SPREAD_SPEC.rule_id
#: Its row of the ``lightning-diag report`` checklist (registered in report order by
#: :mod:`lightning_diag.rules.catalog`).
GRAD_SPREAD_CHECK = CheckSpec(
    "grad_spread", "Model",
    "Relative gradients of one role across blocks within a ratio of {grad_layer_spread:g}",
)

#: ``grad_layer_spread``: largest / smallest relative gradient of one role across blocks (seed 000 §3.1).
DEFAULT_LAYER_SPREAD_THRESHOLD = default(GRAD_LAYER_SPREAD)


class GradSpreadRule(Rule):
    """``grad_layer_spread``: largest / smallest relative gradient among the matrices of one role, across blocks.

    Example:
        >>> rule = GradSpreadRule(patience=1, warmup_steps=0)
        >>> roles = {"h.0.fc": "h.*.fc", "h.1.fc": "h.*.fc", "head": "head"}
        >>> m = Measures(grad_relative={"h.0.fc": 1e-4, "h.1.fc": 0.1, "head": 1.0}, layer_roles=roles)
        >>> [a.source for a in rule.judge(StepContext(0, 0), m)]
        ['h.*.fc']
    """

    specs = (GRAD_LAYER_SPREAD_SPEC,)
    setting_keys: ClassVar[Mapping[str, str]] = {
        "spread_ratio": GRAD_LAYER_SPREAD,
        "patience": GRAD_PATIENCE_SETTING.key,
        "warmup_steps": GRAD_WARMUP_SETTING.key,
    }
    # the relative gradients are judged; the update ratios of a measured step are noted for the next judgment
    optional = frozenset({Measure.GRAD_RELATIVE, Measure.LAYER_ROLES, Measure.UPDATE_RATIOS})
    state_keys = ("streak", "updates")

    def __init__(
        self,
        spread_ratio: float = DEFAULT_LAYER_SPREAD_THRESHOLD,
        patience: int = DEFAULT_GRAD_PATIENCE,
        warmup_steps: int = DEFAULT_GRAD_WARMUP_STEPS,
    ) -> None:
        super().__init__()
        self.spread_ratio = spread_ratio
        self.patience = patience
        self.latch = Latch.for_patience(patience)
        self.warmup_steps = warmup_steps
        self.streak = 0
        #: ``{layer: ||ΔW|| / ||W||}`` at the last measured step (:meth:`_observe_updates`); empty when unknown.
        self.updates: dict[str, float] = {}

    def _observe_updates(self, ratios: Mapping[str, float]) -> None:
        """Note the relative update ``||ΔW|| / ||W||`` each layer got at the last measured optimizer step: a
        matrix whose gradient is far below its peers' but whose update is not is not a slow learner."""
        self.updates = {k: float(v) for k, v in ratios.items() if math.isfinite(v)}

    def starved(self, members: Mapping[str, float]) -> dict[str, float]:
        """The members of one role whose last update is more than ``spread_ratio`` times below the role's largest
        (all of them when the updates are not known; a member whose update is not known counts as starved)."""
        known = [self.updates[k] for k in members if k in self.updates]
        if not known:
            return dict(members)
        top = max(known)
        return {k: v for k, v in members.items() if k not in self.updates or self.updates[k] * self.spread_ratio < top}

    def judge(self, ctx: StepContext, m: Measures) -> list[Alert]:
        """Judge one measurement of the comparable layers' relative gradients and their roles (``None``: one
        role for all); return the alerts raised. The update ratios of a measured step (``m.update_ratios``) are
        noted first (:meth:`_observe_updates`); measures without ``grad_relative`` raise nothing."""
        if m.update_ratios is not None:
            self._observe_updates(m.update_ratios)
        if m.grad_relative is None:
            return []
        values, roles = m.grad_relative, m.layer_roles
        early = ctx.global_step < self.warmup_steps
        groups: dict[str, dict[str, float]] = {}
        for layer, v in values.items():
            if math.isfinite(v) and v > 0:
                role = roles.get(layer, layer) if roles is not None else "model"
                groups.setdefault(role, {})[layer] = v
        worst: tuple[float, str, str, str] | None = None
        for role, members in groups.items():
            if len(members) < 2:
                continue
            high = max(members, key=members.__getitem__)
            # the slow side: a matrix whose update is not starved moves as fast as its peers (Adam rescales a
            # small gradient; L2 weight decay keeps shrinking a block the loss no longer needs)
            slow = self.starved(members)
            if not slow:
                continue
            low = min(slow, key=slow.__getitem__)
            ratio = members[high] / members[low]
            if worst is None or ratio > worst[0]:
                worst = (ratio, role, high, low)
        if worst is None:
            return []
        ratio, role, high, low = worst
        # during the warm-up only overwhelming evidence counts
        self.observe(ratio, self.spread_ratio * (OVERWHELMING if early else 1.0))
        self.streak = self.streak + 1 if ratio > self.spread_ratio * (OVERWHELMING if early else 1.0) else 0
        if not self.latch.update("model", self.streak >= self.patience, excess(ratio, self.spread_ratio)):
            return []
        members = groups[role]
        return [
            self._alert(
                ctx,
                f"relative gradients of `{role}` span {ratio:.3g}x across blocks (`{high}` {members[high]:.3g}, "
                f"`{low}` {members[low]:.3g}), more than {self.spread_ratio:g}x: blocks of one kind learn at very "
                "different speeds; check normalisation, residual paths, initialisation and per-layer learning rates",
                source=role,
                value=ratio,
                threshold=self.spread_ratio,
            )
        ]


# -- the report's grad_spread row ------------------------------------------------------------------------------


@measure("grad_spread")
def _measure_grad_spread(run: LoggedRun, check: Check) -> bool:
    ratio = run_threshold(run, GRAD_LAYER_SPREAD)
    check.threshold = f"largest / smallest <= {fmt(ratio)}" if ratio is not None else "not logged"
    check.threshold_value = {"value": ratio} if ratio is not None else {}
    spreads = []
    for values in values_by_step(layer_series(run, "grad_relative").items()).values():
        roles: dict[str, list[float]] = {}
        for layer, v in values.items():
            if math.isfinite(v) and v > 0:
                roles.setdefault(role_of(layer), []).append(v)
        spreads += [max(vs) / min(vs) for vs in roles.values() if len(vs) > 1]
    what = "||g||/||W|| within a role"
    if not spreads:  # a run logged before the scale-free tags: raw layer norms, for information
        what = "layer L2 norm"
        spreads = [
            max(vs) / min(vs)
            for norms in values_by_step(per_layer_series(run).items()).values()
            if len(vs := [v for v in norms.values() if math.isfinite(v) and v > 0]) > 1
        ]
    if spreads:
        check.measured = f"largest / smallest {what} up to {fmt(max(spreads))}"
        check.measured_value = {"max": max(spreads)}
    return bool(spreads)


@replay("grad_spread")
def _replay_grad_spread(run: LoggedRun) -> list[Alert]:
    rule = GradSpreadRule.from_settings(run.thresholds)
    updates = updates_by_step(run)
    alerts: list[Alert] = []
    for step, values in values_by_step(layer_series(run, "grad_relative").items()).items():
        grads = Measures(grad_relative=values, layer_roles={layer: role_of(layer) for layer in values})
        alerts += rule.judge(StepContext(0, step), grads)
        if step in updates:
            alerts += rule.judge(StepContext(0, step), Measures(update_ratios=updates[step]))
    return alerts
