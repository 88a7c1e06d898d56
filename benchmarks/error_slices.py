"""ErrorAnalysis on a text classifier whose validation set holds a planted hard group (issue 37 §1).

The task: binary classification of 24-token texts over a 1,000-token vocabulary. A sample of class ``c`` carries
3 of its class's 50 signal tokens among 21 neutral ones (a Zipf draw from 850 tokens); 4% of the labels are
flipped (the error a good model keeps outside the group). The **hard group** (``--hard-share``, 14%) carries the
three rare tokens 901, 902 and 903 at random positions, and its label is a coin flip independent of its text:
nothing about it can be learned, so about half of it stays wrong. The rare tokens also appear, one at a time, in
1% of the other samples. ``--noise`` flips that share of all labels instead (uniform label noise: nothing to find).

``--markers 10`` (issue 46 §3) marks the hard group differently: each of its samples carries **one** of ten marker
tokens 970–979 (each marker is on about 1.4% of the samples, too few to be a slice of its own), and 1% of the other
samples carry one of them too. ``--unrelated 0.08`` adds an unrelated hard group: that share of the other samples
comes from ``source=forum`` (returned as metadata by ``validation_step``; ``source=news`` otherwise) with a
coin-flip label, and no telling token.

One fit of an EmbeddingBag classifier (d 64, a hidden layer of 64, AdamW; 4,000 training and 1,000 validation
samples (``--val-size``), 4 epochs, one torch thread) with ``ErrorAnalysis()`` at its defaults, then it prints
the group's truth (size, error inside and outside), each finding ErrorAnalysis reported (size, error rate, lift,
p-value, kind and description, or defining features) and the alerts.

    PYTHONPATH=. .venv/bin/python benchmarks/error_slices.py                 # the planted group (about 30 s)
    PYTHONPATH=. .venv/bin/python benchmarks/error_slices.py --hard-share 0 --noise 0.25   # uniform noise
    PYTHONPATH=. .venv/bin/python benchmarks/error_slices.py --hard-share 0  # a healthy run
    PYTHONPATH=. .venv/bin/python benchmarks/error_slices.py --markers 10 --unrelated 0.08 --val-size 2000
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Sequence
from typing import Any

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_diag import ErrorAnalysis

VOCAB, LENGTH, SIGNAL = 1000, 24, 5
#: The rare tokens the hard group shares.
PLANTED = (901, 902, 903)
#: With ``markers=10``: each hard sample carries one of these.
MARKERS = tuple(range(970, 980))
_CLASS_TOKENS = ((10, 60), (60, 110))  # each class's 50 signal tokens
_NEUTRAL = (110, 960)


def planted_task(
    n: int, seed: int, hard_share: float = 0.14, flip: float = 0.03, noise: float = 0.0, markers: int = 0,
    unrelated: float = 0.0,
) -> tuple[TensorDataset, torch.Tensor]:
    """``n`` samples (ids ``[n, 24]``, with ``unrelated`` a source ``[n]`` (1 for "forum"), labels ``[n]``)
    and the mask of the hard group (see the module docstring).

    ``flip`` is the label noise outside the hard group; ``noise`` (uniform label noise) replaces it when given;
    ``markers`` (at most 10): each hard sample carries one of the first ``markers`` of :data:`MARKERS` instead of
    the three :data:`PLANTED` tokens; ``unrelated``: that share of the other samples is a hard ``forum`` source.
    """
    g = torch.Generator().manual_seed(seed)
    classes = torch.randint(0, 2, (n,), generator=g)
    ranks = torch.arange(1, _NEUTRAL[1] - _NEUTRAL[0] + 1, dtype=torch.float)
    neutral = torch.multinomial(1.0 / ranks, n * LENGTH, replacement=True, generator=g).view(n, LENGTH) + _NEUTRAL[0]
    low = torch.tensor([_CLASS_TOKENS[0][0], _CLASS_TOKENS[1][0]])[classes]
    signal = low[:, None] + torch.randint(0, 50, (n, SIGNAL), generator=g)
    ids = torch.cat([signal, neutral[:, SIGNAL:]], dim=1)
    ids = ids[torch.arange(n)[:, None], torch.argsort(torch.rand(n, LENGTH, generator=g), dim=1)]
    hard = torch.rand(n, generator=g) < hard_share
    slots = torch.argsort(torch.rand(n, LENGTH, generator=g), dim=1)
    tokens = torch.tensor(MARKERS[:markers] if markers else PLANTED)
    if markers:
        ids[hard, slots[hard, 0]] = tokens[torch.randint(0, len(tokens), (n,), generator=g)][hard]
        stray = ~hard & (torch.rand(n, generator=g) < 0.01)  # the markers, one at a time, elsewhere
    else:
        for i, token in enumerate(PLANTED):
            ids[hard, slots[hard, i]] = token
        stray = ~hard & (torch.rand(n, generator=g) < 0.01 * len(PLANTED))  # the rare tokens, one at a time
    picked = tokens[torch.randint(0, len(tokens), (n,), generator=g)]
    ids[stray, slots[stray, 0]] = picked[stray]
    labels = classes.clone()
    flipped = torch.rand(n, generator=g) < (noise if noise > 0 else flip)
    labels = torch.where(flipped, 1 - labels, labels)
    labels = torch.where(hard, torch.randint(0, 2, (n,), generator=g), labels)
    if not unrelated:
        return TensorDataset(ids, labels), hard
    forum = ~hard & (torch.rand(n, generator=g) < unrelated / (1 - hard_share))
    labels = torch.where(forum, torch.randint(0, 2, (n,), generator=g), labels)
    return TensorDataset(ids, forum.long(), labels), hard


class TextClassifier(pl.LightningModule):
    """Mean of token embeddings (d 64), a hidden layer of 64, two classes; ``validation_step`` returns logits."""

    def __init__(self, train: TensorDataset, val: TensorDataset, batch_size: int = 64) -> None:
        super().__init__()
        self.train_set, self.val_set, self.batch_size = train, val, batch_size
        self.embed = nn.EmbeddingBag(VOCAB, 64)
        self.head = nn.Sequential(nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, labels = batch[0], batch[-1]
        return nn.functional.cross_entropy(self(ids), labels)

    def validation_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        ids, labels = batch[0], batch[-1]
        logits = self(ids)
        self.log("val_loss", nn.functional.cross_entropy(logits, labels))
        if len(batch) < 3:
            return {"logits": logits}
        return {"logits": logits, "metadata": {"source": ["forum" if s else "news" for s in batch[1].tolist()]}}

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=250)


class History(pl.Callback):
    """Keeps a copy of ``ErrorAnalysis.last`` after every validation (listed after it, so it runs after it)."""

    def __init__(self, analysis: ErrorAnalysis, reports: list[dict[str, Any]]) -> None:
        self.analysis, self.reports = analysis, reports

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        last = self.analysis.last
        if last is not None and not any(r is last for r in self.reports):
            self.reports.append(last)


def run(
    root: str,
    hard_share: float = 0.14,
    noise: float = 0.0,
    epochs: int = 4,
    train_size: int = 4000,
    val_size: int = 1000,
    seed: int = 0,
    reports: list[dict[str, Any]] | None = None,
    markers: int = 0,
    unrelated: float = 0.0,
    **kwargs: Any,
) -> tuple[ErrorAnalysis, pl.Trainer, TextClassifier, torch.Tensor]:
    """One fit with ``ErrorAnalysis(**kwargs)``; returns the callback, the trainer, the model and the hard mask.
    ``reports``, when given, receives each validation's report (``ErrorAnalysis.last``); ``markers`` and
    ``unrelated`` as :func:`planted_task`'s. The callback writes ``<root>/diag/errors.json``."""
    torch.manual_seed(seed)
    train, _ = planted_task(train_size, seed + 1, hard_share, noise=noise, markers=markers, unrelated=unrelated)
    val, hard = planted_task(val_size, seed + 2, hard_share, noise=noise, markers=markers, unrelated=unrelated)
    model = TextClassifier(train, val)
    callback = ErrorAnalysis(**kwargs)
    extra = [History(callback, reports)] if reports is not None else []
    trainer = pl.Trainer(max_epochs=epochs, callbacks=[callback, *extra], default_root_dir=root,
                         logger=False,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                         num_sanity_val_steps=0)
    trainer.fit(model)
    return callback, trainer, model, hard


def truth(model: TextClassifier, hard: torch.Tensor) -> dict[str, float]:
    """The hard group's share and the final model's error inside it, outside it and overall."""
    ids, labels = model.val_set.tensors[0], model.val_set.tensors[-1]
    with torch.no_grad():
        wrong = (model(ids).argmax(-1) != labels).float()
    return {"share": float(hard.float().mean()), "inside": float(wrong[hard].mean()) if hard.any() else float("nan"),
            "outside": float(wrong[~hard].mean()), "overall": float(wrong.mean())}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hard-share", type=float, default=0.14, help="share of the planted hard group (0: none)")
    parser.add_argument("--noise", type=float, default=0.0, help="uniform label noise on every sample instead")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--val-size", type=int, default=1000, help="validation samples")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--markers", type=int, default=0, help="mark the group by one of N marker tokens (0: 901-903)")
    parser.add_argument("--unrelated", type=float, default=0.0, help="share of an unrelated hard source=forum group")
    args = parser.parse_args(argv)
    if not 0 <= args.hard_share < 1 or not 0 <= args.noise < 1 or not 0 <= args.unrelated < 1 - args.hard_share:
        parser.error("--hard-share, --noise and --unrelated must be in [0, 1) (and --unrelated below 1 - --hard-share)")
    if not 0 <= args.markers <= len(MARKERS):
        parser.error(f"--markers must be in [0, {len(MARKERS)}]")
    if args.epochs < 1 or args.val_size < 100:
        parser.error("--epochs must be >= 1 and --val-size >= 100")
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as root:
        reports: list[dict[str, Any]] = []
        callback, _, model, hard = run(root, args.hard_share, args.noise, args.epochs, seed=args.seed,
                                       reports=reports, markers=args.markers, unrelated=args.unrelated,
                                       val_size=args.val_size)
    t = truth(model, hard)
    tokens = list(MARKERS[:args.markers]) if args.markers else list(PLANTED)
    print(f"planted group: {t['share']:.1%} of {len(hard)} validation samples, tokens {tokens}; final error "
          f"{t['inside']:.3f} inside, {t['outside']:.3f} outside, {t['overall']:.3f} overall")
    for report in reports:
        line = f"validation at step {report['step']}: error rate {report['error_rate']:.3f}"
        found = report["findings"] or report["slices"][:1]
        what = "finding" if report["findings"] else "most significant slice"
        for top in found:
            line += (f"; {what}: {top['share']:.1%} of the samples, error rate {top['error_rate']:.3f}, lift "
                     f"{top['lift']:.2f}x, corrected p {top['p_adjusted']:.1e}, "
                     + (f"{top['kind']}: {top['description']}" if "kind" in top
                        else f"features {', '.join(top['features'])}"))
        print(line)
    last = callback.last or {}
    print(f"ErrorAnalysis at step {last.get('step')}: error rate {last.get('error_rate', float('nan')):.3f}, "
          f"{last.get('slices_tested', 0)} slices tested")
    print("| finding | samples | share | error rate | rest | lift | p (corrected) | kind | samples ... | members |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for i, f in enumerate(last.get("findings", [])):
        print(f"| {i} | {f['size']} | {f['share']:.1%} | {f['error_rate']:.3f} | {f['rest_error_rate']:.3f} | "
              f"{f['lift']:.2f}x | {f['p_adjusted']:.1e} | {f['kind']} | {f['description']} | {len(f['members'])} |")
    if last.get("slices"):
        top = last["slices"][0]
        print(f"most significant slice: {', '.join(top['features'])}: {top['share']:.1%} of the samples, error rate "
              f"{top['error_rate']:.3f}, lift {top['lift']:.2f}x, p {top['p_value']:.1e} ({top['p_adjusted']:.1e} "
              "corrected)")
    alerts = [a for a in callback.alerts if a.rule == "error_cluster"]
    print(f"error_cluster alerts: {len(alerts)}")
    for a in alerts:
        print(f"  step {a.global_step}: {a.message}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
