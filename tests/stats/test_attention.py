import math

import numpy as np
import pytest
import scipy.stats
import torch

from lightning_diag.stats.attention_probs import head_pca, head_similarity, head_stats, row_entropy, special_key_mask


@pytest.mark.parametrize("n", [1, 2, 5, 12, 128])
def test_uniform_attention_has_ln_n_nats_and_one_hot_has_zero(n):
    uniform = torch.full((2, 3, 4, n), 1.0 / n)
    stats = head_stats(uniform)
    assert torch.allclose(stats.entropy, torch.full((3,), math.log(n)), atol=1e-5)
    assert torch.allclose(stats.uniform, torch.full((3,), math.log(n)), atol=1e-5)
    one_hot = torch.zeros(2, 3, 4, n)
    one_hot[..., n - 1] = 1.0
    assert torch.equal(head_stats(one_hot).entropy, torch.zeros(3))


@pytest.mark.parametrize("seed", range(5))
def test_row_entropy_matches_scipy(seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(6, 9, generator=g) * (1 + seed)
    # Softmax in float64: a float32 row sums to 1 only within ~1e-7, and how far off depends on the CPU's kernels,
    # while scipy renormalises every row; the comparison must test the entropy, not the machine's rounding.
    p = torch.softmax(logits.double(), -1)
    expected = [scipy.stats.entropy(row) for row in p.numpy()]
    assert np.allclose(row_entropy(p).numpy(), expected, atol=1e-10)


def test_head_stats_match_brute_force_with_padding():
    g = torch.Generator().manual_seed(1)
    b, h, s = 3, 2, 6
    lengths = [6, 4, 2]
    valid = torch.tensor([[i < n for i in range(s)] for n in lengths])
    scores = torch.randn(b, h, s, s, generator=g).masked_fill(~valid[:, None, None, :], -math.inf)
    probs = torch.softmax(scores, -1)
    special = special_key_mask(valid, positions=(0, -1))
    stats = head_stats(probs, valid[:, None, None, :], valid, special)
    for head in range(h):
        ents, unis, masses, shares = [], [], [], []
        for i, n in enumerate(lengths):
            for q in range(n):
                row = probs[i, head, q, :n].double().numpy()
                ents.append(scipy.stats.entropy(row))
                unis.append(math.log(n))
                spec = sorted({0, n - 1})
                masses.append(row[spec].sum())
                shares.append(len(spec) / n)
        assert stats.entropy[head].item() == pytest.approx(np.mean(ents), abs=1e-5)
        assert stats.uniform[head].item() == pytest.approx(np.mean(unis), abs=1e-5)
        assert stats.special_mass[head].item() == pytest.approx(np.mean(masses), abs=1e-5)
        assert stats.special_share[head].item() == pytest.approx(np.mean(shares), abs=1e-5)
    assert stats.rows.tolist() == [12.0, 12.0]


def test_padded_query_rows_and_dead_rows_are_left_out():
    probs = torch.full((1, 1, 3, 4), 0.25)
    probs[0, 0, 2] = math.nan  # a non-finite row
    query_valid = torch.tensor([[True, False, True]])
    stats = head_stats(probs, query_valid=query_valid)
    assert stats.rows.item() == 1.0
    assert stats.entropy.item() == pytest.approx(math.log(4))
    empty = head_stats(torch.zeros(1, 2, 3, 4))
    assert empty.rows.tolist() == [0.0, 0.0] and torch.equal(empty.entropy, torch.zeros(2))


def test_rows_are_renormalised_over_allowed_keys():
    # dropout-scaled weights (sum 1.25) and mass leaking onto a masked key are judged by their shape
    probs = torch.tensor([[[[0.625, 0.625, 0.3]]]])
    allowed = torch.tensor([True, True, False])
    assert head_stats(probs, allowed).entropy.item() == pytest.approx(math.log(2), abs=1e-6)


def test_special_key_mask_positions_and_ids():
    valid = torch.tensor([[True, True, True, True, False], [True, True, False, False, False]])
    ids = torch.tensor([[101, 7, 102, 9, 0], [101, 102, 0, 0, 0]])
    assert special_key_mask(valid, (0, -1)).int().tolist() == [[1, 0, 0, 1, 0], [1, 1, 0, 0, 0]]
    assert special_key_mask(valid, (), ids, (102,)).int().tolist() == [[0, 0, 1, 0, 0], [0, 1, 0, 0, 0]]
    assert special_key_mask(valid, (1,)).int().tolist() == [[0, 1, 0, 0, 0], [0, 1, 0, 0, 0]]


def test_head_similarity_matches_numpy_corrcoef():
    g = torch.Generator().manual_seed(3)
    maps = torch.rand(5, 40, generator=g)
    assert np.allclose(head_similarity(maps).numpy(), np.corrcoef(maps.numpy()), atol=1e-5)
    constant = torch.cat([maps[:2], torch.ones(1, 40)])
    corr = head_similarity(constant)
    assert corr[2].tolist() == [0.0, 0.0, 1.0] and torch.isfinite(corr).all()


def test_head_pca_matches_numpy_svd_up_to_sign():
    g = torch.Generator().manual_seed(4)
    maps = torch.rand(6, 30, generator=g, dtype=torch.float64)
    x = maps.numpy() - maps.numpy().mean(0)
    u, s, _ = np.linalg.svd(x, full_matrices=False)
    expected = u[:, :2] * s[:2]
    got = head_pca(maps).numpy()
    assert np.allclose(np.abs(got), np.abs(expected), atol=1e-5)
    assert head_pca(maps[:1]).tolist() == [[0.0, 0.0]]


def test_causal_is_read_off_the_visible_key_counts():
    causal = torch.ones(5, 5, dtype=torch.bool).tril()
    probs = torch.softmax(torch.randn(2, 2, 5, 5).masked_fill(~causal, -math.inf), -1)
    assert float(head_stats(probs, causal[None, None]).causal) == 1.0
    # left padding, with the fully padded rows un-masked (as Hugging Face does for SDPA): still causal
    padded = causal[None].repeat(2, 1, 1)
    padded[1, :, :2] = False
    padded[1, :2] = True
    valid = torch.tensor([[True] * 5, [False, False, True, True, True]])
    assert float(head_stats(probs, padded[:, None], valid).causal) == 1.0
    # bidirectional with padding, cross-attention, one query row: not causal
    pad = torch.tensor([[True] * 5, [True, True, True, False, False]])[:, None, None, :]
    assert float(head_stats(torch.full((2, 2, 5, 5), 0.2), pad).causal) == 0.0
    assert float(head_stats(torch.full((2, 2, 3, 5), 0.2)).causal) == 0.0
    assert float(head_stats(torch.full((2, 2, 1, 5), 0.2)).causal) == 0.0


def test_first_key_mass_and_key_coverage():
    n = 6
    sink = torch.zeros(1, 1, n, n)
    sink[..., 0] = 1.0  # every query on the first key
    reversal = torch.eye(n).flip(-1)[None, None]  # each query on its own key
    stats = head_stats(torch.cat([sink, reversal], 1))
    assert torch.allclose(stats.first_mass, torch.tensor([1.0, 1.0 / n]))
    assert torch.allclose(stats.coverage, torch.tensor([0.0, 1.0]), atol=1e-6)
    assert torch.equal(stats.entropy, torch.zeros(2))  # the same entropy: coverage tells them apart
    # the first *visible* key of each row, and coverage over at most min(rows, keys)
    window = torch.ones(n, n, dtype=torch.bool).tril() & ~torch.ones(n, n, dtype=torch.bool).tril(-3)
    onto_first = torch.zeros(1, 1, n, n).scatter(-1, window.float().argmax(-1).view(1, 1, n, 1), 1.0)
    assert torch.allclose(head_stats(onto_first, window[None, None]).first_mass, torch.ones(1))
    rows = torch.eye(n)[None, None, :3]  # 3 queries on 3 different keys out of 6
    assert torch.allclose(head_stats(rows).coverage, torch.ones(1), atol=1e-6)
