"""loss_on_padding and position_overflow (DataDiagnostics) through real Trainer.fit runs, and their resume."""

from types import SimpleNamespace

import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader

from lightning_diag import DataDiagnostics

FAST = dict(
    accelerator="cpu",
    enable_progress_bar=False,
    enable_model_summary=False,
    enable_checkpointing=False,
    num_sanity_val_steps=0,
    logger=False,
    max_steps=2,
    limit_val_batches=1,
)
VOCAB, PAD = 50, 0
RULES = ("loss_on_padding", "position_overflow")


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class TinyLM(pl.LightningModule):
    """Embedding + learned positions (64) -> linear next-token head; HF-style dict batches, -100 ignored."""

    def __init__(self, max_positions=None):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, 8)
        self.head = nn.Linear(8, VOCAB)
        if max_positions is not None:
            self.config = SimpleNamespace(max_position_embeddings=max_positions)

    def _loss(self, batch):
        logits = self.head(self.embed(batch["input_ids"]))
        return nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, VOCAB), batch["labels"][:, 1:].reshape(-1), ignore_index=-100
        )

    def training_step(self, batch, batch_idx):
        return self._loss(batch)

    def validation_step(self, batch, batch_idx):
        return self._loss(batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _samples(n, low, high, seed):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high + 1, (n,), generator=g)
    return [torch.randint(1, VOCAB, (int(k),), generator=g) for k in lengths]


def _collate(mask_labels=True, padded=True):
    def collate(items):
        width = max(len(x) for x in items)
        ids = torch.full((len(items), width), PAD)
        mask = torch.zeros(len(items), width, dtype=torch.long)
        for i, x in enumerate(items):
            ids[i, : len(x)] = x
            mask[i, : len(x)] = 1
        labels = ids.clone()  # HF style: labels are the input ids (the model shifts them)
        if mask_labels:
            labels[mask == 0] = -100
        batch = {"input_ids": ids, "labels": labels}
        if padded:
            batch["attention_mask"] = mask
        return batch

    return collate


def _fit(cb, train, val, tmp_path, model=None, **kw):
    trainer = pl.Trainer(default_root_dir=tmp_path, callbacks=[cb], **{**FAST, **kw})
    trainer.fit(model or TinyLM(), train, val)
    return trainer


def _loaders(train_len=(8, 20), val_len=(8, 20), **collate_kw):
    collate = _collate(**collate_kw)
    train = DataLoader(_samples(128, *train_len, seed=1), batch_size=16, collate_fn=collate)
    val = DataLoader(_samples(32, *val_len, seed=2), batch_size=16, collate_fn=collate)
    return train, val


def _hits(cb):
    return [(a.rule, a.source, a.severity) for a in cb.alerts if a.rule in RULES]


def test_padded_batches_with_masked_labels_are_healthy(tmp_path):
    cb = DataDiagnostics()
    _fit(cb, *_loaders(), tmp_path)
    assert _hits(cb) == []
    assert cb.last["train/padding_label_share"] == 0.0
    assert cb.last["train/max_positions"] == 20.0


def test_labels_equal_to_input_ids_without_padding_are_healthy(tmp_path):
    # HF causal-LM batches of one length: labels are the input ids, the mask is all ones
    cb = DataDiagnostics()
    _fit(cb, *_loaders(train_len=(16, 16), val_len=(16, 16), mask_labels=False), tmp_path)
    assert _hits(cb) == []


def test_unmasked_padding_labels_are_loss_on_padding_with_the_share_and_the_fix(tmp_path):
    cb = DataDiagnostics()
    _fit(cb, *_loaders(mask_labels=False), tmp_path)
    (hit,) = [a for a in cb.alerts if a.rule == "loss_on_padding"]
    assert hit.severity == "warning" and hit.source == "train" and hit.global_step == 0
    share = cb.last["train/padding_label_share"]
    assert 0.1 < share < 0.6 and hit.value == pytest.approx(share)
    assert "labels[attention_mask == 0] = -100" in hit.message and f"{share:.1%}" in hit.message


def test_validation_longer_than_training_is_position_overflow(tmp_path):
    cb = DataDiagnostics()
    _fit(cb, *_loaders(train_len=(8, 20), val_len=(30, 40)), tmp_path)
    (hit,) = [a for a in cb.alerts if a.rule == "position_overflow"]
    assert hit.source == "val" and hit.value == pytest.approx(40 / 20)
    assert "40 positions" in hit.message and "20" in hit.message


def test_sequences_beyond_the_model_capacity_are_position_overflow(tmp_path):
    cb = DataDiagnostics()
    _fit(cb, *_loaders(), tmp_path, model=TinyLM(max_positions=16))
    (hit,) = [a for a in cb.alerts if a.rule == "position_overflow"]
    assert hit.source == "capacity" and hit.threshold == 16.0 and "max_position_embeddings" in hit.message


def test_longest_training_length_survives_a_resume_and_a_longer_curriculum_alerts(tmp_path):
    cb = DataDiagnostics()
    trainer = pl.Trainer(default_root_dir=tmp_path, callbacks=[cb], **FAST)
    train, val = _loaders()
    trainer.fit(TinyLM(), train, val)
    trainer.save_checkpoint(tmp_path / "short.ckpt")
    assert cb.state_dict()["sequences"]["train_extent"] == 20
    cb2 = DataDiagnostics()
    longer, val2 = _loaders(train_len=(20, 30), val_len=(8, 20))
    trainer = pl.Trainer(default_root_dir=tmp_path, callbacks=[cb2], **{**FAST, "max_steps": 4})
    trainer.fit(TinyLM(), longer, val2, ckpt_path=tmp_path / "short.ckpt")
    assert _hits(cb2) == [("position_overflow", "train", "warning")]
    assert cb2.sequence_rules.train_extent == 30


def test_bad_configuration_names_the_argument():
    with pytest.raises(ValueError, match=r"rules\['loss_on_padding'\]\['threshold'\]"):
        DataDiagnostics(rules={"loss_on_padding": {"threshold": 1.0}})
    with pytest.raises(ValueError, match=r"rules\['position_overflow'\]\['threshold'\]"):
        DataDiagnostics(rules={"position_overflow": {"threshold": 0.5}})
    assert DataDiagnostics(rules={"position_overflow": {"threshold": 1.5}}).thresholds()["position_overflow"] == 1.5
