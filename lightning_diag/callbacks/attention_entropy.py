"""AttentionEntropyMonitor: per-head attention entropy, collapse / diffusion / [CLS]-[SEP] sink alerts, heatmaps."""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Sequence
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.trainer.states import TrainerFn
from torch import nn

from lightning_diag.callbacks.base import AlertHandler, DiagCallback
from lightning_diag.core.tags import (
    attn_distance_tag,
    attn_entropy_tag,
    attn_heads_tag,
    attn_map_tag,
    attn_sink_tag,
    attn_uniform_tag,
)
from lightning_diag.core.validation import check_int, check_number
from lightning_diag.instrument.attention_capture import AttentionCapture, is_compiled
from lightning_diag.instrument.attention_record import AttentionRecorder
from lightning_diag.instrument.batches import token_ids as find_token_ids
from lightning_diag.instrument.sharding import TP_DIM_NAME
from lightning_diag.output.images import heatmap, scatter, tile
from lightning_diag.rules.attention import (
    ATTN_ENTROPY_HIGH,
    ATTN_ENTROPY_LOW,
    ATTN_MAX_QUERIES_SETTING,
    ATTN_SAMPLE_SIZE_SETTING,
    ATTN_SINK,
    DEFAULT_ATTN_PATIENCE,
    DEFAULT_ATTN_WARMUP_STEPS,
    DEFAULT_ENTROPY_HIGH,
    DEFAULT_ENTROPY_LOW,
    DEFAULT_SINK_MASS,
    DEFAULT_UNIFORM_FRACTION,
    AttentionEntropyRule,
    AttentionSinkRule,
    LayerStats,
)
from lightning_diag.stats.attention_probs import head_pca, head_similarity

__all__ = ["DEFAULT_MAX_QUERIES", "DEFAULT_SAMPLE_SIZE", "AttentionEntropyMonitor"]

#: Sequences of the batch measured on a sampled step (``attn.sample_size``).
DEFAULT_SAMPLE_SIZE = int(ATTN_SAMPLE_SIZE_SETTING.default)
#: Query positions per sequence measured on a sampled step, evenly spaced (``attn.max_queries``).
DEFAULT_MAX_QUERIES = int(ATTN_MAX_QUERIES_SETTING.default)
_IMAGE_KEYS = 128  # keys shown at most per heatmap


class AttentionEntropyMonitor(DiagCallback):
    r"""Per-head attention entropy in TensorBoard, with collapse, diffusion and special-token sink alerts.

    Attention is found automatically: every ``torch.nn.MultiheadAttention`` (also inside
    ``nn.TransformerEncoderLayer`` / ``DecoderLayer``), every call of
    ``torch.nn.functional.scaled_dot_product_attention`` made inside the ``LightningModule`` (Hugging Face
    ``attn_implementation="sdpa"``, litgpt, nanoGPT, timm), and eager attention that computes its own softmax
    inside a module whose class name contains ``Attention`` (Hugging Face ``"eager"``); see
    :mod:`lightning_diag.instrument.attention_capture`. Other attention modules report through
    :func:`~lightning_diag.record_attention`. On a sampled step (every ``log_every_n_steps`` optimizer steps, the
    first micro-batch of the step) the probabilities are recomputed from each call's inputs without gradient,
    before dropout, for the first ``sample_size`` sequences and at most ``max_queries`` query positions of each:
    the step's loss, gradients and random numbers are exactly those of a run without the monitor. Other steps cost
    one integer comparison: no hook and no function mode is installed. Under ``torch.compile`` the
    ``scaled_dot_product_attention`` / softmax capture stays off (one notice).

    Entropy is in nats, per head, averaged over valid query rows only: padded keys carry no mass (the key padding
    mask and attention mask are honoured) and padded query rows are left out. Uniform attention over ``n`` keys
    has ``ln n`` nats (2.48 for 12 keys, 4.85 for 128); one-hot attention has 0.

    Sharded models: under FSDP2 the capture is unchanged (the forward runs on the gathered weights). Under tensor
    parallelism each rank computes only its share of the heads (``ColwiseParallel`` projections reshaped to local
    heads, or a DTensor ``query`` sharded on its head dimension): the statistics are placed at each head's global
    index (``tp_rank * H_local + h``) and summed over the ranks on the sampled step, so rank zero logs every head
    once, exactly as a single process would; data-parallel groups are averaged as under DDP. The images are not
    drawn under tensor parallelism (a one-time message says so).

    Logged metrics (global rank zero; ``<module>`` is the module's qualified name):

    * ``diag/attn_entropy/<module>/head_<h>``: entropy of head ``h``.
    * ``diag/attn_entropy/<module>/mean``: mean over the module's heads.
    * ``diag/attn_entropy/<module>/uniform``: entropy uniform attention over the same keys would have (the
      ceiling; ``attn_entropy_high`` compares with it).
    * ``diag/attn_sink/<module>``: the smallest attention mass any head puts on the special tokens.
    * ``diag/threshold/attn_entropy_low``, ``.../attn_entropy_high``, ``.../attn_sink``: the thresholds, as
      reference series for the dashboard's charts.
    * ``diag/attn_map/<module>`` (image, every ``image_every_n_steps``): each head's attention map of the first
      sampled sequence (query rows x keys, padding cut off), heads side by side, coloured from 0 (dark) to the
      largest weight in the image (yellow).
    * ``diag/attn_heads/similarity`` (image): correlation between every pair of heads' maps (blue -1, white 0,
      red 1), heads in module order.
    * ``diag/attn_heads/pca`` (image): every head projected onto the first two principal components of the heads'
      maps, one colour per module: heads that do the same job sit together.

    Rules (definitions in :mod:`lightning_diag.rules.attention`), each on ``patience`` consecutive measurements:

    * ``attn_entropy_low``: a head below ``entropy_low`` nats (where uniform attention would exceed twice that).
    * ``attn_entropy_high``: after ``warmup_steps``, a head above ``entropy_high`` nats and above
      ``uniform_fraction`` of uniform.
    * ``attn_sink``: every head of a module puts more than ``sink_mass`` of its attention (and twice its uniform
      share) on special tokens.

    Args:
        log_every_n_steps: Sample every this many optimizer steps; defaults to the trainer's interval.
        modules: ``fnmatch`` patterns of the attention module names to watch (``nn.MultiheadAttention`` and
            the modules whose attention calls are captured); default: all.
        sample_size: Sequences of the batch measured (default 8).
        max_queries: Query positions per sequence measured, evenly spaced (default 64).
        special_positions: Positions among each sequence's non-padding keys that are special tokens: ``0`` is
            the first ([CLS] / BOS), ``-1`` the last ([SEP] / EOS). Default ``(0, -1)``.
        special_token_ids: Token ids that are special, in addition to ``special_positions``; needs the batch's
            token ids (``input_ids``).
        input_ids: ``batch -> LongTensor[B, S]`` giving the token ids; default: ``batch["input_ids"]`` or the
            first 2-D integer tensor of a tuple batch.
        image_every_n_steps: Interval of the images; ``None`` (default) is 10 times the sampling interval, ``0``
            turns them off.
        entropy_low: ``attn_entropy_low`` threshold in nats (default 0.5).
        entropy_high: ``attn_entropy_high`` threshold in nats (default 2.5).
        uniform_fraction: ``attn_entropy_high`` also needs the entropy above this fraction of uniform (0.9).
        warmup_steps: Optimizer steps before ``attn_entropy_high`` judges (default 200).
        sink_mass: ``attn_sink`` threshold: mass on special tokens (default 0.5).
        patience: Consecutive measurements a condition must hold (default 2).

    Raises:
        TypeError: If an argument has the wrong type.
        ValueError: If an argument is out of range.

    Example:
        >>> monitor = AttentionEntropyMonitor(log_every_n_steps=10, special_positions=(0,))
        >>> monitor.entropy_low, monitor.entropy_high
        (0.5, 2.5)
    """

    def __init__(
        self,
        *,
        log_every_n_steps: int | None = None,
        modules: Sequence[str] | None = None,
        sample_size: int = DEFAULT_SAMPLE_SIZE,
        max_queries: int = DEFAULT_MAX_QUERIES,
        special_positions: Sequence[int] = (0, -1),
        special_token_ids: Sequence[int] | None = None,
        input_ids: Callable[[Any], torch.Tensor | None] | None = None,
        image_every_n_steps: int | None = None,
        entropy_low: float = DEFAULT_ENTROPY_LOW,
        entropy_high: float = DEFAULT_ENTROPY_HIGH,
        uniform_fraction: float = DEFAULT_UNIFORM_FRACTION,
        warmup_steps: int = DEFAULT_ATTN_WARMUP_STEPS,
        sink_mass: float = DEFAULT_SINK_MASS,
        patience: int = DEFAULT_ATTN_PATIENCE,
        on_alert: AlertHandler | None = None,
    ) -> None:
        super().__init__(log_every_n_steps=log_every_n_steps, on_alert=on_alert)
        if modules is not None and (isinstance(modules, str) or not all(isinstance(m, str) for m in modules)):
            raise TypeError(f"Expected argument `modules` to be a list of module-name patterns, but got {modules!r}")
        self.modules = None if modules is None else tuple(modules)
        self.sample_size = check_int("sample_size", sample_size, low=1)
        self.max_queries = check_int("max_queries", max_queries, low=1)
        self.special_positions = self._int_tuple("special_positions", special_positions)
        self.special_token_ids = self._int_tuple("special_token_ids", special_token_ids or ())
        if input_ids is not None and not callable(input_ids):
            raise TypeError(f"Expected argument `input_ids` to be a callable batch -> tensor, but got {input_ids!r}")
        self.input_ids = input_ids
        if image_every_n_steps is not None:
            check_int("image_every_n_steps", image_every_n_steps, low=0)
        self.image_every_n_steps = image_every_n_steps
        self.entropy_low = check_number("entropy_low", entropy_low, low=0.0)
        self.entropy_high = check_number("entropy_high", entropy_high, low=self.entropy_low)
        self.uniform_fraction = check_number("uniform_fraction", uniform_fraction, low=0.0, high=1.0)
        self.warmup_steps = check_int("warmup_steps", warmup_steps, low=0)
        self.sink_mass = check_number("sink_mass", sink_mass, low=0.0, high=1.0, high_inclusive=False)
        self.patience = check_int("patience", patience, low=1)
        self.entropy_rule = self.add_rule("entropy_rule", AttentionEntropyRule.from_settings, state_key="entropy")
        self.sink_rule = self.add_rule("sink_rule", AttentionSinkRule.from_settings, state_key="sink")
        self._recorder: AttentionRecorder | None = None
        self._handles: list[Any] = []
        self._mha: list[tuple[str, nn.Module]] | None = None
        self._names: dict[int, str] = {}
        self._sampled_step = -1
        self._capture: AttentionCapture | None = None
        self._compiled: bool | None = None

    @staticmethod
    def _int_tuple(name: str, values: Sequence[int]) -> tuple[int, ...]:
        if isinstance(values, (str, bytes)) or not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            raise TypeError(f"Expected argument `{name}` to be a sequence of ints, but got {values!r}")
        return tuple(values)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """A new fit starts with fresh rules (the base class; a resume then loads their state)."""
        super().setup(trainer, pl_module, stage)
        if stage == TrainerFn.FITTING:
            self._mha = None
            self._compiled = None
            self._sampled_step = -1

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Remove any hook still attached, then release the session."""
        self._detach()
        super().teardown(trainer, pl_module, stage)

    # -- sampling ------------------------------------------------------------------------------------------
    def _find_modules(self, pl_module: pl.LightningModule) -> list[tuple[str, nn.Module]]:
        self._names = {id(m): n for n, m in pl_module.named_modules()}
        found: list[tuple[str, nn.Module]] = [
            (n, m) for n, m in pl_module.named_modules() if isinstance(m, nn.MultiheadAttention)
        ]
        if self.modules is not None:
            found = [(n, m) for n, m in found if self._wanted(n)]
        return found

    def _wanted(self, name: str) -> bool:
        return self.modules is None or any(fnmatch.fnmatchcase(name, p) for p in self.modules)

    def image_interval(self, trainer: pl.Trainer) -> int:
        """Steps between images (0: none)."""
        if self.image_every_n_steps is not None:
            return self.image_every_n_steps
        return 10 * self.every_n_steps(trainer)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """On the first micro-batch of a sampled step: attach the measuring hooks and open the recorder."""
        step = trainer.global_step
        if step % self.every_n_steps(trainer) != 0 or step == self._sampled_step:
            return
        self._sampled_step = step
        if self._mha is None:
            self._mha = self._find_modules(pl_module)
        token_ids = None
        if self.special_token_ids:
            token_ids = (self.input_ids or find_token_ids)(batch)
            if token_ids is None:
                self.notice(
                    trainer,
                    "no-input-ids",
                    "`special_token_ids` is set but the batch's token ids were not found: pass `input_ids=` "
                    "(batch -> LongTensor[B, S]); only `special_positions` mark special tokens",
                )
        interval = self.image_interval(trainer)
        tp_mesh = self._tp_mesh(trainer)
        if interval and tp_mesh is not None:
            self.notice(trainer, "tp-images", "tensor parallelism: the attention maps and head-similarity images "
                        "are not drawn (each rank holds only its own heads); the per-head scalars cover every head")
            interval = 0
        recorder = AttentionRecorder(
            self.sample_size,
            self.max_queries,
            self.special_positions,
            self.special_token_ids,
            token_ids,
            keep_maps=bool(interval) and step % interval == 0 and self.writer.active,
            module_names=self._names,
        )
        self._handles = [
            module.register_forward_pre_hook(recorder.mha_pre_hook(name), with_kwargs=True)
            for name, module in self._mha
        ]
        recorder.activate()
        self._recorder = recorder
        if self._compiled is None:
            self._compiled = is_compiled(pl_module)
        if self._compiled:
            self.notice(
                trainer,
                "compiled",
                "the model runs through torch.compile: scaled_dot_product_attention and eager attention are not "
                "captured (nn.MultiheadAttention and record_attention() still are); train without compile for a "
                "while to see them",
            )
        else:
            include = self._wanted if self.modules is not None else None
            self._capture = AttentionCapture(pl_module, recorder, include, self._names, tp_mesh)
            self._capture.start()

    def _tp_mesh(self, trainer: pl.Trainer) -> Any:
        """The tensor-parallel mesh of ``ModelParallelStrategy`` when it has more than one rank, else ``None``."""
        if trainer.world_size <= 1:
            return None
        try:
            mesh = getattr(trainer.strategy, "device_mesh", None)
        except Exception:  # a strategy whose mesh is not set up: no tensor parallelism to see
            return None
        if mesh is None or TP_DIM_NAME not in (getattr(mesh, "mesh_dim_names", None) or ()):
            return None
        tp = mesh[TP_DIM_NAME]
        return tp if tp.size() > 1 else None

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        """The sampled forward is over: leave the function mode before backward (and any recomputation) runs."""
        self._stop_capture()

    def _stop_capture(self) -> None:
        capture, self._capture = self._capture, None
        if capture is not None:
            capture.stop()

    def _detach(self) -> AttentionRecorder | None:
        self._stop_capture()
        for handle in self._handles:
            handle.remove()
        self._handles = []
        recorder, self._recorder = self._recorder, None
        if recorder is not None:
            recorder.deactivate()
        return recorder

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """After a sampled micro-batch: remove the hooks, log the statistics, run the rules, draw images."""
        recorder = self._detach()
        if recorder is None:
            return
        for name, problem in recorder.problems.items():
            self.notice(trainer, f"problem:{name}", f"attention of `{name}` is not measured: {problem}")
        for key, note in recorder.notes.items():
            self.notice(trainer, f"note:{key}", note)
        layers = self._reduce(trainer, recorder)
        if layers is None:
            return
        step = self._sampled_step
        values: dict[str, float] = {}
        for name, stats in layers.items():
            for h, ent in enumerate(stats.entropy):
                values[attn_entropy_tag(name, h)] = ent
            values[attn_entropy_tag(name, "mean")] = sum(stats.entropy) / len(stats.entropy)
            values[attn_uniform_tag(name)] = max(stats.uniform)
            values[attn_sink_tag(name)] = min(stats.special_mass)
        values.update(self._distances(trainer, recorder, [n for n in layers if n in recorder.stats]))
        values.update(self.threshold_lines(ATTN_ENTROPY_LOW, ATTN_ENTROPY_HIGH, ATTN_SINK))
        self.writer.scalars(values, step)
        ctx = self.context(trainer)
        ctx = type(ctx)(epoch=ctx.epoch, global_step=step)
        self.record(self.entropy_rule.update(layers, ctx) + self.sink_rule.update(layers, ctx))
        if recorder.keep_maps:
            self._draw(recorder, step)

    def _reduce(self, trainer: pl.Trainer, recorder: AttentionRecorder) -> dict[str, LayerStats] | None:
        """One host copy of every module's statistics, averaged over ranks (weighted by valid rows)."""
        names = list(recorder.stats)
        distributed = trainer.world_size > 1
        if distributed:
            # Every rank reaches this point on the same step; agree on the module count before reducing.
            count = torch.tensor([len(names), -len(names)], dtype=torch.float32, device=trainer.strategy.root_device)
            count = trainer.strategy.reduce(count, reduce_op="max")
            if int(count[0]) != -int(count[1]):
                self.notice(
                    trainer,
                    "ranks-differ",
                    "ranks recorded different attention modules on one step; each rank's statistics are its own",
                )
                distributed = False
        if not names:
            self.notice(
                trainer,
                "no-attention",
                "no nn.MultiheadAttention found"
                + (" matching `modules`" if self.modules is not None else "")
                + ", no scaled_dot_product_attention or attention softmax call seen"
                + " and nothing handed over through record_attention(): attention entropy is not measured",
            )
            return None
        # Tensor parallelism: a rank holds heads tp_rank * H_local ... of H_local * tp_size; each value goes to
        # its global head's slot (zeros elsewhere) with a per-head row count, so the sum over ranks gives every
        # head once per data-parallel group, averaged over those groups like DDP's ranks.
        heads: list[int] = []
        parts = []
        for n in names:
            s = recorder.stats[n]
            rows = s.rows.reshape(-1)[:1].float()
            local = int(s.entropy.numel())
            tp_rank, tp_size = recorder.head_shards.get(n, (0, 1)) if distributed else (0, 1)
            heads.append(local * tp_size)

            def place(v: torch.Tensor, local: int = local, tp_rank: int = tp_rank, tp_size: int = tp_size) -> Any:
                if tp_size == 1:
                    return v.reshape(-1).float()
                out = torch.zeros(local * tp_size, dtype=torch.float32, device=v.device)
                out[tp_rank * local : (tp_rank + 1) * local] = v.reshape(-1).float()
                return out

            unknown = torch.full_like(s.entropy, float("nan"))
            first = s.first_mass if s.first_mass is not None else unknown
            coverage = s.coverage if s.coverage is not None else unknown
            causal = s.causal if s.causal is not None else torch.zeros((), device=rows.device)
            parts += [place(s.entropy * rows), place(s.uniform * rows), place(s.special_mass * rows)]
            parts += [place(s.special_share * rows), place(first * rows), place(coverage * rows)]
            parts += [causal.reshape(1) * rows, rows, place(rows.expand(local))]
        flat = torch.cat([p.reshape(-1).float() for p in parts])
        if distributed:
            flat = trainer.strategy.reduce(flat, reduce_op="sum")
        host = flat.tolist()  # the one copy of this sampled step
        layers: dict[str, LayerStats] = {}
        i = 0
        for name, h in zip(names, heads, strict=True):
            chunk = host[i : i + 7 * h + 2]
            i += 7 * h + 2
            rows = chunk[6 * h + 1]
            head_rows = chunk[6 * h + 2 :]
            if rows <= 0 or min(head_rows) <= 0:
                continue
            cols = [[v / r for v, r in zip(chunk[j * h : (j + 1) * h], head_rows, strict=True)] for j in range(6)]
            # causal only when every rank's rows are: the summed flag is the same number on every rank
            is_causal = chunk[6 * h] / rows > 1 - 1e-6
            entropy, uniform, mass, share, first_mass, cover = cols
            layers[name] = LayerStats(entropy, uniform, mass, share, first_mass, is_causal, cover)
        return layers

    def _distances(self, trainer: pl.Trainer, recorder: AttentionRecorder, names: list[str]) -> dict[str, float]:
        """``diag/attn_distance[_relative]/<module>/head_<h>`` of the self-attention modules, averaged over ranks
        weighted by valid rows (one host copy; every rank has the same modules here, as :meth:`_reduce` checked)."""
        measured = [n for n in names if recorder.stats[n].distance is not None]
        if not measured:
            return {}
        distributed = trainer.world_size > 1 and "ranks-differ" not in self._notices  # the same on every rank
        # Tensor parallelism: each rank's heads go to their global slots with per-head rows, as in _reduce.
        parts = []
        heads: list[int] = []
        for n in measured:
            s = recorder.stats[n]
            rows = s.rows.reshape(-1)[:1].float()
            local = int(s.entropy.numel())
            tp_rank, tp_size = recorder.head_shards.get(n, (0, 1)) if distributed else (0, 1)
            heads.append(local * tp_size)
            per_head = [s.distance * rows, s.distance_relative * rows, rows.expand(local)]  # type: ignore[operator]
            for v in per_head:
                out = torch.zeros(local * tp_size, dtype=torch.float32, device=rows.device)
                out[tp_rank * local : (tp_rank + 1) * local] = v.reshape(-1).float()
                parts.append(out)
        flat = torch.cat(parts)
        if distributed:
            flat = trainer.strategy.reduce(flat, reduce_op="sum")
        host = flat.tolist()
        values: dict[str, float] = {}
        i = 0
        for n, h in zip(measured, heads, strict=True):
            chunk, i = host[i : i + 3 * h], i + 3 * h
            head_rows = chunk[2 * h :]
            for head in range(h):
                if head_rows[head] <= 0:
                    continue
                values[attn_distance_tag(n, head)] = chunk[head] / head_rows[head]
                values[attn_distance_tag(n, head, relative=True)] = chunk[h + head] / head_rows[head]
        return values

    # -- images --------------------------------------------------------------------------------------------
    def _draw(self, recorder: AttentionRecorder, step: int) -> None:
        for name, probs in recorder.maps.items():
            maps = probs[..., :_IMAGE_KEYS].cpu().numpy()
            if maps.size == 0:
                continue
            cell = max(1, min(8, 128 // max(maps.shape[1], maps.shape[2], 1)))
            # one colour scale per image, 0 to its largest weight: near-uniform maps still show their structure
            top = max(float(maps.max()), 1e-6)
            self.writer.image(attn_map_tag(name), tile([heatmap(m, cell, 0.0, top) for m in maps], gap=cell), step)
        # Heads are compared within the largest set of modules whose maps have the same shape.
        by_shape: dict[tuple[int, ...], list[str]] = {}
        for name, flat in recorder.flat.items():
            by_shape.setdefault(tuple(flat.shape[1:]), []).append(name)
        if not by_shape:
            return
        names = max(by_shape.values(), key=len)
        stacked = torch.cat([recorder.flat[n] for n in names])
        if stacked.shape[0] < 2:
            return
        groups = [g for g, n in enumerate(names) for _ in range(recorder.flat[n].shape[0])]
        corr = head_similarity(stacked).cpu().numpy()
        cell = max(2, min(16, 256 // corr.shape[0]))
        self.writer.image(attn_heads_tag("similarity"), heatmap(corr, cell, -1.0, 1.0, diverging=True), step)
        coords = head_pca(stacked).cpu().numpy()
        self.writer.image(attn_heads_tag("pca"), scatter(coords, groups), step)
