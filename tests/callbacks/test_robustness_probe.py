"""RobustnessProbe through real fits: a model keyed on exact token order is caught, a bag-of-words one is not."""

import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_diag import RobustnessProbe
from lightning_diag.stats.perturb import adjacent_swaps, random_replacements
from tests.callbacks.test_error_analysis import BagClassifier, topic_task

VOCAB, LENGTH, CLASSES = 40, 24, 16


class ExactOrderModel(pl.LightningModule):
    """Predicts with a fixed random linear map of the one-hot sequence: every token at every position counts,
    so one changed or moved token often flips the prediction. Its labels are its own clean predictions."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.register_buffer("code", torch.randn(LENGTH * VOCAB, CLASSES, generator=g) * 3)
        self.bias = nn.Parameter(torch.zeros(CLASSES))
        ids = torch.randint(0, VOCAB, (256, LENGTH), generator=g)
        self.data = TensorDataset(ids, self(ids).argmax(-1))

    def forward(self, ids):
        return nn.functional.one_hot(ids, VOCAB).flatten(1).float() @ self.code + self.bias

    def training_step(self, batch, batch_idx):
        ids, labels = batch
        return nn.functional.cross_entropy(self(ids), labels)

    def validation_step(self, batch, batch_idx):
        return {"logits": self(batch[0])}

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=64)

    def val_dataloader(self):
        return DataLoader(self.data, batch_size=128)


def fit(tmp_path, model, epochs=1, **kwargs):
    probe = RobustnessProbe(**kwargs)
    trainer = pl.Trainer(max_epochs=epochs, callbacks=[probe], default_root_dir=tmp_path, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0)
    trainer.fit(model)
    return probe, trainer


def test_a_model_keyed_on_exact_tokens_is_caught(tmp_path):
    torch.manual_seed(0)
    model = ExactOrderModel()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    probe, _ = fit(tmp_path, model, epochs=2)
    result = probe.last_result
    assert result is not None and result.metric == "accuracy" and result.clean == 1.0
    assert result.drops["replace"] > 0.15 and result.drops["swap"] > 0.15, result
    alerts = [a for a in probe.alerts if a.rule == "robustness_drop"]
    assert len(alerts) == 1, probe.alerts  # both kinds at the first probe: one alert; the second probe is latched
    assert "replace" in alerts[0].message and "swap" in alerts[0].message
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # lr 0 and the sandbox


def test_a_bag_of_words_model_is_robust(tmp_path):
    torch.manual_seed(0)
    model = BagClassifier(topic_task(1200, 1), topic_task(600, 2))
    probe, _ = fit(tmp_path, model, epochs=3)
    result = probe.last_result
    assert result is not None and result.clean > 0.9
    assert all(d < 0.15 for d in result.drops.values()), result
    assert probe.alerts == []


def test_the_probe_leaves_training_bit_identical(tmp_path):
    def run(with_probe):
        torch.manual_seed(0)
        model = BagClassifier(topic_task(300, 1), topic_task(200, 2))
        callbacks = [RobustnessProbe()] if with_probe else []
        pl.Trainer(max_epochs=2, callbacks=callbacks, default_root_dir=tmp_path, enable_progress_bar=False,
                   enable_model_summary=False, enable_checkpointing=False, logger=False,
                   num_sanity_val_steps=0).fit(model)
        return model.state_dict()

    plain, probed = run(False), run(True)
    assert all(torch.equal(plain[k], probed[k]) for k in plain)


def test_the_latch_survives_a_resume(tmp_path):
    probe, trainer = fit(tmp_path, ExactOrderModel())
    assert probe.alerts
    ckpt = tmp_path / "probe.ckpt"
    trainer.save_checkpoint(ckpt)
    again = RobustnessProbe()
    resumed = pl.Trainer(max_epochs=2, callbacks=[again], default_root_dir=tmp_path, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0)
    resumed.fit(ExactOrderModel(), ckpt_path=ckpt)
    assert again.last_result is not None and again.alerts == []  # still brittle: the same event


def test_perturbations_respect_padding():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 30, (8, 20))
    mask = torch.ones_like(ids)
    mask[:, 15:] = 0
    for out in (random_replacements(ids, 0.5, 30, g, mask), adjacent_swaps(ids, 0.5, g, mask)):
        assert torch.equal(out[:, 15:], ids[:, 15:])
        assert not torch.equal(out[:, :15], ids[:, :15])


@pytest.mark.parametrize(
    ("kwargs", "error", "needle"),
    [
        ({"rules": {"robustness_drop": {"threshold": 1.5}}}, ValueError, "threshold"),
        ({"rules": {"robustness_drop": {"rate": -0.1}}}, ValueError, "rate"),
        ({"perturbations": ("typo",)}, ValueError, "`perturbations`"),
        ({"perturbations": ()}, ValueError, "`perturbations`"),
        ({"vocab_size": 1}, ValueError, "`vocab_size`"),
        ({"perturb": "x"}, TypeError, "`perturb`"),
    ],
)
def test_bad_configuration_is_refused(kwargs, error, needle):
    with pytest.raises(error, match=needle):
        RobustnessProbe(**kwargs)
