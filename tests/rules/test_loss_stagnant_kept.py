"""``loss_stagnant``'s trend test from sums kept as the loss points grow gives the numbers of
``mann_kendall`` and ``theil_sen_slope`` over the whole series, to the bit: on random series with ties, across the
halving of the points past 256, a state load (a resume) and points changed from outside."""

from __future__ import annotations

import math
import random

import pytest

from lightning_diag.rules.base import StepContext
from lightning_diag.rules.loss_stagnant import LossStagnantRule, _KeptTrend
from lightning_diag.rules.measures import LossWindow, Measures
from lightning_diag.stats.trend import mann_kendall, theil_sen_slope


def _bits(values: tuple[float, ...]) -> tuple[str, ...]:
    return tuple(v.hex() for v in values)


@pytest.mark.parametrize("kind", ["falling", "flat", "ties", "signed"])
def test_kept_trend_equals_the_functions_at_every_length(kind: str) -> None:
    rng = random.Random(kind)
    kept = _KeptTrend()
    series: list[float] = []
    for n in range(120):
        v = {"falling": 2.0 * 0.98**n, "flat": 1.4, "ties": 1.0, "signed": 0.0}[kind] + rng.gauss(0.0, 0.05)
        series = [*series, round(v, 1) if kind == "ties" else v]
        if len(series) >= 3:
            want = (*mann_kendall(series), theil_sen_slope(series))
            assert _bits(kept.of(series)) == _bits(want), n
    assert kept.of(series[:50]) == (*mann_kendall(series[:50]), theil_sen_slope(series[:50]))  # shorter: afresh
    changed = [*series[:10], series[10] + 1.0, *series[11:]]
    assert _bits(kept.of(changed)) == _bits((*mann_kendall(changed), theil_sen_slope(changed)))
    assert kept.of([1.0, math.inf, 2.0]) == (*mann_kendall([1.0, math.inf, 2.0]), theil_sen_slope([1.0, math.inf, 2.0]))


class _Functions(LossStagnantRule):
    """The rule with the trend test of the functions, over the whole series at each point (as before)."""

    def __init__(self, **kwargs: float) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self._trend = _Afresh()  # type: ignore[assignment]


class _Afresh:
    def of(self, series: list[float]) -> tuple[float, float, float]:
        return (*mann_kendall(series), theil_sen_slope(series))


def _feed(rule: LossStagnantRule, point: int, value: float) -> list[tuple]:
    window = LossWindow(value, initial=1.5 if point == 0 else None)
    alerts = rule.judge(StepContext(point, 20 * (point + 1)), Measures(loss_window=window))
    return [(a.rule, a.global_step, a.value, a.message) for a in alerts]


@pytest.mark.parametrize("seed", range(4))
def test_the_rule_judges_as_with_the_functions(seed: int) -> None:
    rng = random.Random(seed)
    kept, afresh = LossStagnantRule(min_drop=0.05), _Functions(min_drop=0.05)
    resumed: LossStagnantRule | None = None
    got, want, after_resume, resumed_got = [], [], [], []
    for point in range(300):  # past 256 points: the pairs are averaged, the sums taken afresh
        drift = -0.002 * point if (point // 60) % 2 else 0.0
        value = 1.5 + drift + rng.gauss(0.0, 0.03)
        a, b = _feed(kept, point, value), _feed(afresh, point, value)
        got += a
        want += b
        assert kept.state_dict() == afresh.state_dict()
        numbers = [(rule.last_p, rule.last_trend, rule.level) for rule in (kept, afresh)]
        assert _bits(numbers[0]) == _bits(numbers[1])
        if point == 100:
            resumed = LossStagnantRule(min_drop=0.05)
            resumed.load_state_dict(kept.state_dict())
        elif resumed is not None:
            resumed_got += _feed(resumed, point, value)
            after_resume += a
    assert got == want and got, "a flat loss: the rule fires"
    assert resumed is not None and resumed_got == after_resume and resumed.state_dict() == kept.state_dict()
    assert len(kept.history) <= 256 and kept._trend.values == kept.history
