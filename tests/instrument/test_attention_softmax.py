"""Hand-written attention (softmax over q @ k^T whose output weights values) is seen, exact and named; softmaxes
that are not attention (a router over experts, a classifier over classes, a loss) are not."""

import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from lightning_diag.callbacks.attention_entropy.measure import no_attention_message
from lightning_diag.instrument.attention_capture import AttentionCapture
from lightning_diag.instrument.attention_record import AttentionRecorder

B, T, D, H = 3, 7, 16, 4
HD = D // H


def _split(x: torch.Tensor) -> torch.Tensor:
    """[B, T, D] -> [B, H, T, HD]."""
    return x.view(x.shape[0], x.shape[1], H, HD).transpose(1, 2)


class _Base(nn.Module):
    """q, k, v projections; ``used`` keeps the probabilities the forward used, [B, H, T, S] (test-only)."""

    def __init__(self, n_head: int | None = H) -> None:
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)
        self.proj = nn.Linear(D, D)
        if n_head is not None:
            self.n_head = n_head
        self.used: torch.Tensor | None = None

    def qkv_heads(self, x):
        return (_split(z) for z in self.qkv(x).split(D, dim=-1))

    def out(self, y):
        return self.proj(y.transpose(1, 2).reshape(y.shape[0], T, D))


class NanoGPTStyle(_Base):
    """nanoGPT's non-flash path, in a module whose name does not say "attention"."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("bias", torch.tril(torch.ones(T, T)).view(1, 1, T, T))

    def forward(self, x):
        q, k, v = self.qkv_heads(x)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = torch.softmax(att, dim=-1)
        self.used = att.detach().clone()
        return self.out(att @ v)


class FlatBmm(_Base):
    """Heads folded into the batch, [B*H, T, S], through torch.bmm and F.softmax (b * H + h layout)."""

    def forward(self, x):
        q, k, v = (z.reshape(B * H, T, HD) for z in self.qkv_heads(x))
        scores = torch.bmm(q, k.transpose(1, 2)) / math.sqrt(HD)
        probs = F.softmax(scores, dim=-1)
        self.used = probs.detach().view(B, H, T, T).clone()
        return self.out(torch.bmm(probs, v).view(B, H, T, HD))


class HeadLoop(_Base):
    """One head at a time, [B, T, S] each, Tensor.softmax, causal -1e9 mask; heads concatenated."""

    def forward(self, x):
        q, k, v = self.qkv_heads(x)
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        outs, used = [], []
        for h in range(H):
            s = q[:, h] @ k[:, h].transpose(-2, -1) / math.sqrt(HD)
            p = s.masked_fill(~causal, -1e9).softmax(-1)
            used.append(p.detach())
            outs.append(p @ v[:, h])
        self.used = torch.stack(used, 1)
        return self.out(torch.stack(outs, 1))


class Einsum(_Base):
    """einsum for both products (pytorch-tabular's FT-Transformer style), padding as an additive -inf mask."""

    def __init__(self) -> None:
        super().__init__(n_head=None)
        self.pad = torch.tensor([[j < n for j in range(T)] for n in (7, 5, 3)])  # True = real key

    def forward(self, x):
        q, k, v = self.qkv_heads(x)
        sim = torch.einsum("b h i d, b h j d -> b h i j", q, k) * HD**-0.5
        sim = sim + torch.zeros(B, 1, 1, T).masked_fill(~self.pad[:, None, None, :], float("-inf"))
        attn = sim.softmax(dim=-1)
        self.used = attn.detach().clone()
        return self.out(torch.einsum("bhij,bhjd->bhid", attn, v))


class SoftmaxModule(_Base):
    """An nn.Softmax module (pytorch-forecasting's ScaledDotProductAttention style, dim=3 of 4-D)."""

    def __init__(self) -> None:
        super().__init__()
        self.softmax = nn.Softmax(dim=3)

    def forward(self, x):
        q, k, v = self.qkv_heads(x)
        attn = self.softmax(torch.matmul(q, k.permute(0, 1, 3, 2)) / torch.as_tensor(HD).sqrt())
        self.used = attn.detach().clone()
        return self.out(torch.matmul(attn, v))


class WithDropout(_Base):
    """Dropout (an nn.Dropout module) and a dtype round trip between the softmax and the value product."""

    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        q, k, v = self.qkv_heads(x)
        att = F.softmax(q @ k.transpose(-2, -1) / math.sqrt(HD), dim=-1, dtype=torch.float64)
        self.used = att.detach().clone()
        return self.out(self.drop(att.to(q.dtype)) @ v)


VARIANTS = {
    "nanogpt": NanoGPTStyle,
    "flat_bmm": FlatBmm,
    "head_loop": HeadLoop,
    "einsum": Einsum,
    "softmax_module": SoftmaxModule,
    "dropout": WithDropout,
}


class Net(nn.Module):
    def __init__(self, block: nn.Module, after: nn.Module | None = None) -> None:
        super().__init__()
        self.block = block
        self.after = after if after is not None else nn.Identity()

    def forward(self, x):
        return self.after(self.block(x))


def _capture(net: nn.Module, *inputs, sample_size: int = B):
    recorder = AttentionRecorder(sample_size=sample_size, max_queries=T, special_positions=())
    capture = AttentionCapture(net, recorder)
    capture.start()
    try:
        out = net(*inputs)
    finally:
        capture.stop()
    return recorder, out


def _brute_force_entropy(probs: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Per head: -sum p log p of each row (masked keys have p = 0), averaged over sequences and the query rows
    ``rows`` ([B, T], default all; padded queries of self-attention are left out)."""
    p = probs.double()
    terms = torch.where(p > 0, -p * p.log(), torch.zeros((), dtype=torch.float64)).sum(-1)  # [B, H, T]
    weight = torch.ones(p.shape[0], p.shape[2], dtype=torch.float64) if rows is None else rows.double()
    return (terms * weight[:, None]).sum((0, 2)) / weight.sum()


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_hand_written_attention_is_seen_named_and_exact(variant):
    torch.manual_seed(0)
    net = Net(VARIANTS[variant]()).train()
    x = torch.randn(B, T, D) * 3  # sharp enough that heads differ
    torch.manual_seed(1)
    bare = net(x)
    torch.manual_seed(1)
    recorder, watched = _capture(net, x)
    assert torch.equal(bare, watched)  # the forward is unchanged, random numbers included
    assert sorted(recorder.stats) == ["block"], (recorder.stats.keys(), recorder.problems, recorder.unrecognised)
    assert recorder.problems == {}
    stats = recorder.stats["block"]
    assert stats.entropy.shape == (H,)
    want = _brute_force_entropy(net.block.used, getattr(net.block, "pad", None))
    assert torch.allclose(stats.entropy.double(), want, atol=1e-5), (stats.entropy, want)
    assert len(set(stats.entropy.round(decimals=4).tolist())) == H  # H distinct heads, not one mixture
    assert recorder.captured == {"block"}
    assert torch._C._len_torch_function_stack() == 0 and not capture_hooks_left()


def capture_hooks_left() -> bool:
    return bool(torch.nn.modules.module._global_forward_pre_hooks or torch.nn.modules.module._global_forward_hooks)


def test_masked_keys_set_the_uniform_reference():
    """-inf, -1e9 and padding masks: the uniform reference counts only the keys a query could see."""
    torch.manual_seed(0)
    for block, visible in ((NanoGPTStyle(), torch.arange(1, T + 1)), (HeadLoop(), torch.arange(1, T + 1))):
        recorder, _ = _capture(Net(block), torch.randn(B, T, D))
        want = visible.double().log().mean()
        assert torch.allclose(recorder.stats["block"].uniform.double(), want.expand(H), atol=1e-6)
    recorder, _ = _capture(Net(Einsum()), torch.randn(B, T, D))
    real = torch.tensor([7.0, 5.0, 3.0])  # every real query row of a sequence sees its real keys
    want = (real * real.log()).sum() / real.sum()
    assert torch.allclose(recorder.stats["block"].uniform.double(), want.double().expand(H), atol=1e-6)


def test_sample_size_measures_the_first_sequences_of_folded_heads():
    torch.manual_seed(0)
    net = Net(FlatBmm())
    recorder, _ = _capture(net, torch.randn(B, T, D) * 3, sample_size=2)
    assert torch.allclose(recorder.stats["block"].entropy.double(), _brute_force_entropy(net.block.used[:2]), atol=1e-5)


def test_without_a_head_count_folded_heads_are_one_head_with_the_exact_mean():
    torch.manual_seed(0)
    block = FlatBmm()
    del block.n_head
    net = Net(block)
    recorder, _ = _capture(net, torch.randn(B, T, D) * 3, sample_size=B * H)  # rows of [B*H, T, S]
    stats = recorder.stats["block"]
    assert stats.entropy.shape == (1,)
    assert torch.allclose(stats.entropy.double(), _brute_force_entropy(net.block.used).mean(), atol=1e-5)


class EagerSelfAttention(NanoGPTStyle):
    """The same code in a module named ...Attention: captured once by the eager path, not again by the matmul."""


class WithSdpa(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.hand = EagerSelfAttention()
        self.mha = nn.MultiheadAttention(D, H, batch_first=True)

    def forward(self, x):
        y = self.hand(x)
        out, weights = self.mha(y, y, y, need_weights=True)  # F.multi_head_attention_forward: softmax + bmm
        q = _split(out)
        return F.scaled_dot_product_attention(q, q, q, is_causal=True) @ weights.new_ones(HD, 1)


def test_no_double_counting_with_eager_sdpa_and_multihead_attention():
    torch.manual_seed(0)
    recorder, _ = _capture(WithSdpa(), torch.randn(B, T, D))
    # "hand" once (eager path); the MHA's own softmax and bmm are left to its hook; SDPA at the root, once
    assert sorted(recorder.stats) == ["WithSdpa", "hand"]
    net = WithSdpa()
    recorder, _ = _capture(net, torch.randn(B, T, D) * 3)
    assert torch.allclose(recorder.stats["hand"].entropy.double(), _brute_force_entropy(net.hand.used), atol=1e-5)


class ProbsBlock(nn.Module):
    """The softmax in one module, the value product in its parent: named after the module that ran the softmax."""

    def __init__(self) -> None:
        super().__init__()
        self.score = nn.Identity()

    def forward(self, q, k):
        return (q @ k.transpose(-2, -1)).softmax(-1)


class Parent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.probs = ProbsBlock()

    def forward(self, x):
        q = k = v = _split(x)
        return self.probs(q, k) @ v


def test_softmax_and_product_in_different_modules_and_repeated_calls():
    net = Parent()
    recorder, _ = _capture(net, torch.randn(B, T, D))
    assert sorted(recorder.stats) == ["probs"]

    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = NanoGPTStyle()

        def forward(self, x):
            return self.layer(self.layer(x))  # a shared layer called twice: two calls, not twice the heads

    recorder, _ = _capture(Twice(), torch.randn(B, T, D))
    assert sorted(recorder.stats) == ["layer", "layer.call_1"]
    assert all(s.entropy.shape == (H,) for s in recorder.stats.values())


# -- what is not attention -----------------------------------------------------------------------------------
class Router(nn.Module):
    """A top-2 MoE: softmax over experts, top-k, outputs weighted element-wise."""

    def __init__(self, experts: int = 4) -> None:
        super().__init__()
        self.gate = nn.Linear(D, experts)
        self.experts = nn.ModuleList(nn.Linear(D, D) for _ in range(experts))

    def forward(self, x):
        probs = F.softmax(self.gate(x), dim=-1)  # [B, T, E]
        weights, chosen = probs.topk(2, dim=-1)
        out = torch.zeros_like(x)
        for slot in range(2):
            for e, expert in enumerate(self.experts):
                hit = (chosen[..., slot] == e).unsqueeze(-1)
                out = out + hit * weights[..., slot : slot + 1] * expert(x)
        return out


class SoftRouter(nn.Module):
    """A dense MoE whose gate is a parameter product and whose combine is an einsum contracting the experts."""

    def __init__(self, experts: int = 4) -> None:
        super().__init__()
        self.w_gate = nn.Parameter(torch.randn(D, experts) * 0.1)
        self.experts = nn.ModuleList(nn.Linear(D, D) for _ in range(experts))

    def forward(self, x):
        gates = (x @ self.w_gate).softmax(-1)  # [B, T, E]
        outs = torch.stack([expert(x) for expert in self.experts], dim=2)  # [B, T, E, D]
        return torch.einsum("bte,bted->btd", gates, outs)


class Classifier(nn.Module):
    """A sequence classifier ([B, C] softmax) and a token classifier ([B, T, C] softmax, argmax)."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(D, 5)

    def forward(self, x):
        sequence = F.softmax(self.head(x.mean(1)), dim=-1)
        tokens = torch.softmax(self.head(x), dim=-1).argmax(-1)
        return sequence, tokens


class TiedLoss(nn.Module):
    """Logits from a tied embedding (a product of two non-parameters) fed to a softmax loss."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, D)

    def forward(self, x):
        logits = x @ self.emb.weight.t()  # [B, T, V]
        target = F.one_hot(torch.arange(T).remainder(11), 11).expand(B, T, 11).float()
        return -(torch.softmax(logits, -1).clamp_min(1e-9).log() * target).sum(-1).mean()


@pytest.mark.parametrize("module", [Router, SoftRouter, Classifier, TiedLoss])
def test_softmaxes_that_are_not_attention_are_not_reported(module):
    torch.manual_seed(0)
    net = Net(module())
    x = torch.randn(B, T, D)
    bare = net.block(x)
    recorder, watched = _capture(net.block, x)
    assert recorder.stats == {} and recorder.captured == set() and recorder.problems == {}
    assert recorder.unrecognised  # and the "no attention" message says why
    message = no_attention_message(recorder)
    assert message.startswith("no attention recognised: looked for nn.MultiheadAttention")
    assert "softmax-weighted matmuls" in message and "not recognised as attention" in message
    bare, watched = (z if isinstance(z, tuple) else (z,) for z in (bare, watched))
    assert all(torch.equal(a, b) for a, b in zip(bare, watched, strict=True))


def test_a_router_next_to_hand_written_attention_is_left_out():
    torch.manual_seed(0)
    net = Net(NanoGPTStyle(), SoftRouter())
    recorder, _ = _capture(net, torch.randn(B, T, D))
    assert sorted(recorder.stats) == ["block"]
    assert "after" in recorder.unrecognised and "query-key product" in recorder.unrecognised["after"]


def test_a_head_loop_whose_batch_divides_by_the_head_count_is_not_split_again():
    """HeadLoop has ``n_head`` and [8, T, S] scores per head: 8 rows are 8 sequences (its input has 8 rows)."""
    torch.manual_seed(0)
    net = Net(HeadLoop())
    recorder, _ = _capture(net, torch.randn(8, T, D) * 3, sample_size=8)
    stats = recorder.stats["block"]
    assert stats.entropy.shape == (H,)
    assert torch.allclose(stats.entropy.double(), _brute_force_entropy(net.block.used), atol=1e-5)


class Grouped(nn.Module):
    """Scores with two head-like dims, [B, G, H, T, S], through einsum."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)
        self.used: torch.Tensor | None = None

    def forward(self, x):
        q, k, v = (z.view(B, T, 2, 2, HD).permute(0, 2, 3, 1, 4) for z in self.qkv(x).split(D, -1))
        probs = torch.einsum("bghid,bghjd->bghij", q, k).div(math.sqrt(HD)).softmax(-1)
        self.used = probs.detach().reshape(B, 4, T, T).clone()
        return torch.einsum("bghij,bghjd->bghid", probs, v)


def test_extra_head_dimensions_are_heads():
    torch.manual_seed(0)
    net = Net(Grouped())
    recorder, _ = _capture(net, torch.randn(B, T, D) * 3)
    stats = recorder.stats["block"]
    assert stats.entropy.shape == (4,)
    assert torch.allclose(stats.entropy.double(), _brute_force_entropy(net.block.used), atol=1e-5)


class ScaledDotProductAttention(nn.Module):
    """pytorch-forecasting's TFT attention: [B, T, S] bmm, scaled, masked_fill(-1e9), nn.Softmax(dim=2), dropout."""

    def __init__(self) -> None:
        super().__init__()
        self.softmax = nn.Softmax(dim=2)
        self.dropout = nn.Dropout(0.1)
        self.used: list[torch.Tensor] = []

    def forward(self, q, k, v, mask):
        attn = torch.bmm(q, k.permute(0, 2, 1))
        attn = attn / torch.as_tensor(k.size(-1), dtype=attn.dtype).sqrt()
        attn = self.softmax(attn.masked_fill(mask, -1e9))
        self.used.append(attn.detach()[:, None])
        return torch.bmm(self.dropout(attn), v), attn


class InterpretableMultiHeadAttention(nn.Module):
    """One call of the shared attention submodule per head, a value projection shared by the heads."""

    def __init__(self) -> None:
        super().__init__()
        self.n_head = H
        self.q_layers = nn.ModuleList(nn.Linear(D, HD) for _ in range(H))
        self.k_layers = nn.ModuleList(nn.Linear(D, HD) for _ in range(H))
        self.v_layer = nn.Linear(D, HD)
        self.attention = ScaledDotProductAttention()

    def forward(self, x):
        mask = torch.ones(T, T, dtype=torch.bool).triu(1).expand(x.shape[0], T, T)
        vs = self.v_layer(x)
        heads = [self.attention(self.q_layers[i](x), self.k_layers[i](x), vs, mask)[0] for i in range(H)]
        return torch.stack(heads, dim=2).mean(dim=2)


def test_tft_style_attention_is_seen_per_call_of_its_submodule():
    torch.manual_seed(0)
    net = Net(InterpretableMultiHeadAttention()).train()
    recorder, _ = _capture(net, torch.randn(B, T, D) * 3)
    names = ["block.attention", *(f"block.attention.call_{i}" for i in range(1, H))]
    assert sorted(recorder.stats) == names
    for name, used in zip(names, net.block.attention.used, strict=True):
        stats = recorder.stats[name]
        assert stats.entropy.shape == (1,)
        assert torch.allclose(stats.entropy.double(), _brute_force_entropy(used), atol=1e-5)
        assert torch.allclose(stats.uniform.double(), torch.arange(1, T + 1).double().log().mean(), atol=1e-6)
