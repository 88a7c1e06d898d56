import pytest

from lightning_diag.rules.attention_entropy import START_HOLD, AttentionEntropyRule
from lightning_diag.rules.attention_sink import AttentionSinkRule
from lightning_diag.rules.base import StepContext
from lightning_diag.rules.measures import Measures
from lightning_diag.rules.records import LayerStats


def layer(entropy, uniform=2.7, mass=0.1, share=0.15, first=(), causal=False):
    n = len(entropy)
    return {
        "enc.attn": LayerStats(
            list(entropy),
            [uniform] * n,
            [mass] * n if isinstance(mass, float) else mass,
            [share] * n,
            [first] * n if isinstance(first, float) else list(first),
            causal,
        )
    }


def _attn(stats):
    """The measures of one attention module `attn` measured as `stats`."""
    return Measures(attention={"attn": stats})


def fired(rule, feed, start=0):
    return [
        [(a.rule, a.source, a.severity.value) for a in rule.judge(StepContext(0, start + i), Measures(attention=x))]
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
    first.judge(StepContext(0, 0), Measures(attention=bad))
    second = factory()
    second.load_state_dict(first.state_dict())
    # the streak survived: alerts on the second measurement
    assert second.judge(StepContext(0, 1), Measures(attention=bad))
    third = factory()
    third.load_state_dict(second.state_dict())
    assert third.judge(StepContext(0, 2), Measures(attention=bad)) == []  # and so did the latch
    state = third.state_dict()
    del state["latch"]
    with pytest.raises(KeyError, match="latch"):
        factory().load_state_dict(state)


def serious(got):
    return [[x for x in step if x[2] != "info"] for step in got]


# Causal attention parked on the first visible key (the attention sink of Xiao et al. 2023) is a healthy no-op
# head; the same low entropy on a content key, or on [CLS] of bidirectional attention, is a collapse.
SINK = layer([0.1, 0.2], mass=[0.95, 0.9], first=[0.95, 0.9], causal=True)
CONTENT = layer([0.1, 0.2], mass=[0.02, 0.03], first=[0.02, 0.03], causal=True)
CLS = layer([0.1, 0.2], mass=[0.95, 0.9], first=[0.95, 0.9], causal=False)
MIXED = layer([0.1, 0.2], mass=[0.95, 0.05], first=[0.95, 0.05], causal=True)  # head 1 one-hot on content
UNKNOWN = layer([0.1, 0.2], mass=[0.95, 0.9], causal=True)  # first-key mass not measured: judged as before


@pytest.mark.parametrize(
    ("feed", "low", "sink"),
    [
        ([SINK] * 4, [[], [], [], []], [[], [], [], []]),
        (
            [CONTENT] * 3,
            [[], [("attn_entropy_low", "enc.attn/head_0")], []],
            [[], [], []],
        ),
        (
            [CLS] * 3,
            [[], [("attn_entropy_low", "enc.attn/head_0")], []],
            [[], [("attn_sink", "enc.attn")], []],
        ),
        ([MIXED] * 3, [[], [("attn_entropy_low", "enc.attn/head_1")], []], [[], [], []]),
        (
            [UNKNOWN] * 2,
            [[], [("attn_entropy_low", "enc.attn/head_0")]],
            [[], [("attn_sink", "enc.attn")]],
        ),
    ],
    ids=["causal-sink", "causal-content", "bidirectional-cls", "causal-mixed", "causal-unknown-first"],
)
def test_causal_sink_is_not_a_collapse_table(feed, low, sink):
    entropy = fired(AttentionEntropyRule(warmup_steps=0), feed)
    sinks = fired(AttentionSinkRule(), feed)
    assert [[x[:2] for x in s] for s in serious(entropy)] == low
    assert [[x[:2] for x in s] for s in serious(sinks)] == sink


def test_causal_sink_heads_get_one_info_note_per_module():
    rule = AttentionEntropyRule(warmup_steps=0)
    got = fired(rule, [SINK] * 3 + [CONTENT] + [SINK] * 3)
    notes = [(i, x) for i, step in enumerate(got) for x in step if x[2] == "info"]
    assert notes == [(1, ("attn_entropy_low", "enc.attn", "info"))]  # once, after `patience`, never again
    note = rule.judge(StepContext(0, 99), Measures(attention=SINK))
    assert note == []
    fresh = AttentionEntropyRule(warmup_steps=0, patience=1)
    got = {a.severity.value: a for a in fresh.judge(StepContext(0, 0), Measures(attention=MIXED))}
    assert set(got) == {"info", "warning"}  # head 0 is a sink (note), head 1 collapsed on content (warning)
    assert got["warning"].source == "enc.attn/head_1"
    assert "1 of 2 heads" in got["info"].message and "head_0" in got["info"].message


def test_causal_layer_of_sink_heads_is_info_for_the_sink_rule():
    rule = AttentionSinkRule(patience=1)
    (alert,) = rule.judge(StepContext(0, 0), Measures(attention=SINK))
    assert (alert.rule, alert.severity) == ("attn_sink", "info")
    assert "first key" in alert.message
    # causal, but the special mass sits on the last key (EOS), not the first one: still a warning
    eos = layer([0.1, 0.2], mass=[0.95, 0.9], first=[0.1, 0.1], causal=True)
    assert fired(AttentionSinkRule(patience=1), [eos]) == [[("attn_sink", "enc.attn", "warning")]]


def test_sink_state_survives_a_round_trip():
    first = AttentionEntropyRule(warmup_steps=0)
    first.judge(StepContext(0, 0), Measures(attention=SINK))
    second = AttentionEntropyRule(warmup_steps=0)
    second.load_state_dict(first.state_dict())
    assert [a.severity for a in second.judge(StepContext(0, 1), Measures(attention=SINK))] == ["info"]
    third = AttentionEntropyRule(warmup_steps=0)
    third.load_state_dict(second.state_dict())
    assert third.judge(StepContext(0, 2), Measures(attention=SINK)) == []


def modules(**entropy):
    """``{module: LayerStats}`` of heads with these entropies (uniform 2.7 nats)."""
    return {m: LayerStats(list(e), [2.7] * len(e), [0.1] * len(e), [0.15] * len(e)) for m, e in entropy.items()}


HEALTHY8, COLLAPSED8 = [1.5] * 8, [0.3, 0.1, 0.2, 0.05, 0.4, 0.3, 0.2, 0.1]


# Many heads tripping one rule at one measurement make one alert naming them (count and the worst few); the
# latches stay per (module, head), so a module tripping later, or a head clearing and tripping again, alerts again.
@pytest.mark.parametrize(
    ("feed", "expected"),
    [
        # 8 heads of one module collapse at once: one alert, source the worst head, naming "8 heads"
        ([modules(a=COLLAPSED8)] * 2, [[], [("a/head_3", 0.05, "8 heads in 1 module")]]),
        # a second module collapsing later: a second alert, about it alone
        (
            [modules(a=COLLAPSED8, b=HEALTHY8)] * 2 + [modules(a=COLLAPSED8, b=[0.2] + [1.5] * 7)] * 2,
            [[], [("a/head_3", 0.05, "8 heads in 1 module")], [], [("b/head_0", 0.2, "`b/head_0` is 0.2 nats")]],
        ),
        # two modules at the same step: one alert counting both
        (
            [modules(a=[0.2, 1.5], b=[0.1, 0.3])] * 2,
            [[], [("b/head_0", 0.1, "3 heads in 2 modules: `b/head_0` 0.1, `a/head_0` 0.2, `b/head_1` 0.3")]],
        ),
        # a head that clears for `patience` measurements and trips again alerts again; its neighbour, still
        # latched, does not
        (
            [modules(a=[0.1, 0.2])] * 2 + [modules(a=[1.5, 0.2])] * 2 + [modules(a=[0.1, 0.2])] * 2,
            [[], [("a/head_0", 0.1, "2 heads")], [], [], [], [("a/head_0", 0.1, "`a/head_0` is 0.1 nats")]],
        ),
        # one measurement out of the band is a flicker: the same event, no second alert
        (
            [modules(a=[0.1, 0.2])] * 2 + [modules(a=[1.5, 0.2])] + [modules(a=[0.1, 0.2])] * 2,
            [[], [("a/head_0", 0.1, "2 heads")], [], [], []],
        ),
    ],
    ids=["8-heads-one-alert", "second-module-later", "two-modules-at-once", "clear-and-trip-again", "flicker"],
)
def test_heads_tripping_together_make_one_alert_table(feed, expected):
    rule = AttentionEntropyRule(warmup_steps=0)
    got = [rule.judge(StepContext(0, i), Measures(attention=x)) for i, x in enumerate(feed)]
    assert [[(a.source, a.value) for a in step] for step in got] == [[x[:2] for x in step] for step in expected]
    for step, want in zip(got, expected, strict=True):
        for alert, (_, _, text) in zip(step, want, strict=True):
            assert alert.rule == "attn_entropy_low" and alert.severity == "warning" and text in alert.message


def test_diffuse_heads_at_one_step_make_one_info_alert():
    diffuse = {m: LayerStats([4.7, 4.6, 3.0], [4.85] * 3, [0.1] * 3, [0.15] * 3) for m in ("a", "b")}
    (alert,) = AttentionEntropyRule(warmup_steps=0, patience=1).judge(StepContext(0, 0), Measures(attention=diffuse))
    assert (alert.rule, alert.severity, alert.source, alert.value) == ("attn_entropy_high", "info", "a/head_0", 4.7)
    assert "4 heads in 2 modules" in alert.message


def test_modules_sinking_at_one_step_make_one_alert():
    rule = AttentionSinkRule(patience=1)
    sunk = {
        m: LayerStats([0.2, 0.3], [2.7, 2.7], mass, [0.13, 0.13])
        for m, mass in (("a", [0.9, 0.8]), ("b", [0.95, 0.92]))
    }
    (alert,) = rule.judge(StepContext(0, 0), Measures(attention=sunk))
    assert (alert.rule, alert.severity, alert.source, alert.value) == ("attn_sink", "warning", "b", 0.92)
    assert "2 layers: `b` 0.92, `a` 0.8" in alert.message
    assert rule.judge(StepContext(0, 1), Measures(attention=sunk)) == []  # latched per module
    third = {**sunk, "c": sunk["a"]}
    assert [a.source for a in rule.judge(StepContext(0, 2), Measures(attention=third))] == ["c"]


# Sharp by learning is not a collapse (issue 23): the alarm's beginning is judged by how the head got there.
def two_heads(target, other=1.8):
    """One module: head 0 at ``target`` nats, head 1 spread (so the layer as a whole has not collapsed)."""
    return modules(a=[target, other])


GRADUAL = [1.6, 1.2, 0.9, 0.7, 0.55, 0.48, 0.46, 0.47, 0.45]  # at most 1.3x per measurement
FALLING_LOSS = [3.4 - 0.3 * i for i in range(len(GRADUAL))]


def severities(rule, entropies, losses, other=1.8):
    got = [
        rule.judge(StepContext(0, i * 5), Measures(attention=two_heads(e, other), loss=loss))
        for i, (e, loss) in enumerate(zip(entropies, losses, strict=True))
    ]
    return [(i, a.severity.value) for i, step in enumerate(got) for a in step if a.rule == "attn_entropy_low"]


@pytest.mark.parametrize(
    ("entropies", "losses", "expected"),
    [
        # a gradual descent while the loss falls: a learned sharp head, one info alert
        (GRADUAL, FALLING_LOSS, [(6, "info")]),
        # the same descent with the loss unknown: still gradual, still info
        (GRADUAL, [None] * len(GRADUAL), [(6, "info")]),
        # the same descent while the loss rises: gradual, so still learned (a plateau is no collapse)
        (GRADUAL, FALLING_LOSS[::-1], [(6, "info")]),
        # an abrupt fall (1.8 -> 0.05) while the loss rises: a collapse
        ([1.8, 1.8, 0.05, 0.05, 0.05], [2.0, 1.9, 2.6, 2.8, 2.9], [(3, "warning")]),
        # an abrupt fall with the loss unknown: a collapse
        ([1.8, 1.8, 0.05, 0.05, 0.05], [None] * 5, [(3, "warning")]),
        # an abrupt fall while the loss keeps falling: a learned phase change (an induction head forming)
        ([1.8, 1.8, 0.3, 0.2, 0.2], [3.0, 2.5, 1.5, 1.0, 0.8], [(3, "info")]),
        # low from the first measurement while the loss falls: pretrained or built sharp, info
        ([0.3] * 4, [3.0, 2.5, 2.0, 1.5], [(1, "info")]),
        # low from the first measurement, loss flat through the hold (START_HOLD measurements past patience): nothing
        # says it was learned, a warning
        ([0.3] * 10, [2.0] * 10, [(9, "warning")]),
    ],
    ids=[
        "gradual-loss-falls", "gradual-loss-unknown", "gradual-loss-rises", "abrupt-loss-rises",
        "abrupt-loss-unknown", "abrupt-loss-falls", "sharp-from-start-learning", "sharp-from-start-flat",
    ],
)  # fmt: skip
def test_collapse_is_a_change_table(entropies, losses, expected):
    assert severities(AttentionEntropyRule(warmup_steps=0), entropies, losses) == expected


def test_entropy_low_margin_is_the_warnings():
    # a learned sharp head (gradual, info) is quiet with room: margin 0; an abrupt collapse's margin is low / entropy
    learned = AttentionEntropyRule(warmup_steps=0)
    severities(learned, GRADUAL, FALLING_LOSS)
    assert learned.peaks["attn_entropy_low"] == 0.0
    collapsed = AttentionEntropyRule(warmup_steps=0)
    severities(collapsed, [1.8, 1.8, 0.05, 0.05, 0.05], [2.0, 1.9, 2.6, 2.8, 2.9])
    assert collapsed.peaks["attn_entropy_low"] == pytest.approx(0.5 / 0.05)


def test_every_head_of_a_layer_low_is_a_collapse_even_gradually():
    rule = AttentionEntropyRule(warmup_steps=0)
    feed = [Measures(attention=modules(a=[e, e]), loss=loss) for e, loss in zip(GRADUAL, FALLING_LOSS, strict=True)]
    got = [rule.judge(StepContext(0, i), m) for i, m in enumerate(feed)]
    alerts = [(i, a) for i, step in enumerate(got) for a in step]
    assert [(i, a.severity.value) for i, a in alerts] == [(6, "warning")]
    assert "2 heads in 1 module" in alerts[0][1].message and "every head of the layer" in alerts[0][1].message


@pytest.mark.parametrize(
    ("losses", "expected"),
    [
        ([4.3, 4.1, 3.9, 3.8], [(1, "info")]),  # learning from the start
        # flat for its first 30 steps, then falling (Lightning's demo transformer): info once the loss falls
        ([4.25, 4.25, 4.28, 4.25, 4.25, 4.23, 4.11, 4.14, 4.0, 3.9], [(5, "info")]),
        ([4.0] * 10, [(1 + START_HOLD, "warning")]),  # flat through the hold: a warning
    ],
)
def test_a_whole_layer_peaked_from_its_first_measurement_is_a_collapse_only_while_the_loss_does_not_improve(
    losses, expected
):
    # Lightning's demo transformer scales its embeddings by sqrt(200): every head near one-hot from step 0 while
    # the model learns (info); the same picture with a flat loss stays a warning
    rule = AttentionEntropyRule(warmup_steps=0)
    feed = [Measures(attention=modules(a=[0.05, 0.08]), loss=loss) for loss in losses]
    got = [rule.judge(StepContext(0, 5 * i), m) for i, m in enumerate(feed)]
    assert [(i, a.severity.value) for i, step in enumerate(got) for a in step] == expected


def test_a_head_hovering_at_the_threshold_alerts_once():
    # the nanoGPT pattern: 0.44 .. 0.54 for a long time, crossing the threshold back and forth
    hover = [0.9, 0.7, 0.55, 0.47, 0.54, 0.51, 0.44, 0.46, 0.46, 0.35, 0.45, 0.49, 0.52, 0.47, 0.48]
    losses = [0.5 - 0.02 * i for i in range(len(hover))]
    rule = AttentionEntropyRule(warmup_steps=0)
    assert severities(rule, hover, losses) == [(7, "info")]


def test_clearly_worse_alerts_again_once():
    # latched at 0.1 nats (5x past 0.5): again at 0.01 (50x, another 10x), not at 0.02
    entropies = [1.8, 0.1, 0.1, 0.05, 0.02, 0.01, 0.01, 0.005]
    rule = AttentionEntropyRule(warmup_steps=0)
    got = severities(rule, entropies, [None] * len(entropies))
    assert got == [(2, "warning"), (5, "warning")]


def test_history_and_losses_survive_a_round_trip():
    first = AttentionEntropyRule(warmup_steps=0)
    for i, (e, loss) in enumerate([(1.8, 2.0), (0.05, 2.6)]):
        first.judge(StepContext(0, i), Measures(attention=two_heads(e), loss=loss))
    second = AttentionEntropyRule(warmup_steps=0)
    second.load_state_dict(first.state_dict())
    (alert,) = second.judge(StepContext(0, 2), Measures(attention=two_heads(0.05), loss=2.7))
    assert alert.severity == "warning"  # the abrupt fall and the rising loss were remembered


def test_entropy_high_holds_its_event_while_the_batch_room_moves_around_the_bound():
    # a uniform head whose batches' sequences hold 11.6 .. 14.7 keys (the finetune corpus): 2.45 .. 2.69 nats
    rule = AttentionEntropyRule(patience=2, warmup_steps=0)
    uniforms = [2.58, 2.56, 2.59, 2.50, 2.49, 2.53, 2.55, 2.59, 2.69, 2.45, 2.53, 2.45, 2.58, 2.57]
    fired = []
    for step, u in enumerate(uniforms):
        stats = {"attn": LayerStats([u], [u], [0.0], [0.1])}
        fired += [a.rule for a in rule.judge(StepContext(0, step), Measures(attention=stats))]
    assert fired == ["attn_entropy_high"]


def test_entropy_high_clears_when_the_head_focuses_and_alerts_the_next_event():
    rule = AttentionEntropyRule(patience=2, warmup_steps=0)
    ents = [2.6, 2.6, 2.6, 1.5, 1.5, 1.5, 2.6, 2.6]  # diffuse, focused for 3 measurements, diffuse again
    fired = [
        [a.rule for a in rule.judge(StepContext(0, s), _attn(LayerStats([e], [2.6], [0.0], [0.1])))]
        for s, e in enumerate(ents)
    ]
    assert [s for s, f in enumerate(fired) if f] == [1, 7]


def test_entropy_low_hovering_around_the_bound_is_one_event():
    rule = AttentionEntropyRule(patience=2, warmup_steps=0)
    ents = [1.5, 0.45, 0.48, 0.55, 0.52, 0.58, 0.47, 0.53, 0.56, 0.49, 0.46]
    alerts = []
    for step, e in enumerate(ents):
        alerts += rule.judge(StepContext(0, step), _attn(LayerStats([e, 1.5], [2.7, 2.7], [0.0, 0.0], [0.1, 0.1])))
    assert [a.rule for a in alerts] == ["attn_entropy_low"]


def test_sink_hovering_around_its_mass_is_one_event():
    rule = AttentionSinkRule(patience=2)
    masses = [0.6, 0.6, 0.48, 0.47, 0.46, 0.6, 0.6, 0.45, 0.6]  # three below 0.5 would clear a plain latch
    fired = [
        len(rule.judge(StepContext(0, s), _attn(LayerStats([0.3], [2.7], [m], [0.13]))))
        for s, m in enumerate(masses)
    ]
    assert sum(fired) == 1
