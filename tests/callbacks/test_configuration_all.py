"""Every constructor argument of every public callback rejects a bad value at construction (issue 23 §5).

The arguments come from ``inspect.signature`` of each callback, so a renamed or new argument is checked without
editing this file: bad values are derived from the argument's annotation (a string where a number or a flag is
expected, NaN or a huge negative number where a range applies, an unknown choice for a ``Literal``, a bare
string where a list of names is expected, a number where a callable is expected), and every one must raise
``ValueError`` or ``TypeError`` whose message names the argument. ``tests/callbacks/test_configuration.py``
holds the hand-written table with the exact allowed-value messages.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import inspect
import math
import types
import typing
from collections.abc import Sequence
from typing import Any

import pytest
import pytorch_lightning as pl

import lightning_diag

CALLBACKS = sorted(
    (getattr(lightning_diag, name) for name in lightning_diag.__all__),
    key=lambda obj: getattr(obj, "__name__", ""),
)
CALLBACKS = [c for c in CALLBACKS if isinstance(c, type) and issubclass(c, pl.Callback)]
SEVEN = {
    "GradientFlowMonitor", "AnomalyAlarm", "AttentionEntropyMonitor", "DataDiagnostics", "SystemMonitor",
    "SharpnessProbe", "QuantizationProbe",
}  # fmt: skip

# Arguments whose every value of the derived kinds is valid (documented as free-form), or that only a value of a
# kind the derivation cannot build would reject; each with the reason.
FREE_FORM: dict[str, str] = {
    "tokenizer": "any object with a decode method (ErrorAnalysis); an object without one is refused in "
    "tests/callbacks/test_error_analysis.py",
}


def _bad_values(hint: Any) -> list[Any]:
    """Values no argument with this (resolved) type hint may accept."""
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    options = list(typing.get_args(hint)) if union else [hint]
    options = [o for o in options if o is not type(None)]
    origins = {typing.get_origin(o) or o for o in options}
    bad: list[Any] = []
    if typing.Literal in origins:
        bad.append("no-such-choice")
    if origins <= {bool}:
        bad += ["yes", 1]
    elif origins & {int, float} and not origins & {str, typing.Literal}:
        bad += ["12", -(10**12)]
        if float in origins:
            bad.append(math.nan)
    if origins == {str}:
        bad.append(3)
    sequences = [o for o in options if typing.get_origin(o) in (list, tuple, Sequence, collections.abc.Iterable)]
    for seq in sequences[:1]:
        element = (typing.get_args(seq) or (str,))[0]
        bad.append(["x"] if element is int else [1.5])  # an element of the wrong type
    if any(typing.get_origin(o) is collections.abc.Callable for o in options):
        bad.append(42)
    if any(dataclasses.is_dataclass(o) for o in options):  # a settings object
        bad.append(42)
    if any(typing.get_origin(o) is collections.abc.Mapping for o in options):  # `rules=`: not a mapping
        bad.append(3)
    return bad


def _arguments(cls: type) -> list[tuple[str, Any]]:
    hints = typing.get_type_hints(cls.__init__)
    return [
        (name, hints.get(name, Any))
        for name, param in inspect.signature(cls).parameters.items()
        if param.kind not in (param.VAR_KEYWORD, param.VAR_POSITIONAL) and name not in FREE_FORM
    ]


def _cases() -> list[Any]:
    cases = []
    for cls in CALLBACKS:
        for name, hint in _arguments(cls):
            for value in _bad_values(hint):
                cases.append(pytest.param(cls, name, value, id=f"{cls.__name__}-{name}-{value!r}"))
    return cases


def test_the_seven_callbacks_are_public():
    assert {c.__name__ for c in CALLBACKS} >= SEVEN


def test_every_argument_has_a_bad_value():
    covered = {(p.values[0].__name__, p.values[1]) for p in _cases()}
    missing = [(cls.__name__, name, hint) for cls in CALLBACKS for name, hint in _arguments(cls)]
    assert [m for m in missing if m[:2] not in covered] == []


def test_constructors_are_keyword_only():
    for cls in CALLBACKS:
        for name, param in inspect.signature(cls).parameters.items():
            assert param.kind in (param.KEYWORD_ONLY, param.VAR_KEYWORD), (cls.__name__, name)


@pytest.mark.parametrize(("cls", "name", "value"), _cases())
def test_a_bad_value_is_rejected_naming_the_argument(cls, name, value):
    with pytest.raises((ValueError, TypeError)) as info:
        cls(**{name: value})
    assert f"`{name}`" in str(info.value), str(info.value)
