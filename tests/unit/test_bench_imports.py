"""Every name a bench, an example or a test takes from the package is still there: benches run
outside the suite (`make bench`, by hand), so a name moved or removed in app/ breaks one only
when somebody runs it (bench/citus_pairs.py imported a function a refactor took away)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted([*ROOT.glob("bench/*.py"), *ROOT.glob("examples/**/*.py")])


def package_imports(script: Path) -> list[tuple[str, str]]:
    """(module, name) of each `from oncegate... import name` in `script`."""
    found = []
    for node in ast.walk(ast.parse(script.read_text(), str(script))):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("oncegate"):
            found += [(node.module or "", alias.name) for alias in node.names]
    return found


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda path: str(path.relative_to(ROOT)))
def test_what_a_script_imports_from_the_package_exists(script: Path) -> None:
    missing = []
    for module, name in package_imports(script):
        imported = importlib.import_module(module)
        if not hasattr(imported, name):
            try:
                importlib.import_module(f"{module}.{name}")
            except ModuleNotFoundError:
                missing.append(f"{module}.{name}")
    assert missing == []


def test_the_scripts_are_found() -> None:
    assert any(script.name == "citus_pairs.py" for script in SCRIPTS)
