"""Every migration goes up and comes back down, on a real PostgreSQL."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import asyncpg

from oncegate import schema


async def _tables(url: str) -> set[str]:
    connection = await asyncpg.connect(url)
    try:
        rows = await connection.fetch("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
    finally:
        await connection.close()
    return {row["tablename"] for row in rows}


async def _upgrade(url: str, revision: str = "head") -> None:
    # Alembic's async environment runs its own event loop: keep it off this one.
    await asyncio.to_thread(schema.upgrade, url, revision)


async def test_upgrade_downgrade_upgrade(empty_database_url: str) -> None:
    await _upgrade(empty_database_url)
    assert {"oncegate_keys", "alembic_version"} <= await _tables(empty_database_url)
    await _upgrade(empty_database_url)  # idempotent
    await asyncio.to_thread(schema.downgrade, empty_database_url, "base")
    assert "oncegate_keys" not in await _tables(empty_database_url)
    await _upgrade(empty_database_url)
    assert "oncegate_keys" in await _tables(empty_database_url)


async def test_the_key_table_leaves_room_for_hot_updates(database_url: str) -> None:
    connection = await asyncpg.connect(database_url)
    try:
        options = await connection.fetchval(
            "SELECT reloptions FROM pg_class WHERE relname = 'oncegate_keys'"
        )
    finally:
        await connection.close()
    assert "fillfactor=70" in options


ROOT = Path(__file__).resolve().parents[2]


async def test_alembic_s_own_command_line_migrates_from_the_checkout(
    empty_database_url: str,
) -> None:
    # For people who know Alembic: alembic.ini beside migrations/, the URL from the environment.
    alembic = Path(sys.executable).with_name("alembic")
    result = await asyncio.to_thread(
        subprocess.run,
        [str(alembic), "upgrade", "head"],
        cwd=ROOT,
        env={**os.environ, "ONCEGATE_DATABASE_URL": empty_database_url},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert {"oncegate_keys", "alembic_version"} <= await _tables(empty_database_url)


def test_the_package_imports_beside_a_project_whose_own_package_is_app(tmp_path: Path) -> None:
    # A FastAPI project very often has its own `app` package: both import side by side.
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "__init__.py").write_text("WHO = 'the user'\n")
    probe = (
        "import app, oncegate.agent, oncegate.schema; print(app.WHO); print(oncegate.schema.head())"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:2] == ["the user", schema.head()]
