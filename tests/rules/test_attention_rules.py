import pytest

from lightning_diag.rules.attention import AttentionEntropyRule, AttentionSinkRule, LayerStats
from lightning_diag.rules.base import StepContext


def layer(entropy, uniform=2.7, mass=0.1, share=0.15):
    n = len(entropy)
    return {
        "enc.attn": LayerStats(
            list(entropy), [uniform] * n, [mass] * n if isinstance(mass, float) else mass, [share] * n
        )
    }


def fired(rule, feed, start=0):
    return [
        [(a.rule, a.source, a.severity.value) for a in rule.update(x, StepContext(0, start + i))]
        for i, x in enumerate(feed)
    ]


@pytest.mark.parametrize(
    ("feed", "expected"),
    [
        # a collapsed head alerts after 2 consecutive measurements, once
        ([layer([0.1, 2.0])] * 4, [[], [("attn_entropy_low", "enc.attn/head_0", "warning")], [], []]),
        # a noisy single dip does not alert
        ([layer([0.1, 2.0]), layer([1.0, 2.0]), layer([0.1, 2.0])], [[], [], []]),
        # short rows (uniform below 2 x 0.5 nats) are never collapse
        ([layer([0.1, 0.2], uniform=0.69)] * 3, [[], [], []]),
    ],
)
def test_low_entropy_table(feed, expected):
    assert fired(AttentionEntropyRule(warmup_steps=0), feed) == expected


def test_low_latch_clears_and_fires_again():
    rule = AttentionEntropyRule(patience=1, warmup_steps=0)
    got = fired(rule, [layer([0.1]), layer([1.5]), layer([0.1])])
    assert [len(x) for x in got] == [1, 0, 1]


def test_high_needs_warmup_near_uniform_and_is_info():
    diffuse = layer([4.7, 3.0], uniform=4.85)  # head 0 at 97% of uniform over 128 keys, head 1 focused
    rule = AttentionEntropyRule(warmup_steps=10)
    assert fired(rule, [diffuse] * 3, start=0) == [[], [], []]
    got = fired(rule, [diffuse] * 2, start=10)
    assert got == [[], [("attn_entropy_high", "enc.attn/head_0", "info")]]


def test_high_cannot_fire_below_the_absolute_threshold():
    rule = AttentionEntropyRule(warmup_steps=0, patience=1)
    assert fired(rule, [layer([2.4], uniform=2.48)] * 2) == [[], []]


def test_sink_needs_every_head_and_twice_the_uniform_share():
    rule = AttentionSinkRule(patience=1)
    assert fired(rule, [layer([0.2, 0.3], mass=[0.9, 0.4])]) == [[]]  # one head still reads the content
    assert fired(rule, [layer([0.2, 0.3], mass=[0.9, 0.8], share=0.6)]) == [[]]  # uniform would give 60%
    assert fired(rule, [layer([0.2, 0.3], mass=[0.9, 0.8])]) == [[("attn_sink", "enc.attn", "warning")]]


@pytest.mark.parametrize("factory", [lambda: AttentionEntropyRule(warmup_steps=0), AttentionSinkRule])
def test_state_round_trip_continues_the_streak(factory):
    bad = layer([0.1, 0.2], mass=[0.9, 0.9])
    first = factory()
    first.update(bad, StepContext(0, 0))
    second = factory()
    second.load_state_dict(first.state_dict())
    assert second.update(bad, StepContext(0, 1))  # the streak survived: alerts on the second measurement
    third = factory()
    third.load_state_dict(second.state_dict())
    assert third.update(bad, StepContext(0, 2)) == []  # and so did the latch
    state = third.state_dict()
    del state["latch"]
    with pytest.raises(KeyError, match="latch"):
        factory().load_state_dict(state)
