"""The ``train_override_bypassed`` check runs the user's ``train()`` on a ``meta`` copy of the model, never on the
live model (issue 43): an override's side effects (a counter, a re-initialised weight) leave the model untouched."""

from __future__ import annotations

import logging

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_diag import AnomalyAlarm
from lightning_diag.instrument.runtime_probes import meta_copy, train_override_effects


class Noisy(nn.Module):
    """An override with side effects: it counts its calls, re-initialises the head and freezes the stem."""

    def __init__(self) -> None:
        super().__init__()
        self.stem, self.head = nn.Linear(4, 8), nn.Linear(8, 1)
        self.register_buffer("seen", torch.zeros(3))
        self.calls = 0
        self.history: list[bool] = []

    def train(self, mode: bool = True) -> Noisy:
        super().train(mode)
        self.calls += 1
        self.history.append(mode)
        nn.init.normal_(self.head.weight)
        self.seen.add_(1.0)
        self.stem.requires_grad_(not mode)
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.stem(x)))


def test_the_override_runs_on_a_copy_and_the_live_model_is_untouched() -> None:
    net = Noisy()
    weights = {k: v.clone() for k, v in net.state_dict().items()}
    notes: list[str] = []
    to_eval, frozen = train_override_effects(net, notes)
    assert (to_eval, frozen, notes) == ([], ["stem.bias", "stem.weight"], [])
    assert net.calls == 0 and net.history == []  # the counter and the list are the copy's
    assert all(torch.equal(v, weights[k]) for k, v in net.state_dict().items())  # bitwise equal
    assert all(p.requires_grad and p.device.type == "cpu" for p in net.parameters())


def test_meta_copy_keeps_shapes_flags_and_shared_parameters_without_storage() -> None:
    shared = nn.Linear(3, 3)
    net = nn.Sequential(shared, nn.BatchNorm1d(3), shared)
    net[1].eval()
    net[0].bias.requires_grad_(False)
    hits = []
    net.register_forward_hook(lambda *args: hits.append(1))
    twin = meta_copy(net)
    assert [n for n, _ in twin.named_modules()] == [n for n, _ in net.named_modules()]
    assert twin[0] is twin[2] and twin[0] is not shared  # sharing kept, inside the copy
    assert all(p.device.type == "meta" for p in [*twin.parameters(), *twin.buffers()])
    assert [p.shape for p in twin.parameters()] == [p.shape for p in net.parameters()]
    assert [p.requires_grad for p in twin.parameters()] == [p.requires_grad for p in net.parameters()]
    assert [m.training for m in twin.modules()] == [m.training for m in net.modules()]
    assert not twin._forward_hooks and len(net._forward_hooks) == 1  # hooks are not copied, nor removed


def test_an_override_that_reads_values_cannot_run_on_meta_and_says_so() -> None:
    class ReadsValues(nn.Linear):
        def train(self, mode: bool = True) -> ReadsValues:
            super().train(mode)
            if float(self.weight.abs().sum()) > 0:  # needs the values: a meta tensor has none
                self.requires_grad_(False)
            return self

    net = nn.Sequential(ReadsValues(2, 2))
    notes: list[str] = []
    assert train_override_effects(net, notes) == ([], [])
    assert len(notes) == 1 and "raised on the copy" in notes[0]
    assert all(p.requires_grad for p in net.parameters())


def test_a_tree_that_cannot_be_copied_is_not_checked_and_says_why() -> None:
    import threading

    class Locked(nn.Linear):
        def __init__(self) -> None:
            super().__init__(2, 2)
            self.lock = threading.Lock()  # deepcopy cannot copy a lock

        def train(self, mode: bool = True) -> Locked:
            return super().train(mode)

    notes: list[str] = []
    assert train_override_effects(nn.Sequential(Locked()), notes) == ([], [])
    assert len(notes) == 1 and "could not be copied" in notes[0]


class _Module(pl.LightningModule):
    """A LightningModule whose ``train()`` override counts and freezes the stem (Lightning never calls it)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = Noisy()

    def train(self, mode: bool = True) -> _Module:
        super().train(mode)
        self.net.stem.requires_grad_(not mode)
        return self

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_in_a_fit_the_check_fires_and_the_model_trains_as_without_it(tmp_path, caplog) -> None:
    def fit(callbacks: list[pl.Callback]) -> tuple[_Module, list]:
        pl.seed_everything(0, verbose=False)
        model = _Module()
        data = DataLoader(TensorDataset(torch.randn(32, 4), torch.randn(32, 1)), batch_size=8)
        trainer = pl.Trainer(
            max_steps=3,
            accelerator="cpu",
            default_root_dir=tmp_path,
            callbacks=callbacks,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
        )
        trainer.fit(model, data)
        return model, [cb for cb in callbacks if isinstance(cb, AnomalyAlarm)]

    bare, _ = fit([])
    with caplog.at_level(logging.WARNING, logger="lightning_diag"):
        watched, (alarm,) = fit([AnomalyAlarm()])
    assert watched.net.calls == bare.net.calls == 0 and watched.net.history == []
    assert all(
        torch.equal(a, b) for a, b in zip(bare.state_dict().values(), watched.state_dict().values(), strict=True)
    )
    fired = [a for a in alarm.alerts if a.rule == "train_override_bypassed"]
    assert len(fired) == 1 and "net.stem.weight" in fired[0].message
    assert "not checked" not in caplog.text
