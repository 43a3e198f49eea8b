"""migrations/schema.sql is the schema as the migrations leave it at head: the same tables,
columns, constraints, domains, indexes, sequences, storage options and functions, read from the
catalogs of a database built each way."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import asyncpg
import pytest

SCHEMA = Path(__file__).parents[2] / "migrations" / "schema.sql"

# Each query reads one part of the schema of oncegate's objects in `public` (Alembic's own
# `alembic_version` is the migrations' bookkeeping, not the schema), as text the server prints
# the same way however it was spelled when created.
CATALOG = {
    "tables": r"""
        SELECT c.relname, coalesce(array_to_string(c.reloptions, ','), '') AS options
        FROM pg_class AS c JOIN pg_namespace AS n ON n.oid = c.relnamespace
        WHERE n.nspname = 'public' AND c.relkind IN ('r', 'p') AND c.relname LIKE 'oncegate\_%'
        ORDER BY 1
    """,
    # In each table's order (a column a migration added comes last, in schema.sql too).
    "columns": r"""
        SELECT c.relname,
               row_number() OVER (PARTITION BY c.relname ORDER BY a.attnum) AS position,
               a.attname, format_type(a.atttypid, a.atttypmod) AS type, a.attnotnull,
               a.attidentity, coalesce(pg_get_expr(d.adbin, d.adrelid), '') AS default
        FROM pg_attribute AS a
        JOIN pg_class AS c ON c.oid = a.attrelid
        JOIN pg_namespace AS n ON n.oid = c.relnamespace
        LEFT JOIN pg_attrdef AS d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
        WHERE n.nspname = 'public' AND c.relkind IN ('r', 'p') AND c.relname LIKE 'oncegate\_%'
          AND a.attnum > 0 AND NOT a.attisdropped
        ORDER BY 1, 2
    """,
    "constraints": r"""
        SELECT c.relname, k.conname, k.contype, pg_get_constraintdef(k.oid) AS definition
        FROM pg_constraint AS k
        JOIN pg_class AS c ON c.oid = k.conrelid
        JOIN pg_namespace AS n ON n.oid = c.relnamespace
        WHERE n.nspname = 'public' AND c.relname LIKE 'oncegate\_%'
        ORDER BY 1, 2
    """,
    # Each domain with its base type, NOT NULL, default and each of its checks.
    "domains": r"""
        SELECT t.typname, format_type(t.typbasetype, t.typtypmod) AS base, t.typnotnull,
               coalesce(t.typdefault, '') AS default, k.conname,
               pg_get_constraintdef(k.oid) AS definition
        FROM pg_type AS t
        JOIN pg_namespace AS n ON n.oid = t.typnamespace
        LEFT JOIN pg_constraint AS k ON k.contypid = t.oid
        WHERE n.nspname = 'public' AND t.typtype = 'd' AND t.typname LIKE 'oncegate\_%'
        ORDER BY 1, 5
    """,
    "indexes": r"""
        SELECT tablename, indexname, indexdef FROM pg_indexes
        WHERE schemaname = 'public' AND tablename LIKE 'oncegate\_%'
        ORDER BY 1, 2
    """,
    "sequences": r"""
        SELECT sequencename, data_type::text, start_value, min_value, max_value,
               increment_by, cycle, cache_size
        FROM pg_sequences WHERE schemaname = 'public'
        ORDER BY 1
    """,
    # Same signatures, same bodies byte for byte (pg_get_functiondef prints the header the
    # same way whatever its spelling; the body is kept as written).
    "functions": r"""
        SELECT p.proname || '(' || pg_get_function_identity_arguments(p.oid) || ')' AS signature,
               pg_get_functiondef(p.oid) AS definition
        FROM pg_proc AS p JOIN pg_namespace AS n ON n.oid = p.pronamespace
        WHERE n.nspname = 'public' AND p.proname LIKE 'oncegate\_%'
        ORDER BY 1
    """,
}


async def catalog(url: str) -> dict[str, list[tuple[Any, ...]]]:
    connection = await asyncpg.connect(url)
    try:
        return {
            part: [tuple(row) for row in await connection.fetch(query)]
            for part, query in CATALOG.items()
        }
    finally:
        await connection.close()


async def load_schema_sql(url: str, *then: str) -> None:
    connection = await asyncpg.connect(url)
    try:
        await connection.execute(SCHEMA.read_text())
        for statement in then:
            await connection.execute(statement)
    finally:
        await connection.close()


async def test_schema_sql_builds_exactly_the_schema_the_migrations_leave(
    database_url: str, empty_database_url: str
) -> None:
    migrated = await catalog(database_url)
    # The comparison has something to compare: every table, and the rule among the functions.
    assert [row[0] for row in migrated["tables"]] == [
        "oncegate_checkpoints", "oncegate_ended_sessions", "oncegate_keys"
    ]  # fmt: skip
    assert ("oncegate_keys", "fillfactor=70") in migrated["tables"]
    assert any(row[1] == "oncegate_keys_expires_at" for row in migrated["indexes"])
    assert any(row[0].startswith("oncegate_key_state(") for row in migrated["functions"])
    columns = [row[:4] for row in migrated["columns"]]
    assert ("oncegate_keys", 2, "route", "oncegate_route") in columns
    assert any(row[0] == "oncegate_sha256" for row in migrated["domains"])
    await load_schema_sql(empty_database_url)
    loaded = await catalog(empty_database_url)
    for part in CATALOG:
        assert loaded[part] == migrated[part], part


@pytest.mark.parametrize(
    "change",
    [
        "ALTER TABLE oncegate_keys SET (fillfactor = 100)",
        "ALTER TABLE oncegate_keys ALTER COLUMN waited SET DEFAULT true",
        "ALTER TABLE oncegate_checkpoints ALTER COLUMN pending SET NOT NULL",
        "ALTER TABLE oncegate_ended_sessions DROP CONSTRAINT oncegate_ended_sessions_session_check",
        "DROP INDEX oncegate_keys_expires_at",
        "ALTER DOMAIN oncegate_status DROP CONSTRAINT oncegate_status_http;"
        " ALTER DOMAIN oncegate_status ADD CONSTRAINT oncegate_status_http"
        " CHECK (VALUE BETWEEN 100 AND 598)",
        "ALTER TABLE oncegate_keys ALTER COLUMN id SET CACHE 1",
        "CREATE OR REPLACE FUNCTION oncegate_after(at timestamptz, seconds float8)"
        " RETURNS timestamptz LANGUAGE sql IMMUTABLE AS $$ SELECT at $$",
    ],
)
async def test_the_comparison_sees_a_schema_that_differs(
    database_url: str, empty_database_url: str, change: str
) -> None:
    # The test above can fail: schema.sql with one thing changed does not compare equal.
    migrated = await catalog(database_url)
    await load_schema_sql(empty_database_url, change)
    loaded = await catalog(empty_database_url)
    assert any(loaded[part] != migrated[part] for part in CATALOG)


async def test_the_schemas_sql_functions_are_inlined_where_a_statement_calls_them(
    db: asyncpg.Connection,
) -> None:
    # A function PostgreSQL does not inline runs as a call of its own on every row: 1.5-2.0 µs
    # for `oncegate_after` as migration 0008 wrote it, against 0.08 µs written out. It is not
    # inlined when its body calls something less immutable than it is declared.
    plan = "\n".join(
        row[0]
        for row in await db.fetch(
            "EXPLAIN VERBOSE SELECT oncegate_after(now(), seconds),"
            " oncegate_key_is('expired', 'completed', NULL, now() + interval '1 hour', now()),"
            " oncegate_key_state('in_progress', now(), now())"
            " FROM generate_series(1, 3) AS seconds"
        )
    )
    assert "oncegate_" not in plan, plan
    # And the lease's end is the instant it always was, whatever the session's time zone.
    await db.execute("SET timezone = 'Europe/Paris'")
    assert await db.fetchval(
        "SELECT oncegate_after('2026-03-29 00:30:00+00', 7200.5)"
        " = '2026-03-29 00:30:00+00'::timestamptz + interval '7200.5 seconds'"
    )
