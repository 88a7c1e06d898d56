"""Every callback is a preset: a named list of detectors whose rule ids are the ones it owns (issue 43)."""

import copy
import pickle
import re
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch

from lightning_diag import (
    AnomalyAlarm,
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
from lightning_diag.callbacks.common.preset import Detector, Preset
from lightning_diag.core.registry import rules_of
from lightning_diag.rules.catalog import ALL_RULES
from lightning_diag.rules.grad_norm_band import GradBandRule

DOCS = Path(__file__).resolve().parents[2] / "docs"
#: Each public callback and its page.
PAGES = {
    AnomalyAlarm: "anomaly_alarm.md",
    GradientFlowMonitor: "gradient_flow.md",
    AttentionEntropyMonitor: "attention_entropy.md",
    SystemMonitor: "system_monitor.md",
    DataDiagnostics: "data_diagnostics.md",
    ErrorAnalysis: "error_analysis.md",
    SharpnessProbe: "sharpness_probe.md",
    QuantizationProbe: "quantization_probe.md",
    RobustnessProbe: "robustness_probe.md",
}


@pytest.mark.parametrize("callback", list(PAGES), ids=lambda c: c.__name__)
def test_the_preset_declares_every_rule_the_callback_owns(callback: type[DiagCallback]) -> None:
    preset = callback.preset
    assert preset.name == callback.__name__
    ids = preset.rule_ids
    assert len(ids) == len(set(ids)), f"a rule id twice in {preset.name}'s preset"
    assert set(ids) == {spec.rule_id for spec in rules_of(callback.__name__)}
    # attributes and checkpoint keys are distinct: one detector per attribute, one state per key
    assert len({d.attribute for d in preset.detectors}) == len(preset.detectors)
    assert len({d.key for d in preset.detectors}) == len(preset.detectors)


def test_every_declared_rule_is_in_exactly_one_preset() -> None:
    owners: dict[str, list[str]] = {}
    for callback in PAGES:
        for rule_id in callback.preset.rule_ids:
            owners.setdefault(rule_id, []).append(callback.__name__)
    assert set(ALL_RULES) == set(owners)
    assert all(len(names) == 1 for names in owners.values()), owners


@pytest.mark.parametrize("callback", list(PAGES), ids=lambda c: c.__name__)
def test_the_callback_page_lists_every_rule_of_its_preset(callback: type[DiagCallback]) -> None:
    page = (DOCS / PAGES[callback]).read_text()
    missing = [r for r in callback.preset.rule_ids if not re.search(rf"`{r}`", page)]
    assert not missing, f"docs/{PAGES[callback]} does not name {missing}"


@pytest.mark.parametrize("callback", list(PAGES), ids=lambda c: c.__name__)
def test_the_detectors_are_built_and_saved_under_their_keys(callback: type[DiagCallback]) -> None:
    instance = callback()
    state = instance.state_dict()
    for entry in callback.preset.detectors:
        built = getattr(instance, entry.attribute)
        assert isinstance(built, entry.rule)
        assert entry.key in state


def test_context_is_read_when_a_fit_builds_the_detectors(tmp_path: Path) -> None:
    """A detector's context (here ``monitor`` and ``mode``) is the callback's attribute as a fit starts, and every
    fit gets fresh detectors."""
    alarm = AnomalyAlarm(monitor="val_acc", mode="max")
    first = alarm.val_decline_rule
    assert (first.monitor, first.mode) == ("val_acc", "max")

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return self.layer(batch).pow(2).mean()

        def train_dataloader(self) -> torch.utils.data.DataLoader:
            return torch.utils.data.DataLoader(torch.randn(8, 4), batch_size=4)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    alarm.monitor = "val_f1"
    trainer = pl.Trainer(
        default_root_dir=tmp_path, max_steps=2, callbacks=[alarm], logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False,
    )
    trainer.fit(Tiny())
    rebuilt = alarm.val_decline_rule
    assert rebuilt is not first
    assert (rebuilt.monitor, rebuilt.mode) == ("val_f1", "max")


def test_a_preset_lists_its_rule_ids_and_keys() -> None:
    preset = Preset("X", (Detector(GradBandRule, "band"),))
    assert preset.rule_ids == ("grad_vanish", "grad_explode")
    assert preset.detectors[0].key == "band"


@pytest.mark.parametrize("copier", [copy.deepcopy, lambda x: pickle.loads(pickle.dumps(x))], ids=["deepcopy", "pickle"])
def test_a_copied_callback_builds_from_its_own_attributes(copier) -> None:
    """Pickled or deep-copied (a LightningCLI config, a hyper-parameter search), a callback's declarations build
    its detectors from the copy's attributes, not the original's."""
    original = AnomalyAlarm(monitor="val_acc", mode="max")
    copied = copier(original)
    copied.monitor = "val_f1"
    copied.reset_rules()
    assert copied.val_decline_rule.monitor == "val_f1"
    assert original.val_decline_rule.monitor == "val_acc"
    for entry in AnomalyAlarm.preset.detectors:
        assert getattr(copied, entry.attribute) is not getattr(original, entry.attribute)


def test_feed_judges_the_detectors_the_measurements_feed_in_preset_order() -> None:
    from lightning_diag.rules.base import StepContext
    from lightning_diag.rules.grad_collapse import GradCollapseRule
    from lightning_diag.rules.grad_layer_spread import GradSpreadRule
    from lightning_diag.rules.measures import Measures

    monitor = GradientFlowMonitor()
    called: list[str] = []
    for entry in GradientFlowMonitor.preset.detectors:
        rule = getattr(monitor, entry.attribute)
        judge = rule.judge

        def spy(ctx, m, _judge=judge, _name=entry.rule.__name__):
            called.append(_name)
            return _judge(ctx, m)

        rule.judge = spy  # the test's own detector instances
    ctx = StepContext(epoch=0, global_step=5)
    # the step's loss alone feeds nobody (it is read alongside other measurements): a measuring part's error
    with pytest.raises(ValueError, match=r"no detector of its preset reads \['loss'\]"):
        monitor.feed(ctx, Measures(loss=1.0))
    assert called == []
    # the global gradient norm feeds the collapse rule only
    monitor.feed(ctx, Measures(grad_norm=1.0, loss=1.0))
    assert called == [GradCollapseRule.__name__]
    called.clear()
    # the per-layer gradients feed the band (which needs none of them) and the spread, in preset order
    monitor.feed(ctx, Measures(grad_rms={"a": 1e-3}, grad_relative={"a": 1e-3}, layer_roles={"a": "linear"}))
    assert called == [GradBandRule.__name__, GradSpreadRule.__name__]



@pytest.mark.parametrize("callback", list(PAGES), ids=lambda c: c.__name__)
def test_every_detector_reads_a_measurement_that_feeds_it(callback: type[DiagCallback]) -> None:
    from lightning_diag.rules.measures import ALONGSIDE
    from lightning_diag.rules.nonfinite import NonFinitePolicy

    for entry in callback.preset.detectors:
        needs = getattr(entry.rule, "needs", frozenset())
        optional = getattr(entry.rule, "optional", frozenset())
        if entry.rule is NonFinitePolicy:  # the guard carries out its verdicts; it raises no alert through judge
            assert not needs and not optional
            continue
        assert needs or optional - ALONGSIDE, f"nothing feeds {entry.rule.__name__}: it reads only {optional}"
        assert entry in callback.preset.fed_by(frozenset(needs or optional - ALONGSIDE))
