"""The one judgment signature: every rule is ``judge(ctx, m)`` over measurements named from a closed set."""

import dataclasses
import importlib
import inspect
import pkgutil

import pytest

import lightning_diag.rules
from lightning_diag.rules.base import Rule, StepContext
from lightning_diag.rules.data_loader import LoaderRules
from lightning_diag.rules.grad_norm_band import GradBandRule
from lightning_diag.rules.measures import LossWindow, Measure, Measures
from lightning_diag.rules.update_size import UpdateSizeRule


def _rule_classes() -> list[type[Rule]]:
    for info in pkgutil.iter_modules(lightning_diag.rules.__path__):
        importlib.import_module(f"lightning_diag.rules.{info.name}")
    found, todo = [], list(Rule.__subclasses__())
    while todo:
        cls = todo.pop()
        todo += cls.__subclasses__()
        if cls.__module__.startswith("lightning_diag.rules."):
            found.append(cls)
    return sorted(found, key=lambda c: c.__name__)


def test_the_closed_set_names_the_fields_of_measures_one_to_one():
    assert sorted(m.value for m in Measure) == sorted(f.name for f in dataclasses.fields(Measures))
    assert all(f.default is None for f in dataclasses.fields(Measures))  # absent: None


def test_every_rule_has_the_one_judgment_signature_and_names_what_it_reads():
    classes = _rule_classes()
    assert len(classes) >= 30
    for cls in classes:
        params = list(inspect.signature(cls.judge).parameters)
        assert params == ["self", "ctx", "m"], cls
        assert not hasattr(cls, "update"), f"{cls.__name__} keeps a second entry point"
        assert isinstance(cls.needs, frozenset) and isinstance(cls.optional, frozenset)
        assert all(isinstance(n, Measure) for n in cls.needs | cls.optional), cls
        assert not cls.needs & cls.optional, cls
        assert cls.needs or cls.optional, f"{cls.__name__} reads nothing"


def test_a_missing_measurement_is_a_value_error_naming_the_rule_and_the_measure():
    with pytest.raises(ValueError, match=r"UpdateSizeRule\.judge: the measures lack \['update_ratios'\]"):
        UpdateSizeRule().judge(StepContext(0, 0), Measures(loss=0.5))
    with pytest.raises(ValueError, match=r"GradBandRule\.judge: the measures hold none of \[.*'grad_rms'"):
        GradBandRule().judge(StepContext(0, 0), Measures(loss_window=LossWindow(1.0)))
    with pytest.raises(ValueError, match=r"LoaderRules\.judge: the measures hold none of"):
        LoaderRules().judge(StepContext(0, 0), Measures(loss=1.0))


def test_one_measures_object_feeds_every_rule_that_reads_it():
    m = Measures(update_ratios={"fc": 1e-7}, loss=0.69, grad_rms={"fc": 0.1})
    rules = [UpdateSizeRule(patience=1), GradBandRule(warmup_steps=0)]
    assert [r.judge(StepContext(0, 0), m) for r in rules] == [[], []]


def test_a_rule_without_judge_cannot_be_built():
    class Half(Rule):
        rule_id = "half"

    with pytest.raises(TypeError, match="judge"):
        Half()
