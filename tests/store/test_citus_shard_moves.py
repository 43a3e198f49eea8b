"""Claims and completes sent to the Citus workers themselves (store/postgres/workers.py), on a
real cluster: shard moves and splits under load lose and repeat nothing, including for a store
whose shard map is old (it reads the map only when a worker refuses it); a write never lands on
a placement that was moved away; a worker left with no shard has its pools closed and
forgotten, and new ones when shards come back. (No two-phase commit on the request path:
test_citus_store.py; the moves themselves commit on several nodes.)

The load is the store's own request path (`PostgresStore`, many concurrent claims, completes
and replays); what the store holds is read back from the coordinator afterwards.
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

import asyncpg
import pytest

from oncegate.kernel.sealing import plaintext
from oncegate.model import errors
from oncegate.model.answers import StoredAnswer
from oncegate.model.records import Claim
from oncegate.store import citus as citus_store
from oncegate.store.citus import hash_text
from oncegate.store.postgres import PostgresStore
from tests import citus

pytestmark = pytest.mark.usefixtures("citus_cluster")

SCOPE = hashlib.sha256(b"citus workers").digest()
FINGERPRINT = hashlib.sha256(b"the request").digest()
ANSWER = StoredAnswer(201, plaintext([("content-type", "application/json")], b"{}"))
TASKS = 24


@pytest.fixture(scope="module")
def backend() -> str:
    return "citus"


@pytest.fixture
async def coordinator(database_url: str) -> AsyncIterator[asyncpg.Connection]:
    connection = await asyncpg.connect(database_url)
    try:
        yield connection
    finally:
        await connection.close()


class Load:
    """`TASKS` tasks on one store, each claiming a new key, completing it and claiming it again
    (a replay), until stopped; every outcome that is not what the contract says is kept."""

    def __init__(self, store: PostgresStore) -> None:
        self.store = store
        self.completed: list[str] = []
        self.wrong: list[str] = []
        self._running = True
        self._tasks = [asyncio.create_task(self._one()) for _ in range(TASKS)]

    async def _one(self) -> None:
        while self._running:
            key = str(uuid.uuid4())
            try:
                claimed = await self.store.requests.claim("r", SCOPE, key, FINGERPRINT, 600, 600)
                if not isinstance(claimed, Claim):
                    self.wrong.append(f"{key}: a new key's claim got {claimed!r}")
                    continue
                if not await self.store.requests.complete(claimed, ANSWER):
                    self.wrong.append(f"{key}: its claim's complete was refused")
                    continue
                replay = await self.store.requests.claim("r", SCOPE, key, FINGERPRINT, 600, 600)
                if isinstance(replay, Claim) or replay is None or replay.state != "completed":
                    self.wrong.append(f"{key}: the replay got {replay!r}")
                    continue
                self.completed.append(key)
            except Exception as exc:  # what the test reports: any failure is one
                self.wrong.append(f"{key}: {type(exc).__name__}: {exc}")

    async def stop(self) -> None:
        self._running = False
        await asyncio.gather(*self._tasks)


def rerouted(caplog: pytest.LogCaptureFixture) -> int:
    """Batches a worker refused (a shard of theirs had left it) and the store sent again."""
    return sum(1 for record in caplog.records if "is sent again" in record.getMessage())


async def placements(coordinator: asyncpg.Connection) -> dict[int, int]:
    rows = await coordinator.fetch(
        "SELECT shardid, nodeport FROM citus_shards WHERE table_name = 'oncegate_keys'::regclass"
    )
    return {row["shardid"]: row["nodeport"] for row in rows}


async def check_held(coordinator: asyncpg.Connection, keys: list[str]) -> None:
    """Every key held once, completed, where Citus places it now: a claim or a complete that
    had landed on a placement moved away would be missing here (the source's table is dropped
    after the move), or left in flight."""
    rows = await coordinator.fetch(
        "SELECT key, count(*) AS copies, bool_and(state = 'completed') AS completed"
        " FROM oncegate_keys WHERE key = ANY($1::text[]) GROUP BY key",
        keys,
    )
    assert len(rows) == len(keys)
    assert all(row["copies"] == 1 and row["completed"] for row in rows)


async def test_shard_moves_under_load_lose_and_repeat_nothing_even_with_an_old_map(
    coordinator: asyncpg.Connection,
    database_url: str,
    citus_cluster: citus.Cluster,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, "oncegate.store.postgres")
    # The stores read their map only when a worker refuses a batch: every store here routes by
    # a map older than the moves, until a refusal tells it.
    monkeypatch.setattr(citus_store, "REFRESH_INTERVAL", 3600.0)
    stores = [await PostgresStore.connect(database_url) for _ in range(2)]
    loads = [Load(store) for store in stores]
    try:
        await asyncio.sleep(0.5)
        nodes = {worker.port for worker in citus_cluster.workers}
        moved = 0
        for mode in ("force_logical", "block_writes", "force_logical"):
            placed = await placements(coordinator)
            shard, port = min(placed.items())
            target = (nodes - {port}).pop()
            await coordinator.execute(
                "SELECT citus_move_shard_placement($1, '127.0.0.1', $2, '127.0.0.1', $3,"
                " shard_transfer_mode => $4::citus.shard_transfer_mode)",
                shard, port, target, mode,
            )  # fmt: skip
            assert (await placements(coordinator))[shard] == target
            moved += 1
            await asyncio.sleep(0.5)
        # And a rebalance: every worker ends with its share (the moves above left it uneven).
        await coordinator.execute(
            "SELECT citus_rebalance_start(shard_transfer_mode => 'force_logical')"
        )
        await coordinator.execute("SELECT citus_rebalance_wait()")
        await asyncio.sleep(0.5)
    finally:
        for load in loads:
            await load.stop()
        for store in stores:
            await store.close()
    keys = [key for load in loads for key in load.completed]
    assert [wrong for load in loads for wrong in load.wrong] == []
    assert moved == 3 and len(keys) > 100
    await check_held(coordinator, keys)
    assert rerouted(caplog) > 0  # the old maps were used, and workers refused them


@pytest.mark.parametrize("path", ["workers", "coordinator"])
async def test_a_shard_split_under_load_loses_and_repeats_nothing_even_with_an_old_map(
    coordinator: asyncpg.Connection,
    database_url: str,
    citus_cluster: citus.Cluster,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    path: str,
) -> None:
    caplog.set_level(logging.INFO, "oncegate.store.postgres")
    monkeypatch.setattr(citus_store, "REFRESH_INTERVAL", 3600.0)
    store = await PostgresStore.connect(database_url)
    if path == "coordinator":
        # Where the workers take no statements themselves (their metadata not synced), claims
        # and completes go through the coordinator, batched per shard of the store's map: a
        # statement Citus refuses because the shard it was planned for is gone is sent again.
        workers = store.requests._dialect.workers  # type: ignore[attr-defined]
        monkeypatch.setattr(workers, "route", lambda key: None)
    load = Load(store)
    try:
        await asyncio.sleep(0.5)
        # Twice, blocking writes: a split by logical replication needs Citus's own decoder as an
        # output plugin, which these servers refuse ("may not be used as an output plugin").
        for mode in ("block_writes", "block_writes"):
            placed = await placements(coordinator)
            shard = max(placed)
            low, high = await coordinator.fetchrow(
                "SELECT shardminvalue::int, shardmaxvalue::int FROM pg_dist_shard"
                " WHERE shardid = $1",
                shard,
            )
            node = await coordinator.fetchval(
                "SELECT nodeid FROM pg_dist_node WHERE nodeport = $1", placed[shard]
            )
            other = await coordinator.fetchval(
                "SELECT nodeid FROM pg_dist_node WHERE groupid <> 0 AND nodeid <> $1 LIMIT 1", node
            )
            # Half of the range stays on its worker, half goes to the other one.
            await coordinator.execute(
                "SELECT citus_split_shard_by_split_points($1::bigint, ARRAY[$2::text],"
                " ARRAY[$3, $4]::int[], $5::citus.shard_transfer_mode)",
                shard, str(low + (high - low) // 2), node, other, mode,
            )  # fmt: skip
            assert shard not in await placements(coordinator)
            await asyncio.sleep(0.5)
    finally:
        await load.stop()
        await store.close()
    assert load.wrong == []
    assert len(load.completed) > 50
    await check_held(coordinator, load.completed)
    if path == "workers":
        assert rerouted(caplog) > 0
    # Through the coordinator, whether the race was met is not asserted: Citus refuses only a
    # statement planned for the split shard before its metadata was switched and run after it
    # (the load's writes wait on the blocking split's lock, then run). Run alone, this case met
    # it in each of five runs (2-3 batches sent again); after the module's earlier tests, in none
    # of three: an assertion would fail by the order the tests run in. What this case asserts
    # holds either way: nothing lost or repeated, no 503 (`load.wrong`). The refusal is made on
    # demand in the two tests below.
    # Each key on the shard whose range holds its hash now (the split's children).
    rows = await coordinator.fetch(
        "SELECT key, get_shard_id_for_distribution_column('oncegate_keys', key) AS shard"
        " FROM unnest($1::text[]) AS key",
        load.completed[:200],
    )
    assert all(hash_text(row["key"]) is not None for row in rows)


async def a_split_to_come(
    coordinator: asyncpg.Connection, shards: citus_store.ShardMap
) -> tuple[int, dict[bool, list[str]], Callable[[], Awaitable[None]]]:
    """A shard, three new keys of each half of its range (by half: True the lower), and what
    splits it in those halves, both on its worker."""
    placed = await placements(coordinator)
    shard = max(placed)
    low, high = await coordinator.fetchrow(
        "SELECT shardminvalue::int, shardmaxvalue::int FROM pg_dist_shard WHERE shardid = $1",
        shard,
    )
    middle = low + (high - low) // 2
    keys: dict[bool, list[str]] = {True: [], False: []}
    while min(len(half) for half in keys.values()) < 3:
        key = str(uuid.uuid4())
        if shards.shard_of(key) == shard:
            keys[hash_text(key) <= middle].append(key)
    node = await coordinator.fetchval(
        "SELECT nodeid FROM pg_dist_node WHERE nodeport = $1", placed[shard]
    )

    async def split() -> None:
        await coordinator.execute(
            "SELECT citus_split_shard_by_split_points($1::bigint, ARRAY[$2::text],"
            " ARRAY[$3, $3]::int[], 'block_writes')",
            shard, str(middle), node,
        )  # fmt: skip

    return shard, keys, split


async def refuse_as_citus_does(pool: object) -> None:
    """Citus's refusal of a statement planned for a shard a split replaced, raised by PostgreSQL
    on a connection of `pool` (the race itself is too narrow to meet on demand)."""
    async with pool.acquire() as connection:  # type: ignore[attr-defined]
        await connection.execute(
            "DO $$ BEGIN RAISE EXCEPTION 'shard for the given value does not exist'"
            " USING ERRCODE = '40001', DETAIL = 'A concurrent shard split may have"
            " moved the data into a new set of shards.'; END $$"
        )


class Refusing:
    """The dialect's `method` (its `_fetch_on` or `_fetchrow_on`) with Citus's refusal of a
    split shard raised first for the next `count` statements sent through it; `names` says
    which were refused, `sent` is the method itself."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, dialect: object, method: str) -> None:
        self.names: list[str] = []
        self.count = 1
        self.sent = getattr(dialect, method)

        async def refused(pool: object, name: str, values: dict[str, object]) -> object:
            if len(self.names) < self.count:
                self.names.append(name)
                await refuse_as_citus_does(pool)
            return await self.sent(pool, name, values)

        monkeypatch.setattr(dialect, method, refused)


@pytest.fixture
async def through_coordinator(
    database_url: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> AsyncIterator[PostgresStore]:
    """A store that sends every statement through the coordinator, its shard map read once."""
    caplog.set_level(logging.INFO, "oncegate.store.postgres")
    monkeypatch.setattr(citus_store, "REFRESH_INTERVAL", 3600.0)
    store = await PostgresStore.connect(database_url)
    monkeypatch.setattr(store.requests._dialect.workers, "route", lambda key: None)  # type: ignore[attr-defined]
    try:
        yield store
    finally:
        await store.close()


async def test_through_the_coordinator_a_statement_planned_for_a_split_shard_is_sent_again(
    coordinator: asyncpg.Connection,
    through_coordinator: PostgresStore,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Through the coordinator, Citus routes each statement itself, but one planned while a split
    # replaced its shard is refused ("shard for the given value does not exist", 40001, "A
    # concurrent shard split may have moved the data...": the load test above met it as 503s).
    # That race is made here on demand: a real split behind the store's old map, then the
    # coordinator's refusal, raised by PostgreSQL, for the first statement sent after it.
    store = through_coordinator
    dialect = store.requests._dialect  # type: ignore[attr-defined]
    shard, keys, split = await a_split_to_come(coordinator, dialect.shards)
    batch = keys[True][:3] + keys[False][:3]
    await split()
    assert dialect.shards.shard_of(batch[0]) == shard  # the store's map is the old one
    refusing = Refusing(monkeypatch, dialect, "_fetch_on")
    claims = await asyncio.gather(
        *(store.requests.claim("r", SCOPE, key, FINGERPRINT, 600, 600) for key in batch)
    )
    assert all(isinstance(claim, Claim) for claim in claims), claims
    assert refusing.names == ["claim"]
    assert rerouted(caplog) >= 1  # sent again, each claim to its shard of the split
    assert dialect.shards.shard_of(batch[0]) != shard  # the map was read again
    answered = await asyncio.gather(
        *(store.requests.complete(claim, ANSWER) for claim in claims)  # type: ignore[arg-type]
    )
    assert all(answered)
    await check_held(coordinator, batch)
    # Refused where the map says nothing moved: an outage for that batch, not a loop.
    refusing.names.clear()
    refusing.count = 10
    with pytest.raises(errors.StoreUnavailable):
        await store.requests.claim("r", SCOPE, str(uuid.uuid4()), FINGERPRINT, 600, 600)
    assert refusing.names == ["claim"]


@pytest.mark.parametrize("operation", ["get", "mark_waited", "renew"])
async def test_through_the_coordinator_a_single_key_statement_met_by_a_split_is_sent_again(
    coordinator: asyncpg.Connection,
    through_coordinator: PostgresStore,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    operation: str,
) -> None:
    # The statements of one key outside the batchers (a key's read, `Prefer: wait`'s mark, a
    # lease's renewal) meet the same refusal as a batch (test above): sent again once where the
    # map read again says, else refused.
    store = through_coordinator
    dialect = store.requests._dialect  # type: ignore[attr-defined]
    shard, keys, split = await a_split_to_come(coordinator, dialect.shards)
    done, held = keys[True][0], keys[False][0]
    completed = await store.requests.claim("r", SCOPE, done, FINGERPRINT, 600, 600)
    assert isinstance(completed, Claim)
    assert await store.requests.complete(completed, ANSWER)
    claim = await store.requests.claim("r", SCOPE, held, FINGERPRINT, 600, 600)
    assert isinstance(claim, Claim)
    record = await store.requests.get(SCOPE, held)
    assert record is not None and record.state == "in_progress"
    await split()
    assert dialect.shards.shard_of(held) == shard  # the store's map is the old one
    refusing = Refusing(monkeypatch, dialect, "_fetchrow_on")
    statements = {
        "get": lambda: store.requests.get(SCOPE, done),
        "mark_waited": lambda: store.requests.mark_waited(record),
        "renew": lambda: store.requests.renew(claim, 600),
    }
    found = await statements[operation]()
    if operation == "get":
        assert found is not None and found.state == "completed" and found.key == done
    else:
        assert found is True
    assert refusing.names == [operation]
    assert "is sent again" in caplog.text
    assert dialect.shards.shard_of(held) != shard  # the map was read again
    # Refused where the map says nothing moved: the refusal stands, sent once.
    refusing.names.clear()
    refusing.count = 10
    with pytest.raises(errors.StoreUnavailable):
        await statements[operation]()
    assert refusing.names == [operation]
    # What the store holds: the completed key's answer, the held key still claimed.
    monkeypatch.setattr(dialect, "_fetchrow_on", refusing.sent)
    after = await store.requests.get(SCOPE, held)
    assert after is not None and after.state == "in_progress" and after.token == claim.token
    if operation == "mark_waited":
        assert await coordinator.fetchval("SELECT waited FROM oncegate_keys WHERE key = $1", held)


async def store_connections(node: citus.Node, database: str) -> list[asyncpg.Record]:
    """The client connections on `node`'s database but Citus's own (its internal connections
    and the rebalancer's name themselves `citus_...`) and this one: the store's."""
    connection = await asyncpg.connect(node.url(database))
    try:
        return await connection.fetch(
            "SELECT pid, application_name, state, query FROM pg_stat_activity"
            " WHERE datname = current_database() AND backend_type = 'client backend'"
            "   AND pid <> pg_backend_pid() AND application_name NOT LIKE 'citus%'"
        )
    finally:
        await connection.close()


async def until(condition: Callable[[], bool | Awaitable[bool]], what: str) -> None:
    """Wait for `condition`, looked at every 0.2 s 300 times (the store reads its map every
    2 s)."""
    for _ in range(300):
        holds = condition()
        if await holds if inspect.isawaitable(holds) else holds:
            return
        await asyncio.sleep(0.2)
    raise AssertionError(f"still not so after 300 looks: {what}")


async def test_a_worker_the_map_no_longer_names_has_its_pools_closed_and_is_served_again_after(
    coordinator: asyncpg.Connection,
    database_url: str,
    citus_cluster: citus.Cluster,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Every shard moved off a worker under a store's load: once the store's map says so (its
    # read every 2 s), the worker's pools are closed (their connections gone from the worker)
    # and forgotten with its batcher, while the keys are served on the other worker, each
    # claimed once. Shards moved back: new pools, and its keys served there again.
    caplog.set_level(logging.INFO, "oncegate.store.postgres")
    database = database_url.rsplit("/", 1)[1]
    drained, other = citus_cluster.workers[:2]
    store = await PostgresStore.connect(database_url)
    workers = store.requests._dialect.workers  # type: ignore[attr-defined]
    batchers = store.requests._claims._batchers  # type: ignore[attr-defined]  # per worker

    def pools_on(port: int) -> list[citus_store.Node]:
        return [node for node in workers._pools if node.port == port]

    load = Load(store)
    try:
        await until(lambda: len(load.completed) > 20, "the load under way")
        (node,) = pools_on(drained.port)
        assert node in batchers
        assert await store_connections(drained, database)  # the store's pools there
        for shard, port in sorted((await placements(coordinator)).items()):
            if port == drained.port:
                await coordinator.execute(
                    "SELECT citus_move_shard_placement($1, '127.0.0.1', $2, '127.0.0.1', $3,"
                    " shard_transfer_mode => 'block_writes')",
                    shard, drained.port, other.port,
                )  # fmt: skip
        assert drained.port not in (await placements(coordinator)).values()

        async def closed() -> bool:
            return not pools_on(drained.port) and not await store_connections(drained, database)

        await until(closed, "the drained worker's pools closed, its connections gone")
        await until(lambda: node not in batchers, "the drained worker's batcher forgotten")
        served = len(load.completed)
        await until(lambda: len(load.completed) > served + 20, "keys served meanwhile")
        assert await store_connections(other, database)  # served there
        said = [record.getMessage() for record in caplog.records]
        assert sum(f"{node} holds no shard" in line for line in said) == 1, said
        # The shards back: the worker's pools and batcher made anew, its keys served there.
        await coordinator.execute("SELECT citus_rebalance_start(shard_transfer_mode =>"
                                  " 'block_writes')")  # fmt: skip
        await coordinator.execute("SELECT citus_rebalance_wait()")
        assert drained.port in (await placements(coordinator)).values()
        await until(lambda: node in batchers and bool(pools_on(drained.port)),
                    "the worker's pools and batcher back")  # fmt: skip
        back = len(load.completed)
        await until(lambda: len(load.completed) > back + 20, "keys served after")
        assert await store_connections(drained, database)
    finally:
        await load.stop()
        await store.close()
    assert load.wrong == []
    await check_held(coordinator, load.completed)
