"""Every migration goes up and comes back down, on a real PostgreSQL."""

from __future__ import annotations

import asyncio
import hashlib
import os
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import asyncpg
import pytest

from oncegate.kernel.sealing import plaintext
from oncegate.model.answers import StoredAnswer
from oncegate.model.records import Claim
from oncegate.store import citus, migrate
from oncegate.store.postgres import PostgresStore
from tests.helpers import KEY_TABLE_SCANS, digest, key_table_reads_since, new_key, stored
from tests.store.test_store import BAD_ROWS, refusals


async def _tables(url: str) -> set[str]:
    connection = await asyncpg.connect(url)
    try:
        rows = await connection.fetch("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
    finally:
        await connection.close()
    return {row["tablename"] for row in rows}


async def _upgrade(url: str, revision: str = "head") -> None:
    # Alembic's async environment runs its own event loop: keep it off this one.
    await asyncio.to_thread(migrate.upgrade, url, revision)


async def test_upgrade_downgrade_upgrade(empty_database_url: str) -> None:
    await _upgrade(empty_database_url)
    assert {"oncegate_keys", "alembic_version"} <= await _tables(empty_database_url)
    await _upgrade(empty_database_url)  # idempotent
    await asyncio.to_thread(migrate.downgrade, empty_database_url, "base")
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
        "import app, oncegate.agent, oncegate.store.migrate; print(app.WHO); "
        "print(oncegate.store.migrate.head())"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:2] == ["the user", migrate.head()]


# Keys in every state, written straight into a 0007 table: (key, state column, lease end,
# expiry) as SQL, and the state each must read after the upgrade.
ROWS_OF_EVERY_STATE = [
    ("in-flight", "in_progress", "now() + interval '1 minute'", "now() + interval '1 day'",
     "in_progress"),
    ("lease-ran-out", "in_progress", "now() - interval '1 minute'", "now() + interval '1 day'",
     "unknown"),
    ("answer-lost", "unknown", "NULL", "now() + interval '1 day'", "unknown"),
    ("answered", "completed", "NULL", "now() + interval '1 day'", "completed"),
    ("past-ttl", "completed", "NULL", "now() - interval '1 second'", "expired"),
    ("in-flight-past-ttl", "in_progress", "now() + interval '1 minute'",
     "now() - interval '1 second'", "in_progress"),
]  # fmt: skip


async def _write_rows_of_every_state(url: str) -> None:
    connection = await asyncpg.connect(url)
    try:
        for key, state, lease, expires, _ in ROWS_OF_EVERY_STATE:
            await connection.execute(
                "INSERT INTO oncegate_keys (route, scope, key, fingerprint, state, fencing_token,"
                " lease_expires_at, response_status, response_headers, response_body,"
                " response_stored, created_at, expires_at)"
                " VALUES ('r', sha256(convert_to($1, 'UTF8')), $1, sha256(''::bytea), $2, 3,"
                f"  {lease},"
                "  CASE WHEN $2 = 'completed' THEN 201 END,"
                "  CASE WHEN $2 = 'completed' THEN '[]'::jsonb END,"
                "  CASE WHEN $2 = 'completed' THEN 'receipt'::bytea END, $2 = 'completed',"
                f"  now() - interval '2 days', {expires})",
                key,
                state,
            )
    finally:
        await connection.close()


async def _states(url: str) -> dict[str, tuple[str, int, bytes | None]]:
    connection = await asyncpg.connect(url)
    try:
        rows = await connection.fetch(
            "SELECT key, oncegate_key_state(state, lease_expires_at, expires_at) AS state,"
            " fencing_token, response_body FROM oncegate_keys"
        )
    finally:
        await connection.close()
    return {row["key"]: (row["state"], row["fencing_token"], row["response_body"]) for row in rows}


async def _primary_key(url: str) -> str:
    connection = await asyncpg.connect(url)
    try:
        definition: str = await connection.fetchval(
            "SELECT pg_get_constraintdef(oid) FROM pg_constraint"
            " WHERE conrelid = 'oncegate_keys'::regclass AND contype = 'p'"
        )
    finally:
        await connection.close()
    return definition


async def test_an_upgrade_keeps_keys_of_every_state_and_adds_key_to_the_primary_key(
    empty_database_url: str,
) -> None:
    await _upgrade(empty_database_url, "0007")
    await _write_rows_of_every_state(empty_database_url)
    before = await _states(empty_database_url)
    assert await _primary_key(empty_database_url) == "PRIMARY KEY (id)"
    await _upgrade(empty_database_url)
    assert await _primary_key(empty_database_url) == "PRIMARY KEY (id, key)"
    after = await _states(empty_database_url)
    assert after == before
    assert {key: state for key, (state, _, _) in after.items()} == {
        key: expected for key, *_, expected in ROWS_OF_EVERY_STATE
    }
    # And the store works on the upgraded table: the old rows as they were, new keys claimed.
    store = await PostgresStore.connect(empty_database_url)
    try:
        answered = await store.requests.get(hashlib.sha256(b"answered").digest(), "answered")
        assert answered is not None and answered.state == "completed"
        assert stored(answered).body == b"receipt"
        claimed = await store.requests.claim(
            "r", hashlib.sha256(b"s").digest(), "new", bytes(32), 60, 600
        )
        assert isinstance(claimed, Claim)
        assert await store.requests.release(claimed)
    finally:
        await store.close()
    await asyncio.to_thread(migrate.downgrade, empty_database_url, "0007")
    assert await _primary_key(empty_database_url) == "PRIMARY KEY (id)"
    assert await _states(empty_database_url) == before


async def test_the_state_rule_reads_as_it_did_before_it_was_written_as_a_condition(
    database_url: str,
) -> None:
    # Migration 0008 rewrote `oncegate_key_state` on top of `oncegate_key_is`: every state
    # column, with or without a lease, before or after it and the TTL, reads as before.
    connection = await asyncpg.connect(database_url)
    try:
        differing = await connection.fetch(
            """
            WITH cases AS (
                SELECT state, now() + lease AS lease_expires_at, now() + ttl AS expires_at
                FROM unnest(ARRAY['in_progress', 'completed', 'unknown']) AS state,
                     unnest(ARRAY[NULL, interval '-1 minute', interval '0', interval '1 minute'])
                         AS lease,
                     unnest(ARRAY[interval '-1 minute', interval '0', interval '1 minute'])
                         AS ttl
            )
            SELECT *, oncegate_key_state(state, lease_expires_at, expires_at) AS now_reads
            FROM cases
            WHERE oncegate_key_state(state, lease_expires_at, expires_at) IS DISTINCT FROM
                CASE
                    WHEN state = 'in_progress' AND lease_expires_at > now() THEN 'in_progress'
                    WHEN expires_at <= now() THEN 'expired'
                    WHEN state = 'in_progress' THEN 'unknown'
                    ELSE state
                END
               OR NOT oncegate_key_is(oncegate_key_state(state, lease_expires_at, expires_at),
                                      state, lease_expires_at, expires_at, now())
            """
        )
    finally:
        await connection.close()
    assert differing == []


def test_the_head_a_gateway_needs_is_alembic_s_head() -> None:
    # `migrate.head` reads the scripts' own lines, so a start need not import Alembic: it must
    # name the revision Alembic would migrate to.
    from alembic.config import Config
    from alembic.script import ScriptDirectory

    config = Config()
    config.set_main_option("script_location", str(migrate.LOCATION))
    assert migrate.head() == ScriptDirectory.from_config(config).get_current_head()


def test_the_shard_count_migrate_chooses_is_the_one_the_store_recommends() -> None:
    # Migration 0008 writes its own copy of the recommendation (a migration does what it did
    # when written); a gateway warns above the store's. The two must not drift apart silently.
    import ast

    script = migrate.LOCATION / "versions" / "0008_distributable.py"
    assigned = {
        target.id: node.value
        for node in ast.parse(script.read_text()).body
        if isinstance(node, ast.Assign)
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    written = assigned["SHARDS_PER_WORKER"]
    assert isinstance(written, ast.Constant)
    assert written.value == citus.SHARDS_PER_WORKER


def _script(directory: Path, revision: str, down: str | None) -> None:
    down_text = "None" if down is None else f'"{down}"'
    (directory / f"{revision}_change.py").write_text(
        f'"""A change."""\n\nrevision = "{revision}"\ndown_revision = {down_text}\n'
        "branch_labels = None\n"
    )


def test_the_head_is_refused_when_the_scripts_are_not_one_line(tmp_path: Path) -> None:
    _script(tmp_path, "0001", None)
    _script(tmp_path, "0002", "0001")
    (tmp_path / "README").write_text("not a script")
    assert migrate.head_of(tmp_path.iterdir()) == "0002"
    _script(tmp_path, "0003", "0001")  # a branch: two heads
    with pytest.raises(RuntimeError, match=r"not one line of revisions \(heads \['0002', '0003'\]"):
        migrate.head_of(tmp_path.iterdir())
    (tmp_path / "0003_change.py").write_text(
        'revision = "0003"\ndown_revision = ("0001", "0002")\n'  # a merge
    )
    with pytest.raises(RuntimeError, match=r"migration 0003_change\.py: no single"):
        migrate.head_of(tmp_path.iterdir())


async def _files(url: str) -> dict[str, int]:
    """The key table's and its indexes' files: a rewrite gives them new ones."""
    connection = await asyncpg.connect(url)
    try:
        rows = await connection.fetch(
            "SELECT c.relname, pg_relation_filenode(c.oid) AS file FROM pg_class AS c"
            " WHERE c.oid = 'oncegate_keys'::regclass OR c.oid IN"
            "  (SELECT indexrelid FROM pg_index WHERE indrelid = 'oncegate_keys'::regclass)"
        )
    finally:
        await connection.close()
    return {row["relname"]: row["file"] for row in rows}


async def test_the_column_domains_come_and_go_without_rewriting_the_key_table(
    empty_database_url: str,
) -> None:
    await _upgrade(empty_database_url, "0012")
    await _write_rows_of_every_state(empty_database_url)
    before, files = await _states(empty_database_url), await _files(empty_database_url)
    assert len(files) == 4  # the table, its primary key, (scope, key) and expires_at
    await _upgrade(empty_database_url, "0013")
    assert await _files(empty_database_url) == files
    assert await _states(empty_database_url) == before
    connection = await asyncpg.connect(empty_database_url)
    try:
        assert await refusals(connection) == [("23514", constraint) for _, constraint in BAD_ROWS]
    finally:
        await connection.close()
    await asyncio.to_thread(migrate.downgrade, empty_database_url, "0012")
    assert await _files(empty_database_url) == files
    assert await _states(empty_database_url) == before


async def _reads_of_the_key_table(url: str, change: Callable[[], Awaitable[None]]) -> int:
    """How many times `change` read the key table from end to end (pg_stat_user_tables.seq_scan)."""
    connection = await asyncpg.connect(url)
    try:
        before = await connection.fetchval(KEY_TABLE_SCANS)
        await change()
        return await key_table_reads_since(connection, before)
    finally:
        await connection.close()


async def test_the_column_domains_read_the_key_table_five_times_up_and_once_down(
    empty_database_url: str,
) -> None:
    # One ALTER TABLE for the five columns (the checks across columns validated again, once),
    # then one read per domain's constraint. Five ALTER TABLE statements read it nine times.
    await _upgrade(empty_database_url, "0012")
    await _write_rows_of_every_state(empty_database_url)
    up = await _reads_of_the_key_table(
        empty_database_url, lambda: _upgrade(empty_database_url, "0013")
    )
    down = await _reads_of_the_key_table(
        empty_database_url,
        lambda: asyncio.to_thread(migrate.downgrade, empty_database_url, "0012"),
    )
    assert (up, down) == (5, 1)


async def test_a_gateway_left_running_through_the_column_domains_keeps_working(
    empty_database_url: str,
) -> None:
    # A 0012 gateway's pools and prepared statements, across `migrate` to 0013 (the result types
    # of some statements change: asyncpg prepares them again and sends them again, each
    # statement autocommitting) and back.
    await _upgrade(empty_database_url, "0012")
    store = await PostgresStore.connect(empty_database_url)
    scope = digest("across the migration")
    kept: list[str] = []

    async def forward() -> None:
        key = new_key()
        claim = await store.requests.claim("r", scope, key, digest("f"), 60.0, 3600.0)
        assert isinstance(claim, Claim)
        assert await store.requests.complete(claim, StoredAnswer(201, plaintext([], b"kept")))
        record = await store.requests.get(scope, key)
        assert record is not None and record.state == "completed"
        kept.append(key)

    try:
        for step in range(3):
            for _ in range(3):
                await forward()
            if step == 0:
                await _upgrade(empty_database_url, "0013")
            elif step == 1:
                await asyncio.to_thread(migrate.downgrade, empty_database_url, "0012")
        for key in kept:
            replay = await store.requests.claim("r", scope, key, digest("f"), 60.0, 3600.0)
            assert not isinstance(replay, Claim) and replay is not None
            assert replay.state == "completed"
            assert stored(replay).body == b"kept"
    finally:
        await store.close()
