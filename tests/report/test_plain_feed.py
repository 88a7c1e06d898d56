"""The plain-run replay is a preset judged through one framework-free dispatch (issue 43)."""

from __future__ import annotations

from lightning_diag.report.plain import PRESET, feed
from lightning_diag.rules.base import StepContext
from lightning_diag.rules.measures import LossWindow, Measures, StepLosses, Validation


def _built() -> list:
    return [rule.from_settings({}) for rule in PRESET]


def test_the_preset_is_the_replayed_loss_rows() -> None:
    assert [rule.rule_id for rule in PRESET] == [
        "val_decline", "val_fluctuation", "loss_swing", "loss_stagnant", "loss_outlier"
    ]


def test_feed_judges_what_each_measurement_feeds_in_preset_order() -> None:
    detectors, ctx = _built(), StepContext(0, 20)
    assert list(feed(detectors, ctx, Measures(loss_window=LossWindow(1.0)))) == ["loss_swing", "loss_stagnant"]
    judged = feed(detectors, ctx, Measures(validation=Validation(0.9, train=1.0)))
    assert list(judged) == ["val_decline", "val_fluctuation", "loss_swing", "loss_stagnant"]
    assert list(feed(detectors, ctx, Measures(step_losses=StepLosses([1.0, 1.1], [19, 20])))) == ["loss_outlier"]
    assert feed(detectors, ctx, Measures(loss=1.0)) == {}  # read alongside others: feeds nobody alone


def test_a_fed_detector_keeps_its_state_between_feeds() -> None:
    detectors = _built()
    for step, value in enumerate([1.0, 1.2, 1.4, 1.6], start=1):
        feed(detectors, StepContext(0, 20 * step), Measures(validation=Validation(value)))
    decline = detectors[0]
    stagnant = detectors[3]
    assert decline.streak == 3 and stagnant.validation_runs() == 4
