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


BENCH_MODULES = {script.stem: script for script in ROOT.glob("bench/*.py")}


def top_level_names(script: Path) -> set[str]:
    """What a module defines at its top level: functions, classes, assignments, imports."""
    names: set[str] = set()
    for node in ast.parse(script.read_text(), str(script)).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {target.id for target in node.targets if isinstance(target, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
    return names


def bench_uses(script: Path) -> list[tuple[str, str]]:
    """(bench module, name) of each `module.name` a script reads from another bench script it
    imports (`import citus_pairs`, then `citus_pairs.vacuum`)."""
    tree = ast.parse(script.read_text(), str(script))
    imported = {
        alias.asname or alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
        if alias.name in BENCH_MODULES
    }
    return [
        (node.value.id, node.attr)
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id in imported
    ]


@pytest.mark.parametrize(
    "script", sorted(BENCH_MODULES.values()), ids=lambda path: str(path.relative_to(ROOT))
)
def test_what_a_bench_takes_from_another_bench_exists(script: Path) -> None:
    # bench/citus_gateway.py called citus_pairs.analyze for a day after it became `vacuum`.
    missing = [
        f"{module}.{name}"
        for module, name in bench_uses(script)
        if name not in top_level_names(BENCH_MODULES[module])
    ]
    assert missing == []


def test_a_bench_module_read_by_another_is_found() -> None:
    assert ("citus_pairs", "vacuum") in bench_uses(BENCH_MODULES["citus_gateway"])
