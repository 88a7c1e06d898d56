"""lightning_diag assigns no attribute on an object or class it does not own (issue 43), outside a reviewed list.

The package's source is parsed (``ast``) and every place that could patch someone else's object is listed:

* ``setattr(x, ...)``, ``delattr(x, ...)``, ``object.__setattr__(x, ...)``;
* ``x.__dict__[...] = ...``, ``vars(x)[...] = ...``, ``x.__dict__.update/pop/setdefault(...)``,
  ``vars(x).update/pop/setdefault(...)``;
* ``x.__class__ = ...``;
* ``x.attr = ...`` (also augmented) where ``x`` is named like an object of torch, Lightning or the user
  (``trainer``, ``pl_module``, ``module``, ``model``, ``optimizer``, ``logger``, ``dataloader``, ``dataset``, ...);

where ``x`` is not ``self`` or ``cls``. Each must be in :data:`ALLOWED` with the reason it is the library's own
object or a documented interface; an entry that no longer matches anything fails too, so the list stays current.
"""

from __future__ import annotations

import ast
from pathlib import Path

import lightning_diag

PACKAGE = Path(lightning_diag.__file__).parent

#: Names that, as the object of an attribute assignment, denote an object of torch, Lightning or the user.
FOREIGN = frozenset({
    "trainer", "pl_module", "module", "model", "modules", "optimizer", "opt", "logger", "loggers", "dataloader",
    "loader", "dataset", "callback", "cb", "strategy", "scheduler", "scaler", "precision_plugin", "batch",
    "lightning_module", "fit_loop",
})
_OWN = frozenset({"self", "cls"})
_DICT_METHODS = frozenset({"update", "pop", "setdefault", "clear", "__setitem__"})

#: ``(file, enclosing function, what)`` -> why it is not a patch. Reviewed: add an entry only with a reason.
ALLOWED: dict[tuple[str, str, str], str] = {
    ("callbacks/common/unlogged.py", "unlogged_copy", "vars(copy).update"):
        "the shallow copy of the module that the function itself creates (object.__new__) and owns",
    ("callbacks/common/unlogged.py", "unlogged_copy", "vars(copy)[]="):
        "silences log/log_dict on that copy only; the user's module and class are untouched",
    ("instrument/rng.py", "restore", "setattr(obj)"):
        "puts back the binding the user's dataset/collate_fn held before our bounded read ran its code: assigns "
        "only values the object held at capture",
    ("instrument/rng.py", "restore", "delattr(obj)"):
        "removes what the user's __getitem__ added during our read (a lazily opened file, a new generator)",
    ("repro.py", "run_repro", "setattr(trainer)"):
        "limit_*_batches of the Trainer the repro command itself builds from the config, before its fit: "
        "the tool's own trainer, set through the Trainer's public attributes",
    ("callbacks/probes/probe.py", "sandbox", "module.training"):
        "restores each module's training flag the probe's eval() changed, to the value it had (the flag "
        "nn.Module.train() itself assigns; calling train() would run the user's override)",
    ("callbacks/anomaly_alarm/nonfinite_guard.py", "perform", "trainer.should_stop"):
        "Lightning's documented way for a callback to end the fit (what EarlyStopping does): on_nonfinite='stop'",
    ("core/log_handler.py", "ensure_handler", "logger.propagate"):
        "the library's own 'lightning_diag' logging.Logger, and only when the user configured no handler",
    ("callbacks/common/driver.py", "batch_started", "cb.on_cadence"):
        "the trainer's driver sets the cadence flag of the lightning_diag callbacks attached to it (only "
        "DiagCallback.setup attaches, with itself): the library's own objects and their own attribute",
    ("callbacks/common/driver.py", "_host", "vars(cb)[]="):
        "our own callbacks' hook attributes (DiagCallback instances attached to the driver): the driver's calls on "
        "the host, None on the others during a fit, given back at unhost",
    ("callbacks/common/driver.py", "_unhost", "vars(cb)[]="):
        "our own callbacks' hook attributes, given back at unhost: what each instance held before the fit",
    ("callbacks/common/driver.py", "_unhost", "vars(cb).pop"):
        "our own callbacks' hook attributes, given back at unhost: the driver's entry removed, the class's hook again",
    ("callbacks/common/driver.py", "_refresh", "vars(host)[]="):
        "our own host callback's hook attributes (a DiagCallback the driver hosts): the driver's call of every "
        "attached callback's part, given back at unhost",
    ("demo/loader_faults.py", "reseed_jitter", "dataset.rng"):
        "the demo's worker_init_fn reseeding the demo's own JitteredInputs in each worker",
}


def _name(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return ""


def _vars_of(node: ast.expr) -> ast.expr | None:
    """``x`` of ``x.__dict__`` or ``vars(x)``."""
    if isinstance(node, ast.Attribute) and node.attr == "__dict__":
        return node.value
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "vars" and node.args:
        return node.args[0]
    return None


def _shown(target: ast.expr) -> str:
    """``vars(x)`` for both ``x.__dict__`` and ``vars(x)``, so one entry covers either spelling."""
    return f"vars({ast.unparse(target)})"


def _findings(tree: ast.AST) -> list[tuple[str, int, str]]:
    """``(enclosing function, line, what)`` of every candidate patch in ``tree``."""
    out: list[tuple[str, int, str]] = []

    def visit(node: ast.AST, function: str) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            function = node.name
        what = _what(node)
        if what:
            out.append((function, getattr(node, "lineno", 0), what))
        for child in ast.iter_child_nodes(node):
            visit(child, function)

    visit(tree, "<module>")
    return out


def _what(node: ast.AST) -> str:
    if isinstance(node, ast.Call):
        func = node.func
        if (isinstance(func, ast.Name) and func.id in ("setattr", "delattr") and node.args
                and _name(node.args[0]) not in _OWN):
            return f"{func.id}({ast.unparse(node.args[0])})"
        if (isinstance(func, ast.Attribute) and func.attr == "__setattr__" and isinstance(func.value, ast.Name)
                and func.value.id == "object" and node.args and _name(node.args[0]) not in _OWN):
            return f"object.__setattr__({ast.unparse(node.args[0])})"
        if isinstance(func, ast.Attribute) and func.attr in _DICT_METHODS:
            of = _vars_of(func.value)
            if of is not None and _name(of) not in _OWN:
                return f"{_shown(of)}.{func.attr}"
        return ""
    targets: list[ast.expr] = []
    if isinstance(node, ast.Assign):
        targets = [t for target in node.targets for t in (target.elts if isinstance(target, ast.Tuple) else [target])]
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        targets = [node.target]
    for target in targets:
        if isinstance(target, ast.Subscript):
            of = _vars_of(target.value)
            if of is not None and _name(of) not in _OWN:
                return f"{_shown(of)}[]="
        if isinstance(target, ast.Attribute):
            base = _name(target.value)
            if target.attr == "__class__" and base not in _OWN:
                return f"{ast.unparse(target.value)}.__class__"
            if base in FOREIGN:
                return f"{base}.{target.attr}"
    return ""


def _scan() -> dict[tuple[str, str, str], list[int]]:
    found: dict[tuple[str, str, str], list[int]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        for function, line, what in _findings(ast.parse(path.read_text(encoding="utf-8"), filename=rel)):
            found.setdefault((rel, function, what), []).append(line)
    return found


def test_nothing_is_assigned_on_objects_the_library_does_not_own() -> None:
    found = _scan()
    new = {key: lines for key, lines in found.items() if key not in ALLOWED}
    assert not new, "assignments on objects lightning_diag may not own (fix them, or review and add to ALLOWED " \
        "with a reason): " + "; ".join(f"{f}:{lines} in {fn}(): {what}" for (f, fn, what), lines in new.items())


def test_every_allowed_entry_still_matches_and_says_why() -> None:
    found = _scan()
    stale = [key for key in ALLOWED if key not in found]
    assert not stale, f"ALLOWED entries that match nothing any more (remove them): {stale}"
    assert all(len(reason) > 40 for reason in ALLOWED.values())


def test_the_scan_sees_each_kind_of_patch() -> None:
    source = '''
def patch(trainer, pl_module, obj, cb):
    setattr(pl_module, "log", None)
    delattr(obj, "x")
    object.__setattr__(obj, "y", 1)
    pl_module.__dict__["log"] = None
    vars(cb)["on_fit_start"] = None
    obj.__dict__.update(a=1)
    vars(obj).pop("a")
    obj.__class__ = int
    trainer.fit_loop = None
    trainer.strategy.precision_plugin.x += 1

class Mine:
    def ok(self, value):
        setattr(self, "a", value)
        self.__dict__["b"] = value
        vars(self).update(c=value)
        self.trainer = value
        mine = {}
        mine["x"] = value
'''
    whats = [what for _, _, what in _findings(ast.parse(source))]
    assert whats == [
        "setattr(pl_module)", "delattr(obj)", "object.__setattr__(obj)", "vars(pl_module)[]=", "vars(cb)[]=",
        "vars(obj).update", "vars(obj).pop", "obj.__class__", "trainer.fit_loop", "precision_plugin.x",
    ]
