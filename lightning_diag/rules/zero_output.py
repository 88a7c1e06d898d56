"""``zero_output``: a module's output turns all-zero (framework-free).

Fed by :class:`~lightning_diag.AnomalyAlarm`
(:mod:`lightning_diag.callbacks.anomaly_alarm.runtime_checks` measures).

``zero_output`` (warning): a module's output is all zeros on a sampled training step while it was non-zero on
each of its (at least ``threshold``) measurements before and never zero: a copy between devices or ranks that
arrived as zeros (a faulty link, a failed transfer). Transitions are judged, not the state: a module whose output
was ever zero before (a ReLU dead from the start, a zero-initialised adapter) never fires, and each module fires
once per fit. Only modules whose output took negative values on an earlier measurement are judged: a rectifier
(or a block ending in one) returns all zeros whenever no unit responds to the input, which one sample (batch size
1) or a layer whose units died does legitimately (``dead_units``' concern, not a corrupted copy); an exact zero
from a module whose outputs had both signs is implausible at any batch size.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

from lightning_diag.core.record import Alert
from lightning_diag.core.registry import Limit, RuleSpec, default, register
from lightning_diag.rules.base import Rule, StepContext, list_names
from lightning_diag.rules.grad_collapse import GRAD_COLLAPSE
from lightning_diag.rules.loss_outlier import LOSS_OUTLIER
from lightning_diag.rules.measures import Measure, Measures

__all__ = [
    "DEFAULT_ZERO_OUTPUT_HISTORY",
    "ZERO_OUTPUT",
    "ZERO_OUTPUT_SPEC",
    "ZeroOutputRule",
]

_ALARM = "AnomalyAlarm"

ZERO_OUTPUT_SPEC = register(
    RuleSpec(
        "zero_output",
        _ALARM,
        "warning",
        3,
        "a module's output all zeros on a sampled training step after non-zero outputs on each of its "
        "{threshold:g} or more measurements before (a copy arriving as zeros)",
        limits={"threshold": Limit(low=1, integer=True)},
    )
)
ZERO_OUTPUT = ZERO_OUTPUT_SPEC.rule_id

#: ``zero_output``: non-zero measurements a module needs before an all-zero output is judged a transition.
DEFAULT_ZERO_OUTPUT_HISTORY: int = int(default(ZERO_OUTPUT_SPEC.rule_id))
#: Names an alert lists, at most.
_SHOWN = 4


class ZeroOutputRule(Rule):
    """``zero_output``: modules whose output turned all-zero on a sampled step after non-zero measurements.

    Example:
        >>> from lightning_diag.rules.measures import ZeroOutputs
        >>> rule = ZeroOutputRule(history=2)
        >>> def zeros(names):
        ...     return Measures(zero_outputs=ZeroOutputs(["enc", "enc.act"], names))
        >>> [rule.judge(StepContext(0, s), zeros(["enc.act"])) for s in (0, 5)]  # dead from the start
        [[], []]
        >>> rule.judge(StepContext(0, 10), zeros([]))
        []
        >>> [(a.rule, a.source) for a in rule.judge(StepContext(0, 15), zeros(["enc"]))]
        [('zero_output', 'enc')]
        >>> rule.judge(StepContext(0, 20), zeros(["enc"]))  # once per module and fit
        []
    """

    specs = (ZERO_OUTPUT_SPEC,)
    setting_keys: ClassVar[Mapping[str, str]] = {"history": ZERO_OUTPUT}
    state_keys = ("nonzero", "zeroed", "checks", "signed")
    needs = frozenset({Measure.ZERO_OUTPUTS})

    def __init__(self, history: int = DEFAULT_ZERO_OUTPUT_HISTORY) -> None:
        super().__init__()
        self.history = max(int(history), 1)
        #: Per module, its measurements with a non-zero output (while never zero).
        self.nonzero: dict[str, int] = {}
        #: The modules seen returning zeros (never judged again in this fit).
        self.zeroed: list[str] = []
        #: Sampled steps judged.
        self.checks = 0
        #: The modules seen returning a negative value (only they are judged, when signs are fed).
        self.signed: list[str] = []

    def judge(self, ctx: StepContext, m: Measures) -> list[Alert]:
        """Judge one sampled step: the modules that ran, those among them whose every output was all zeros and,
        when known, those that returned a negative value (``None``: signs not measured, every module judged)."""
        assert m.zero_outputs is not None  # checked against `needs`
        ran, zeros, signed = m.zero_outputs.ran, m.zero_outputs.zeros, m.zero_outputs.signed
        self.checks += 1
        zero_set = set(zeros)
        known = set(self.zeroed)
        judged = None if signed is None else set(self.signed)
        found = [
            n
            for n in zeros
            if n not in known and self.nonzero.get(n, 0) >= self.history and (judged is None or n in judged)
        ]
        if signed is not None:
            self.signed += [n for n in signed if judged is not None and n not in judged]
        for name in ran:
            if name in zero_set:
                if name not in known:
                    self.zeroed.append(name)
                    known.add(name)
                self.nonzero.pop(name, None)
            elif name not in known:
                self.nonzero[name] = self.nonzero.get(name, 0) + 1
        if not found:
            return []
        found.sort(key=lambda n: -n.count(".") if n else 1)  # the innermost first
        shown = list_names([n or "<root>" for n in found], _SHOWN, "modules")
        return [
            self._alert(
                ctx,
                f"the output of {shown} is all zeros on this step, after non-zero outputs of both signs on each of "
                f"its {self.history} or more earlier measurements: a copy between devices or ranks that arrived as "
                "zeros (a faulty link or transfer: pytorch #84803, #96600), or a layer whose weights were zeroed. A "
                f"transient corruption comes and goes (look for `{LOSS_OUTLIER}` at other steps); a layer that stays "
                f"zero is followed by `{GRAD_COLLAPSE}`",
                source=found[0] or "<root>",
                value=float(len(found)),
                threshold=float(self.history),
            )
        ]
