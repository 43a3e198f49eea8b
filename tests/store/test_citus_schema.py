"""`oncegate migrate` on a real Citus cluster (tests/citus.py): the key table distributed by
`key`, the claim function beside its shards, and an existing database's keys kept."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Iterator
from urllib.parse import urlsplit

import asyncpg
import pytest

from oncegate.model import errors
from oncegate.store import migrate
from tests import citus
from tests.store.test_migrations import ROWS_OF_EVERY_STATE, _states, _write_rows_of_every_state
from tests.store.test_store import BAD_ROWS, refusals


@pytest.fixture
def citus_database(citus_cluster: citus.Cluster, request: pytest.FixtureRequest) -> Iterator[str]:
    """An empty Citus database (the extension on every node, the workers added)."""
    name = f"oncegate_citus_{os.getpid()}_{request.node.name[-30:].lower()}"
    url = citus_cluster.create_database(name)
    yield url
    citus_cluster.drop_database(name)


async def _fetch(url: str, query: str) -> list[asyncpg.Record]:
    connection = await asyncpg.connect(url)
    try:
        rows: list[asyncpg.Record] = await connection.fetch(query)
    finally:
        await connection.close()
    return rows


def test_migrate_distributes_the_key_table_by_key_and_says_over_what(citus_database: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "oncegate.cli", "migrate"],
        env={**os.environ, "ONCEGATE_DATABASE_URL": citus_database},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == (
        f"oncegate_keys is distributed by key over {citus.WORKERS} Citus workers"
        f" in {citus.SHARD_COUNT} shards"
    )
    tables = asyncio.run(
        _fetch(
            citus_database,
            "SELECT table_name::text AS name, distribution_column, colocation_id, shard_count"
            " FROM citus_tables ORDER BY 1",
        )
    )
    assert [(row["name"], row["distribution_column"]) for row in tables] == [
        ("oncegate_checkpoints", "run_id"),
        ("oncegate_keys", "key"),
    ]
    # Nothing joins the agent's checkpoints with the keys: a colocation group of their own.
    assert tables[0]["colocation_id"] != tables[1]["colocation_id"]
    functions = asyncio.run(
        _fetch(
            citus_database,
            "SELECT objid::regprocedure::text AS function, distribution_argument_index,"
            " colocationid FROM pg_dist_object WHERE classid = 'pg_proc'::regclass ORDER BY 1",
        )
    )
    by_name = {row["function"].split("(")[0]: row for row in functions}
    assert {"oncegate_claim", "oncegate_key_is", "oncegate_key_state", "oncegate_after"} <= set(
        by_name
    )
    # The claim runs on the worker of its first argument's shard, beside the key table's rows.
    assert by_name["oncegate_claim"]["distribution_argument_index"] == 0
    assert by_name["oncegate_claim"]["colocationid"] == tables[1]["colocation_id"]
    # Run again: nothing to do, the same answer.
    again = subprocess.run(
        [sys.executable, "-m", "oncegate.cli", "migrate"],
        env={**os.environ, "ONCEGATE_DATABASE_URL": citus_database},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert again.returncode == 0 and again.stdout == result.stdout


async def test_a_database_that_gained_citus_is_distributed_with_its_keys(
    citus_database: str,
) -> None:
    # Migrated before Citus mattered (its tables are plain ones on the coordinator), with keys.
    await asyncio.to_thread(migrate.upgrade, citus_database, "0007")
    await _write_rows_of_every_state(citus_database)
    before = await _states(citus_database)
    await asyncio.to_thread(migrate.upgrade, citus_database)
    assert await _states(citus_database) == before
    assert {key: state for key, (state, _, _) in before.items()} == {
        key: expected for key, *_, expected in ROWS_OF_EVERY_STATE
    }
    # The rows now live in the shards, on the workers.
    shards = await _fetch(
        citus_database,
        "SELECT result::int AS rows, nodeport FROM run_command_on_shards("
        "  'oncegate_keys', 'SELECT count(*) FROM %s') AS counted"
        " JOIN citus_shards USING (shardid)",
    )
    assert sum(shard["rows"] for shard in shards) == len(ROWS_OF_EVERY_STATE)
    assert len({shard["nodeport"] for shard in shards}) == citus.WORKERS
    with pytest.raises(RuntimeError, match="cannot downgrade below revision 0008 on Citus"):
        await asyncio.to_thread(migrate.downgrade, citus_database, "0007")


# The key table's columns that migration 0013 gives a domain each, with it.
DOMAIN_COLUMNS = {
    "route": "oncegate_route",
    "scope": "oncegate_sha256",
    "fingerprint": "oncegate_sha256",
    "state": "oncegate_state",
    "response_status": "oncegate_status",
}


async def _shard_column_types(url: str) -> dict[str, set[str]]:
    """Each of DOMAIN_COLUMNS with the types it has in the key table's shards, on the workers."""
    rows = await _fetch(
        url,
        "SELECT result FROM run_command_on_shards('oncegate_keys', $$SELECT string_agg("
        "  attname || ':' || format_type(atttypid, atttypmod), ',') FROM pg_attribute"
        "  WHERE attrelid = '%s'::regclass AND attnum > 0$$)",
    )
    types: dict[str, set[str]] = {}
    for row in rows:
        for pair in row["result"].split(","):
            column, type_ = pair.split(":")
            if column in DOMAIN_COLUMNS:
                types.setdefault(column, set()).add(type_)
    return types


async def _refusals_on_the_cluster(url: str) -> list[list[tuple[str, str]]]:
    """BAD_ROWS sent through the coordinator, and straight into a shard table on its worker, as
    the store writes: what each refusal says."""
    shard = (
        await _fetch(
            url,
            "SELECT shard_name, nodeport FROM citus_shards"
            " WHERE table_name = 'oncegate_keys'::regclass ORDER BY shardid LIMIT 1",
        )
    )[0]
    parts = urlsplit(url)
    worker = parts._replace(netloc=f"{parts.username}@{parts.hostname}:{shard['nodeport']}")
    found = []
    for target, table in ((url, "oncegate_keys"), (worker.geturl(), shard["shard_name"])):
        connection = await asyncpg.connect(target)
        try:
            found.append(await refusals(connection, table, shard=table != "oncegate_keys"))
        finally:
            await connection.close()
    return found


async def _shard_constraints(url: str) -> list[tuple[int, str]]:
    """Every shard's constraints: names and definitions, by shard."""
    rows = await _fetch(
        url,
        "SELECT shardid, result FROM run_command_on_shards('oncegate_keys', $$"
        " SELECT string_agg(conname || ' ' || pg_get_constraintdef(oid), ' | ' ORDER BY conname)"
        " FROM pg_constraint WHERE conrelid = '%s'::regclass$$) ORDER BY shardid",
    )
    return [(row["shardid"], row["result"]) for row in rows]


async def test_migrate_gives_an_existing_clusters_shards_their_column_domains(
    citus_database: str,
) -> None:
    # A cluster distributed before the domains, holding keys.
    await asyncio.to_thread(migrate.upgrade, citus_database, "0012")
    await _write_rows_of_every_state(citus_database)
    before = await _states(citus_database)
    checks = await _refusals_on_the_cluster(citus_database)
    constraints = await _shard_constraints(citus_database)
    base = {column: {type_} for column, type_ in (
        ("route", "text"), ("scope", "bytea"), ("fingerprint", "bytea"), ("state", "text"),
        ("response_status", "smallint"),
    )}  # fmt: skip
    assert await _shard_column_types(citus_database) == base
    await asyncio.to_thread(migrate.upgrade, citus_database)
    assert await _states(citus_database) == before
    # Every shard's columns are of the domains now, on every worker.
    assert await _shard_column_types(citus_database) == {
        column: {domain} for column, domain in DOMAIN_COLUMNS.items()
    }
    # A bad value is refused through the coordinator and on a worker's shard as on one server.
    plain = [("23514", constraint) for _, constraint in BAD_ROWS]
    assert await _refusals_on_the_cluster(citus_database) == [plain, plain]
    # Before, the same rows were refused by the same kind of error, each by a table check of
    # its own (named after the shard table on the worker).
    assert [[sqlstate for sqlstate, _ in found] for found in checks] == [["23514"] * len(plain)] * 2
    # Down and up again: the table checks come back, then the domains.
    await asyncio.to_thread(migrate.downgrade, citus_database, "0012")
    assert await _shard_column_types(citus_database) == base
    # The same checks under the same names, on the coordinator and on every shard.
    assert await _refusals_on_the_cluster(citus_database) == checks
    assert await _shard_constraints(citus_database) == constraints
    await asyncio.to_thread(migrate.upgrade, citus_database)
    assert await _states(citus_database) == before
    assert await _refusals_on_the_cluster(citus_database) == [plain, plain]


async def test_migrate_on_citus_without_workers_says_to_add_them(
    citus_cluster: citus.Cluster,
) -> None:
    name = f"oncegate_citus_{os.getpid()}_no_workers"
    connection = await asyncpg.connect(citus_cluster.url())
    try:
        await connection.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        await connection.execute(f"CREATE DATABASE {name}")
    finally:
        await connection.close()
    url = citus_cluster.url(name)
    connection = await asyncpg.connect(url)
    try:
        await connection.execute("CREATE EXTENSION citus")
    finally:
        await connection.close()
    try:
        # Refused before any migration runs: one sentence from `oncegate migrate` (exit 2).
        with pytest.raises(errors.ConfigError, match=r"no worker to put shards on.*citus_add_node"):
            await asyncio.to_thread(migrate.upgrade, url)
        assert await _fetch(url, "SELECT to_regclass('alembic_version') AS t") == [(None,)]
    finally:
        connection = await asyncpg.connect(citus_cluster.url())
        try:
            await connection.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        finally:
            await connection.close()


def _migrate(url: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "oncegate.cli", "migrate"],
        env={**os.environ, "ONCEGATE_DATABASE_URL": url},
        capture_output=True,
        text=True,
        timeout=120,
    )


async def _set_shard_count(url: str, setting: str) -> None:
    """`ALTER DATABASE <url's> <setting>` on the coordinator, as an operator would."""
    connection = await asyncpg.connect(url)
    try:
        name = await connection.fetchval("SELECT current_database()")
        await connection.execute(f"ALTER DATABASE {name} {setting}")
    finally:
        await connection.close()


def test_migrate_chooses_two_shards_per_worker_where_the_shard_count_was_left_at_its_default(
    citus_database: str,
) -> None:
    asyncio.run(_set_shard_count(citus_database, "RESET citus.shard_count"))  # Citus's 32
    result = _migrate(citus_database)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == (
        f"oncegate_keys is distributed by key over {citus.WORKERS} Citus workers"
        f" in {2 * citus.WORKERS} shards"
    )
    held = asyncio.run(
        _fetch(
            citus_database,
            "SELECT nodeport, count(*) AS shards FROM citus_shards"
            " WHERE table_name = 'oncegate_keys'::regclass GROUP BY nodeport",
        )
    )
    assert sorted(row["shards"] for row in held) == [2] * citus.WORKERS
    assert "more than the 2 oncegate recommends" not in result.stderr


def test_migrate_honours_a_shard_count_the_operator_set_and_warns_of_its_cost(
    citus_database: str,
) -> None:
    asyncio.run(_set_shard_count(citus_database, "SET citus.shard_count = 6"))
    result = _migrate(citus_database)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1].endswith(" in 6 shards")
    # Three a worker: the operator's choice stands, and is named with its cost and remedy.
    [warning] = [line for line in result.stderr.splitlines() if "oncegate recommends" in line]
    assert "a Citus worker holds 3 shards of oncegate_keys, more than the 2" in warning
    assert "add workers (citus_add_node, then citus_rebalance_start)" in warning
    assert "leave citus.shard_count at Citus's default before `oncegate migrate`" in warning


def test_migrate_refuses_a_shard_replication_factor_above_one_saying_why_and_what_to_do(
    citus_database: str,
) -> None:
    """`citus.shard_replication_factor = 2` would put each shard on two workers, and the gateway
    writes a key's claim to one of them only: refused before anything is changed, in one
    sentence naming the setting and the fix, not with Citus's own error from the middle of
    revision 0008 ("cannot colocate function ...", a traceback). Set back, it migrates."""
    asyncio.run(_set_shard_count(citus_database, "SET citus.shard_replication_factor = 2"))
    refused = _migrate(citus_database)
    assert refused.returncode == 2, refused.stderr
    assert "Traceback" not in refused.stderr and refused.stdout == "", refused.stderr
    [said] = refused.stderr.splitlines()
    assert said.startswith("oncegate: citus.shard_replication_factor is 2 for database "), said
    assert "RESET citus.shard_replication_factor" in said and "migrate again" in said, said
    assert asyncio.run(_fetch(citus_database, "SELECT to_regclass('alembic_version') AS t")) == [
        (None,)
    ]
    asyncio.run(_set_shard_count(citus_database, "RESET citus.shard_replication_factor"))
    migrated = _migrate(citus_database)
    assert migrated.returncode == 0, migrated.stderr
    assert migrated.stdout.splitlines()[-1].startswith("oncegate_keys is distributed by key")
