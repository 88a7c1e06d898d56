"""Learning rates of every optimizer and parameter group, named as ``diag/lr/<Optimizer>/group_<j>`` logs them."""

from __future__ import annotations

import pytorch_lightning as pl

from lightning_diag.core.tags import lr_tag

__all__ = ["learning_rates", "lr_scalars"]


def learning_rates(trainer: pl.Trainer) -> dict[str, float]:
    """``"<Optimizer>/group_<j>" -> lr`` for every optimizer of the trainer.

    A second optimizer of the same class is ``<Optimizer>_1``, a third ``<Optimizer>_2``; groups without an
    ``lr`` are left out.
    """
    names: dict[str, int] = {}
    out: dict[str, float] = {}
    for opt in trainer.optimizers:
        base = type(opt).__name__
        n = names.get(base, 0)
        names[base] = n + 1
        name = base if n == 0 else f"{base}_{n}"
        for j, group in enumerate(opt.param_groups):
            lr = group.get("lr")
            if lr is not None:
                out[f"{name}/group_{j}"] = float(lr)
    return out


def lr_scalars(trainer: pl.Trainer) -> dict[str, float]:
    """The learning rates under their ``diag/lr/...`` tags."""
    return {lr_tag(*name.split("/")): lr for name, lr in learning_rates(trainer).items()}
