"""Replaying the library's pure rules over a run's logged series (``lightning-diag report``).

Each function re-runs the rules of one checklist row (``lightning_diag.rules``, the same code the callbacks
run) over the ``diag/`` series the run logged, with the run's thresholds and patience (the registry's defaults
where the run logged none), and returns the alerts they raise. :mod:`lightning_diag.report.checks` fails a row
on them as on the run's own alerts. Imports neither torch nor Lightning.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable
from typing import Literal

from lightning_diag.core.alerts import Alert, Severity
from lightning_diag.core.registry import default
from lightning_diag.core.tags import (
    attn_head,
    attn_uniform_tag,
    grad_blocks_tag,
    grad_layer,
    loss_tag,
    prefix,
)
from lightning_diag.report.load import RunData, Series
from lightning_diag.rules.attention_entropy import AttentionEntropyRule
from lightning_diag.rules.attention_specs import LayerStats
from lightning_diag.rules.base import StepContext
from lightning_diag.rules.catalog import (
    ATTN_ENTROPY_LOW,
    GRAD_COLLAPSE,
    LOSS_SWING,
    VAL_DECLINE,
)
from lightning_diag.rules.grad_collapse import GradCollapseRule
from lightning_diag.rules.grad_layer_spread import GradSpreadRule
from lightning_diag.rules.grad_norm_band import GradBandRule
from lightning_diag.rules.layer_roles import role_of
from lightning_diag.rules.loss_stagnant import STAGNANT_BASELINE_STEPS_KEY
from lightning_diag.rules.loss_swing import LossSwingRule
from lightning_diag.rules.measures import LossWindow, Measures, Validation
from lightning_diag.rules.val_decline import VAL_DECLINE_HIGHER_IS_BETTER_KEY, ValDeclineRule

__all__ = ["REPLAYS", "Replay", "layer_series", "per_layer_series", "replay", "run_setting", "values_by_step"]

#: Re-runs a check's pure rules over the logged series; returns the alerts they raise.
Replay = Callable[[RunData], list[Alert]]
#: Check id -> its replay function.
REPLAYS: dict[str, Replay] = {}


def replay(check_id: str) -> Callable[[Replay], Replay]:
    """Register the replay function of a checklist row."""

    def decorate(fn: Replay) -> Replay:
        REPLAYS[check_id] = fn
        return fn

    return decorate


def _threshold(run: RunData, key: str) -> float | None:
    value = run.thresholds.get(key)
    return None if value is None else float(value)


def per_layer_series(run: RunData) -> dict[str, Series]:
    return {layer: run.scalars[t] for t in run.tags(prefix("grad_norm")) if (layer := grad_layer(t)) is not None}


def values_by_step(series: Iterable[tuple[str, Series]]) -> dict[int, dict[str, float]]:
    out: dict[int, dict[str, float]] = {}
    for name, points in series:
        for step, v in points:
            out.setdefault(step, {})[name] = v
    return dict(sorted(out.items()))


def run_setting(run: RunData, key: str) -> float:
    """A threshold or setting in effect for replaying: the run's, else the registry's default."""
    value = run.thresholds.get(key)
    return float(value) if value is not None else default(key)


# -- replays ----------------------------------------------------------------------------------------------


def layer_series(run: RunData, family: str) -> dict[str, Series]:
    """``diag/<family>/<layer>`` series by layer (``grad_rms``, ``grad_relative``)."""
    head = prefix(family)
    return {t[len(head) :]: run.scalars[t] for t in run.tags(head)}


def _blocks(layers: Iterable[str]) -> set[str] | None:
    """The layers inside repeated blocks (an index in the name), or ``None`` (all) when there are none."""
    inside = {layer for layer in layers if role_of(layer) != layer}
    return inside or None


def _updates(run: RunData) -> dict[int, dict[str, float]]:
    """``diag/update_ratio/<layer>`` by measured step: the rules read the update of a measured step at the next
    measurement, as in the run (:meth:`GradBandRule.observe_updates` and its peers)."""
    return values_by_step(layer_series(run, "update_ratio").items())


@replay("grad_norm_band")
def _replay_grad_band(run: RunData) -> list[Alert]:
    rule = GradBandRule.from_settings(run.thresholds)
    rms = values_by_step(layer_series(run, "grad_rms").items())
    relative = values_by_step(layer_series(run, "grad_relative").items())
    blocks = _blocks(layer_series(run, "grad_relative"))
    updates = _updates(run)
    alerts: list[Alert] = []
    for step in sorted(set(rms) | set(relative)):
        grads = Measures(grad_rms=rms.get(step, {}), grad_relative=relative.get(step), blocks=blocks)
        alerts += rule.judge(StepContext(0, step), grads)
        if step in updates:
            rule.observe_updates(updates[step])
    return alerts


@replay("grad_spread")
def _replay_grad_spread(run: RunData) -> list[Alert]:
    rule = GradSpreadRule.from_settings(run.thresholds)
    updates = _updates(run)
    alerts: list[Alert] = []
    for step, values in values_by_step(layer_series(run, "grad_relative").items()).items():
        grads = Measures(grad_relative=values, layer_roles={layer: role_of(layer) for layer in values})
        alerts += rule.judge(StepContext(0, step), grads)
        if step in updates:
            rule.observe_updates(updates[step])
    return alerts


@replay(GRAD_COLLAPSE)
def _replay_grad_collapse(run: RunData) -> list[Alert]:
    rule = GradCollapseRule.from_settings(run.thresholds)
    losses = sorted(run.scalars.get(loss_tag("train_step"), []))
    steps = [step for step, _ in losses]
    updates = _updates(run)
    alerts: list[Alert] = []
    for step, norm in run.scalars.get(grad_blocks_tag(), []):
        # the training loss of the measured step, or the last one logged before it (a logger's own cadence)
        at = bisect.bisect_right(steps, step) - 1
        alerts += rule.judge(StepContext(0, step), Measures(grad_norm=norm, loss=losses[at][1] if at >= 0 else None))
        if step in updates:
            rule.observe_updates(updates[step])
    return alerts


@replay("attn_entropy_band")
def _replay_attn_band(run: RunData) -> list[Alert]:
    rule = AttentionEntropyRule.from_settings(run.thresholds)
    heads: dict[str, dict[int, Series]] = {}
    for name, points in run.scalars.items():
        parsed = attn_head(name)
        if parsed is not None:
            heads.setdefault(parsed[0], {})[parsed[1]] = points
    # The first-key mass and key coverage that explain an attention sink or an alignment are not logged: a module
    # the run's own rule explained (its `info` note) is fed as explained (full key coverage), so the replay does not
    # fail it on its low-entropy heads, before the heads tripping together are grouped into one alert.
    explained = {a.source for a in run.alerts if a.rule == ATTN_ENTROPY_LOW and a.severity == Severity.INFO}
    alerts: list[Alert] = []
    by_step: dict[int, dict[str, LayerStats]] = {}
    for module, per_head in heads.items():
        uniform = dict(run.scalars.get(attn_uniform_tag(module), []))
        n = max(per_head) + 1
        for step, values in values_by_step((str(h), s) for h, s in per_head.items()).items():
            entropy = [values.get(str(h), math.nan) for h in range(n)]
            uni = uniform.get(step, math.inf)  # not logged: the low rule judges alone
            cover = [1.0] * n if module in explained else ()
            by_step.setdefault(step, {})[module] = LayerStats(
                entropy, [uni] * n, [math.nan] * n, [math.nan] * n, coverage=cover
            )
    # the training loss at the measured steps tells a collapse from learned sharpness, as in the run
    losses = dict(run.scalars.get(loss_tag("train_step"), []))
    for step, layers in sorted(by_step.items()):
        alerts += rule.judge(StepContext(0, step), Measures(attention=layers, loss=losses.get(step)))
    # the replay's own notes on those modules restate the run's: not returned
    return [a for a in alerts if not (a.rule == ATTN_ENTROPY_LOW and a.severity == Severity.INFO)]


def _loss_points(run: RunData) -> Series:
    return run.scalars.get(loss_tag("train_epoch")) or run.scalars.get(loss_tag("train_window")) or []


@replay(LOSS_SWING)
def _replay_loss_swing(run: RunData) -> list[Alert]:
    rule = LossSwingRule.from_settings(run.thresholds)
    alerts: list[Alert] = []
    spread = dict(run.scalars.get(loss_tag("train_spread"), []))
    previous = 0
    for step, v in _loss_points(run):
        sd = spread.get(step)  # the step losses' spread (a run from before it was logged: pooled from the points)
        variance = sd * sd if sd is not None and math.isfinite(sd) else None
        window = LossWindow(v, steps=max(step - previous, 1), variance=variance)
        alerts += rule.judge(StepContext(0, step), Measures(loss_window=window))
        previous = step
    # the validation view, where the run logged the standard errors it judged the validation loss with (a run from
    # before them is replayed on the training points alone, as it was judged)
    se = dict(run.scalars.get(loss_tag("val_se"), []))
    if se:
        monitor = run.mapping.get("val_loss", "val_loss")
        # the scale a rise must end above: the untrained model's loss, from the first logged training losses (the
        # alarm takes the mean of the first steps, of which the logging steps are a sample)
        baseline = int(_threshold(run, STAGNANT_BASELINE_STEPS_KEY) or 1)
        logged = [v for _, v in run.scalars.get(loss_tag("train_step"), []) if math.isfinite(v)]
        early = [v for step, v in run.scalars.get(loss_tag("train_step"), []) if step < baseline and math.isfinite(v)]
        sample = early or logged[:1]
        scale = sum(sample) / len(sample) if sample else None
        for step, v in run.scalars.get(loss_tag("val"), []):
            judged = Validation(v, noise_se=se.get(step), baseline=scale, metric=monitor)
            alerts += rule.judge(StepContext(0, step), Measures(validation=judged))
    return sorted(alerts, key=lambda a: a.global_step)


@replay(VAL_DECLINE)
def _replay_val_decline(run: RunData) -> list[Alert]:
    mode: Literal["min", "max"] = "max" if _threshold(run, VAL_DECLINE_HIGHER_IS_BETTER_KEY) else "min"
    rule = ValDeclineRule.from_settings(run.thresholds, mode=mode)
    alerts: list[Alert] = []
    for step, v in run.scalars.get(loss_tag("val"), []):
        if math.isfinite(v):
            alerts += rule.judge(StepContext(0, step), Measures(validation=Validation(v)))
    return alerts
