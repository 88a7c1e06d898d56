"""The runs of the calibration harness (``benchmarks/calibration.py``): which runs make the healthy set and the
fault set, and how one run is executed into a JSON record.

Everything is enumerated from the libraries, never from a hand list of rules or faults: the fault library
(:data:`lightning_diag.demo.faults.FAULTS`), the real-architecture corpus (:data:`lightning_diag.demo.corpus.CORPUS`),
the foreign corpus (:data:`tests.foreign.corpus.ENTRIES`), the schedules (:data:`lightning_diag.demo.schedules.
SCENARIOS`) and the rule registry (:data:`lightning_diag.rules.catalog.ALL_RULES`).

A run is a :class:`RunSpec`; :func:`execute` trains it with the default callbacks, the callbacks its entry needs
and the opt-in callbacks the spec names, and returns a record: the warning/critical alerts, each rule's peak
excess (:meth:`DiagCallback.rule_peaks`), the rules watched (those of the attached callbacks), the steps, the
steps of an epoch, and on a healthy run (or a fault of the rule) what the oracles of
:mod:`benchmarks.calibration_oracle` measured after the fit (``oracle``: the real share of the step spent waiting
for data, for ``dataloader_bound``).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import os
import re
import sys
import tempfile
import time
import traceback
import warnings
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: The epoch lengths (optimizer steps an epoch) every documented threshold is checked at (issue 44 item 3).
EPOCH_LENGTHS = (1, 4, 16, 64, 256)
#: ``log_every_n_steps`` of every run: the step-measured rules judge every this many steps.
MEASURE_EVERY = 5
#: Epoch faults that are still themselves at one step an epoch, so the per-epoch-length check runs them there too
#: (the others change nature: an alternating rate every step, a drift of the targets at every step).
ONE_STEP_EPOCH_FAULTS = {
    "overfit": "64 random-label samples memorised full-batch: validation worsens run after run at any epoch length",
}
#: The healthy baselines of the fault library trained over every epoch length with a second seed and batch size:
#: one per model shape and optimiser family (the other baselines get every epoch length with one seed).
_SECOND_SEED = (
    "none",
    "healthy_sgd",
    "healthy_deep",
    "healthy_regression",
    "healthy_lm",
    "healthy_gru",
    "healthy_dropout",
)
#: Opt-in probes attached to the healthy runs of the demo models at 16 steps an epoch and to the first seed of
#: each schedule (DataDiagnostics and SystemMonitor go on every healthy run). RobustnessProbe and ErrorAnalysis are
#: calibrated on the text classifiers of :mod:`benchmarks.calibration_probes` instead: every token task of the
#: fault library is decided by exact tokens (the most frequent marker, the next number of a sequence), so a 5%
#: typo changing the answer is the task, not a fragile model, and no model there returns predictions from
#: ``validation_step``.
PROBES = ["SharpnessProbe", "QuantizationProbe"]
#: A fault's recipe at one epoch length where the library's own does not produce its condition there: overrides
#: of its config, the epochs to run, and of its data settings.
#:
#: * ``swing`` at 4 steps: the 40x rate alternation over plain SGD at 0.01, in 4 batches of 128 an epoch, barely
#:   moves the epoch means (-11%, -21%, -18%, -28%, -27%, -4%, +93%: a loss falling steadily, one excursion at the
#:   end, never 3 swinging epochs); over AdamW at 3e-3 the same alternation swings them by 30-330% from epoch to
#:   epoch (the seed's condition), as in tests/callbacks/test_loss_noise.py.
#: * ``oscillation_bs1`` at 4 steps: its 64 samples in 4 batches of 16 are no batch-size-1 fault (the loss falls
#:   1.18 -> 0.15 in 6 epochs, accuracy 72-81%: nothing swings); batch size 1 kept, 4 batches drawn an epoch
#:   (the validation loss swings 10 -> 19 -> 20 -> 7 ...), over 12 epochs.
LENGTH_RECIPES: dict[tuple[str, int], tuple[dict[str, Any], int, dict[str, Any]]] = {
    ("swing", 4): ({"optimizer": "adamw", "lr": 3e-3, "oscillate_factor": 40.0}, 12, {}),
    ("oscillation_bs1", 4): ({}, 12, {"n_train": 64, "batch_size": 1, "limit_batches": 4}),
}
#: The healthy families, in the order the docs describe them.
FAMILIES = {
    "baselines": "the fault library's healthy baselines over epoch lengths, seeds and batch sizes",
    "corpus": "the real-architecture corpus (Hugging Face models from configs, CNN, LSTM, frozen fine-tune)",
    "foreign": "the foreign corpus (other projects' LightningModules, fitted through their own entry points)",
    "schedules": "long runs with the schedules people use (lightning_diag/demo/schedules.py)",
    "probes": "text classifiers for the opt-in probes that read predictions (benchmarks/calibration_probes.py)",
}


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One run of the harness.

    Attributes:
        key: Unique id (the cache key).
        kind: ``"fault"`` (fault library), ``"corpus"``, ``"foreign"``, ``"schedule"``, ``"probe"``
            (:mod:`benchmarks.calibration_probes`) or ``"rulefault"`` (:mod:`benchmarks.calibration_faults`).
        name: The entry's name in its library.
        family: The healthy family (a key of :data:`FAMILIES`), or ``"faults"``.
        seed: Seed of data, model and trainer.
        expected: Rules that must fire (empty: a healthy run).
        onset_step: Global step where the fault begins (step faults).
        onset_epoch: Epoch where the fault begins (epoch faults).
        epoch_len: Target optimizer steps an epoch (``None``: the entry's own).
        batch_size: Training batch size override.
        n_train: Training set size override.
        limit_batches: ``limit_train_batches`` (each epoch a fresh draw of that many batches).
        max_epochs: Epochs (``None``: the entry's own).
        max_steps: Steps (``None``: the entry's own).
        val_every: ``check_val_every_n_epoch``.
        overrides: Overrides of the entry's fault switches (a shifted onset).
        optin: Opt-in callbacks attached beyond the defaults and the entry's own.
        length_check: Part of the per-epoch-length check (item 3).
    """

    key: str
    kind: str
    name: str
    family: str
    seed: int = 0
    expected: tuple[str, ...] = ()
    onset_step: int | None = None
    onset_epoch: int | None = None
    epoch_len: int | None = None
    batch_size: int | None = None
    n_train: int | None = None
    limit_batches: int | None = None
    max_epochs: int | None = None
    max_steps: int | None = None
    val_every: int = 1
    overrides: dict[str, Any] = dataclasses.field(default_factory=dict)
    optin: tuple[str, ...] = ()
    length_check: bool = False

    @property
    def healthy(self) -> bool:
        """Whether no rule may fire."""
        return not self.expected


# ------------------------------------------------------------------------------------------------ the plan


def _shape(model: str) -> tuple[Any, Any]:
    """The fault library's ``(model builder, data module class)`` for the model shape ``model`` (as
    :func:`lightning_diag.demo.faults.build_fault` chooses them)."""
    from lightning_diag.demo.models import build_model
    from lightning_diag.demo.output_models import OUTPUT_SHAPES
    from lightning_diag.demo.synthetic import DATA_MODULES

    if model in OUTPUT_SHAPES:
        return OUTPUT_SHAPES[model]
    return build_model, DATA_MODULES[model]


def _shapes() -> set[str]:
    """The model shapes of the fault library."""
    from lightning_diag.demo.output_models import OUTPUT_SHAPES
    from lightning_diag.demo.synthetic import DATA_MODULES

    return {*OUTPUT_SHAPES, *DATA_MODULES}


def _data_defaults(model: str) -> tuple[int, int]:
    """``(n_train, batch_size)`` defaults of the fault library's data module for ``model``."""
    params = inspect.signature(_shape(model)[1].__init__).parameters
    return int(params["n_train"].default), int(params["batch_size"].default)


def _length_settings(fault: Any, length: int, batch_size: int | None = None) -> dict[str, Any] | None:
    """The data and trainer settings that give ``fault`` epochs of ``length`` steps (``None`` where the fault
    cannot have them).

    A fault whose training set is small by design (its ``data`` sets ``n_train``: memorisation, the swing's 512
    samples) keeps it and divides it into ``length`` batches (of at least 2 samples). The others keep their
    batch size and draw ``length`` batches an epoch (``limit_train_batches``) from a set of at least ``length``
    batches.
    """
    n_default, bs_default = _data_defaults(fault.model)
    if "n_train" in fault.data:
        n = int(fault.data["n_train"])
        if n % length or n // length < 2:  # batches of one sample: another fault
            return None
        return {"n_train": n, "batch_size": n // length, "limit_batches": None}
    bs = batch_size or int(fault.data.get("batch_size", bs_default))
    return {"n_train": max(n_default, length * bs), "batch_size": bs, "limit_batches": length}


def _healthy_epochs(length: int) -> tuple[int, int]:
    """``(max_epochs, val_every)`` of a healthy baseline at ``length`` steps an epoch: at least 60 steps and 2
    epochs, at most ~15 validations."""
    epochs = {1: 60, 4: 20, 16: 8, 64: 3, 256: 2}.get(length, max(2, math.ceil(128 / length)))
    return epochs, max(1, epochs // 15)


def twin_of(name: str) -> str:
    """The healthy twin of a fault-library fault: the healthy entry whose description names it, else the healthy
    entry of the same model shape with the fewest overrides."""
    from lightning_diag.demo.faults import FAULTS

    fault = FAULTS[name]
    healthy = [f for f in FAULTS.values() if f.healthy]
    named = [f for f in healthy if re.search(rf"`{re.escape(name)}`", f.description)]
    if named:
        return named[0].name
    same = [f for f in healthy if f.model == fault.model]
    return min(same, key=lambda f: len(f.config) + len(f.data) + len(f.trainer) + len(f.callbacks)).name


def _has_threshold(rules: tuple[str, ...]) -> bool:
    """Whether any of ``rules`` has a documented threshold (the registry's default is a number)."""
    from lightning_diag.core.registry import RULES

    return any(RULES[r].threshold is not None for r in rules)


def _onset_keys(switches: dict[str, Any], onset: int | None) -> list[str]:
    """The fault switches that set the onset step (``*_at_step`` / ``*_from`` equal to the onset)."""
    if onset is None:
        return []
    return [k for k, v in switches.items() if (k.endswith("_at_step") or k.endswith("_from")) and v == onset]


def _healthy_baselines(subset: str) -> list[RunSpec]:
    from lightning_diag.demo.faults import FAULTS

    specs = []
    names = [f.name for f in FAULTS.values() if f.healthy]
    lengths: tuple[int, ...] = EPOCH_LENGTHS
    if subset == "ci":
        names, lengths = ["none", "healthy_regression", "healthy_gru"], (1, 16)
    for name in names:
        fault = FAULTS[name]
        for length in lengths:
            second = name in _SECOND_SEED and subset != "ci" and length != max(EPOCH_LENGTHS)
            for seed in (0, 1) if second else (0,):
                settings = _length_settings(fault, length, batch_size=8 if seed else None)
                if settings is None:
                    continue
                epochs, val_every = _healthy_epochs(length)
                optin = ["DataDiagnostics", "SystemMonitor"]
                if seed == 0 and subset != "ci" and length == 16:
                    optin += PROBES
                optin = [c for c in optin if c not in {n for n, _ in fault.callbacks}]
                specs.append(
                    RunSpec(
                        f"baseline:{name}:L{length}:s{seed}",
                        "fault",
                        name,
                        "baselines",
                        seed,
                        epoch_len=length,
                        max_epochs=epochs,
                        val_every=val_every,
                        optin=tuple(optin),
                        length_check=seed == 0,
                        **settings,
                    )
                )
    return specs


def _fault_runs(subset: str) -> list[RunSpec]:
    """Every fault of the fault library over seeds and shifted onsets, and at every epoch length."""
    from lightning_diag.demo.faults import FAULTS

    specs = []
    faults = [f for f in FAULTS.values() if not f.healthy]
    if subset == "ci":
        faults = [FAULTS[n] for n in ("nan", "explode", "collapse", "swing")]
    for fault in faults:
        for seed in (0,) if subset == "ci" else (0, 1):
            specs.append(
                RunSpec(
                    f"fault:{fault.name}:s{seed}",
                    "fault",
                    fault.name,
                    "faults",
                    seed,
                    fault.expected_rules,
                    fault.onset_step,
                    fault.onset_epoch,
                )
            )
        keys = _onset_keys(fault.config, fault.onset_step)
        if keys and subset != "ci":
            shift = 3 * MEASURE_EVERY + 2
            onset = int(fault.onset_step or 0) + shift
            specs.append(
                RunSpec(
                    f"fault:{fault.name}:onset{onset}",
                    "fault",
                    fault.name,
                    "faults",
                    0,
                    fault.expected_rules,
                    onset,
                    max_epochs=fault.max_epochs + 2,
                    overrides={k: onset for k in keys},
                )
            )
        for length in (16,) if subset == "ci" else EPOCH_LENGTHS:
            if not _has_threshold(fault.expected_rules):
                continue  # an event judged where it happens (a NaN, a frozen layer): no threshold to hold
            if fault.onset_epoch is not None and length == 1 and fault.name not in ONE_STEP_EPOCH_FAULTS:
                continue  # an epoch fault over one-step epochs: the healthy one-batch epochs are the check there
            recipe, recipe_epochs, recipe_data = LENGTH_RECIPES.get((fault.name, length), ({}, 0, {}))
            settings = {**(_length_settings(fault, length) or {}), **recipe_data} or None
            if settings is None:
                continue
            if fault.onset_step is not None:
                steps = fault.onset_step + max(fault.window, 3 * MEASURE_EVERY) + 2 * MEASURE_EVERY
                run: dict[str, Any] = {"max_steps": steps, "max_epochs": None}
                val_every = max(1, math.ceil(steps / length) // 15)
            else:
                run = {"max_epochs": fault.max_epochs, "max_steps": None}
                val_every = 1
            if recipe_epochs:
                run["max_epochs"] = recipe_epochs
            specs.append(
                RunSpec(
                    f"length:{fault.name}:L{length}",
                    "fault",
                    fault.name,
                    "faults",
                    0,
                    fault.expected_rules,
                    fault.onset_step,
                    fault.onset_epoch,
                    epoch_len=length,
                    val_every=val_every,
                    length_check=True,
                    overrides=recipe,
                    **settings,
                    **run,
                )
            )
    return specs


def _corpus_runs(subset: str) -> list[RunSpec]:
    from lightning_diag.demo.corpus import CORPUS

    specs = []
    for entry in CORPUS.values():
        if entry.healthy:
            if subset == "ci" and entry.name not in ("lstm",):
                continue
            for seed, bs in ((0, 16), (1, 8), (2, 32)) if subset != "ci" else ((0, 16),):
                optin = tuple(
                    c for c in ("DataDiagnostics", "SystemMonitor") if c not in {n for n, _ in entry.callbacks}
                )
                specs.append(
                    RunSpec(
                        f"corpus:{entry.name}:s{seed}:b{bs}",
                        "corpus",
                        entry.name,
                        "corpus",
                        seed,
                        batch_size=bs,
                        optin=optin,
                    )
                )
            continue
        if subset == "ci":
            continue
        for seed in (0,):
            specs.append(
                RunSpec(
                    f"corpus:{entry.name}:s{seed}",
                    "corpus",
                    entry.name,
                    "faults",
                    seed,
                    entry.expected_rules,
                    entry.onset_step,
                )
            )
        keys = _onset_keys(entry.fault, entry.onset_step)
        if keys:
            onset = int(entry.onset_step or 0) + 3 * MEASURE_EVERY + 2
            specs.append(
                RunSpec(
                    f"corpus:{entry.name}:onset{onset}",
                    "corpus",
                    entry.name,
                    "faults",
                    0,
                    entry.expected_rules,
                    onset,
                    max_steps=entry.max_steps + onset - int(entry.onset_step or 0),
                    overrides={k: onset for k in keys},
                )
            )
    return specs


def _foreign_runs(subset: str) -> list[RunSpec]:
    from tests.foreign.corpus import ENTRIES

    if subset == "ci":
        return []
    return [RunSpec(f"foreign:{name}", "foreign", name, "foreign") for name in ENTRIES]


def _schedule_runs(subset: str) -> list[RunSpec]:
    from lightning_diag.demo.schedules import SCENARIOS

    specs = []
    for scenario in SCENARIOS.values():
        if subset == "ci" and scenario.name not in ("one_cycle", "step_decay"):
            continue
        for seed in (0,) if subset == "ci" else (0, 1, 2, 3):
            optin = ["DataDiagnostics", "SystemMonitor"]
            if seed == 0 and subset != "ci":
                optin += PROBES
            specs.append(
                RunSpec(
                    f"schedule:{scenario.name}:s{seed}",
                    "schedule",
                    scenario.name,
                    "schedules",
                    seed,
                    optin=tuple(optin),
                )
            )
    return specs


def _probe_runs(subset: str) -> list[RunSpec]:
    from benchmarks.calibration_probes import PROBE_CALLBACKS, TASKS

    specs = []
    for task in TASKS.values():
        if subset == "ci" and task.net == "bert":  # the CI subset: the fast bag-of-words and order tasks
            continue
        seeds = (0,) if subset == "ci" else (0, 1) if task.expected else (0, 1, 2)
        for seed in seeds:
            family = "faults" if task.expected else "probes"
            onset = 0 if task.expected else None  # wrong from the first epoch
            specs.append(
                RunSpec(
                    f"probe:{task.name}:s{seed}",
                    "probe",
                    task.name,
                    family,
                    seed,
                    task.expected,
                    onset_epoch=onset,
                    max_epochs=task.epochs,
                    optin=PROBE_CALLBACKS,
                )
            )
    return specs


#: The rule faults of the CI subset: one data fault and one step fault (each a few seconds).
_CI_RULEFAULTS = ("leaked_split", "nan_gradients")


def _rulefault_runs(subset: str) -> list[RunSpec]:
    """The faults of the rules the matrices do not exercise (:mod:`benchmarks.calibration_faults`)."""
    from benchmarks.calibration_faults import FAULTS

    specs = []
    for fault in FAULTS.values():
        if subset == "ci" and fault.name not in _CI_RULEFAULTS:
            continue
        for seed in (0,) if subset == "ci" else (0, 1):
            specs.append(
                RunSpec(
                    f"rulefault:{fault.name}:s{seed}",
                    "rulefault",
                    fault.name,
                    "faults",
                    seed,
                    fault.expected,
                    onset_step=fault.onset_step,
                    onset_epoch=fault.onset_epoch,
                )
            )
    return specs


def priority(spec: RunSpec) -> int:
    """The order runs start in, so that a set cut short still has each fault and each healthy family: the faults
    at their own settings (0), the healthy runs at 16 steps an epoch or at their own settings (1), the
    per-epoch-length runs (2), the foreign corpus and the healthy runs' other seeds (3), the faults' other seeds
    and onsets (4)."""
    if spec.expected and (spec.seed > 0 or "onset" in spec.key):
        return 4
    if spec.kind == "foreign" or spec.seed > 0:
        return 3
    if spec.expected and spec.epoch_len is None:
        return 0
    if not spec.expected and spec.epoch_len in (None, 16):
        return 1
    return 2


def plan(subset: str = "full") -> list[RunSpec]:
    """Every run of ``subset`` (``"full"`` or ``"ci"``), in :func:`priority` order.

    Raises:
        ValueError: If ``subset`` is neither.
    """
    if subset not in ("full", "ci"):
        raise ValueError(f"Expected argument `subset` to be 'full' or 'ci', but got {subset!r}")
    specs = [
        *_foreign_runs(subset),
        *_corpus_runs(subset),
        *_schedule_runs(subset),
        *_healthy_baselines(subset),
        *_fault_runs(subset),
        *_probe_runs(subset),
        *_rulefault_runs(subset),
    ]
    specs.sort(key=priority)
    keys = [s.key for s in specs]
    assert len(keys) == len(set(keys)), "duplicate run keys"
    return specs


# --------------------------------------------------------------------------------------------- execution


def _callbacks(names: list[str], model: str) -> list[Any]:
    """The named callbacks, without duplicate classes, built with their defaults, except where the fault library
    declares settings for ``model``'s data (a shape with the same data module counts: its language-model task
    repeats its training sequences in validation by construction, ``data_leakage`` counts exact copies only
    there)."""
    import lightning_diag
    from lightning_diag.demo.faults import FAULTS

    declared: dict[str, dict[str, Any]] = {}
    data = _shape(model)[1] if model in _shapes() else None
    for fault in FAULTS.values():
        if fault.model == model or (data is not None and _shape(fault.model)[1] is data):
            for name, kwargs in fault.callbacks:
                declared.setdefault(name, kwargs)
    seen: set[str] = set()
    out = []
    for name in names:
        if name not in seen:
            seen.add(name)
            out.append(getattr(lightning_diag, name)(**declared.get(name, {})))
    return out


def _trainer_base(root: str) -> dict[str, Any]:
    return {
        "default_root_dir": root,
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "enable_checkpointing": False,
        "log_every_n_steps": MEASURE_EVERY,
        "accelerator": "cpu",
    }


def _fit(trainer_kwargs: dict[str, Any], model: Any, data: Any) -> Any:
    import pytorch_lightning as pl

    trainer = pl.Trainer(**trainer_kwargs)
    trainer.fit(model, datamodule=data)
    return trainer


def _run_fault(spec: RunSpec, root: str) -> tuple[list[Any], Any]:
    import pytorch_lightning as pl

    from lightning_diag.demo.faults import FAULTS
    from lightning_diag.demo.models import DemoConfig
    from lightning_diag.demo.run import default_callbacks, fault_callbacks

    fault = FAULTS[spec.name]
    config = dataclasses.replace(DemoConfig(seed=spec.seed), **{**fault.config, **spec.overrides})
    data_kwargs = dict(fault.data)
    if spec.batch_size is not None:
        data_kwargs["batch_size"] = spec.batch_size
    if spec.n_train is not None:
        data_kwargs["n_train"] = spec.n_train
    build, data_class = _shape(config.model)
    data = data_class(seed=spec.seed, **data_kwargs)
    model = build(config)
    cbs = [*default_callbacks(), *fault_callbacks(fault), *_callbacks(list(spec.optin), fault.model)]
    kwargs = {
        **_trainer_base(root),
        "deterministic": True,
        "max_epochs": spec.max_epochs or fault.max_epochs,
        "check_val_every_n_epoch": spec.val_every,
        **fault.trainer,
    }
    if spec.max_steps is not None:
        kwargs.update(max_steps=spec.max_steps, max_epochs=-1)
    if spec.limit_batches is not None:
        kwargs["limit_train_batches"] = spec.limit_batches
    pl.seed_everything(spec.seed, verbose=False)
    return cbs, _fit({**kwargs, "callbacks": cbs}, model, data)


def _run_corpus(spec: RunSpec, root: str) -> tuple[list[Any], Any]:
    import pytorch_lightning as pl

    from lightning_diag.demo.corpus import ARCHITECTURES, CORPUS, TRAINER_SETTINGS, CorpusModule
    from lightning_diag.demo.corpus_data import CorpusDataModule
    from lightning_diag.demo.run import default_callbacks, fault_callbacks

    entry = CORPUS[spec.name]
    if spec.overrides:
        entry = dataclasses.replace(entry, fault={**entry.fault, **spec.overrides}, onset_step=spec.onset_step)
    if spec.max_steps is not None:
        entry = dataclasses.replace(entry, max_steps=spec.max_steps)
    data_kwargs = dict(entry.data)
    if spec.batch_size is not None:
        data_kwargs["batch_size"] = spec.batch_size
    data = CorpusDataModule(
        ARCHITECTURES[entry.arch],
        seed=spec.seed,
        shuffle_targets=bool(entry.fault.get("shuffle_targets", False)),
        **data_kwargs,
    )
    model = CorpusModule(entry, seed=spec.seed)
    model_shape = {"lm": "causal_lm", "classify": "transformer"}.get(ARCHITECTURES[entry.arch], entry.arch)
    cbs = [*default_callbacks(), *fault_callbacks(entry), *_callbacks(list(spec.optin), model_shape)]
    pl.seed_everything(spec.seed, verbose=False)
    kwargs = {
        **_trainer_base(root),
        **TRAINER_SETTINGS,
        "logger": False,
        "max_steps": entry.max_steps,
        "max_epochs": -1,
        **entry.trainer,
        "callbacks": cbs,
    }
    return cbs, _fit(kwargs, model, data)


def _trainer_ref() -> Any:
    """A callback that only keeps a reference to the trainer it runs in (for :func:`trainer_of`)."""
    import pytorch_lightning as pl

    class TrainerRef(pl.Callback):  # type: ignore[misc]
        def __init__(self) -> None:
            self.trainer: Any = None

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            self.trainer = trainer

    return TrainerRef()


def _run_schedule(spec: RunSpec, root: str) -> tuple[list[Any], Any]:
    from lightning_diag.demo.run import default_callbacks
    from lightning_diag.demo.schedules import SCENARIOS, run_scenario

    cbs = [*default_callbacks(), *_callbacks(list(spec.optin), SCENARIOS[spec.name].model), _trainer_ref()]
    result = run_scenario(spec.name, cbs, root=root, seed=spec.seed)
    return result.callbacks, result


def _run_foreign(spec: RunSpec, root: str) -> tuple[list[Any], Any]:
    from tests.foreign.corpus import ENTRIES, installed, run_entry

    missing = installed(ENTRIES[spec.name])
    if missing is not None:
        raise RuntimeError(missing)
    result = run_entry(spec.name, root)
    return result.trainer_callbacks, result


def _run_probe(spec: RunSpec, root: str) -> tuple[list[Any], Any]:
    from benchmarks.calibration_probes import run_task
    from lightning_diag.demo.run import default_callbacks

    cbs = [*default_callbacks(), *_callbacks(list(spec.optin), "probe")]
    trainer = run_task(spec.name, cbs, {**_trainer_base(root), "num_sanity_val_steps": 0}, spec.seed)
    return cbs, trainer


def _run_rulefault(spec: RunSpec, root: str) -> tuple[list[Any], Any]:
    from benchmarks.calibration_faults import callbacks_for, run_fault

    cbs = callbacks_for(spec.name)
    trainer = run_fault(spec.name, cbs, {**_trainer_base(root), "num_sanity_val_steps": 0}, spec.seed)
    return cbs, trainer


_RUNNERS = {
    "fault": _run_fault,
    "corpus": _run_corpus,
    "schedule": _run_schedule,
    "foreign": _run_foreign,
    "probe": _run_probe,
    "rulefault": _run_rulefault,
}


def trainer_of(callbacks: list[Any], result: Any) -> Any:
    """The fitted trainer of a run (``None`` where the runner does not expose it): the result itself, the
    foreign result's ``trainer``, or the one a schedule's trainer reference kept."""
    for cb in callbacks:
        if type(cb).__name__ == "TrainerRef":
            return cb.trainer
    return result if hasattr(result, "fit_loop") else getattr(result, "trainer", None)


def _oracle(spec: RunSpec, callbacks: list[Any], result: Any, watched: list[str]) -> dict[str, Any] | None:
    """The oracles (:mod:`benchmarks.calibration_oracle`) of the rules a run watches, on a healthy run or a fault
    of those rules; ``None`` where none applies."""
    from benchmarks.calibration_oracle import ORACLES, measure

    rules = [r for r in ORACLES if r in watched and (spec.healthy or r in spec.expected)]
    if not rules:
        return None
    trainer = trainer_of(callbacks, result)
    if trainer is None:
        return {r: {"error": "the runner does not expose its trainer"} for r in rules}
    return measure(trainer, rules)


def _owners(callbacks: list[Any]) -> set[str]:
    """The class names of the diagnostics attached (a subclass counts as its library class)."""
    names: set[str] = set()
    for cb in callbacks:
        names.update(k.__name__ for k in type(cb).__mro__)
    return names


def execute(spec: RunSpec) -> dict[str, Any]:
    """Train ``spec`` and return its record (an ``error`` field instead of alerts if the run raised)."""
    from lightning_diag.demo.run import quiet
    from lightning_diag.instrument.cpu_pressure import CpuPressure, OtherCpu
    from lightning_diag.rules.catalog import ALL_RULES

    record: dict[str, Any] = {"spec": dataclasses.asdict(spec), "measure_every": MEASURE_EVERY}
    pressure, other = CpuPressure(), OtherCpu()
    stall_start, other_start = pressure.read(), other.read()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as root, quiet(1), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            cbs, result = _RUNNERS[spec.kind](spec, root)
        except Exception as err:  # a crash is what the record reports
            record.update(error=f"{type(err).__name__}: {err}", trace=traceback.format_exc()[-2000:])
            record["seconds"] = time.perf_counter() - start
            return record
    diag = [cb for cb in cbs if hasattr(cb, "rule_peaks")]
    owners = _owners(diag)
    alerts = sorted((a for cb in diag for a in getattr(cb, "alerts", [])), key=lambda a: a.global_step)
    if spec.kind == "foreign":  # read from the files: a library may run copies of the callbacks
        alerts = list(result.alerts)
    peaks: dict[str, float] = {}
    for cb in diag:
        for rule, value in cb.rule_peaks().items():
            peaks[rule] = max(value, peaks.get(rule, value))
    trainer = getattr(result, "trainer", result) if spec.kind in ("fault", "corpus") else None
    steps = int(getattr(result, "global_step", 0))
    per_epoch = getattr(trainer, "num_training_batches", None) if trainer is not None else None
    record.update(
        alerts=[
            {
                "rule": a.rule,
                "severity": str(getattr(a.severity, "value", a.severity)),
                "step": a.global_step,
                "epoch": a.epoch,
                "value": a.value,
            }
            for a in alerts
        ],
        peaks={k: v for k, v in peaks.items() if math.isfinite(v)},
        watched=sorted(r for r, owner in ALL_RULES.items() if owner in owners),
        callbacks=sorted({type(cb).__name__ for cb in diag}),
        steps=steps,
        steps_per_epoch=per_epoch if isinstance(per_epoch, int) else None,
        seconds=time.perf_counter() - start,
    )
    stall_end, other_end = pressure.read(), other.read()
    if stall_start is not None and stall_end is not None and record["seconds"] > 0:
        # the machine's CPU pressure over the run: what the wall-clock rules' verdicts depend on
        record["cpu_pressure"] = min(1.0, (stall_end - stall_start) / record["seconds"])
    if other_start is not None and other_end is not None and record["seconds"] > 0:
        # and the CPUs the machine's other processes used meanwhile (who made the pressure)
        record["cpu_others"] = max(0.0, (other_end - other_start) / record["seconds"])
    with quiet(1), warnings.catch_warnings():  # after the record's measures: the oracle trains the module on
        warnings.simplefilter("ignore")
        oracle = _oracle(spec, cbs, result, record["watched"])
    if oracle is not None:
        record["oracle"] = oracle
    return record
