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
