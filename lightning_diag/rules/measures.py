"""The closed set of measurements a detector may read, and the container a caller fills with them (framework-free).

Every detector (:class:`~lightning_diag.rules.base.Rule`) is judged the same way, ``rule.judge(ctx, m)``: ``ctx``
says where in training (:class:`~lightning_diag.rules.base.StepContext`), ``m`` is a :class:`Measures` holding
what the caller computed at this step. A rule names the measurements it cannot judge without in ``needs`` and
those it reads when present in ``optional``, both from :class:`Measure`; the names are the fields of
:class:`Measures` (``Measure.GRAD_RMS.value == "grad_rms"``). A field that was not measured is ``None``.

A measurement of several parts that only make sense together (an output's spread with its level and batch size,
a probe's result with its settings) is one field holding a small frozen record defined here; the larger records
of several parts (an activation's reading, a layer's sampled update, the sampled data) are
in :mod:`lightning_diag.rules.records`.

Example:
    >>> m = Measures(loss=0.69, update_ratios={"fc": 1e-3})
    >>> m.missing(frozenset({Measure.UPDATE_RATIOS, Measure.LOSS}))
    []
    >>> m.missing(frozenset({Measure.GRAD_RMS, Measure.LOSS}))
    ['grad_rms']
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from lightning_diag.rules.errors import Group
    from lightning_diag.rules.records import (
        ActivationReading,
        DataMeasurement,
        LayerStats,
        LayerUpdate,
        SequenceMeasurement,
    )
    from lightning_diag.stats.timing import Series

__all__ = [
    "ALONGSIDE",
    "AmpLayers",
    "BatchSizes",
    "ErrorGroups",
    "LoaderStreams",
    "LoaderWait",
    "LossWindow",
    "Measure",
    "Measures",
    "OutputSpread",
    "QuantizationReading",
    "ReplicaDifferences",
    "Rollback",
    "SharpnessReading",
    "StaleGrads",
    "StepLosses",
    "StepTimes",
    "TrainOverrides",
    "UntrainedInEval",
    "Validation",
    "WeightNorms",
    "ZeroOutputs",
    "fed_by",
]


class Measure(str, enum.Enum):
    """The name of one measurement; its value is the :class:`Measures` field that holds it."""

    # the training loss
    LOSS = "loss"
    LOSS_WINDOW = "loss_window"
    STEP_LOSSES = "step_losses"
    VALIDATION = "validation"
    # gradients and updates
    GRAD_RMS = "grad_rms"
    GRAD_RELATIVE = "grad_relative"
    GRAD_NORM = "grad_norm"
    LAYER_ROLES = "layer_roles"
    BLOCKS = "blocks"
    STUCK_PARAMS = "stuck_params"
    PARAM_NAMES = "param_names"
    UPDATE_RATIOS = "update_ratios"
    WEIGHT_NORMS = "weight_norms"
    LAYER_UPDATES = "layer_updates"
    STALE_GRADS = "stale_grads"
    # activations, attention and outputs
    ACTIVATIONS = "activations"
    INPUT_RMS = "input_rms"
    ATTENTION = "attention"
    ATTENTION_LOGIT_PEAKS = "attention_logit_peaks"
    OUTPUT_SPREAD = "output_spread"
    ZERO_OUTPUTS = "zero_outputs"
    # the module tree's modes and precision
    TRAIN_OVERRIDES = "train_overrides"
    EVAL_MODE = "eval_mode"
    EVAL_DROPOUTS = "eval_dropouts"
    UNTRAINED_IN_EVAL = "untrained_in_eval"
    AMP = "amp"
    # timings and memory
    LOADER_WAIT = "loader_wait"
    STEP_TIMES = "step_times"
    COMPUTE_TIMES = "compute_times"
    GPU_UTILIZATION = "gpu_utilization"
    CPU_PRESSURE = "cpu_pressure"
    MEMORY = "memory"
    # data
    DATA = "data"
    SEQUENCES = "sequences"
    BATCH_SIZES = "batch_sizes"
    LOADER_STREAMS = "loader_streams"
    # probes, replicas and recovery
    SHARPNESS = "sharpness"
    QUANTIZATION = "quantization"
    ROBUSTNESS_DROPS = "robustness_drops"
    ERROR_GROUPS = "error_groups"
    REPLICA_DIFFERENCES = "replica_differences"
    ROLLBACK = "rollback"


#: The measurements read alongside others (the step's loss, the layers' roles, the CPU's contention): a detector
#: that needs nothing and names one of these as optional is not fed a :class:`Measures` that holds only these.
ALONGSIDE: frozenset[Measure] = frozenset(
    {Measure.LOSS, Measure.LAYER_ROLES, Measure.BLOCKS, Measure.PARAM_NAMES, Measure.INPUT_RMS, Measure.CPU_PRESSURE}
)


def fed_by(needs: frozenset[Measure], optional: frozenset[Measure], present: frozenset[Measure]) -> bool:
    """Whether a detector that ``needs`` and reads ``optional`` measurements is judged on measures holding
    ``present``: all it needs, or, where it needs none, one of its optional measurements that is not only read
    alongside others (:data:`ALONGSIDE`).

    Example:
        >>> fed_by(frozenset({Measure.GRAD_NORM}), frozenset({Measure.LOSS}), frozenset({Measure.LOSS}))
        False
        >>> fed_by(frozenset(), frozenset({Measure.LOSS_WINDOW, Measure.VALIDATION}), frozenset({Measure.VALIDATION}))
        True
    """
    if needs:
        return needs <= present
    return not (optional - ALONGSIDE).isdisjoint(present)


@dataclasses.dataclass(frozen=True)
class LossWindow:
    """The training loss over one closed window (an epoch, or ``swing_window`` steps).

    Attributes:
        mean: The window's mean step loss.
        steps: How many step losses the mean is over.
        variance: The variance of those step losses (``None``: unknown).
        lr: The learning rate of the window (``None``: unknown).
        initial: The mean loss of the run's first steps (the untrained model's loss, ``loss_stagnant``'s baseline),
            given with a window that closes after them until the detector has one (``None``: not given; the first
            finite value is kept).
    """

    mean: float
    steps: float = 1.0
    variance: float | None = None
    lr: float | None = None
    initial: float | None = None


@dataclasses.dataclass(frozen=True)
class StepLosses:
    """Training losses of single steps (or micro-batches), in order, with the global step of each."""

    values: Sequence[float]
    steps: Sequence[int]


@dataclasses.dataclass(frozen=True)
class Validation:
    """One validation's monitored value.

    Attributes:
        value: The monitored validation value.
        train: The mean training loss of the period before it (``None``: unknown).
        se: The value's standard error from the validation batches (``None``: unknown).
        noise_se: The standard error ``val_fluctuation`` and ``loss_swing``'s validation view judge against where
            ``se`` is unknown (an estimate from the training noise; ``None``: ``se``).
        df: The degrees of freedom of ``noise_se`` (``inf``: known exactly).
        lr: The learning rate at this run (``None``: unknown).
        baseline: The untrained model's loss, the scale a swinging rise must reach (``None``: unknown, the first
            validation value).
        metric: The validation metric's name, for messages and alerts.
        higher_is_better: Whether a higher value is better (``mode="max"``): how ``loss_stagnant`` orients it.
        is_loss: Whether the value is a loss (lower is better and its name says so): only a loss's swings are
            ``loss_swing``'s (its validation view judges no other value).
    """

    value: float
    train: float | None = None
    se: float | None = None
    noise_se: float | None = None
    df: float = math.inf
    lr: float | None = None
    baseline: float | None = None
    metric: str = "val_loss"
    higher_is_better: bool = False
    is_loss: bool = True


@dataclasses.dataclass(frozen=True)
class WeightNorms:
    """Each layer's weight norm before the optimizer step of a measurement.

    Attributes:
        norms: ``{layer: ||W||}``.
        sizes: ``{layer: its elements}``.
        sgd: ``(learning rate, momentum)`` of its optimizer when it is plain SGD, else ``None``.
    """

    norms: Mapping[str, float]
    sizes: Mapping[str, int]
    sgd: tuple[float, float] | None


@dataclasses.dataclass(frozen=True)
class StaleGrads:
    """Layers whose gradient was not zeroed between optimizer steps, and the optimizers stepping them.

    Attributes:
        layers: The layers whose gradient was not zeroed (empty: all were).
        optimizers: The names of the optimizers stepping them.
        decided: ``False``: the watches closed without a verdict (a check that leaves the alarm as it is).
    """

    layers: Collection[str]
    optimizers: Sequence[str] = ()
    decided: bool = True


@dataclasses.dataclass(frozen=True)
class OutputSpread:
    """How much a module's output varies over a batch.

    Attributes:
        spread: The output's spread across the batch's samples.
        level: The output's typical magnitude.
        batch: The batch's samples.
        source: The module measured.
        input_relative: The inputs' own spread relative to their level (``nan``: unknown).
    """

    spread: float
    level: float
    batch: int
    source: str
    input_relative: float = math.nan


@dataclasses.dataclass(frozen=True)
class ZeroOutputs:
    """Which modules ran, which of them output only zeros, and which were judged for a sign (``None``: none)."""

    ran: Sequence[str]
    zeros: Sequence[str]
    signed: Sequence[str] | None = None


@dataclasses.dataclass(frozen=True)
class TrainOverrides:
    """What overridden ``train()`` methods would do to the module tree.

    Attributes:
        overriders: The classes whose ``train()`` override was tried.
        to_eval: Modules the overrides would put in eval mode that are in training mode.
        to_freeze: Parameters the overrides would freeze that train.
    """

    overriders: Sequence[str]
    to_eval: Sequence[str]
    to_freeze: Sequence[str]


@dataclasses.dataclass(frozen=True)
class UntrainedInEval:
    """Components evaluated before any training forward updated their state (spectral norms), and whether the
    evaluation was the sanity check."""

    modules: Sequence[str]
    sanity: bool


@dataclasses.dataclass(frozen=True)
class AmpLayers:
    """The matmul layers that ran under mixed precision (``{layer: parameter count}``), those of them whose output
    was float32, and the trainer's precision setting."""

    layers: Mapping[str, int]
    float32: Mapping[str, int]
    precision: str


@dataclasses.dataclass(frozen=True)
class LoaderWait:
    """Time spent waiting for batches over ``steps`` steps, and those steps' whole time (seconds)."""

    wait_s: float
    step_s: float
    steps: int


@dataclasses.dataclass(frozen=True)
class StepTimes:
    """The window of step times after the warm-up (seconds, oldest first), with what explains some of them.

    Attributes:
        times: The window of step times after the warm-up.
        run_times: Every step time since the fit's start while the window is still short (``None``: not kept).
        explained: Which of ``run_times`` have a known one-time cause.
        work: The trainer's scheduled work measured on each step of ``times`` (seconds).
        run_work: The same for ``run_times``.
        run_pressure: The CPU pressure blamed on the machine over the steps of ``run_times`` (their mean, as
            :attr:`Measures.cpu_pressure` is the window's; ``None``: not known).
    """

    times: Series
    run_times: Series | None = None
    explained: Sequence[bool] | None = None
    work: Series | None = None
    run_work: Series | None = None
    run_pressure: float | None = None


@dataclasses.dataclass(frozen=True)
class BatchSizes:
    """One batch's leading dimensions (``{key: rows}``), its split, and words saying which batch it was."""

    sizes: Mapping[str, int]
    split: str
    where: str = ""


@dataclasses.dataclass(frozen=True)
class LoaderStreams:
    """The training loader's shared random streams: the paths of the dataset's own generators that reading a
    sample drew from, its ``num_workers`` and its ``worker_init_fn`` (``""``: none; else a description)."""

    paths: Sequence[str]
    num_workers: int
    worker_init: str


@dataclasses.dataclass(frozen=True)
class SharpnessReading:
    """One sharpness probe: the SAM gap ``L(w+eps) - L(w)``, relative to the loss (``None``: unknown), the radius
    ``rho`` and the layers that contributed most."""

    gap: float
    relative_gap: float | None = None
    rho: float | None = None
    worst_layers: Sequence[tuple[str, float]] = ()


@dataclasses.dataclass(frozen=True)
class QuantizationReading:
    """One quantization probe.

    Attributes:
        end_to_end: The relative loss change under the judged scheme (``None``: unmeasured).
        layer_errors: Each layer's relative output MSE under the judged scheme.
        per_channel_errors: The same under per-channel weight scales.
        scheme: The judged scheme.
        notes: A few words on some layers (their outlier ratios).
        change_noise: The standard error of the end-to-end change, relative like it (``nan``: unknown).
    """

    end_to_end: float | None
    layer_errors: Mapping[str, float]
    per_channel_errors: Mapping[str, float]
    scheme: str = "per-tensor"
    notes: Mapping[str, str] | None = None
    change_noise: float = math.nan


@dataclasses.dataclass(frozen=True)
class ErrorGroups:
    """The candidate groups of one error analysis, the overall error rate, a decoder of feature names for the
    messages and the analysis's ordinal."""

    groups: Sequence[Group]
    overall_rate: float
    decode: Callable[[str], str] | None = None
    analysis: int = 1


@dataclasses.dataclass(frozen=True)
class ReplicaDifferences:
    """One comparison of the replicas' parameter checksums over every replica group.

    Attributes:
        per_param: Per parameter (model order), the largest relative checksum difference among its replicas (0 for
            a parameter with no replica).
        names: The parameter names, in the model's order.
        first: ``{global rank: (parameter index, reference rank)}``: every rank that differs from its group's
            first member, with the first parameter on which it does.
        compared: How many of the parameters have replicas (``None``: all).
    """

    per_param: Sequence[float]
    names: Sequence[str]
    first: Mapping[int, tuple[int, int]]
    compared: int | None = None


@dataclasses.dataclass(frozen=True)
class Rollback:
    """A rollback just made: the snapshot step restored, what was found non-finite, where, and why this snapshot."""

    restored: int
    found: str
    source: str
    reason: str


@dataclasses.dataclass(frozen=True)
class Measures:
    """What a caller measured at one step, for the rules it judges; every field is a :class:`Measure` (``None``:
    not measured).

    Attributes:
        loss: The training loss of the measured step.
        loss_window: The training loss over a closed window.
        step_losses: Single steps' training losses.
        validation: A validation's monitored value.
        grad_rms: ``{layer: gradient RMS}``.
        grad_relative: ``{layer: gradient RMS / weight RMS}``.
        grad_norm: The gradient's global norm.
        layer_roles: ``{layer: role}`` (``"embedding"``, ``"norm"``, ...).
        blocks: The layers that belong to repeated blocks.
        stuck_params: ``{parameter: why its gradient is stuck}``.
        param_names: Every parameter's name, in the model's order.
        update_ratios: ``{layer: ||W_after - W_before|| / ||W_before||}``.
        weight_norms: Each layer's weight norm before a measured optimizer step.
        layer_updates: ``{layer: what the step did to its sampled elements}``.
        stale_grads: Gradients not zeroed between steps.
        activations: The activation readings of the watched layers.
        input_rms: The RMS of the model's input.
        attention: ``{attention module: its heads' statistics}``.
        attention_logit_peaks: ``{attention module: its largest pre-softmax logit}``.
        output_spread: How much a module's output varies over a batch.
        zero_outputs: Modules that output only zeros.
        train_overrides: What overridden ``train()`` methods would do.
        eval_mode: ``{module: why it is in eval mode during training}``.
        eval_dropouts: ``{module: dropout probability}`` of the dropouts applied during evaluation.
        untrained_in_eval: Components evaluated before any training forward updated their state.
        amp: The layers that ran under mixed precision.
        loader_wait: Time waiting for batches.
        step_times: The step times' window.
        compute_times: Step times without the loader's wait, their periodic slow steps left out (seconds).
        gpu_utilization: A window of GPU utilisation samples (percent), oldest first.
        cpu_pressure: The share of the step-time window's wall time during which some runnable task waited for a
            CPU (:mod:`~lightning_diag.instrument.cpu_pressure`; the busiest rank's).
        memory: ``{memory kind: bytes}`` (``"host_rss"``, ``"cuda_allocated"``).
        data: One data measurement.
        sequences: One sequence-length measurement.
        batch_sizes: One batch's leading dimensions.
        loader_streams: The training loader's shared random streams.
        sharpness: One sharpness probe.
        quantization: One quantization probe.
        robustness_drops: ``{perturbation: relative accuracy drop}``.
        error_groups: One error analysis's candidate groups.
        replica_differences: How far the replicas' parameter checksums differ.
        rollback: A rollback just made.
    """

    loss: float | None = None
    loss_window: LossWindow | None = None
    step_losses: StepLosses | None = None
    validation: Validation | None = None
    grad_rms: Mapping[str, float] | None = None
    grad_relative: Mapping[str, float] | None = None
    grad_norm: float | None = None
    layer_roles: Mapping[str, str] | None = None
    blocks: Collection[str] | None = None
    stuck_params: Mapping[str, str] | None = None
    param_names: Sequence[str] | None = None
    update_ratios: Mapping[str, float] | None = None
    weight_norms: WeightNorms | None = None
    layer_updates: Mapping[str, LayerUpdate] | None = None
    stale_grads: StaleGrads | None = None
    activations: Sequence[ActivationReading] | None = None
    input_rms: float | None = None
    attention: Mapping[str, LayerStats] | None = None
    attention_logit_peaks: Mapping[str, float] | None = None
    output_spread: OutputSpread | None = None
    zero_outputs: ZeroOutputs | None = None
    train_overrides: TrainOverrides | None = None
    eval_mode: Mapping[str, str] | None = None
    eval_dropouts: Mapping[str, float] | None = None
    untrained_in_eval: UntrainedInEval | None = None
    amp: AmpLayers | None = None
    loader_wait: LoaderWait | None = None
    step_times: StepTimes | None = None
    compute_times: Series | None = None
    gpu_utilization: Series | None = None
    cpu_pressure: float | None = None
    memory: Mapping[str, float] | None = None
    data: DataMeasurement | None = None
    sequences: SequenceMeasurement | None = None
    batch_sizes: BatchSizes | None = None
    loader_streams: LoaderStreams | None = None
    sharpness: SharpnessReading | None = None
    quantization: QuantizationReading | None = None
    robustness_drops: Mapping[str, float] | None = None
    error_groups: ErrorGroups | None = None
    replica_differences: ReplicaDifferences | None = None
    rollback: Rollback | None = None

    def present(self) -> frozenset[Measure]:
        """The measurements this holds a value for."""
        return frozenset(_MEASURE_OF[name] for name, value in self.__dict__.items() if value is not None)

    def missing(self, needs: Collection[Measure]) -> list[str]:
        """The names of the measurements of ``needs`` this holds no value for, sorted."""
        return sorted(n.value for n in needs if getattr(self, n.value) is None)

    def holds_all(self, names: Collection[str]) -> bool:
        """Whether every field of ``names`` holds a value (:meth:`missing` is empty; a judgment's check, per call)."""
        fields = self.__dict__
        return all(fields[name] is not None for name in names)

    def holds_any(self, names: Collection[str]) -> bool:
        """Whether a field of ``names`` holds a value."""
        fields = self.__dict__
        return any(fields[name] is not None for name in names)


#: ``{field name: its Measure}``, for :meth:`Measures.present` (every field of :class:`Measures` is one).
_MEASURE_OF: dict[str, Measure] = {name.value: name for name in Measure}


@functools.lru_cache(maxsize=1024)
def field_names(measures: frozenset[Measure]) -> tuple[str, ...]:
    """The :class:`Measures` field names of ``measures`` (for :meth:`Measures.holds_all` / :meth:`Measures.holds_any`;
    kept per set: a rule's ``needs`` and ``optional`` are class constants)."""
    return tuple(sorted(n.value for n in measures))
