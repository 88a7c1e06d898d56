"""The package's import graph and its rule ids, read from the source with `ast` (nothing is imported)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_diag"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, tuple[Path, ast.Module]]:
    return {_module_name(p): (p, ast.parse(p.read_text(), str(p))) for p in sorted(PACKAGE.rglob("*.py"))}


def _resolve(importer: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = importer.split(".") if is_package else importer.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def _import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports, at module level or inside a function (``TYPE_CHECKING``-only
    imports excluded: they never run)."""
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}

    def target(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    for name, (path, tree) in modules.items():
        type_checking = {
            id(n)
            for node in ast.walk(tree)
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for n in ast.walk(node)
        }
        for node in ast.walk(tree):
            if id(node) in type_checking:
                continue
            found: list[str] = []
            if isinstance(node, ast.Import):
                found = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                module = _resolve(name, path.name == "__init__.py", node)
                # `from package import submodule` imports the submodule
                found = [f"{module}.{alias.name}" if f"{module}.{alias.name}" in modules else module
                         for alias in node.names]
            for imported in found:
                if imported.split(".")[0] == "lightning_diag" and (dest := target(imported)) and dest != name:
                    graph[name].add(dest)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_sees_module_and_function_level_imports():
    graph = _import_graph()
    assert "lightning_diag.core.registry" in graph["lightning_diag.rules.grad"]
    assert "lightning_diag.report.compare" in graph["lightning_diag.cli"]  # imported inside a function
    assert "lightning_diag.stats.error_clusters" in graph["lightning_diag.callbacks.error_analysis"]  # in a method


def test_no_import_cycles():
    """No module imports itself through others, at module level or in a function: no cycle is broken by a late
    import (registry <-> catalog and report/checks <-> its row modules were)."""
    assert _cycles(_import_graph()) == []


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _string_constants(tree: ast.Module) -> list[str]:
    """String literals, without docstrings and without the values of ``Literal[...]`` types."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                skip.add(id(first.value))
        if isinstance(node, ast.Subscript) and ast.unparse(node.value).endswith("Literal"):
            skip.update(id(n) for n in ast.walk(node.slice))
    return [
        n.value for n in ast.walk(tree)
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in skip
    ]


def test_every_rule_id_is_spelled_in_exactly_one_module():
    """A rule id is written once, in its `RuleSpec`; every other module reads it from the declaration."""
    from lightning_diag.core.registry import RULES
    from lightning_diag.rules import catalog  # noqa: F401  (every declaration)

    spelled: dict[str, list[str]] = {rule: [] for rule in RULES}
    for name, (_path, tree) in _modules().items():
        for rule in set(_string_constants(tree)) & set(spelled):
            spelled[rule].append(name)
    assert {rule: modules for rule, modules in spelled.items() if len(modules) != 1} == {}


def test_every_rule_class_is_built_from_its_settings():
    """Each rule class declares its rule ids (`specs`) and builds from the thresholds in effect with the
    defaults where a key is missing, as the callbacks and the report's replay do."""
    import importlib.util
    import inspect

    from lightning_diag.core.registry import RULES
    from lightning_diag.rules import catalog  # noqa: F401
    from lightning_diag.rules.base import Rule

    declared: set[str] = set()
    for path in sorted((PACKAGE / "rules").glob("*.py")):
        module = importlib.import_module(_module_name(path))
        for _name, cls in inspect.getmembers(module, inspect.isclass):
            specs = getattr(cls, "specs", ())
            if cls.__module__ != module.__name__ or not specs:
                continue
            declared |= {s.rule_id for s in specs}
            rule = cls.from_settings({})
            assert type(rule) is cls
            if issubclass(cls, Rule):
                assert cls.rule_id == specs[0].rule_id
    assert declared == set(RULES)


def _public_callbacks() -> list[type]:
    import pytorch_lightning as pl

    import lightning_diag

    found = [getattr(lightning_diag, n) for n in lightning_diag.__all__]
    return [c for c in found if isinstance(c, type) and issubclass(c, pl.Callback)]


def test_nothing_in_the_package_raises_a_deprecation_warning():
    """No compatibility layer (0.1.0 was never released): importing every module and building every public
    callback with its defaults warns about nothing, deprecation least of all."""
    import importlib.util
    import subprocess
    import sys

    modules = sorted(_modules())
    code = (
        "import importlib, warnings\n"
        "warnings.simplefilter('error')\n"
        f"for name in {modules!r}:\n"
        "    if name.endswith('__main__'):\n"
        "        continue\n"
        "    importlib.import_module(name)\n"
        "import lightning_diag, pytorch_lightning as pl\n"
        "for name in lightning_diag.__all__:\n"
        "    value = getattr(lightning_diag, name)\n"
        "    if isinstance(value, type) and issubclass(value, pl.Callback):\n"
        "        value()\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert len(_public_callbacks()) >= 9
    assert importlib.util.find_spec("lightning_diag.core.deprecation") is None
