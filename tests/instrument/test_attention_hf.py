"""Off-the-shelf Hugging Face transformers (tiny configs, no downloads): every attention layer is seen automatically.

For each model the entropies logged through ``Trainer.fit`` (``attn_implementation="sdpa"``) and those captured from
the eager implementation's softmax agree with the model's own ``output_attentions=True`` weights to 1e-4.
"""

import copy
import math

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lightning_diag import AttentionEntropyMonitor
from lightning_diag.instrument.attention_capture import AttentionCapture
from lightning_diag.instrument.attention_record import AttentionRecorder

transformers = pytest.importorskip("transformers")

VOCAB, LAYERS, D, HEADS, FFN = 50, 2, 64, 4, 128
BATCH, SEQ, DEC = 3, 10, 7
TOL = 1e-4


def _text_batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=g)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, 7:] = 0  # right padding
    mask[2, 4:] = 0
    return ids, mask


def _config(kind: str, impl: str, dropout: float = 0.0):
    t = transformers
    kind = kind.split("_")[0]
    common = dict(attn_implementation=impl)
    if kind == "bert":
        return t.BertConfig(
            vocab_size=VOCAB, hidden_size=D, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
            intermediate_size=FFN, max_position_embeddings=32, hidden_dropout_prob=dropout,
            attention_probs_dropout_prob=dropout, num_labels=3, **common,
        )  # fmt: skip
    if kind == "gpt2":
        return t.GPT2Config(
            vocab_size=VOCAB, n_embd=D, n_layer=LAYERS, n_head=HEADS, n_positions=32, resid_pdrop=dropout,
            embd_pdrop=dropout, attn_pdrop=dropout, bos_token_id=1, eos_token_id=2, **common,
        )  # fmt: skip
    if kind == "llama":
        return t.LlamaConfig(
            vocab_size=VOCAB, hidden_size=D, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
            num_key_value_heads=HEADS // 2, intermediate_size=FFN, max_position_embeddings=32,
            attention_dropout=dropout, **common,
        )  # fmt: skip
    if kind == "bart":
        return t.BartConfig(
            vocab_size=VOCAB, d_model=D, encoder_layers=LAYERS, decoder_layers=LAYERS, encoder_attention_heads=HEADS,
            decoder_attention_heads=HEADS, encoder_ffn_dim=FFN, decoder_ffn_dim=FFN, max_position_embeddings=32,
            dropout=dropout, attention_dropout=dropout, activation_dropout=dropout, **common,
        )  # fmt: skip
    if kind == "t5":
        return t.T5Config(
            vocab_size=VOCAB, d_model=D, d_kv=D // HEADS, d_ff=FFN, num_layers=LAYERS, num_decoder_layers=LAYERS,
            num_heads=HEADS, relative_attention_num_buckets=8, dropout_rate=dropout, decoder_start_token_id=0,
            **common,
        )  # fmt: skip
    return t.ViTConfig(
        image_size=16, patch_size=4, num_channels=3, hidden_size=D, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, intermediate_size=FFN, num_labels=3, hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout, **common,
    )  # fmt: skip


_CLASSES = {
    "bert": "BertForSequenceClassification",
    "gpt2": "GPT2LMHeadModel",
    "llama": "LlamaForCausalLM",
    "bart": "BartForConditionalGeneration",
    "t5": "T5ForConditionalGeneration",
    "vit": "ViTForImageClassification",
}
_ENC = [f"encoder.layers.{i}.self_attn" for i in range(LAYERS)]
_DEC = [f"decoder.layers.{i}.{a}" for i in range(LAYERS) for a in ("self_attn", "encoder_attn")]
# The attention modules of each model, in call order, written out by hand.
NAMES = {
    "bert": [f"bert.encoder.layer.{i}.attention.self" for i in range(LAYERS)],
    "gpt2": [f"transformer.h.{i}.attn" for i in range(LAYERS)],
    "llama": [f"model.layers.{i}.self_attn" for i in range(LAYERS)],
    # no padding: Hugging Face passes no mask and `enable_gqa=True` instead of repeating the key/value heads
    "llama_unpadded": [f"model.layers.{i}.self_attn" for i in range(LAYERS)],
    "bart": [f"model.{n}" for n in _ENC + _DEC],
    "t5": [f"encoder.block.{i}.layer.0.SelfAttention" for i in range(LAYERS)]
    + [
        f"decoder.block.{i}.layer.{j}.{a}"
        for i in range(LAYERS)
        for j, a in ((0, "SelfAttention"), (1, "EncDecAttention"))
    ],
    "vit": [f"vit.layers.{i}.attention" for i in range(LAYERS)],
}


def build(kind: str, impl: str = "sdpa", dropout: float = 0.0, seed: int = 0):
    torch.manual_seed(seed)
    model = getattr(transformers, _CLASSES[kind.split("_")[0]])(_config(kind, impl, dropout))
    with torch.no_grad():  # larger weights than the init's: heads differ and attention is far from uniform
        for name, p in model.named_parameters():
            if p.dim() == 2 and "embed" not in name and "wte" not in name and "wpe" not in name:
                p.normal_(0.0, 0.35)
    return model.train()


def inputs(kind: str, with_labels: bool = True) -> dict:
    if kind == "vit":
        g = torch.Generator().manual_seed(1)
        out = {"pixel_values": torch.randn(BATCH, 3, 16, 16, generator=g)}
        return out | ({"labels": torch.tensor([0, 1, 2])} if with_labels else {})
    ids, mask = _text_batch()
    if kind.endswith("_unpadded"):
        mask = torch.ones_like(mask)
    out = {"input_ids": ids, "attention_mask": mask}
    if kind in ("bart", "t5"):
        out |= {"decoder_input_ids": ids[:, :DEC], "decoder_attention_mask": mask[:, :DEC]}
        return out | ({"labels": ids[:, :DEC].contiguous()} if with_labels else {})
    if kind == "bert":
        return out | ({"labels": torch.tensor([0, 1, 2])} if with_labels else {})
    return out | ({"labels": ids} if with_labels else {})


def reference(model, kind: str) -> dict[str, tuple[list[float], list[float]]]:
    """Per-head entropy and uniform reference from the model's own eager ``output_attentions=True`` weights."""
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    batch = inputs(kind, with_labels=False)
    with torch.no_grad():
        out = eager(**batch, output_attentions=True)
    mask = batch.get("attention_mask")
    if kind in ("bart", "t5"):
        dec = batch["decoder_attention_mask"]
        per_layer = [(a, mask, False) for a in out.encoder_attentions]
        for self_attn, cross in zip(out.decoder_attentions, out.cross_attentions, strict=True):
            per_layer += [(self_attn, dec, True), (cross, mask, False)]
    else:
        per_layer = [(a, mask, kind.startswith(("gpt2", "llama"))) for a in out.attentions]
    recorder = AttentionRecorder(sample_size=8, max_queries=64, special_positions=())
    for name, (probs, m, causal) in zip(NAMES[kind], per_layer, strict=True):
        recorder.add_probabilities(probs, name, attention_mask=m, causal=causal)
    return {n: (s.entropy.tolist(), s.uniform.tolist()) for n, s in recorder.stats.items()}


class Wrapped(pl.LightningModule):
    def __init__(self, net, kind):
        super().__init__()
        self.net, self.kind = net, kind

    def training_step(self, batch, batch_idx):
        return self.net(**inputs(self.kind)).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _fit(module, tmp_path, callbacks, steps=1, logger=None):
    trainer = pl.Trainer(
        default_root_dir=tmp_path,
        max_steps=steps,
        callbacks=callbacks,
        logger=logger if logger is not None else False,
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
    )
    trainer.fit(module, torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(steps)), batch_size=1))
    return trainer


@pytest.mark.parametrize("kind", sorted(NAMES))
def test_every_attention_layer_is_logged_and_agrees_with_output_attentions(kind, tmp_path, monkeypatch):
    gqa_flags = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    if kind.startswith("llama"):  # which grouped-query path Hugging Face took (the spy sits outside the capture)

        def spy(*args, **kwargs):
            gqa_flags.append(kwargs.get("enable_gqa", False))
            return sdpa(*args, **kwargs)

        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    model = build(kind)
    want = reference(model, kind)
    assert sorted(want) == sorted(NAMES[kind])
    spread = [e for ent, _ in want.values() for e in ent]
    assert max(spread) - min(spread) > 0.1  # heads differ: an agreement below is not between two uniform maps

    # Eager attention (the model computes the softmax itself) is seen too, at its softmax.
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    recorder = AttentionRecorder(sample_size=8, max_queries=64, special_positions=())
    capture = AttentionCapture(eager, recorder)
    capture.start()
    try:
        with torch.no_grad():
            eager(**inputs(kind))
    finally:
        capture.stop()
    assert list(recorder.stats) == NAMES[kind] and not recorder.problems
    for name, (entropy, uniform) in want.items():
        assert recorder.stats[name].entropy.tolist() == pytest.approx(entropy, abs=TOL), name
        assert recorder.stats[name].uniform.tolist() == pytest.approx(uniform, abs=TOL), name

    # sdpa, through Trainer.fit with TensorBoard: the logged values of the first (sampled) step.
    monitor = AttentionEntropyMonitor(image_every_n_steps=0)
    trainer = _fit(Wrapped(model, kind), tmp_path, [monitor], logger=TensorBoardLogger(tmp_path, name="tb"))
    events = EventAccumulator(str(trainer.log_dir), size_guidance={"scalars": 0})
    events.Reload()
    tags = set(events.Tags()["scalars"])
    prefix = "diag/attn_entropy/"
    logged = {t[len(prefix) : -len("/mean")] for t in tags if t.startswith(prefix) and t.endswith("/mean")}
    assert logged == {f"net.{n}" for n in NAMES[kind]}
    for name, (entropy, uniform) in want.items():
        base = f"{prefix}net.{name}"
        heads = [events.Scalars(f"{base}/head_{h}")[0].value for h in range(HEADS)]
        assert heads == pytest.approx(entropy, abs=TOL), name
        assert events.Scalars(f"{base}/uniform")[0].value == pytest.approx(max(uniform), abs=TOL)
    if kind not in ("vit", "llama_unpadded"):  # padded keys carry no mass and padded query rows are left out
        full = math.log(SEQ if "decoder" not in NAMES[kind][-1] else DEC)
        assert min(u for _, uniform in want.values() for u in uniform) < full - 0.05
    if kind.startswith("llama"):
        assert gqa_flags and all(gqa_flags) == (kind == "llama_unpadded")  # enable_gqa, or HF's own repeat_kv


@pytest.mark.parametrize(("kind", "impl"), [("bert", "sdpa"), ("llama", "sdpa"), ("gpt2", "eager")])
def test_training_is_bitwise_unchanged_with_dropout(kind, impl, tmp_path):
    """Every step sampled, attention and hidden dropout on: final weights and the RNG stream are identical."""
    finals = []
    for callbacks in ([], [AttentionEntropyMonitor(log_every_n_steps=1, image_every_n_steps=1)]):
        pl.seed_everything(7)
        module = Wrapped(build(kind, impl, dropout=0.2), kind)
        _fit(module, tmp_path, callbacks, steps=3)
        finals.append(({k: v.clone() for k, v in module.state_dict().items()}, torch.get_rng_state()))
        if callbacks:
            assert callbacks[0]._sampled_step == 2
    (bare, bare_rng), (watched, watched_rng) = finals
    assert bare.keys() == watched.keys()
    assert all(torch.equal(bare[k], watched[k]) for k in bare)
    assert torch.equal(bare_rng, watched_rng)


class OldStyle(Wrapped):
    """Eager BERT that still hands its attentions over by hand: the layers are counted once, with one notice."""

    def training_step(self, batch, batch_idx):
        from lightning_diag import attention_requested, record_hf_attentions

        out = self.net(**inputs(self.kind), output_attentions=attention_requested())
        record_hf_attentions(out.attentions, "bert", attention_mask=inputs(self.kind)["attention_mask"])
        return out.loss


def test_record_hf_attentions_beside_the_capture_counts_each_layer_once(tmp_path, caplog):
    monitor = AttentionEntropyMonitor(log_every_n_steps=1, image_every_n_steps=0)
    with caplog.at_level("INFO", logger="lightning_diag"):
        trainer = _fit(
            OldStyle(build("bert", "eager"), "bert"), tmp_path, [monitor], steps=2, logger=TensorBoardLogger(tmp_path)
        )
    events = EventAccumulator(str(trainer.log_dir), size_guidance={"scalars": 0})
    events.Reload()
    means = sorted(t for t in events.Tags()["scalars"] if t.startswith("diag/attn_entropy/") and t.endswith("/mean"))
    assert means == [f"diag/attn_entropy/net.{n}/mean" for n in NAMES["bert"]]
    notes = [r.getMessage() for r in caplog.records
             if "record_hf_attentions" in r.getMessage() and not r.getMessage().startswith("diagnostics of this run")]
    assert len(notes) == 1 and "ignored" in notes[0]
