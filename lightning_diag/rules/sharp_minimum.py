"""``sharp_minimum``, the rule of :class:`~lightning_diag.SharpnessProbe` (validation end). Plain Python; defaults
read from the rule registry.
"""

from __future__ import annotations

import math

from lightning_diag.core.record import Alert
from lightning_diag.core.registry import COUNT, POSITIVE, RULES, CheckSpec, RuleSpec, register
from lightning_diag.core.tags import sharpness_tag
from lightning_diag.rules.base import Latch, Rule, StepContext, excess
from lightning_diag.rules.measures import Measure, Measures, SharpnessReading
from lightning_diag.rules.rows import Check, LoggedRun, finite_values, fmt, measure, replay, run_setting

__all__ = [
    "DEFAULT_SHARP_MINIMUM_PATIENCE",
    "DEFAULT_SHARP_MINIMUM_RHO",
    "DEFAULT_SHARP_MINIMUM_THRESHOLD",
    "LOSS_SURFACE_CHECK",
    "SHARP_MINIMUM",
    "SHARP_MINIMUM_PATIENCE_KEY",
    "SHARP_MINIMUM_RHO_KEY",
    "SHARP_MINIMUM_SPEC",
    "SharpMinimumRule",
]

# -- declaration (the docs' thresholds table and the report read it) ---------------------------------------------
SHARP_MINIMUM_SPEC = register(RuleSpec(
    "sharp_minimum", "SharpnessProbe", "warning", 0.3,
    "SAM gap L(w+ε) − L(w) above {threshold:g} (rho {rho:g}) on {patience:g} consecutive probes",
    settings={"rho": 0.05, "patience": 3}, check="loss_surface", source="seed 000 §4.1",
    limits={"threshold": POSITIVE, "rho": POSITIVE, "patience": COUNT},
))
SHARP_MINIMUM = SHARP_MINIMUM_SPEC.rule_id
#: Its row of the ``lightning-diag report`` checklist (registered in report order by
#: :mod:`lightning_diag.rules.catalog`).
LOSS_SURFACE_CHECK = CheckSpec("loss_surface", "Training",
                               "Loss surface: SAM gap L(w+ε) − L(w) not above {sharp_minimum:g} on "
                               "{sharp_minimum__patience:g} consecutive probes (rho {sharp_minimum__rho:g})")
#: ``thresholds()`` keys of the settings SharpnessProbe reads for its own measuring.
SHARP_MINIMUM_PATIENCE_KEY = SHARP_MINIMUM_SPEC.key("patience")
SHARP_MINIMUM_RHO_KEY = SHARP_MINIMUM_SPEC.key("rho")

_SHARP = SHARP_MINIMUM_SPEC
#: SAM gap above which a probe counts as sharp (seed 000 §4.1).
DEFAULT_SHARP_MINIMUM_THRESHOLD: float = _SHARP.value({})
#: SAM's perturbation radius (Foret et al. 2021).
DEFAULT_SHARP_MINIMUM_RHO: float = float(_SHARP.settings["rho"])
#: Consecutive sharp probes before ``sharp_minimum`` fires ("persistently").
DEFAULT_SHARP_MINIMUM_PATIENCE: int = int(_SHARP.settings["patience"])
_WORST_NAMED = 3


class SharpMinimumRule(Rule):
    """``sharp_minimum``: the SAM gap above ``threshold`` on ``patience`` consecutive probes.

    A non-finite gap is skipped (the streak neither grows nor resets). The alert's source is ``"model"``. The
    margin noted (:meth:`~lightning_diag.rules.base.Rule.observe`) is the statistic that decides: the smallest gap of
    the last ``patience`` probes (from the ``patience``-th probe on), so a single sharp probe is not "close to an
    alert".

    Example:
        >>> from lightning_diag.rules.measures import SharpnessReading
        >>> rule = SharpMinimumRule(threshold=0.3, patience=2)
        >>> ms = [Measures(sharpness=SharpnessReading(g)) for g in (0.5, 0.1, 0.5, 0.6, 0.7)]
        >>> [bool(rule.judge(StepContext(i, i), m)) for i, m in enumerate(ms)]
        [False, False, False, True, False]
        >>> round(rule.peaks["sharp_minimum"], 3)  # min(0.6, 0.7) / 0.3
        2.0
    """

    specs = (SHARP_MINIMUM_SPEC,)
    needs = frozenset({Measure.SHARPNESS})
    state_keys = ("streak", "recent")

    def __init__(
        self, threshold: float = DEFAULT_SHARP_MINIMUM_THRESHOLD, patience: int = DEFAULT_SHARP_MINIMUM_PATIENCE
    ) -> None:
        super().__init__()
        self.threshold = threshold
        self.patience = patience
        self.latch = Latch.for_patience(patience)
        self.streak = 0
        #: The last ``patience`` finite gaps (the smallest decides).
        self.recent: list[float] = []

    def judge(self, ctx: StepContext, m: Measures) -> list[Alert]:
        """Judge one probe's gap; return the alert when the streak reaches ``patience`` (latched)."""
        s = m.sharpness
        assert s is not None  # checked against `needs`
        gap, relative_gap, rho, worst_layers = s.gap, s.relative_gap, s.rho, s.worst_layers
        if not math.isfinite(gap):
            return []
        self.recent = [*self.recent, float(gap)][-max(int(self.patience), 1) :]
        if len(self.recent) >= self.patience:
            self.observe(min(self.recent), self.threshold)  # the statistic that decides
        self.streak = self.streak + 1 if gap > self.threshold else 0
        if not self.latch.update("model", self.streak >= self.patience, excess(gap, self.threshold)):
            return []
        parts = [f"SAM gap L(w+ε) − L(w) = {gap:.3g} above {self.threshold:g} on {self.streak} consecutive probes"]
        if rho is not None:
            parts[0] += f" (rho {rho:g})"
        if relative_gap is not None and math.isfinite(relative_gap):
            parts.append(f"{relative_gap:.0%} of the loss")
        if worst_layers:
            parts.append("most sensitive: " + ", ".join(f"{n} (+{g:.3g})" for n, g in worst_layers[:_WORST_NAMED]))
        message = "; ".join(parts) + (
            ": the minimum is sharp, which tends to generalise poorly; consider SAM/ASAM, a lower learning rate "
            "late in training, weight decay, or a larger batch-noise scale"
        )
        return [self._alert(ctx, message, "model", gap, self.threshold)]


# -- the report's loss_surface row (SharpnessProbe's ``diag/sharpness/...``) -------------------------------------


@measure("loss_surface")
def _measure_loss_surface(run: LoggedRun, check: Check) -> bool:
    check.threshold = RULES[SHARP_MINIMUM].describe(run.thresholds)
    check.threshold_value = {
        "value": run_setting(run, SHARP_MINIMUM),
        "patience": run_setting(run, SHARP_MINIMUM_PATIENCE_KEY),
    }
    gaps = finite_values(run.scalars.get(sharpness_tag("gap"), []))
    if not gaps:
        return False
    relative = finite_values(run.scalars.get(sharpness_tag("relative_gap"), []))
    check.measured = f"SAM gap {fmt(min(gaps))} .. {fmt(max(gaps))} over {len(gaps)} probes (last {fmt(gaps[-1])}"
    check.measured += f", {relative[-1]:.0%} of the loss)" if relative else ")"
    check.measured_value = {"min": min(gaps), "max": max(gaps), "last": gaps[-1]}
    return True


@replay("loss_surface")
def _replay_loss_surface(run: LoggedRun) -> list[Alert]:
    rule = SharpMinimumRule.from_settings(run.thresholds)
    alerts: list[Alert] = []
    for step, gap in run.scalars.get(sharpness_tag("gap"), []):
        alerts += rule.judge(StepContext(0, step), Measures(sharpness=SharpnessReading(gap)))
    return alerts
