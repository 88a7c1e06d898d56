"""``threshold_lines``: the ``diag/threshold/<rule>`` values of ``thresholds()``, taken once per fit."""

from lightning_diag import GradientFlowMonitor


def test_threshold_lines_are_the_thresholds_and_a_fresh_dict_each_call():
    monitor = GradientFlowMonitor(rules={"grad_vanish": {"threshold": 1e-3}, "grad_explode": False})
    lines = monitor.threshold_lines("grad_vanish", "grad_explode")
    assert lines == {"diag/threshold/grad_vanish": 1e-3}  # a rule switched off has no line
    lines["diag/threshold/grad_vanish"] = 5.0  # the caller's dict: the next call is not changed by it
    assert monitor.threshold_lines("grad_vanish", "grad_explode") == {"diag/threshold/grad_vanish": 1e-3}
    assert monitor.threshold_lines("grad_explode") == {}


def test_a_new_fit_takes_the_thresholds_again(tmp_path):
    import pytorch_lightning as pl

    monitor = GradientFlowMonitor()
    assert monitor.threshold_lines("grad_vanish") == {"diag/threshold/grad_vanish": monitor.thresholds()["grad_vanish"]}
    monitor.thresholds = lambda: {"grad_vanish": 0.5}  # type: ignore[method-assign]  # this test's own instance
    assert monitor.threshold_lines("grad_vanish")["diag/threshold/grad_vanish"] != 0.5  # kept within one fit
    trainer = pl.Trainer(default_root_dir=tmp_path, logger=False, enable_checkpointing=False)
    monitor.setup(trainer, pl.LightningModule(), "fit")
    try:
        assert monitor.threshold_lines("grad_vanish") == {"diag/threshold/grad_vanish": 0.5}
    finally:
        monitor.teardown(trainer, pl.LightningModule(), "fit")
