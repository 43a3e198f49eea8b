"""Every migration goes up and comes back down, on a real PostgreSQL."""

from __future__ import annotations

import asyncio

import asyncpg

from app import migrations


async def _tables(url: str) -> set[str]:
    connection = await asyncpg.connect(url)
    try:
        rows = await connection.fetch("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
    finally:
        await connection.close()
    return {row["tablename"] for row in rows}


async def _upgrade(url: str, revision: str = "head") -> None:
    # Alembic's async environment runs its own event loop: keep it off this one.
    await asyncio.to_thread(migrations.upgrade, url, revision)


async def test_upgrade_downgrade_upgrade(empty_database_url: str) -> None:
    await _upgrade(empty_database_url)
    assert {"oncegate_keys", "alembic_version"} <= await _tables(empty_database_url)
    await _upgrade(empty_database_url)  # idempotent
    await asyncio.to_thread(migrations.downgrade, empty_database_url, "base")
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
