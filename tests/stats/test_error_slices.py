"""Slice search (stats.error_slices, stats.error_clusters): features, the test against scipy's Fisher exact test,
the correction and quiet uniform noise."""

import math

import numpy as np
import pytest
from scipy.stats import fisher_exact

from lightning_diag.rules.errors import ErrorClusterRule
from lightning_diag.stats.error_clusters import embedding_clusters
from lightning_diag.stats.error_slices import (
    find_slices,
    stack_features,
    token_features,
    value_features,
)
from lightning_diag.stats.slice_groups import find_groups


def test_token_features_are_presence_of_unigrams_and_bigrams_with_support():
    f = token_features([np.array([5, 6, 5, 6]), np.array([6, 7]), np.array([5, 6])], min_count=2)
    assert f.names == ["5", "6", "5 6"]  # "7", "6 5", "6 7" are held by one sample only
    assert f.members.toarray().tolist() == [[1, 1, 1], [0, 1, 0], [1, 1, 1]]  # presence, not counts


def test_token_features_ignore_negative_ids_and_empty_samples():
    f = token_features([np.array([-100, 3]), np.array([], dtype=int)])
    assert f.names == ["3"] and f.members.shape == (2, 1)


@pytest.mark.parametrize("seed", range(5))
def test_p_values_are_scipys_one_sided_fisher_exact_test(seed):
    rng = np.random.default_rng(seed)
    n = 300
    wrong = rng.random(n) < 0.2
    groups = rng.integers(0, 4, n)
    wrong[groups == 0] |= rng.random(n)[groups == 0] < 0.3  # group 0 fails more
    f = value_features(groups.tolist(), "g")
    slices, tested = find_slices(f, wrong.astype(float), wrong, min_count=10)
    assert tested == 4
    for s in slices:
        inside = groups == int(s.features[0].split("=")[1])
        table = [[int((wrong & inside).sum()), int((~wrong & inside).sum())],
                 [int((wrong & ~inside).sum()), int((~wrong & ~inside).sum())]]
        expected = fisher_exact(table, alternative="greater")[1]
        assert s.p_value == pytest.approx(expected, rel=1e-6)
        assert s.p_adjusted == pytest.approx(min(1.0, expected * tested), rel=1e-6)
        assert s.error_rate == pytest.approx(wrong[inside].mean())
        assert s.rest_error_rate == pytest.approx(wrong[~inside].mean())
        assert s.lift == pytest.approx(wrong[inside].mean() / wrong.mean())
        assert s.error_rate > s.rest_error_rate  # only slices worse than the rest are returned


def test_support_bounds_the_slices_tested_and_identical_sample_sets_are_one_slice():
    wrong = np.array([1] * 6 + [0] * 14, dtype=bool)
    f = stack_features([value_features(["a"] * 6 + ["b"] * 14, "x"), value_features(["p"] * 6 + ["q"] * 14, "y"),
                        value_features(["r"] * 2 + ["s"] * 18, "z")])
    slices, tested = find_slices(f, wrong.astype(float), wrong, min_count=3)
    # x=a and y=p hold the same samples (one slice), x=b and y=q too; z=r has 2 samples, z=s leaves 2 outside
    assert tested == 2
    assert [s.features for s in slices] == [("x=a", "y=p")]


def test_uniform_noise_yields_no_significant_slice():
    """Errors independent of the features: across 100 random validation sets, the corrected test at 0.01 finds
    nothing (the family-wise error rate is at most 0.01 by construction), and no slice reaches a lift of 3."""
    rng = np.random.default_rng(1)
    significant = big_lift = 0
    for _ in range(100):
        n = 1000
        seqs = [rng.zipf(1.3, 20) % 300 for _ in range(n)]
        wrong = rng.random(n) < 0.1
        f = stack_features([token_features(seqs, 50), value_features(rng.integers(0, 3, n).tolist(), "label")])
        slices, tested = find_slices(f, wrong.astype(float), wrong, min_count=50)
        assert tested > 20
        significant += any(s.p_adjusted <= 0.01 for s in slices)
        big_lift += any(s.lift >= 3 for s in slices)
    assert significant <= 3 and big_lift == 0


def test_embedding_clusters_give_a_small_hard_region_its_own_slice():
    rng = np.random.default_rng(0)
    easy = rng.normal(0, 1, (540, 4))
    hard = rng.normal(0, 0.3, (60, 4)) + np.array([4, 4, 0, 0])  # 10% of the samples, in their own region
    x = np.concatenate([easy, hard])
    wrong = np.concatenate([rng.random(540) < 0.05, rng.random(60) < 0.6])
    f = embedding_clusters(x, wrong, k_range=(2, 5))
    assert f is not None and all(n.startswith("embedding=k") for n in f.names)
    assert len(f.names) == 2 + 3 + 4 + 5
    slices, _ = find_slices(f, wrong.astype(float), wrong, min_count=30)
    best = next(s for s in slices if ErrorClusterRule().qualifies(s))  # the most significant that qualifies
    assert abs(best.size - 60) <= 5 and best.lift >= 3


def _markers(n=600, markers=8, per=10, rate=0.7, seed=0):
    """``markers`` tags of ``per`` samples each (``tag=m<i>``, the hard group) failing at ``rate``, 5% elsewhere."""
    rng = np.random.default_rng(seed)
    tag = [f"m{i % markers}" if i < markers * per else None for i in range(n)]
    hard = np.arange(n) < markers * per
    wrong = np.where(hard, rng.random(n) < rate, rng.random(n) < 0.05)
    return tag, hard, wrong


def test_disjoint_markers_too_small_to_be_slices_are_one_disjunction_with_the_union_numbers():
    tag, hard, wrong = _markers()
    words = value_features(rng_words(len(tag)), "word")
    f = stack_features([value_features(tag, "tag"), words])
    singles, _ = find_slices(f, wrong.astype(float), wrong, min_count=30)
    assert not any(s.features[0].startswith("tag=") for s in singles)  # each marker (10 samples) is below support
    groups = find_groups(f, wrong.astype(float), wrong, min_count=30, ratio=3.0, member_min=5)
    [group] = [g for g in groups.findings if ErrorClusterRule().qualifies(g)]
    assert group.kind == "disjunction"
    assert sorted(m.features[0] for m in group.members) == [f"tag=m{i}" for i in range(8)]
    assert group.size == 80 == hard.sum() and group.share == group.union_share == pytest.approx(80 / 600)
    assert group.error_rate == group.union_error_rate == pytest.approx(wrong[hard].mean())
    assert group.rest_error_rate == pytest.approx(wrong[~hard].mean())
    table = [[int((wrong & hard).sum()), int((~wrong & hard).sum())],
             [int((wrong & ~hard).sum()), int((~wrong & ~hard).sum())]]
    assert group.p_value == pytest.approx(fisher_exact(table, alternative="greater")[1], rel=1e-6)
    # weighted Bonferroni over every union of m of the P candidates: p * C(P, m) * m (m + 1)
    p_count, m = groups.hypotheses, len(group.members)
    assert groups.hypotheses == groups.candidates + groups.conjunctions > 8
    assert group.p_adjusted == pytest.approx(group.p_value * math.comb(p_count, m) * m * (m + 1), rel=1e-6)


def rng_words(n, seed=5):
    """An unrelated field: one of 12 words per sample."""
    return [f"w{i}" for i in np.random.default_rng(seed).integers(0, 12, n).tolist()]


def test_an_unrelated_failing_field_value_stays_a_separate_finding():
    tag, _, wrong = _markers()
    n = len(tag)
    source = np.where(np.arange(n) >= n - 60, "forum", "news")
    wrong = wrong | ((np.arange(n) >= n - 60) & (np.random.default_rng(3).random(n) < 0.6))
    f = stack_features([value_features(tag, "tag"), value_features(source.tolist(), "source")])
    groups = find_groups(f, wrong.astype(float), wrong, min_count=30, ratio=2.5, member_min=5)
    found = [g for g in groups.findings if ErrorClusterRule(ratio=2.5).qualifies(g)]
    assert sorted(g.kind for g in found) == ["disjunction", "slice"]
    forum = next(g for g in found if g.kind == "slice")
    assert forum.features == ("source=forum",) and forum.size == 60


def test_two_features_that_fail_only_together_are_a_conjunction():
    rng = np.random.default_rng(2)
    n = 800
    a, b = rng.random(n) < 0.5, rng.random(n) < 0.5
    wrong = np.where(a & b, rng.random(n) < 0.6, rng.random(n) < 0.05)
    f = stack_features([value_features(np.where(a, "x", "y").tolist(), "a"),
                        value_features(np.where(b, "web", "news").tolist(), "source")])
    singles, _ = find_slices(f, wrong.astype(float), wrong, min_count=40)
    assert all(s.lift < 3 for s in singles)  # neither feature qualifies alone
    groups = find_groups(f, wrong.astype(float), wrong, min_count=40, ratio=3.0)
    assert groups.conjunctions >= 4  # a=x & source=web, a=x & source=news, ...: every eligible pair is counted
    [group] = [g for g in groups.findings if ErrorClusterRule().qualifies(g)]
    assert group.kind == "conjunction" and group.features[0] == "a=x & source=web"
    assert group.size == int((a & b).sum()) and group.lift >= 3


@pytest.mark.slow
def test_uniform_noise_yields_no_significant_group_after_the_correction():
    """Errors independent of the features (tokens, two fields): across 40 random validation sets, the greedy union
    finds chance groups whose own p-value is below 0.01 in most sets, but the corrected p-value of a group is
    within 0.01 at most twice (the family-wise level allows 0.4), and none qualifies for error_cluster."""
    rng = np.random.default_rng(4)
    rule = ErrorClusterRule()
    raw = corrected = qualifying = 0
    for _ in range(40):
        n = 600
        seqs = [rng.zipf(1.3, 12) % 200 for _ in range(n)]
        wrong = rng.random(n) < 0.12
        f = stack_features([token_features(seqs, 5), value_features(rng.integers(0, 8, n).tolist(), "source"),
                            value_features(rng.integers(0, 3, n).tolist(), "label")])
        groups = find_groups(f, wrong.astype(float), wrong, min_count=30, ratio=3.0, member_min=5)
        assert groups.conjunctions > 0 and groups.candidates > 50
        raw += any(g.p_value <= 0.01 for g in groups.findings)
        corrected += any(g.p_adjusted <= 0.01 for g in groups.findings)
        qualifying += any(rule.qualifies(g) for g in groups.findings)
    assert raw >= 20 and corrected <= 2 and qualifying == 0
