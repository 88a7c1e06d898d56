"""``ddp_desync`` (framework-free): parameters that differ across data-parallel replicas.

Fed by :class:`~lightning_diag.AnomalyAlarm` every ``desync_every_n_steps`` optimizer steps with every rank's
checksums (two numbers per parameter: its L2 norm and its sum,
:func:`lightning_diag.stats.updates.parameter_checksums`), gathered in one collective. A parameter whose
checksum on some rank differs from rank zero's by more than ``tolerance`` (relative to rank zero's value) is
out of sync: the alert (critical) names the first such parameter in the model's order and the ranks that
differ. Latched: the run alerts once, and again only after a check found the replicas in agreement.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from lightning_diag.core.record import Alert, Severity
from lightning_diag.core.registry import RuleSpec, default, register
from lightning_diag.rules.base import Rule, StepContext

__all__ = [
    "DDP_DESYNC",
    "DDP_DESYNC_SPEC",
    "DEFAULT_DESYNC_EVERY_N_STEPS",
    "DEFAULT_DESYNC_TOLERANCE",
    "DesyncRule",
    "replica_differences",
]

# -- declaration (the docs' thresholds table and the report read it) -------------------------------------------
_ALARM = "AnomalyAlarm"
DDP_DESYNC_SPEC = register(RuleSpec(
    "ddp_desync", _ALARM, "critical", 1e-6,
    "a parameter's checksum differs across data-parallel replicas by more than {threshold:g} "
    "(relative), checked every {every_n_steps:g} optimizer steps",
    settings={"every_n_steps": 100}, check="replicas_agree",
    arguments={"threshold": "desync_tolerance", "every_n_steps": "desync_every_n_steps"},
))
DDP_DESYNC = DDP_DESYNC_SPEC.rule_id

#: ``ddp_desync``: relative checksum difference across ranks above this.
DEFAULT_DESYNC_TOLERANCE = default(DDP_DESYNC)
#: ``ddp_desync``: optimizer steps between two comparisons.
DEFAULT_DESYNC_EVERY_N_STEPS = int(default(f"{DDP_DESYNC}.every_n_steps"))


def replica_differences(checksums: Sequence[Sequence[float]]) -> list[list[float]]:
    """``[rank][value]``: each rank's relative difference from rank zero, value by value.

    Example:
        >>> replica_differences([[2.0, 1.0], [2.0, 1.5]])
        [[0.0, 0.0], [0.0, 0.5]]
    """
    ref = checksums[0]
    out = []
    for row in checksums:
        diffs = []
        for a, b in zip(row, ref, strict=True):
            if a == b:
                diffs.append(0.0)
            elif not (math.isfinite(a) and math.isfinite(b)):
                diffs.append(math.inf)
            else:
                diffs.append(abs(a - b) / max(abs(b), 1e-12))
        out.append(diffs)
    return out


class DesyncRule(Rule):
    """``ddp_desync``: one comparison of every rank's parameter checksums.

    Example:
        >>> rule = DesyncRule()
        >>> same = [[1.0, 2.0, 1.0, 2.0]] * 2  # two ranks, norms then sums of two parameters
        >>> rule.update(same, ["a", "b"], StepContext(0, 100))
        []
        >>> drift = [[1.0, 2.0, 1.0, 2.0], [1.0, 2.1, 1.0, 2.0]]
        >>> [(a.rule, a.source, a.severity) for a in rule.update(drift, ["a", "b"], StepContext(0, 200))]
        [('ddp_desync', 'b', <Severity.CRITICAL: 'critical'>)]
    """

    specs = (DDP_DESYNC_SPEC,)
    severity = Severity.CRITICAL
    state_keys = ("checks", "last_max_diff")

    def __init__(self, tolerance: float = DEFAULT_DESYNC_TOLERANCE) -> None:
        super().__init__()
        self.tolerance = tolerance
        self.checks = 0
        self.last_max_diff = 0.0

    @classmethod
    def from_settings(cls, thresholds: Mapping[str, float | None]) -> DesyncRule:
        """The rule with the threshold in effect (see :meth:`Rule.from_settings`)."""
        return cls(DDP_DESYNC_SPEC.value(thresholds))

    def update(self, checksums: Sequence[Sequence[float]], names: Sequence[str], ctx: StepContext) -> list[Alert]:
        """Judge one comparison.

        Args:
            checksums: ``[rank][2 * n]``: each rank's norms of the ``n`` parameters, then their sums.
            names: The ``n`` parameter names, in the model's order.
            ctx: Where the comparison was made.
        """
        self.checks += 1
        n = len(names)
        diffs = replica_differences(checksums)
        per_param = [max(max(d[i], d[n + i]) for d in diffs) for i in range(n)]
        self.last_max_diff = max(per_param, default=0.0)
        bad = [i for i, v in enumerate(per_param) if v > self.tolerance]
        if not self.latch.update("replicas", bool(bad)):
            return []
        first = bad[0]
        ranks = [r for r, d in enumerate(diffs) if max(d[first], d[n + first]) > self.tolerance]
        return [
            self._alert(
                ctx,
                f"data-parallel replicas disagree: `{names[first]}` on rank(s) {', '.join(map(str, ranks))} differs "
                f"from rank 0 by {per_param[first]:.3g} (relative checksum difference, above {self.tolerance:g}); "
                f"{len(bad)} of {n} parameters differ. Each rank now trains its own model: look for rank-dependent "
                "code touching the weights (an update outside the optimizer, loading weights on one rank), "
                "non-synchronised parameters (`find_unused_parameters`, parameters DDP does not see) or a hardware "
                "fault; resume from a checkpoint saved before this step",
                source=names[first],
                value=per_param[first],
                threshold=self.tolerance,
            )
        ]
