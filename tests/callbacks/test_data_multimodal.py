"""``data_leakage`` judges a multimodal sample as a whole: templated prompts with different images are no leak."""

from __future__ import annotations

import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_diag import DataDiagnostics

FAST = dict(
    accelerator="cpu",
    enable_progress_bar=False,
    enable_model_summary=False,
    enable_checkpointing=False,
    num_sanity_val_steps=0,
    logger=False,
)
PROMPTS = [[5, 9, 12, 7, 3], [5, 9, 14, 7, 3], [5, 11, 12, 7, 3], [5, 11, 14, 7, 3]]  # "describe the image" x 4


class Captioned(Dataset):
    """A short templated prompt and an image per sample; ``images`` names the images' dtype."""

    def __init__(self, n: int, seed: int, images: str = "float", subset_of: Captioned | None = None) -> None:
        g = torch.Generator().manual_seed(seed)
        self.images = images
        self.ids = torch.tensor([PROMPTS[i % len(PROMPTS)] for i in range(n)])
        self.pixels = torch.randn(n, 3, 8, 8, generator=g)
        self.labels = torch.randint(0, 4, (n,), generator=g)
        if subset_of is not None:  # a validation set copied from the training set
            pick = torch.randperm(len(subset_of), generator=g)[:n]
            self.ids, self.pixels, self.labels = subset_of.ids[pick], subset_of.pixels[pick], subset_of.labels[pick]

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int):
        pixels = self.pixels[i]
        if self.images == "uint8":
            pixels = ((pixels.clamp(-2, 2) + 2) * 60).to(torch.uint8)
        return {
            "input_ids": self.ids[i],
            "attention_mask": torch.ones_like(self.ids[i]),
            "pixel_values": pixels,
            "labels": self.labels[i],
        }


class VisionLanguage(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(16, 8)
        self.vision = nn.Linear(3 * 8 * 8, 8)
        self.head = nn.Linear(8, 4)

    def _loss(self, batch):
        h = self.embed(batch["input_ids"]).mean(1) + self.vision(batch["pixel_values"].float().flatten(1))
        return nn.functional.cross_entropy(self.head(h), batch["labels"])

    def training_step(self, batch, batch_idx):
        return self._loss(batch)

    def validation_step(self, batch, batch_idx):
        return self._loss(batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(train: Dataset, val: Dataset, tmp_path) -> DataDiagnostics:
    cb = DataDiagnostics(max_batches=8)
    trainer = pl.Trainer(default_root_dir=tmp_path, callbacks=[cb], max_steps=2, limit_val_batches=1, **FAST)
    trainer.fit(VisionLanguage(), DataLoader(train, batch_size=16, shuffle=True), DataLoader(val, batch_size=16))
    return cb


@pytest.mark.parametrize("images", ["float", "uint8"])
def test_templated_prompts_with_different_images_are_no_leak(tmp_path, images):
    cb = fit(Captioned(256, 1, images), Captioned(128, 2, images), tmp_path)
    assert [a.format() for a in cb.alerts if a.rule == "data_leakage" and a.severity != "info"] == []
    assert cb.last["leaked_fraction"] == 0.0
    (note,) = [a for a in cb.alerts if a.rule == "data_leakage"]  # the text alone repeats: said, as info
    assert "repeat a training sample's token ids with other `pixel_values`: not counted as leaks" in note.message


@pytest.mark.parametrize("images", ["float", "uint8"])
def test_the_same_samples_in_both_splits_are_still_a_leak_naming_what_was_compared(tmp_path, images):
    train = Captioned(256, 1, images)
    cb = fit(train, Captioned(64, 3, images, subset_of=train), tmp_path)
    leaks = [a for a in cb.alerts if a.rule == "data_leakage" and a.severity == "warning"]
    assert len(leaks) == 1, [a.format() for a in cb.alerts]
    assert "compared: token ids and `pixel_values`" in leaks[0].message
    assert cb.last["leaked_fraction"] == 1.0  # half the training set read: half the copies found, extrapolated


def test_text_only_batches_still_compare_token_ids(tmp_path):
    train = Captioned(256, 1)
    text_only = Captioned(64, 3, subset_of=train)
    text_only.pixels = torch.randn_like(text_only.pixels)  # same prompts and labels, other images

    class Text(Dataset):
        def __init__(self, inner: Captioned) -> None:
            self.inner = inner

        def __len__(self) -> int:
            return len(self.inner)

        def __getitem__(self, i: int):
            item = dict(self.inner[i])
            del item["pixel_values"]
            return item

    # without the images, the templated prompts are the same text: an honest (if unhelpful) leak
    cb = DataDiagnostics(max_batches=8)
    model = VisionLanguage()
    model._loss = lambda batch: nn.functional.cross_entropy(  # type: ignore[method-assign]
        model.head(model.embed(batch["input_ids"]).mean(1)), batch["labels"]
    )
    trainer = pl.Trainer(default_root_dir=tmp_path, callbacks=[cb], max_steps=2, limit_val_batches=1, **FAST)
    trainer.fit(model, DataLoader(Text(train), batch_size=16), DataLoader(Text(text_only), batch_size=16))
    leaks = [a for a in cb.alerts if a.rule == "data_leakage" and a.severity == "warning"]
    assert len(leaks) == 1 and "(compared: token ids)" in leaks[0].message


def test_a_per_sample_index_in_the_batch_does_not_hide_a_leak(tmp_path):
    class Indexed(Dataset):
        def __init__(self, inner: Captioned, offset: int) -> None:
            self.inner, self.offset = inner, offset

        def __len__(self) -> int:
            return len(self.inner)

        def __getitem__(self, i: int):
            return {**self.inner[i], "idx": torch.tensor(self.offset + i)}  # a 1-D value: no content

    train = Captioned(256, 1)
    cb = fit(Indexed(train, 0), Indexed(Captioned(64, 3, subset_of=train), 10_000), tmp_path)
    assert [a.rule for a in cb.alerts if a.severity == "warning"] == ["data_leakage"]
