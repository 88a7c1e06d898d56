"""Capturing scaled_dot_product_attention and eager attention softmax: every mask kind against explicit references."""

import math

import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.nn import functional as F

from lightning_diag import AttentionEntropyMonitor
from lightning_diag.instrument.attention_capture import AttentionCapture, sdpa_probabilities
from lightning_diag.instrument.attention_record import AttentionRecorder
from lightning_diag.stats.attention_probs import head_stats
from tests import launch

B, HQ, HK, L, S, E = 3, 4, 2, 6, 6, 8
LENGTHS = [6, 4, 2]  # real keys per batch row; the rest is padding
MIN = torch.finfo(torch.float32).min


def _padding() -> torch.Tensor:
    return torch.tensor([[j < n for j in range(S)] for n in LENGTHS])  # True = real key


def _masks() -> dict[str, dict]:
    pad = _padding()
    causal = torch.ones(L, S, dtype=torch.bool).tril()
    hf = (causal[None] & pad[:, None, :])[:, None]  # Hugging Face's 4-D mask: causal and padding
    bias = torch.randn(B, HQ, L, S, generator=torch.Generator().manual_seed(3))
    return {
        "none": {},
        "scale": dict(scale=0.3),
        "causal": dict(is_causal=True),
        "bool_2d": dict(attn_mask=causal),
        "bool_padding_b11s": dict(attn_mask=pad[:, None, None, :]),
        "bool_hf_4d": dict(attn_mask=hf),
        "float_inf_padding": dict(attn_mask=torch.zeros(B, 1, 1, S).masked_fill(~pad[:, None, None, :], -math.inf)),
        "float_finfo_min_hf": dict(attn_mask=torch.zeros(B, 1, L, S).masked_fill(~hf, MIN)),
        "float_bias_per_head": dict(attn_mask=bias),
        "float_bias_broadcast_3d": dict(attn_mask=bias[0, :1]),
        "gqa": dict(enable_gqa=True, heads_kv=HK),
        "gqa_causal_scale": dict(enable_gqa=True, heads_kv=HK, is_causal=True, scale=0.5),
    }


MASKS = _masks()


def _reference(q, k, attn_mask=None, is_causal=False, scale=None, enable_gqa=False):
    """Explicit softmax, the allowed keys and the valid rows, written independently of the library."""
    if enable_gqa:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scores = q @ k.transpose(-2, -1) * (scale if scale is not None else q.shape[-1] ** -0.5)
    allowed = torch.ones(q.shape[0], q.shape[1], L, S, dtype=torch.bool)
    if is_causal:
        allowed &= torch.ones(L, S, dtype=torch.bool).tril()
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            allowed &= attn_mask
        else:
            allowed &= (attn_mask > MIN / 2).expand_as(allowed)
            scores = scores + attn_mask
    probs = torch.softmax(scores.masked_fill(~allowed, -math.inf), -1).nan_to_num(0.0)
    key_valid = allowed.any(1).any(1)
    return probs, allowed, key_valid


class SdpaBlock(nn.Module):
    """A hand-written attention block calling SDPA twice (the second call is named `.call_1`)."""

    def __init__(self, kwargs):
        super().__init__()
        self.kwargs = {k: v for k, v in kwargs.items() if k != "heads_kv"}
        self.heads_kv = kwargs.get("heads_kv", HQ)

    def forward(self, q, k, v):
        out = F.scaled_dot_product_attention(q, k, v, **self.kwargs)
        again = torch._C._nn.scaled_dot_product_attention(q, k, v, **self.kwargs)
        return out + again


class Holder(nn.Module):
    def __init__(self, kwargs):
        super().__init__()
        self.block = SdpaBlock(kwargs)


def _qkv(heads_kv: int = HQ):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, HQ, L, E, generator=g) * 2
    k = torch.randn(B, heads_kv, S, E, generator=g) * 2
    v = torch.randn(B, heads_kv, S, E, generator=g)
    return q, k, v


@pytest.mark.parametrize("case", sorted(MASKS))
def test_sdpa_probabilities_match_an_explicit_softmax_and_the_call_output(case):
    kwargs = MASKS[case]
    call = {k: v for k, v in kwargs.items() if k != "heads_kv"}
    q, k, v = _qkv(kwargs.get("heads_kv", HQ))
    expected, allowed, key_valid = _reference(q, k, **call)
    probs, got_allowed, got_key_valid, query_valid = sdpa_probabilities(q, k, **call, sample_size=B, max_queries=L)
    assert torch.allclose(probs, expected, atol=1e-6)
    assert torch.equal(got_allowed.expand_as(allowed), allowed)
    assert torch.equal(got_key_valid, key_valid)
    assert torch.equal(query_valid, key_valid)  # self-attention shape: padded query rows drop out
    # The probabilities reproduce the call's own output on every row that has a visible key.
    out = F.scaled_dot_product_attention(q, k, v, **call)
    vv = v.repeat_interleave(HQ // v.shape[1], dim=1)
    rows = allowed.any(-1)
    assert torch.allclose((probs @ vv)[rows], out[rows], atol=1e-5)


@pytest.mark.parametrize("case", sorted(MASKS))
def test_capture_names_calls_and_reduces_them_like_head_stats(case):
    kwargs = MASKS[case]
    holder = Holder(kwargs)
    q, k, v = _qkv(kwargs.get("heads_kv", HQ))
    recorder = AttentionRecorder(sample_size=2, max_queries=3, special_positions=())
    capture = AttentionCapture(holder, recorder)
    capture.start()
    try:
        with torch.no_grad():
            out = holder.block(q, k, v)
    finally:
        capture.stop()
    assert sorted(recorder.stats) == ["block", "block.call_1"]
    assert not recorder.problems
    expected, allowed, key_valid = _reference(q, k, **{n: x for n, x in kwargs.items() if n != "heads_kv"})
    rows = torch.tensor([0, 2, 5])  # max_queries=3 over 6 rows, evenly spaced
    want = head_stats(expected[:2, :, rows], allowed[:2, :, rows], key_valid[:2, rows])
    causal = case in ("causal", "bool_2d", "bool_hf_4d", "float_finfo_min_hf", "gqa_causal_scale")
    for name in recorder.stats:
        assert torch.allclose(recorder.stats[name].entropy, want.entropy, atol=1e-5)
        assert torch.allclose(recorder.stats[name].uniform, want.uniform, atol=1e-6)
        assert torch.allclose(recorder.stats[name].first_mass, want.first_mass, atol=1e-5)
        assert float(recorder.stats[name].causal) == float(causal)  # read off the mask, whatever its form
    # The call ran unchanged.
    assert torch.equal(out, holder.block(q, k, v))


def test_unbatched_and_three_dimensional_inputs():
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(L, E, generator=g), torch.randn(S, E, generator=g)
    probs, *_ = sdpa_probabilities(q, k)
    assert probs.shape == (1, 1, L, S)
    assert torch.allclose(probs[0, 0], torch.softmax(q @ k.T / math.sqrt(E), -1), atol=1e-6)
    q3, k3 = torch.randn(B, L, E, generator=g), torch.randn(B, S, E, generator=g)
    mask = torch.ones(L, S, dtype=torch.bool).tril()
    probs, *_ = sdpa_probabilities(q3, k3, attn_mask=mask)
    ref = torch.softmax((q3 @ k3.transpose(1, 2) / math.sqrt(E)).masked_fill(~mask, -math.inf), -1)
    assert torch.allclose(probs[:, 0], ref, atol=1e-6)


class Eager(nn.Module):
    """nanoGPT's non-flash path: softmax over masked scores inside a module named ...Attention."""

    def forward(self, scores):
        causal = torch.ones(L, S, dtype=torch.bool).tril()
        return F.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)


class CausalSelfAttention(Eager):
    pass


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = CausalSelfAttention()
        self.head = Eager()  # not an attention module by name: its softmax is not attention
        self.mha = nn.MultiheadAttention(E, 2, batch_first=True)


def test_eager_softmax_is_seen_only_in_attention_modules_and_mha_is_left_to_its_hook():
    net = Net().train()
    recorder = AttentionRecorder(sample_size=B, max_queries=L, special_positions=())
    capture = AttentionCapture(net, recorder)
    scores = torch.randn(B, HQ, L, S) * 3
    x = torch.randn(B, L, E)
    capture.start()
    try:
        probs = net.attn(scores)
        net.head(scores)
        net.mha(x, x, x, need_weights=False)  # calls SDPA internally
    finally:
        capture.stop()
    assert sorted(recorder.stats) == ["attn"]
    allowed = torch.ones(L, S, dtype=torch.bool).tril()[None, None]
    want = head_stats(probs, allowed)
    assert torch.allclose(recorder.stats["attn"].entropy, want.entropy, atol=1e-6)
    assert torch.allclose(recorder.stats["attn"].uniform, want.uniform, atol=1e-6)


def test_a_call_the_capture_cannot_follow_is_named_once_and_runs_unchanged(monkeypatch):
    import lightning_diag.instrument.attention_capture as capture_module

    def broken(*args, **kwargs):
        raise RuntimeError("unexpected shape")

    holder = Holder({})
    recorder = AttentionRecorder(sample_size=2, max_queries=4, special_positions=())
    capture = AttentionCapture(holder, recorder)
    q, k, v = _qkv()
    monkeypatch.setattr(capture_module, "sdpa_probabilities", broken)
    capture.start()
    try:
        out = holder.block(q, k, v)
        top = F.scaled_dot_product_attention(q, k, v)  # made by no submodule: named after the root
    finally:
        capture.stop()
    assert torch.equal(out, 2 * F.scaled_dot_product_attention(q, k, v)) and torch.equal(top, out / 2)
    assert recorder.problems == {
        "block": "scaled_dot_product_attention: RuntimeError: unexpected shape",
        "Holder": "scaled_dot_product_attention: RuntimeError: unexpected shape",
    }
    assert not recorder.stats
    assert torch._C._len_torch_function_stack() == 0 and not capture.active


# -- through the Trainer: zero cost on other steps, root-level calls ------------------------------------------
class RootCaller(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(E, 3 * E)
        self.seen: list[tuple[int, int, int]] = []

    def training_step(self, batch, batch_idx):
        (x,) = batch
        self.seen.append(
            (
                self.global_step,
                torch._C._len_torch_function_stack(),
                len(torch.nn.modules.module._global_forward_pre_hooks),
            )
        )
        q, k, v = self.proj(x).reshape(x.shape[0], L, 3, 2, E // 2).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).square().mean()

    def on_after_backward(self):
        self.seen.append((self.global_step, torch._C._len_torch_function_stack(), -1))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_nothing_is_installed_on_steps_that_are_not_sampled(tmp_path):
    model = RootCaller()
    monitor = AttentionEntropyMonitor(log_every_n_steps=3)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(28, L, E)), batch_size=4)
    trainer = pl.Trainer(
        default_root_dir=tmp_path,
        max_steps=7,
        callbacks=[monitor],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, data)
    forward = [(step, modes, hooks) for step, modes, hooks in model.seen if hooks >= 0]
    assert [(step, modes > 0, hooks > 0) for step, modes, hooks in forward] == [
        (s, (s + 1) % 3 == 0, (s + 1) % 3 == 0) for s in range(7)  # sampled on the user's cadence: steps 2, 5
    ]
    assert all(modes == 0 for _, modes, hooks in model.seen if hooks < 0)  # off again before backward
    assert torch._C._len_torch_function_stack() == 0
    assert not torch.nn.modules.module._global_forward_pre_hooks
    assert not [a for a in monitor.alerts if a.severity != "info"]


class CompiledBlock(RootCaller):
    def __init__(self, how: str):
        super().__init__()
        self.attn = Holder({"is_causal": True}).block
        if how == "module":
            self.attn = torch.compile(self.attn, backend="eager")
        else:
            self.attn.compile(backend="eager")

    def training_step(self, batch, batch_idx):
        (x,) = batch
        self.seen.append((self.global_step, torch._C._len_torch_function_stack(), 0))
        q, k, v = self.proj(x).reshape(x.shape[0], L, 3, 2, E // 2).permute(2, 0, 3, 1, 4)
        return self.attn(q, k, v).square().mean()


@pytest.mark.slow
@pytest.mark.parametrize("how", ["module", "in_place"])
def test_compiled_models_train_unchanged_and_are_explained_once(how, tmp_path, caplog):
    """Under torch.compile the capture stays off (no mode, no recompilation), with one notice per fit."""
    model = CompiledBlock(how)
    monitor = AttentionEntropyMonitor(log_every_n_steps=1)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(12, L, E)), batch_size=4)
    with caplog.at_level("INFO", logger="lightning_diag"):
        pl.Trainer(
            default_root_dir=tmp_path,
            max_steps=3,
            callbacks=[monitor],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        ).fit(model, data)
    assert [modes for _, modes, hooks in model.seen if hooks >= 0] == [0, 0, 0]
    notices = [r.getMessage() for r in caplog.records if "torch.compile" in r.getMessage()]
    assert len(notices) == 1 and "not captured" in notices[0]
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_extra_head_dimensions_broadcast_like_the_call():
    """[N, G, H, L, E] queries against keys shared over G, with a mask broadcast over the heads."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 3, HK, L, E, generator=g)
    k = torch.randn(2, 1, HK, S, E, generator=g)
    v = torch.randn(2, 1, HK, S, E, generator=g)
    mask = _padding()[:2, None, None, None, :]  # [2, 1, 1, 1, S]
    probs, *_ = sdpa_probabilities(q, k, attn_mask=mask, sample_size=2, max_queries=L)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert probs.shape == (2, 3 * HK, L, S)
    assert torch.allclose(
        probs @ v.expand(2, 3, HK, S, E).reshape(2, 3 * HK, S, E), out.reshape(2, 3 * HK, L, E), atol=1e-5
    )


@pytest.mark.slow
def test_ddp_ranks_judge_the_same_averaged_sdpa_statistics(tmp_path):
    import json
    import sys
    from pathlib import Path

    script = Path(__file__).with_name("ddp_sdpa_script.py")
    proc = launch.run([sys.executable, str(script), str(tmp_path)], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert len(ranks[0]["judged"]) == 2  # steps 0 and 2
    assert ranks[0]["judged"] == ranks[1]["judged"]
    assert all(sorted(j) == [f"blocks.{i}.attn" for i in range(2)] for j in ranks[0]["judged"])
    assert len(list(tmp_path.rglob("events.out.tfevents.*"))) == 1
