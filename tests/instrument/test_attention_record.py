"""Getting attention probabilities: MultiheadAttention recomputation, the explicit API, the Hugging Face adapter."""

import math

import pytest
import torch
from torch import nn

from lightning_diag.instrument.attention_record import (
    AttentionRecorder,
    attention_requested,
    mha_probabilities,
    record_attention,
    record_hf_attentions,
)

B, L, S, E, H = 3, 5, 7, 8, 2


def _lengths_mask(lengths, width):
    return torch.tensor([[i >= n for i in range(width)] for n in lengths])  # True = padding


CASES = {
    "batch_first": dict(module=dict(batch_first=True), self_attention=True),
    "seq_first": dict(module=dict(batch_first=False), self_attention=True),
    "bool_padding": dict(module=dict(batch_first=True), self_attention=True, kpm="bool"),
    "float_padding": dict(module=dict(batch_first=True), self_attention=True, kpm="float"),
    "bool_causal_mask": dict(module=dict(batch_first=True), self_attention=True, attn="bool2d", kpm="bool"),
    "float_3d_mask": dict(module=dict(batch_first=True), self_attention=True, attn="float3d"),
    "cross_attention_kdim": dict(module=dict(batch_first=True, kdim=6, vdim=6), self_attention=False, kpm="bool"),
    "bias_kv_zero_attn": dict(
        module=dict(batch_first=True, add_bias_kv=True, add_zero_attn=True), self_attention=True, kpm="bool"
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_recomputed_probabilities_match_the_module(case):
    spec = CASES[case]
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(E, H, **spec["module"]).eval()
    batch_first = spec["module"]["batch_first"]
    x = torch.randn(B, L, E)
    src_len = L if spec["self_attention"] else S
    kv = x if spec["self_attention"] else torch.randn(B, S, spec["module"].get("kdim", E))
    kpm = None
    if spec.get("kpm"):
        kpm = _lengths_mask([src_len, src_len - 2, 2], src_len)
        if spec["kpm"] == "float":
            kpm = torch.zeros(B, src_len).masked_fill(kpm, -math.inf)
    attn = None
    if spec.get("attn") == "bool2d":
        attn = torch.ones(L, src_len, dtype=torch.bool).triu(1)
    elif spec.get("attn") == "float3d":
        attn = torch.randn(B * H, L, src_len)
    q, k = (x, kv) if batch_first else (x.transpose(0, 1), kv.transpose(0, 1))
    if spec["self_attention"]:
        k = q
    _, expected = mha(q, k, k, key_padding_mask=kpm, attn_mask=attn, need_weights=True, average_attn_weights=False)
    probs, _, key_valid, query_valid = mha_probabilities(mha, q, k, kpm, attn, sample_size=B, max_queries=L)
    assert probs.shape == expected.shape
    assert torch.allclose(probs, expected.nan_to_num(0.0), atol=1e-6)
    assert (query_valid is not None) == spec["self_attention"]
    if kpm is not None:
        assert key_valid.sum(-1).tolist() == [src_len, src_len - 2, 2]


def test_unbatched_input_and_subsampling():
    torch.manual_seed(1)
    mha = nn.MultiheadAttention(E, H).eval()
    x = torch.randn(L, E)
    _, expected = mha(x, x, x, need_weights=True, average_attn_weights=False)
    probs, *_ = mha_probabilities(mha, x, x, sample_size=4, max_queries=L)
    assert torch.allclose(probs[0], expected, atol=1e-6)
    xb = torch.randn(6, 40, E)
    mha.batch_first = True
    probs, _, _, query_valid = mha_probabilities(mha, xb, xb, sample_size=2, max_queries=8)
    assert probs.shape == (2, H, 8, 40) and query_valid.shape == (2, 8)


def test_explicit_api_is_a_no_op_unless_a_recorder_is_active():
    probs = torch.full((2, 1, 3, 3), 1 / 3)
    assert not attention_requested()
    record_attention(probs, "custom")  # nothing to feed: no error, nothing kept
    rec = AttentionRecorder(8, 64, (0, -1))
    rec.activate()
    try:
        assert attention_requested()
        record_attention(probs, "custom", attention_mask=torch.tensor([[1, 1, 0], [1, 1, 1]]))
        record_attention(probs, "custom")  # a second call in the same step is ignored
    finally:
        rec.deactivate()
    assert not attention_requested()
    stats = rec.stats["custom"]
    # sequence 0 has 2 real tokens (its padded query row is left out): 2 + 3 rows
    assert stats.rows.item() == 5.0
    assert stats.entropy.item() == pytest.approx(math.log(2) * 2 / 5 + math.log(3) * 3 / 5, abs=1e-5)


def test_explicit_api_causal_reference_and_bad_input():
    rec = AttentionRecorder(8, 64, (0,))
    rec.activate()
    try:
        lower = torch.tril(torch.ones(4, 4))
        record_attention((lower / lower.sum(-1, keepdim=True))[None, None], "causal", causal=True)
        record_attention(torch.ones(4), "broken")
    finally:
        rec.deactivate()
    stats = rec.stats["causal"]
    expected = sum(math.log(i) for i in range(1, 5)) / 4
    assert stats.entropy.item() == pytest.approx(expected, abs=1e-6)
    assert stats.uniform.item() == pytest.approx(expected, abs=1e-6)  # causal rows are uniform over what they see
    assert "broken" in rec.problems and "broken" not in rec.stats


def test_hugging_face_adapter_on_a_model_built_from_a_config():
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        vocab_size=30,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=32,
        attention_probs_dropout_prob=0.0,
        hidden_dropout_prob=0.0,
        attn_implementation="eager",
    )
    model = transformers.BertModel(config, add_pooling_layer=False).eval()
    ids = torch.randint(3, 30, (2, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
    rec = AttentionRecorder(8, 64, (0, -1))
    rec.activate()
    try:
        out = model(ids, attention_mask=mask, output_attentions=attention_requested())
        record_hf_attentions(out.attentions, "bert", attention_mask=mask)
        record_hf_attentions((), "empty")
    finally:
        rec.deactivate()
    assert sorted(rec.stats) == ["bert.layer_0", "bert.layer_1"]
    stats = rec.stats["bert.layer_0"]
    assert stats.rows.tolist() == [10.0, 10.0]  # 6 + 4 real query rows
    # padded keys carry no mass: the ceiling is ln 6 for 6 rows and ln 4 for 4 rows
    assert stats.uniform[0].item() == pytest.approx((6 * math.log(6) + 4 * math.log(4)) / 10, abs=1e-5)
    assert "attn_implementation" in rec.problems["empty"]
