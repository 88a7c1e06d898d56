"""Gradient-flow rules (framework-free): ``grad_vanish``, ``grad_explode``, ``grad_layer_spread``,
``grad_collapse``, ``grad_frozen``. Fed with per-layer and global gradient L2 norms at each measured step.

Exact meaning (each condition must hold on ``patience`` consecutive measurements, so a single noisy step never
alerts; non-finite norms are AnomalyAlarm's business and are skipped):

* ``grad_vanish``: a layer's norm below ``vanish_threshold`` **and** more than ``relative`` (default 100) times
  smaller than the global norm. A converged model whose gradients are all small together is not vanishing
  (that is ``grad_collapse``'s question); one layer starved while the rest learn is.
* ``grad_explode``: a layer's norm above ``explode_threshold`` on a single measurement: an explosion grows
  within a few steps into non-finite values, so it is reported at once.
* ``grad_layer_spread``: largest / smallest layer norm (over layers with a non-zero norm) above ``spread_ratio``.
* ``grad_collapse``: the global norm below ``collapse_ratio`` times the baseline, the median of the first
  ``baseline_measurements`` finite global norms of the fit.
* ``grad_frozen``: a layer some of whose parameters cannot learn while the rest of the model does: the
  parameter has ``requires_grad=False`` (``"frozen"``) or is trainable but in no optimizer (``"excluded"``),
  reported at the first measurement; or it is in the optimizer but gets no gradient (``grad is None``,
  ``"no_grad"``: cut from the graph by a ``detach`` or unused) on ``patience`` consecutive measurements.
  Parameters frozen on purpose are named to the callback (``expect_frozen``) and never reported.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence

from lightning_diag.alerts import GRAD_COLLAPSE, GRAD_EXPLODE, GRAD_FROZEN, GRAD_LAYER_SPREAD, GRAD_VANISH, Alert
from lightning_diag.rules.base import Rule, StepContext
from lightning_diag.rules.registry import default

__all__ = [
    "DEFAULT_BASELINE_MEASUREMENTS",
    "DEFAULT_COLLAPSE_RATIO",
    "DEFAULT_EXPLODE_THRESHOLD",
    "DEFAULT_GRAD_PATIENCE",
    "DEFAULT_SPREAD_RATIO",
    "DEFAULT_VANISH_THRESHOLD",
    "FROZEN_REASONS",
    "GradBandRule",
    "GradCollapseRule",
    "GradFrozenRule",
    "GradSpreadRule",
]

#: ``grad_vanish``: a layer's gradient L2 norm below this (seed 000 §3.1).
DEFAULT_VANISH_THRESHOLD = default("grad_vanish")
#: ``grad_explode``: a layer's gradient L2 norm above this (seed 000 §3.1).
DEFAULT_EXPLODE_THRESHOLD = default("grad_explode")
#: ``grad_layer_spread``: largest / smallest layer norm above this: two orders of magnitude (seed 000 §3.1).
DEFAULT_SPREAD_RATIO = default("grad_layer_spread")
#: ``grad_collapse``: global norm below this fraction of its baseline (seed 001 §1.2).
DEFAULT_COLLAPSE_RATIO = default("grad_collapse")
#: Consecutive measurements a gradient condition must hold before it alerts.
DEFAULT_GRAD_PATIENCE = int(default("grad.patience"))
#: ``grad_collapse``: measurements whose median global norm is the baseline.
DEFAULT_BASELINE_MEASUREMENTS = int(default("grad_collapse.baseline_measurements"))

#: ``grad_frozen``: why a parameter cannot learn, and the advice for each.
FROZEN_REASONS: dict[str, str] = {
    "frozen": "`requires_grad` is False",
    "excluded": "it is trainable but in no optimizer's parameter groups",
    "no_grad": "it gets no gradient (a `detach`, `torch.no_grad` or an unused branch cuts it from the loss)",
}


class GradBandRule(Rule):
    """``grad_vanish`` and ``grad_explode``, per layer.

    Example:
        >>> rule = GradBandRule(patience=2)
        >>> [len(rule.update({"fc": n}, StepContext(0, i))) for i, n in enumerate([1.0, 50.0, 60.0, 70.0])]
        [0, 1, 0, 0]
    """

    rule_id = GRAD_VANISH
    state_keys = ("streaks",)

    def __init__(
        self,
        vanish_threshold: float = DEFAULT_VANISH_THRESHOLD,
        explode_threshold: float = DEFAULT_EXPLODE_THRESHOLD,
        patience: int = DEFAULT_GRAD_PATIENCE,
        relative: float = DEFAULT_SPREAD_RATIO,
    ) -> None:
        super().__init__()
        self.relative = relative
        self.vanish_threshold = vanish_threshold
        self.explode_threshold = explode_threshold
        self.patience = patience
        self.streaks: dict[str, int] = {}

    def update(self, layer_norms: Mapping[str, float], ctx: StepContext, total: float | None = None) -> list[Alert]:
        """Feed one measurement of every layer's norm (and the global norm); return the alerts raised."""
        alerts = []
        if total is None:
            total = math.sqrt(sum(v * v for v in layer_norms.values() if math.isfinite(v)))
        for layer, norm in layer_norms.items():
            if not math.isfinite(norm):
                continue
            starved = norm < self.vanish_threshold and norm * self.relative < total
            for rule, bad, threshold, word in (
                (GRAD_VANISH, starved, self.vanish_threshold, "below"),
                (GRAD_EXPLODE, norm > self.explode_threshold, self.explode_threshold, "above"),
            ):
                key = f"{rule}:{layer}"
                self.streaks[key] = self.streaks.get(key, 0) + 1 if bad else 0
                needed = self.patience if rule == GRAD_VANISH else 1
                if self.latch.update(key, self.streaks[key] >= needed):
                    hint = (
                        "check saturating activations, depth without residuals or normalisation, a too-small init"
                        if rule == GRAD_VANISH
                        else "lower the learning rate, clip gradients or check the loss scale"
                    )
                    alerts.append(
                        self._alert(
                            ctx,
                            f"gradient L2 norm of `{layer}` is {norm:.3g}, {word} {threshold:g}"
                            + (f" on {needed} consecutive measurements" if needed > 1 else "")
                            + f": {hint}",
                            source=layer,
                            value=norm,
                            threshold=threshold,
                            rule=rule,
                        )
                    )
        return alerts


class GradSpreadRule(Rule):
    """``grad_layer_spread``: largest / smallest layer norm above ``spread_ratio``."""

    rule_id = GRAD_LAYER_SPREAD
    state_keys = ("streak",)

    def __init__(self, spread_ratio: float = DEFAULT_SPREAD_RATIO, patience: int = DEFAULT_GRAD_PATIENCE) -> None:
        super().__init__()
        self.spread_ratio = spread_ratio
        self.patience = patience
        self.streak = 0

    def update(self, layer_norms: Mapping[str, float], ctx: StepContext) -> list[Alert]:
        """Feed one measurement of every layer's norm; return the alerts raised."""
        finite = {k: v for k, v in layer_norms.items() if math.isfinite(v) and v > 0}
        if len(finite) < 2:
            return []
        high = max(finite, key=finite.__getitem__)
        low = min(finite, key=finite.__getitem__)
        ratio = finite[high] / finite[low]
        self.streak = self.streak + 1 if ratio > self.spread_ratio else 0
        if not self.latch.update("model", self.streak >= self.patience):
            return []
        return [
            self._alert(
                ctx,
                f"gradient norms across layers span {ratio:.3g}x (largest `{high}` {finite[high]:.3g}, smallest "
                f"`{low}` {finite[low]:.3g}), more than {self.spread_ratio:g}x: layers learn at very different "
                "speeds; check normalisation, initialisation and per-layer learning rates",
                source="model",
                value=ratio,
                threshold=self.spread_ratio,
            )
        ]


class GradCollapseRule(Rule):
    """``grad_collapse``: the global norm falls below ``collapse_ratio`` times its early-training baseline.

    Example:
        >>> rule = GradCollapseRule(patience=1, baseline_measurements=2)
        >>> [len(rule.update(n, StepContext(0, i))) for i, n in enumerate([1.0, 1.2, 0.5, 0.001])]
        [0, 0, 0, 1]
    """

    rule_id = GRAD_COLLAPSE
    state_keys = ("early", "baseline", "streak")

    def __init__(
        self,
        collapse_ratio: float = DEFAULT_COLLAPSE_RATIO,
        patience: int = DEFAULT_GRAD_PATIENCE,
        baseline_measurements: int = DEFAULT_BASELINE_MEASUREMENTS,
    ) -> None:
        super().__init__()
        self.collapse_ratio = collapse_ratio
        self.patience = patience
        self.baseline_measurements = baseline_measurements
        self.early: list[float] = []
        self.baseline: float | None = None
        self.streak = 0

    def update(self, total_norm: float, ctx: StepContext) -> list[Alert]:
        """Feed one global gradient norm; return the alerts raised."""
        if not math.isfinite(total_norm):
            return []
        if self.baseline is None:
            self.early.append(total_norm)
            if len(self.early) >= self.baseline_measurements:
                self.baseline = statistics.median(self.early)
            return []
        limit = self.collapse_ratio * self.baseline
        self.streak = self.streak + 1 if total_norm < limit else 0
        if not self.latch.update("global", self.streak >= self.patience):
            return []
        return [
            self._alert(
                ctx,
                f"global gradient norm {total_norm:.3g} is below {self.collapse_ratio:g} x its baseline "
                f"{self.baseline:.3g} on {self.patience} consecutive measurements: units may have died (ReLU), "
                "the loss may have saturated, or the graph may be cut",
                source="global",
                value=total_norm / self.baseline if self.baseline > 0 else total_norm,
                threshold=self.collapse_ratio,
            )
        ]


class GradFrozenRule(Rule):
    """``grad_frozen``: layers whose parameters cannot learn while the rest of the model trains.

    Fed, at each measurement, ``{parameter name: reason}`` for every parameter that cannot learn (reasons are
    the keys of :data:`FROZEN_REASONS`) and the names of all parameters. Stuck parameters are grouped under the
    outermost module all of whose parameters are stuck (a whole frozen block is one alert), else under the
    module that owns them. ``"frozen"`` and ``"excluded"`` alert at once; ``"no_grad"`` after ``patience``
    consecutive measurements. One alert per group, latched until it learns again.

    Example:
        >>> rule = GradFrozenRule(patience=2)
        >>> names = ["enc.0.weight", "enc.1.lin.weight", "enc.1.norm.weight", "head.weight"]
        >>> stuck = {"enc.1.lin.weight": "frozen", "enc.1.norm.weight": "frozen"}
        >>> [(a.rule, a.source) for a in rule.update(stuck, StepContext(0, 0), names)]
        [('grad_frozen', 'enc.1')]
        >>> rule.update(stuck, StepContext(0, 5), names)
        []
    """

    rule_id = GRAD_FROZEN
    state_keys = ("streaks",)

    def __init__(self, patience: int = DEFAULT_GRAD_PATIENCE) -> None:
        super().__init__()
        self.patience = patience
        self.streaks: dict[str, int] = {}

    @staticmethod
    def layer_of(name: str) -> str:
        """The owning module of a parameter name (``enc.1.weight`` -> ``enc.1``)."""
        return name.rsplit(".", 1)[0] if "." in name else name

    @staticmethod
    def _prefixes(name: str) -> list[str]:
        parts = name.split(".")
        return [".".join(parts[:i]) for i in range(1, len(parts))]

    def group_of(self, stuck: Mapping[str, str], names: Sequence[str]) -> dict[str, str]:
        """``{stuck parameter: its group}``: the outermost module whose parameters are all stuck."""
        total: dict[str, int] = {}
        for name in names:
            for prefix in self._prefixes(name):
                total[prefix] = total.get(prefix, 0) + 1
        stuck_count: dict[str, int] = {}
        for name in stuck:
            for prefix in self._prefixes(name):
                stuck_count[prefix] = stuck_count.get(prefix, 0) + 1
        groups = {}
        for name in stuck:
            whole = [p for p in self._prefixes(name) if stuck_count.get(p, 0) == total.get(p, -1)]
            groups[name] = whole[0] if whole else self.layer_of(name)
        return groups

    def update(self, stuck: Mapping[str, str], ctx: StepContext, names: Sequence[str] = ()) -> list[Alert]:
        """Feed the parameters that cannot learn at this measurement and all parameter names; return the alerts."""
        group = self.group_of(stuck, list(names) or list(stuck))
        layers: dict[str, dict[str, list[str]]] = {}
        for name, reason in stuck.items():
            layers.setdefault(group[name], {}).setdefault(reason, []).append(name)
        streaks = {layer: self.streaks.get(layer, 0) + 1 for layer in layers}
        self.streaks = streaks
        alerts = []
        for layer in sorted(set(layers) | set(self.latch.active)):
            reasons = layers.get(layer, {})
            needed = 1 if ("frozen" in reasons or "excluded" in reasons) else self.patience
            if not self.latch.update(layer, bool(reasons) and streaks.get(layer, 0) >= needed):
                continue
            parts = []
            for reason, names in sorted(reasons.items()):
                shown = ", ".join(f"`{n}`" for n in names[:4]) + (
                    f" and {len(names) - 4} more" if len(names) > 4 else ""
                )
                parts.append(f"{shown}: {FROZEN_REASONS.get(reason, reason)}")
            alerts.append(
                self._alert(
                    ctx,
                    f"`{layer}` does not learn while the rest of the model does; "
                    + "; ".join(parts)
                    + ". If this is on purpose, name it in `expect_frozen`",
                    source=layer,
                    value=float(sum(len(n) for n in reasons.values())),
                    threshold=None,
                )
            )
        return alerts
