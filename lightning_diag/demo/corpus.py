"""The real-architecture corpus: off-the-shelf architectures, healthy and with injected faults.

The models nobody in this project wrote: Hugging Face ``transformers`` models built from small configs (no
download) and plain torch models, each trained with AdamW, a linear learning-rate warm-up and a cosine decay on
a learnable synthetic task of :mod:`lightning_diag.demo.corpus_data`:

=============  ==========================================================  ==========
architecture   model                                                       task
=============  ==========================================================  ==========
``bert``       ``BertForSequenceClassification`` (2 layers, d 64)          classify
``gpt2``       ``GPT2LMHeadModel`` (2 layers, d 64)                        lm
``llama``      ``LlamaForCausalLM`` (2 layers, d 64, 4 query / 2 KV heads)  lm
``bart``       ``BartForConditionalGeneration`` (2+2 layers, d 64)         seq2seq
``vit``        ``ViTForImageClassification`` (2 layers, d 64, patch 4)     image
``cnn``        conv-BatchNorm-ReLU x 3, global pooling, linear head         image
``lstm``       2-layer LSTM classifier                                     classify
``finetune``   BERT whose embeddings and first layer are frozen            classify
=============  ==========================================================  ==========

:data:`CORPUS` lists a healthy run of each and the faults injected into them; :func:`run_corpus` trains one. The
networks themselves are built in :mod:`lightning_diag.demo.corpus_models`.

Example:
    >>> sorted(name for name, entry in CORPUS.items() if entry.healthy)[:3]
    ['bart', 'bert', 'cnn']
    >>> CORPUS["bert_high_lr"].expected_rules
    ('grad_collapse',)
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
import warnings
from typing import Any

import pytorch_lightning as pl
import torch
from torch import nn

from lightning_diag.core.alerts import Alert
from lightning_diag.demo.corpus_data import CorpusDataModule
from lightning_diag.demo.corpus_models import ARCHITECTURES, build_net, hf_quiet
from lightning_diag.rules.catalog import (
    AMP_NOT_APPLIED,
    ATTN_ENTROPY_LOW,
    BATCH_SIZE_MISMATCH,
    EVAL_RANDOMNESS,
    GRAD_COLLAPSE,
    GRAD_FROZEN,
    LOSS_OUTLIER,
    LOSS_STAGNANT,
    NONFINITE_LOSS,
    TRAIN_OVERRIDE_BYPASSED,
    WORKER_RNG_SHARED,
    ZERO_OUTPUT,
)

__all__ = [
    "ARCHITECTURES",
    "CORPUS",
    "TRAINER_SETTINGS",
    "CorpusEntry",
    "CorpusModule",
    "CorpusResult",
    "build_corpus",
    "run_corpus",
]


@dataclasses.dataclass(frozen=True)
class CorpusEntry:
    """One run of the corpus: an architecture, healthy or with one injected fault.

    Attributes:
        name: The entry's name (the architecture for a healthy run).
        arch: A key of :data:`ARCHITECTURES`.
        description: What goes wrong (or "healthy").
        expected_rules: Rule ids that must fire (empty for a healthy run).
        onset_step: Global step where the fault begins.
        window: Steps after onset by which the expected rules must have fired.
        max_steps: Optimizer steps of the run.
        lr: Peak learning rate (AdamW; linear warm-up over ``warmup_steps``, then cosine decay to 10%).
        warmup_steps: Learning-rate warm-up steps.
        fault: Switches of :class:`CorpusModule` (``nan_at_step``, ``qk_scale_at_step``, ``exclude``,
            ``dead_relu_at_step``, ``freeze_in_train``, ``train_at_epoch_start``, ``eval_attention_dropout``,
            ``autocast_off``, ``zero_input_every``/``zero_input_from``, ``zero_transfer_every``/
            ``zero_transfer_from``); ``shuffle_targets`` goes to the data module.
        data: Loader switches of :class:`~lightning_diag.demo.corpus_data.CorpusDataModule` (``jitter``,
            ``num_workers``, ``reseed_workers``, ``one_row_inputs``).
        trainer: Overrides of :class:`pytorch_lightning.Trainer` arguments (``precision``,
            ``num_sanity_val_steps``).
        callbacks: Callbacks the entry needs beyond the defaults, as ``(class name, keyword arguments)`` pairs.
    """

    name: str
    arch: str
    description: str
    expected_rules: tuple[str, ...] = ()
    onset_step: int | None = None
    window: int = 0
    max_steps: int = 300
    lr: float = 3e-3
    warmup_steps: int = 30
    fault: dict[str, Any] = dataclasses.field(default_factory=dict)
    data: dict[str, Any] = dataclasses.field(default_factory=dict)
    trainer: dict[str, Any] = dataclasses.field(default_factory=dict)
    callbacks: tuple[tuple[str, dict[str, Any]], ...] = ()

    @property
    def healthy(self) -> bool:
        """Whether this entry is a healthy run (no warning may fire)."""
        return not self.expected_rules

    @property
    def model(self) -> str:
        """The architecture (the fault library's column name)."""
        return self.arch

    @property
    def onset_epoch(self) -> int | None:
        """Corpus faults begin at a step, never at an epoch."""
        return None


def _leaky_attention() -> str:
    """Register (once) and name an attention function that applies ``config.attn_pdrop`` whatever the module's
    mode, as the FlashAttention-2 path of several Hugging Face models did (transformers PR 33844)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    name = "lightning_diag_leaky_sdpa"

    def leaky(module: nn.Module, query: Any, key: Any, value: Any, mask: Any, **kwargs: Any) -> Any:
        config: Any = module.config
        kwargs["dropout"] = float(config.attn_pdrop)  # the bug: `dropout if self.training else 0.0` was lost
        return sdpa_attention_forward(module, query, key, value, mask, **kwargs)

    AttentionInterface.register(name, leaky)
    return name


class CorpusModule(pl.LightningModule):
    """A corpus network, its loss and its optimizer (AdamW, warm-up then cosine), with the fault switches.

    Logs ``train_loss`` and ``val_loss``.
    """

    def __init__(self, entry: CorpusEntry, seed: int = 0) -> None:
        super().__init__()
        hf_quiet()
        self.entry = entry
        torch.manual_seed(seed)
        net: Any = build_net(entry.arch)
        self.net = net
        self.task = ARCHITECTURES[entry.arch]
        self._nan_handle: Any = None
        if entry.arch == "finetune":
            # frozen on purpose, the way everyone freezes: requires_grad_(False) on the pretrained part
            net.bert.embeddings.requires_grad_(False)
            net.bert.encoder.layer[0].requires_grad_(False)
        f = entry.fault
        if f.get("eval_attention_dropout"):
            # FlashAttention-2's bug (transformers PR 33844): the attention dropout passed whatever the mode
            net.config.attn_pdrop = float(f["eval_attention_dropout"])
            net.config._attn_implementation = _leaky_attention()
        if f.get("zero_transfer_every"):
            net.transformer.h[0].register_forward_hook(self._zero_transfer)

    def _zero_transfer(self, module: nn.Module, args: Any, output: Any) -> Any:
        f, step = self.entry.fault, self.global_step
        if not (self.training and step >= f["zero_transfer_from"] and step % f["zero_transfer_every"] == 0):
            return output
        # the fault: block 0's hidden states reach block 1 as zeros (a hand-off between devices)
        if isinstance(output, tuple):
            return (torch.zeros_like(output[0]), *output[1:])
        return torch.zeros_like(output)

    def train(self, mode: bool = True) -> CorpusModule:
        """``nn.Module.train``; with ``freeze_in_train`` it also freezes those parameters (mmpretrain's
        ``frozen_stages``, applied where plain-PyTorch code calls ``model.train()`` every epoch)."""
        super().train(mode)
        prefixes = tuple(self.entry.fault.get("freeze_in_train", ())) if hasattr(self, "entry") else ()
        if mode and prefixes:
            for name, p in self.named_parameters():
                if name.startswith(prefixes):
                    p.requires_grad_(False)
        return self

    def on_train_epoch_start(self) -> None:
        if self.entry.fault.get("train_at_epoch_start"):
            self.train()

    # -- faults -------------------------------------------------------------------------------------------
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        f, step = self.entry.fault, self.global_step
        if f.get("qk_scale_at_step") is not None and step == f["qk_scale_at_step"]:
            # attention-logit growth: query and key weights grow, the logits with their product
            with torch.no_grad():
                for layer in self.net.model.layers:
                    layer.self_attn.q_proj.weight.mul_(f.get("qk_scale", 8.0))
                    layer.self_attn.k_proj.weight.mul_(f.get("qk_scale", 8.0))
        if f.get("dead_relu_at_step") is not None and step == f["dead_relu_at_step"]:
            # a bad update pushes every BatchNorm shift far negative: every ReLU outputs 0 from here on
            with torch.no_grad():
                for m in self.net.modules():
                    if isinstance(m, nn.BatchNorm2d):
                        m.bias.fill_(-20.0)
        if f.get("nan_at_step") is not None:
            if step == f["nan_at_step"] and self._nan_handle is None:
                block = self.net.transformer.h[1].mlp
                self._nan_handle = block.register_forward_hook(lambda m, i, o: o * math.nan)
            elif step != f["nan_at_step"] and self._nan_handle is not None:
                self._nan_handle.remove()
                self._nan_handle = None

    # -- loss -------------------------------------------------------------------------------------------------
    def compute_loss(self, batch: Any) -> torch.Tensor:
        """The loss of a batch (with ``autocast_off``, a training forward that escapes autocast)."""
        if self.training and self.entry.fault.get("autocast_off"):
            with torch.autocast(device_type=self.device.type, enabled=False):  # the fault: no mixed precision
                return self._loss(batch)
        return self._loss(batch)

    def _loss(self, batch: Any) -> torch.Tensor:
        arch = self.entry.arch
        if self.task == "classify":
            tokens, mask, labels = batch
            if arch == "lstm":
                return nn.functional.cross_entropy(self.net(tokens, mask), labels)
            return self.net(input_ids=tokens, attention_mask=(~mask).long(), labels=labels).loss
        if self.task == "lm":
            (seq,) = batch
            return self.net(input_ids=seq, labels=seq).loss
        if self.task == "seq2seq":
            source, target = batch
            return self.net(input_ids=source, labels=target).loss
        pixels, labels = batch
        if arch == "vit":
            return self.net(pixel_values=pixels, labels=labels).loss
        return nn.functional.cross_entropy(self.net(pixels), labels)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        f, step = self.entry.fault, self.global_step
        if f.get("zero_input_every") and step >= f["zero_input_from"] and step % f["zero_input_every"] == 0:
            batch = (torch.zeros_like(batch[0]), *batch[1:])  # the fault: this step's tokens arrived as zeros
        loss = self.compute_loss(batch)
        self.log("train_loss", loss, on_step=True, on_epoch=False)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self.compute_loss(batch))

    def configure_optimizers(self) -> Any:
        e = self.entry
        excluded = tuple(e.fault.get("exclude", ()))
        decay: list[nn.Parameter] = []
        no_decay: list[nn.Parameter] = []
        for name, p in self.named_parameters():
            if not p.requires_grad or name.startswith(excluded):
                continue
            (no_decay if p.ndim < 2 else decay).append(p)
        lr = e.lr * float(e.fault.get("lr_factor", 1.0))
        opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}], lr=lr
        )
        warm, total = e.warmup_steps, e.max_steps

        def schedule(step: int) -> float:
            if step < warm:
                return (step + 1) / warm
            progress = min(1.0, (step - warm) / max(1, total - warm))
            return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _entries() -> list[CorpusEntry]:
    healthy = [
        CorpusEntry("bert", "bert", "healthy", lr=2e-3),
        CorpusEntry("gpt2", "gpt2", "healthy", lr=3e-3),
        CorpusEntry("llama", "llama", "healthy", lr=3e-3),
        CorpusEntry("bart", "bart", "healthy", lr=3e-3),
        CorpusEntry("vit", "vit", "healthy", lr=2e-3),
        CorpusEntry("cnn", "cnn", "healthy", lr=3e-3),
        CorpusEntry("lstm", "lstm", "healthy", lr=3e-3),
        CorpusEntry("finetune", "finetune", "healthy", lr=1e-3),
    ]
    faults = [
        CorpusEntry(
            "gpt2_nan",
            "gpt2",
            "the MLP of GPT-2's block 1 outputs NaN at step 100",
            (NONFINITE_LOSS,),
            onset_step=100,
            window=0,
            max_steps=120,
            fault={"nan_at_step": 100},
        ),
        CorpusEntry(
            "llama_logit_growth",
            "llama",
            "Llama's query and key weights are scaled up 8x at step 100: attention logits grow 64x and "
            "attention collapses to one-hot",
            (ATTN_ENTROPY_LOW,),
            onset_step=100,
            window=20,
            max_steps=140,
            lr=3e-3,
            fault={"qk_scale_at_step": 100, "qk_scale": 8.0},
        ),
        CorpusEntry(
            "bert_high_lr",
            "bert",
            "BERT at a learning rate 100x too high (0.2): the network dies",
            (GRAD_COLLAPSE,),
            onset_step=0,
            window=150,
            max_steps=200,
            lr=2e-3,
            warmup_steps=1,
            fault={"lr_factor": 100.0},
        ),
        CorpusEntry(
            "bert_excluded",
            "bert",
            "BERT's pooler and classifier are left out of the optimizer",
            (GRAD_FROZEN,),
            onset_step=0,
            window=4,  # the first measurement: step 4, the user's first logging step (log_every_n_steps=5)
            max_steps=60,
            fault={"exclude": ("net.bert.pooler.", "net.classifier.")},
        ),
        CorpusEntry(
            "cnn_dead_relu",
            "cnn",
            "every ReLU of the CNN dies at step 100 (BatchNorm shifts pushed to -20)",
            (GRAD_COLLAPSE,),
            onset_step=100,
            window=40,
            max_steps=180,
            fault={"dead_relu_at_step": 100},
        ),
        CorpusEntry(
            "bert_shuffled_labels",
            "bert",
            "BERT's training labels are permuted against the inputs",
            (LOSS_STAGNANT,),
            onset_step=0,
            window=260,
            max_steps=260,
            fault={"shuffle_targets": True},
        ),
        # -- the silent errors of issue 35 on real architectures ------------------------------------------------
        CorpusEntry(
            "cnn_train_override",
            "cnn",
            "the CNN overrides train() to freeze its stem (mmpretrain's frozen_stages); Lightning never calls "
            "train(), so the stem keeps training",
            (TRAIN_OVERRIDE_BYPASSED,),
            onset_step=0,
            window=0,
            max_steps=20,
            fault={"freeze_in_train": ("net.0.0.", "net.0.1.")},
        ),
        CorpusEntry(
            "gpt2_eval_dropout",
            "gpt2",
            "GPT-2's attention applies its dropout (0.1) in eval mode too (the FlashAttention-2 path of transformers "
            "PR 33844): validation is random",
            (EVAL_RANDOMNESS,),
            onset_step=0,
            window=0,
            max_steps=20,
            fault={"eval_attention_dropout": 0.1},
            trainer={"num_sanity_val_steps": 2},
        ),
        CorpusEntry(
            "llama_autocast_off",
            "llama",
            "precision='bf16-mixed', but Llama's training forward runs in autocast(enabled=False): every matmul "
            "stays float32",
            (AMP_NOT_APPLIED,),
            onset_step=0,
            window=1,
            max_steps=10,
            fault={"autocast_off": True},
            trainer={"precision": "bf16-mixed"},
        ),
        CorpusEntry(
            "bert_zero_input",
            "bert",
            "from step 100, every 20th step's tokens arrive as zeros (a transient corruption of a copy)",
            (LOSS_OUTLIER,),
            onset_step=100,
            window=5,
            max_steps=150,
            lr=2e-3,
            fault={"zero_input_every": 20, "zero_input_from": 100},
        ),
        CorpusEntry(
            "gpt2_zero_transfer",
            "gpt2",
            "from step 102, every 3rd step GPT-2's block 0 hands its hidden states to block 1 as zeros (a copy "
            "between devices)",
            (ZERO_OUTPUT,),
            onset_step=102,
            window=15,  # sampled every 5 steps (104, 109, ...): corrupted 102, 105, 108, 111 are not, 114 is
            max_steps=130,
            fault={"zero_transfer_every": 3, "zero_transfer_from": 102},
        ),
        CorpusEntry(
            "bart_batch_rows",
            "bart",
            "the collate_fn keeps the first source sequence and all 16 targets: BART's decoder broadcasts one "
            "encoder output against every target (transformers #34204's shape)",
            (BATCH_SIZE_MISMATCH,),
            onset_step=0,
            window=0,
            max_steps=20,
            data={"one_row_inputs": True},
            callbacks=(("DataDiagnostics", {}),),
        ),
        CorpusEntry(
            "cnn_worker_rng",
            "cnn",
            "the image dataset jitters its pixels with a numpy generator it holds, read by 2 workers without a "
            "worker_init_fn: both workers draw the same noise",
            (WORKER_RNG_SHARED,),
            onset_step=0,
            window=0,
            max_steps=20,
            data={"jitter": 0.1, "num_workers": 2},
            callbacks=(("DataDiagnostics", {}),),
        ),
    ]
    twins = [
        CorpusEntry(
            "cnn_train_override_applied",
            "cnn",
            "healthy twin of cnn_train_override: the same override, run by self.train() in on_train_epoch_start",
            max_steps=60,
            fault={"freeze_in_train": ("net.0.0.", "net.0.1."), "train_at_epoch_start": True},
        ),
        CorpusEntry(
            "llama_bf16_mixed",
            "llama",
            "healthy twin of llama_autocast_off: Llama under precision='bf16-mixed'",
            max_steps=60,
            trainer={"precision": "bf16-mixed"},
        ),
        CorpusEntry(
            "cnn_loader",
            "cnn",
            "healthy twin of cnn_worker_rng and bart_batch_rows: the jittering image dataset read by 2 workers whose "
            "worker_init_fn reseeds its generator, collated whole",
            max_steps=60,
            data={"jitter": 0.1, "num_workers": 2, "reseed_workers": True},
            callbacks=(("DataDiagnostics", {}),),
        ),
    ]
    return healthy + faults + twins


#: Every corpus entry by name: the eight healthy architectures, the faults, then the healthy twins of issue 35's.
CORPUS: dict[str, CorpusEntry] = {e.name: e for e in _entries()}


def build_corpus(name: str, seed: int = 0) -> tuple[CorpusModule, CorpusDataModule, CorpusEntry]:
    """The module, data module and entry for ``name``.

    Raises:
        ValueError: If ``name`` is not in :data:`CORPUS`.
    """
    if name not in CORPUS:
        raise ValueError(f"Expected argument `name` to be one of {sorted(CORPUS)}, but got {name!r}")
    entry = CORPUS[name]
    data = CorpusDataModule(
        ARCHITECTURES[entry.arch],
        seed=seed,
        shuffle_targets=bool(entry.fault.get("shuffle_targets", False)),
        **entry.data,
    )
    return CorpusModule(entry, seed=seed), data, entry


@dataclasses.dataclass
class CorpusResult:
    """What a corpus run produced."""

    name: str
    alerts: list[Alert]
    log_dir: str
    global_step: int
    seconds: float
    losses: list[float]


#: The Trainer settings every corpus run shares (an entry's ``trainer`` mapping overrides them); the detection
#: matrix's runs use them too.
TRAINER_SETTINGS: dict[str, Any] = {
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "enable_checkpointing": False,
    "log_every_n_steps": 5,
    "val_check_interval": 50,
    "check_val_every_n_epoch": None,
    "limit_val_batches": 8,
    "num_sanity_val_steps": 0,
    "accelerator": "cpu",
}


def run_corpus(
    name: str, root: str | None = None, seed: int = 0, callbacks: list[Any] | None = None, **trainer_kwargs: Any
) -> CorpusResult:
    """Train one corpus entry with :func:`~lightning_diag.demo.run.default_callbacks` (or ``callbacks``).

    Validation runs every 50 steps on the 128 validation examples; everything is measured every 5 steps.

    Args:
        name: A key of :data:`CORPUS`.
        root: Directory for logs (default ``./diag_runs``).
        seed: Seed of data, model and trainer.
        callbacks: Callbacks to attach instead of the defaults.
        **trainer_kwargs: Passed on to :class:`pytorch_lightning.Trainer`.
    """
    from pytorch_lightning.loggers import TensorBoardLogger

    from lightning_diag.demo.run import default_callbacks, fault_callbacks

    model, data, entry = build_corpus(name, seed=seed)
    root = root or os.path.join(os.getcwd(), "diag_runs")
    cbs = [*default_callbacks(), *fault_callbacks(entry)] if callbacks is None else callbacks
    losses: list[float] = []

    class _Losses(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, i: int) -> None:
            if trainer.global_step % 10 == 0 and isinstance(outputs, dict) and "loss" in outputs:
                losses.append(float(outputs["loss"]))

    pl.seed_everything(seed, verbose=False)
    kwargs: dict[str, Any] = {
        "max_steps": entry.max_steps,
        "max_epochs": -1,
        "logger": TensorBoardLogger(root, name=f"corpus_{name}"),
        "callbacks": [*cbs, _Losses()],
        **TRAINER_SETTINGS,
        **entry.trainer,
    }
    kwargs.update(trainer_kwargs)
    trainer = pl.Trainer(**kwargs)
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        trainer.fit(model, datamodule=data)
    seconds = time.perf_counter() - start
    alerts = sorted((a for cb in cbs for a in getattr(cb, "alerts", [])), key=lambda a: a.global_step)
    return CorpusResult(name, alerts, trainer.log_dir or root, trainer.global_step, seconds, losses)
