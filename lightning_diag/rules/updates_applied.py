"""Update rules (framework-free): ``update_none``, ``update_stale`` (one class, one report row,
``updates_applied``).

Fed by :class:`~lightning_diag.GradientFlowMonitor` on its measured steps with what a small fixed sample of each
parameter's elements did across the optimizer step (:mod:`lightning_diag.stats.updates`). Exact meaning:

* ``update_none`` (warning): every sampled element of a layer that has a finite, non-zero gradient is left
  unchanged by the optimizer step, on ``patience`` consecutive measurements. The likely cause is named: no
  trainable parameter of the model is in any optimizer (it was built over a copy, or the parameters were
  replaced after ``configure_optimizers``), the parameter group's learning rate is 0, or the optimizer (a
  wrapper around it) drops the update. A parameter frozen (``requires_grad=False``) or left out of the optimizer
  while the rest trains is ``grad_frozen``'s business, not this rule's.
* ``update_stale`` (warning): in a bf16/fp16 parameter, more than ``stale_fraction`` of the sampled elements with
  a non-zero gradient are left unchanged (their updates round to zero in the low-precision weights), on
  ``patience`` consecutive measurements, while the training loss does not fall (its median over the latest
  ``patience`` measurements less than ``loss_fall`` below that of the first ``patience``, judged from the
  ``2 x patience``-th measurement with a loss), or, whatever the loss, with more than ``certain`` of them
  unchanged (nearly every update lost: a learning rate below what the weights' precision can represent).
  Between the two, a converging pure-bf16 run is healthy: Adam's step ``lr * m / sqrt(v)`` shrinks for elements
  whose gradient has become mostly noise, and below half an ulp of the weight (``|w| * 2**-8`` in bf16) it rounds
  away. Measured on the fault library's ``healthy_bf16`` (an MLP, AdamW at 3e-3, ``precision="bf16-true"``, 64
  steps an epoch): 50% to 64% of a layer's sampled elements unchanged from step 60 on, while its loss falls 0.20 ->
  0.12 and stays within 0.5% of the same run with fp32 master weights (``bf16-mixed``) at every 16-step window;
  60% to 93% of its elements would move at Adam's full step (``lr >= |w| * 2**-8``), against 0% to 1% under
  ``bf16_tiny_lr`` (1e-6), whose every sampled element stays unchanged from the first measurement.

Layers tripping one rule at one measurement make one alert naming them; each layer is latched until it clears.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping
from typing import Any, ClassVar

from lightning_diag.core.record import Alert
from lightning_diag.core.registry import COUNT, FRACTION, RULES, STEPS, CheckSpec, Limit, RuleSpec, default, register
from lightning_diag.core.tags import updates_layer
from lightning_diag.rules.base import Rule, StepContext, excess, list_names, name_layers
from lightning_diag.rules.grad_frozen import GRADIENT_FLOW
from lightning_diag.rules.loss_windows import LossWindows
from lightning_diag.rules.measures import Measure, Measures
from lightning_diag.rules.records import LayerUpdate
from lightning_diag.rules.rows import Check, LoggedRun, finite_values, measure, run_setting

__all__ = [
    "DEFAULT_STALE_CERTAIN",
    "DEFAULT_STALE_FRACTION",
    "DEFAULT_STALE_LOSS_FALL",
    "DEFAULT_UPDATE_PATIENCE",
    "DEFAULT_UPDATE_SAMPLE_SIZE",
    "UPDATES_APPLIED_CHECK",
    "UPDATE_CAUSES",
    "UPDATE_NONE",
    "UPDATE_NONE_SPEC",
    "UPDATE_SAMPLE_SIZE_KEY",
    "UPDATE_STALE",
    "UPDATE_STALE_SPEC",
    "UpdateRule",
]

# -- declarations (one per rule id; the docs' thresholds table and the report read them) -----------------------
UPDATE_NONE_SPEC = register(RuleSpec(
    "update_none", GRADIENT_FLOW, "warning", None,
    "a parameter with non-zero gradients that {patience:g} consecutive measured optimizer steps leave "
    "unchanged (every one of its {sample_size:g} sampled elements)",
    settings={"patience": 3, "sample_size": 32}, check="updates_applied",
    limits={"patience": COUNT, "sample_size": STEPS},
))
UPDATE_STALE_SPEC = register(RuleSpec(
    "update_stale", GRADIENT_FLOW, "warning", 0.5,
    "a bf16/fp16 parameter whose measured optimizer steps leave more than {threshold:.0%} of the "
    "sampled elements with a non-zero gradient unchanged (updates round to zero), on {patience:g} "
    "consecutive measurements, while the loss has fallen less than {loss_fall:.0%} below its initial value "
    "(more than {certain:.0%}: whatever the loss)",
    settings={"patience": 3, "certain": 0.95, "loss_fall": 0.1}, check="updates_applied",
    limits={
        "threshold": Limit(low=0.0, high=1.0, low_inclusive=True, high_inclusive=False), "patience": COUNT,
        "certain": FRACTION, "loss_fall": FRACTION,
    },
))
UPDATE_NONE = UPDATE_NONE_SPEC.rule_id
UPDATE_STALE = UPDATE_STALE_SPEC.rule_id
#: The ``lightning-diag report`` checklist row of both rules (registered in report order by
#: :mod:`lightning_diag.rules.catalog`).
UPDATES_APPLIED_CHECK = CheckSpec("updates_applied", "Training",
                                  "Optimizer steps change every trained parameter (no sampled layer left unchanged; "
                                  "at most {update_stale:.0%} of a low-precision layer's sampled elements unchanged)")
#: ``thresholds()`` key of the elements sampled per layer (read by GradientFlowMonitor).
UPDATE_SAMPLE_SIZE_KEY = UPDATE_NONE_SPEC.key("sample_size")

#: ``update_stale``: share of sampled elements (with a non-zero gradient) left unchanged above this.
DEFAULT_STALE_FRACTION = default(UPDATE_STALE)
#: ``update_stale``: a share above this is stale whatever the loss does ("nearly every update lost").
DEFAULT_STALE_CERTAIN = default(UPDATE_STALE_SPEC.key("certain"))
#: ``update_stale``: below ``certain``, the loss must have fallen less than this fraction below its initial value.
DEFAULT_STALE_LOSS_FALL = default(UPDATE_STALE_SPEC.key("loss_fall"))
#: ``update_none`` / ``update_stale``: consecutive measurements (GradientFlowMonitor's ``patience``).
DEFAULT_UPDATE_PATIENCE = int(default(UPDATE_NONE_SPEC.key("patience")))
#: Elements sampled per parameter (evenly spaced over the flattened tensor).
DEFAULT_UPDATE_SAMPLE_SIZE = int(default(UPDATE_SAMPLE_SIZE_KEY))

#: ``update_none``: why an update may be missing, and what to do about it.
UPDATE_CAUSES: dict[str, str] = {
    "no_optimizer": (
        "none of the model's trainable parameters is in any optimizer: the optimizer was built over other tensors "
        "(a copy of the model, or parameters replaced after `configure_optimizers`); build it over "
        "`self.parameters()` of the module that trains"
    ),
    "lr_zero": "the learning rate of its parameter group is 0 (a schedule that ends at 0, or a warm-up that never "
    "starts)",
    "dropped": (
        "the optimizer step leaves it unchanged: a wrapper that drops the update, a learning rate that rounds to "
        "zero, or parameters the optimizer updates out of place"
    ),
}


class UpdateRule(Rule):
    """``update_none`` and ``update_stale`` over the layers of one measured step (streaks and latch per layer).

    Example:
        >>> rule = UpdateRule(patience=2)
        >>> stuck = {"fc": LayerUpdate(32, 32)}
        >>> [a.rule for i in range(3) for a in rule.judge(StepContext(0, i), Measures(layer_updates=stuck))]
        ['update_none']
        >>> bf16 = {"fc": LayerUpdate(32, 31, low_precision=True)}
        >>> stale = UpdateRule(patience=2)
        >>> [a.rule for i in range(2) for a in stale.judge(StepContext(0, i), Measures(layer_updates=bf16))]
        ['update_stale']
        >>> half = {"fc": LayerUpdate(32, 20, low_precision=True)}  # 62% unchanged while the loss falls: converging
        >>> converging = UpdateRule(patience=2)
        >>> ms = [Measures(layer_updates=half, loss=1.0 - 0.1 * i) for i in range(6)]
        >>> [a.rule for i, m in enumerate(ms) for a in converging.judge(StepContext(0, i), m)]
        []
    """

    specs = (UPDATE_NONE_SPEC, UPDATE_STALE_SPEC)
    setting_keys: ClassVar[Mapping[str, str]] = {"stale_fraction": UPDATE_STALE}
    state_keys = ("streaks",)
    needs = frozenset({Measure.LAYER_UPDATES})
    optional = frozenset({Measure.LOSS})

    def __init__(
        self,
        stale_fraction: float = DEFAULT_STALE_FRACTION,
        patience: int = DEFAULT_UPDATE_PATIENCE,
        certain: float = DEFAULT_STALE_CERTAIN,
        loss_fall: float = DEFAULT_STALE_LOSS_FALL,
    ) -> None:
        super().__init__()
        self.stale_fraction = stale_fraction
        self.patience = patience
        self.certain = certain
        self.loss_fall = loss_fall
        self.streaks: dict[str, int] = {}
        #: The first and latest ``patience`` training losses (``update_stale`` below ``certain`` needs them flat).
        self.losses = LossWindows(patience)

    def state_dict(self) -> dict[str, Any]:
        """The declared state, the latch and the loss windows."""
        return {**super().state_dict(), "losses": self.losses.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output."""
        super().load_state_dict(state)
        self.losses.load_state_dict(state["losses"])

    def judge(self, ctx: StepContext, m: Measures) -> list[Alert]:
        """Judge one measured step (``{layer: LayerUpdate}``) and its training loss (``None``: unknown); return the
        alerts raised."""
        layers, loss = m.layer_updates or {}, m.loss
        self.losses.add(loss)
        measured = {k: v for k, v in layers.items() if v.counted > 0}
        none = {
            k: v for k, v in measured.items() if v.unchanged == v.counted and (not v.low_precision or v.cause)
        }
        stuck = self.losses.not_learning(self.loss_fall)
        for k, v in measured.items():
            if v.low_precision and not v.cause:  # the margin: the statistic that decides, loss gate included
                cap = math.inf if stuck else excess(v.share, self.certain)
                self.observe_held(k, excess(v.share, self.stale_fraction), self.patience, cap, rule=UPDATE_STALE)
        stale = {
            k: v
            for k, v in measured.items()
            if v.low_precision and not v.cause and k not in none and v.share > self.stale_fraction
        }
        alerts = []
        new = self._trip(UPDATE_NONE, none, set(measured))
        if new:
            causes = [none[k].cause or "dropped" for k in new]
            cause = max(set(causes), key=causes.count)
            worst = sorted(new)[0]
            alerts.append(
                self._alert(
                    ctx,
                    f"optimizer steps leave {list_names(new)} unchanged although their gradients "
                    f"are non-zero (every sampled element, on {self.patience} consecutive measured steps): "
                    f"{UPDATE_CAUSES[cause]}",
                    source=worst,
                    value=1.0,
                    threshold=None,
                    rule=UPDATE_NONE,
                )
            )
        # below `certain`, a converging pure-bf16 run loses the small steps of its noise-dominated elements: stale
        # only while the loss does not fall (a layer already in alarm holds)
        new = self._trip(UPDATE_STALE, stale, set(measured),
                         lambda k: stuck or stale[k].share > self.certain)  # fmt: skip
        if new:
            shares = {k: stale[k].share for k in new}
            worst = max(shares, key=shares.__getitem__)
            initial, latest = self.losses.initial, self.losses.latest
            flat = (
                f", while the loss is not falling ({latest:.4g}, initial {initial:.4g})"
                if stuck and initial is not None and latest is not None
                else ""
            )
            alerts.append(
                self._alert(
                    ctx,
                    f"in bf16/fp16 weights most updates round to zero: the optimizer step left this share of the "
                    f"sampled elements with a non-zero gradient unchanged in {name_layers(shares)} (above "
                    f"{self.stale_fraction:.0%}, on {self.patience} consecutive measured steps{flat}); keep fp32 "
                    "master weights (`precision=\"bf16-mixed\"`), raise the learning rate, or use an optimizer with "
                    "Kahan summation or stochastic rounding",
                    source=worst,
                    value=shares[worst],
                    threshold=self.stale_fraction,
                    rule=UPDATE_STALE,
                )
            )
        return alerts

    def _trip(
        self,
        rule: str,
        bad: Mapping[str, LayerUpdate],
        seen: Collection[str],
        confirmed: Callable[[str], bool] = lambda layer: True,
    ) -> list[str]:
        new = []
        for layer in sorted(set(seen) | set(bad)):
            key = f"{rule}:{layer}"
            if layer in bad:
                self.streaks[key] = self.streaks.get(key, 0) + 1
            else:
                self.streaks.pop(key, None)
            held = self.streaks.get(key, 0) >= self.patience and (self.latch.is_active(key) or confirmed(layer))
            if self.latch.update(key, held):
                new.append(layer)
        return new


# -- the report's updates_applied row --------------------------------------------------------------------------
# GradientFlowMonitor's ``diag/updates/<layer>``. The row passes or fails on the rules' alerts, which need what the
# series do not hold (parameter dtypes, optimizer membership), so nothing is replayed.


@measure("updates_applied")
def _measure_updates(run: LoggedRun, check: Check) -> bool:
    check.threshold = RULES[UPDATE_STALE].describe(run.thresholds)
    check.threshold_value = {"stale_fraction": run_setting(run, UPDATE_STALE)}
    worst: dict[str, float] = {}
    measurements = 0
    for name, points in run.scalars.items():
        layer = updates_layer(name)
        values = finite_values(points) if layer is not None else []
        if values:
            worst[layer] = max(values)  # type: ignore[index]
            measurements = max(measurements, len(values))
    if not worst:
        return False
    top = max(worst, key=worst.__getitem__)
    check.measured = (
        f"largest share of sampled elements left unchanged by a step: {worst[top]:.1%} (`{top}`), over "
        f"{len(worst)} layers and {measurements} measured steps"
    )
    check.measured_value = {"max": worst[top], "layers": float(len(worst))}
    return True
