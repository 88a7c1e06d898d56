"""Healthy and faulty text classifiers for the opt-in probes that read predictions (issue 44).

``ErrorAnalysis`` needs a ``validation_step`` that returns predictions and ``RobustnessProbe`` a model whose
answer should survive a few perturbed tokens; none of the fault library's models is both. These tasks are the
classification users run those two callbacks on:

* the planted-group text task of ``benchmarks/error_slices.py`` (binary topics of 24-token texts over a 1,000-token
  vocabulary, 3% of the labels flipped): healthy **without** a hard group, with an EmbeddingBag classifier or a
  2-layer BERT from a config, and with 25% uniform label noise (errors everywhere, nothing to find);
* the same task **with** a hard group of 14% (three rare tokens, or one of ten marker tokens, and a coin-flip
  label): ``error_cluster`` must name it;
* a classifier keyed on exact token order (a one-hot, position-by-position linear model trained on labels that
  every token at every position decides): a 5% typo flips its answers, ``robustness_drop`` must fire. Its healthy
  twin is the bag-of-words classifier above.

Every run trains with the defaults, ``ErrorAnalysis()``, ``RobustnessProbe()``, ``DataDiagnostics()`` and
``SystemMonitor()`` at their defaults; :func:`run_task` is what the calibration harness calls.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import TensorDataset

from benchmarks.error_slices import VOCAB, TextClassifier, planted_task

#: The exact-order task: vocabulary, sequence length and classes.
ORDER_VOCAB, ORDER_LENGTH, ORDER_CLASSES = 8, 24, 16
#: The opt-in callbacks every probe task attaches beyond the defaults.
PROBE_CALLBACKS = ("ErrorAnalysis", "RobustnessProbe", "DataDiagnostics", "SystemMonitor")


@dataclasses.dataclass(frozen=True)
class ProbeTask:
    """One task.

    Attributes:
        name: Key in :data:`TASKS`.
        description: What it is, one sentence.
        net: ``"bag"`` (EmbeddingBag), ``"bert"`` (a 2-layer BERT from a config) or ``"order"`` (exact order).
        expected: Rules that must fire (empty: healthy).
        data: :func:`~benchmarks.error_slices.planted_task` keywords (``hard_share``, ``noise``, ``markers``).
        epochs: Training epochs (one validation each).
    """

    name: str
    description: str
    net: str
    expected: tuple[str, ...] = ()
    data: dict[str, Any] = dataclasses.field(default_factory=dict)
    epochs: int = 4


TASKS: dict[str, ProbeTask] = {
    t.name: t
    for t in (
        ProbeTask("text_bag", "bag-of-words topic classifier, no hard group", "bag", data={"hard_share": 0.0}),
        ProbeTask(
            "text_bag_noise",
            "bag-of-words classifier on labels with 25% uniform noise: errors everywhere, no group",
            "bag",
            data={"hard_share": 0.0, "noise": 0.25},
        ),
        ProbeTask("text_bert", "2-layer BERT topic classifier, no hard group", "bert", data={"hard_share": 0.0}),
        ProbeTask(
            "text_group",
            "bag-of-words classifier; 14% of the texts carry three rare tokens and a coin-flip label",
            "bag",
            ("error_cluster",),
            {"hard_share": 0.14},
        ),
        ProbeTask(
            "text_markers_bert",
            "2-layer BERT; 14% of the texts carry one of ten marker tokens and a coin-flip label",
            "bert",
            ("error_cluster",),
            {"hard_share": 0.14, "markers": 10},
        ),
        ProbeTask(
            "exact_order",
            "a position-by-position linear classifier whose labels every token decides: a typo flips it "
            "(healthy twin: `text_bag`)",
            "order",
            ("robustness_drop",),
            epochs=6,
        ),
    )
}


class BertTextClassifier(TextClassifier):
    """:class:`~benchmarks.error_slices.TextClassifier` with a 2-layer BERT (d 64, 4 heads) from a config."""

    def __init__(self, train: TensorDataset, val: TensorDataset, batch_size: int = 64) -> None:
        super().__init__(train, val, batch_size)
        from transformers import BertConfig, BertForSequenceClassification

        del self.embed, self.head
        self.net = BertForSequenceClassification(
            BertConfig(
                vocab_size=VOCAB,
                hidden_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                intermediate_size=128,
                max_position_embeddings=32,
                **{"num_labels": 2},  # a PretrainedConfig keyword BertConfig's signature does not declare
            )
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.net(input_ids=ids).logits

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def order_task(n: int, seed: int) -> TensorDataset:
    """``n`` random sequences labelled by a fixed random linear map of their one-hot tokens (the same map for
    every seed): every token at every position moves the answer."""
    teacher = torch.Generator().manual_seed(1234)
    code = torch.randn(ORDER_LENGTH * ORDER_VOCAB, ORDER_CLASSES, generator=teacher)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, ORDER_VOCAB, (n, ORDER_LENGTH), generator=g)
    labels = (nn.functional.one_hot(ids, ORDER_VOCAB).flatten(1).float() @ code).argmax(-1)
    return TensorDataset(ids, labels)


class OrderClassifier(TextClassifier):
    """One linear map of the one-hot sequence (each position its own weights), trained on :func:`order_task`."""

    def __init__(self, train: TensorDataset, val: TensorDataset, batch_size: int = 64) -> None:
        super().__init__(train, val, batch_size)
        del self.embed, self.head
        self.linear = nn.Linear(ORDER_LENGTH * ORDER_VOCAB, ORDER_CLASSES)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.linear(nn.functional.one_hot(ids, ORDER_VOCAB).flatten(1).float())


def build(task: ProbeTask, seed: int) -> TextClassifier:
    """The task's model and data for ``seed`` (the model initialised from ``seed``)."""
    if task.net == "order":
        train, val = order_task(8000, seed + 1), order_task(1000, seed + 2)
        torch.manual_seed(seed)
        return OrderClassifier(train, val)
    train, _ = planted_task(4000, seed + 1, **task.data)
    val, _ = planted_task(1000, seed + 2, **task.data)
    torch.manual_seed(seed)
    return BertTextClassifier(train, val) if task.net == "bert" else TextClassifier(train, val)


def run_task(name: str, callbacks: list[pl.Callback], trainer_kwargs: dict[str, Any], seed: int) -> pl.Trainer:
    """Fit task ``name`` with ``seed`` and ``callbacks``; ``trainer_kwargs`` are the harness's trainer settings."""
    task = TASKS[name]
    model = build(task, seed)
    pl.seed_everything(seed, verbose=False)
    trainer = pl.Trainer(**{**trainer_kwargs, "max_epochs": task.epochs, "callbacks": callbacks})
    trainer.fit(model)
    return trainer


__all__ = ["PROBE_CALLBACKS", "TASKS", "ProbeTask", "build", "order_task", "run_task"]
