"""Renamed arguments and constants keep their old names for one release, with a ``DeprecationWarning``.

One helper for every callback: :func:`renamed_arguments` decorates a keyword-only ``__init__`` and maps the old
keyword names to the new ones (or to a field of a settings object, ``"rollback.every_n_steps"``), and
:func:`renamed_constants` gives a module a PEP 562 ``__getattr__`` that serves old ``DEFAULT_*`` names. Any other
unknown keyword still raises Python's own ``TypeError``: the wrapper hands it on to the real ``__init__``.
Standard library only.

Example:
    >>> import warnings
    >>> class Monitor:
    ...     @renamed_arguments({"spread_ratio": "layer_spread_threshold"})
    ...     def __init__(self, *, layer_spread_threshold: float = 100.0) -> None:
    ...         self.layer_spread_threshold = layer_spread_threshold
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     Monitor(spread_ratio=50.0).layer_spread_threshold
    50.0
    >>> for part in str(caught[0].message).split("; "):
    ...     print(part)
    `Monitor(spread_ratio=...)` is deprecated and will be removed in the next release
    use `Monitor(layer_spread_threshold=...)`
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import warnings
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

__all__ = ["deprecation_message", "renamed_arguments", "renamed_constants"]

_F = TypeVar("_F", bound=Callable[..., Any])


def deprecation_message(old: str, new: str) -> str:
    """The one wording of every deprecation warning of the library."""
    return f"`{old}` is deprecated and will be removed in the next release; use `{new}`"


def renamed_arguments(renames: Mapping[str, str], *, groups: Mapping[str, type] | None = None) -> Callable[[_F], _F]:
    """Decorate an ``__init__`` so that old keyword names still work, each with a ``DeprecationWarning``.

    Args:
        renames: Old keyword -> new keyword, or ``"<group>.<field>"`` for a field of a settings object.
        groups: ``<group>`` -> its settings class (a dataclass). The old keywords of one group are collected
            into one object: the one passed as ``<group>=`` with those fields replaced, or a new one with the
            class's defaults for the rest. Construction of that object validates the values as usual.

    Raises:
        TypeError: At the call, if an old keyword and its new one are both given.
        ValueError: If ``renames`` names a group ``groups`` lacks (at decoration).
    """
    groups = dict(groups or {})
    missing = {new.split(".")[0] for new in renames.values() if "." in new} - set(groups)
    if missing:
        raise ValueError(f"`renames` names settings groups without a class in `groups`: {sorted(missing)}")

    def decorate(func: _F) -> _F:
        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            old_names = [name for name in kwargs if name in renames]
            if old_names:
                owner = type(args[0]).__name__ if args else func.__qualname__.split(".")[0]
                collected: dict[str, dict[str, Any]] = {}
                for old in old_names:
                    new = renames[old]
                    group, _, field = new.rpartition(".")
                    replacement = f"{group}={groups[group].__name__}({field}=...)" if group else f"{new}=..."
                    warnings.warn(
                        deprecation_message(f"{owner}({old}=...)", f"{owner}({replacement})"),
                        DeprecationWarning,
                        stacklevel=2,
                    )
                    value = kwargs.pop(old)
                    if group:
                        collected.setdefault(group, {})[field] = value
                        continue
                    if new in kwargs:
                        raise TypeError(f"{owner}() got both `{old}` (deprecated) and `{new}`; pass only `{new}`")
                    kwargs[new] = value
                for group, fields in collected.items():
                    given = kwargs.get(group)
                    kwargs[group] = groups[group](**fields) if given is None else dataclasses.replace(given, **fields)
            return func(*args, **kwargs)

        wrapper.__deprecated_arguments__ = dict(renames)  # type: ignore[attr-defined]
        return wrapper  # type: ignore[return-value]

    return decorate


def renamed_constants(module_name: str, renames: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` (PEP 562) serving old constant names, each with a ``DeprecationWarning``.

    Use as ``__getattr__ = renamed_constants(__name__, {"DEFAULT_OLD": "DEFAULT_NEW"})`` at the end of the
    module; ``from module import DEFAULT_OLD`` works too.
    """
    renames = dict(renames)

    def __getattr__(name: str) -> Any:
        new = renames.get(name)
        if new is None:
            raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
        warnings.warn(deprecation_message(f"{module_name}.{name}", new), DeprecationWarning, stacklevel=2)
        return getattr(sys.modules[module_name], new)

    return __getattr__
