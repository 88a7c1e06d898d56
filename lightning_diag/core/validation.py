"""Constructor argument checks with one message shape: the argument's name and what is allowed."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, TypeVar

__all__ = ["check_bool", "check_callable", "check_choice", "check_int", "check_names", "check_number"]

T = TypeVar("T")


def check_number(
    name: str,
    value: Any,
    *,
    low: float | None = None,
    high: float | None = None,
    low_inclusive: bool = False,
    high_inclusive: bool = True,
) -> float:
    """Check that ``value`` is a finite real number in the given range and return it as ``float``.

    Raises:
        TypeError: If ``value`` is not a real number (bools are rejected).
        ValueError: If it is non-finite or out of range.
    """
    allowed = _range_text(low, high, low_inclusive, high_inclusive)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"Expected argument `{name}` to be a number {allowed}, but got {value!r}")
    v = float(value)
    ok = math.isfinite(v)
    if ok and low is not None:
        ok = v >= low if low_inclusive else v > low
    if ok and high is not None:
        ok = v <= high if high_inclusive else v < high
    if not ok:
        raise ValueError(f"Expected argument `{name}` to be a number {allowed}, but got {value!r}")
    return v


def check_int(name: str, value: Any, *, low: int = 1, high: int | None = None) -> int:
    """Check that ``value`` is an int in ``[low, high]`` and return it.

    Raises:
        TypeError: If ``value`` is not an int (bools are rejected).
        ValueError: If it is out of range.
    """
    allowed = f">= {low}" + (f" and <= {high}" if high is not None else "")
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"Expected argument `{name}` to be an int {allowed}, but got {value!r}")
    if value < low or (high is not None and value > high):
        raise ValueError(f"Expected argument `{name}` to be an int {allowed}, but got {value!r}")
    return value


def check_choice(name: str, value: Any, choices: Iterable[str]) -> str:
    """Check that ``value`` is one of ``choices`` and return it.

    Raises:
        TypeError: If ``value`` is not a string.
        ValueError: If it is not one of ``choices``.
    """
    options = tuple(choices)
    text = ", ".join(repr(c) for c in options)
    if not isinstance(value, str):
        raise TypeError(f"Expected argument `{name}` to be one of {text}, but got {value!r}")
    if value not in options:
        raise ValueError(f"Expected argument `{name}` to be one of {text}, but got {value!r}")
    return value


def check_bool(name: str, value: Any) -> bool:
    """Check that ``value`` is ``True`` or ``False`` and return it.

    Raises:
        TypeError: If it is not a bool.
    """
    if not isinstance(value, bool):
        raise TypeError(f"Expected argument `{name}` to be a bool (True or False), but got {value!r}")
    return value


def check_callable(name: str, value: T, what: str = "a callable") -> T:
    """Check that ``value`` is ``None`` or callable (``what`` says how it is called) and return it.

    Raises:
        TypeError: If it is neither.
    """
    if value is not None and not callable(value):
        raise TypeError(f"Expected argument `{name}` to be {what} or None, but got {value!r}")
    return value


def check_names(name: str, value: Any, what: str) -> tuple[str, ...]:
    """Check that ``value`` is a sequence of strings (not one string; ``what`` names them) and return it as a tuple.

    Raises:
        TypeError: If it is not.
    """
    if isinstance(value, str) or not all(isinstance(p, str) for p in value):
        raise TypeError(f"Expected argument `{name}` to be a list of {what}, but got {value!r}")
    return tuple(value)


def _range_text(low: float | None, high: float | None, low_inclusive: bool, high_inclusive: bool) -> str:
    parts = []
    if low is not None:
        parts.append(f"{'>=' if low_inclusive else '>'} {low:g}")
    if high is not None:
        parts.append(f"{'<=' if high_inclusive else '<'} {high:g}")
    return " and ".join(parts) if parts else "(finite)"
