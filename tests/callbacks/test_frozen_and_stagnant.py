"""grad_frozen (GradientFlowMonitor) and loss_stagnant (AnomalyAlarm) through real Trainer.fit runs."""

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import BaseFinetuning
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_diag import AnomalyAlarm, GradientFlowMonitor
from lightning_diag.demo import run_demo

FAST = dict(
    enable_progress_bar=False,
    enable_model_summary=False,
    enable_checkpointing=False,
    accelerator="cpu",
    log_every_n_steps=2,
    logger=False,
)


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class _Net(pl.LightningModule):
    """Three linear layers; ``bug="excluded"`` leaves `middle` out of the optimizer, ``"detach"`` cuts `first`,
    ``"zero"`` zeroes its gradient in the graph, ``"unused_head"`` builds a head that is never called."""

    def __init__(self, bug=None):
        super().__init__()
        torch.manual_seed(0)
        self.bug = bug
        self.first, self.middle, self.last = nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 1)
        if bug == "unused_head":  # an optional head this configuration builds and never calls
            self.aux_head = nn.Linear(8, 3)

    def forward(self, x):
        h = torch.relu(self.first(x))
        if self.bug == "detach":  # the classic slip: `first` is cut from the loss and never gets a gradient
            h = h.detach()
        if self.bug == "zero" or (self.bug == "zero_later" and self.global_step >= 3):
            h = h * 0.0 + 1.0  # in the graph, but multiplied by zero: `first` gets a gradient of exactly 0
        return self.last(torch.relu(self.middle(h))).squeeze(-1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self):
        params = [p for n, p in self.named_parameters() if not (self.bug == "excluded" and n.startswith("middle"))]
        return torch.optim.SGD(params, lr=0.01)


def _loader():
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(64, 4, generator=g), torch.randn(64, generator=g)), batch_size=8)


def _fit(model, callbacks, tmp_path, steps=8):
    pl.Trainer(default_root_dir=tmp_path, max_steps=steps, callbacks=callbacks, **FAST).fit(model, _loader())


def test_healthy_net_has_no_frozen_alert(tmp_path):
    monitor = GradientFlowMonitor()
    _fit(_Net(), [monitor], tmp_path)
    assert [a for a in monitor.alerts if a.rule == "grad_frozen"] == []


def test_layer_left_out_of_the_optimizer_is_reported_at_the_first_measurement(tmp_path):
    monitor = GradientFlowMonitor()
    _fit(_Net("excluded"), [monitor], tmp_path)
    frozen = [a for a in monitor.alerts if a.rule == "grad_frozen"]
    assert [(a.source, a.global_step) for a in frozen] == [("middle", 1)]  # measured at 1, 3, ... (the user's cadence)
    assert "in no optimizer" in frozen[0].message


def test_layer_outside_the_graph_is_one_info_after_patience(tmp_path):
    monitor = GradientFlowMonitor(rules={"grad": {"patience": 2}})
    _fit(_Net("detach"), [monitor], tmp_path)
    frozen = [a for a in monitor.alerts if a.rule == "grad_frozen"]
    assert [(a.source, a.severity) for a in frozen] == [("unused", "info")]
    assert frozen[0].global_step == 3  # second measurement (log every 2 steps, on the user's cadence: 1, 3)
    assert "`first`" in frozen[0].message and "not in the graph" in frozen[0].message


def test_module_built_but_never_called_is_information_not_a_warning(tmp_path):
    monitor = GradientFlowMonitor(rules={"grad": {"patience": 2}})
    _fit(_Net("unused_head"), [monitor], tmp_path)
    frozen = [a for a in monitor.alerts if a.rule == "grad_frozen"]
    assert [(a.source, a.severity) for a in frozen] == [("unused", "info")]
    assert "`aux_head`" in frozen[0].message and "never ran" in frozen[0].message
    assert [a.format() for a in monitor.alerts if a.severity != "info"] == []


def test_layer_whose_gradient_becomes_exactly_zero_is_a_warning(tmp_path):
    monitor = GradientFlowMonitor(rules={"grad": {"patience": 2}})
    _fit(_Net("zero_later"), [monitor], tmp_path)  # measured at steps 1 (a gradient), 3, 5 (exactly 0)
    frozen = [a for a in monitor.alerts if a.rule == "grad_frozen"]
    assert [(a.source, a.severity) for a in frozen] == [("first", "warning")]
    assert frozen[0].global_step == 5 and "exactly zero" in frozen[0].message


def test_layer_in_the_graph_never_reached_by_the_loss_is_information(tmp_path):
    # exactly zero from the first measurement on: the loss does not depend on `first` (as with a detach)
    monitor = GradientFlowMonitor(rules={"grad": {"patience": 2}})
    _fit(_Net("zero"), [monitor], tmp_path)
    frozen = [a for a in monitor.alerts if a.rule == "grad_frozen"]
    assert [(a.source, a.severity, a.global_step) for a in frozen] == [("unused", "info", 3)]  # measured at 1, 3
    assert "`first`" in frozen[0].message and "exactly zero since the fit began" in frozen[0].message


def test_expect_frozen_silences_a_layer_frozen_on_purpose(tmp_path):
    monitor = GradientFlowMonitor(expect_frozen=["encoder.layers.1.*"])
    result = run_demo("frozen", max_epochs=1, root=str(tmp_path), callbacks=[monitor])
    assert [a for a in result.alerts if a.rule == "grad_frozen"] == []


class _Finetune(BaseFinetuning):
    def freeze_before_training(self, pl_module):
        self.freeze(pl_module.first)

    def finetune_function(self, pl_module, epoch, optimizer):
        pass


def test_base_finetuning_owns_freezing(tmp_path):
    monitor = GradientFlowMonitor()
    _fit(_Net(), [_Finetune(), monitor], tmp_path)
    assert [a for a in monitor.alerts if a.rule == "grad_frozen"] == []


def test_frozen_state_survives_a_checkpoint_roundtrip(tmp_path):
    monitor = GradientFlowMonitor()
    _fit(_Net("excluded"), [monitor], tmp_path)
    fresh = GradientFlowMonitor()
    fresh.load_state_dict(monitor.state_dict())
    assert fresh.frozen_rule.latch.active == {"middle"}


def test_loss_stagnant_uses_the_first_steps_as_the_initial_loss(tmp_path):
    alarm = AnomalyAlarm(rules={"loss_stagnant": {"patience": 2, "baseline_steps": 3}})
    result = run_demo("shuffled_labels", max_epochs=5, root=str(tmp_path), callbacks=[alarm])
    (alert,) = [a for a in alarm.alerts if a.rule == "loss_stagnant"]
    # patience 2, but the trend test needs 5 epoch points (16 steps each) to be able to see a trend
    assert alert.epoch == 4 and alert.global_step == result.global_step
    assert 1.3 < alarm.stagnant_rule.baseline < 1.5  # about ln 4: chance level of 4 balanced classes
    state = alarm.state_dict()
    assert state["stagnant"]["baseline"] == alarm.stagnant_rule.baseline
    restored = AnomalyAlarm()
    restored.load_state_dict(state)
    assert restored.stagnant_rule.latch.active == {"train_loss"}
    del state["stagnant"]
    with pytest.raises(KeyError, match="stagnant"):
        AnomalyAlarm().load_state_dict(state)
