"""``attn_sink``: every head of a layer puts most of its attention on the special tokens (framework-free; the exact
meaning is in :mod:`lightning_diag.rules.attention_specs`)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import ClassVar

from lightning_diag.core.record import Alert, Severity
from lightning_diag.rules.attention_specs import (
    ATTN_PATIENCE_SETTING,
    ATTN_SINK_SPEC,
    DEFAULT_ATTN_PATIENCE,
    DEFAULT_SINK_THRESHOLD,
    first_mass,
)
from lightning_diag.rules.base import Latch, Rule, StepContext, excess, name_layers
from lightning_diag.rules.measures import Measure, Measures

__all__ = ["SINK_HOLD_MARGIN", "AttentionSinkRule"]

#: ``attn_sink`` hysteresis: a layer in alarm stays in its event while every head keeps more than ``sink_mass -
#: SINK_HOLD_MARGIN`` (0.4 for 0.5) on the special tokens (and twice its uniform share).
SINK_HOLD_MARGIN = 0.1


class AttentionSinkRule(Rule):
    """``attn_sink``: every head of a layer puts most of its mass on the special tokens.

    Example:
        >>> from lightning_diag.rules.records import LayerStats
        >>> rule = AttentionSinkRule(patience=1)
        >>> sink = {"attn": LayerStats([0.2, 0.3], [2.7, 2.7], [0.9, 0.8], [0.13, 0.13])}
        >>> [a.rule for a in rule.judge(StepContext(0, 5), Measures(attention=sink))]
        ['attn_sink']
    """

    specs = (ATTN_SINK_SPEC,)
    setting_keys: ClassVar[Mapping[str, str]] = {
        "sink_mass": ATTN_SINK_SPEC.rule_id, "patience": ATTN_PATIENCE_SETTING.key,
    }
    needs = frozenset({Measure.ATTENTION})
    state_keys = ("streaks",)

    def __init__(self, sink_mass: float = DEFAULT_SINK_THRESHOLD, patience: int = DEFAULT_ATTN_PATIENCE) -> None:
        super().__init__()
        self.sink_mass = sink_mass
        self.patience = patience
        self.latch = Latch.for_patience(patience)
        self.streaks: dict[str, int] = {}

    def judge(self, ctx: StepContext, m: Measures) -> list[Alert]:
        """Judge one measurement of every module's heads; return the alerts raised.

        Latching and streaks are per module; the modules newly sinking at this measurement make one alert naming
        them (one for causal layers of attention-sink heads, ``info``; one for the others), whose ``source`` is
        the module whose heads sink most (largest least-mass).
        """
        layers = m.attention or {}
        causal: dict[str, float] = {}
        sunk_modules: dict[str, float] = {}
        first_least: dict[str, float] = {}
        for module, stats in layers.items():
            pairs = [
                (m, s)
                for m, s in zip(stats.special_mass, stats.special_share, strict=True)
                if math.isfinite(m) and math.isfinite(s)
            ]
            if not pairs:
                continue
            sunk = all(m > self.sink_mass and m > 2 * s for m, s in pairs)
            if self.latch.is_active(module):  # hysteresis: a sinking layer stays in its event on a looser bound
                sunk = sunk or all(m > self.sink_mass - SINK_HOLD_MARGIN and m > 2 * s for m, s in pairs)
            least = min(m for m, _ in pairs)
            # the margin: the least-sinking head's excess, held over `patience` measurements; a causal layer of
            # attention-sink heads is an `info` note, not the warning: 0
            first = first_mass(stats)
            resting = stats.causal and all(f > self.sink_mass for f in first)  # NaN (unknown) compares False
            x = 0.0 if resting else min(min(excess(m, self.sink_mass), excess(m, 2 * s)) for m, s in pairs)
            self.observe_held(module, x, self.patience)
            self.streaks[module] = self.streaks.get(module, 0) + 1 if sunk else 0
            if self.latch.update(module, self.streaks[module] >= self.patience):
                if resting:
                    causal[module] = least
                    first_least[module] = min(first)
                else:
                    sunk_modules[module] = least
        alerts = []
        if sunk_modules:
            alerts.append(self._sink_alert(sunk_modules, ctx))
        if causal:
            alerts.append(self._causal_note(causal, first_least, ctx))
        return alerts

    def _causal_note(self, least: Mapping[str, float], first: Mapping[str, float], ctx: StepContext) -> Alert:
        worst = max(least, key=least.__getitem__)
        if len(least) == 1:
            which = f"every head of `{worst}` (causal attention) puts"
            firsts = f"least: {first[worst]:.0%}"
        else:
            which = f"in {name_layers(least)} (causal attention; each layer's least head), every head puts"
            firsts = f"least in `{worst}`: {first[worst]:.0%}"
        return self._alert(
            ctx,
            f"{which} more than {self.sink_mass:.0%} of its attention on the first key each query may see "
            f"({firsts}) on {self.patience} consecutive measurements: a layer of attention-sink heads, the usual "
            "resting place of causal heads with nothing to add (Xiao et al. 2023); information, not a fault",
            source=worst,
            value=least[worst],
            threshold=self.sink_mass,
            severity=Severity.INFO,
        )

    def _sink_alert(self, least: Mapping[str, float], ctx: StepContext) -> Alert:
        worst = max(least, key=least.__getitem__)
        if len(least) == 1:
            which = f"every head of `{worst}` puts"
            mass = f"least: {least[worst]:.0%}"
        else:
            which = f"in {name_layers(least)} (each layer's least head), every head puts"
            mass = f"least in `{worst}`: {least[worst]:.0%}"
        return self._alert(
            ctx,
            f"{which} more than {self.sink_mass:.0%} of its attention on the special tokens ({mass}) on "
            f"{self.patience} consecutive measurements: the layer attends to [CLS]/[SEP] instead of the content; "
            "check masks, positional encodings and whether the layer still learns",
            source=worst,
            value=least[worst],
            threshold=self.sink_mass,
        )
