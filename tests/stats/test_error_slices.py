"""Slice search (stats.error_slices, stats.error_clusters): features, the test against scipy's Fisher exact test,
the correction, merging, and quiet uniform noise."""

import numpy as np
import pytest
from scipy.stats import fisher_exact

from lightning_diag.rules.errors import ErrorClusterRule
from lightning_diag.stats.error_clusters import embedding_clusters
from lightning_diag.stats.error_slices import (
    find_slices,
    merge_slices,
    stack_features,
    token_features,
    value_features,
)


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


def test_merge_joins_overlapping_slices_and_keeps_distinct_groups_apart():
    n = 400
    rng = np.random.default_rng(0)
    hard_a = np.arange(n) < 40  # two hard groups of 40, each with two tokens nearly always present
    hard_b = (np.arange(n) >= 40) & (np.arange(n) < 80)
    wrong = (hard_a | hard_b) & (rng.random(n) < 0.8) | (rng.random(n) < 0.03)
    seqs = []
    for i in range(n):
        s = list(rng.integers(100, 200, 8))
        if hard_a[i]:
            s += [1, 50] if i % 10 else [1]  # token 50 is missing from a tenth of group a
        if hard_b[i]:
            s += [2, 60]
        seqs.append(np.array(s))
    f = token_features(seqs, min_count=20)
    slices, _ = find_slices(f, wrong.astype(float), wrong, min_count=20)
    rule = ErrorClusterRule()
    findings = merge_slices(slices, f, wrong, keep=rule.qualifies)
    assert len(findings) == 2
    assert sorted(sorted(m.features) for m in findings) == [["1", "1 50", "50"], ["2", "2 60", "60"]]
    assert [m.slices for m in findings if "1" in m.features] == [2]  # "1"; "50" and "1 50" (the same samples)
    assert sorted(m.size for m in findings) == [40, 40]


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
    best = merge_slices(slices, f, wrong, keep=ErrorClusterRule().qualifies)[0]
    assert abs(best.size - 60) <= 5 and best.lift >= 3
