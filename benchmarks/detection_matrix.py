"""Detection matrix: every fault and every healthy baseline of the fault library, with the default callbacks,
side by side with what Lightning users have: ``EarlyStopping(check_finite=True)``, ``SpikeDetection`` and
``Trainer(detect_anomaly=True)``, each in its own real run.

    python benchmarks/detection_matrix.py                       # print the markdown tables
    python benchmarks/detection_matrix.py --write docs/detection.md
    python benchmarks/detection_matrix.py --only nan --only healthy_gru --max-epochs 2   # a quick subset
    python benchmarks/detection_matrix.py --corpus real --write docs/detection.md   # the real-architecture matrix

``--corpus real`` runs :data:`lightning_diag.demo.corpus.CORPUS` (Hugging Face BERT, GPT-2, Llama, BART, ViT, a
BatchNorm CNN, an LSTM, a frozen-backbone fine-tune, and the faults injected into them) and, with ``--write``,
replaces only the real-architecture section of the page (between its markers), so each matrix is regenerated
on its own. It also measures, on the healthy runs, each gradient quantity's extreme against its threshold.

The lightning_diag column uses ``lightning_diag.demo.run.default_callbacks()``, so a callback added there is in
the matrix at the next run.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import pytorch_lightning as pl

from lightning_diag.core.alerts import Alert
from lightning_diag.demo.corpus import CORPUS, TRAINER_SETTINGS, CorpusEntry, run_corpus
from lightning_diag.demo.faults import FAULTS, Fault, build_fault
from lightning_diag.demo.run import default_callbacks, fault_callbacks, quiet, run_demo
from lightning_diag.rules.catalog import ALL_RULES

try:  # SpikeDetection is in pytorch_lightning >= 2.2 (experimental); older versions lack it
    from pytorch_lightning.callbacks import SpikeDetection
except ImportError:  # pragma: no cover - depends on the installed Lightning
    SpikeDetection = None  # type: ignore[assignment,misc]

COMMAND = "PYTHONPATH=. .venv/bin/python benchmarks/detection_matrix.py --write docs/detection.md"
REAL_COMMAND = "PYTHONPATH=. .venv/bin/python benchmarks/detection_matrix.py --corpus real --write docs/detection.md"
REAL_START, REAL_END = "<!-- real-corpus:start -->", "<!-- real-corpus:end -->"
#: The foreign-code corpus's section (benchmarks/foreign_corpus.py writes it): kept as it is by --write.
FOREIGN_START, FOREIGN_END = "<!-- foreign-corpus:start -->", "<!-- foreign-corpus:end -->"
#: The two-process rows (benchmarks/multiprocess_matrix.py writes them): kept as they are by --write.
MP_START, MP_END = "<!-- multiprocess:start -->", "<!-- multiprocess:end -->"
#: Marks the tables of the published training problems (issue 45), written by hand from the faults' runs: kept.
PROBLEMS_START, PROBLEMS_END = "<!-- problems:start -->", "<!-- problems:end -->"


@dataclasses.dataclass
class Outcome:
    """What one comparison run did: the step/epoch it stopped or raised at, and why."""

    detected: bool
    step: int | None = None
    epoch: int | None = None
    reason: str = ""

    def cell(self, fault: Fault | CorpusEntry) -> str:
        if not self.detected:
            return f"no{f' ({self.reason})' if self.reason else ''}"
        return f"yes, step {self.step} (epoch {self.epoch}){_after(fault, self.step, self.epoch)}: {self.reason}"


def _after(fault: Fault | CorpusEntry, step: int | None, epoch: int | None) -> str:
    if fault.onset_step is not None and step is not None:
        return f", +{step - fault.onset_step} steps"
    if fault.onset_epoch is not None and epoch is not None:
        return f", +{epoch - fault.onset_epoch} epochs"
    return ""


def _trainer(root: str, fault: Fault, max_epochs: int | None, **kwargs: Any) -> pl.Trainer:
    return pl.Trainer(
        default_root_dir=root,
        max_epochs=max_epochs or fault.max_epochs,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        log_every_n_steps=5,
        accelerator="cpu",
        deterministic=True,
        **{**fault.trainer, **kwargs},
    )


def _fit(
    name: str, root: str, max_epochs: int | None, callbacks: list[Any], seed: int = 0, **kwargs: Any
) -> tuple[pl.Trainer, BaseException | None]:
    if name.startswith(_REAL):
        return _fit_real(name[len(_REAL) :], root, callbacks, seed, **kwargs)
    model, data, fault = build_fault(name, seed=seed)
    pl.seed_everything(seed, verbose=False)
    trainer = _trainer(root, fault, max_epochs, callbacks=[*callbacks, *fault_callbacks(fault)], **kwargs)
    try:
        trainer.fit(model, datamodule=data)
    except Exception as err:  # the comparison tools stop a run by raising
        return trainer, err
    return trainer, None


_REAL = "real:"


def _fit_real(
    name: str, root: str, callbacks: list[Any], seed: int = 0, **kwargs: Any
) -> tuple[pl.Trainer, BaseException | None]:
    from lightning_diag.demo.corpus import build_corpus

    model, data, entry = build_corpus(name, seed=seed)
    pl.seed_everything(seed, verbose=False)
    settings: dict[str, Any] = {
        "default_root_dir": root,
        "max_steps": entry.max_steps,
        "max_epochs": -1,
        "logger": False,
        **TRAINER_SETTINGS,
        "callbacks": callbacks,
    }
    trainer = pl.Trainer(**{**settings, **entry.trainer, **kwargs})
    try:
        trainer.fit(model, datamodule=data)
    except Exception as err:  # the comparison tools stop a run by raising
        return trainer, err
    return trainer, None


def early_stopping(name: str, root: str, max_epochs: int | None) -> Outcome:
    """``EarlyStopping(monitor="val_loss", check_finite=True)`` with its defaults (patience 3)."""
    from pytorch_lightning.callbacks import EarlyStopping

    es = EarlyStopping(monitor="val_loss", check_finite=True)
    trainer, err = _fit(name, root, max_epochs, [es])
    if err is not None:
        return Outcome(True, trainer.global_step, trainer.current_epoch, f"raised {type(err).__name__}")
    reason = getattr(es, "stopping_reason", None)
    if not es.stopped_epoch:
        return Outcome(False)
    why = {"NON_FINITE_METRIC": "val_loss not finite", "PATIENCE_EXHAUSTED": "val_loss stopped improving"}.get(
        str(getattr(reason, "name", reason)), str(reason)
    )
    return Outcome(True, trainer.global_step, es.stopped_epoch, f"stopped, {why}")


def spike_detection(name: str, root: str, max_epochs: int | None) -> Outcome:
    """Lightning's ``SpikeDetection()`` with its defaults (window 10, rtol 2, non-finite losses count)."""
    if SpikeDetection is None:
        return Outcome(False, reason="not in the installed pytorch_lightning")
    spike = SpikeDetection(exclude_batches_path=os.path.join(root, "skip_batches.json"))
    trainer, err = _fit(name, root, max_epochs, [spike])
    if err is None:
        return Outcome(False)
    if type(err).__name__ != "TrainingSpikeException":
        raise err
    # raised in on_train_batch_end, after the optimizer step of the batch counted in global_step
    return Outcome(True, trainer.global_step - 1, trainer.current_epoch, "TrainingSpikeException")


def detect_anomaly(name: str, root: str, max_epochs: int | None) -> Outcome:
    """``Trainer(detect_anomaly=True)``: autograd anomaly mode raises on a NaN produced in backward."""
    trainer, err = _fit(name, root, max_epochs, [], detect_anomaly=True)
    if err is None:
        return Outcome(False)
    if not isinstance(err, RuntimeError):
        raise err
    return Outcome(True, trainer.global_step, trainer.current_epoch, "RuntimeError from autograd")


@dataclasses.dataclass
class Row:
    """One entry of the fault library with every tool's result."""

    fault: Fault | CorpusEntry
    alerts: list[Alert]
    steps: int
    seconds: float
    comparisons: dict[str, Outcome]
    callbacks: list[str]
    margins: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def serious(self) -> list[Alert]:
        return [a for a in self.alerts if a.severity != "info"]

    def first(self) -> dict[str, Alert]:
        out: dict[str, Alert] = {}
        for a in self.serious:
            out.setdefault(a.rule, a)
        return out

    def caught(self) -> bool:
        """Every expected rule fired within the fault's documented window."""
        first = self.first()
        for rule in self.fault.expected_rules:
            if rule not in first:
                return False
            a = first[rule]
            if self.fault.onset_step is not None and a.global_step > self.fault.onset_step + self.fault.window:
                return False
            if self.fault.onset_epoch is not None and a.epoch > self.fault.onset_epoch + self.fault.window:
                return False
        return True

    def ours(self) -> str:
        first = self.first()
        if not first:
            return "nothing"
        cells = []
        for rule, a in first.items():
            mark = "**" if rule in self.fault.expected_rules else ""
            cells.append(f"{mark}`{rule}`{mark} step {a.global_step}{_after(self.fault, a.global_step, a.epoch)}")
        return "; ".join(cells)

    def steps_per_epoch(self) -> float | None:
        epochs = getattr(self.fault, "max_epochs", None)
        return self.steps / epochs if epochs and self.fault.onset_epoch is not None else None

    def prompt(self) -> str:
        """Steps and measurements from onset to the first alert of each expected rule, against the target."""
        first = self.first()
        cells = []
        for rule in self.fault.expected_rules:
            if rule not in first:
                cells.append(f"`{rule}`: -")
                continue
            d = delay(self.fault, first[rule], self.steps_per_epoch())
            if d is None:
                cells.append(f"`{rule}`: -")
                continue
            steps, count, unit = d
            ok = count <= PROMPT_MEASUREMENTS
            why = "" if ok else f"; {SLOWER_BY_DEFINITION.get(rule, '**slower than the target**')}"
            unit = unit if count != 1 else unit[:-1]
            cells.append(f"+{steps} steps ({count} {unit}){why}")
        return "; ".join(cells) or "-"

    def verdict(self) -> str:
        if self.caught():
            return "yes"
        missing = [r for r in self.fault.expected_rules if ALL_RULES.get(r) not in self.callbacks]
        if missing:
            return f"no: {', '.join(ALL_RULES[r] for r in missing)} is not in `default_callbacks()` yet"
        return "**no**"


COMPARISONS: dict[str, Callable[[str, str, int | None], Outcome]] = {
    "EarlyStopping(check_finite=True)": early_stopping,
    "SpikeDetection": spike_detection,
    "detect_anomaly=True": detect_anomaly,
}


def run_entry(name: str, root: str, max_epochs: int | None, comparisons: bool) -> Row:
    """Run one fault (or baseline) with the default callbacks (and those the entry needs), then each comparison
    tool."""
    callbacks = [*default_callbacks(), *fault_callbacks(FAULTS[name])]
    t0 = time.perf_counter()
    result = run_demo(name, max_epochs=max_epochs, root=os.path.join(root, "diag"), callbacks=callbacks)
    seconds = time.perf_counter() - t0
    outcomes = {}
    if comparisons:
        for label, tool in COMPARISONS.items():
            sub = os.path.join(root, label.split("(")[0].split("=")[0], name)
            outcomes[label] = tool(name, sub, max_epochs)
    return Row(
        FAULTS[name], result.alerts, result.global_step, seconds, outcomes, [type(c).__name__ for c in callbacks]
    )


def run_real_entry(name: str, root: str, comparisons: bool) -> Row:
    """Run one corpus entry with the default callbacks (and those the entry needs), then each comparison tool."""
    callbacks = [*default_callbacks(), *fault_callbacks(CORPUS[name])]
    result = run_corpus(name, root=os.path.join(root, "diag"), callbacks=callbacks)
    outcomes = {}
    if comparisons:
        for label, tool in COMPARISONS.items():
            sub = os.path.join(root, label.split("(")[0].split("=")[0], name)
            outcomes[label] = tool(_REAL + name, sub, None)
    row = Row(
        CORPUS[name], result.alerts, result.global_step, result.seconds, outcomes, [type(c).__name__ for c in callbacks]
    )
    row.margins = _margins(result.log_dir) if CORPUS[name].healthy else {}
    return row


#: Healthy-run extremes measured against each threshold: (tag kind, extreme, threshold key, rule).
_MARGIN_QUANTITIES = (
    ("grad_rms", "max", "explode_threshold", "grad_explode"),
    ("grad_relative", "min", "vanish_threshold", "grad_vanish"),
)


def _margins(log_dir: str) -> dict[str, Any]:
    """Extremes of the gradient quantities of a healthy run, read back from its event file."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from lightning_diag.stats.layer_roles import role_of

    acc = EventAccumulator(log_dir, size_guidance={"scalars": 0})
    acc.Reload()
    tags = acc.Tags()["scalars"]
    series = {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in tags if t.startswith("diag/grad_")}
    out: dict[str, Any] = {}
    rms = [(v, t.split("/", 2)[2], s) for t, vals in series.items() if t.startswith("diag/grad_rms/") for s, v in vals]
    out["rms_max"] = max(rms) if rms else None
    rel = {t.split("/", 2)[2]: dict(vals) for t, vals in series.items() if t.startswith("diag/grad_relative/")}
    # grad_vanish: the smallest ratio of a matrix to the best-fed block matrix, after the warm-up
    worst_starve: tuple[float, str, int] | None = None
    worst_spread: tuple[float, str, int] | None = None
    steps = sorted({s for vals in rel.values() for s in vals if s >= 50})
    for step in steps:
        at = {layer: vals[step] for layer, vals in rel.items() if step in vals and vals[step] > 0}
        if len(at) < 2:
            continue
        blocks = [v for layer, v in at.items() if role_of(layer) != layer] or list(at.values())
        best = max(blocks)
        layer = min(at, key=at.__getitem__)
        if worst_starve is None or at[layer] / best < worst_starve[0]:
            worst_starve = (at[layer] / best, layer, step)
        groups: dict[str, list[float]] = {}
        for name, v in at.items():
            groups.setdefault(role_of(name), []).append(v)
        for role, vs in groups.items():
            if len(vs) > 1 and (worst_spread is None or max(vs) / min(vs) > worst_spread[0]):
                worst_spread = (max(vs) / min(vs), role, step)
    late = [(v, layer, s) for layer, vals in rel.items() for s, v in vals.items() if s >= 50]
    out["rel_min"] = min(late, default=None)
    out["starve"] = worst_starve
    out["spread"] = worst_spread
    blocks = series.get("diag/grad_blocks/norm", [])
    if len(blocks) > 5:
        base = sorted(v for _, v in blocks[:5])[2]
        out["collapse"] = min((v / base, s) for s, v in blocks[5:]) if base > 0 else None
    return out


#: Steps between two measurements of the step-measured rules in both matrices (``log_every_n_steps=5``).
MEASURE_EVERY = 5
#: The target of issue 23: every fault caught within this many measurements of its onset.
PROMPT_MEASUREMENTS = 3
#: Why a fault's rule needs more than :data:`PROMPT_MEASUREMENTS` measurements (its definition, not a warm-up).
SLOWER_BY_DEFINITION = {
    "loss_swing": "the seed's definition: 3 consecutive swinging epochs, so the 4th epoch point at the earliest",
    "val_decline": "the seed's definition: 5 consecutive worsening validation runs (6 runs at the earliest)",
    "loss_stagnant": "the loss gets 4 points (epochs or windows) to fall 10% below its initial value",
    "grad_collapse": "the baseline is the median of the first 5 measurements, then 3 consecutive collapsed ones",
    "step_time_periodic": "a period is seen at its second occurrence, one period (10 steps) after the onset, and "
    "judged at the end of SystemMonitor's 5-step interval that holds it",
}


def delay(fault: Fault | CorpusEntry, alert: Alert, steps_per_epoch: float | None) -> tuple[int, int, str] | None:
    """``(steps, measurements, unit)`` from the fault's onset to ``alert``, or ``None`` without an onset.

    Step-onset faults count the measurements every :data:`MEASURE_EVERY` steps from the onset to the alert, both
    included; epoch-onset faults count epochs (one loss point each), the onset's included.
    """
    if fault.onset_step is not None:
        steps = alert.global_step - fault.onset_step
        first = -(-fault.onset_step // MEASURE_EVERY)
        return steps, max(1, alert.global_step // MEASURE_EVERY - first + 1), "measurements"
    if fault.onset_epoch is not None:
        start = round(fault.onset_epoch * steps_per_epoch) if steps_per_epoch else 0
        return alert.global_step - start, alert.epoch - fault.onset_epoch + 1, "epochs"
    return None


def _onset(fault: Fault | CorpusEntry) -> str:
    if fault.onset_step is not None:
        return f"step {fault.onset_step} (window {fault.window} steps)"
    if fault.onset_epoch is not None:
        return f"epoch {fault.onset_epoch} (window {fault.window} epochs)"
    return "-"


def render(rows: list[Row]) -> str:
    """The two markdown tables: faults, then healthy baselines."""
    labels = list(COMPARISONS) if rows and rows[0].comparisons else []
    out = []
    faults = [r for r in rows if not r.fault.healthy]
    healthy = [r for r in rows if r.fault.healthy]
    if faults:
        head = [
            "fault", "model", "onset", "expected", "lightning_diag (first alert of each rule)", "caught",
            "onset to alert (target: 3 measurements)", *labels,
        ]  # fmt: skip
        out += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in faults:
            cells = [
                f"`{r.fault.name}`",
                r.fault.model,
                _onset(r.fault),
                ", ".join(f"`{x}`" for x in r.fault.expected_rules),
                r.ours(),
                r.verdict(),
                r.prompt(),
                *(r.comparisons[label].cell(r.fault) for label in labels),
            ]
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    if healthy:
        head = ["healthy baseline", "model", "steps", "lightning_diag warnings/criticals (target: none)", *labels]
        out += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in healthy:
            alerts = "; ".join(f"`{a.rule}` step {a.global_step}" for a in r.serious) or "none"
            cells = [f"`{r.fault.name}`", r.fault.model, str(r.steps), alerts]
            cells += [r.comparisons[label].cell(r.fault) for label in labels]
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


#: The silent-error rows that need more than one process, written by hand from their tests, and the comparison with
#: TrainCheck's published results (issue 22).
SILENT = """### Silent training errors (issue 22)

The rows `optimizer_copy` to `val_longer` above are the silent errors of the fault library: training goes on, the
loss stays finite, and the model quietly comes out worse. Their steps are measured like every other row (the
first alert of the rule, `log_every_n_steps=5`, so the gradient-flow measurements are at steps 4, 9, 14, ..., the
user's logging steps).
The data faults are found by `DataDiagnostics` before the first step (step 0). The faults that need two processes
(replicas that drift apart under DDP and tensor parallelism) are in the table below, generated by
`benchmarks/multiprocess_matrix.py`, which runs the scripts of `tests/callbacks/test_silent_ddp.py` and
`tests/callbacks/test_silent_sharded.py` (its `--write` replaces only this marked part; this page's generator keeps
it):

<!-- multiprocess:start -->
Not measured yet: run `PYTHONPATH=. .venv/bin/python benchmarks/multiprocess_matrix.py --write docs/detection.md`.
<!-- multiprocess:end -->

TrainCheck (OSDI '25) infers invariants from reference runs and checks them through an instrumentation pass; its
authors report that it caught 18 of 20 real silent errors (among them BLOOM-176B's weights diverging across
GPUs, an optimizer wrapped wrongly for FSDP that changed nothing, and missing `zero_grad`) that loss and
gradient-norm monitoring missed, within a few iterations. The rules here need no reference run and no
instrumentation, catch the Lightning-reachable kinds of those errors from inside the callbacks within `patience`
measurements (3 measured steps) for the update rules, one check interval for `ddp_desync`, one measurement
interval for `grad_not_zeroed` and before the first step for the data rules; they do not learn invariants, so
an error outside these seven rules (a wrong loss function, a data-order bug) stays TrainCheck's kind of finding.

### The published silent errors (issue 35)

TrainCheck's evaluation (OSDI '25, "Training with Confidence") names 18 real silent training errors from the
PyTorch, Hugging Face, DeepSpeed, Megatron and Lightning trackers; its authors report catching them by checking
invariants learned from reference runs. Here each is mapped to the fault that reproduces its root cause as a
Lightning fit on CPU, with the library's defaults and no reference run. 15 of the 18 can be written so; all 15 are
caught, each within one measurement of its onset, in the fault library and on real architectures (steps from the
generated rows).

| case | root cause | reproduced here as | rule | onset to alert |
|---|---|---|---|---|
| pytorch #51800 | a model with `nn.utils.spectral_norm` evaluated before its first training forward: the power iteration never ran | `_Critic` in `tests/callbacks/test_runtime_checks.py`, `trainer.validate()` before `fit` | `eval_before_training` | at that validation (info in a fit's sanity check) |
| pytorch #84803, #96600, Baichuan2 #86 | a faulty GPU link zeroes tensors in transit (1% of copies) | `zero_input`: single steps' batches arrive as zeros; `zero_transfer`: a hand-off between two halves of the model arrives as zeros every 3rd step; on real architectures `bert_zero_input`, `gpt2_zero_transfer` | `loss_outlier`; `zero_output` | +1 step (the step after); `zero_output` at the first corrupted step that is sampled (every 5 steps, on the logging cadence: 4, 9, 14, ...): +6 steps in `zero_transfer`, +12 in `gpt2_zero_transfer`; `bert_zero_input`'s corrupted steps (100, 120, 140) are not sampled (before issue 43's hook set the sampled steps were 0, 5, 10, ...: +12, +3 and +0, BERT's padding embedding turning zero tokens into zero vectors) |
| pytorch #104336 | DDP's gradient hooks lost when the wrapped model is moved between devices: gradients never synchronised | `ddp_nosync` in the two-process table (a communication hook that skips the all-reduce) | `ddp_desync` | see its row |
| jxmnop (X/Twitter, HF Trainer) | the model sometimes not wrapped in DDP: each rank trains alone | the same `ddp_nosync` run | `ddp_desync` | see its row |
| DeepSpeed PR 1801 (BLOOM-176B) | gradient clipping computed from each tensor-parallel rank's own shards: the replicated LayerNorms drift | `tp_clip_local` in the two-process table (`ModelParallelStrategy`, 1 x 2) | `ddp_desync` | see its row |
| pytorch #115607 | a compiled optimizer step that stops updating the parameters | `optimizer_copy` (every step changes nothing) | `update_none` | +10 steps (3 measurements) |
| PyTorch forum 84911 | the layers that should learn frozen by mistake: the model does not learn | `frozen`, `shuffled_labels` | `grad_frozen`, `loss_stagnant` | +0 steps; +3 epochs |
| Stack Overflow 60335387 | `optimizer.zero_grad()` missing | `no_zero_grad` | `grad_not_zeroed` | see its row above |
| Lightning Thunder #725 | autocast no longer applied to the linear layers: mixed precision silently off | `autocast_off` (`precision="bf16-mixed"`, forward in `autocast(enabled=False)`); `llama_autocast_off` | `amp_not_applied` | step 1, +1 (judged at the end of the first batch) |
| mmpretrain #702 | `frozen_stages` applied in a `train()` override that the training loop never calls | `train_override`; `cnn_train_override` | `train_override_bypassed` | step 0, +0 |
| transformers PR 33844 | FlashAttention-2 path keeps attention dropout on in `eval()` | `eval_dropout` (`F.dropout` with its default `training=True`); `gpt2_eval_dropout` (GPT-2's attention dropout applied in eval, the bug's own path) | `eval_randomness` | the first validation batch (sanity check), step 0 |
| transformers #34204 | a processor returns `input_ids` of 1 row for a batch of 50 images | `batch_rows`; `bart_batch_rows` (one source sequence for 16 targets: BART broadcasts it) | `batch_size_mismatch` | step 0, +0 |
| Stack Overflow 67180955 | data-loader workers draw the same augmentation from a generator the dataset holds | `worker_rng`; `cnn_worker_rng` | `worker_rng_shared` | step 0, +0 |
| transformers PR 17877 | weight initialisation run repeatedly at model construction (slow start) | not expressible: it happens before `fit` and changes no training quantity | - | - |
| transformers #23723 | `max_new_tokens` not honoured with long prompts | not expressible: generation-only code, no training step | - | - |
| DeepSpeed #5794 | MoE `all_to_all` called with inconsistent arguments across workers: training hangs | not expressible here: a hang of a CUDA/NCCL collective (a callback never runs again); Lightning's process-group timeout is the guard | - | - |

The rows named `<architecture>_...` are the same faults injected into the real architectures (the real-architecture
matrix below), the others are the fault library's (above) and the two-process table's. The healthy twins
(`healthy_train_override`, `healthy_bf16_mixed`, `healthy_dropout`, `healthy_loader`, `healthy_zero_init`; on real
architectures `cnn_train_override_applied`, `llama_bf16_mixed`, `cnn_loader` and the eight healthy architectures;
the unperturbed DDP and tensor-parallel runs) raise no warning.

Class 6 (a batch whose parts disagree on the batch dimension) is covered where the disagreement is visible in the
batch: `batch_size_mismatch` compares the leading dimension of the batch's leaves. A loss computed over fewer samples
than the batch holds while the leaves agree (`loss = F.cross_entropy(logits[:1], y[:1])`) is not checked: a callback
sees the loss as one number, and which rows entered it would take the gradient of the model's output per row on a
sampled step, a hook on an output the callback cannot name in general (Hugging Face models return the loss itself);
neither cheap nor exact, so it is left out. What is not caught: a gradient all-reduce zeroed
identically on every rank (the replicas stay equal and the loss barely moves), which only a per-step gradient-norm
check on the host would see.

"""  # noqa: E501


def page(rows: list[Row], seconds: float) -> str:
    """``docs/detection.md``."""
    defaults = {type(c).__name__ for c in default_callbacks()}
    names = sorted(defaults)
    extra = sorted({c for r in rows for c in r.callbacks} - defaults)
    users = {n: ", ".join(f"`{r.fault.name}`" for r in rows if n in r.callbacks) for n in extra}
    extra_text = (
        "; the entries that need more get it: " + "; ".join(f"`{n}` for {users[n]}" for n in extra) if extra else ""
    )
    spike = (
        "`pytorch_lightning.callbacks.SpikeDetection` (experimental, in the installed version)"
        if SpikeDetection is not None
        else "`SpikeDetection` is **not** in the installed pytorch_lightning: its column says so"
    )
    caught = sum(r.caught() for r in rows if not r.fault.healthy)
    n_faults = sum(not r.fault.healthy for r in rows)
    alarms = sum(len(r.serious) for r in rows if r.fault.healthy)
    return f"""# Detection matrix

Every fault of the fault library (`lightning_diag/demo/faults.py`) and every healthy baseline, trained with
`lightning_diag.demo.run.default_callbacks()` (here: {", ".join(f"`{n}`" for n in names)}{extra_text}), and, in separate
real runs of the same model, data and seed, with what a Lightning user has today:

* `EarlyStopping(monitor="val_loss", check_finite=True)` with its defaults (patience 3): stops when `val_loss`
  is not finite, or after 3 validation runs without improvement.
* {spike}, defaults (running mean over 10 batches, `rtol=2`, non-finite losses count as spikes): raises
  `TrainingSpikeException`.
* `Trainer(detect_anomaly=True)`: autograd anomaly mode raises a `RuntimeError` when backward produces a NaN.

Reproduce (about {max(1, round(seconds / 60))} minutes on a 2-core CPU, one thread per run):

```bash
{COMMAND}
```

Result: **{caught} of {n_faults} faults caught** by their expected rule within the documented window;
**{alarms} warning/critical alerts on the healthy baselines** (target: none).

"Step" is the global step of the first alert (or of the stop); "+N" counts from the fault's onset. The expected
rule is in bold; other rules that fired on a fault are listed too (a fault often has several symptoms). "Onset to
alert" counts the steps from the fault's onset to its expected rule's first alert, and the measurements (every
{MEASURE_EVERY} steps, onset and alert included) or epochs (one loss point each) that took; the target is
{PROMPT_MEASUREMENTS} (issue 23), and a rule whose definition needs more says why.

{render(rows)}
{SILENT}
## Reading the comparison columns

* `EarlyStopping(check_finite=True)` sees a non-finite value only once it reaches `val_loss`, at the end of the
  epoch, after the NaN update has already been applied to the weights. Its patience stop is a generic "no
  improvement" signal, not a diagnosis.
* `SpikeDetection` looks at the training loss only and raises when it jumps to 3x its running mean: it stops
  non-finite losses at the step and faults whose loss jumps, but says nothing about the cause, cannot see a
  fault that leaves the loss smooth (a frozen layer, vanishing gradients), and raises on healthy runs whose
  loss has fallen near zero, where ordinary batch-to-batch noise is a 3x "spike".
* `detect_anomaly=True` raises only when backward produces a NaN, and slows every step several times over
  (see `docs/performance.md`).
* A fault whose expected rule belongs to a callback missing from `default_callbacks()` would read "no: ... is
  not in `default_callbacks()` yet".
* The silent errors (`optimizer_copy`, `bf16_tiny_lr`, `no_zero_grad`, `eval_mode`, `padding_labels`,
  `val_longer`, and one DDP rank's weights drifting) make no NaN and no spike: the three tools see them only
  when the loss stops improving for long enough (EarlyStopping's patience), which says nothing of the cause.
"""


def _fmt(value: tuple[Any, ...] | None, digits: str = ".3g") -> str:
    if value is None:
        return "-"
    head, *rest = value
    where = ", ".join(f"`{x}`" if isinstance(x, str) else f"step {x}" for x in rest)
    return f"{head:{digits}} ({where})"


def render_margins(rows: list[Row]) -> str:
    """Healthy runs: each gradient quantity's extreme beside its default threshold."""
    head = [
        "architecture",
        "max RMS grad / element (explode > 10)",
        "min ‖g‖/‖W‖ (vanish < 1e-3 ...)",
        "min matrix / best-fed block matrix (... and < 1/100)",
        "max spread within a role (> 100)",
        "min blocks' norm / baseline (collapse < 0.01)",
    ]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if not r.fault.healthy or not r.margins:
            continue
        m = r.margins
        out.append(
            "| "
            + " | ".join(
                [
                    f"`{r.fault.name}`",
                    _fmt(m.get("rms_max")),
                    _fmt(m.get("rel_min")),
                    _fmt(m.get("starve")),
                    _fmt(m.get("spread")),
                    _fmt(m.get("collapse")),
                ]
            )
            + " |"
        )
    return "\n".join(out) + "\n"


def real_section(rows: list[Row], seconds: float) -> str:
    """The real-architecture part of ``docs/detection.md``, between its markers."""
    caught = sum(r.caught() for r in rows if not r.fault.healthy)
    n_faults = sum(not r.fault.healthy for r in rows)
    alarms = sum(len(r.serious) for r in rows if r.fault.healthy)
    n_healthy = sum(r.fault.healthy for r in rows)
    times = ", ".join(f"{r.fault.name} {r.seconds:.0f}s" for r in rows)
    return f"""{REAL_START}
## Real architectures

The corpus of `lightning_diag/demo/corpus.py`: models nobody in this project wrote, built from Hugging Face
`transformers` configs (no download) and torch, each trained with AdamW, a linear warm-up and a cosine decay
on a learnable synthetic task (`lightning_diag/demo/corpus_data.py`), measured every 5 steps, validated every
50: BERT (sequence classification), GPT-2 and Llama with grouped-query attention (causal LM), BART
(encoder-decoder with cross-attention, sequence reversal), ViT and a BatchNorm CNN (images), a 2-layer LSTM,
and a BERT fine-tune whose embeddings and first layer are frozen with `requires_grad_(False)`. Same comparison
columns as above, each in its own real run.

Reproduce (about {max(1, round(seconds / 60))} minutes on a 2-core CPU, one thread per run):

```bash
{REAL_COMMAND}
```

Result: **{caught} of {n_faults} faults caught** by their expected rule within the documented window;
**{alarms} warning/critical alerts on the {n_healthy} healthy runs** (the architectures and the twins; target: none).

The silent-error rules (issue 22: `update_none`, `update_stale`, `grad_not_zeroed`, `eval_mode_in_training`) are
part of the default callbacks, so they are on in every run here (GPT-2 and Llama train on `labels=input_ids`,
the fine-tune has a frozen BERT base, the CNN BatchNorm); `ddp_desync` needs several processes (the two-process
table above). Issue 35's faults are injected into these architectures too (`cnn_train_override`,
`gpt2_eval_dropout`, `llama_autocast_off`, `bert_zero_input`, `gpt2_zero_transfer`, `bart_batch_rows`,
`cnn_worker_rng`), short runs with the set-up each needs (`precision="bf16-mixed"`, Lightning's sanity check,
`DataDiagnostics` for the loader faults), each with a healthy twin among the healthy rows
(`cnn_train_override_applied`, `llama_bf16_mixed`, `cnn_loader`; for the others the plain architecture).

{render(rows)}
Margins of the healthy runs: the extreme of each gradient quantity over the run (from step 50 for the
warm-up-gated rules), beside the default threshold it must not cross (`docs/gradient_flow.md` explains the
quantities).

{render_margins(rows)}
Run times (default callbacks, one thread): {times}.
{REAL_END}
"""


def _read(path: str) -> str:
    if not os.path.exists(path):
        return ""
    with open(path) as f:
        return f.read()


def _splice(path: str, section: str) -> None:
    """Write ``section`` into the page at ``path``, replacing the marked real-architecture section."""
    text = _read(path)
    if REAL_START in text and REAL_END in text:
        before, rest = text.split(REAL_START, 1)
        after = rest.split(REAL_END, 1)[1].lstrip("\n")
        text = before + section + ("\n" + after if after else "")
    else:
        marker = "## Reading the comparison columns"
        text = text.replace(marker, section + "\n" + marker) if marker in text else text + "\n" + section
    with open(path, "w") as f:
        f.write(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", action="append", choices=sorted(FAULTS) + sorted(CORPUS), help="run only these")
    parser.add_argument(
        "--corpus", choices=["demo", "real"], default="demo", help="the fault library (demo) or real architectures"
    )
    parser.add_argument("--max-epochs", type=int, default=None, help="override every entry's epochs")
    parser.add_argument("--no-comparisons", action="store_true", help="skip the Lightning comparison runs")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: fastest for tiny models)")
    parser.add_argument("--write", default=None, help="also write the page (docs/detection.md) here")
    parser.add_argument("--root", default=None, help="directory for the runs' logs (default: a temporary one)")
    args = parser.parse_args(argv)
    if args.max_epochs is not None and args.max_epochs < 1:
        parser.error("--max-epochs must be >= 1")
    with quiet(args.threads):
        return _main(args)


def _main(args: argparse.Namespace) -> int:
    if args.corpus == "real":
        return _main_real(args)
    root = args.root or tempfile.mkdtemp(prefix="detection_matrix_")
    names = args.only or [n for n, f in FAULTS.items() if not f.healthy] + [n for n, f in FAULTS.items() if f.healthy]
    t0 = time.perf_counter()
    rows = []
    try:
        for name in names:
            rows.append(run_entry(name, os.path.join(root, name), args.max_epochs, not args.no_comparisons))
            print(f"[{time.perf_counter() - t0:6.0f}s] {name}: {rows[-1].ours()}", file=sys.stderr)
    finally:
        if args.root is None:
            shutil.rmtree(root, ignore_errors=True)
    print(render(rows))
    if args.write:
        existing = _read(args.write)
        with open(args.write, "w") as f:
            f.write(page(rows, time.perf_counter() - t0))
        if PROBLEMS_START in existing and PROBLEMS_END in existing:  # the training problems' tables, before the rest
            kept = PROBLEMS_START + existing.split(PROBLEMS_START, 1)[1].split(PROBLEMS_END, 1)[0] + PROBLEMS_END
            text = _read(args.write)
            marker = "## Reading the comparison columns"
            text = text.replace(marker, kept + "\n\n" + marker, 1) if marker in text else text + "\n" + kept + "\n"
            with open(args.write, "w") as f:
                f.write(text)
        if REAL_START in existing and REAL_END in existing:  # keep the real-architecture matrix
            _splice(args.write, REAL_START + existing.split(REAL_START, 1)[1].split(REAL_END, 1)[0] + REAL_END + "\n")
        if MP_START in existing and MP_END in existing:  # and the two-process rows, in place
            kept = MP_START + existing.split(MP_START, 1)[1].split(MP_END, 1)[0] + MP_END
            text = _read(args.write)
            head, rest = text.split(MP_START, 1)
            with open(args.write, "w") as f:
                f.write(head + kept + rest.split(MP_END, 1)[1])
        if FOREIGN_START in existing and FOREIGN_END in existing:  # and the foreign-code corpus, at the end
            foreign = FOREIGN_START + existing.split(FOREIGN_START, 1)[1].split(FOREIGN_END, 1)[0] + FOREIGN_END
            text = _read(args.write)
            with open(args.write, "w") as f:
                f.write(text.rstrip("\n") + "\n\n" + foreign + "\n")
    return 0


def _main_real(args: argparse.Namespace) -> int:
    root = args.root or tempfile.mkdtemp(prefix="detection_matrix_real_")
    names = args.only or [n for n, e in CORPUS.items() if not e.healthy] + [n for n, e in CORPUS.items() if e.healthy]
    unknown = [n for n in names if n not in CORPUS]
    if unknown:
        raise SystemExit(f"not in the real-architecture corpus: {unknown}")
    t0 = time.perf_counter()
    rows = []
    try:
        for name in names:
            rows.append(run_real_entry(name, os.path.join(root, name), not args.no_comparisons))
            print(f"[{time.perf_counter() - t0:6.0f}s] {name}: {rows[-1].ours()}", file=sys.stderr)
    finally:
        if args.root is None:
            shutil.rmtree(root, ignore_errors=True)
    section = real_section(rows, time.perf_counter() - t0)
    print(section)
    if args.write:
        _splice(args.write, section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
