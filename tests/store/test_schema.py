"""migrations/schema.sql is the schema's functions as the migrations leave them at head."""

from __future__ import annotations

from pathlib import Path

import asyncpg

SCHEMA = Path(__file__).parents[2] / "migrations" / "schema.sql"

FUNCTIONS = """
SELECT p.proname || '(' || pg_get_function_identity_arguments(p.oid) || ')' AS signature,
       pg_get_functiondef(p.oid) AS definition
FROM pg_proc AS p JOIN pg_namespace AS n ON n.oid = p.pronamespace
WHERE n.nspname = 'public' AND p.proname LIKE 'oncegate\\_%'
ORDER BY 1
"""


async def functions(url: str) -> dict[str, str]:
    connection = await asyncpg.connect(url)
    try:
        return {row["signature"]: row["definition"] for row in await connection.fetch(FUNCTIONS)}
    finally:
        await connection.close()


async def test_schema_sql_defines_exactly_the_functions_the_migrations_leave(
    database_url: str, empty_database_url: str
) -> None:
    migrated = await functions(database_url)
    assert "oncegate_key_state(state text, lease_expires_at timestamp with time zone, " \
        "expires_at timestamp with time zone)" in migrated  # fmt: skip
    loaded = await asyncpg.connect(empty_database_url)
    try:
        await loaded.execute(SCHEMA.read_text())
    finally:
        await loaded.close()
    # Same signatures, same bodies byte for byte (pg_get_functiondef prints the header the
    # same way whatever its spelling; the body is kept as written).
    assert await functions(empty_database_url) == migrated


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
