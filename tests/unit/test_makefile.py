"""The Makefile's installs: `make run` installs the package with `[embedded]`, `make test` the test
toolchain `[dev]` on top; neither installs again what is there, in either order, and a `.venv`
made before the split (its one stamp, `.installed`) keeps working.

Run on a copy of the Makefile with a stand-in Python that records what it is asked to install
(the real installs are what `make test` itself and bench/first_run.py exercise)."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
RUN_STAMP, TEST_STAMP = ".venv/.installed-embedded", ".venv/.installed"

# `python -m venv DIR` makes DIR/bin/python (this script again); `python -m pip ...` is logged.
FAKE_PYTHON = """#!/bin/sh
if [ "$1 $2" = "-m venv" ]; then
    mkdir -p "$3/bin" && cp "$0" "$3/bin/python" && echo "venv" >> "$LOG"
elif [ "$1 $2" = "-m pip" ]; then
    shift 2; echo "pip $*" >> "$LOG"
fi
"""


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    shutil.copy(ROOT / "Makefile", tmp_path / "Makefile")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    python = tmp_path / "python3"
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    return tmp_path


def make(checkout: Path, target: str) -> list[str]:
    """What `make target` asked Python to do."""
    log = checkout / "log"
    log.unlink(missing_ok=True)
    subprocess.run(
        ["make", "--no-print-directory", target, f"PYTHON={checkout / 'python3'}"],
        cwd=checkout,
        env={**os.environ, "LOG": str(log)},
        check=True,
        capture_output=True,
    )
    return log.read_text().splitlines() if log.exists() else []


def installs(actions: list[str]) -> list[str]:
    return [action.rsplit(" ", 1)[-1] for action in actions if action.startswith("pip install")]


def test_run_then_test_installs_each_extra_once(checkout: Path) -> None:
    assert make(checkout, RUN_STAMP)[0] == "venv"
    assert installs(make(checkout, RUN_STAMP)) == []
    assert installs(make(checkout, TEST_STAMP)) == [".[dev]"]
    assert make(checkout, TEST_STAMP) == make(checkout, RUN_STAMP) == []


def test_a_fresh_run_installs_only_what_running_needs(checkout: Path) -> None:
    assert make(checkout, RUN_STAMP) == ["venv", "pip install --quiet --disable-pip-version-check "
                                         "-e .[embedded]"]  # fmt: skip


def test_test_then_run_installs_nothing_more(checkout: Path) -> None:
    assert installs(make(checkout, TEST_STAMP)) == [".[dev]"]
    assert make(checkout, RUN_STAMP) == []


def test_a_venv_made_before_the_split_keeps_working(checkout: Path) -> None:
    """Its only stamp is `.installed`, from `pip install -e '.[dev]'`."""
    make(checkout, TEST_STAMP)
    (checkout / RUN_STAMP).unlink()
    assert make(checkout, RUN_STAMP) == []
    assert make(checkout, TEST_STAMP) == []


def test_a_changed_pyproject_installs_again_what_each_command_needs(checkout: Path) -> None:
    make(checkout, TEST_STAMP)
    earlier = time.time() - 60  # both stamps older than pyproject.toml, as after an edit of it
    for stamp in (RUN_STAMP, TEST_STAMP):
        os.utime(checkout / stamp, (earlier, earlier))
    assert installs(make(checkout, RUN_STAMP)) == [".[embedded]"]
    assert installs(make(checkout, TEST_STAMP)) == [".[dev]"]
    assert make(checkout, RUN_STAMP) == make(checkout, TEST_STAMP) == []


@pytest.mark.parametrize("target", ["run", "test", "test-all", "lint"])
def test_each_command_asks_for_the_stamp_of_what_it_uses(target: str) -> None:
    needs = subprocess.run(
        ["make", "-pn", target], cwd=ROOT, capture_output=True, text=True, check=False
    ).stdout
    stamp = RUN_STAMP if target == "run" else TEST_STAMP
    rule = next(line for line in needs.splitlines() if line.startswith(f"{target}:"))
    if target in ("test", "test-all"):
        rule = next(line for line in needs.splitlines() if line.startswith("test-tools:"))
    assert stamp in rule.split(":", 1)[1].split()
