"""The request path finds its rows through the key table's indexes, whatever size the table had
when a connection planned its statements.

The request pools plan each statement once per connection (a generic plan,
`store.postgres.connections`). A plan made while the table is empty and never analysed, as on
a new deployment, believed it tiny: a seq scan hashed against the batch, for the claim's read
of existing rows, the complete, the release, the marks and the take-overs. Kept while the table
grew, such a plan read every row of the table on every statement until autovacuum's first
ANALYZE of it made the connections plan again (a minute or more): measured in the first `make
bench` round, a forward cost PostgreSQL 0.24 ms of CPU instead of 0.06, and a mixed load 0.84 ms.

The test plans every request-path statement on an empty table, grows the table as a busy gateway
does, with autovacuum off for it (its ANALYZE would make the connections plan again), and reads
the plans each of the store's connections now holds: every read of the key table must be a
lookup by an index condition on the index's first column, neither a seq scan nor an index walked
whole (a condition on the primary key's second column alone, `key`, reads all of it).

Nor may a plan compare each row of the key table it reads with every row of the batch (a nested
loop whose inner side is the batch's `unnest`): a filter `id = ANY(:ids)` beside the join made
PostgreSQL plan the settles so once the table was analysed, work that grows with the square of
the batch (64 completes, 4,032 comparisons). The plans are read again as made on an analysed
table, and a batch of 64 completes, the most one statement carries, is run on one."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import asyncpg

from oncegate.kernel.sealing import plaintext
from oncegate.model.answers import StoredAnswer
from oncegate.model.records import Claim, Record
from oncegate.settings import StoreOptions
from oncegate.store.postgres import PostgresStore
from oncegate.store.postgres.connections import request_settings
from oncegate.store.queries import DIALECTS
from tests.helpers import digest, insert_completed_keys, new_key

ROUTE = "plans"
SCOPE = digest("plans scope")
LONG = 600.0  # a lease or TTL that cannot run out during the test
SHORT = 0.05  # a TTL that has run out by the time the test reclaims the key
GROWN = 20_000  # rows: a scan of them costs many times a batch's index lookups
# The request path's statements (queries.sql), by a fragment of each: every one must have been
# planned for the test to mean anything.
STATEMENTS = {
    "claim": "INSERT INTO oncegate_keys",
    "get": "FROM oncegate_keys\nWHERE scope",
    "reclaim_expired": "completed_at = NULL",
    "take_over": "greatest(k.expires_at",
    "complete": "SET state = 'completed'",
    "release": "DELETE FROM oncegate_keys",
    "mark_unknown": "SET state = 'unknown'",
    "mark_waited": "SET waited = true",
}
LOOKUPS = frozenset({"Index Scan", "Index Only Scan"})


async def claimed(store: PostgresStore, ttl: float = LONG) -> Claim:
    claim = await store.requests.claim(ROUTE, SCOPE, new_key(), digest("body"), LONG, ttl)
    assert isinstance(claim, Claim)
    return claim


async def row(store: PostgresStore, key: str) -> Record:
    found = await store.requests.get(SCOPE, key)
    assert isinstance(found, Record)
    return found


def whole_table_reads(node: dict[str, Any], leading: dict[str, str]) -> list[str]:
    """The plan's reads of the key table that are not a lookup by index condition: a seq scan,
    or an index walked from end to end (what a hash or merge join over the table would do, or a
    condition on an index's later column alone). `leading`: each index's first column."""
    found = []
    kind = node.get("Node Type", "")
    if node.get("Relation Name") == "oncegate_keys" and kind.endswith("Scan"):
        if kind == "Bitmap Heap Scan":
            looked_up = all(
                looks_up(child, leading)
                for child in node.get("Plans", [])
                if child.get("Node Type") == "Bitmap Index Scan"
            ) and bool(node.get("Plans"))
        else:
            looked_up = kind in LOOKUPS and looks_up(node, leading)
        if not looked_up:
            found.append(f"{kind} on {node.get('Alias')} ({node.get('Index Name', '')})")
    for child in node.get("Plans", []):
        found += whole_table_reads(child, leading)
    return found


def batch_rescans(node: dict[str, Any]) -> list[str]:
    """The plan's joins that read the batch again for every row of the other side: a nested
    loop whose inner side is a function scan (the batch's `unnest`), work of the batch's size
    squared. A nested loop over the batch with an index lookup inside is the right plan."""
    found = []
    children = node.get("Plans", [])
    if node.get("Node Type") == "Nested Loop" and len(children) == 2:
        inner = children[1]
        while inner.get("Node Type") == "Materialize" and inner.get("Plans"):
            inner = inner["Plans"][0]
        if inner.get("Node Type") == "Function Scan":
            found.append(f"Nested Loop over {children[0].get('Alias')}: {inner.get('Alias')}")
    for child in children:
        found += batch_rescans(child)
    return found


def looks_up(scan: dict[str, Any], leading: dict[str, str]) -> bool:
    """An index scan whose condition names the index's first column: it descends to the rows.
    A column of a domain type (`scope`, migration 0013) is compared as its base type:
    `((scope)::bytea = $1)`."""
    condition = scan.get("Index Cond", "")
    column = leading.get(scan.get("Index Name", ""), "")
    named = re.search(rf"\((?:\({column}\)::\w+|{column}) = ", condition)
    return bool(column) and named is not None


async def first_columns(connection: asyncpg.Connection) -> dict[str, str]:
    """Each index of the key table by name, with its first column."""
    rows = await connection.fetch(
        "SELECT i.indexrelid::regclass::text AS name, a.attname AS column "
        "FROM pg_index AS i JOIN pg_attribute AS a "
        "ON a.attrelid = i.indrelid AND a.attnum = i.indkey[0] "
        "WHERE i.indrelid = 'oncegate_keys'::regclass"
    )
    return {row["name"]: row["column"] for row in rows}


async def held_plans(connection: asyncpg.Connection) -> list[tuple[str, list[str]]]:
    """Each statement this connection has prepared, with the reads of the whole key table and
    the rescans of the batch in the plan it would run now (EXPLAIN EXECUTE shows the cached
    generic plan)."""
    plans = []
    prepared = await connection.fetch(
        "SELECT name, statement, cardinality(parameter_types) AS arguments "
        "FROM pg_prepared_statements"
    )
    leading = await first_columns(connection)  # after the list: it prepares a statement too
    for statement in prepared:
        if "oncegate_keys" not in statement["statement"]:
            continue  # the driver's own look-ups of types
        nulls = ", ".join(["NULL"] * statement["arguments"])
        explained = await connection.fetchval(
            f'EXPLAIN (FORMAT JSON) EXECUTE "{statement["name"]}"({nulls})'
        )
        plan = json.loads(explained)[0]["Plan"]
        plans.append(
            (statement["statement"], whole_table_reads(plan, leading) + batch_rescans(plan))
        )
    return plans


async def plan_every_statement(store: PostgresStore) -> None:
    """Each request-path statement run once on the store's connections (one per pool), so that
    each connection holds its plan."""
    completed = await claimed(store)
    assert await store.requests.complete(completed, StoredAnswer(201, plaintext([], b"{}")))
    assert await store.requests.release(await claimed(store))
    lost = await claimed(store)
    assert await store.requests.mark_unknown(lost)
    taken = await store.requests.take_over(await row(store, lost.key), LONG)
    assert taken is not None
    assert await store.requests.mark_unknown(taken)
    assert await store.requests.mark_waited(await row(store, (await claimed(store)).key))
    expiring = await claimed(store, ttl=SHORT)
    assert await store.requests.complete(expiring, StoredAnswer(201, plaintext([], b"{}")))
    await asyncio.sleep(2 * SHORT)
    expired = await row(store, expiring.key)
    assert expired.state == "expired"
    assert (
        await store.requests.reclaim_expired(expired, ROUTE, digest("body"), LONG, LONG) is not None
    )
    # The claim's read of a row that holds the key.
    assert isinstance(
        await store.requests.claim(ROUTE, SCOPE, completed.key, digest("body"), LONG, LONG),
        Record,
    )


async def misplanned(store: PostgresStore) -> dict[str, list[list[str]]]:
    """By statement, what is wrong in the plans the store's connections hold now: a gateway's."""
    plans: list[tuple[str, list[str]]] = []
    for pool in (store._pools.requests, store._pools.answers):
        async with pool.acquire() as connection:
            plans += await held_plans(connection)
    wrong = {}
    for name, fragment in STATEMENTS.items():
        held = [found for sql, found in plans if fragment in sql]
        assert held, f"{name} was not planned on the store's connections"
        if any(held):
            wrong[name] = held
    return wrong


async def test_plans_made_on_an_empty_table_still_use_the_indexes_when_it_has_grown(
    database_url: str, db: asyncpg.Connection
) -> None:
    assert await db.fetchval("SELECT count(*) FROM oncegate_keys") == 0
    await db.execute("ALTER TABLE oncegate_keys SET (autovacuum_enabled = off)")
    # One connection per pool: every statement is planned on the connection looked at below.
    store = await PostgresStore.connect(database_url, StoreOptions(pool_size=1))
    try:
        await plan_every_statement(store)
        await insert_completed_keys(db, GROWN, "now() + interval '1 hour'", prefix="grown-")
        assert await misplanned(store) == {}, "plans that read too much, by statement"
        # And the table did grow past what the plans were made for: the test measured something.
        assert await db.fetchval("SELECT count(*) FROM oncegate_keys") > GROWN
    finally:
        await store.close()


async def test_plans_made_on_an_analysed_table_look_each_row_of_a_batch_up(
    database_url: str, db: asyncpg.Connection
) -> None:
    # A table of real size that autovacuum has analysed: the state of every table in production.
    await insert_completed_keys(db, GROWN, "now() + interval '1 hour'", prefix="analysed-")
    await db.execute("ANALYZE oncegate_keys")
    store = await PostgresStore.connect(database_url, StoreOptions(pool_size=1))
    try:
        await plan_every_statement(store)
        assert await misplanned(store) == {}, "plans that read too much, by statement"
    finally:
        await store.close()


async def test_a_batch_of_completes_on_an_analysed_table_finds_each_row_once(
    database_url: str, db: asyncpg.Connection
) -> None:
    batch = 64  # the most completes one statement carries (store_batch_size)
    await db.execute(
        "INSERT INTO oncegate_keys (route, scope, key, fingerprint, state, fencing_token,"
        " lease_expires_at, expires_at) SELECT $1, $2, 'q-' || n, $2, 'in_progress', 1,"
        " now() + interval '1 hour', now() + interval '1 day' FROM generate_series(1, $3::int) n",
        ROUTE, SCOPE, GROWN,
    )  # fmt: skip
    await db.execute("ANALYZE oncegate_keys")
    rows = await db.fetch(
        "SELECT id, key, fencing_token FROM oncegate_keys WHERE key LIKE 'q-%' ORDER BY id"
        " LIMIT $1",
        batch,
    )
    complete = DIALECTS["postgres"]["complete"]
    arguments = complete.arguments(
        {
            "keys": [each["key"] for each in rows], "ids": [each["id"] for each in rows],
            "tokens": [each["fencing_token"] for each in rows], "statuses": [201] * batch,
            "headers": ["[]"] * batch, "bodies": [b"{}"] * batch, "stored": [True] * batch,
            "sealed_with": [None] * batch, "sealed_headers": [None] * batch,
        }
    )  # fmt: skip
    # A connection set as the request pools are: one generic plan, as each of theirs.
    connection = await asyncpg.connect(database_url, server_settings=request_settings(False))
    try:
        explain = await connection.prepare(f"EXPLAIN (ANALYZE, FORMAT JSON) {complete.sql}")
        transaction = connection.transaction()
        await transaction.start()
        try:
            plan = json.loads(await explain.fetchval(*arguments))[0]["Plan"]
        finally:
            await transaction.rollback()  # the rows as they were
    finally:
        await connection.close()
    assert plan["Actual Rows"] == batch  # every complete settled its row
    # Each complete looked its row up; none was compared with the other completes' rows.
    assert compared(plan) == 0


def compared(node: dict[str, Any]) -> int:
    """Rows a plan read and threw away in its joins."""
    own = int(node.get("Rows Removed by Join Filter", 0))
    return own + sum(compared(child) for child in node.get("Plans", []))
