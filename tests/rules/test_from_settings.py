"""The generated ``from_settings`` (issue 43): every rule class builds from the thresholds in effect, with its
declared defaults where a key is missing, and reads every key that sets one of its parameters."""

import importlib
import inspect
import math
from pathlib import Path

import pytest

import lightning_diag
import lightning_diag.rules.catalog  # the complete registry
from lightning_diag.core.registry import RULES, SETTINGS, Limit, RuleSpec, default_thresholds
from lightning_diag.rules.activations import DEAD_UNITS, ActivationRule
from lightning_diag.rules.base import FromSettings, Latch
from lightning_diag.rules.errors import ErrorClusterRule
from lightning_diag.rules.grad_frozen import GRAD_PATIENCE_SETTING
from lightning_diag.rules.nonfinite import NONFINITE_GRAD_SPEC, NONFINITE_LOSS_SPEC, NonFinitePolicy
from lightning_diag.rules.sharp_minimum import SHARP_MINIMUM_SPEC, SharpMinimumRule
from lightning_diag.rules.updates_applied import UPDATE_NONE_SPEC, UPDATE_STALE, UPDATE_STALE_SPEC, UpdateRule

_RULES_DIR = Path(lightning_diag.__file__).parent / "rules"


def _classes() -> list[type]:
    """Every class of ``rules/`` that declares rule ids (``specs``): the rules and the non-finite policy."""
    found = []
    for path in sorted(_RULES_DIR.glob("*.py")):
        module = importlib.import_module(f"lightning_diag.rules.{path.stem}")
        for _name, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ == module.__name__ and getattr(cls, "specs", ()):
                found.append(cls)
    return found


CLASSES = _classes()


def _settings(obj: object) -> dict[str, tuple[str, object]]:
    """The attributes a rule keeps from its settings (numbers, strings, the latch's patience), with their types:
    an int setting must stay an int."""
    kept: dict[str, tuple[str, object]] = {}
    for name, value in vars(obj).items():
        if isinstance(value, (bool, int, float, str, tuple, type(None))):
            kept[name] = (type(value).__name__, value)
        elif isinstance(value, Latch):
            kept[name] = ("Latch", (value.clear_after, value.worsen_factor))
    return kept


def _limit(key: str) -> Limit:
    if key in SETTINGS:
        return SETTINGS[key].limit
    rule_id, _, name = key.partition(".")
    return RULES[rule_id].limit(name or "threshold")


def _changed(key: str, value: float) -> float:
    """Another allowed value of ``key``: one more for an int, else a smaller or larger number within its limit."""
    limit = _limit(key)
    if limit.integer:
        return value + 1
    smaller = value * 0.5
    if smaller > (limit.low if limit.low is not None else -math.inf) and value > 0:
        return smaller
    return value * 1.5 + 0.01


def test_every_rule_class_is_covered():
    assert len(CLASSES) >= 35
    assert {s.rule_id for cls in CLASSES for s in cls.specs} == set(RULES)
    assert all(issubclass(cls, FromSettings) for cls in CLASSES)


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_from_settings_with_the_defaults_equals_the_class_built_with_no_arguments(cls):
    assert _settings(cls.from_settings({})) == _settings(cls())
    assert _settings(cls.from_settings(default_thresholds())) == _settings(cls())


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_from_settings_reads_every_key_that_sets_a_parameter(cls):
    """Changing one ``thresholds()`` key at a time: the keys that change the rule are the keys of its parameters
    (a hand-written ``from_settings`` may read more: settings it sets after construction), each reaching its
    parameter with the parameter's type; every declared threshold of its rules is read."""
    base = _settings(cls.from_settings({}))
    mapped = cls.settings_map()
    reads = set()
    for key, value in default_thresholds().items():
        new = _changed(key, value)
        built = _settings(cls.from_settings({key: new}))
        if built != base:
            reads.add(key)
        for name in (n for n, k in mapped.items() if k == key):
            param = inspect.signature(cls).parameters[name]
            assert built == _settings(cls(**{name: int(new) if isinstance(param.default, int) else new}))
    assert set(mapped.values()) <= reads
    if "from_settings" not in cls.__dict__:
        assert reads == set(mapped.values())
    assert {s.rule_id for s in cls.specs if s.threshold is not None} <= reads


def test_no_rule_writes_its_own_from_settings():
    """Issue 43: every rule class is built by the generated one (its declarations and ``setting_keys``)."""
    assert [cls.__name__ for cls in CLASSES if "from_settings" in cls.__dict__] == []


def test_the_named_keys_and_the_convention_reach_the_right_parameters():
    rule = ActivationRule.from_settings({DEAD_UNITS: 0.4, GRAD_PATIENCE_SETTING.key: 5})
    assert (rule.dead_threshold, rule.patience, type(rule.patience)) == (0.4, 5, int)
    # UpdateRule: `patience` is a setting of update_none (the first spec declaring it), `certain` of update_stale
    updates = UpdateRule.from_settings({UPDATE_NONE_SPEC.key("patience"): 7.0, UPDATE_STALE_SPEC.key("certain"): 0.9,
                                        UPDATE_STALE: 0.3})
    assert (updates.patience, type(updates.patience), updates.certain, updates.stale_fraction) == (7, int, 0.9, 0.3)
    sharp = SharpMinimumRule.from_settings({SHARP_MINIMUM_SPEC.key("patience"): None})  # None: the default
    assert sharp.patience == int(SHARP_MINIMUM_SPEC.settings["patience"])
    policy = NonFinitePolicy.from_settings({NONFINITE_LOSS_SPEC.key("max_skips"): 4,
                                            NONFINITE_GRAD_SPEC.key("max_scaler_overflows"): 6}, action="warn")
    assert (policy.action, policy.max_skips, policy.max_scaler_overflows) == ("warn", 4, 6)


def test_other_parameters_come_from_keywords_and_unknown_ones_raise():
    assert ErrorClusterRule.from_settings({}, alpha=0.01).alpha == 0.01
    assert ErrorClusterRule.from_settings({}).alpha == ErrorClusterRule().alpha
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'alpah'; it takes \['alpha'\]"):
        ErrorClusterRule.from_settings({}, alpah=0.01)
    with pytest.raises(TypeError, match="'ratio'; it is set by 'error_cluster'"):
        ErrorClusterRule.from_settings({}, ratio=2.0)
    with pytest.raises(TypeError, match="keyword arguments only"):
        ErrorClusterRule.from_settings({}, 0.01)
    with pytest.raises(ValueError, match="action"):  # the constructor's own check still runs
        NonFinitePolicy.from_settings({}, action="explode")


_FIRST = RuleSpec("toy_first", "Toy", "warning", 1.0, "first", settings={"patience": 2})
_SECOND = RuleSpec("toy_second", "Toy", "warning", 5.0, "second", settings={"patience": 9, "window": 4})


class _Toy(FromSettings):
    specs = (_FIRST, _SECOND)

    def __init__(self, threshold: float = 1.0, patience: int = 2, window: int = 4, unit: str = "epoch") -> None:
        self.threshold, self.patience, self.window, self.unit = threshold, patience, window, unit


def test_threshold_is_the_first_specs_and_a_setting_the_first_declaring_spec_s():
    assert _Toy.settings_map() == {"threshold": "toy_first", "patience": "toy_first.patience",
                                   "window": "toy_second.window"}
    toy = _Toy.from_settings({"toy_first": 3.0, "toy_second": 7.0, "toy_second.patience": 8, "toy_second.window": 6.0},
                             unit="step")
    assert (toy.threshold, toy.patience, toy.window, type(toy.window), toy.unit) == (3.0, 2, 6, int, "step")


class _Required(FromSettings):
    specs = (_FIRST,)

    def __init__(self, threshold: float, scale: float) -> None:
        self.threshold, self.scale = threshold, scale


class _Undeclared(FromSettings):
    specs = (_FIRST,)
    setting_keys = {"factor": "no_such_rule.factor"}  # noqa: RUF012

    def __init__(self, factor: float = 1.0) -> None:
        self.factor = factor


def test_a_parameter_without_default_or_an_undeclared_key_raises():
    assert _Required.from_settings({}, scale=2.0).threshold == 1.0
    with pytest.raises(TypeError, match=r"needs the keyword arguments \['scale'\]"):
        _Required.from_settings({})
    with pytest.raises(KeyError, match=r"no_such_rule\.factor"):
        _Undeclared.from_settings({})
