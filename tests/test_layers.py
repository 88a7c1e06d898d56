import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_diag"


def test_stats_and_rules_import_no_lightning():
    code = (
        "import sys, lightning_diag.stats, lightning_diag.rules\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('pytorch_lightning', 'lightning')]\n"
        "print(bad); sys.exit(1 if bad else 0)\n"
    )
    # lightning_diag/__init__ imports callbacks; load the two subpackages without it.
    code = (
        "import importlib.util, sys, types\n"
        f"pkg = types.ModuleType('lightning_diag'); pkg.__path__ = [{str(PACKAGE)!r}]\n"
        "sys.modules['lightning_diag'] = pkg\n"
    ) + code.replace("import sys, ", "import ")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_no_private_trainer_attributes():
    hits = [
        f"{p}:{i}"
        for p in PACKAGE.rglob("*.py")
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if "trainer._" in line
    ]
    assert hits == []


def test_py_typed_shipped():
    assert (PACKAGE / "py.typed").exists()


# -- the package layout: each package imports only the packages below it -----------------------------------
import ast  # noqa: E402

#: Package -> the lightning_diag packages it may import (itself included). The order is the layering:
#: core <- stats <- rules <- instrument <- output <- callbacks; report reads core and rules only.
ALLOWED = {
    "core": {"core"},
    "stats": {"core", "stats"},
    "rules": {"core", "stats", "rules"},
    "instrument": {"core", "stats", "rules", "instrument"},
    "output": {"core", "output"},
    "callbacks": {"core", "stats", "rules", "instrument", "output", "callbacks"},
    "report": {"core", "rules", "output", "report"},  # output: the dashboard layout (no torch) for the plots
}
#: Third-party roots each package must not import (Lightning in the framework-free layers; torch in the core).
FORBIDDEN = {
    "core": {"torch", "numpy", "scipy", "pytorch_lightning", "lightning", "tensorboard"},
    "stats": {"pytorch_lightning", "lightning"},
    "rules": {"pytorch_lightning", "lightning", "torch"},
    "instrument": {"pytorch_lightning", "lightning"},
    "report": {"torch", "pytorch_lightning", "lightning"},
}


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


#: Modules outside the layers above rules/ that read rule ids from their declarations (each id is written once,
#: next to its rule): the dashboard layout. core/ is not among them: it imports nothing of the package above it.
READS_RULE_IDS = {"output/dashboard.py"}


#: Function-level imports that reach up a layer, each with its reason.
UPWARD = {
    # MLflow users get the run's report as an artifact: the sink renders it (report/ imports no torch).
    "output/logger_sinks.py": {"report"},
}


def test_each_package_imports_only_the_layers_below_it():
    wrong = []
    for package, allowed in ALLOWED.items():
        for path in sorted((PACKAGE / package).rglob("*.py")):
            here = str(path.relative_to(PACKAGE))
            permitted = allowed | ({"rules"} if here in READS_RULE_IDS else set()) | UPWARD.get(here, set())
            for name in _imports(path):
                parts = name.split(".")
                if parts[0] == "lightning_diag" and len(parts) > 1 and parts[1] in ALLOWED:
                    if parts[1] not in permitted:
                        wrong.append(f"{path.relative_to(PACKAGE)} imports {name}")
                elif parts[0] in FORBIDDEN.get(package, ()):
                    wrong.append(f"{path.relative_to(PACKAGE)} imports {name}")
    assert wrong == []


def test_no_module_shadows_a_third_party_package():
    # `lightning_diag.lightning` is the documented public path for the unified package and stays.
    third_party = {"torch", "numpy", "scipy", "tensorboard", "pytorch_lightning", "torchmetrics", "matplotlib",
                   "transformers", "wandb", "mlflow", "sklearn", "psutil", "logging", "json", "typing"}
    clashes = [p for p in PACKAGE.rglob("*.py") if p.stem in third_party]
    assert clashes == []


def test_core_imports_no_other_package_of_lightning_diag():
    """core/ is the bottom layer: the rule ids and ``ALL_RULES`` live with the declarations (rules/), not here."""
    wrong = [
        f"{path.relative_to(PACKAGE)} imports {name}"
        for path in sorted((PACKAGE / "core").rglob("*.py"))
        for name in _imports(path)
        if name.startswith("lightning_diag.") and name.split(".")[1] != "core"
    ]
    assert wrong == []


def _private_imports() -> list[str]:
    """``from lightning_diag.x import _name``: a private name of one module imported by another."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("lightning_diag")):
                found += [
                    f"{path.relative_to(PACKAGE)}: {node.module}.{alias.name}"
                    for alias in node.names
                    if alias.name.startswith("_") and not alias.name.startswith("__")
                ]
    return found


#: The private names still imported across modules (at most 5), each shared by a module and its helper.
PRIVATE_IMPORTS_ALLOWED = 5


def test_private_names_are_not_imported_across_modules():
    found = _private_imports()
    assert len(found) <= PRIVATE_IMPORTS_ALLOWED, found


# -- callbacks/: one subpackage per callback, common/ for what they all share ---------------------------------------
#: Imports between two callbacks' subpackages, each with its reason.
CALLBACK_CROSS_IMPORTS = {
    # RobustnessProbe reads a validation batch's predictions the way ErrorAnalysis does.
    ("probes/robustness.py", "lightning_diag.callbacks.error_analysis.samples"),
}


def test_each_callback_subpackage_imports_only_common_and_itself():
    """``callbacks/<callback>/`` holds what only that callback uses: it imports ``callbacks/common/`` and its own
    modules; ``common/`` imports no callback's subpackage. No module sits flat in ``callbacks/`` but ``__init__``."""
    callbacks = PACKAGE / "callbacks"
    assert [p.name for p in callbacks.glob("*.py")] == ["__init__.py"]
    wrong = []
    for path in sorted(callbacks.rglob("*.py")):
        here = path.relative_to(callbacks)
        if len(here.parts) == 1:
            continue
        allowed = {"common"} | {here.parts[0]}
        for name in _imports(path):
            parts = name.split(".")
            crosses = parts[:2] == ["lightning_diag", "callbacks"] and len(parts) > 2 and parts[2] not in allowed
            if crosses and (str(here), name) not in CALLBACK_CROSS_IMPORTS:
                wrong.append(f"callbacks/{here} imports {name}")
    assert wrong == []
