"""AnomalyAlarm's checks of silent errors: replicas that drift apart (``ddp_desync``) and modules left in eval
mode while they train (``eval_mode_in_training``).

Two helpers :class:`~lightning_diag.AnomalyAlarm` owns: each measures (the replicas' checksum differences, the
modules in eval mode) and feeds its owner's preset, whose detectors (:mod:`lightning_diag.rules.replicas`,
:mod:`lightning_diag.rules.train_mode`) judge; a helper keeps only where it stands in the fit.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.strategies import DDPStrategy, ModelParallelStrategy
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.dropout import _DropoutNd

from lightning_diag.core.tags import replicas_tag
from lightning_diag.instrument.sharding import mesh_dim_ranks, replica_dims
from lightning_diag.rules.measures import Measures, ReplicaDifferences
from lightning_diag.stats.grad import is_dtensor, local_tensor
from lightning_diag.stats.replicas import check_due, first_differences, member_differences
from lightning_diag.stats.updates import parameter_checksums

if TYPE_CHECKING:  # pragma: no cover
    from lightning_diag.callbacks.common.base import DiagCallback

__all__ = ["ReplicaCheck", "TrainModeCheck"]


def _replicated(trainer: pl.Trainer) -> bool:
    """Whether every rank must hold the same copy of a plain-tensor (not DTensor) parameter: under DDP (its
    replicas) and under ``ModelParallelStrategy``, which shards only what ``fully_shard`` or ``parallelize_module``
    turned into DTensors, so a plain parameter (a LayerNorm weight or bias left out of the tensor-parallel plan) is
    a copy that nothing keeps in sync across ranks: BLOOM-176B's 15-day bug was such a copy drifting apart."""
    strategy = trainer.strategy
    if isinstance(strategy, ModelParallelStrategy):
        return True
    return isinstance(strategy, DDPStrategy) and "DeepSpeed" not in type(strategy).__name__


class _Group:
    """One replica group this rank belongs to: its global ranks, its process group (``None``: the whole world)
    and the model-order indices of the parameters it holds copies of."""

    def __init__(self, ranks: tuple[int, ...], group: Any) -> None:
        self.ranks, self.group = ranks, group
        self.params: list[int] = []


class ReplicaCheck:
    """``ddp_desync``: after optimizer steps 1, 2, 4, ... below ``every_n_steps`` and then every ``every_n_steps``
    (:func:`~lightning_diag.stats.replicas.check_due`), the parameters' checksums compared within each replica
    group; nothing runs on other steps.

    A replica group is a set of ranks that must hold identical copies of a parameter's local tensor:

    * a plain-tensor parameter under DDP or ``ModelParallelStrategy`` (FSDP2 and tensor parallelism shard only
      DTensors; a plain parameter there, such as a LayerNorm left out of the tensor-parallel plan, is a copy on
      every rank that nothing synchronises): every rank (the world);
    * a DTensor parameter (FSDP2/HSDP ``fully_shard``, tensor parallelism, both), under any strategy: for each mesh
      dimension whose placement is ``Replicate``, the ranks along that dimension with the same coordinates on the
      other dimensions (``device_mesh.get_group(dim)``). ``Shard`` dimensions hold different data: not compared.
    * a plain tensor under a strategy that shards plain tensors itself (FSDP1's flat parameters, DeepSpeed's
      partitions): not compared, said once per fit in a notice.

    Cost on a check step: one checksum pair per parameter (a device kernel each), one ``all_gather`` per replica
    group this rank belongs to, of every parameter the group shares batched into one float64 tensor
    (``2 * k`` numbers per rank), and one host read each. When the groups do not span every rank (HSDP with
    several shards, TP x DP), one more ``all_reduce`` of ``n + 2 * world`` numbers over all ranks makes every rank
    take the same decision. Global rank zero writes.

    Args:
        owner: The callback whose preset judges the comparisons (``ddp_desync``'s detector) and that writes.
        rule_id: The id of the rule judging the comparisons, handed in by the owner's preset module: its notices
            name it, and its threshold is written beside the logged differences.
        every_n_steps: ``ddp_desync.every_n_steps``.
        tolerance: ``ddp_desync.threshold``: the relative difference above which a rank differs (the first
            differing parameter of each rank is found with it, and the logged ``agree`` reads it).
    """

    def __init__(self, owner: DiagCallback, rule_id: str, every_n_steps: int, tolerance: float) -> None:
        self.owner = owner
        self.rule_id = rule_id
        self.every_n_steps = every_n_steps
        self.tolerance = tolerance
        self.reset()

    def reset(self) -> None:
        """The start of a fit: nothing compared yet."""
        self._last_step = -1
        #: The replica groups this rank took part in at the last check (their global ranks), for tests and docs.
        self.last_groups: list[tuple[int, ...]] = []

    def _groups(self, trainer: pl.Trainer, named: Sequence[tuple[str, torch.Tensor]]) -> dict[tuple[int, ...], _Group]:
        """This rank's replica groups, in an order every rank shares (that of the first parameter each holds)."""
        world = trainer.world_size
        replicated = _replicated(trainer)
        groups: dict[tuple[int, ...], _Group] = {}
        plain: list[str] = []
        for index, (name, p) in enumerate(named):
            if is_dtensor(p):
                mesh = p.device_mesh  # type: ignore[attr-defined]
                members = [(mesh_dim_ranks(mesh, dim), dim) for dim in replica_dims(p)]
                for ranks, dim in members:
                    if len(ranks) > 1:
                        groups.setdefault(ranks, _Group(ranks, mesh.get_group(dim))).params.append(index)
            elif replicated:
                groups.setdefault(tuple(range(world)), _Group(tuple(range(world)), None)).params.append(index)
            else:
                plain.append(name)
        if plain:
            self.owner.notice(
                trainer,
                "desync-plain-sharded",
                f"`{self.rule_id}` does not compare {len(plain)} parameter(s) under {type(trainer.strategy).__name__} "
                f"(first: `{plain[0]}`): they are plain tensors, not DTensors, under a sharded strategy (FSDP1 flat "
                "parameters, DeepSpeed partitions), so nothing says which ranks hold copies and which hold shards",
            )
        if not groups:
            self.owner.notice(
                trainer,
                "desync-no-replicas",
                f"`{self.rule_id}` has nothing to compare under {type(trainer.strategy).__name__}: no parameter has a "
                "replica on another rank (every DTensor mesh dimension is a Shard; shards are not replicas)",
            )
        return groups

    def on_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """After an optimizer step that :func:`~lightning_diag.stats.replicas.check_due` names: compare the
        replicas."""
        step = trainer.global_step
        if trainer.world_size <= 1 or not check_due(step, self.every_n_steps) or step == self._last_step:
            return
        self._last_step = step
        named = list(pl_module.named_parameters())
        if not named:
            return
        groups = self._groups(trainer, named)
        self.last_groups = list(groups)
        if not groups:
            return
        import torch.distributed as dist

        world, me, n, tol = trainer.world_size, trainer.global_rank, len(named), self.tolerance
        per_param = [0.0] * n
        first: dict[int, tuple[int, int]] = {}
        for g in groups.values():  # the same order on every member of a group: no crossed collectives
            mine = parameter_checksums([local_tensor(named[i][1]) for i in g.params]).reshape(-1)
            rows = [torch.empty_like(mine) for _ in g.ranks]
            dist.all_gather(rows, mine, group=g.group)  # the group's one collective
            diffs = member_differences(torch.stack(rows).tolist())  # its one host read
            for k, index in enumerate(g.params):
                per_param[index] = max(per_param[index], max(d[k] for d in diffs))
            for rank, found in first_differences(diffs, g.ranks, g.params, tol).items():
                if rank not in first or found[0] < first[rank][0]:
                    first[rank] = found
        compared = {i for g in groups.values() for i in g.params}  # the same on every rank (same placements)
        if any(len(ranks) < world for ranks in groups):
            # Other ranks compared other groups: one all_reduce (MAX) so that every rank judges the same numbers.
            # [n per-parameter differences | per rank: n - first differing index (0: none) | its reference + 1]
            packed = torch.zeros(n + 2 * world, dtype=torch.float64, device=local_tensor(named[0][1]).device)
            packed[:n] = torch.tensor(per_param, dtype=torch.float64)
            if me in first:
                packed[n + me] = n - first[me][0]
                packed[n + world + me] = first[me][1] + 1
            dist.all_reduce(packed, op=dist.ReduceOp.MAX)
            flat = packed.tolist()
            per_param = flat[:n]
            first = {r: (n - int(flat[n + r]), int(flat[n + world + r]) - 1) for r in range(world) if flat[n + r] > 0}
        ctx = self.owner.context(trainer)
        differences = ReplicaDifferences(per_param, [name for name, _ in named], first, compared=len(compared))
        self.owner.record(self.owner.feed(ctx, Measures(replica_differences=differences)))
        largest = max(per_param, default=0.0)
        self.owner.writer.scalars(
            {
                replicas_tag("max_rel_diff"): largest,
                replicas_tag("agree"): float(largest <= tol),
                **self.owner.threshold_lines(self.rule_id),
            },
            step,
        )


class TrainModeCheck:
    """``eval_mode_in_training``: on logging steps, the train/eval flags of the model's Dropout and BatchNorm
    modules (found once per fit) are read on the host and fed to the owner's preset; nothing runs on other steps."""

    def __init__(self, owner: DiagCallback) -> None:
        self.owner = owner
        self.reset()

    def reset(self) -> None:
        """The start of a fit: the modules are found again."""
        self._modules: list[tuple[str, torch.nn.Module, torch.nn.Module]] | None = None
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
        if step == self._last_step or self.owner.cadence_step(trainer) % self.owner.every_n_steps(trainer):
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
        self.owner.record(self.owner.feed(self.owner.context(trainer), Measures(eval_mode=found)))
