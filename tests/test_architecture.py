"""The package's import graph and its rule ids, read from the source with `ast` (nothing is imported)."""

import ast
from collections.abc import Collection
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
    assert "lightning_diag.core.registry" in graph["lightning_diag.rules.grad_norm_band"]
    assert "lightning_diag.report.compare" in graph["lightning_diag.cli"]  # imported inside a function
    # imported in a method
    assert "lightning_diag.stats.error_clusters" in graph["lightning_diag.callbacks.error_analysis.analysis"]


def test_no_import_cycles():
    """No module imports itself through others, at module level or in a function: no cycle is broken by a late
    import (registry <-> catalog and report/checks <-> its row modules were)."""
    assert _cycles(_import_graph()) == []


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _string_nodes(tree: ast.Module) -> list[ast.Constant]:
    """String literals (f-string parts included), without docstrings and without the values of ``Literal[...]``
    types."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                skip.add(id(first.value))
        if isinstance(node, ast.Subscript) and ast.unparse(node.value).endswith("Literal"):
            skip.update(id(n) for n in ast.walk(node.slice))
    return [
        n for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in skip
    ]


def _imported(name: str, tree: ast.Module) -> dict[str, object]:
    """Name bound by a ``from lightning_diag... import`` in ``tree`` -> the object it names."""
    import importlib

    found: dict[str, object] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            source = _resolve(name, False, node)
            if not source.startswith("lightning_diag"):
                continue
            module = importlib.import_module(source)
            for alias in node.names:
                if hasattr(module, alias.name):
                    found[alias.asname or alias.name] = getattr(module, alias.name)
    return found


def _rule_named(node: ast.expr | None, imported: dict[str, object], rules: Collection[str]) -> str | None:
    """The rule id ``node`` spells (``"loss_swing"``) or names (``LOSS_SWING``, imported), else ``None``."""
    value = imported.get(node.id) if isinstance(node, ast.Name) else None
    if isinstance(node, ast.Constant):
        value = node.value
    return value if isinstance(value, str) and value in rules else None


#: The fault library: each fault names the rule it expects to fire.
FAULT_LIBRARY = {"lightning_diag.demo.faults", "lightning_diag.demo.loader_faults"}


def _misspellings() -> list[str]:
    """Every place outside its declaring module (the module whose ``RuleSpec(...)`` / ``SettingSpec(...)`` holds
    it) where a library module spells a rule id or one of a rule's setting names (the fault library
    excepted, docstrings being prose):

    * a rule id as a word of a string literal (``"loss_swing"``, ``f"{p}/threshold/loss_swing$"``, a title's
      ``{loss_swing:g}``), with a setting after it (``"loss_swing.patience"``, ``{loss_swing__patience}``);
    * a shared setting's key (``"grad.patience"``);
    * a ``thresholds()`` key built from a rule id in an f-string (``f"{LOSS_SWING}.patience"``);
    * a field read by name from what a declaration built (``fields = f(DDP_DESYNC_SPEC); fields["threshold"]``);
    * a setting name handed to a declaration's ``key`` / ``value`` / ``limit`` (``SPEC.key("sample_size")``);
    * a setting name as the key of the mapping given to a rule id (``{LOSS_SWING: {"patience": 3}}``) or to a
      family of shared settings (``{"grad": {"patience": 5}}``).
    """
    import re

    from lightning_diag.core.registry import RULES, SETTINGS, RuleSpec
    from lightning_diag.rules import catalog  # noqa: F401  (every declaration)

    modules = {n: t for n, (_p, t) in _modules().items() if n not in FAULT_LIBRARY}
    home: dict[str, str] = {}
    for name, tree in modules.items():
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and ast.unparse(node.func) in ("RuleSpec", "SettingSpec")
                and node.args
                and isinstance(node.args[0], ast.Constant)
            ):
                home[node.args[0].value] = name
    assert set(RULES) | set(SETTINGS) <= set(home), "a declaration was not found by the checker"
    settings = {rule: set(spec.settings) for rule, spec in RULES.items()}
    all_settings = set().union(*settings.values())
    declares = {m: set().union(*(settings[r] for r, h in home.items() if h == m and r in RULES)) for m in modules}
    words = "|".join(sorted(map(re.escape, [*RULES, *SETTINGS]), key=len, reverse=True))
    spelled = re.compile(rf"(?<![\w.])({words})(?:(?:\.|__)(\w+))?(?!\w)")
    found: list[str] = []
    for name, tree in modules.items():
        for node in _string_nodes(tree):
            for match in spelled.finditer(node.value):
                if home[match[1]] != name:
                    found.append(f"{name}:{node.lineno}: {match[0]!r}")
        imported = _imported(name, tree)
        # names bound to something built from an imported declaration (``fields = self._fields(SPEC)``)
        built = {
            target.id: arg
            for node in ast.walk(tree) if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
            for target in node.targets if isinstance(target, ast.Name)
            for arg in [imported.get(a.id) for a in node.value.args if isinstance(a, ast.Name)]
            if isinstance(arg, RuleSpec)
        }
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Subscript)
                and isinstance(node.value, ast.Name)
                and isinstance(node.slice, ast.Constant)
                and node.value.id in built
                and node.slice.value in built[node.value.id].fields
            ):
                found.append(f"{name}:{node.lineno}: {built[node.value.id].rule_id}.{node.slice.value}")
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("key", "value", "limit")
            ):
                receiver = imported.get(node.func.value.id) if isinstance(node.func.value, ast.Name) else None
                for arg in node.args:
                    if not (isinstance(arg, ast.Constant) and arg.value in all_settings):
                        continue
                    if isinstance(receiver, RuleSpec):
                        if arg.value in receiver.settings and home[receiver.rule_id] != name:
                            found.append(f"{name}:{node.lineno}: {receiver.rule_id}.{arg.value}")
                    elif arg.value not in declares[name]:
                        found.append(f"{name}:{node.lineno}: ?.{arg.value}")
            elif isinstance(node, ast.JoinedStr):  # f"{LOSS_SWING}.patience"
                for part, after in zip(node.values, node.values[1:], strict=False):
                    rule = _rule_named(part.value, imported, RULES) if isinstance(part, ast.FormattedValue) else None
                    if rule is None or home[rule] == name or not isinstance(after, ast.Constant):
                        continue
                    setting = re.match(r"(?:\.|__)(\w+)", str(after.value))
                    if setting:  # a declared setting, or a key written beside them (``higher_is_better``)
                        found.append(f"{name}:{node.lineno}: {rule}.{setting[1]}")
            elif isinstance(node, ast.Dict):
                for key, value in zip(node.keys, node.values, strict=True):
                    if not isinstance(value, ast.Dict):
                        continue
                    rule = _rule_named(key, imported, RULES)
                    inner = [k.value for k in value.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)]
                    if rule is not None and home[rule] != name:
                        fields = {"threshold", *settings[rule]}
                        found += [f"{name}:{node.lineno}: {rule}.{k}" for k in inner if k in fields]
                    elif isinstance(key, ast.Constant) and isinstance(key.value, str):  # a family: {"grad": {...}}
                        found += [
                            f"{name}:{node.lineno}: {key.value}.{k}" for k in inner
                            if home.get(f"{key.value}.{k}", name) != name
                        ]
    return sorted(set(found))


def test_every_rule_id_and_setting_name_is_spelled_in_its_declaring_module_only():
    """A rule id and its settings' names are written once, in the rule's declaration; every other module reads
    them from it (the fault library may name the rule it expects)."""
    assert _misspellings() == []


def test_the_spelling_check_finds_a_misspelling(tmp_path, monkeypatch):
    """The checker sees each form it looks for (a literal id, a key, a declaration's key, a nested mapping)."""
    source = (
        "from lightning_diag.rules.loss_swing import LOSS_SWING, LOSS_SWING_SPEC\n"
        "A = 'loss_swing'\nB = f'{p}/threshold/loss_swing$'\nC = 'grad.patience'\n"
        "D = LOSS_SWING_SPEC.key('patience')\nE = {LOSS_SWING: {'patience': 3}}\nF = {'grad': {'patience': 5}}\n"
        "G = f'{LOSS_SWING}.patience'\nH = fields(LOSS_SWING_SPEC)\nI = H['patience']\n"
    )
    tree = ast.parse(source)
    real = _modules
    monkeypatch.setitem(globals(), "_modules", lambda: {**real(), "lightning_diag.probe": (tmp_path, tree)})
    found = [f.split(":", 1)[1] for f in _misspellings() if f.startswith("lightning_diag.probe:")]
    assert sorted(found, key=lambda f: int(f.split(":")[0])) == [
        "2: 'loss_swing'", "3: 'loss_swing'", "4: 'grad.patience'", "5: loss_swing.patience",
        "6: loss_swing.patience", "7: grad.patience", "8: loss_swing.patience", "10: loss_swing.patience",
    ]


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


#: The callbacks' main modules (their presets) and the report's replay of a plain run (its ``PRESET``): the only
#: modules outside rules/ that name detectors.
PRESET_MODULES = {
    "lightning_diag.callbacks.anomaly_alarm.alarm",
    "lightning_diag.callbacks.attention_entropy.monitor",
    "lightning_diag.callbacks.data_diagnostics.diagnostics",
    "lightning_diag.callbacks.error_analysis.analysis",
    "lightning_diag.callbacks.gradient_flow.monitor",
    "lightning_diag.callbacks.probes.quantization",
    "lightning_diag.callbacks.probes.robustness",
    "lightning_diag.callbacks.probes.sharpness",
    "lightning_diag.callbacks.system_monitor.monitor",
    "lightning_diag.report.plain",
}
#: The modules of rules/ every part may import: the judgment signature (``base``), the closed set of measurements
#: and its records (``measures``, ``records``), the non-finite and rollback verdicts a part carries out
#: (``verdicts``), the report rows' machinery (``rows``) and the generic index of every rule (``catalog``).
SHARED_RULE_MODULES = {
    "lightning_diag.rules.base",
    "lightning_diag.rules.catalog",
    "lightning_diag.rules.measures",
    "lightning_diag.rules.records",
    "lightning_diag.rules.rows",
    "lightning_diag.rules.verdicts",
}


def _rule_module_imports(modules: dict[str, tuple[Path, ast.Module]]) -> list[str]:
    """``importer -> rules module`` for every import (type-only and function-level ones included) by a module
    outside rules/, other than a preset, of a module of rules/ that is not shared (a detector's module, a module
    shared by one family of detectors, or the package, which re-exports rule classes)."""
    found = []
    for name, (path, tree) in sorted(modules.items()):
        if name.startswith("lightning_diag.rules") or name in PRESET_MODULES:
            continue
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom):
                module = _resolve(name, path.name == "__init__.py", node)
                targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in modules else module for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            found += [
                f"{name} -> {t}" for t in targets
                if t.split(".")[:2] == ["lightning_diag", "rules"] and t not in SHARED_RULE_MODULES
            ]
    return sorted(set(found))


def test_no_module_outside_rules_but_a_preset_imports_a_rule_module():
    """A part (a callback's helper, instrument/, output/, the report's other modules) imports the measurements,
    records, verdicts, rows and the catalog, never a detector's module: the ids, settings and defaults it needs
    come from its preset module, at construction."""
    assert _rule_module_imports(_modules()) == []


def test_the_preset_modules_are_those_that_declare_a_preset():
    """The exception list is exactly the modules assigning a callback's ``preset`` or the report's ``PRESET`` a
    non-empty list of detectors (the base class's empty ``Preset("DiagCallback", ())`` names none)."""

    def detectors(value: ast.expr | None) -> list[ast.expr]:
        if isinstance(value, ast.Call) and ast.unparse(value.func) == "Preset" and len(value.args) > 1:
            value = value.args[1]
        return value.elts if isinstance(value, ast.Tuple) else []

    declaring = {
        name for name, (_path, tree) in _modules().items()
        for node in ast.walk(tree)
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and detectors(node.value)
        for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
        if isinstance(target, ast.Name) and target.id in ("preset", "PRESET")
    }
    assert declaring == PRESET_MODULES


def test_the_shared_rule_modules_declare_no_rule():
    """What every part may import holds no declaration (else a part could read a rule through it)."""
    modules = _modules()
    declaring = [
        name for name in sorted(SHARED_RULE_MODULES)
        for node in ast.walk(modules[name][1])
        if isinstance(node, ast.Call) and ast.unparse(node.func) in ("RuleSpec", "SettingSpec", "register")
    ]
    assert declaring == []


def test_the_rule_module_check_finds_an_import():
    source = (
        "from lightning_diag.rules.measures import Measures\n"
        "from lightning_diag.rules.zero_output import ZERO_OUTPUT\n"
        "def f():\n    from lightning_diag.rules import LossSwingRule\n"
    )
    part = {"lightning_diag.callbacks.some_part": (PACKAGE / "callbacks" / "some_part.py", ast.parse(source))}
    preset = {"lightning_diag.callbacks.gradient_flow.monitor": (PACKAGE / "x.py", ast.parse(source))}
    modules = {**_modules(), **part, **preset}
    found = [f for f in _rule_module_imports(modules) if "some_part" in f or "gradient_flow.monitor" in f]
    assert found == [
        "lightning_diag.callbacks.some_part -> lightning_diag.rules",
        "lightning_diag.callbacks.some_part -> lightning_diag.rules.zero_output",
    ]
