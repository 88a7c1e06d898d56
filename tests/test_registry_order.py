"""The registry's order does not depend on import order (issue 43): two processes that import the declaring
modules in opposite orders list the same rules, settings and checklist rows in the same order."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: Imports the given rules modules one by one, then the catalogue, and prints the registry's three views.
SCRIPT = """
import importlib, json, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
import lightning_diag.rules.catalog as catalog
from lightning_diag.core import registry
print(json.dumps({
    "rules": list(catalog.ALL_RULES),
    "settings": list(registry.SETTINGS),
    "checks": list(registry.CHECKS),
    "owners": {o: [s.rule_id for s in registry.rules_of(o)] for o in sorted(set(catalog.ALL_RULES.values()))},
}))
"""


def _rules_modules() -> list[str]:
    return sorted(f"lightning_diag.rules.{p.stem}" for p in (ROOT / "lightning_diag" / "rules").glob("*.py"))


def _listing(modules: list[str]) -> dict[str, object]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, *modules], capture_output=True, text=True, env=env, check=True, cwd=ROOT
    )
    return json.loads(out.stdout)


@pytest.mark.slow
def test_registry_order_does_not_depend_on_import_order() -> None:
    modules = _rules_modules()
    forward = _listing(modules)
    backward = _listing(list(reversed(modules)))
    # the whole package first (the callbacks import the rules modules in their own order)
    package = _listing(["lightning_diag", *modules])
    assert forward == backward == package
    rules = forward["rules"]
    assert isinstance(rules, list) and len(rules) == len(set(rules)) >= 40
    # declaration order within a module is kept: the attention module declares low, high, then the sink
    declared = ["attn_entropy_low", "attn_entropy_high", "attn_sink"]
    owned = forward["owners"]["AttentionEntropyMonitor"]
    assert isinstance(owned, list)
    assert [r for r in owned if r in declared] == declared
    # the checklist keeps the catalogue's report order
    checks = forward["checks"]
    assert isinstance(checks, list)
    assert checks.index("data_label_balance") < checks.index("grad_norm_band") < checks.index("nonfinite")


def test_registry_order_is_by_module_then_declaration() -> None:
    """In this process: the rules are grouped by declaring module (found in the source: ``RuleSpec("<id>"``), the
    modules in name order, each module's rules in the order its source declares them."""
    import lightning_diag.rules.catalog as catalog

    declared: list[str] = []
    for name in _rules_modules():
        source = (ROOT / "lightning_diag" / "rules" / f"{name.rsplit('.', 1)[-1]}.py").read_text()
        declared += [r for r in re.findall(r'RuleSpec\(\s*"(\w+)"', source) if r in catalog.ALL_RULES]
    assert len(declared) >= 40
    assert list(catalog.ALL_RULES) == declared
