"""Activation rules (framework-free): ``dead_units`` and ``activation_saturation``.

Fed by :class:`~lightning_diag.GradientFlowMonitor` on its measured steps with what the activation modules of the
model saw in the step's forward (:mod:`lightning_diag.instrument.activation_watch`). They are gradient-flow
problems: a dead unit passes no gradient, a saturated bounded activation passes almost none; the repair differs
from that of vanishing gradients (initialisation, learning rate or input scaling rather than depth), so each has its
own rule id and ``grad_vanish`` defers to ``dead_units``. Exact meaning:

* ``dead_units`` (warning): in a layer followed by a ReLU-family activation (``nn.ReLU``, ``nn.ReLU6``), more
  than ``threshold`` of the units (output features; channels after a convolution) are inactive (activation input
  ``<= 0``, output exactly 0) for **every** sample of the measured batch, on ``grad.patience`` consecutive
  measurements, while the training loss does not fall (its median over the latest ``grad.patience`` measurements
  less than ``loss_fall`` below that of the first ``grad.patience``; judged from the ``2 x grad.patience``-th
  measurement), or, whatever the loss, with more than ``certain`` of the units dead. A healthy net's batch of
  correlated rows (windows of one series) can leave 75% of a layer's units idle while it learns. A layer that a
  frozen part feeds (a frozen layer ran before it in the forward: a head on a frozen encoder, progressive
  unfreezing) is judged on ``certain`` alone: its inputs are fixed features that may barely vary across the batch
  (a frozen randomly initialised encoder maps a batch to nearly one row, so about half of the head's units are
  inactive for every sample from the first step), and a mostly frozen model's loss falls slowly by construction.
  Units of the frozen layers themselves are not counted (below). One alert
  names every layer tripping at once (count and the worst few), how the worst layer's
  share moved since its first measurement, and the share of exactly-zero gradient entries of those layers'
  weights. A batch with fewer than
  :data:`~lightning_diag.instrument.activation_watch.MIN_ROWS` rows per unit (batch size 1) is not judged: a unit
  inactive for one sample is not dead.
* ``activation_saturation`` (warning): more than ``threshold`` of the inputs of a bounded activation beyond its
  linear range (:data:`~lightning_diag.instrument.activation_watch.LINEAR_RANGES`: ``|x| > 5`` for tanh,
  ``|x| > 10`` for sigmoid, outside ``[min_val, max_val]`` for hardtanh, ``|x| >= 3`` for hardsigmoid), on
  ``grad.patience`` consecutive measurements. An activation that nothing trainable follows (a sigmoid output
  head, confident near convergence) is not judged. The message names the likely cause: the first layer
  saturated while the inputs' RMS is at least :data:`UNSCALED_INPUT_RMS` (unscaled inputs), the first layer
  saturated on standardized inputs (its initialisation is too large), or deeper layers only (weights too large:
  initialisation or a learning rate that grew them).

Layers of a frozen part (no trainable parameter) are not judged: their units do not train, so they cannot die
in training (a frozen layer whose outputs are all zero is the model's design, or a fault of the weights loaded).

Margin (:attr:`Rule.peaks`, for the calibration harness): per layer, the smallest share over the latest
``grad.patience`` measurements as a fraction of ``threshold``, and for ``dead_units`` at most the share as a fraction
of ``certain`` where the loss does not confirm; above 1 exactly where the layer's condition held.

Each layer is latched until it clears; layers that trip while others of the same rule are in alarm join that event
without a new alert.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

from lightning_diag.core.record import Alert
from lightning_diag.core.registry import FRACTION, RULES, CheckSpec, RuleSpec, default, register
from lightning_diag.core.tags import dead_units_tag, saturation_tag, zero_grad_tag
from lightning_diag.rules.base import Latch, Rule, StepContext, excess, name_layers
from lightning_diag.rules.grad_frozen import GRAD_PATIENCE_SETTING, GRADIENT_FLOW
from lightning_diag.rules.loss_windows import LossWindows
from lightning_diag.rules.measures import Measure, Measures
from lightning_diag.rules.records import ActivationReading
from lightning_diag.rules.rows import (
    Check,
    LayerPoints,
    LoggedRun,
    finite_family,
    last_point,
    measure,
    run_setting,
    worst_point,
)

__all__ = [
    "ACTIVATIONS_IN_RANGE_CHECK",
    "ACTIVATION_SATURATION",
    "ACTIVATION_SATURATION_SPEC",
    "DEAD_UNITS",
    "DEAD_UNITS_SPEC",
    "DEFAULT_DEAD_UNITS_CERTAIN",
    "DEFAULT_DEAD_UNITS_LOSS_FALL",
    "DEFAULT_DEAD_UNITS_THRESHOLD",
    "DEFAULT_SATURATION_THRESHOLD",
    "UNITS_ALIVE_CHECK",
    "UNSCALED_INPUT_RMS",
    "ActivationRule",
]

# -- declarations (one per rule id; the docs' thresholds table and the report read them) -----------------------
DEAD_UNITS_SPEC = register(RuleSpec(
    "dead_units", GRADIENT_FLOW, "warning", 0.5,
    "a layer followed by a ReLU-family activation with more than {threshold:.0%} of its units inactive for every "
    "sample of the measured batch on {patience:g} consecutive measurements, while the loss has fallen less than "
    "{loss_fall:.0%} below its initial value (more than {certain:.0%}: whatever the loss)",
    settings={"certain": 0.95, "loss_fall": 0.1}, source="AUTOTRAINER (ICSE'21), DeepDiagnosis", check="units_alive",
    limits={"threshold": FRACTION, "certain": FRACTION, "loss_fall": FRACTION},
))
ACTIVATION_SATURATION_SPEC = register(RuleSpec(
    "activation_saturation", GRADIENT_FLOW, "warning", 0.5,
    "more than {threshold:.0%} of a bounded activation's inputs beyond its linear range (|x| > 5 for tanh, > 10 "
    "for sigmoid), on {patience:g} consecutive measurements",
    source="DeepDiagnosis, UMLAUT (CHI'21)", limits={"threshold": FRACTION}, check="activations_in_range",
))
DEAD_UNITS = DEAD_UNITS_SPEC.rule_id
ACTIVATION_SATURATION = ACTIVATION_SATURATION_SPEC.rule_id
#: The rules' rows of the ``lightning-diag report`` checklist (registered in report order by
#: :mod:`lightning_diag.rules.catalog`).
UNITS_ALIVE_CHECK = CheckSpec("units_alive", "Model", "Units alive: no ReLU layer with more than {dead_units:.0%} dead")
ACTIVATIONS_IN_RANGE_CHECK = CheckSpec(
    "activations_in_range", "Model",
    "Bounded activations in their linear range: no more than {activation_saturation:.0%} of a layer's inputs saturated",
)

#: ``dead_units``: share of a layer's units inactive for every sample above this ("most units").
DEFAULT_DEAD_UNITS_THRESHOLD = default(DEAD_UNITS)
#: ``dead_units``: a share above this is dead whatever the loss does ("nearly all units").
DEFAULT_DEAD_UNITS_CERTAIN = default(DEAD_UNITS_SPEC.key("certain"))
#: ``dead_units``: below ``certain``, the loss must have fallen less than this fraction below its initial value.
DEFAULT_DEAD_UNITS_LOSS_FALL = default(DEAD_UNITS_SPEC.key("loss_fall"))
#: ``activation_saturation``: share of a bounded activation's inputs beyond its linear range above this.
DEFAULT_SATURATION_THRESHOLD = default(ACTIVATION_SATURATION)
#: ``activation_saturation``'s cause: an RMS of the model's inputs at least this is "unscaled inputs" (standardized
#: inputs have an RMS of 1; pixel values in 0..255 about 120).
UNSCALED_INPUT_RMS = 5.0
_PATIENCE = int(GRAD_PATIENCE_SETTING.default)


class ActivationRule(Rule):
    """``dead_units`` and ``activation_saturation`` over the activation readings of one measured step.

    Example:
        >>> rule = ActivationRule(patience=2)
        >>> dead = [ActivationReading("net.0", "ReLU", dead=1.0, zero_grad=1.0)]
        >>> [a.rule for i in range(3) for a in rule.judge(StepContext(0, i), Measures(activations=dead))]
        ['dead_units']
        >>> hot = [ActivationReading("net.0", "Tanh", saturated=0.91, limit=5.0, first=True)]
        >>> rule = ActivationRule(patience=1)
        >>> "unscaled inputs" in rule.judge(StepContext(0, 5), Measures(activations=hot, input_rms=57.0))[0].message
        True
    """

    specs = (DEAD_UNITS_SPEC, ACTIVATION_SATURATION_SPEC)
    setting_keys: ClassVar[Mapping[str, str]] = {
        "dead_threshold": DEAD_UNITS, "saturation_threshold": ACTIVATION_SATURATION,
        "patience": GRAD_PATIENCE_SETTING.key,
    }
    needs = frozenset({Measure.ACTIVATIONS})
    optional = frozenset({Measure.INPUT_RMS, Measure.LOSS})
    state_keys = ("streaks", "first_seen")

    def __init__(
        self,
        dead_threshold: float = DEFAULT_DEAD_UNITS_THRESHOLD,
        saturation_threshold: float = DEFAULT_SATURATION_THRESHOLD,
        patience: int = _PATIENCE,
        certain: float = DEFAULT_DEAD_UNITS_CERTAIN,
        loss_fall: float = DEFAULT_DEAD_UNITS_LOSS_FALL,
    ) -> None:
        super().__init__()
        self.dead_threshold = dead_threshold
        self.saturation_threshold = saturation_threshold
        self.patience = patience
        self.certain = certain
        self.loss_fall = loss_fall
        #: The first and latest ``patience`` training losses (``dead_units`` below ``certain`` needs them flat).
        self.losses = LossWindows(patience)
        self.latch = Latch.for_patience(patience)
        self.streaks: dict[str, int] = {}
        #: ``{"<rule>:<layer>": [share, step]}``: each layer's share at its first measurement (the message says
        #: how it moved).
        self.first_seen: dict[str, list[float]] = {}

    def state_dict(self) -> dict[str, Any]:
        """The declared state, the latch and the loss windows."""
        return {**super().state_dict(), "losses": self.losses.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output.

        Raises:
            KeyError: If a key is missing; the message names every missing key.
        """
        missing = [k for k in (*self.state_keys, "latch", "losses") if k not in state]
        if missing:
            raise KeyError(f"{type(self).__name__}.load_state_dict: missing state keys {missing}")
        super().load_state_dict(state)
        self.losses.load_state_dict(state["losses"])

    def dead_layers(self) -> set[str]:
        """The layers ``dead_units`` holds in alarm (``grad_vanish`` defers to it while any is)."""
        prefix = f"{DEAD_UNITS}:"
        return {k[len(prefix) :] for k in self.latch.active if k.startswith(prefix)}

    def judge(self, ctx: StepContext, m: Measures) -> list[Alert]:
        """Judge the readings of one measured forward (``input_rms``: RMS of the model's inputs, as the first
        trainable layer saw them; ``loss``: the step's training loss); return the alerts raised."""
        readings, input_rms, loss = m.activations or (), m.input_rms, m.loss
        self.losses.add(loss)
        # below `certain`, most units inactive for a batch matter only while the loss does not fall (a healthy
        # net's batch of correlated rows, windows of one series, leaves many units idle while it learns), and
        # never in a layer fed by a frozen part: its inputs are fixed features that may barely vary across the
        # batch (a frozen encoder maps a batch to nearly one row), and the loss of a mostly frozen model falls slowly
        stuck = self.losses.not_learning(self.loss_fall)
        frozen_fed = {r.layer for r in readings if r.dead is not None and r.after_frozen}

        def confirmed(layer: str, share: float) -> bool:
            return (stuck and layer not in frozen_fed) or share > self.certain

        dead = self._shares(readings, "dead", DEAD_UNITS, self.dead_threshold, ctx, confirmed, self.certain)
        saturated = self._shares(readings, "saturated", ACTIVATION_SATURATION, self.saturation_threshold, ctx)
        alerts = []
        new = self._trip(DEAD_UNITS, dead, confirmed)
        if new:
            alerts.append(self._dead_alert(ctx, new, readings))
        new = self._trip(ACTIVATION_SATURATION, saturated)
        if new:
            alerts.append(self._saturation_alert(ctx, new, readings, input_rms))
        return alerts

    def _shares(
        self,
        readings: Sequence[ActivationReading],
        field: str,
        rule: str,
        threshold: float,
        ctx: StepContext,
        confirmed: Callable[[str, float], bool] | None = None,
        certain: float = math.inf,
    ) -> dict[str, tuple[float, bool]]:
        """``{layer: (share, over the threshold)}`` of the readings that measure ``field`` (the largest share of a
        layer read twice); notes each layer's first share and the rule's peak: the smallest share over the latest
        ``patience`` measurements against ``threshold``, at most the share against ``certain`` where the loss
        does not confirm (``confirmed``), the statistic that decides the alert."""
        shares: dict[str, float] = {}
        for r in readings:
            value = getattr(r, field)
            if value is not None:
                shares[r.layer] = max(value, shares.get(r.layer, 0.0))
        for layer, share in shares.items():
            cap = math.inf if confirmed is None or confirmed(layer, 0.0) else excess(share, certain)
            self.observe_held(f"{rule}:{layer}", excess(share, threshold), self.patience, cap, rule=rule)
            self.first_seen.setdefault(f"{rule}:{layer}", [share, float(ctx.global_step)])
        return {k: (v, v > threshold) for k, v in shares.items()}

    def _trip(
        self,
        rule: str,
        shares: Mapping[str, tuple[float, bool]],
        confirmed: Callable[[str, float], bool] = lambda layer, share: True,
    ) -> dict[str, float]:
        """Advance the streaks of ``rule``; return the layers whose alarm has just begun (a layer tripping while
        others are in alarm joins their event), with their shares. A layer over its threshold on ``patience``
        consecutive measurements alerts when ``confirmed(share)``."""
        ongoing = {k for k in self.latch.active if k.startswith(f"{rule}:")}
        new = {}
        for layer, (share, bad) in sorted(shares.items()):
            key = f"{rule}:{layer}"
            if bad:
                self.streaks[key] = self.streaks.get(key, 0) + 1
            else:
                self.streaks.pop(key, None)
            held = self.streaks.get(key, 0) >= self.patience and (self.latch.is_active(key) or confirmed(layer, share))
            if self.latch.update(key, held) and not ongoing:
                new[layer] = share
        return new

    def _moved(self, rule: str, layer: str, share: float, ctx: StepContext) -> str:
        first, step = self.first_seen.get(f"{rule}:{layer}", [share, float(ctx.global_step)])
        if int(step) == ctx.global_step:
            return f"`{layer}` at {share:.0%}"
        if f"{first:.0%}" == f"{share:.0%}":
            return f"`{layer}` at {share:.0%} since step {int(step)}"
        return f"`{layer}` from {first:.0%} at step {int(step)} to {share:.0%} at step {ctx.global_step}"

    def _dead_alert(
        self, ctx: StepContext, new: dict[str, float], readings: Sequence[ActivationReading]
    ) -> Alert:
        worst = max(new, key=new.__getitem__)
        zero = [r.zero_grad for r in readings if r.layer in new and r.zero_grad is not None]
        grads = (
            f"; {sum(zero) / len(zero):.0%} of their weights' gradient entries are exactly zero" if zero else ""
        )
        initial, latest = self.losses.initial, self.losses.latest
        if initial is not None and latest is not None and self.losses.not_learning(self.loss_fall):
            grads += f"; the loss is not falling ({latest:.4g}, initial {initial:.4g})"
        return self._alert(
            ctx,
            f"dead units: more than {self.dead_threshold:.0%} of the units are inactive for every sample of the "
            f"batch (ReLU output 0) in {name_layers(new)} (share of dead units, on {self.patience} consecutive "
            f"measurements; {self._moved(DEAD_UNITS, worst, new[worst], ctx)}){grads}: dead units pass no "
            "gradient, this is not a vanishing gradient; lower the learning rate, check the initialisation (He "
            "init, no large negative biases), or use LeakyReLU/GELU or normalisation before the activation",
            source=worst,
            value=new[worst],
            threshold=self.dead_threshold,
            rule=DEAD_UNITS,
        )

    def _saturation_alert(
        self,
        ctx: StepContext,
        new: dict[str, float],
        readings: Sequence[ActivationReading],
        input_rms: float | None,
    ) -> Alert:
        worst = max(new, key=new.__getitem__)
        by_layer = {r.layer: r for r in readings if r.layer in new}
        first = any(r.first for r in by_layer.values())
        if first and input_rms is not None and input_rms >= UNSCALED_INPUT_RMS:
            cause = (
                f"unscaled inputs: the first layer saturates and the model's inputs have an RMS of {input_rms:.3g}; "
                "standardize them (zero mean, unit variance)"
            )
        elif first:
            cause = "the first layer's weights are too large for its inputs: check its initialisation"
        else:
            cause = (
                "weights too large: an initialisation with too large a scale, or a learning rate that grew them; "
                "use Xavier/Glorot initialisation or normalisation before the activation"
            )
        kinds = sorted({f"{r.activation} beyond ±{r.limit:g}" for r in by_layer.values() if r.limit is not None})
        return self._alert(
            ctx,
            f"saturated activations: more than {self.saturation_threshold:.0%} of the inputs of a bounded "
            f"activation are beyond its linear range ({', '.join(kinds)}) in {name_layers(new)} (share beyond, on "
            f"{self.patience} consecutive measurements; {self._moved(ACTIVATION_SATURATION, worst, new[worst], ctx)}"
            f"): their gradient is ~0. Likely cause: {cause}",
            source=worst,
            value=new[worst],
            threshold=self.saturation_threshold,
            rule=ACTIVATION_SATURATION,
        )


# -- the report's units_alive and activations_in_range rows ----------------------------------------------------
# GradientFlowMonitor's ``diag/act_dead/<layer>``, ``diag/grad_zero/<layer>`` and ``diag/act_saturated/<layer>``.
# The rows pass or fail on the rules' alerts: the rules also judge what the series do not hold (the loss's fall since
# the fit began, the activation each layer feeds), so nothing is replayed.


def _share_row(check: Check, series: LayerPoints, what: str) -> None:
    layer, step, peak = worst_point(series)
    last_layer, last = last_point(series)
    measurements = max(len(p) for p in series.values())
    check.measured = (
        f"largest share of {what}: {peak:.1%} (`{layer}`, step {step}); {last:.1%} (`{last_layer}`) at the last "
        f"measurement, over {len(series)} layers and {measurements} measurements"
    )
    check.measured_value = {"max": peak, "last": last, "layers": float(len(series))}


@measure("units_alive")
def _measure_dead_units(run: LoggedRun, check: Check) -> bool:
    check.threshold = RULES[DEAD_UNITS].describe(run.thresholds)
    check.threshold_value = {"value": run_setting(run, DEAD_UNITS)}
    dead = finite_family(run, dead_units_tag)
    if not dead:
        return False
    _share_row(check, dead, "units inactive for every sample of the measured batch")
    zero = finite_family(run, zero_grad_tag)
    if zero:
        layer, _, peak = worst_point(zero)
        check.measured = f"{check.measured}; exactly-zero gradient entries up to {peak:.1%} (`{layer}`)"
        check.measured_value["zero_grad_max"] = peak
    return True


@measure("activations_in_range")
def _measure_saturation(run: LoggedRun, check: Check) -> bool:
    check.threshold = RULES[ACTIVATION_SATURATION].describe(run.thresholds)
    check.threshold_value = {"value": run_setting(run, ACTIVATION_SATURATION)}
    saturated = finite_family(run, saturation_tag)
    if not saturated:
        return False
    _share_row(check, saturated, "a bounded activation's inputs beyond its linear range")
    return True
