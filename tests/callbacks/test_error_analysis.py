"""ErrorAnalysis through real fits: a planted hard subgroup is found and named, uniform label noise is quiet."""

import json

import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_diag import ErrorAnalysis  # scikit-learn is in the dev extra: a missing one fails here

VOCAB, LENGTH, HARD_TOKEN = 40, 12, 35


def topic_task(n, seed, hard_share=0.0, noise=0.0):
    """Three topics, each drawing its tokens from its own range (label = topic). Hard samples carry token 35 four
    times and a random label (nothing to learn); noisy samples get a random label (uniform noise)."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 3, (n,), generator=g)
    ids = labels[:, None] * 10 + torch.randint(0, 10, (n, LENGTH), generator=g)
    filler = torch.randint(30, 34, (n, LENGTH), generator=g)
    ids = torch.where(torch.rand(n, LENGTH, generator=g) < 0.3, filler, ids)
    hard = torch.rand(n, generator=g) < hard_share
    ids[hard, :4] = HARD_TOKEN
    noisy = hard | (torch.rand(n, generator=g) < noise)
    labels = torch.where(noisy, torch.randint(0, 3, (n,), generator=g), labels)
    return TensorDataset(ids, labels)


class BagClassifier(pl.LightningModule):
    def __init__(self, train, val):
        super().__init__()
        self.train_set, self.val_set = train, val
        self.embed = nn.EmbeddingBag(VOCAB, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, ids):
        return self.head(self.embed(ids))

    def training_step(self, batch, batch_idx):
        ids, labels = batch
        return nn.functional.cross_entropy(self(ids), labels)

    def validation_step(self, batch, batch_idx):
        ids, labels = batch
        logits = self(ids)
        self.log("val_loss", nn.functional.cross_entropy(logits, labels))
        return {"logits": logits}

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.05)

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=64, shuffle=True)

    def val_dataloader(self):
        return DataLoader(self.val_set, batch_size=100)


class Vocab:
    def decode(self, ids):
        return " ".join("dosage" if i == HARD_TOKEN else f"w{i}" for i in ids)


def fit(tmp_path, hard_share=0.0, noise=0.0, **kwargs):
    torch.manual_seed(0)
    model = BagClassifier(topic_task(1200, 1, hard_share, noise), topic_task(600, 2, hard_share, noise))
    callback = ErrorAnalysis(**kwargs)
    trainer = pl.Trainer(max_epochs=3, callbacks=[callback], default_root_dir=tmp_path, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0)
    trainer.fit(model)
    return callback, trainer


def test_a_planted_hard_subgroup_is_found_and_named(tmp_path):
    callback, trainer = fit(tmp_path, hard_share=0.12, tokenizer=Vocab())
    alerts = [a for a in callback.alerts if a.rule == "error_cluster"]
    assert len(alerts) == 1, callback.alerts  # one event: the latch holds it over the later validations
    assert alerts[0].severity == "warning" and alerts[0].global_step == trainer.global_step // 3
    assert f"{HARD_TOKEN} ('dosage')" in alerts[0].message
    report = json.loads((tmp_path / "lightning_logs" / "version_0" / "diag" / "errors.json").read_text())
    worst = report["clusters"][0]
    assert str(HARD_TOKEN) in [name for name, _ in worst["top_features"]]
    assert worst["error_rate"] >= 3 * report["error_rate"] and worst["share"] >= 0.05
    assert len(report["confusion_matrix"]) == 3 and len(report["precision"]) == 3


def test_uniform_label_noise_stays_quiet(tmp_path):
    callback, _ = fit(tmp_path, noise=0.25)
    assert callback.last is not None and callback.last["error_rate"] > 0.1  # there are errors to cluster
    assert callback.last["clusters"], "the errors were clustered"
    assert [a for a in callback.alerts if a.rule == "error_cluster"] == []


def test_the_latch_survives_a_resume(tmp_path):
    callback, trainer = fit(tmp_path, hard_share=0.12)
    assert callback.alerts
    ckpt = tmp_path / "last.ckpt"
    trainer.save_checkpoint(ckpt)
    torch.manual_seed(0)
    model = BagClassifier(topic_task(1200, 1, 0.12), topic_task(600, 2, 0.12))
    again = ErrorAnalysis()
    resumed = pl.Trainer(max_epochs=4, callbacks=[again], default_root_dir=tmp_path, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0)
    resumed.fit(model, ckpt_path=ckpt)
    assert again.validations == 4
    assert again.alerts == []  # the hard subgroup is still there: the same event, not a new alert


def test_inputs_without_tokens_need_embed(tmp_path, caplog):
    class Dense(BagClassifier):
        def validation_step(self, batch, batch_idx):
            ids, labels = batch
            return {"logits": self(ids), "labels": labels}

    torch.manual_seed(0)
    model = Dense(topic_task(300, 1, 0.12), topic_task(300, 2, 0.12))
    model.val_set = TensorDataset(*(t for t in model.val_set.tensors))
    callback = ErrorAnalysis(embed=lambda m, b: m.embed(b[0]))
    trainer = pl.Trainer(max_epochs=1, callbacks=[callback], default_root_dir=tmp_path, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0)
    trainer.fit(model)
    assert callback.last is not None and callback.last["samples"] == 300


@pytest.mark.parametrize(
    ("kwargs", "error", "needle"),
    [
        ({"rules": {"error_cluster": {"threshold": 1.0}}}, ValueError, r"`rules\['error_cluster'\]\['threshold'\]`"),
        ({"rules": {"error_cluster": {"min_share": 0.0}}}, ValueError, r"`rules\['error_cluster'\]\['min_share'\]`"),
        ({"rules": {"error_cluster": {"min_errors": 1}}}, ValueError, r"`rules\['error_cluster'\]\['min_errors'\]`"),
        ({"k_range": (1, 4)}, ValueError, "`k_range`"),
        ({"embed": 3}, TypeError, "`embed`"),
        ({"tokenizer": object()}, TypeError, "`tokenizer`"),
        ({"max_samples": 5}, ValueError, "`max_samples`"),
        ({"every_n_validations": 0}, ValueError, "`every_n_validations`"),
    ],
)
def test_bad_configuration_is_refused(kwargs, error, needle):
    with pytest.raises(error, match=needle):
        ErrorAnalysis(**kwargs)
