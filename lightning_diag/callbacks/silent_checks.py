"""AnomalyAlarm's checks of silent errors: replicas that drift apart (``ddp_desync``) and modules left in eval
mode while they train (``eval_mode_in_training``).

Two helpers :class:`~lightning_diag.AnomalyAlarm` owns, thin adapters over :mod:`lightning_diag.rules.replicas`
and :mod:`lightning_diag.rules.train_mode`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.strategies import DDPStrategy
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.dropout import _DropoutNd

from lightning_diag.core.tags import replicas_tag
from lightning_diag.rules.replicas import DDP_DESYNC, DesyncRule
from lightning_diag.rules.train_mode import EvalModeRule
from lightning_diag.stats.updates import parameter_checksums

if TYPE_CHECKING:  # pragma: no cover
    from lightning_diag.callbacks.base import DiagCallback

__all__ = ["ReplicaCheck", "TrainModeCheck"]


def _replicated(trainer: pl.Trainer) -> bool:
    """Whether the strategy keeps whole replicas of every parameter (DDP, DDP spawn), not shards."""
    strategy = trainer.strategy
    return isinstance(strategy, DDPStrategy) and "DeepSpeed" not in type(strategy).__name__


class ReplicaCheck:
    """``ddp_desync``: every ``every_n_steps`` optimizer steps, one checksum pair per parameter on each rank, one
    ``all_gather`` of them and one host read; every rank judges the same gathered values.

    Under sharded strategies (FSDP, ``ModelParallelStrategy``, DeepSpeed) each rank holds shards, not replicas: the
    check is skipped, said once in a notice.
    """

    def __init__(self, owner: DiagCallback, every_n_steps: int, tolerance: float) -> None:
        self.owner = owner
        self.every_n_steps = every_n_steps
        self.rule = DesyncRule(tolerance)
        self._last_step = -1

    def reset(self) -> None:
        """A fresh rule: the start of a fit."""
        self.rule = DesyncRule(self.rule.tolerance)
        self._last_step = -1

    def on_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """After an optimizer step that is a multiple of ``every_n_steps``: compare the replicas."""
        step = trainer.global_step
        if trainer.world_size <= 1 or step == 0 or step % self.every_n_steps or step == self._last_step:
            return
        self._last_step = step
        if not _replicated(trainer):
            self.owner.notice(
                trainer,
                "desync-sharded",
                f"`ddp_desync` is not checked under {type(trainer.strategy).__name__}: its ranks hold parameter "
                "shards, not replicas (HSDP replica groups are not compared)",
            )
            return
        named = list(pl_module.named_parameters())
        if not named:
            return
        mine = parameter_checksums([p for _, p in named]).reshape(-1)
        gathered = trainer.strategy.all_gather(mine)  # [world, 2 * n]: the one collective of the check
        rows = gathered.reshape(trainer.world_size, -1).tolist()  # the one host read
        ctx = self.owner.context(trainer)
        self.owner.record(self.rule.update(rows, [n for n, _ in named], ctx))
        self.owner.writer.scalars(
            {
                replicas_tag("max_rel_diff"): self.rule.last_max_diff,
                replicas_tag("agree"): float(self.rule.last_max_diff <= self.rule.tolerance),
                **self.owner.threshold_lines(DDP_DESYNC),
            },
            step,
        )

    def state_dict(self) -> dict[str, Any]:
        """The rule's state."""
        return self.rule.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output."""
        self.rule.load_state_dict(state)


class TrainModeCheck:
    """``eval_mode_in_training``: on logging steps, the train/eval flags of the model's Dropout and BatchNorm
    modules (found once per fit) are read on the host; nothing runs on other steps."""

    def __init__(self, owner: DiagCallback) -> None:
        self.owner = owner
        self.rule = EvalModeRule()
        self._modules: list[tuple[str, torch.nn.Module, torch.nn.Module]] | None = None
        self._last_step = -1

    def reset(self) -> None:
        """A fresh rule: the start of a fit."""
        self.rule = EvalModeRule()
        self._modules = None
        self._last_step = -1

    def _find(self, pl_module: pl.LightningModule) -> list[tuple[str, torch.nn.Module, torch.nn.Module]]:
        modules = dict(pl_module.named_modules())
        found: list[tuple[str, torch.nn.Module, torch.nn.Module]] = []
        for name, module in modules.items():
            if isinstance(module, (_DropoutNd, _BatchNorm)):
                parent = modules.get(name.rsplit(".", 1)[0] if "." in name else "", pl_module)
                found.append((name, module, parent))
        return found

    @staticmethod
    def _kind(module: torch.nn.Module, parent: torch.nn.Module) -> str | None:
        if module.training:
            return None
        parent_trains = any(p.requires_grad for p in parent.parameters())
        if isinstance(module, _DropoutNd):
            return "dropout" if module.p > 0 and parent_trains else None
        own = list(module.parameters(recurse=False))
        if own:
            return "batchnorm" if any(p.requires_grad for p in own) else "batchnorm_frozen"
        if not getattr(module, "track_running_stats", True):
            return None  # no running statistics: eval mode normalises with the batch's, as training does
        return "batchnorm" if parent_trains else "batchnorm_frozen"

    def on_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """On logging steps: find the Dropout/BatchNorm modules in eval mode and judge them."""
        step = trainer.global_step
        if step == self._last_step or step % self.owner.every_n_steps(trainer):
            return
        self._last_step = step
        if self._modules is None:
            self._modules = self._find(pl_module)
        if not self._modules:
            return
        found = {}
        for name, module, parent in self._modules:
            kind = self._kind(module, parent)
            if kind is not None:
                found[name] = kind
        self.owner.record(self.rule.update(found, self.owner.context(trainer)))

    def state_dict(self) -> dict[str, Any]:
        """The rule's state."""
        return self.rule.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output."""
        self.rule.load_state_dict(state)
