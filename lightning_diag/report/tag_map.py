"""Which of a plain Lightning run's own tags are its training loss, validation loss, learning rate and epoch.

A run trained without lightning_diag callbacks has only what the user logged: ``self.log("train_loss", ...)``
(``train_loss``, or ``train_loss_step`` and ``train_loss_epoch`` with ``on_epoch=True``), ``val_loss`` or
``val/loss``, ``LearningRateMonitor``'s ``lr-Adam`` or ``lr-AdamW/pg1``, and Lightning's ``epoch``. :func:`auto_map`
picks one tag per :data:`ROLES` entry from the logged names; ``lightning-diag report --map ROLE=TAG`` overrides
it (:func:`parse_overrides` checks the option). Imports neither torch nor Lightning.

Example:
    >>> found = auto_map(["epoch", "train_loss_step", "train_loss_epoch", "val/loss", "lr-AdamW/pg1", "hp_metric"])
    >>> found["train_loss"], found["train_loss_epoch"], found["val_loss"], found["lr"], found["epoch"]
    ('train_loss_step', 'train_loss_epoch', 'val/loss', 'lr-AdamW/pg1', 'epoch')
    >>> parse_overrides(["val_loss=valid/nll"])
    {'val_loss': 'valid/nll'}
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

__all__ = ["ROLES", "auto_map", "is_candidate", "parse_overrides"]

#: What each role is, in the order shown (``--map ROLE=TAG``).
ROLES: dict[str, str] = {
    "train_loss": "the training loss of each logged step",
    "train_loss_epoch": "the training loss's epoch mean (Lightning's <name>_epoch with on_epoch=True)",
    "val_loss": "the validation loss, one value per validation run",
    "lr": "the learning rate (LearningRateMonitor's lr-<Optimizer>)",
    "epoch": "the epoch of each step (Lightning logs it as `epoch`)",
}
_WORDS = re.compile(r"[/_\-.\s]+")
_EVAL_WORDS = {"val", "valid", "validation", "test", "eval", "dev", "predict"}
#: Preferred exact names, best first.
_TRAIN = (
    "train_loss_step",
    "train/loss_step",
    "train_loss",
    "train/loss",
    "loss_step",
    "loss",
    "training_loss",
    "training/loss",
    "train/loss/step",
)
_TRAIN_EPOCH = ("train_loss_epoch", "train/loss_epoch", "loss_epoch", "training_loss_epoch", "train/loss/epoch")
_VAL = (
    "val_loss",
    "val/loss",
    "valid_loss",
    "valid/loss",
    "validation_loss",
    "validation/loss",
    "val_loss_epoch",
    "val/loss_epoch",
    "loss/val",
    "val_loss/epoch",
)


def _words(name: str) -> list[str]:
    return [w for w in _WORDS.split(name.lower()) if w]


def _is_loss(name: str) -> bool:
    return "loss" in name.lower()


def is_candidate(name: str) -> bool:
    """Whether a tag may fill a role (a loss, a learning rate, the epoch): the report keeps only these."""
    lower = name.lower()
    return "loss" in lower or lower.startswith("lr-") or lower == "epoch"


def _best(names: Sequence[str], preferred: Sequence[str], fallback: bool) -> str | None:
    """The first ``preferred`` name present (any case); else, with ``fallback``, a ``_step`` tag before the
    others, the shortest first."""
    by_lower = {n.lower(): n for n in names}
    for want in preferred:
        if want in by_lower:
            return by_lower[want]
    if not fallback or not names:
        return None
    return min(names, key=lambda n: (not n.lower().endswith("step"), len(n), n))


def auto_map(tags: Iterable[str]) -> dict[str, str]:
    """The tag of each role found among ``tags`` (a role whose tag is not found is left out).

    Training loss: a preferred name (``train_loss_step``, ``train_loss``, ``train/loss``, ``loss``, ...), else the
    shortest tag holding ``loss`` and no validation or test word, per step (``_step``) before plain before its
    epoch mean (``_epoch``). Validation loss: ``val_loss``, ``val/loss``, ``valid_loss``, ... else the shortest
    loss tag with a ``val``/``valid``/``validation`` word. Learning rate: the first ``lr-`` tag that is not a
    momentum. Epoch: ``epoch``.
    """
    names = sorted(set(tags))
    losses = [n for n in names if _is_loss(n) and not n.startswith("diag/")]
    train = [n for n in losses if not _EVAL_WORDS & set(_words(n))]
    val = [n for n in losses if {"val", "valid", "validation"} & set(_words(n))]
    step_like = [n for n in train if not n.lower().endswith("epoch")]
    epoch_like = [n for n in train if n.lower().endswith("epoch")]
    out: dict[str, str] = {}
    chosen = _best(step_like, _TRAIN, fallback=True)
    if chosen is not None:
        out["train_loss"] = chosen
        stem = re.sub(r"[_/]?step$", "", chosen, flags=re.IGNORECASE)
        sibling = [n for n in epoch_like if re.sub(r"[_/]?epoch$", "", n, flags=re.IGNORECASE) == stem]
        epoch = sibling[0] if sibling else _best(epoch_like, _TRAIN_EPOCH, fallback=False)
        if epoch is not None:
            out["train_loss_epoch"] = epoch
    elif epoch_like:
        out["train_loss_epoch"] = _best(epoch_like, _TRAIN_EPOCH, fallback=True) or epoch_like[0]
    chosen = _best([n for n in val if not n.lower().endswith("step")], _VAL, fallback=True)
    if chosen is not None:
        out["val_loss"] = chosen
    rates = [n for n in names if n.lower().startswith("lr-") and "momentum" not in n.lower()]
    if rates:
        out["lr"] = rates[0]
    if "epoch" in names:
        out["epoch"] = "epoch"
    return out


def parse_overrides(items: Sequence[str] | None) -> dict[str, str]:
    """``["ROLE=TAG", ...]`` (``--map``) as ``{role: tag}``.

    Raises:
        ValueError: One line naming the item and what is wrong: no ``=``, an empty tag, an unknown role (the
            allowed roles listed) or a role given twice.
    """
    out: dict[str, str] = {}
    for item in items or ():
        role, sep, tag = item.partition("=")
        role, tag = role.strip(), tag.strip()
        if not sep or not tag:
            raise ValueError(f"--map {item!r}: expected ROLE=TAG, for example --map val_loss=valid/nll")
        if role not in ROLES:
            raise ValueError(f"--map {item!r}: unknown role {role!r}; the roles are {', '.join(ROLES)}")
        if role in out:
            raise ValueError(f"--map {item!r}: {role} is mapped twice")
        out[role] = tag
    return out
