"""What a gateway's own statements read of the key table, at start-up and every interval: a
bounded number of rows each, however many keys the table holds.

Read from the plans PostgreSQL executes (`EXPLAIN ANALYZE`, on Citus every shard's task): the
rows each scan of the key table (or of one of its shards) returned, never a time.

- At start-up `oncegate serve` says how many keys the store holds (contract section 2). A
  `count(*)` of the table read every row at every start; the count now stops at a cap and
  PostgreSQL's statistics say about how many lie beyond it.
- Every `key_count_interval` one gateway process per database sweeps the table page by page for
  the gauge `oncegate_keys{state}`: each statement one page. On Citus a page was the next rows
  by id through a LIMIT that Citus sends to every shard: each shard read, and sent the
  coordinator, a whole page of its own, so a sweep read the table once per shard (the coordinator
  sorting them: 0.35 s of its CPU for 10^5 keys in 4 shards, docs/operations.md). A page is now
  a range of ids, counted on each shard.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import asyncpg
import pytest

from oncegate import service
from oncegate.store.postgres import PostgresStore
from oncegate.store.queries import DIALECTS, Query
from tests.helpers import insert_completed_keys

pytestmark = pytest.mark.citus

PAGE = 1000
# Twenty pages; on the tests' Citus cluster (8 shards) about 2,500 rows a shard: enough that a
# page's range is read through the primary key, not a shard read whole as the cheapest way to
# find a few of its rows (which the planner rightly chooses for a shard of 75).
KEYS = 20_000
CAP = 10  # the start-up count's cap here (the gateway's: upkeep.HELD_KEYS_COUNTED)
ALIVE = "now() + interval '1 day'"


def scans(node: Any) -> Iterator[dict[str, Any]]:
    """Every scan of the key table or of one of its shards in a JSON plan, Citus's remote plans
    of each task included."""
    if isinstance(node, list):
        for each in node:
            yield from scans(each)
    elif isinstance(node, dict):
        relation = node.get("Relation Name", "")
        if relation.startswith("oncegate_keys") and node.get("Node Type", "").endswith("Scan"):
            yield node
        for value in node.values():
            yield from scans(value)


async def rows_read(db: asyncpg.Connection, query: Query, **values: object) -> int:
    """The rows the key table's scans returned or passed over (`Rows Removed by ...`) while
    `query` ran once with `values`."""
    plan = json.loads(
        await db.fetchval(f"EXPLAIN (ANALYZE, FORMAT JSON) {query.sql}", *query.arguments(values))
    )
    read = 0
    for scan in scans(plan):
        removed = sum(value for name, value in scan.items() if name.startswith("Rows Removed"))
        read += (scan["Actual Rows"] + removed) * scan["Actual Loops"]
    return read


async def shards(db: asyncpg.Connection, backend: str) -> int:
    """How many tables hold the key table's rows: its shards on Citus, itself on PostgreSQL."""
    if backend != "citus":
        return 1
    await db.execute("SET citus.explain_all_tasks = on")  # every shard's plan, not one
    count: int = await db.fetchval(
        "SELECT count(*) FROM pg_dist_shard WHERE logicalrelid = 'oncegate_keys'::regclass"
    )
    return count


def server(backend: str) -> str:
    return "citus" if backend == "citus" else "postgres"


@pytest.fixture
async def keys(db: asyncpg.Connection) -> int:
    """The module's key table emptied, then KEYS keys in it, analysed."""
    await db.execute("DELETE FROM oncegate_keys")
    await insert_completed_keys(db, KEYS, ALIVE, prefix="upkeep-")
    await db.execute("ANALYZE oncegate_keys")
    return KEYS


async def test_each_page_of_the_key_count_reads_at_most_a_page(
    db: asyncpg.Connection, store: PostgresStore, backend: str, keys: int
) -> None:
    # Ids a released or purged key left unused in the middle of the table: on Citus a page is
    # a range of ids, and one that holds fewer rows than a page is not the sweep's end.
    low = await db.fetchval("SELECT min(id) FROM oncegate_keys")
    gone = int(
        (await db.execute(
            "DELETE FROM oncegate_keys WHERE id > $1 AND id <= $1 + $2", low + 100, PAGE * 3
        )).split()[-1]
    )  # fmt: skip
    assert gone == PAGE * 3
    held = keys - gone
    count = DIALECTS[server(backend)]["count_keys"]
    # On Citus, besides the page, each shard's first id past the last page: one index entry.
    bound = PAGE + await shards(db, backend)

    after, pages, counted = 0, 0, 0
    while True:
        read = await rows_read(db, count, after=after, page_size=PAGE)
        assert read <= bound, f"page {pages + 1} read {read} rows (a page is {PAGE})"
        page = await store.upkeep.count_keys(after, PAGE)
        counted += page.rows
        pages += 1
        if page.last or page.last_id is None:
            break
        after = page.last_id
    assert counted == held
    assert pages <= held // PAGE + 5  # not a statement per few rows either

    totals = await service.count_keys(store.upkeep, page_size=PAGE, pause=0)
    assert totals == {"in_progress": 0, "completed": held, "unknown": 0}


async def test_the_start_up_count_of_keys_stops_at_its_cap(
    db: asyncpg.Connection, store: PostgresStore, backend: str, keys: int
) -> None:
    held_keys = DIALECTS[server(backend)]["held_keys"]
    # Each shard stops at the cap (Citus sends the LIMIT to every shard): never the table.
    read = await rows_read(db, held_keys, cap=CAP)
    assert read <= CAP * await shards(db, backend) < keys

    held = await store.upkeep.held_keys(CAP)
    assert (held.counted, held.exact) == (CAP, False)
    # Beyond the cap, the table's statistics (analysed whole: a table this small is sampled
    # entirely): the start-up line's "about".
    assert held.keys == keys
    assert str(held) == f"about {keys} (PostgreSQL's estimate; {CAP} or more counted)"

    await db.execute("DELETE FROM oncegate_keys WHERE key <> 'upkeep-1'")
    few = await store.upkeep.held_keys(CAP)
    assert (few.keys, few.exact, str(few)) == (1, True, "1")
