"""A nanoGPT written by hand ([B*H, T, S] bmm scores, softmax, attention dropout, in modules whose names do not say
"attention") through Trainer.fit with AttentionEntropyMonitor: every layer's heads are logged, exactly; a healthy
run raises no warning; the weights are bitwise those of a run without the monitor (issue 34 item 5)."""

import math

import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn
from torch.nn import functional as F

from lightning_diag import AttentionEntropyMonitor
from tests.callbacks.nanogpt import HEADS, LAYERS, WIDTH, CausalSelfAttention, NanoGPT

FAST = dict(enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", enable_checkpointing=False)
#: The first step measured with ``log_every_n_steps=5``: the user's first logging step.
KEPT_STEP = 4


class Mixer(CausalSelfAttention):
    """The same projections as nanoGPT's attention, written out: heads folded into the batch, torch.bmm,
    a -inf causal mask, F.softmax, dropout, torch.bmm. ``first`` keeps the probabilities of the training forward at
    step ``KEPT_STEP`` (one forward per step), the first the monitor measures."""

    n_head = HEADS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        d = c // HEADS
        q, k, v = (
            z.view(b, t, HEADS, d).transpose(1, 2).reshape(b * HEADS, t, d) for z in self.c_attn(x).split(WIDTH, 2)
        )
        att = torch.bmm(q, k.transpose(1, 2)) / math.sqrt(d)
        att = att.masked_fill(~torch.ones(t, t, dtype=torch.bool, device=x.device).tril(), float("-inf"))
        att = F.softmax(att, dim=-1)
        if self.training:
            self.forwards = getattr(self, "forwards", 0) + 1
            if self.forwards == KEPT_STEP + 1:
                self.first = att.detach().view(b, HEADS, t, t).clone()
        y = torch.bmm(self.drop(att), v)
        return self.c_proj(y.view(b, HEADS, t, d).transpose(1, 2).reshape(b, t, c))


class HandWrittenGPT(NanoGPT):
    def __init__(self, lr: float = 5e-3) -> None:
        super().__init__(lr=lr)
        for block in self.h:
            block.attn.__class__ = Mixer
            block.attn.drop = nn.Dropout(0.1)
            block.attn.first = None


def _fit(tmp_path, callbacks, steps, logger=False):
    pl.seed_everything(7)
    model = HandWrittenGPT()
    losses = []

    class Losses(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(float(outputs["loss"]))

    trainer = pl.Trainer(
        max_steps=steps, default_root_dir=tmp_path, callbacks=[*callbacks, Losses()], logger=logger,
        log_every_n_steps=5, **FAST,
    )  # fmt: skip
    trainer.fit(model)
    return model, losses


def _entropy(probs: torch.Tensor) -> list[float]:
    p = probs.double()
    return torch.where(p > 0, -p * p.log(), torch.zeros((), dtype=torch.float64)).sum(-1).mean((0, 2)).tolist()


def test_hand_written_gpt_is_seen_exact_quiet_and_leaves_the_run_unchanged(tmp_path):
    monitor = AttentionEntropyMonitor()
    logger = TensorBoardLogger(tmp_path, name="tb")
    model, losses = _fit(tmp_path / "watched", [monitor], 150, logger)
    assert sum(losses[-10:]) < 0.5 * sum(losses[:10])  # it learned
    assert [a.format() for a in monitor.alerts if a.severity != "info"] == []

    acc = EventAccumulator(logger.log_dir, size_guidance={"scalars": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for layer in range(LAYERS):
        name = f"h.{layer}.attn"
        expected = {f"diag/attn_entropy/{name}/{h}" for h in ["mean", *(f"head_{i}" for i in range(HEADS))]}
        assert expected <= tags, sorted(t for t in tags if t.startswith("diag/attn_entropy"))
        assert [e.step for e in acc.Scalars(f"diag/attn_entropy/{name}/mean")][:3] == [KEPT_STEP, 9, 14]
        # step 4: the logged heads are the entropies of the probabilities the model used (first 8 sequences)
        want = _entropy(model.h[layer].attn.first[: monitor.sample_size])
        got = [acc.Scalars(f"diag/attn_entropy/{name}/head_{i}")[0].value for i in range(HEADS)]
        assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-5, (got, want)
    assert not any(t.startswith("diag/attn_entropy/h.0.attn.") for t in tags)  # no second count of a layer

    bare, bare_losses = _fit(tmp_path / "bare", [], 20)
    watched, watched_losses = _fit(tmp_path / "every", [AttentionEntropyMonitor(log_every_n_steps=1)], 20)
    assert bare_losses == watched_losses
    for (name, a), b in zip(bare.named_parameters(), watched.parameters(), strict=True):
        assert torch.equal(a, b), name
