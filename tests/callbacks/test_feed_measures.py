"""The measuring parts of GradientFlowMonitor, AttentionEntropyMonitor, SystemMonitor, DataDiagnostics, the probes
and ErrorAnalysis name what they measured (``feed``), not who reads it (issue 43): the measures each part builds
feed exactly the detectors that part judged by name before, in the same order."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import pytorch_lightning as pl
import torch

from lightning_diag import (
    AttentionEntropyMonitor,
    DataDiagnostics,
    ErrorAnalysis,
    GradientFlowMonitor,
    QuantizationProbe,
    RobustnessProbe,
    SharpnessProbe,
    SystemMonitor,
)
from lightning_diag.callbacks.common.base import DiagCallback
from lightning_diag.rules.activations import ActivationRule
from lightning_diag.rules.attention_entropy import AttentionEntropyRule
from lightning_diag.rules.attention_logits import AttentionLogitRule
from lightning_diag.rules.attention_sink import AttentionSinkRule
from lightning_diag.rules.data_loader import LoaderRules
from lightning_diag.rules.data_sample import DataRules
from lightning_diag.rules.data_sequences import SequenceRules
from lightning_diag.rules.dataloader_bound import DataloaderBoundRule
from lightning_diag.rules.errors import ErrorClusterRule
from lightning_diag.rules.grad_collapse import GradCollapseRule
from lightning_diag.rules.grad_frozen import GradFrozenRule
from lightning_diag.rules.grad_layer_spread import GradSpreadRule
from lightning_diag.rules.grad_norm_band import GradBandRule
from lightning_diag.rules.grad_not_zeroed import GradNotZeroedRule
from lightning_diag.rules.measures import (
    BatchSizes,
    ErrorGroups,
    LoaderStreams,
    Measure,
    Measures,
    QuantizationReading,
    SharpnessReading,
    StaleGrads,
    WeightNorms,
)
from lightning_diag.rules.memory_growth import MemoryGrowthRule
from lightning_diag.rules.quantization_error import QuantizationErrorRule
from lightning_diag.rules.records import ActivationReading, LayerUpdate
from lightning_diag.rules.robustness import RobustnessDropRule
from lightning_diag.rules.sharp_minimum import SharpMinimumRule
from lightning_diag.rules.step_time_fluctuation import StepFluctuationRule
from lightning_diag.rules.step_time_periodic import StepPeriodicRule
from lightning_diag.rules.update_size import UpdateSizeRule
from lightning_diag.rules.updates_applied import UpdateRule
from tests.callbacks.system_models import Encoder, FakeTime, Tick

#: Per callback: (the measurement that names a call site, the detectors that call site judged before, in order).
#: The first entry whose measurement the measures hold is the call site (the update ratios come with the weights).
BEFORE: dict[type[DiagCallback], list[tuple[Measure, tuple[type, ...]]]] = {
    GradientFlowMonitor: [
        (Measure.UPDATE_RATIOS, (GradBandRule, GradSpreadRule, GradCollapseRule, UpdateSizeRule)),
        (Measure.GRAD_RMS, (GradBandRule, GradSpreadRule)),
        (Measure.GRAD_NORM, (GradCollapseRule,)),
        (Measure.STUCK_PARAMS, (GradFrozenRule,)),
        (Measure.ACTIVATIONS, (ActivationRule,)),
        (Measure.WEIGHT_NORMS, (GradBandRule,)),
        (Measure.LAYER_UPDATES, (UpdateRule,)),
        (Measure.STALE_GRADS, (GradNotZeroedRule,)),
    ],
    AttentionEntropyMonitor: [
        (Measure.ATTENTION_LOGIT_PEAKS, (AttentionLogitRule,)),
        (Measure.ATTENTION, (AttentionEntropyRule, AttentionSinkRule)),
    ],
    SystemMonitor: [
        (Measure.LOADER_WAIT, (DataloaderBoundRule,)),
        (Measure.STEP_TIMES, (StepPeriodicRule,)),
        (Measure.COMPUTE_TIMES, (StepFluctuationRule,)),
        (Measure.MEMORY, (MemoryGrowthRule,)),
        (Measure.GPU_UTILIZATION, (StepPeriodicRule,)),
    ],
    DataDiagnostics: [
        (Measure.DATA, (DataRules, SequenceRules)),
        (Measure.BATCH_SIZES, (LoaderRules,)),
        (Measure.LOADER_STREAMS, (LoaderRules,)),
    ],
    SharpnessProbe: [(Measure.SHARPNESS, (SharpMinimumRule,))],
    QuantizationProbe: [(Measure.QUANTIZATION, (QuantizationErrorRule,))],
    RobustnessProbe: [(Measure.ROBUSTNESS_DROPS, (RobustnessDropRule,))],
    ErrorAnalysis: [(Measure.ERROR_GROUPS, (ErrorClusterRule,))],
}


def _site(callback: type[DiagCallback], m: Measures) -> tuple[Measure, tuple[type, ...]]:
    """The call site of ``callback`` that built ``m`` (see :data:`BEFORE`)."""
    present = m.present()
    return next((name, rules) for name, rules in BEFORE[callback] if name in present)


def _fed(callback: type[DiagCallback], m: Measures) -> tuple[type, ...]:
    return tuple(entry.rule for entry in callback.preset.fed_by(m.present()))


#: The measures each call site builds, as it builds them (values of the right kinds; ``None``: not measured).
BUILT: list[tuple[type[DiagCallback], Measures]] = [
    (GradientFlowMonitor, Measures(grad_rms={"a": 1.0}, grad_relative={"a": 1.0}, blocks=None, layer_roles={})),
    (GradientFlowMonitor, Measures(grad_rms={"a": 1.0}, grad_relative={"a": 1.0}, blocks=["a"], layer_roles={})),
    (GradientFlowMonitor, Measures(grad_norm=1.0, loss=None)),
    (GradientFlowMonitor, Measures(grad_norm=1.0, loss=0.5)),
    (GradientFlowMonitor, Measures(stuck_params={}, param_names=["a.weight"])),
    (GradientFlowMonitor, Measures(activations=[ActivationReading("a", "ReLU", dead=0.1)], input_rms=None, loss=None)),
    (GradientFlowMonitor, Measures(activations=[ActivationReading("a", "ReLU", dead=0.1)], input_rms=1.0, loss=0.5)),
    (GradientFlowMonitor, Measures(weight_norms=WeightNorms({"a": 1.0}, {"a": 4}, None))),
    (GradientFlowMonitor, Measures(weight_norms=None, update_ratios={"a": 1e-3}, loss=None)),
    (GradientFlowMonitor, Measures(weight_norms=WeightNorms({}, {}, None), update_ratios={}, loss=0.5)),
    (GradientFlowMonitor, Measures(layer_updates={"a": LayerUpdate(8, 0)}, loss=None)),
    (GradientFlowMonitor, Measures(stale_grads=StaleGrads((), decided=False))),
    (GradientFlowMonitor, Measures(stale_grads=StaleGrads({"a"}, ["optimizer 0 (SGD)"]))),
    (AttentionEntropyMonitor, Measures(attention_logit_peaks={})),
    (AttentionEntropyMonitor, Measures(attention={}, loss=0.5)),
    (SystemMonitor, Measures(gpu_utilization=[50.0, 60.0])),
    (DataDiagnostics, Measures(batch_sizes=BatchSizes({"x": 4, "y": 3}, "train"))),
    (DataDiagnostics, Measures(loader_streams=LoaderStreams(["dataset.rng"], 2, ""))),
    (SharpnessProbe, Measures(sharpness=SharpnessReading(0.1))),
    (QuantizationProbe, Measures(quantization=QuantizationReading(None, {}, {}))),
    (RobustnessProbe, Measures(robustness_drops={"swap": 0.1})),
    (ErrorAnalysis, Measures(error_groups=ErrorGroups([], 0.1))),
]


@pytest.mark.parametrize(("callback", "m"), BUILT, ids=lambda x: x.__name__ if isinstance(x, type) else "")
def test_the_measures_of_a_call_site_feed_the_detectors_it_judged(callback: type[DiagCallback], m: Measures) -> None:
    _name, before = _site(callback, m)
    assert _fed(callback, m) == before


def test_every_detector_of_these_presets_is_fed_by_some_call_site() -> None:
    for callback, sites in BEFORE.items():
        fed = {rule for _name, rules in sites for rule in rules}
        assert fed == {entry.rule for entry in callback.preset.detectors}, callback.__name__


class _Spy:
    """Wraps a callback's ``feed`` (on the test's own instance): the measures of every call, and the alerts."""

    def __init__(self, callback: DiagCallback) -> None:
        self.callback = callback
        self.calls: list[Measures] = []
        self.alerts = 0
        self.feed: Callable[[Any, Measures], list[Any]] = callback.feed
        callback.feed = self  # type: ignore[method-assign]

    def __call__(self, ctx: Any, m: Measures) -> list[Any]:
        self.calls.append(m)
        alerts = self.feed(ctx, m)
        self.alerts += len(alerts)
        return alerts


class _Leaky(Encoder):
    """The system tests' encoder with a ReLU module (the activation watch's) and a validation loop."""

    def __init__(self) -> None:
        super().__init__(width=32, seq=16, samples=256)
        self.act = torch.nn.ReLU()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.act(h).mean(dim=1))


@pytest.mark.slow
def test_a_fit_feeds_each_detector_from_the_call_sites_that_judged_it(tmp_path) -> None:
    clock = FakeTime()
    system = SystemMonitor()
    system.time_source = clock  # the timings are the fake clock's: no wall-clock alert
    callbacks: list[DiagCallback] = [GradientFlowMonitor(), AttentionEntropyMonitor(), DataDiagnostics(), system]
    spies = [_Spy(cb) for cb in callbacks]
    trainer = pl.Trainer(
        max_steps=16,
        log_every_n_steps=4,
        accelerator="cpu",
        callbacks=[*callbacks, Tick(clock, 0.01)],
        logger=False,
        default_root_dir=str(tmp_path),
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(_Leaky())
    seen: dict[type[DiagCallback], set[Measure]] = {}
    for spy in spies:
        kind = type(spy.callback)
        for m in spy.calls:
            name, before = _site(kind, m)
            assert _fed(kind, m) == before, (kind.__name__, sorted(x.value for x in m.present()))
            seen.setdefault(kind, set()).add(name)
        assert spy.alerts == len(spy.callback.alerts)  # every alert of the fit came through `feed`
        assert not any(a.severity.value in ("warning", "critical") for a in spy.callback.alerts)  # a healthy fit
    # the call sites a healthy fit on the CPU reaches, each at least once
    assert seen[GradientFlowMonitor] >= {
        Measure.GRAD_RMS,
        Measure.GRAD_NORM,
        Measure.STUCK_PARAMS,
        Measure.ACTIVATIONS,
        Measure.UPDATE_RATIOS,
        Measure.LAYER_UPDATES,
    }
    assert seen[AttentionEntropyMonitor] == {Measure.ATTENTION_LOGIT_PEAKS, Measure.ATTENTION}
    assert {Measure.LOADER_WAIT, Measure.STEP_TIMES, Measure.COMPUTE_TIMES, Measure.MEMORY} <= seen[SystemMonitor]
    assert Measure.DATA in seen[DataDiagnostics]
