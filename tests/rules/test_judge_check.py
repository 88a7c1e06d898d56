"""The judge wrapper's needs check (by field name) decides as :meth:`Measures.missing` does, for every rule."""

import random

import pytest

from lightning_diag.rules.base import Rule, StepContext
from lightning_diag.rules.measures import Measure, Measures, field_names
from tests.rules.test_measures import _rule_classes


def _filled(names: set[str]) -> Measures:
    """Measures holding a placeholder in the fields ``names`` (the check reads only whether a field is ``None``)."""
    return Measures(**dict.fromkeys(names, object()))


def test_field_names_are_the_fields_of_the_measures():
    every = frozenset(Measure)
    assert set(field_names(every)) == set(Measures.__dataclass_fields__)
    assert field_names(frozenset()) == ()
    assert field_names(frozenset({Measure.LOSS, Measure.GRAD_RMS})) == ("grad_rms", "loss")


def test_holds_all_and_holds_any_agree_with_missing_on_random_measures():
    rng = random.Random(0)
    fields = [m.value for m in Measure]
    classes = _rule_classes()
    for _ in range(300):
        m = _filled({f for f in fields if rng.random() < 0.15})
        for cls in classes:
            assert m.holds_all(field_names(cls.needs)) == (not m.missing(cls.needs)), cls
            assert m.holds_any(field_names(cls.optional)) == (len(m.missing(cls.optional)) < len(cls.optional)), cls


@pytest.mark.parametrize("seed", range(3))
def test_the_wrapper_raises_exactly_where_the_measures_lack_what_a_rule_needs(seed):
    """A rule judged on measures lacking what it needs (or, needing none, holding none of what it reads) raises the
    wrapper's ValueError; otherwise the check passes (whatever the rule's own judgment then does with placeholders)."""
    rng = random.Random(seed)
    for cls in _rule_classes():
        rule: Rule = cls()  # type: ignore[call-arg]
        present = {n.value for n in cls.needs | cls.optional if rng.random() < 0.5}
        m = _filled(present)
        refused = bool(m.missing(cls.needs)) or (not cls.needs and len(m.missing(cls.optional)) == len(cls.optional))
        try:
            rule.judge(StepContext(0, 0), m)
        except ValueError as err:
            if f"{cls.__name__}.judge: the measures" in str(err):
                assert refused, (cls, err)
                continue
        except Exception:  # the placeholders reached the rule's own judgment: the check passed
            pass
        assert not refused, cls
