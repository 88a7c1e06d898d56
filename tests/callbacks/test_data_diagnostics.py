"""DataDiagnostics end to end: real Trainer.fit runs on tiny token and feature tasks."""

from __future__ import annotations

import logging
import re
from unittest.mock import MagicMock

import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset

from lightning_diag import DataDiagnostics
from lightning_diag.output.dashboard import dashboard_layout
from lightning_diag.output.writer import DiagWriter

FAST = dict(
    accelerator="cpu",
    enable_progress_bar=False,
    enable_model_summary=False,
    enable_checkpointing=False,
    num_sanity_val_steps=0,
    logger=False,
)
VOCAB, SEQ = 300, 24


class TokenModel(pl.LightningModule):
    """Embedding bag -> linear classifier; accepts (ids, labels) tuples, HF dicts and (features, labels)."""

    def __init__(self, features: int = 0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB + 10, 8)
        self.feat = nn.Linear(max(features, 1), 8)
        self.head = nn.Linear(8, 4)

    def _loss(self, batch):
        if isinstance(batch, dict):
            x, y = batch["input_ids"], batch["labels"]
        else:
            x, y = batch
        h = self.feat(torch.nan_to_num(x)) if x.is_floating_point() else self.embed(x).mean(1)
        return nn.functional.cross_entropy(self.head(h), y)

    def training_step(self, batch, batch_idx):
        return self._loss(batch)

    def validation_step(self, batch, batch_idx):
        return self._loss(batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def tokens(n: int, seed: int, low: int = 0, high: int = VOCAB) -> torch.Tensor:
    return torch.randint(low, high, (n, SEQ), generator=torch.Generator().manual_seed(seed))


def labels(n: int, seed: int, weights=(1, 1, 1, 1)) -> torch.Tensor:
    return torch.multinomial(
        torch.tensor(weights, dtype=torch.float), n, True, generator=torch.Generator().manual_seed(seed)
    )


def fit(cb, train, val, tmp_path, model=None, **trainer_kw):
    trainer = pl.Trainer(
        default_root_dir=tmp_path,
        callbacks=[cb] if cb else [],
        **{**FAST, "max_steps": 2, "limit_val_batches": 1, **trainer_kw},
    )
    model = model or TokenModel()
    trainer.fit(model, train, val)
    return trainer, model


def loaders(xt, yt, xv, yv, bs=32, **kw):
    return DataLoader(TensorDataset(xt, yt), batch_size=bs, shuffle=True, **kw), DataLoader(TensorDataset(xv, yv), bs)


def serious(cb):
    return [a for a in cb.alerts if a.severity != "info"]


def test_healthy_split_raises_nothing(tmp_path):
    cb = DataDiagnostics()
    fit(cb, *loaders(tokens(3000, 1), labels(3000, 1), tokens(600, 2), labels(600, 2)), tmp_path)
    assert serious(cb) == []
    assert cb.last["vocab_kl"] < 0.05
    assert cb.last["leaked_fraction"] == 0.0
    assert cb.last["train/label_std"] < 0.05 and cb.last["val/label_std"] < 0.05


def test_leaked_validation_set_fires_with_examples(tmp_path):
    xt, yt = tokens(1500, 1), labels(1500, 1)
    xv, yv = tokens(500, 2), labels(500, 2)
    xv[:100] = xt[:100]  # 20% exact copies
    xv[100:200] = xt[100:200]
    xv[100:200, SEQ // 2] = (xv[100:200, SEQ // 2] + 1) % VOCAB  # 20% with one token changed
    cb = DataDiagnostics(max_batches=None)
    fit(cb, *loaders(xt, yt, xv, yv), tmp_path)
    (alert,) = [a for a in cb.alerts if a.rule == "data_leakage"]
    assert alert.severity == "warning"
    assert alert.value == pytest.approx(0.4, abs=0.03)
    assert "val 0 ~ train 0" in alert.message
    assert cb.last["exact_copies"] == pytest.approx(0.2, abs=0.01)
    assert cb.last["near_copies"] == pytest.approx(0.2, abs=0.03)
    assert not [a for a in cb.alerts if a.rule != "data_leakage"]


def test_partial_training_sample_extrapolates_the_leak(tmp_path):
    xt, yt = tokens(4000, 1), labels(4000, 1)
    xv, yv = tokens(500, 2), labels(500, 2)
    xv[:200] = xt[torch.arange(200) * 20]  # 40% copies spread over the training set
    cb = DataDiagnostics(max_batches=40)  # 1280 of 4000 training samples read
    fit(cb, *loaders(xt, yt, xv, yv), tmp_path)
    assert cb.last["train_coverage"] == pytest.approx(0.32)
    assert [a.rule for a in serious(cb)] == ["data_leakage"]
    assert 0.25 < cb.last["leaked_fraction"] < 0.55


def test_vocabulary_shift_fires(tmp_path):
    cb = DataDiagnostics()
    xv = tokens(600, 2, low=VOCAB // 2, high=VOCAB + 10)  # another half of the vocabulary and unseen ids
    fit(cb, *loaders(tokens(2000, 1), labels(2000, 1), xv, labels(600, 2)), tmp_path)
    assert [a.rule for a in serious(cb)] == ["data_vocab_shift"]
    assert cb.last["vocab_kl"] > 0.3 and cb.last["oov_share"] > 0.01


def test_label_imbalance_fires_with_the_class_table(tmp_path):
    cb = DataDiagnostics()
    fit(cb, *loaders(tokens(2000, 1), labels(2000, 1, (8, 1, 1, 1)), tokens(400, 2), labels(400, 2)), tmp_path)
    (alert,) = serious(cb)
    assert (alert.rule, alert.source) == ("label_imbalance", "train")
    assert alert.value > 0.1 and "0: 7" in alert.message  # class 0 holds ~73%
    assert cb.last["label_tv"] > 0.3  # train vs val label distributions compared


def test_nonfinite_features_name_key_and_index_and_constant_features_are_info(tmp_path):
    x = torch.randn(256, 5)
    x[:, 3] = 1.0
    x[37, 1] = float("nan")
    y = labels(256, 1)
    cb = DataDiagnostics(max_batches=None)
    fit(cb, *loaders(x, y, torch.randn(64, 5), labels(64, 2)), tmp_path, model=TokenModel(features=5))
    (critical,) = [a for a in cb.alerts if a.severity == "critical"]
    assert (critical.rule, critical.source) == ("data_nonfinite", "train:[0]")
    assert "37" in critical.message
    info = [a for a in cb.alerts if a.severity == "info"]
    assert [a.source for a in info] == ["train:[0] (constant)"] and "indices 3" in info[0].message


class HFDataset(Dataset):
    """Hugging Face style dict samples with right padding (id 0); sample 5 is empty."""

    def __init__(self, n: int, seed: int) -> None:
        self.ids = tokens(n, seed, low=1)
        self.lengths = torch.randint(4, SEQ, (n,), generator=torch.Generator().manual_seed(seed))
        self.lengths[5] = 0
        self.y = labels(n, seed)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        mask = (torch.arange(SEQ) < self.lengths[i]).long()
        return {"input_ids": self.ids[i] * mask, "attention_mask": mask, "labels": self.y[i]}


def test_hugging_face_dicts_padding_and_empty_sequences(tmp_path):
    cb = DataDiagnostics()
    fit(cb, DataLoader(HFDataset(512, 1), batch_size=16), DataLoader(HFDataset(128, 2), batch_size=16), tmp_path)
    assert serious(cb) == []
    assert 0.2 < cb.last["train/padding_ratio"] < 0.6
    assert cb.last["train/mean_seq_len"] == pytest.approx(float(HFDataset(512, 1).lengths.float().mean()), rel=1e-6)
    assert {a.source for a in cb.alerts} == {"train:tokens (empty)", "val:tokens (empty)"}


def test_uninterpretable_batch_gets_one_message_and_extract_reads_it(tmp_path, caplog):
    class Odd(Dataset):
        def __len__(self):
            return 64

        def __getitem__(self, i):
            return {"ids": [i % 7, 3, 4], "cls": i % 4}

    class OddModel(TokenModel):
        def training_step(self, batch, batch_idx):
            return self.head(self.embed(torch.stack(batch["ids"], 1)).mean(1)).sum()

        def validation_step(self, batch, batch_idx):
            return None

    caplog.set_level(logging.INFO, logger="lightning_diag")
    cb = DataDiagnostics()
    fit(cb, DataLoader(Odd(), batch_size=8), DataLoader(Odd(), batch_size=8), tmp_path, model=OddModel())
    notes = [r.getMessage() for r in caplog.records if "not examined" in r.getMessage()]
    assert len(notes) == 2 and "dict{'ids'" in notes[0] and "extract=" in notes[0]
    cb = DataDiagnostics(extract=lambda b: {"token_ids": torch.stack(b["ids"], 1), "labels": b["cls"]})
    fit(cb, DataLoader(Odd(), batch_size=8), DataLoader(Odd(), batch_size=8), tmp_path, model=OddModel())
    assert [a.rule for a in serious(cb)] == ["data_leakage"]  # the same 64 samples in both splits


class Augmented(Dataset):
    """Random augmentation in __getitem__ from the global RNGs: reading it must leave no trace."""

    def __init__(self) -> None:
        self.x, self.y = tokens(96, 1), labels(96, 1)

    def __len__(self) -> int:
        return 96

    def __getitem__(self, i):
        shift = int(torch.randint(0, 3, ()))
        return (self.x[i] + shift) % VOCAB, self.y[i]


@pytest.mark.parametrize("workers", [0, 2])
def test_the_run_is_bit_identical_with_and_without_the_callback(tmp_path, workers):
    weights = []
    for cb in (None, DataDiagnostics(max_batches=3)):
        pl.seed_everything(3, verbose=False)
        train = DataLoader(Augmented(), batch_size=8, shuffle=True, num_workers=workers, persistent_workers=workers > 0)
        val = DataLoader(Augmented(), batch_size=8)
        _, model = fit(cb, train, val, tmp_path, max_steps=6)
        weights.append([p.detach().clone() for p in model.parameters()])
        if cb is not None:
            assert cb.last["train/samples"] == 24
    assert all(torch.equal(a, b) for a, b in zip(*weights, strict=True))


class Stream(IterableDataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        g = torch.Generator().manual_seed(0)
        for _ in range(self.n):
            yield torch.randint(0, VOCAB, (SEQ,), generator=g), torch.randint(0, 4, (), generator=g)


def test_iterable_dataset_is_sampled_not_exhausted(tmp_path):
    cb = DataDiagnostics(max_batches=2)
    trainer, _ = fit(
        cb, DataLoader(Stream(10_000), batch_size=8), DataLoader(Stream(64), batch_size=8), tmp_path, max_steps=3
    )
    assert cb.last["train/samples"] == 16 and cb.last["val/samples"] == 16
    assert trainer.global_step == 3
    assert [a.rule for a in serious(cb)] == ["data_leakage"]  # both streams start with the same samples


def test_logged_tags(tmp_path, monkeypatch):
    experiment = MagicMock()
    monkeypatch.setattr(DiagWriter, "for_trainer", classmethod(lambda cls, trainer, log_dir: cls(experiment)))
    cb = DataDiagnostics()
    fit(cb, *loaders(tokens(500, 1), labels(500, 1), tokens(200, 2), labels(200, 2)), tmp_path)
    scalars = {c.args[0] for c in experiment.add_scalar.call_args_list}
    for name in (
        "diag/data/vocab_kl",
        "diag/data/oov_share",
        "diag/data/leaked_fraction",
        "diag/data/train/label_std",
        "diag/data/val/padding_ratio",
        "diag/data/train/head_types",
        "diag/data/seconds",
        "diag/threshold/data_vocab_shift",
        "diag/threshold/label_imbalance",
    ):
        assert name in scalars, name
    layout = dashboard_layout([k for k in cb.thresholds() if "." not in k])
    assert list(layout) == ["Data"]
    for title, (_kind, patterns) in layout["Data"].items():
        assert any(re.match(patterns[0], name) for name in scalars), title
    hists = {c.args[0] for c in experiment.add_histogram.call_args_list}
    assert {"diag/data/train/seq_len", "diag/data/val/token_ids"} <= hists
    assert [c.args[0] for c in experiment.add_image.call_args_list] == ["diag/data/label_distribution"]
    assert "diag/data/summary" in {c.args[0] for c in experiment.add_text.call_args_list}


def test_resume_does_not_repeat_what_was_reported(tmp_path):
    from pytorch_lightning.callbacks import ModelCheckpoint

    xt, yt = tokens(600, 1), labels(600, 1, (8, 1, 1, 1))
    data = loaders(xt, yt, tokens(200, 2), labels(200, 2))
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    cb = DataDiagnostics()
    trainer = pl.Trainer(
        default_root_dir=tmp_path,
        callbacks=[cb, ckpt],
        **{**FAST, "enable_checkpointing": True, "max_epochs": 1, "limit_val_batches": 1},
    )
    trainer.fit(TokenModel(), *data)
    assert [a.rule for a in cb.alerts] == ["label_imbalance"]
    saved = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)["callbacks"]
    (state,) = [v for k, v in saved.items() if "DataDiagnostics" in k]
    assert list(state["rules"]["latch"]) == ["label_imbalance:train"] and state["last_epoch"] == 0
    resumed = DataDiagnostics()
    trainer = pl.Trainer(
        default_root_dir=tmp_path, callbacks=[resumed], **{**FAST, "max_epochs": 2, "limit_val_batches": 1}
    )
    trainer.fit(TokenModel(), *data, ckpt_path=tmp_path / "ckpt" / "last.ckpt")
    assert resumed.alerts == []  # measured again, still imbalanced, already reported
    assert resumed.data_rules.latch.active == {"label_imbalance:train"}
    with pytest.raises(KeyError, match="last_epoch"):
        resumed.load_state_dict({"rules": {}, "last": {}})


@pytest.mark.parametrize(
    ("kwargs", "error", "needle"),
    [
        ({"max_batches": 0}, ValueError, "max_batches"),
        ({"max_batches": 2.5}, TypeError, "max_batches"),
        ({"rules": {"data_vocab_shift": {"threshold": -1}}}, ValueError, "threshold"),
        ({"rules": {"data_leakage": {"threshold": 1.5}}}, ValueError, "threshold"),
        ({"rules": {"data_leakage": {"near_duplicate": "high"}}}, TypeError, "near_duplicate"),
        ({"rules": {"label_imbalance": {"threshold": 0.7}}}, ValueError, "threshold"),
        ({"num_classes": 1}, ValueError, "num_classes"),
        ({"extract": 3}, TypeError, "extract"),
        ({"rules": {"data_leakage": {"shingle_size": 0}}}, ValueError, "shingle_size"),
        ({"every_n_epochs": 0}, ValueError, "every_n_epochs"),
        ({"pad_token_id": -1}, ValueError, "pad_token_id"),
    ],
)
def test_constructor_validation(kwargs, error, needle):
    with pytest.raises(error, match=needle):
        DataDiagnostics(**kwargs)


def test_report_fills_the_two_data_rows(tmp_path):
    from lightning_diag.report import build_report

    xt, yt = tokens(1000, 1), labels(1000, 1, (8, 1, 1, 1))
    xv, yv = tokens(300, 2), labels(300, 2)
    xv[:150] = xt[:150]
    fit(DataDiagnostics(max_batches=None), *loaders(xt, yt, xv, yv), tmp_path / "bad")
    fit(
        DataDiagnostics(), *loaders(tokens(1000, 3), labels(1000, 3), tokens(300, 4), labels(300, 4)), tmp_path / "good"
    )
    for run, status in (("bad", "fail"), ("good", "pass")):
        (report,) = build_report(tmp_path / run)
        rows = {c.id: c for c in report.checks}
        for check_id in ("data_label_balance", "data_train_test_overlap"):
            assert rows[check_id].status == status, (run, check_id, rows[check_id])
    (report,) = build_report(tmp_path / "bad")
    rows = {c.id: c for c in report.checks}
    assert rows["data_train_test_overlap"].measured_value["value"] == pytest.approx(0.5)
    assert rows["data_label_balance"].measured_value["train"] > 0.1


def test_every_n_epochs_measures_again_and_once_otherwise(tmp_path, monkeypatch):
    experiment = MagicMock()
    monkeypatch.setattr(DiagWriter, "for_trainer", classmethod(lambda cls, trainer, log_dir: cls(experiment)))
    data = loaders(tokens(64, 1), labels(64, 1), tokens(32, 2), labels(32, 2))
    for every, expected in ((None, [0]), (1, [0, 2, 4])):
        experiment.reset_mock()
        cb = DataDiagnostics(every_n_epochs=every)
        fit(cb, *data, tmp_path, max_steps=-1, max_epochs=3)
        steps = [
            c.args[2] if len(c.args) > 2 else c.kwargs["global_step"]
            for c in experiment.add_scalar.call_args_list
            if c.args[0] == "diag/data/vocab_kl"
        ]
        assert steps == expected
        assert cb.last_epoch == (2 if every else 0)
