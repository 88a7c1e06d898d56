"""AttentionEntropyMonitor: per-head attention entropy, collapse / diffusion / [CLS]-[SEP] sink alerts, heatmaps."""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Sequence
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.trainer.states import TrainerFn
from torch import nn

from lightning_diag.callbacks.attention_entropy.measure import draw_images, reduce_distances, reduce_stats
from lightning_diag.callbacks.common.base import AlertHandler, DiagCallback, RuleChoices
from lightning_diag.callbacks.common.outputs import extract_loss
from lightning_diag.callbacks.common.preset import Detector, Preset
from lightning_diag.core.tags import (
    attn_entropy_tag,
    attn_uniform_tag,
    tag,
)
from lightning_diag.core.validation import check_callable, check_int
from lightning_diag.instrument.attention_capture import AttentionCapture, is_compiled
from lightning_diag.instrument.attention_record import AttentionRecorder
from lightning_diag.instrument.batches import token_ids as find_token_ids
from lightning_diag.instrument.sharding import TP_DIM_NAME
from lightning_diag.rules.attention_entropy import AttentionEntropyRule
from lightning_diag.rules.attention_logits import ATTN_LOGIT_GROWTH, AttentionLogitRule
from lightning_diag.rules.attention_sink import AttentionSinkRule
from lightning_diag.rules.attention_specs import (
    ATTN_ENTROPY_HIGH,
    ATTN_ENTROPY_LOW,
    ATTN_MAX_QUERIES_SETTING,
    ATTN_SAMPLE_SIZE_SETTING,
    ATTN_SINK,
)
from lightning_diag.rules.measures import Measures
from lightning_diag.rules.records import LayerStats

__all__ = ["DEFAULT_MAX_QUERIES", "DEFAULT_SAMPLE_SIZE", "NO_ATTENTION_SAMPLES", "AttentionEntropyMonitor"]

#: Sampled steps in a row without attention after which a single-process fit stops looking (a model without
#: attention then pays nothing more for the monitor).
NO_ATTENTION_SAMPLES = 3

#: Sequences of the batch measured on a sampled step (``attn.sample_size``).
DEFAULT_SAMPLE_SIZE = int(ATTN_SAMPLE_SIZE_SETTING.default)
#: Query positions per sequence measured on a sampled step, evenly spaced (``attn.max_queries``).
DEFAULT_MAX_QUERIES = int(ATTN_MAX_QUERIES_SETTING.default)


class AttentionEntropyMonitor(DiagCallback):
    r"""Per-head attention entropy in TensorBoard, with collapse, diffusion and special-token sink alerts.

    Attention is found automatically: every ``torch.nn.MultiheadAttention`` (also inside
    ``nn.TransformerEncoderLayer`` / ``DecoderLayer``), every call of
    ``torch.nn.functional.scaled_dot_product_attention`` made inside the ``LightningModule`` (Hugging Face
    ``attn_implementation="sdpa"``, litgpt, nanoGPT, timm), eager attention that computes its own softmax
    inside a module whose class name contains ``Attention`` (Hugging Face ``"eager"``), and hand-written attention
    in any module: a softmax over the last dimension of query-key scores whose output weights values through
    ``matmul`` / ``bmm`` / ``einsum`` / ``@`` (``[B, H, T, S]``, ``[B*H, T, S]``, one head at a time; see
    :mod:`lightning_diag.instrument.attention_softmax`). Other attention modules report through
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
    * ``diag/attn_logit_growth/<module>``: the largest attention logit ``|q.k| * scale`` among the sampled queries'
      allowed keys (where the logits are seen: ``scaled_dot_product_attention``, ``nn.MultiheadAttention``,
      hand-written softmax attention; not for probabilities handed over by ``record_attention``).
    * ``diag/threshold/attn_entropy_low``, ``.../attn_entropy_high``, ``.../attn_sink``,
      ``.../attn_logit_growth``: the thresholds, as
      reference series for the dashboard's charts.
    * ``diag/attn_map/<module>`` (image, every ``image_every_n_steps``): each head's attention map of the first
      sampled sequence (query rows x keys, padding cut off), heads side by side, coloured from 0 (dark) to the
      largest weight in the image (yellow).
    * ``diag/attn_heads/similarity`` (image): correlation between every pair of heads' maps (blue -1, white 0,
      red 1), heads in module order.
    * ``diag/attn_heads/pca`` (image): every head projected onto the first two principal components of the heads'
      maps, one colour per module: heads that do the same job sit together.

    Rules (definitions in :mod:`lightning_diag.rules.attention_specs`), each on ``patience`` consecutive measurements:

    * ``attn_entropy_low``: a head below ``attn_entropy_low.threshold`` nats (where uniform attention would exceed twice
      that): a warning when it is a collapse (every head of the layer at once, or an abrupt fall while the training
      loss did not improve), ``info`` when the head sharpened by learning. The loss is that of the sampled batch
      (``training_step``'s output), read in the step's one host copy.
    * ``attn_entropy_high``: after ``attn_entropy_high.warmup_steps``, a head above ``attn_entropy_high.threshold``
      nats and above ``attn_entropy_high.uniform_fraction`` of uniform.
    * ``attn_sink``: every head of a module puts more than ``attn_sink.threshold`` of its attention (and twice its
      uniform share) on special tokens.
    * ``attn_logit_growth`` (its own ``patience``): a module's largest attention logit above
      ``attn_logit_growth.threshold`` (50) and grown on each of its last ``attn_logit_growth.patience`` (2)
      measurements: attention-logit growth towards one-hot attention, usually seen before the entropy collapses
      (:mod:`lightning_diag.rules.attention_logits`).

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
        rules: Thresholds and settings by rule id, ``False`` to switch a rule off (docs/thresholds.md):
            ``{"attn_entropy_low": {"threshold": 0.3}, "attn_sink": False, "attn": {"patience": 3}}``.
        on_alert: A callable receiving each :class:`~lightning_diag.core.alerts.Alert` as it is recorded (global
            rank zero, after it is written to ``alerts.jsonl``): send it to Slack, e-mail or a pager. A handler
            that raises is reported once per fit through the ``lightning_diag`` logger and never stops training.

    Raises:
        TypeError: If an argument has the wrong type.
        ValueError: If an argument is out of range.

    Example:
        >>> monitor = AttentionEntropyMonitor(log_every_n_steps=10, rules={"attn_entropy_low": {"threshold": 0.3}})
        >>> monitor.thresholds()["attn_entropy_low"], monitor.thresholds()["attn_entropy_high"]
        (0.3, 2.5)
    """

    #: Switched off on quiet batches (:meth:`quiet_batch`): Lightning then skips them.
    batch_hooks = ("on_before_backward", "on_train_batch_end")
    preset = Preset(
        "AttentionEntropyMonitor",
        (
            Detector(AttentionEntropyRule, "entropy_rule", "entropy"),
            Detector(AttentionSinkRule, "sink_rule", "sink"),
            Detector(AttentionLogitRule, "logit_rule", "logits"),
        ),
    )
    @property
    def recorder_timing(self) -> Callable[[Callable[..., Any]], Callable[..., Any]] | None:
        """Wraps the attention recorders' methods in ``SystemMonitor``'s timer of this trainer (its driver's, while
        one times it), else ``None``."""
        driver = self._driver
        return driver.recorder_timing if driver is not None else None

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
        rules: RuleChoices | None = None,
        on_alert: AlertHandler | None = None,
    ) -> None:
        super().__init__(rules=rules, log_every_n_steps=log_every_n_steps, on_alert=on_alert)
        if modules is not None and (isinstance(modules, str) or not all(isinstance(m, str) for m in modules)):
            raise TypeError(f"Expected argument `modules` to be a list of module-name patterns, but got {modules!r}")
        self.modules = None if modules is None else tuple(modules)
        self.sample_size = check_int("sample_size", sample_size, low=1)
        self.max_queries = check_int("max_queries", max_queries, low=1)
        self.special_positions = self._int_tuple("special_positions", special_positions)
        self.special_token_ids = self._int_tuple("special_token_ids", special_token_ids or ())
        self.input_ids = check_callable("input_ids", input_ids, "a callable batch -> tensor")
        if image_every_n_steps is not None:
            check_int("image_every_n_steps", image_every_n_steps, low=0)
        self.image_every_n_steps = image_every_n_steps
        self.add_preset()
        self._logit_peaks: dict[str, float] = {}
        self._recorder: AttentionRecorder | None = None
        self._handles: list[Any] = []
        self._mha: list[tuple[str, nn.Module]] | None = None
        self._names: dict[int, str] = {}
        self._sampled_step = -1
        self._capture: AttentionCapture | None = None
        #: Sampled steps in a row that showed no attention (single process), and whether the fit stopped looking.
        self._empty_samples = 0
        self._stopped = False
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
            self._empty_samples = 0
            self._stopped = False

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
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        if not self.on_cadence or self._stopped:
            return
        step = trainer.global_step
        if step == self._sampled_step:
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
            keep_maps=bool(interval) and self.cadence_step(trainer) % interval == 0 and self.writer.active,
            module_names=self._names,
            timed=self.recorder_timing,
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

    def quiet_batch(self, trainer: pl.Trainer) -> bool:
        """Off the sampling cadence, with nothing attached: the batch's backward and end have nothing to do."""
        idle = not self.on_cadence or self._stopped
        return idle and self._recorder is None and self._capture is None and not self._handles

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
        if self._recorder is None and self._capture is None and not self._handles:
            return  # a quiet step
        recorder = self._detach()
        if recorder is None:
            return
        for name, problem in recorder.problems.items():
            self.notice(trainer, f"problem:{name}", f"attention of `{name}` is not measured: {problem}")
        for key, note in recorder.notes.items():
            self.notice(trainer, f"note:{key}", note)
        loss, _ = extract_loss(outputs)
        reduced = self._reduce(trainer, recorder, loss)
        if reduced is None:
            self._no_attention(trainer, recorder)
            return
        self._empty_samples = 0
        layers, batch_loss = reduced
        peaks, self._logit_peaks = self._logit_peaks, {}
        step = self._sampled_step
        values: dict[str, float] = {}
        for name, stats in layers.items():
            for h, ent in enumerate(stats.entropy):
                values[attn_entropy_tag(name, h)] = ent
            values[attn_entropy_tag(name, "mean")] = sum(stats.entropy) / len(stats.entropy)
            values[attn_uniform_tag(name)] = max(stats.uniform)
            values[tag(ATTN_SINK, name)] = min(stats.special_mass)
            if name in peaks:
                values[tag(ATTN_LOGIT_GROWTH, name)] = peaks[name]
        distributed = trainer.world_size > 1 and "ranks-differ" not in self._notices  # the same on every rank
        values.update(reduce_distances(trainer, recorder, [n for n in layers if n in recorder.stats], distributed))
        values.update(self.threshold_lines(ATTN_ENTROPY_LOW, ATTN_ENTROPY_HIGH, ATTN_SINK, ATTN_LOGIT_GROWTH))
        self.writer.scalars(values, step)
        ctx = self.context(trainer)
        ctx = type(ctx)(epoch=ctx.epoch, global_step=step)
        # the logits' growth first (it comes before the collapse), then the heads' statistics
        self.record(self.feed(ctx, Measures(attention_logit_peaks=peaks)))
        self.record(self.feed(ctx, Measures(attention=layers, loss=batch_loss)))
        if recorder.keep_maps:
            draw_images(self.writer, recorder, step)

    def _no_attention(self, trainer: pl.Trainer, recorder: AttentionRecorder) -> None:
        """A sampled step showed no attention: after :data:`NO_ATTENTION_SAMPLES` of them in a row, a single
        process stops looking for the rest of the fit (one notice). Under several processes every rank keeps
        looking: the ranks decide each sampled step together (``reduce_stats``), and one that stopped alone would
        leave the others waiting."""
        if trainer.world_size > 1 or recorder.problems:
            return
        self._empty_samples += 1
        if self._empty_samples >= NO_ATTENTION_SAMPLES:
            self._stopped = True
            self.notice(
                trainer,
                "no-attention-stop",
                f"no attention in {NO_ATTENTION_SAMPLES} sampled steps in a row: AttentionEntropyMonitor stops "
                "looking for the rest of this fit (it costs nothing from here; the next fit looks again)",
            )

    def _reduce(
        self, trainer: pl.Trainer, recorder: AttentionRecorder, loss: torch.Tensor | None = None
    ) -> tuple[dict[str, LayerStats], float] | None:
        """The sampled step's statistics and loss in one host copy (:func:`._attention_measure.reduce_stats`)."""
        self._logit_peaks = {}
        return reduce_stats(
            trainer,
            recorder,
            loss,
            lambda key, message: self.notice(trainer, key, message),
            self.modules is not None,
            self._logit_peaks,
        )
