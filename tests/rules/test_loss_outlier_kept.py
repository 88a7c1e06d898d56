"""``loss_outlier``'s window kept between judgments (not rebuilt from the saved history at each call) judges as the
rebuild does: the same alerts, margins and state, on random loss sequences with non-finite and non-positive losses,
under gradient accumulation, across a state load (a resume) and a history set from outside."""

from __future__ import annotations

import math
import random

import pytest

import lightning_diag.rules.loss_outlier as loss_outlier
from lightning_diag.rules.base import StepContext
from lightning_diag.rules.loss_outlier import LossOutlierRule
from lightning_diag.rules.measures import Measures, StepLosses


def _losses(rng: random.Random, n: int) -> list[float]:
    level, out = 2.0, []
    for _ in range(n):
        level *= 0.997
        x = level * math.exp(rng.gauss(0.0, 0.12))
        if rng.random() < 0.03:
            x *= rng.choice([8.0, 30.0])  # isolated spikes: outliers
        if rng.random() < 0.03:
            x = rng.choice([math.nan, math.inf, -math.inf, 0.0, -0.5])
        out.append(x)
    return out


def _chunks(rng: random.Random, losses: list[float], span: int) -> list[tuple[list[float], list[int]]]:
    """The losses in logging-step chunks of random length, ``span`` losses a global step."""
    out, start = [], 0
    while start < len(losses):
        n = rng.randint(1, 25)
        out.append((losses[start : start + n], [(start + k) // span for k in range(len(losses[start : start + n]))]))
        start += n
    return out


def _judge(rule: LossOutlierRule, values: list[float], steps: list[int]) -> list[tuple]:
    alerts = rule.judge(StepContext(0, steps[-1]), Measures(step_losses=StepLosses(values, steps)))
    return [(a.rule, a.global_step, a.value, a.message) for a in alerts]


class _Rebuilt(LossOutlierRule):
    """The rule as before the kept window: the window built from ``history`` at every judgment."""

    def _past(self) -> loss_outlier._LossWindow:
        self._kept = None
        return super()._past()


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("span", [1, 3])
def test_kept_window_judges_as_the_rebuild(seed: int, span: int) -> None:
    rng = random.Random(seed * 10 + span)
    window = rng.choice([4, 8, 32])
    losses = _losses(rng, 900)
    kept, rebuilt = LossOutlierRule(window=window), _Rebuilt(window=window)
    resumed: LossOutlierRule | None = None
    alerts_kept, alerts_rebuilt, alerts_resumed, alerts_after = [], [], [], []
    reused = 0
    for n, (values, steps) in enumerate(_chunks(rng, losses, span)):
        before = kept._kept
        raised = _judge(kept, values, steps)
        alerts_kept += raised
        reused += before is not None and kept._kept is not None and kept._kept[0] is before[0]
        alerts_rebuilt += _judge(rebuilt, values, steps)
        assert kept.state_dict() == rebuilt.state_dict()
        assert list(kept._kept[0].values) == [v for v in kept.history if math.isfinite(v)][-window:]  # type: ignore[index]
        if n == 12:  # a resume: a new rule loads the state and goes on
            resumed = LossOutlierRule(window=window)
            resumed.load_state_dict(kept.state_dict())
        elif resumed is not None:
            alerts_resumed += _judge(resumed, values, steps)
            alerts_after += raised
    assert alerts_kept == alerts_rebuilt and kept.peaks == rebuilt.peaks and kept.outliers == rebuilt.outliers
    assert alerts_kept, "the corpus has isolated spikes: the outlier path is exercised"
    assert reused > 20  # the window was kept, not rebuilt, on most judgments
    assert resumed is not None and resumed.state_dict() == kept.state_dict()
    assert alerts_resumed == alerts_after


def test_a_state_load_or_a_history_set_from_outside_replaces_the_kept_window() -> None:
    rule = LossOutlierRule(window=8)
    base = [0.5 + 0.01 * (k % 3) for k in range(12)]
    _judge(rule, base, list(range(12)))
    state = rule.state_dict()
    assert rule._kept is not None and list(rule._kept[0].values) == rule.history
    # a history of lower losses loaded: a spike against it is judged against the loaded losses, not the kept ones
    rule.load_state_dict({**state, "history": [0.05 + 0.001 * k for k in range(8)], "initial": 0.05})
    alerts = _judge(rule, [0.05, 0.9, 0.05, 0.05], [12, 13, 14, 15])
    assert [a[1] for a in alerts] == [13]
    # the same spike against the kept window of losses near 0.5 is no outlier
    again = LossOutlierRule(window=8)
    _judge(again, base, list(range(12)))
    assert _judge(again, [0.5, 0.9, 0.5, 0.5], [12, 13, 14, 15]) == []
    # a history set from outside (in place) is seen too
    again.history[:] = [0.05 + 0.001 * k for k in range(8)]
    again.initial = 0.05
    assert [a[1] for a in _judge(again, [0.05, 0.9, 0.05, 0.05], [16, 17, 18, 19])] == [17]
