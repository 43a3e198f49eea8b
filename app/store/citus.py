"""What Citus says about the key table, when the database is a Citus coordinator.

On plain PostgreSQL (no `citus` extension) every function here answers None and the store runs
as it always did.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import functools
import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

import asyncpg

from .errors import DRIVER_ERRORS, translated

log = logging.getLogger("oncegate.store.citus")


# How many shards of the key table oncegate recommends per worker. The gateway sends each worker
# one statement per batch that names every shard table the worker holds, and each costs the
# worker at every statement, rows or not (executor start of its parts; with rows, its CHECK
# constraints compiled again): measured on two workers beside one server, a claim+complete pair
# cost the cluster 0.06-0.08 ms of PostgreSQL CPU at 1 or 2 shards a worker, 0.09-0.10 at 4,
# 0.15 at 8 and 0.18-0.20 at Citus's default of 32 (16 a worker), one server 0.05
# (docs/scaling.md). Two rather than one: a worker added later takes a shard from each of the
# others by a move, without a split first.
SHARDS_PER_WORKER = 2


def crowded(most: int) -> str | None:
    """What to tell the operator when a worker holds `most` shards of the key table, more than
    recommended; None when it holds no more."""
    if most <= SHARDS_PER_WORKER:
        return None
    return (
        f"a Citus worker holds {most} shards of oncegate_keys, more than the"
        f" {SHARDS_PER_WORKER} oncegate recommends: each claim and stored answer sent to a worker"
        " names every shard table it holds, and each one costs the worker (measured: a request"
        " cost the workers three times as much at 16 shards a worker as at 1 or 2, and twice"
        " as much at 8). A distributed key table cannot take fewer shards (Citus's"
        " alter_distributed_table refuses its identity column): add workers (citus_add_node,"
        f" then citus_rebalance_start) until each holds {SHARDS_PER_WORKER} or fewer; for a new"
        " database, leave citus.shard_count at Citus's default before `oncegate migrate`, which"
        f" then distributes {SHARDS_PER_WORKER} shards per worker"
        ' (docs/operations.md, "Shard count")'
    )


@dataclass(frozen=True, slots=True)
class Distribution:
    """How `oncegate_keys` is spread: over how many workers, in how many shards, by what, and
    the most shards one worker holds."""

    workers: int
    shards: int
    column: str
    most: int = 0

    def __str__(self) -> str:
        return (
            f"oncegate_keys is distributed by {self.column} over {self.workers} Citus"
            f" worker{'s' if self.workers != 1 else ''} in {self.shards} shards"
        )


async def has_citus(connection: asyncpg.Connection) -> bool:
    found: bool = await connection.fetchval(
        "SELECT EXISTS (SELECT FROM pg_extension WHERE extname = 'citus')"
    )
    return found


async def distribution(connection: asyncpg.Connection) -> Distribution | None:
    """None on plain PostgreSQL, or where the key table is not distributed."""
    if not await has_citus(connection):
        return None
    row = await connection.fetchrow(
        "SELECT distribution_column, shard_count,"
        "  (SELECT count(DISTINCT (nodename, nodeport)) FROM citus_shards"
        "   WHERE table_name = 'oncegate_keys'::regclass) AS workers,"
        "  (SELECT coalesce(max(held), 0) FROM"
        "    (SELECT count(*) AS held FROM citus_shards"
        "     WHERE table_name = 'oncegate_keys'::regclass GROUP BY nodename, nodeport) AS h)"
        "   AS most"
        " FROM citus_tables WHERE table_name = 'oncegate_keys'::regclass"
    )
    if row is None:
        return None
    return Distribution(row["workers"], row["shard_count"], row["distribution_column"], row["most"])


async def undistributable(connection: asyncpg.Connection) -> str | None:
    """Why `oncegate migrate` cannot distribute the key table on this Citus database, in words
    with what to do; None where it can, where the key table is distributed already, and on plain
    PostgreSQL. Asked before any migration runs (`migrate.upgrade`), so a refusal leaves the
    database as it was, not half migrated and stopped by Citus's own error.

    - No worker to put shards on.
    - `citus.shard_replication_factor` above 1: each shard would have a placement on several
      workers, kept in step only by statements through the coordinator. The gateway writes a
      key's claim straight to the one worker its map names (`postgres/workers.py`), which the
      other placements never see: two placements could each take a claim of one key, and the
      key would be forwarded twice. (Citus refuses it too: it colocates no function with such
      a table, "cannot colocate function".)"""
    if not await has_citus(connection):
        return None
    row = await connection.fetchrow(
        "SELECT current_database() AS database,"
        "  current_setting('citus.shard_replication_factor')::int AS placements,"
        "  EXISTS (SELECT FROM pg_dist_partition"
        "          WHERE logicalrelid::text = 'oncegate_keys') AS distributed,"
        "  (SELECT count(*) FROM pg_dist_node WHERE noderole = 'primary' AND isactive"
        "   AND shouldhaveshards AND groupid <> 0) AS workers"
    )
    if row["distributed"]:
        return None
    if not row["workers"]:
        return (
            "this database has the citus extension but no worker to put shards on: add the"
            " workers first (SELECT citus_add_node(host, port) on the coordinator), then migrate"
        )
    if row["placements"] > 1:
        return (
            f"citus.shard_replication_factor is {row['placements']} for database"
            f" {row['database']}: oncegate keeps each shard of its key table on one worker (a"
            " factor of 1, Citus's default), because the gateways write a key's claim straight"
            " to the worker that holds its shard, and a second placement would never see it: two"
            " placements could each take a claim of the same key, and a retry would be forwarded"
            ' twice (Citus refuses it too: "cannot colocate function"). Nothing was changed.'
            " Set it back to 1 where it was set (ALTER DATABASE"
            f" {row['database']} RESET citus.shard_replication_factor; or ALTER ROLE, ALTER"
            " SYSTEM, postgresql.conf, the URL's options), then run oncegate migrate again; to"
            " survive the loss of a worker, give each one a streaming standby"
            ' (docs/operations.md, "A worker down")'
        )
    return None


@translated("describe", "cannot connect to PostgreSQL")
async def describe(url: str) -> Distribution | None:
    """`distribution` of the database at `url` (for `oncegate migrate`)."""
    connection = await asyncpg.connect(url)
    try:
        return await distribution(connection)
    finally:
        await connection.close()


# How often the store reads the shards again (their ranges and where each is placed). A
# rebalance moves shards between workers but keeps their ranges; a split makes new shards. Until
# the next read, the store may send a batch to a worker that no longer holds its shard: the
# worker's fence refuses it (nothing written, `store.postgres.workers`) and the store reads the
# shards at once and sends the batch where they are now. So this only bounds how long a map
# may be old when nothing is written: routing stays correct without it, with one exception. A
# worker given a new address (`citus_update_node`) whose old primary stays up and writable is
# written to over the connections a gateway already holds there until this read (its fence
# cannot tell: cut off from Citus's metadata, it still holds its placements). A refused or new
# connection reads the map at once (`postgres/workers.py`); docs/operations.md says to stop or
# demote the old primary first. 2 s bounds that window (it was 30 s); a read costs the
# coordinator about 0.1 ms of CPU (105 µs, two workers and four shards), so 2 s is some 0.005% of
# a core per gateway process.
REFRESH_INTERVAL = 2.0


@dataclass(frozen=True, slots=True, order=True)
class Node:
    """A Citus worker that holds shards of the key table and can take the store's statements
    itself (it has Citus's metadata, synced): its group (pg_dist_placement's `groupid`) and
    where it listens."""

    group: int
    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass(frozen=True, slots=True)
class Shard:
    low: int  # the lowest hash of its range (`shardminvalue`)
    id: int
    node: Node | None  # None: its worker cannot take statements directly (no synced metadata)


class ShardMap:
    """Which shard of `oncegate_keys` holds a key, as Citus decides it: the hash of the key
    (PostgreSQL's `hashtext`, `hash_text` below) falls in one shard's range of `pg_dist_shard`;
    and which worker holds that shard (`pg_dist_placement`, `pg_dist_node`). The store batches
    the request path per worker (or per shard, for what it sends through the coordinator) with
    it, so each statement is one node's."""

    def __init__(self, shards: list[Shard]) -> None:
        self._shards = sorted(shards, key=lambda shard: shard.low)
        self._lows = [shard.low for shard in self._shards]
        self._nodes = {shard.id: shard.node for shard in self._shards}
        self._refreshing: asyncio.Task[None] | None = None
        self._reading: asyncio.Task[bool] | None = None
        self._pool: asyncpg.Pool | None = None
        self._read_at = time.monotonic()
        # Called after each read of the map (changed or not): the store forgets, there, the
        # pools and batchers of the workers and shards the map no longer names.
        self.on_read: list[Callable[[], None]] = []

    @classmethod
    async def load(cls, pool: asyncpg.Pool) -> ShardMap:
        shards = cls(await _shards(pool))
        warning = crowded(shards.most_on_a_worker())
        if warning is not None:
            log.warning("%s", warning)
        shards._pool = pool
        shards._refreshing = asyncio.create_task(shards._refresh_forever())
        return shards

    def shard_of(self, key: str) -> int:
        if not self._shards:
            return 0
        index = bisect.bisect_right(self._lows, hash_text(key)) - 1
        return self._shards[max(index, 0)].id

    def node_of(self, shard: int) -> Node | None:
        """The worker that holds `shard` (as last read), if it can take statements directly."""
        return self._nodes.get(shard)

    async def refresh_if_older(self, seconds: float) -> None:
        """Read the shards again if the map is older than `seconds` (0: now); a read that fails
        (the coordinator down too) leaves the map as last read."""
        if time.monotonic() - self._read_at < seconds:
            return
        try:
            await self.refresh()
        except DRIVER_ERRORS as exc:
            log.debug("could not read the shards of oncegate_keys: %s", exc)

    def most_on_a_worker(self) -> int:
        """The most shards one worker holds (as last read)."""
        held = Counter(holder for holder in self._nodes.values() if holder is not None)
        return max(held.values(), default=0)

    def placements(self) -> Mapping[int, Node | None]:
        """Each shard (as last read) and the worker that holds it, if it takes statements
        directly."""
        return MappingProxyType(self._nodes)

    def shards_on(self, node: Node) -> list[int]:
        """Every shard `node` holds (as last read), in ascending order."""
        return sorted(shard for shard, holder in self._nodes.items() if holder == node)

    async def refresh(self) -> bool:
        """Read the shards again now (one read for every caller that asks meanwhile); whether
        anything changed."""
        if self._reading is None or self._reading.done():
            self._reading = asyncio.create_task(self._read())
        return await asyncio.shield(self._reading)

    async def close(self) -> None:
        for task in (self._refreshing, self._reading):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, *DRIVER_ERRORS):
                    await task

    async def _read(self) -> bool:
        assert self._pool is not None, "a map made by load() reads its shards again"
        shards = sorted(await _shards(self._pool), key=lambda shard: shard.low)
        self._read_at = time.monotonic()
        changed = shards != self._shards
        if changed:
            log.info("the shards of oncegate_keys changed: %d now", len(shards))
            self._shards, self._lows = shards, [shard.low for shard in shards]
            self._nodes = {shard.id: shard.node for shard in shards}
        for listener in self.on_read:
            listener()
        return changed

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(REFRESH_INTERVAL)
            try:
                await self.refresh()
            except DRIVER_ERRORS as exc:  # the old map serves until the next try
                log.debug("could not read the shards of oncegate_keys: %s", exc)


async def _shards(pool: asyncpg.Pool) -> list[Shard]:
    rows = await pool.fetch(
        "SELECT s.shardminvalue::int AS low, s.shardid, n.groupid, n.nodename, n.nodeport,"
        "  coalesce(n.hasmetadata AND n.metadatasynced AND n.isactive, false) AS direct"
        " FROM pg_dist_shard AS s"
        " LEFT JOIN pg_dist_placement AS p ON p.shardid = s.shardid"
        " LEFT JOIN pg_dist_node AS n ON n.groupid = p.groupid AND n.noderole = 'primary'"
        " WHERE s.logicalrelid = 'oncegate_keys'::regclass"
    )
    return [
        Shard(
            row["low"],
            row["shardid"],
            Node(row["groupid"], row["nodename"], row["nodeport"]) if row["direct"] else None,
        )
        for row in rows
    ]


_MASK = 0xFFFFFFFF


def _rotate(value: int, bits: int) -> int:
    return ((value << bits) | (value >> (32 - bits))) & _MASK


# A forward asks for its key's hash several times (where its claim and its complete are batched,
# and sent): Python's lookup3 costs microseconds a call, a cached answer a dictionary lookup.
@functools.lru_cache(maxsize=16384)
def hash_text(text: str) -> int:
    """PostgreSQL's `hashtext(text)` (its `hash_bytes`, Bob Jenkins' lookup3, over the UTF-8
    bytes), as a signed 32-bit integer: the hash Citus places a text distribution value by.
    tests/store/test_citus_store.py checks it against the server's for many keys."""
    data = text.encode()
    a = b = c = (0x9E3779B9 + len(data) + 3923095) & _MASK
    while len(data) >= 12:
        a = (a + int.from_bytes(data[0:4], "little")) & _MASK
        b = (b + int.from_bytes(data[4:8], "little")) & _MASK
        c = (c + int.from_bytes(data[8:12], "little")) & _MASK
        a = (a - c) & _MASK ^ _rotate(c, 4)
        c = (c + b) & _MASK
        b = (b - a) & _MASK ^ _rotate(a, 6)
        a = (a + c) & _MASK
        c = (c - b) & _MASK ^ _rotate(b, 8)
        b = (b + a) & _MASK
        a = (a - c) & _MASK ^ _rotate(c, 16)
        c = (c + b) & _MASK
        b = (b - a) & _MASK ^ _rotate(a, 19)
        a = (a + c) & _MASK
        c = (c - b) & _MASK ^ _rotate(b, 4)
        b = (b + a) & _MASK
        data = data[12:]
    # The last 11 bytes or fewer; the lowest byte of c is left for the length.
    if len(data) > 8:
        c = (c + (int.from_bytes(data[8:], "little") << 8)) & _MASK
    if len(data) > 4:
        b = (b + int.from_bytes(data[4:8], "little")) & _MASK
    if data:
        a = (a + int.from_bytes(data[0:4], "little")) & _MASK
    c = (c ^ b) - _rotate(b, 14) & _MASK
    a = (a ^ c) - _rotate(c, 11) & _MASK
    b = (b ^ a) - _rotate(a, 25) & _MASK
    c = (c ^ b) - _rotate(b, 16) & _MASK
    a = (a ^ c) - _rotate(c, 4) & _MASK
    b = (b ^ a) - _rotate(a, 14) & _MASK
    c = (c ^ b) - _rotate(b, 24) & _MASK
    return c - (1 << 32) if c >= 1 << 31 else c
