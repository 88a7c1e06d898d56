"""``loss_outlier``'s window kept sorted between losses (``judge_losses``) judges exactly as sorting it afresh did."""

import itertools
import math
import random

import pytest

import lightning_diag.rules.loss_outlier as loss_outlier
from lightning_diag.rules.base import StepContext
from lightning_diag.rules.loss_outlier import LossOutlierRule, judge_losses, outlier_excess
from lightning_diag.rules.measures import Measures, StepLosses


def reference_judge_losses(history, new, threshold, ratio, window, floor=None, before=(), after=(), span=1):
    """``judge_losses`` as it was before the sorted window: a list, ``outlier_excess`` sorting it at each loss."""
    past = [v for v in history if math.isfinite(v)][-window:]
    finite = [(i, float(x)) for i, x in enumerate(new) if math.isfinite(x)]
    head = [float(v) for v in before if math.isfinite(v)]
    sequence = [*head, *(x for _, x in finite), *(float(v) for v in after if math.isfinite(v))]
    span = max(int(span), 1)
    out = []
    for k, (i, x) in enumerate(finite):
        at = len(head) + k
        runs = [
            [sequence[n] for n in (start - 1, start + span) if 0 <= n < len(sequence)]
            for start in range(at - span + 1, at + 1)
        ]
        neighbours = min(runs, key=lambda nb: max(nb, default=-math.inf))
        excess, med = outlier_excess(past, x, threshold, ratio, window, floor, neighbours)
        out.append((i, x, excess, med))
        if excess > 1.0:
            continue
        past.append(x)
        if len(past) > window:
            past.pop(0)
    return out


def _same(a, b):
    """Equal, element for element and to the bit (``nan`` equal to ``nan``; ``0.0`` and ``-0.0`` told apart)."""
    assert len(a) == len(b)
    for row_a, row_b in zip(a, b, strict=True):
        for u, v in zip(row_a, row_b, strict=True):
            assert (math.isnan(u) and math.isnan(v)) or (u == v and math.copysign(1.0, u) == math.copysign(1.0, v))


def _losses(rng, n, kind):
    level = 2.0
    out = []
    for t in range(n):
        level *= 0.995
        x = level * math.exp(rng.gauss(0.0, 0.15))
        if rng.random() < 0.04:
            x *= rng.choice([5.0, 20.0, 0.05])  # spikes up, one down
        if kind == "ties":
            x = round(x, 1)
        elif kind == "signed":  # a loss that crosses 0 (a custom objective): the linear scale, and exact zeros
            x = round(x - 1.0, 2) if t % 7 else 0.0
        elif kind == "zeros" and rng.random() < 0.1:
            x = rng.choice([0.0, -0.0])
        elif kind == "nonfinite" and rng.random() < 0.05:
            x = rng.choice([math.nan, math.inf, -math.inf])
        out.append(x)
    return out


@pytest.mark.parametrize("kind", ["lognormal", "ties", "signed", "zeros", "nonfinite"])
@pytest.mark.parametrize(("window", "span", "floor"), [(32, 1, 0.7), (8, 1, None), (4, 2, None), (32, 3, 1.5)])
def test_judge_losses_equals_sorting_afresh(kind, window, span, floor):
    rng = random.Random(f"{kind}-{window}-{span}")
    for _ in range(20):
        losses = _losses(rng, 160, kind)
        history, new, after = losses[:50], losses[50:150], losses[150:152]
        before = losses[48:50]
        for threshold, ratio in ((10.0, 2.0), (2.0, 1.2)):
            args = (history, new, threshold, ratio, window, floor, before, after, span)
            got, want = judge_losses(*args), reference_judge_losses(*args)
            _same(got, want)
    assert any(excess > 1.0 for _, _, excess, _ in got), "the corpus holds outliers: the exclusion path is exercised"


def test_window_statistics_follow_the_losses():
    """After every insertion and removal, the sorted lists are those of the losses in the window."""
    rng = random.Random(0)
    window = loss_outlier._LossWindow([0.5, 0.4, 0.6])
    for v in _losses(rng, 300, "zeros"):
        window.append(v)
        if len(window) > 16:
            window.pop_oldest()
        values = list(window.values)
        assert window.ordered == sorted(values)
        assert window.logs == sorted(math.log(v) for v in values if v > 0)
        pairs = itertools.pairwise(values)
        assert window.spreads == sorted(abs(math.log(b) - math.log(a)) for a, b in pairs if a > 0 and b > 0)
        assert window.nonpositive == sum(v <= 0 for v in values)


def test_rule_alerts_and_margins_unchanged(monkeypatch):
    """The rule fed a fit's losses in logging-step chunks: the same alerts (steps, values, messages) and the same
    peak margins with the sorted window as with the reference."""

    def run():
        rule = LossOutlierRule()
        rng = random.Random(3)
        alerts = []
        losses = _losses(rng, 2_000, "lognormal")
        for start in range(0, len(losses), 10):
            steps = list(range(start, start + 10))
            fed = Measures(step_losses=StepLosses(losses[start : start + 10], steps))
            alerts += rule.judge(StepContext(start // 20, start + 9), fed)
        return [(a.rule, a.global_step, a.value, a.message) for a in alerts], rule.peaks, rule.outliers

    got = run()
    monkeypatch.setattr(  # the rule's judgment against its kept window: the reference, on the window's losses
        loss_outlier, "_judge_against", lambda past, *args: reference_judge_losses(list(past.values), *args)
    )
    want = run()
    assert got == want
    assert got[0], "the losses hold isolated spikes: some alert"
