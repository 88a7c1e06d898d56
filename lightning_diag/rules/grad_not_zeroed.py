"""``grad_not_zeroed`` (framework-free).

Fed by :class:`~lightning_diag.GradientFlowMonitor`. Exact meaning:

* ``grad_not_zeroed`` (warning): a parameter's ``.grad`` still held a non-zero gradient left from before its own
  optimizer's last ``step()`` at a backward, that backward added to it, and the optimizer's next ``step()``
  applied the sum (nothing set it to ``None`` or zero in between): manual optimization without ``zero_grad``, or
  an ``optimizer_zero_grad`` overridden with a no-op, so every step applies the sum of all earlier gradients.
  Watched from each measured step of an optimizer to that optimizer's next step. Deliberate accumulation (several
  backward passes, then the step, then ``zero_grad``), ``accumulate_grad_batches``, and GAN-style optimizers
  whose parameters keep the last step's gradients during the other optimizer's backward (``toggle_optimizer``,
  parameters outside its graph, or ``zero_grad`` right before each optimizer's own backward) never trip it.

The layers tripping it at one check make one alert naming them.
"""

from __future__ import annotations

from lightning_diag.core.record import Alert
from lightning_diag.core.registry import RuleSpec, register
from lightning_diag.rules.base import Rule, StepContext, list_names
from lightning_diag.rules.grad_frozen import GRADIENT_FLOW
from lightning_diag.rules.measures import Measure, Measures

__all__ = [
    "GRAD_NOT_ZEROED",
    "GRAD_NOT_ZEROED_SPEC",
    "GradNotZeroedRule",
]

# -- declaration (the docs' thresholds table and the report read it) ---------------------------------------------
GRAD_NOT_ZEROED_SPEC = register(RuleSpec(
    "grad_not_zeroed", GRADIENT_FLOW, "warning", None,
    "a backward adds to gradients left in `.grad` from before their optimizer's last step, and that "
    "optimizer's next step applies the sum (no `zero_grad` between the steps)",
))
GRAD_NOT_ZEROED = GRAD_NOT_ZEROED_SPEC.rule_id


class GradNotZeroedRule(Rule):
    """``grad_not_zeroed``: the layers whose left-over gradients a backward added to and the next step applied.

    Latched as one source (``optimizer``): it alerts once, and again only after a check found the gradients zeroed.

    Example:
        >>> from lightning_diag.rules.measures import StaleGrads
        >>> rule = GradNotZeroedRule()
        >>> m = Measures(stale_grads=StaleGrads(["fc"], optimizers=["optimizer 0 (SGD)"]))
        >>> [a.rule for a in rule.judge(StepContext(0, 6), m)]
        ['grad_not_zeroed']
        >>> rule.judge(StepContext(0, 11), Measures(stale_grads=StaleGrads(["fc"])))
        []
    """

    specs = (GRAD_NOT_ZEROED_SPEC,)
    state_keys = ("checks",)
    needs = frozenset({Measure.STALE_GRADS})

    def __init__(self) -> None:
        super().__init__()
        self.checks = 0

    def judge(self, ctx: StepContext, m: Measures) -> list[Alert]:
        """Judge one check (the layers whose gradients were not zeroed, empty: all were; ``optimizers``: the names
        of the optimizers holding them); return the alerts.

        ``StaleGrads(decided=False)`` stands for "nothing measured": the watches closed without a verdict (after
        a resume, a watch whose parameters lost their left-over gradients in the reload: whether the user's code
        would have zeroed them cannot be told). It is counted in :attr:`checks`, as in the uninterrupted run, and
        raises nothing; the latch is left as it is (an alert in force stays in force, none is released)."""
        assert m.stale_grads is not None  # checked against `needs`
        stale_layers, optimizers = m.stale_grads.layers, m.stale_grads.optimizers
        self.checks += 1
        if not m.stale_grads.decided:
            return []
        layers = sorted(stale_layers)
        if not self.latch.update("optimizer", bool(layers)):
            return []
        owner = f" (parameters of {', '.join(optimizers)})" if optimizers else ""
        return [
            self._alert(
                ctx,
                f"a backward added to the gradients left in `.grad` from before the last optimizer step in "
                f"{list_names(layers)}{owner}, and the next step applied the sum: nothing zeroed them, so every "
                "step applies the sum of all earlier gradients; call `optimizer.zero_grad()` after "
                "`optimizer.step()` (manual optimization), or do not override `optimizer_zero_grad` with a no-op",
                source=layers[0],
                value=float(len(layers)),
                threshold=None,
            )
        ]
