"""SharpnessProbe and QuantizationProbe through real ``Trainer.fit`` runs."""

from __future__ import annotations

import importlib.util
import json
import os
import random

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lightning_diag import QuantizationProbe, SharpnessProbe
from lightning_diag.callbacks.probes.quantization import torchao_available
from tests.callbacks.probe_models import FAST, ReluNet, pretrained, reparametrise, with_outlier


def fit(model, tmp_path, callbacks, max_epochs=3, ckpt_path=None, **kwargs):
    trainer = pl.Trainer(max_epochs=max_epochs, callbacks=callbacks, default_root_dir=str(tmp_path),
                         **{**FAST, **kwargs})
    trainer.fit(model, ckpt_path=ckpt_path)
    return trainer


def require_torchao() -> None:
    """Skip without torchao; when it is installed but does not import, fail under ``CI=true`` (CI must not
    silently lose the torchao path to a broken install), skip with the error elsewhere."""
    if torchao_available():
        return
    if importlib.util.find_spec("torchao") is None:
        pytest.skip("torchao (the `quant` extra) is not installed")
    try:
        import torchao.quantization  # noqa: F401
    except Exception as err:
        reason = f"torchao is installed but does not import: {err!r}"
    else:
        reason = "torchao is installed but torchao_available() is False"
    if os.environ.get("CI") == "true":
        pytest.fail(reason)
    pytest.skip(reason)


def test_a_broken_torchao_fails_in_ci_and_skips_elsewhere(monkeypatch):
    import lightning_diag.callbacks.probes.quantization as qp
    import lightning_diag.instrument.int8_layers as engines

    monkeypatch.setattr(engines, "_TORCHAO", False)  # as after a failed import
    monkeypatch.setattr("tests.callbacks.test_probes.torchao_available", qp.torchao_available)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())  # "installed"
    monkeypatch.setitem(__import__("sys").modules, "torchao.quantization", None)  # its import raises
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="installed but does not import"):
        require_torchao()
    monkeypatch.setenv("CI", "false")
    with pytest.raises(pytest.skip.Exception, match="installed but does not import"):
        require_torchao()


def slow(model: ReluNet) -> ReluNet:
    model.lr = 1e-6  # stay at the pretrained minimum (Adam moves every weight by ~lr a step, whatever its scale)
    return model


def test_sharpness_sees_the_reparametrised_minimum_and_not_the_original(tmp_path):
    quiet, sharp = SharpnessProbe(), SharpnessProbe(per_layer=True)
    fit(slow(pretrained()), tmp_path / "a", [quiet, QuantizationProbe(backend="fake")])
    fit(slow(reparametrise(pretrained())), tmp_path / "b", [sharp])
    assert quiet.alerts == [] and quiet.last_result is not None and quiet.last_result.gap < 0.3
    (alert,) = sharp.alerts
    assert (alert.rule, alert.severity, alert.epoch, alert.threshold) == ("sharp_minimum", "warning", 2, 0.3)
    # the same function (Dinh et al. 2017): the same loss, a far larger gap; layer net.3 (÷100) is the sensitive one
    assert sharp.last_result.loss == pytest.approx(quiet.last_result.loss, rel=0.02)
    assert sharp.last_result.gap > 10 * quiet.last_result.gap
    assert max(sharp.last_result.layers, key=sharp.last_result.layers.get) == "net.3" and "net.3" in alert.message
    acc = EventAccumulator(str(tmp_path / "b" / "diag"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"diag/sharpness/gap", "diag/sharpness/relative_gap", "diag/sharpness/layer/net.3",
            "diag/threshold/sharp_minimum"} <= tags
    # one probe per epoch, on the user's step axis (Lightning's batches that stepped: 3 at the end of epoch 0)
    assert [e.step for e in acc.Scalars("diag/sharpness/gap")] == [3, 7, 11]
    records = [json.loads(x) for x in (tmp_path / "b" / "diag" / "alerts.jsonl").read_text().splitlines()]
    assert [r["rule"] for r in records] == ["sharp_minimum"]
    # the report's rows: measured from the logged series, and the rule replayed over them agrees
    healthy, sharp_run = (checks(tmp_path / run) for run in ("a", "b"))
    assert healthy["loss_surface"].status == "pass" and healthy["deploy_quantization_error"].status == "pass"
    assert healthy["loss_surface"].measured_value["max"] < 0.3 and "over 3 probes" in healthy["loss_surface"].measured
    assert sharp_run["loss_surface"].status == "fail" and sharp_run["loss_surface"].first_alert_step == 12
    assert sharp_run["loss_surface"].replayed == 1
    assert sharp_run["deploy_quantization_error"].status == "not measured"  # no QuantizationProbe on that run


def checks(run_dir):
    from lightning_diag.report import diagnose, load_run

    return {c.id: c for c in diagnose(load_run(run_dir)).checks}


def test_quantization_names_the_layer_with_an_outlier_weight_and_a_trained_model_stays_quiet(tmp_path):
    healthy, broken = QuantizationProbe(backend="fake"), QuantizationProbe(backend="fake")
    fit(slow(pretrained()), tmp_path / "a", [healthy], max_epochs=1)
    fit(slow(with_outlier(pretrained())), tmp_path / "b", [broken], max_epochs=1)
    assert healthy.alerts == []
    assert healthy.last_result.end_to_end < 0.05 and max(healthy.last_result.relative_mse.values()) < 1e-3
    layer_alert = next(a for a in broken.alerts if a.source != "end_to_end")
    assert layer_alert.rule == "quantization_error" and layer_alert.source == "net.5"  # the third Linear
    assert "net.5" in layer_alert.message and "per-channel" in layer_alert.message
    assert "weights max/p99 2" in layer_alert.message  # the 200x weight, quoted
    result = broken.last_result
    assert result.outliers["net.5"] > 100 and result.relative_mse_per_channel["net.5"] < 1e-3
    # the outlier weight makes one hidden unit huge: the next layer's input carries the outlier
    assert result.input_outliers["net.7"] > 10 * healthy.last_result.input_outliers["net.7"]
    acc = EventAccumulator(str(tmp_path / "b" / "diag"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"diag/quant/end_to_end", "diag/quant/layer/net.5/relative_mse", "diag/quant/layer/net.5/outlier_ratio",
            "diag/quant/layer/net.5/max_error_pct", "diag/quant/worst_layer_ratio",
            "diag/quant/layer/net.7/input_outlier_ratio"} <= tags
    row = checks(tmp_path / "b")["deploy_quantization_error"]
    assert row.status == "fail" and row.replayed == len(broken.alerts) and row.measured_value["worst_layer_ratio"] > 10
    assert checks(tmp_path / "a")["deploy_quantization_error"].status == "pass"


def test_quantization_with_torchao_agrees_with_the_fake_path(tmp_path):
    require_torchao()
    import torch._inductor.config as inductor

    before = {k: getattr(inductor, k) for k in ("coordinate_descent_tuning", "force_fuse_int_mm_with_mul")}
    fake = QuantizationProbe(backend="fake", activations=False)
    tao = QuantizationProbe(backend="torchao", activations=False)
    fit(slow(with_outlier(pretrained())), tmp_path, [fake, tao], max_epochs=1)
    assert {k: getattr(inductor, k) for k in before} == before  # torchao left the process's config alone
    assert tao.engine == "torchao"
    assert [a.source for a in tao.alerts if a.source != "end_to_end"] == ["net.5"]
    assert [a.source for a in fake.alerts if a.source != "end_to_end"] == ["net.5"]
    # the same symmetric per-tensor INT8 weights: the layers' output errors agree (rounding ties aside)
    for name, err in fake.last_result.output_mse.items():
        assert tao.last_result.output_mse[name] == pytest.approx(err, rel=0.3), name


def _training_state(trainer, model):
    opt = trainer.optimizers[0].state_dict()
    return (
        {k: v.clone() for k, v in model.state_dict().items()},
        {k: v.clone() if isinstance(v, torch.Tensor) else v for s in opt["state"].values() for k, v in s.items()},
        [None if p.grad is None else p.grad.clone() for p in model.parameters()],
        torch.get_rng_state(),
        random.random(),
        float(np.random.rand()),
    )


def test_training_state_is_bit_identical_with_and_without_the_probes(tmp_path):
    states = []
    for probes in ([], [SharpnessProbe(per_layer=True), QuantizationProbe(backend="fake")]):
        pl.seed_everything(0)
        model = ReluNet(batchnorm=True, dropout=0.2)
        trainer = fit(model, tmp_path / str(len(probes)), probes, max_epochs=2)
        states.append(_training_state(trainer, model))
        assert all(p.last_result is not None for p in probes)
    (params0, opt0, grads0, rng0, py0, np0), (params1, opt1, grads1, rng1, py1, np1) = states
    assert params0.keys() == params1.keys() and "net.1.running_mean" in params0
    assert all(torch.equal(params0[k], params1[k]) for k in params0)
    assert opt0.keys() == opt1.keys() and all(torch.equal(opt0[k], opt1[k]) for k in opt0)
    assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(grads0, grads1, strict=True))
    assert torch.equal(rng0, rng1) and py0 == py1 and np0 == np1


def test_resume_keeps_the_patience_streak(tmp_path):
    first = SharpnessProbe()
    trainer = fit(slow(reparametrise(pretrained())), tmp_path, [first], max_epochs=2)
    assert first.alerts == [] and first.rule.streak == 2
    ckpt = tmp_path / "two.ckpt"
    trainer.save_checkpoint(ckpt)
    resumed = SharpnessProbe()
    fit(slow(reparametrise(pretrained())), tmp_path, [resumed], max_epochs=3, ckpt_path=str(ckpt))
    assert [(a.rule, a.epoch) for a in resumed.alerts] == [("sharp_minimum", 2)]
    fresh = SharpnessProbe()
    fit(slow(reparametrise(pretrained())), tmp_path, [fresh], max_epochs=1)
    assert fresh.alerts == [] and fresh.rule.streak == 1
    with pytest.raises(KeyError, match="last_probed_epoch"):
        SharpnessProbe().load_state_dict({"rules": resumed.rule.state_dict()})


class ManualNet(ReluNet):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        loss = super().training_step(batch, batch_idx)
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()


def test_manual_optimization_needs_loss_fn_and_every_n_epochs(tmp_path, caplog):
    skipped, probe = SharpnessProbe(), SharpnessProbe(every_n_epochs=2, loss_fn=lambda m, b: {"loss": m(b[0]).var()})
    with caplog.at_level("INFO", logger="lightning_diag"):
        fit(ManualNet(), tmp_path, [skipped, probe], max_epochs=3)
    assert skipped.last_result is None and "pass loss_fn" in caplog.text
    assert probe.last_result is not None and probe.rule.streak in (0, 1) and probe._last_probed_epoch == 1


@pytest.mark.parametrize(
    ("kind", "kwargs", "error", "match"),
    [
        (SharpnessProbe, {"rules": {"sharp_minimum": {"rho": 0.0}}}, ValueError, "rho"),
        (SharpnessProbe, {"rules": {"sharp_minimum": {"patience": 0}}}, ValueError, "patience"),
        (SharpnessProbe, {"every_n_epochs": 1.5}, TypeError, "every_n_epochs"),
        (SharpnessProbe, {"per_layer": "yes"}, TypeError, "per_layer"),
        (SharpnessProbe, {"loss_fn": 3}, TypeError, "loss_fn"),
        (QuantizationProbe, {"granularity": "per_group"}, ValueError, "per_tensor"),
        (QuantizationProbe, {"backend": "onnx"}, ValueError, "backend"),
        (QuantizationProbe, {"rules": {"quantization_error": {"layer_ratio": 0.5}}}, ValueError, "layer_ratio"),
        (QuantizationProbe, {"rules": {"quantization_error": {"threshold": -1}}}, ValueError, "threshold"),
        (QuantizationProbe, {"num_batches": 0}, ValueError, "num_batches"),
        (QuantizationProbe, {"activations": 1}, TypeError, "activations"),
    ],
)
def test_invalid_arguments_raise_at_construction(kind, kwargs, error, match):
    with pytest.raises(error, match=match):
        kind(**kwargs)


def test_thresholds_come_from_the_registry():
    from lightning_diag.core.registry import default_thresholds

    assert SharpnessProbe().thresholds() == default_thresholds("SharpnessProbe")
    assert QuantizationProbe(backend="fake").thresholds() == default_thresholds("QuantizationProbe")
    custom = SharpnessProbe(rules={"sharp_minimum": {"threshold": 0.5, "patience": 2, "rho": 0.1}}).thresholds()
    assert custom == {"sharp_minimum": 0.5, "sharp_minimum.patience": 2.0, "sharp_minimum.rho": 0.1}
    quant = QuantizationProbe(backend="fake", rules={"quantization_error": {"layer_ratio": 20}})
    assert quant.thresholds()["quantization_error.layer_ratio"] == 20.0


def test_dashboard_probes_section_follows_the_rules_in_effect():
    import re

    from lightning_diag.output.dashboard import dashboard_layout

    assert "Probes" not in dashboard_layout(["grad_explode"])
    sharp = dashboard_layout(["sharp_minimum"])["Probes"]
    assert all("INT8" not in title for title in sharp)
    gap_regex, line_regex = sharp["SAM gap L(w+eps) - L(w) (line: sharp_minimum)"][1]
    assert re.match(gap_regex, "diag/sharpness/gap") and not re.match(gap_regex, "diag/sharpness/gap_x")
    assert re.match(line_regex, "diag/threshold/sharp_minimum")
    quant = dashboard_layout(["quantization_error", "sharp_minimum"])["Probes"]
    per_layer = quant["INT8: relative output MSE per layer"][1][0]
    assert re.match(per_layer, "diag/quant/layer/encoder.0/relative_mse")
    assert not re.match(per_layer, "diag/quant/layer/encoder.0/relative_mse_per_channel")


def test_probe_tags_round_trip():
    from lightning_diag.core.tags import quant_layer, quant_layer_tag, quant_tag, sharpness_layer_tag

    assert quant_tag("end_to_end") == "diag/quant/end_to_end"
    assert quant_layer(quant_layer_tag("blocks.0.mlp.fc", "outlier_ratio")) == ("blocks.0.mlp.fc", "outlier_ratio")
    assert quant_layer("diag/quant/end_to_end") is None
    assert sharpness_layer_tag("net.3") == "diag/sharpness/layer/net.3"


def test_a_failing_or_unusable_loss_is_one_clear_message_and_training_goes_on(tmp_path, caplog):
    def broken(module, batch):
        raise RuntimeError("shape mismatch in user code")

    probes = [SharpnessProbe(loss_fn=broken), QuantizationProbe(backend="fake", loss_fn=lambda m, b: None)]
    with caplog.at_level("INFO", logger="lightning_diag"):
        trainer = fit(ReluNet(), tmp_path, probes, max_epochs=2)
    assert trainer.current_epoch == 2 and all(p.last_result is None and p.alerts == [] for p in probes)
    assert caplog.text.count("RuntimeError: shape mismatch in user code") == 1  # once per fit, not per probe
    assert "`loss_fn` returned NoneType" in caplog.text


class SmallCNN(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        nn = torch.nn
        self.net = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
            nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 4),
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        return None

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def test_a_healthy_cnn_with_batchnorm_stays_quiet_and_its_convolutions_are_measured(tmp_path):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(128, 3, 8, 8, generator=g)
    y = (x[:, 0].mean((1, 2)) > 0).long() + 2 * (x[:, 1].mean((1, 2)) > 0).long()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32)
    probes = [SharpnessProbe(), QuantizationProbe()]  # backend "auto": torchao for the Linear when installed
    pl.Trainer(max_epochs=3, callbacks=probes, default_root_dir=str(tmp_path), **FAST).fit(
        SmallCNN(), loader, loader
    )
    assert [a.format() for p in probes for a in p.alerts] == []
    assert set(probes[1].last_result.relative_mse) == {"net.0", "net.3", "net.8"}


def test_bf16_mixed_and_validate_outside_fit(tmp_path):
    probes = [SharpnessProbe(), QuantizationProbe(backend="fake")]
    trainer = fit(slow(pretrained()), tmp_path, probes, max_epochs=1, precision="bf16-mixed")
    assert all(p.last_result is not None and p.alerts == [] for p in probes)
    assert probes[0].last_result.gap < 0.3 and probes[1].last_result.end_to_end < 0.05
    before = [p.last_result for p in probes]
    trainer.validate(trainer.lightning_module, verbose=False)  # probes run during fit only
    assert [p.last_result for p in probes] == before


@pytest.mark.slow
def test_quantization_of_a_small_loss_mid_training_is_quiet_and_the_margin_is_the_deciding_statistic(tmp_path):
    """The calibration run ``baseline:healthy_denoiser:L16:s0``: at step 48 INT8 raised the loss from 0.022 to 0.023
    (5.4% of a loss under 0.05, the false alarm of issue 44's first run); its one sharp SAM probe (0.67 at step 16)
    is not persistent."""
    from lightning_diag.demo import build_fault

    model, data, _ = build_fault("healthy_denoiser")
    data.n_train = max(data.n_train, 16 * data.batch_size)
    quant, sharp = QuantizationProbe(), SharpnessProbe()
    losses = []
    original = quant.decide

    def spy(trainer, result):
        losses.append(result.loss)
        return original(trainer, result)

    quant.decide = spy  # type: ignore[method-assign]
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(max_epochs=8, limit_train_batches=16, deterministic=True, callbacks=[quant, sharp],
                         default_root_dir=str(tmp_path), **FAST)
    trainer.fit(model, datamodule=data)
    assert quant.alerts == [] and sharp.alerts == []
    assert len(losses) == 8 and min(losses) < 0.05  # the floor was in play
    assert 0 < quant.rule.peaks["quantization_error"] < 1.0 and 0 < sharp.rule.peaks["sharp_minimum"] < 1.0
