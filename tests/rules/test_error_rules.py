"""error_cluster (rules.errors): which groups qualify, the level spent over validations, the message."""

from types import SimpleNamespace

import pytest

from lightning_diag.rules.base import StepContext
from lightning_diag.rules.errors import ErrorClusterRule, describe_members, token_ranges
from lightning_diag.rules.measures import ErrorGroups, Measures


def _groups(groups, overall_rate, **parts):
    """The measures of one error analysis: its candidate `groups` and the overall error rate."""
    return Measures(error_groups=ErrorGroups(groups, overall_rate, **parts))

def group(**changes):
    values = dict(features=("7", "7 9", "label=1"), size=140, share=0.14, error_rate=0.51, rest_error_rate=0.04,
                  lift=4.9, p_adjusted=1e-30, majority_label=1, majority_prediction=0)
    return SimpleNamespace(**{**values, **changes})


@pytest.mark.parametrize(
    ("changes", "qualifies"),
    [
        ({}, True),
        ({"share": 0.049}, False),  # below min_share
        ({"lift": 2.99}, False),  # below ratio
        ({"p_adjusted": 0.006}, False),  # above the first validation's level, 0.01 / 2
        ({"p_adjusted": 0.005}, True),
    ],
)
def test_a_group_qualifies_on_share_lift_and_corrected_p(changes, qualifies):
    assert ErrorClusterRule().qualifies(group(**changes)) is qualifies


def test_the_level_is_spent_over_the_validations_of_a_fit():
    rule = ErrorClusterRule(alpha=0.01)
    assert sum(rule.level(v) for v in range(1, 10_000)) == pytest.approx(0.01, rel=1e-3)
    borderline = group(p_adjusted=0.003)
    assert rule.qualifies(borderline, analysis=1) and not rule.qualifies(borderline, analysis=2)
    assert rule.qualifies(group(), analysis=1000)  # a real group's p-value is far below any of them


def test_the_message_names_features_size_rates_lift_and_p_worst_first():
    rule = ErrorClusterRule()
    weaker = group(features=("source=forum",), share=0.06, size=60, lift=3.5, p_adjusted=1e-5)
    [alert] = rule.judge(StepContext(0, 10), _groups([weaker, group()], 0.105, decode=lambda f: f"<{f}>"))
    message = alert.message
    assert message.startswith("2 group(s) of validation samples fail far more often than the rest (overall error "
                              "rate 10.5%): samples with token 7 ('<7>'), tokens '7 9' ('<7 9>'), label=1: 140 "
                              "samples (14%), error rate 51.0% against 4.0% for the rest (4.9x overall), p = 1e-30 "
                              "corrected, mostly label 1 predicted as 0; samples with source=forum")
    assert alert.value == pytest.approx(4.9) and alert.threshold == 3.0
    assert rule.judge(StepContext(0, 20), _groups([group()], 0.105)) == []  # latched
    assert rule.judge(StepContext(0, 30), _groups([group(lift=1.0)], 0.105)) == []  # cleared
    assert len(rule.judge(StepContext(0, 40), _groups([group()], 0.105))) == 1  # a new event


def member(name, size=14):
    return SimpleNamespace(features=(name,), size=size, share=size / 1000, error_rate=0.5, lift=4.0, wrong=7,
                           p_value=1e-4)


def test_token_ranges_are_compact():
    assert token_ranges([189, 180, 181, 182, 183, 184, 185, 186, 187, 188]) == "180–189"
    assert token_ranges([7, 9, 10, 12, 13, 14, 3]) == "3, 7, 9, 10, 12–14"


def test_a_disjunction_is_described_by_token_ranges_and_other_members_with_the_union_numbers():
    members = (*(member(str(t)) for t in (181, 180, 182, 183, 184, 185, 186, 187, 188, 189)), member("source=forum"))
    g = group(features=tuple(m.features[0] for m in members), kind="disjunction", members=members, size=150,
              share=0.15, error_rate=0.45, alternates=("180 181",))
    assert describe_members(g) == "holding any of tokens 180–189, source=forum (also tokens '180 181')"
    [alert] = ErrorClusterRule().judge(StepContext(0, 10), _groups([g], 0.1))
    assert ("samples holding any of tokens 180–189, source=forum (also tokens '180 181'): 150 samples (15%), error "
            "rate 45.0% against 4.0% for the rest (4.9x overall), p = 1e-30 corrected, 11 slices that fail "
            "together") in alert.message


def test_a_conjunction_and_a_single_slice_are_described_by_their_features():
    conj = group(features=("5 & source=web",), kind="conjunction", members=(member("5 & source=web"),))
    assert describe_members(conj, decode=lambda f: f"<{f}>") == "with token 5 ('<5>') and source=web"
    assert describe_members(group()) == "with token 7, tokens '7 9', label=1"  # kind "slice" (and older groups)
