"""What the package declares it needs, and what it imports (issue 24)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lightning_diag"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def _name(requirement: str) -> str:
    return re.split(r"[\[<>=!~;\s]", requirement, maxsplit=1)[0].lower()


def _module_level_imports(path: Path) -> set[str]:
    """Top-level package names imported at module level (not inside a function or class)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def _all_imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_scipy_is_imported_only_inside_the_functions_that_use_it():
    files = PACKAGE.rglob("*.py")
    assert sorted(str(p.relative_to(ROOT)) for p in files if "scipy" in _module_level_imports(p)) == []


def test_every_required_dependency_is_imported_by_the_package():
    imported = set().union(*(_all_imports(p) for p in PACKAGE.rglob("*.py")))
    import_names = {"pytorch-lightning": "pytorch_lightning"}
    required = [_name(r) for r in PYPROJECT["project"]["dependencies"]]
    unused = [r for r in required if import_names.get(r, r) not in imported]
    assert unused == [], f"declared but never imported: {unused}"  # see docs/compatibility.md, "Dependencies"


def test_logger_integrations_are_never_imported_at_module_level():
    for path in PACKAGE.rglob("*.py"):
        assert not {"wandb", "mlflow"} & _all_imports(path), path


def test_dev_extra_and_dependency_group_are_the_same_and_hold_the_loggers():
    extra = PYPROJECT["project"]["optional-dependencies"]["dev"]
    assert PYPROJECT["dependency-groups"]["dev"] == extra
    assert {"wandb", "mlflow-skinny", "sqlalchemy"} <= {_name(r) for r in extra}


def test_python_classifiers_match_requires_python():
    minimum = PYPROJECT["project"]["requires-python"].removeprefix(">=")
    versions = [c.rsplit(" ", 1)[-1] for c in PYPROJECT["project"]["classifiers"] if re.search(r":: 3\.\d+$", c)]
    assert versions and versions[0] == minimum
