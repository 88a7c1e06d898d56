"""Presets: a callback is a named list of detectors (issue 43).

Each public callback declares, in its main module, one :class:`Preset`: the detector classes it runs (each a
:class:`~lightning_diag.rules.base.FromSettings` whose ``specs`` declare its rule ids), the attribute that keeps
each one on the callback and the checkpoint key of its state. :meth:`DiagCallback.add_preset
<lightning_diag.callbacks.common.base.DiagCallback.add_preset>` builds them from the thresholds in effect (and
again at every fit); :meth:`DiagCallback.detector <lightning_diag.callbacks.common.base.DiagCallback.detector>`
hands the one of a class to the parts of the callback that feed it. The rule ids a callback owns are those of its
preset's detectors (``tests/callbacks/test_presets.py`` checks them against the registry and the docs).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from lightning_diag.rules.base import FromSettings

__all__ = ["Detector", "Preset"]


@dataclass(frozen=True)
class Detector:
    """One entry of a preset.

    Args:
        rule: The detector's class: its ``specs`` name the rule ids it raises, its ``from_settings`` builds it.
        attribute: The callback's attribute that keeps the detector.
        state_key: The checkpoint key of its state (default: ``attribute``).
        context: ``(keyword, attribute)`` pairs: ``from_settings`` gets the callback's ``attribute`` (read when
            the preset is added) as ``keyword``: what the detector needs besides its thresholds (the unit of its
            messages, the monitored metric, the non-finite action).
        build: The name of a callback method building the detector, with the thresholds, where
            ``from_settings`` cannot (a detector held by a part of the callback that carries more state than its
            rule's, or built from the callback's own arguments).
    """

    rule: type[FromSettings]
    attribute: str
    state_key: str = ""
    context: tuple[tuple[str, str], ...] = ()
    build: str = ""

    @property
    def key(self) -> str:
        """The checkpoint key of the detector's state."""
        return self.state_key or self.attribute

    @property
    def rule_ids(self) -> tuple[str, ...]:
        """The rule ids the detector raises, from its class's declarations."""
        return tuple(spec.rule_id for spec in self.rule.specs)

    def builder(self, callback: object) -> Callable[[Mapping[str, float]], Any]:
        """What builds the detector from the thresholds in effect, for ``callback`` (a partial, not a closure:
        the callback pickles, its declarations with it)."""
        if self.build:
            method: Callable[[Mapping[str, float]], Any] = getattr(callback, self.build)
            return method
        return functools.partial(_build, self.rule, callback, self.context)


def _build(
    rule: type[FromSettings], callback: object, context: tuple[tuple[str, str], ...], thresholds: Mapping[str, float]
) -> Any:
    """``rule.from_settings(thresholds)`` with the callback's ``context`` attributes as they are now (a new fit
    sees a changed ``monitor``)."""
    return rule.from_settings(thresholds, **{keyword: getattr(callback, name) for keyword, name in context})


@dataclass(frozen=True)
class Preset:
    """A callback's named list of detectors, in the order they are built and saved.

    Args:
        name: The callback's class name (the ``owner`` of its rules' declarations).
        detectors: Its detectors.
    """

    name: str
    detectors: tuple[Detector, ...]

    @property
    def rule_ids(self) -> tuple[str, ...]:
        """Every rule id the preset's detectors raise, in preset order."""
        return tuple(rule_id for detector in self.detectors for rule_id in detector.rule_ids)

    def find(self, rule: type[FromSettings]) -> Detector:
        """The entry of ``rule``'s class.

        Raises:
            KeyError: If the preset has no detector of that class.
        """
        for detector in self.detectors:
            if detector.rule is rule:
                return detector
        raise KeyError(f"{self.name}'s preset has no {rule.__name__}")
