"""What Citus says about the key table, when the database is a Citus coordinator.

On plain PostgreSQL (no `citus` extension) every function here answers None and the store runs
as it always did.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import logging
from dataclasses import dataclass

import asyncpg

from .errors import DRIVER_ERRORS, translated

log = logging.getLogger("oncegate.store.citus")


@dataclass(frozen=True, slots=True)
class Distribution:
    """How `oncegate_keys` is spread: over how many workers, in how many shards, by what."""

    workers: int
    shards: int
    column: str

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
        "   WHERE table_name = 'oncegate_keys'::regclass) AS workers"
        " FROM citus_tables WHERE table_name = 'oncegate_keys'::regclass"
    )
    if row is None:
        return None
    return Distribution(row["workers"], row["shard_count"], row["distribution_column"])


@translated("describe", "cannot connect to PostgreSQL")
async def describe(url: str) -> Distribution | None:
    """`distribution` of the database at `url` (for `oncegate migrate`)."""
    connection = await asyncpg.connect(url)
    try:
        return await distribution(connection)
    finally:
        await connection.close()


# How often the store reads the shards' ranges again. A rebalance moves shards between workers
# but keeps their ranges, so a batch per shard stays one shard's batch; only a split or a new
# shard count changes the ranges, and until the next read a batch may then span two shards:
# still correct (Citus commits it on both, with two-phase commit), only slower.
REFRESH_INTERVAL = 30.0


class ShardMap:
    """Which shard of `oncegate_keys` holds a key, as Citus decides it: the hash of the key
    (PostgreSQL's `hashtext`, `hash_text` below) falls in one shard's range of `pg_dist_shard`.
    The store batches the request path per shard with it, so each batch is one shard's."""

    def __init__(self, ranges: list[tuple[int, int]]) -> None:
        self._ranges = sorted(ranges)  # (lowest hash, shard id)
        self._lows = [low for low, _ in self._ranges]
        self._refreshing: asyncio.Task[None] | None = None

    @classmethod
    async def load(cls, pool: asyncpg.Pool) -> ShardMap:
        shards = cls(await _ranges(pool))
        shards._refreshing = asyncio.create_task(shards._refresh_forever(pool))
        return shards

    def shard_of(self, key: str) -> int:
        if not self._ranges:
            return 0
        index = bisect.bisect_right(self._lows, hash_text(key)) - 1
        return self._ranges[max(index, 0)][1]

    async def close(self) -> None:
        if self._refreshing is not None:
            self._refreshing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._refreshing

    async def _refresh_forever(self, pool: asyncpg.Pool) -> None:
        while True:
            await asyncio.sleep(REFRESH_INTERVAL)
            try:
                ranges = sorted(await _ranges(pool))
            except DRIVER_ERRORS as exc:  # the old ranges serve until the next try
                log.debug("could not read the shards of oncegate_keys: %s", exc)
                continue
            if ranges != self._ranges:
                log.info("the shards of oncegate_keys changed: %d now", len(ranges))
                self._ranges, self._lows = ranges, [low for low, _ in ranges]


async def _ranges(pool: asyncpg.Pool) -> list[tuple[int, int]]:
    rows = await pool.fetch(
        "SELECT shardminvalue::int AS low, shardid FROM pg_dist_shard"
        " WHERE logicalrelid = 'oncegate_keys'::regclass"
    )
    return [(row["low"], row["shardid"]) for row in rows]


_MASK = 0xFFFFFFFF


def _rotate(value: int, bits: int) -> int:
    return ((value << bits) | (value >> (32 - bits))) & _MASK


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
