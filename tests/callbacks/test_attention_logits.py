"""AttentionEntropyMonitor's ``attn_logit_growth`` (issue 45, class 7): the peak attention logit of every module,
measured from what the capture already sees, and its growth named before the entropy collapses."""

from __future__ import annotations

import math

import pytest
import pytorch_lightning as pl
import torch
from torch import nn

from lightning_diag import AttentionEntropyMonitor
from lightning_diag.demo import build_fault, run_demo
from lightning_diag.instrument.attention_capture import AttentionCapture, sdpa_probabilities
from lightning_diag.instrument.attention_record import AttentionRecorder, mha_probabilities

FAST = {
    "accelerator": "cpu",
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "enable_checkpointing": False,
    "logger": False,
    "log_every_n_steps": 5,
}


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _warnings(alerts, rule=None):
    return [a for a in alerts if a.severity != "info" and (rule is None or a.rule == rule)]


# -- the measurement: the largest |q.k| * scale among the allowed keys ----------------------------------------------
def test_sdpa_peak_is_the_largest_allowed_scaled_score():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 3, 6, 8, generator=g) * 4, torch.randn(2, 3, 6, 8, generator=g) * 4
    scores = q @ k.transpose(-2, -1) / math.sqrt(8)
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    peaks: list[torch.Tensor] = []
    sdpa_probabilities(q, k, is_causal=True, peaks=peaks)
    assert peaks[0].item() == pytest.approx(scores.masked_fill(~causal, 0).abs().max().item(), rel=1e-5)
    loud = k.clone()
    loud[:, :, 0] *= 100  # key 0 masked for every query: its huge scores do not count
    allowed = torch.ones(6, 6, dtype=torch.bool)
    allowed[:, 0] = False
    masked: list[torch.Tensor] = []
    sdpa_probabilities(q, loud, attn_mask=allowed, peaks=masked)
    assert masked[0].item() == pytest.approx(scores[..., 1:].abs().max().item(), rel=1e-5)
    scaled: list[torch.Tensor] = []
    sdpa_probabilities(q, k, scale=1.0, peaks=scaled)
    assert scaled[0].item() == pytest.approx((scores * math.sqrt(8)).abs().max().item(), rel=1e-5)


def test_mha_peak_follows_the_modules_projections_and_padding():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(16, 2, batch_first=True)
    x = torch.randn(3, 5, 16) * 3
    padding = torch.zeros(3, 5, dtype=torch.bool)
    padding[:, -1] = True
    peaks: list[torch.Tensor] = []
    mha_probabilities(mha, x, x, key_padding_mask=padding, peaks=peaks)
    w_q, w_k = mha.in_proj_weight[:16], mha.in_proj_weight[16:32]
    b_q, b_k = mha.in_proj_bias[:16], mha.in_proj_bias[16:32]
    q = (x @ w_q.T + b_q).reshape(3, 5, 2, 8).transpose(1, 2)
    k = (x @ w_k.T + b_k).reshape(3, 5, 2, 8).transpose(1, 2)
    scores = (q @ k.transpose(-2, -1) / math.sqrt(8)).detach()
    assert peaks[0].item() == pytest.approx(scores[..., :-1].abs().max().item(), rel=1e-5)



@pytest.mark.parametrize("fill", [-math.inf, torch.finfo(torch.float32).min, -1e9])
def test_mha_peak_leaves_out_keys_masked_by_any_additive_mask(fill):
    """A float causal mask of -inf, finfo.min (nn.Transformer and darts' decoders) or -1e9: the masked keys are not
    logits (a peak of 3.4e38 read the mask itself, seen on darts' TransformerModel in the calibration)."""
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(16, 2, batch_first=True)
    x = torch.randn(3, 5, 16)
    causal = torch.zeros(5, 5).masked_fill(torch.ones(5, 5, dtype=torch.bool).triu(1), fill)
    peaks: list[torch.Tensor] = []
    probs, allowed, *_ = mha_probabilities(mha, x, x, attn_mask=causal, peaks=peaks)
    w_q, w_k = mha.in_proj_weight[:16], mha.in_proj_weight[16:32]
    b_q, b_k = mha.in_proj_bias[:16], mha.in_proj_bias[16:32]
    q = (x @ w_q.T + b_q).reshape(3, 5, 2, 8).transpose(1, 2)
    k = (x @ w_k.T + b_k).reshape(3, 5, 2, 8).transpose(1, 2)
    scores = (q @ k.transpose(-2, -1) / math.sqrt(8)).detach()
    lower = torch.ones(5, 5, dtype=torch.bool).tril()
    assert peaks[0].item() == pytest.approx(scores.abs().masked_fill(~lower, 0).max().item(), rel=1e-5)
    assert not allowed[..., 0, 1:].any()  # the first query sees only the first key
    assert torch.allclose(probs.sum(-1), torch.ones(()))

class _HandWritten(nn.Module):
    """Attention written out by hand: a softmax of q @ k^T weighting the values."""

    def __init__(self) -> None:
        super().__init__()
        self.qk = nn.Linear(8, 16)

    def forward(self, x):
        q, k = self.qk(x).chunk(2, -1)
        scores = q @ k.transpose(-2, -1) * 0.5
        self.last_scores = scores.detach()
        return scores.softmax(-1) @ x


class _Sdpa(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qk = nn.Linear(8, 16)

    def forward(self, x):
        q, k = self.qk(x).chunk(2, -1)
        self.last_scores = (q @ k.transpose(-2, -1) / math.sqrt(8)).detach()
        return nn.functional.scaled_dot_product_attention(q[:, None], k[:, None], x[:, None])[:, 0]


@pytest.mark.parametrize("module", [_HandWritten, _Sdpa])
def test_the_capture_records_each_modules_peak(module):
    torch.manual_seed(0)
    net = nn.Sequential(module())
    recorder = AttentionRecorder(sample_size=8, max_queries=64, special_positions=(0,))
    capture = AttentionCapture(net, recorder)
    capture.start()
    with torch.no_grad():
        net(torch.randn(2, 5, 8))
    capture.stop()
    assert list(recorder.logit_peaks) == ["0"]
    assert recorder.logit_peaks["0"].item() == pytest.approx(net[0].last_scores.abs().max().item(), rel=1e-5)


# -- the fault and its healthy twin ---------------------------------------------------------------------------------
def test_logit_growth_oracle_the_fault_grows_the_logits_and_its_twin_does_not(tmp_path):
    peaks: dict[str, list[float]] = {}
    for name in ("attn_logit_growth", "healthy_qk_norm"):
        model, data, _ = build_fault(name)
        seen: list[float] = []

        def spy(module, args, output, seen=seen, model=model):
            if module.training and model.global_step % 5 == 4:
                x = args[0]
                b, t, d = x.shape
                q, k, _ = module.qkv(x).reshape(b, t, 3, module.heads, d // module.heads).permute(2, 0, 3, 1, 4)
                q, k = module.q_norm(q), module.k_norm(k)
                scores = (q @ k.transpose(-2, -1)) / math.sqrt(d // module.heads)
                causal = torch.ones(t, t, dtype=torch.bool).tril()
                seen.append(float(scores.detach().masked_fill(~causal, 0).abs().max()))

        model.blocks[0].attn.register_forward_hook(spy)
        pl.seed_everything(0, verbose=False)
        pl.Trainer(max_steps=20, default_root_dir=tmp_path, deterministic=True, **FAST).fit(model, datamodule=data)
        peaks[name] = seen
    assert peaks["attn_logit_growth"][-1] > 100 > 20 > max(peaks["healthy_qk_norm"])


def test_logit_growth_is_named_before_the_entropy_collapses(tmp_path):
    result = run_demo("attn_logit_growth", root=str(tmp_path))
    growth = _warnings(result.alerts, "attn_logit_growth")
    collapse = _warnings(result.alerts, "attn_entropy_low")
    assert [(a.global_step, a.source) for a in growth][:1] == [(9, "blocks.0.attn")]  # the second measurement
    assert collapse and growth[0].global_step < collapse[0].global_step
    assert growth[0].value > 50 and "qk-layernorm" in growth[0].message


def test_qk_norm_twin_stays_quiet_with_its_margin(tmp_path):
    monitor = AttentionEntropyMonitor()
    result = run_demo("healthy_qk_norm", root=str(tmp_path), callbacks=[monitor])
    assert [a.format() for a in _warnings(result.alerts)] == []
    assert 0 < monitor.logit_rule.peaks["attn_logit_growth"] < 0.5  # a peak logit below 25
    assert set(monitor.logit_rule.history) == {"blocks.0.attn", "blocks.1.attn"}


def test_state_survives_a_resume(tmp_path):
    model, data, _ = build_fault("attn_logit_growth")
    monitor = AttentionEntropyMonitor(rules={"attn_logit_growth": {"threshold": 1e6}})
    trainer = pl.Trainer(max_steps=10, default_root_dir=tmp_path, callbacks=[monitor], **FAST)
    trainer.fit(model, datamodule=data)
    ckpt = tmp_path / "mid.ckpt"
    trainer.save_checkpoint(ckpt)
    before = {k: list(v) for k, v in monitor.logit_rule.history.items()}
    assert before and all(len(v) == 2 for v in before.values())

    model2, data2, _ = build_fault("attn_logit_growth")
    resumed = AttentionEntropyMonitor(rules={"attn_logit_growth": {"threshold": 1e6}})
    pl.Trainer(max_steps=10, default_root_dir=tmp_path, callbacks=[resumed], **FAST).fit(
        model2, datamodule=data2, ckpt_path=str(ckpt)
    )
    assert resumed.logit_rule.history == before and resumed.logit_rule.first == monitor.logit_rule.first
