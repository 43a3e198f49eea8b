"""pyproject.toml lists the installed packages by hand (`app/` installs as `oncegate`), so a new
folder of modules under `app/` that is not listed works in a checkout (the editable install)
and is missing from the wheel: `pip install oncegate` then fails at its first import."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).parents[2]


def test_every_package_under_app_is_installed() -> None:
    listed = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    app = ROOT / "app"
    found = {
        ".".join(("oncegate", *init.parent.relative_to(app).parts))
        for init in app.rglob("__init__.py")
    }
    assert found - listed == set(), "add them to [tool.setuptools] packages in pyproject.toml"
