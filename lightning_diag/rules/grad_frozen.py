"""``grad_frozen`` (framework-free): parameters that cannot learn while the rest of the model trains.

"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import ClassVar

from lightning_diag.core.record import Alert, Severity
from lightning_diag.core.registry import COUNT, RuleSpec, SettingSpec, register, register_setting
from lightning_diag.rules.base import Rule, StepContext
from lightning_diag.rules.measures import Measure, Measures

__all__ = [
    "FROZEN_REASONS",
    "GRAD_FROZEN",
    "GRAD_FROZEN_SPEC",
    "GRAD_PATIENCE_SETTING",
    "GradFrozenRule",
]

#: The owner of every gradient-flow rule.
GRADIENT_FLOW = "GradientFlowMonitor"

# -- declarations -------------------------------------------------------------------------------------------
GRAD_FROZEN_SPEC = register(
    RuleSpec(
        "grad_frozen",
        GRADIENT_FLOW,
        "warning",
        None,
        "a trainable parameter that cannot learn (in no optimizer, or a zero gradient); requires_grad=False and "
        "modules never called are an info",
    )
)
GRAD_FROZEN = GRAD_FROZEN_SPEC.rule_id
#: ``grad.patience``: consecutive measurements a gradient condition must hold before it alerts, shared by every
#: gradient-flow rule (declared here, the first gradient module to load;
#: :mod:`lightning_diag.rules.grad_settings` reads its default as ``DEFAULT_GRAD_PATIENCE``).
GRAD_PATIENCE_SETTING = register_setting(SettingSpec("grad.patience", GRADIENT_FLOW, 3, limit=COUNT))
_PATIENCE = int(GRAD_PATIENCE_SETTING.default)

#: ``grad_frozen``: why a parameter cannot learn, and the advice for each.
FROZEN_REASONS: dict[str, str] = {
    "frozen": "`requires_grad` is False (frozen on purpose?)",
    "excluded": "it is trainable but in no optimizer's parameter groups",
    "no_grad": "not in the graph: it gets no gradient (its module's forward never ran, or a `detach` or "
    "`torch.no_grad` cuts it from the loss)",
    "zero_grad": "its gradient became exactly zero and stayed so (it is in the graph, but nothing reaches it any more)",
    "unreached": "in the graph, but its gradient has been exactly zero at every measurement since the fit began: "
    "the loss does not depend on it in this configuration (an input that is always zero or empty, an output "
    "nothing downstream uses, such as a softmax over one element)",
}
#: The reasons listed together in the one ``unused`` information.
_UNUSED = frozenset({"no_grad", "unreached"})


class GradFrozenRule(Rule):
    """``grad_frozen``: layers whose parameters cannot learn while the rest of the model trains.

    ``requires_grad=False`` is how everyone freezes on purpose: a group whose only reason is ``"frozen"`` is an
    ``info``, never a warning. A parameter the loss never reached is information too: outside the graph
    (``"no_grad"``: its ``.grad`` is ``None`` after backward, typically an optional head or encoder the
    configuration never calls), or in it with a gradient of exactly zero at every measurement since the first
    (``"unreached"``: an input that is always zero or empty, an output nothing downstream uses; at initialisation
    only the structure of the computation, never saturation, makes a gradient exactly zero). After ``patience``
    consecutive measurements, **one** ``info`` alert lists every such group (source ``"unused"``), and it is not
    repeated for them. ``"excluded"`` (trainable, in no optimizer) and ``"zero_grad"`` (in the graph, a gradient
    that was non-zero and became exactly zero) are warnings.

    Fed, at each measurement, ``{parameter name: reason}`` for every parameter that cannot learn (reasons are
    the keys of :data:`FROZEN_REASONS`) and the names of all parameters. Stuck parameters are grouped under the
    outermost module all of whose parameters are stuck (a whole frozen block is one alert), else under the
    module that owns them. ``"frozen"`` and ``"excluded"`` alert at once; ``"no_grad"`` and ``"zero_grad"`` after
    ``patience`` consecutive measurements. One alert per group, latched until it learns again.

    Example:
        >>> rule = GradFrozenRule(patience=2)
        >>> names = ["enc.0.weight", "enc.1.lin.weight", "enc.1.norm.weight", "head.weight"]
        >>> stuck = {"enc.1.lin.weight": "frozen", "enc.1.norm.weight": "frozen"}
        >>> m = Measures(stuck_params=stuck, param_names=names)
        >>> [(a.rule, a.source) for a in rule.judge(StepContext(0, 0), m)]
        [('grad_frozen', 'enc.1')]
        >>> rule.judge(StepContext(0, 5), m)
        []
    """

    specs = (GRAD_FROZEN_SPEC,)
    setting_keys: ClassVar[Mapping[str, str]] = {"patience": GRAD_PATIENCE_SETTING.key}
    needs = frozenset({Measure.STUCK_PARAMS})
    optional = frozenset({Measure.PARAM_NAMES})
    state_keys = ("streaks", "unused", "unreached")

    def __init__(self, patience: int = _PATIENCE) -> None:
        super().__init__()
        self.patience = patience
        self.streaks: dict[str, int] = {}
        #: Groups the loss never reached, already listed in the ``info`` (each is listed once per fit).
        self.unused: list[str] = []
        #: Parameters whose gradient has been exactly zero at every measurement since the first (``None`` before
        #: it): reason ``"unreached"`` instead of ``"zero_grad"``.
        self.unreached: list[str] | None = None

    def observe_reached(self, stuck: Mapping[str, str]) -> dict[str, str]:
        """``stuck`` with ``"zero_grad"`` replaced by ``"unreached"`` for the parameters whose gradient has been
        exactly zero at every measurement since the first one (a parameter that had a gradient once never is)."""
        zeros = {name for name, reason in stuck.items() if reason == "zero_grad"}
        if self.unreached is None:
            self.unreached = sorted(zeros)
        else:
            self.unreached = [name for name in self.unreached if name in zeros]
        unreached = set(self.unreached)
        return {name: "unreached" if name in unreached else reason for name, reason in stuck.items()}

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

    def judge(self, ctx: StepContext, m: Measures) -> list[Alert]:
        """Judge the parameters that cannot learn at this measurement and all parameter names; return the alerts."""
        names = m.param_names or ()
        stuck = self.observe_reached(m.stuck_params or {})
        group = self.group_of(stuck, list(names) or list(stuck))
        layers: dict[str, dict[str, list[str]]] = {}
        for name, reason in stuck.items():
            layers.setdefault(group[name], {}).setdefault(reason, []).append(name)
        streaks = {layer: self.streaks.get(layer, 0) + 1 for layer in layers}
        self.streaks = streaks
        alerts = []
        # Never reached by the loss (every stuck parameter of the group lacks a .grad, or has had a gradient of
        # exactly zero since the first measurement): listed once, as information.
        unused = sorted(
            layer
            for layer, reasons in layers.items()
            if set(reasons) <= _UNUSED and streaks[layer] >= self.patience and layer not in self.unused
        )
        if unused:
            self.unused = sorted({*self.unused, *unused})
            alerts.append(self._unused_alert(ctx, {layer: layers[layer] for layer in unused}))
        for layer in sorted(set(layers) | set(self.latch.active)):
            reasons = layers.get(layer, {})
            if layer in self.unused and set(reasons) <= _UNUSED:
                continue  # listed in the info (its latch is not used)
            needed = 1 if ("frozen" in reasons or "excluded" in reasons) else self.patience
            if not self.latch.update(layer, bool(reasons) and streaks.get(layer, 0) >= needed):
                continue
            parts = []
            for reason, names in sorted(reasons.items()):
                shown = ", ".join(f"`{n}`" for n in names[:4]) + (
                    f" and {len(names) - 4} more" if len(names) > 4 else ""
                )
                parts.append(f"{shown}: {FROZEN_REASONS.get(reason, reason)}")
            deliberate = set(reasons) == {"frozen"}  # (no_grad alone is the unused-module info above)
            alerts.append(
                self._alert(
                    ctx,
                    (
                        f"`{layer}` is frozen (`requires_grad=False`) and does not learn; "
                        if deliberate
                        else f"`{layer}` does not learn while the rest of the model does; "
                    )
                    + "; ".join(parts)
                    + (
                        ". Reported once as information; name it in `expect_frozen` to silence it"
                        if deliberate
                        else ". If this is on purpose, name it in `expect_frozen`"
                    ),
                    source=layer,
                    value=float(sum(len(n) for n in reasons.values())),
                    threshold=None,
                    severity=Severity.INFO if deliberate else None,
                )
            )
        return alerts

    def _unused_alert(self, ctx: StepContext, groups: Mapping[str, Mapping[str, list[str]]]) -> Alert:
        """The one ``info`` listing the groups the loss never reached, by reason."""
        parts = []
        for reason, what in (
            ("no_grad", "not in the graph (no gradient: their module's forward never ran, an optional head or "
             "encoder this configuration does not use, or a `detach`/`torch.no_grad` cuts them from the loss)"),
            ("unreached", "in the graph with a gradient of exactly zero since the fit began (the loss does not "
             "depend on them in this configuration: an input that is always zero or empty, or an output nothing "
             "downstream uses, such as a softmax over one element)"),
        ):  # fmt: skip
            names = [g for g, reasons in groups.items() if reason in reasons]
            if names:
                more = f" and {len(names) - 8} more" if len(names) > 8 else ""
                shown = ", ".join(f"`{g}`" for g in names[:8]) + more
                parts.append(f"{what}: {shown}")
        count = sum(len(n) for reasons in groups.values() for n in reasons.values())
        return self._alert(
            ctx,
            f"{count} trainable parameter(s) in {len(groups)} module(s) get nothing from the loss at "
            f"{self.patience} consecutive measurements; " + "; ".join(parts) + ". Reported once as information; "
            "name them in `expect_frozen` to silence it",
            source="unused",
            value=float(count),
            threshold=None,
            severity=Severity.INFO,
        )
