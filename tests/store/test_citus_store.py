"""The request path on a real Citus cluster: each statement reaches one shard.

What Citus chose is read from Citus itself: `EXPLAIN` of every request-path statement (one
task, on one worker: the router executor; the claim function pushed down to its worker), and
its per-database counters of single- and multi-shard executions under a burst of concurrent
requests whose keys span every shard (batched per shard: no multi-shard statement at all).
The store's sessions read the catalog without Citus's shard hiding (its cost, not its answer).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import uuid
from collections.abc import AsyncIterator

import asyncpg
import pytest
from asyncpg.transaction import Transaction

from oncegate import settings
from oncegate.kernel import fingerprint, keys
from oncegate.kernel.sealing import plaintext
from oncegate.model import errors
from oncegate.model.answers import StoredAnswer
from oncegate.model.records import Claim
from oncegate.service import Gateway, ProxyRequest
from oncegate.settings import StoreOptions
from oncegate.store import citus as citus_store
from oncegate.store.citus import ShardMap, hash_text
from oncegate.store.postgres import PostgresStore
from oncegate.store.postgres.connections import request_settings
from oncegate.store.postgres.dialect import Plain
from oncegate.store.queries import DIALECTS
from oncegate.telemetry import metrics
from tests import citus
from tests.fake_upstream import FakeUpstream

pytestmark = pytest.mark.usefixtures("citus_cluster")

SCOPE = hashlib.sha256(b"citus scope").digest()
FINGERPRINT = hashlib.sha256(b"the request").digest()


@pytest.fixture(scope="module")
def backend() -> str:
    return "citus"


@pytest.fixture
async def coordinator(database_url: str) -> AsyncIterator[asyncpg.Connection]:
    """A coordinator session set as the gateway's request pools set theirs."""
    connection = await asyncpg.connect(
        database_url, server_settings=request_settings(on_citus=True)
    )
    try:
        yield connection
    finally:
        await connection.close()


async def test_the_gateway_places_keys_by_the_same_hash_as_citus(
    coordinator: asyncpg.Connection,
) -> None:
    keys = ["", "a", "é", "key with spaces", "x" * 255] + [str(uuid.uuid4()) for _ in range(500)]
    rows = await coordinator.fetch(
        "SELECT key, hashtext(key) AS hash,"
        " get_shard_id_for_distribution_column('oncegate_keys', key) AS shard"
        " FROM unnest($1::text[]) AS key",
        keys,
    )
    assert [hash_text(row["key"]) for row in rows] == [row["hash"] for row in rows]
    shards = await ShardMap.load(_Pool(coordinator))  # type: ignore[arg-type]
    try:
        assert [shards.shard_of(row["key"]) for row in rows] == [row["shard"] for row in rows]
    finally:
        await shards.close()


class _Pool:
    """What ShardMap reads through: a connection will do."""

    def __init__(self, connection: asyncpg.Connection) -> None:
        self.fetch = connection.fetch


def keys_of_one_shard(shards: ShardMap, count: int) -> list[str]:
    first = str(uuid.uuid4())
    found = [first]
    while len(found) < count:
        key = str(uuid.uuid4())
        if shards.shard_of(key) == shards.shard_of(first):
            found.append(key)
    return found


async def explain(connection: asyncpg.Connection, name: str, **values: object) -> str:
    query = DIALECTS["citus"][name]
    rows = await connection.fetch("EXPLAIN " + query.sql, *query.arguments(values))
    return "\n".join(row[0] for row in rows)


async def test_every_request_path_statement_goes_to_one_shard(
    coordinator: asyncpg.Connection, database_url: str
) -> None:
    store = await PostgresStore.connect(database_url)
    shards = await ShardMap.load(_Pool(coordinator))  # type: ignore[arg-type]
    try:
        keys = keys_of_one_shard(shards, 3)
        claims = [
            await store.requests.claim("r", SCOPE, key, FINGERPRINT, 600, 600) for key in keys
        ]
        assert all(isinstance(claim, Claim) for claim in claims)
        ids = [claim.id for claim in claims if isinstance(claim, Claim)]
        tokens = [1] * len(keys)
        many = {"keys": keys, "ids": ids, "tokens": tokens}
        plans = {
            "claim": await explain(
                coordinator, "claim", anchor=keys[0], routes=["r"] * 3, scopes=[SCOPE] * 3,
                keys=keys, fingerprints=[FINGERPRINT] * 3, leases=[60.0] * 3, ttls=[600.0] * 3,
                requests=[b"kept"] * 3, requests_sealed_with=[None] * 3, claimant="{}",
            ),
            "get": await explain(coordinator, "get", scope=SCOPE, key=keys[0]),
            "reclaim_expired": await explain(
                coordinator, "reclaim_expired", **many, routes=["r"] * 3,
                fingerprints=[FINGERPRINT] * 3, leases=[60.0] * 3, ttls=[600.0] * 3,
                requests=[b"kept"] * 3, requests_sealed_with=[None] * 3, claimants=["{}"] * 3,
            ),
            "take_over": await explain(
                coordinator, "take_over", **many, leases=[60.0] * 3, claimants=["{}"] * 3
            ),
            "complete": await explain(
                coordinator, "complete", **many, statuses=[201] * 3, headers=["[]"] * 3,
                bodies=[b""] * 3, stored=[True] * 3, sealed_with=[None] * 3,
                sealed_headers=[None] * 3,
            ),
            "release": await explain(coordinator, "release", **many),
            "mark_unknown": await explain(
                coordinator, "mark_unknown", **many, failures=[None] * 3
            ),
            "mark_waited": await explain(
                coordinator, "mark_waited", key=keys[0], id=ids[0], token=1
            ),
        }  # fmt: skip
        for name, plan in plans.items():
            shown = f"{name}:\n{plan}"
            assert "Custom Scan (Citus Adaptive)" in plan, shown
            assert "Task Count: 1\n" in plan + "\n", shown  # one shard: the router executor
            assert "Distributed Subplan" not in plan, shown  # nothing pulled to the coordinator
        # The claim runs whole on the worker that holds the batch's shard.
        assert "Function Scan on oncegate_claim" in plans["claim"]
        # The state's rule was evaluated with the coordinator's now(): a value, sent along.
        assert "now()" not in plans["take_over"].split("Task Count")[1]
    finally:
        await shards.close()
        await store.close()


async def counters(connection: asyncpg.Connection) -> asyncpg.Record:
    """Citus's executions so far, and the two-phase commits it has recorded (a transaction that
    wrote on two nodes leaves its rows in `pg_dist_transaction` until Citus's recovery, every
    minute, clears them)."""
    row: asyncpg.Record = await connection.fetchrow(
        "SELECT query_execution_single_shard AS single, query_execution_multi_shard AS multi,"
        " (SELECT count(*) FROM pg_dist_transaction) AS two_phase"
        " FROM citus_stat_counters WHERE name = current_database()"
    )
    return row


def statements_sent() -> float:
    """How many batched statements the store has sent so far (every operation's)."""
    return sum(
        sample.value
        for family in metrics.STORE_BATCH_SIZE.collect()
        for sample in family.samples
        if sample.name.endswith("_count")
    )


async def test_concurrent_requests_over_every_shard_run_no_multi_shard_statement_nor_2pc(
    coordinator: asyncpg.Connection, database_url: str
) -> None:
    store = await PostgresStore.connect(database_url)
    try:
        keys = [str(uuid.uuid4()) for _ in range(200)]  # over all the shards
        await coordinator.execute("SELECT recover_prepared_transactions()")  # none left over
        before = await counters(coordinator)
        sent_before = statements_sent()

        async def one(key: str) -> None:
            claimed = await store.requests.claim("r", SCOPE, key, FINGERPRINT, 600, 600)
            assert isinstance(claimed, Claim)
            assert await store.requests.complete(claimed, StoredAnswer(201, plaintext([], b"{}")))
            replay = await store.requests.claim("r", SCOPE, key, FINGERPRINT, 600, 600)
            assert not isinstance(replay, Claim) and replay is not None
            assert replay.state == "completed"

        await asyncio.gather(*(one(key) for key in keys))
        after = await counters(coordinator)
        sent = statements_sent() - sent_before
    finally:
        await store.close()
    assert after["multi"] - before["multi"] == 0
    assert after["two_phase"] == before["two_phase"] == 0  # no commit needed two nodes
    # Claims and completes went to the workers themselves, never through the coordinator.
    assert after["single"] - before["single"] == 0
    # And they were batched: fewer statements than operations.
    assert 0 < sent < 3 * len(keys)
    assert citus.SHARD_COUNT > 1


async def test_a_statement_citus_refuses_is_logged_with_its_name(
    database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Plain PostgreSQL's purge (a ctid subquery, FOR UPDATE) sent to Citus as if the store did
    # not know it was on Citus: an error for the caller and a log line naming the statement.
    store = await PostgresStore.connect(database_url)
    try:
        store.upkeep._dialect = Plain()
        with pytest.raises(errors.StoreUnavailable):
            await store.upkeep.purge(10)
    finally:
        await store.close()
    refused = [record.getMessage() for record in caplog.records if "refused" in record.getMessage()]
    assert refused and refused[0].startswith("PostgreSQL refused the store's purge statement")


async def test_the_shard_map_follows_a_shard_split(
    coordinator: asyncpg.Connection, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What a gateway batches by stays Citus's placement when the shards change (read again
    # every REFRESH_INTERVAL; a moment here).
    monkeypatch.setattr(citus_store, "REFRESH_INTERVAL", 0.1)
    pool = await asyncpg.create_pool(database_url, min_size=1, max_size=2)
    shards = await ShardMap.load(pool)
    try:
        key = str(uuid.uuid4())
        before = shards.shard_of(key)
        node = await coordinator.fetchval(
            "SELECT nodeid FROM pg_dist_node WHERE groupid <> 0 ORDER BY nodeid LIMIT 1"
        )
        await coordinator.execute(
            "SELECT citus_split_shard_by_split_points($1::bigint, ARRAY[$2::text],"
            " ARRAY[$3, $3]::int[], 'block_writes'::citus.shard_transfer_mode)",
            before,
            str(hash_text(key) - 1),
            node,
        )
        placed = await coordinator.fetchval(
            "SELECT get_shard_id_for_distribution_column('oncegate_keys', $1::text)", key
        )
        assert placed != before
        deadline = asyncio.get_running_loop().time() + 10
        while shards.shard_of(key) != placed:
            assert asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0.05)
        others = [str(uuid.uuid4()) for _ in range(200)]
        rows = await coordinator.fetch(
            "SELECT key, get_shard_id_for_distribution_column('oncegate_keys', key) AS shard"
            " FROM unnest($1::text[]) AS key",
            others,
        )
        assert [shards.shard_of(row["key"]) for row in rows] == [row["shard"] for row in rows]
    finally:
        await shards.close()
        await pool.close()


async def test_the_store_reads_the_catalog_without_citus_hiding_shards(database_url: str) -> None:
    # asyncpg's look-up of a statement's types scans pg_class hundreds of times. With Citus's
    # shard hiding on, each row of each scan is checked with `relation_is_a_known_shard`: 0.2-0.5 s
    # of the coordinator's CPU per look-up, and gateways opening their pools under load waited
    # past the statement timeout (connections.citus_settings). On every pool of the store, a read
    # of pg_class is planned without that check.
    async def plan_of_catalog_read(connection: asyncpg.Connection) -> str:
        rows = await connection.fetch("EXPLAIN VERBOSE SELECT relname FROM pg_class")
        return "\n".join(row[0] for row in rows)

    store = await PostgresStore.connect(database_url)
    try:
        pools = store._pools
        for pool in (pools.requests, pools.answers, pools.operator):
            async with pool.acquire() as connection:
                plan = await plan_of_catalog_read(connection)
                assert "pg_catalog.pg_class" in plan, plan
                assert "relation_is_a_known_shard" not in plan, plan
    finally:
        await store.close()
    # What the setting undoes, seen on a session with Citus's defaults.
    connection = await asyncpg.connect(database_url)
    try:
        plan = await plan_of_catalog_read(connection)
    finally:
        await connection.close()
    assert "relation_is_a_known_shard" in plan, plan


def batch_sizes(operation: str) -> tuple[float, float]:
    """(operations carried, statements) of the store's `operation` batches so far."""
    found = {"sum": 0.0, "count": 0.0}
    for family in metrics.STORE_BATCH_SIZE.collect():
        for sample in family.samples:
            if sample.labels.get("operation") == operation:
                for suffix in found:
                    if sample.name.endswith(f"_{suffix}"):
                        found[suffix] = sample.value
    return found["sum"], found["count"]


def keys_of_one_worker(store: PostgresStore, count: int) -> list[str]:
    """`count` new keys whose shards one worker holds (a batch of that worker)."""
    workers = store.requests._dialect.workers  # type: ignore[attr-defined]
    keys: list[str] = []
    node = None
    while len(keys) < count:
        key = str(uuid.uuid4())
        if node is None:
            node = workers.route(key)
        if node is not None and workers.route(key) == node:
            keys.append(key)
    return keys


async def test_a_workers_claims_and_completes_share_one_statement_and_a_bad_row_fails_alone(
    database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    # One statement carries a worker's claims and completes; a value PostgreSQL refuses in one
    # row (a NUL in a header: jsonb takes no \u0000) fails that complete alone, every other
    # operation of the statement is sent again alone and keeps its outcome.
    store = await PostgresStore.connect(database_url)
    try:
        keys = keys_of_one_worker(store, 7)
        held = [await store.requests.claim("r", SCOPE, key, FINGERPRINT, 600, 600)
                for key in keys[:3]]  # fmt: skip
        assert all(isinstance(claim, Claim) for claim in held)
        good = StoredAnswer(201, plaintext([("content-type", "application/json")], b"{}"))
        bad = StoredAnswer(201, plaintext([("x-note", "a\x00b")], b"{}"))
        together_before = batch_sizes("claim_complete")
        outcomes = await asyncio.gather(
            # The first goes alone (nothing in flight); the others queue behind it: one batch.
            store.requests.claim("r", SCOPE, keys[3], FINGERPRINT, 600, 600),
            store.requests.complete(held[0], bad),  # type: ignore[arg-type]
            store.requests.claim("r", SCOPE, keys[4], FINGERPRINT, 600, 600),
            store.requests.complete(held[1], good),  # type: ignore[arg-type]
            store.requests.claim("r", SCOPE, keys[5], FINGERPRINT, 600, 600),
            store.requests.complete(held[2], good),  # type: ignore[arg-type]
            store.requests.claim("r", SCOPE, keys[0], FINGERPRINT, 600, 600),  # held: a read
            return_exceptions=True,
        )
        together = batch_sizes("claim_complete")
        assert together[1] - together_before[1] >= 2  # the lone first, then the batch
        assert together[0] - together_before[0] == 7 + 6  # the batch, then each alone again
        assert [
            message for message in (record.getMessage() for record in caplog.records)
            if message.startswith("a claim_complete batch of 6 failed")
        ]  # fmt: skip
        assert isinstance(outcomes[0], Claim)
        assert isinstance(outcomes[1], errors.StoreRefusedValue)
        assert isinstance(outcomes[2], Claim) and isinstance(outcomes[4], Claim)
        assert outcomes[3] is True and outcomes[5] is True
        assert not isinstance(outcomes[6], Claim | BaseException) and outcomes[6] is not None
        assert outcomes[6].state == "in_progress"  # the bad answer was not stored
        for key, state in (
            (keys[1], "completed"),
            (keys[2], "completed"),
            (keys[4], "in_progress"),
        ):
            record = await store.requests.get(SCOPE, key)
            assert record is not None and record.state == state, key
    finally:
        await store.close()


async def test_a_retry_that_meets_its_own_answer_in_a_workers_statement_replays_it(
    database_url: str,
) -> None:
    """The first request's complete and its retry's claim in one statement of their worker: the
    claim read the row before the complete wrote it (in flight), but both commit together, so
    the retry is answered from the row as committed: the stored answer, replayed, not 409
    `request-in-progress` for a request that is no longer in flight."""
    store = await PostgresStore.connect(database_url)
    try:
        other, key = keys_of_one_worker(store, 2)
        route = settings.Route(name="r", match="/", upstream="http://upstream.test")
        retry = ProxyRequest(
            method="POST", path="/emails", query="", body=b"{}",
            headers=[("idempotency-key", key), ("content-type", "application/json")],
        )  # fmt: skip
        scope = keys.scope(route.name, [[] for _ in route.scope_headers])
        digest_of = fingerprint.of_request("POST", "/emails", "", "application/json", b"{}").digest
        first = await store.requests.claim(route.name, scope, key, digest_of, 600, 600)
        assert isinstance(first, Claim)
        upstream = FakeUpstream()
        before = batch_sizes("claim_complete")
        _, stored_first, answer = await asyncio.gather(
            # Alone (nothing in flight); the complete and the retry's claim queue behind it.
            store.requests.claim("r", SCOPE, other, FINGERPRINT, 600, 600),
            store.requests.complete(
                first, StoredAnswer(201, plaintext([("content-type", "text/plain")], b"first"))
            ),
            Gateway(store.requests, upstream).handle(route, retry),
        )
        assert batch_sizes("claim_complete") == (before[0] + 3, before[1] + 2)  # [1], [2]
        assert stored_first is True
        assert (answer.status, answer.outcome, answer.body) == (201, "replayed", b"first")
        assert upstream.requests(key) == []
    finally:
        await store.close()


async def test_a_workers_statement_carries_a_full_batch_of_each_kind(database_url: str) -> None:
    # A worker's claims and completes share a statement, which carries what the two statements
    # it replaces would: `store_batch_size` of each kind, twice that in all. With the one cap
    # for both, 256 requests in flight over two workers made statements of half the one
    # server's batch of each kind.
    store = await PostgresStore.connect(database_url, StoreOptions(batch_size=4))
    try:
        keys = keys_of_one_worker(store, 9)
        held = [await store.requests.claim("r", SCOPE, key, FINGERPRINT, 600, 600)
                for key in keys[:4]]  # fmt: skip
        assert all(isinstance(claim, Claim) for claim in held)
        answer = StoredAnswer(201, plaintext([], b"{}"))
        before = batch_sizes("claim_complete")
        outcomes = await asyncio.gather(
            # The first goes alone (nothing in flight); the other eight queue behind it.
            store.requests.claim("r", SCOPE, keys[4], FINGERPRINT, 600, 600),
            *(store.requests.claim("r", SCOPE, key, FINGERPRINT, 600, 600) for key in keys[5:]),
            *(store.requests.complete(claim, answer) for claim in held),  # type: ignore[arg-type]
        )
        after = batch_sizes("claim_complete")
        assert after == (before[0] + 9, before[1] + 2)  # 1, then 4 claims and 4 completes
        assert all(isinstance(outcome, Claim) for outcome in outcomes[:5])
        assert outcomes[5:] == [True] * 4
    finally:
        await store.close()


async def test_a_workers_connections_keep_its_statements_prepared_whatever_their_size(
    database_url: str,
) -> None:
    # A worker's statement names every shard table it holds: a claim and complete over 16
    # shards is 30 KB. asyncpg keeps none above 15 KiB prepared by default, and one it does not
    # keep is planned again at every call (five to ten times a pair's cost at 32 shards).
    store = await PostgresStore.connect(database_url)
    try:
        workers = store.requests._dialect.workers  # type: ignore[attr-defined]
        node = workers.route(keys_of_one_worker(store, 1)[0])
        large = "SELECT 1 -- " + "a worker's statement naming many shard tables " * 500
        assert len(large) > 20_000
        async with workers._pools_of(node).requests.acquire() as connection:
            for _ in range(2):
                assert await connection.fetchval(large) == 1
            kept = await connection.fetchval(
                "SELECT count(*) FROM pg_prepared_statements WHERE statement = $1", large
            )
        assert kept == 1
    finally:
        await store.close()


async def test_a_gateway_starting_on_workers_with_more_shards_than_recommended_says_so(
    coordinator: asyncpg.Connection, database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    # The tests' databases hold 8 shards over 2 workers (more after a split above): 4 or more a
    # worker, more than the 2 recommended. The gateway's store says so once as it opens, with
    # the cost and the remedy.
    most = await coordinator.fetchval(
        "SELECT max(held) FROM (SELECT count(*) AS held FROM citus_shards"
        " WHERE table_name = 'oncegate_keys'::regclass GROUP BY nodeport) AS h"
    )
    assert most >= citus.SHARD_COUNT // citus.WORKERS
    store = await PostgresStore.connect(database_url)
    await store.close()
    warnings = [
        record.getMessage() for record in caplog.records
        if record.name == "oncegate.store.citus" and record.levelname == "WARNING"
    ]  # fmt: skip
    assert len(warnings) == 1
    assert warnings[0].startswith(
        f"a Citus worker holds {most} shards of oncegate_keys, more than the 2 oncegate recommends"
    )


async def hold(holder: asyncpg.Connection, key: str) -> Transaction:
    """An uncommitted in-flight row for `key`, in a transaction left open: a worker's statement
    that claims the key waits on it inside PostgreSQL until the transaction ends."""
    lock = holder.transaction()
    await lock.start()
    await holder.execute(
        "INSERT INTO oncegate_keys (route, scope, key, fingerprint, state, fencing_token,"
        " lease_expires_at, expires_at) VALUES ('r', $1, $2, $3, 'in_progress', 1,"
        " now() + interval '1 minute', now() + interval '1 hour')",
        SCOPE, key, FINGERPRINT,
    )  # fmt: skip
    return lock


async def test_a_claim_given_up_while_its_workers_statement_waits_is_released_the_rest_kept(
    database_url: str,
) -> None:
    # A worker's claims and completes in one statement, held inside PostgreSQL by an
    # uncommitted row of one of its keys; one claim's caller gives up meanwhile. The others get
    # their outcomes (the complete too), and the key won for nobody is released, so a retry is a
    # new claim rather than `unknown` once the lease runs out.
    store = await PostgresStore.connect(database_url)
    holder = await asyncpg.connect(database_url)
    try:
        blocked, gone, answered, alone = keys_of_one_worker(store, 4)
        claimed = await store.requests.claim("r", SCOPE, answered, FINGERPRINT, 600, 600)
        assert isinstance(claimed, Claim)
        lock = await hold(holder, blocked)
        before = batch_sizes("claim_complete")
        first = asyncio.create_task(store.requests.claim("r", SCOPE, alone, FINGERPRINT, 60, 60))
        together = [
            asyncio.create_task(store.requests.claim("r", SCOPE, blocked, FINGERPRINT, 60, 60)),
            asyncio.create_task(store.requests.claim("r", SCOPE, gone, FINGERPRINT, 60, 60)),
            asyncio.create_task(
                store.requests.complete(claimed, StoredAnswer(201, plaintext([], b"{}")))
            ),
        ]
        assert isinstance(await asyncio.wait_for(first, 10), Claim)
        await asyncio.sleep(0.3)  # [blocked, gone, the complete]: one statement, on the lock
        assert batch_sizes("claim_complete") == (before[0] + 4, before[1] + 2)
        together[1].cancel()
        await asyncio.sleep(0.1)
        await lock.rollback()
        assert isinstance(await asyncio.wait_for(together[0], 10), Claim)
        assert await asyncio.wait_for(together[2], 10) is True
        with pytest.raises(asyncio.CancelledError):
            await together[1]
        for _ in range(100):  # the release of the claim nobody received follows the batch
            if await store.requests.get(SCOPE, gone) is None:
                break
            await asyncio.sleep(0.05)
        assert await store.requests.get(SCOPE, gone) is None
        assert isinstance(await store.requests.claim("r", SCOPE, gone, FINGERPRINT, 60, 60), Claim)
        record = await store.requests.get(SCOPE, answered)
        assert record is not None and record.state == "completed"
    finally:
        await holder.close()
        await store.close()


async def test_claims_that_wait_in_a_workers_statement_hold_none_of_its_completes_rows(
    database_url: str,
) -> None:
    """The lock order of a worker's statement of claims and completes (`workers._claim_complete`):
    the claims are written first. While a claim waits on another transaction inside PostgreSQL,
    the row the statement completes is not locked yet, so nothing that waits on it (another
    statement's claims, a settle, a take-over) can close a cycle with what the claim waits for."""
    store = await PostgresStore.connect(database_url)
    holder = await asyncpg.connect(database_url)
    looker = await asyncpg.connect(database_url)
    try:
        blocked, completing_key, alone = keys_of_one_worker(store, 3)
        completing = await store.requests.claim("r", SCOPE, completing_key, FINGERPRINT, 600, 600)
        assert isinstance(completing, Claim)
        lock = await hold(holder, blocked)
        before = batch_sizes("claim_complete")
        first = asyncio.create_task(store.requests.claim("r", SCOPE, alone, FINGERPRINT, 60, 60))
        together = [
            asyncio.create_task(store.requests.claim("r", SCOPE, blocked, FINGERPRINT, 60, 60)),
            asyncio.create_task(
                store.requests.complete(completing, StoredAnswer(201, plaintext([], b"{}")))
            ),
        ]
        assert isinstance(await asyncio.wait_for(first, 10), Claim)
        waiting = 0
        for _ in range(200):  # until the statement waits on the held key, on the worker
            if batch_sizes("claim_complete") == (before[0] + 3, before[1] + 2):
                waiting = await looker.fetchval(
                    "SELECT count(*) FROM citus_lock_waits WHERE blocking_gpid ="
                    " (SELECT global_pid FROM citus_stat_activity"
                    "  WHERE pid = $1 AND is_worker_query IS false)",
                    holder.get_server_pid(),
                )
                if waiting:
                    break
            await asyncio.sleep(0.05)
        assert waiting == 1
        assert batch_sizes("claim_complete") == (before[0] + 3, before[1] + 2)  # [1], [2]
        assert not any(each.done() for each in together)
        async with looker.transaction():  # the completed row is free: not locked by the claims
            free = await looker.fetchval(
                "SELECT id FROM oncegate_keys WHERE key = $1 AND id = $2 FOR UPDATE NOWAIT",
                completing.key, completing.id,
            )  # fmt: skip
        assert free == completing.id
        await lock.rollback()
        claimed, stored_now = await asyncio.wait_for(asyncio.gather(*together), 10)
        assert isinstance(claimed, Claim) and stored_now is True
    finally:
        await looker.close()
        await holder.close()
        await store.close()


async def test_through_the_coordinator_a_failed_complete_neither_resends_nor_fails_won_claims(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Where a key's worker takes no statements itself (its metadata not synced), claims and
    # completes go through the coordinator in statements of their own. A complete's failure
    # after the claims' statement committed must leave the claims their outcomes: a won claim
    # sent again would read its own row `in_progress` (409 for the client's own first request),
    # and one failed would be forwarded by nobody.
    store = await PostgresStore.connect(database_url)
    try:
        shards = store.requests._dialect.shards  # type: ignore[attr-defined]
        keys = [str(uuid.uuid4())]
        while len(keys) < 6:  # through the coordinator a batch is one shard's
            key = str(uuid.uuid4())
            if shards.shard_of(key) == shards.shard_of(keys[0]):
                keys.append(key)
        held = [await store.requests.claim("r", SCOPE, key, FINGERPRINT, 600, 600)
                for key in keys[:3]]  # fmt: skip
        assert all(isinstance(claim, Claim) for claim in held)
        workers = store.requests._dialect.workers  # type: ignore[attr-defined]
        monkeypatch.setattr(workers, "route", lambda key: None)  # every shard: the coordinator's
        good = StoredAnswer(201, plaintext([("content-type", "application/json")], b"{}"))
        bad = StoredAnswer(201, plaintext([("x-note", "a\x00b")], b"{}"))
        outcomes = await asyncio.gather(
            # The first goes alone (nothing in flight); the others queue behind it: one batch.
            store.requests.complete(held[2], good),  # type: ignore[arg-type]
            store.requests.claim("r", SCOPE, keys[3], FINGERPRINT, 600, 600),
            store.requests.complete(held[0], bad),  # type: ignore[arg-type]
            store.requests.claim("r", SCOPE, keys[4], FINGERPRINT, 600, 600),
            store.requests.complete(held[1], good),  # type: ignore[arg-type]
            store.requests.claim("r", SCOPE, keys[5], FINGERPRINT, 600, 600),
            return_exceptions=True,
        )
        assert outcomes[0] is True and outcomes[4] is True
        assert isinstance(outcomes[2], errors.StoreRefusedValue)
        assert all(isinstance(outcomes[index], Claim) for index in (1, 3, 5)), outcomes
        for key, state in (
            (keys[0], "in_progress"),  # the refused answer was not stored
            (keys[1], "completed"),
            (keys[2], "completed"),
            (keys[3], "in_progress"),
        ):
            record = await store.requests.get(SCOPE, key)
            assert record is not None and record.state == state, key
    finally:
        await store.close()


async def test_a_notification_that_fails_after_a_workers_statement_fails_none_of_its_operations(
    database_url: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Waiters are woken on the coordinator after the worker's statement committed. If that
    # fails (here the coordinator refuses the statement), the claims and answers it committed
    # keep their outcomes; the waiter finds the row at its next poll.
    store = await PostgresStore.connect(database_url)
    try:
        keys = keys_of_one_worker(store, 3)
        held = await store.requests.claim("r", SCOPE, keys[0], FINGERPRINT, 600, 600)
        assert isinstance(held, Claim)
        record = await store.requests.get(SCOPE, keys[0])
        assert record is not None and await store.requests.mark_waited(record)
        statements = dict(store.requests._statements)
        refused = dataclasses.replace(
            statements["notify"], sql="SELECT 1 / 0 FROM unnest($1::bigint[])"
        )
        monkeypatch.setattr(store.requests, "_statements", {**statements, "notify": refused})
        good = StoredAnswer(201, plaintext([("content-type", "application/json")], b"{}"))
        outcomes = await asyncio.gather(
            store.requests.claim("r", SCOPE, keys[1], FINGERPRINT, 600, 600),
            store.requests.complete(held, good),
            store.requests.claim("r", SCOPE, keys[2], FINGERPRINT, 600, 600),
            return_exceptions=True,
        )
        assert isinstance(outcomes[0], Claim) and isinstance(outcomes[2], Claim), outcomes
        assert outcomes[1] is True
        answered = await store.requests.get(SCOPE, keys[0])
        assert answered is not None and answered.state == "completed"
        assert any("not announced to their waiters" in r.getMessage() for r in caplog.records)
    finally:
        await store.close()
