import json
import re
import subprocess
import sys

import pytest
from torch.utils.tensorboard import SummaryWriter

from lightning_diag.core import tags
from lightning_diag.output.dashboard import dashboard_layout
from lightning_diag.report import build_report, load_run


def test_builders_and_parsers_round_trip():
    assert tags.grad_layer(tags.grad_norm_tag("encoder.layers.0")) == "encoder.layers.0"
    for i in (0, 1, 7):
        name = tags.grad_total_tag(i)
        assert tags.grad_total_optimizer(name) == i
        assert tags.grad_layer(name) is None
    assert tags.attn_head(tags.attn_entropy_tag("m.attn", 11)) == ("m.attn", 11)
    assert tags.attn_mean(tags.attn_entropy_tag("m.attn", "mean")) == "m.attn"
    assert tags.attn_head(tags.attn_uniform_tag("m.attn")) is None
    assert tags.threshold_rule(tags.threshold_tag("grad_vanish")) == "grad_vanish"
    assert tags.tag("attn_sink", "m.attn") == "diag/attn_sink/m.attn"
    assert tags.loss_tag("val") == "diag/loss/val" and tags.lr_tag("opt_0", "group_1") == "diag/lr/opt_0/group_1"
    assert tags.overhead_tag("GradientFlowMonitor") == "diag/overhead/GradientFlowMonitor"
    assert tags.family_tag("quant", "int8", "error") == "diag/quant/int8/error"
    with pytest.raises(ValueError, match="`family` can be"):
        tags.family_tag("weights", "x")


def test_tags_module_imports_neither_torch_nor_lightning():
    code = (
        "import json, sys, lightning_diag.core.tags; "
        "print(json.dumps(sorted(m for m in ('torch', 'pytorch_lightning', 'lightning') if m in sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []


# The documented `diag/grad_norm/total/optimizer_<i>` is a global norm, never a layer.
_TWO_OPTIMIZERS = {
    "diag/grad_norm/total": [1.0, 1.0],
    "diag/grad_norm/total/optimizer_1": [1e4, 1e4],  # a GAN's second optimizer, far above every layer
    "diag/grad_norm/gen.0": [0.5, 0.5],
    "diag/grad_norm/gen.1": [0.2, 0.2],
}


def _write(path, scalars):
    writer = SummaryWriter(str(path))
    for name, values in scalars.items():
        for i, v in enumerate(values):
            writer.add_scalar(name, v, global_step=i)
    writer.close()
    (path / "diag").mkdir(exist_ok=True)
    thresholds = {"GradientFlowMonitor": {"grad_vanish": 1e-3, "grad_explode": 10.0, "grad_layer_spread": 100.0}}
    (path / "diag" / "thresholds.json").write_text(json.dumps({"callbacks": thresholds}))
    return path


def test_optimizer_totals_are_not_layers_in_the_report(tmp_path):
    (report,) = build_report(_write(tmp_path / "run", _TWO_OPTIMIZERS))
    checks = {c.id: c for c in report.checks}
    band = checks["grad_norm_band"]
    assert "over 2 layers" in (band.measured or "")
    assert band.measured_value == {"min": pytest.approx(0.2), "max": pytest.approx(0.5)}
    assert checks["grad_spread"].measured_value == {"max": pytest.approx(2.5)}


def test_optimizer_totals_are_not_layers_in_the_dashboard():
    (pattern,) = dashboard_layout(["grad_vanish"])["Gradients"][
        "gradient L2 norm per layer"
    ][1]
    assert [t for t in _TWO_OPTIMIZERS if re.match(pattern, t)] == ["diag/grad_norm/gen.0", "diag/grad_norm/gen.1"]
    (totals,) = dashboard_layout(["grad_vanish"])["Gradients"]["global gradient norm per optimizer"][1]
    assert [t for t in _TWO_OPTIMIZERS if re.match(totals, t)] == list(_TWO_OPTIMIZERS)[:2]


def test_optimizer_totals_are_not_layers_in_the_plots(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from lightning_diag.report import plots

    labels: list[str] = []
    original = plots.plt.Axes.plot

    def spy(self, *args, **kwargs):
        labels.append(kwargs.get("label"))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(plots.plt.Axes, "plot", spy)
    plots.draw_run(load_run(_write(tmp_path / "run", _TWO_OPTIMIZERS)), tmp_path / "plots")
    assert labels == ["gen.0", "gen.1", "total"]
