"""The gateway's upkeep (`service.ports.UpkeepStore`): the purger's batches, the key count, the
primary's standbys and the schema's revision, for the purger, the gauges and the health checks.
On the operator's pool, never on a connection a request waits for, one autocommitted statement
each; the purge takes the dialect's shape of work (`dialect.Dialect`). The key count's lock and
its announcement are on the process's listening connection (`connections.Listener`).
"""

from __future__ import annotations

import asyncpg

from ...model.records import HeldKeys, KeyCount, Listed, Replication
from ...settings import StoreOptions
from ...telemetry import metrics
from ..errors import Outage, translated
from .connections import Listener
from .dialect import Dialect
from .room import OperatorRoom

# The start-up line's count of keys reads at most this many rows: exact below it, estimated
# above (queries.sql, `held_keys`). On Citus each shard sends up to this many rows to the
# coordinator, so it stays small: 32 shards, 32,000 rows of nothing.
HELD_KEYS_COUNTED = 1000


class Upkeep(OperatorRoom):
    def __init__(
        self,
        pool: asyncpg.Pool,
        options: StoreOptions,
        outage: Outage,
        dialect: Dialect,
        listener: Listener,
    ) -> None:
        super().__init__(pool, options, outage, dialect)
        self._listener = listener  # closed by the store

    @translated("take_key_count", on_the_pools=False)
    async def take_key_count(self) -> bool:
        """True when this process is the one to sweep the key table: it holds the key count's
        advisory lock (`connections.KEY_COUNT_LOCK`), tried for now if it did not."""
        return await self._listener.take_key_count()

    @translated("publish_key_count", on_the_pools=False)
    async def publish_key_count(self, totals: dict[Listed, int]) -> None:
        """Announce a sweep's totals: every gateway process sets `oncegate_keys` from them."""
        await self._listener.publish_key_count(totals)

    @translated("purge")
    async def purge(self, batch_size: int) -> int:
        async with self._pool.acquire(timeout=self._options.acquire_timeout) as connection:
            return await self._dialect.purge(connection, batch_size)

    @translated("held_keys")
    async def held_keys(self, cap: int = HELD_KEYS_COUNTED) -> HeldKeys:
        """How many rows the key table holds, expired ones not yet purged included: counted up
        to `cap` (reading at most that many rows), beyond it estimated from its statistics."""
        counted: int = (await self._fetchrow("held_keys", cap=cap))["keys"]
        if counted < cap:
            return HeldKeys(counted, cap)
        estimated: int | None = (await self._fetchrow("estimated_keys"))["keys"]
        if estimated is not None and estimated < 0:  # never analysed: no statistics yet
            estimated = None
        return HeldKeys(counted, cap, estimated)

    @translated("count_keys")
    async def count_keys(self, after: int, limit: int) -> KeyCount:
        row = await self._fetchrow("count_keys", after=after, page_size=limit)
        rows: int = row["counted"]
        return KeyCount(
            last_id=row["last_id"],
            rows=rows,
            counts={
                "in_progress": row["in_progress"],
                "completed": row["completed"],
                "unknown": row["unknown"],
            },
            last=rows == 0 or (self._dialect.short_page_is_last and rows < limit),
        )

    @translated("replication")
    async def replication(self) -> Replication:
        """The primary's standbys and commit setting; `oncegate_store_failover_unsafe` follows."""
        row = await self._fetchrow("replication")
        found = Replication(
            standbys=row["standbys"],
            synchronous=None if row["hidden"] else row["synchronous"],
            synchronous_standby_names=row["synchronous_standby_names"],
            synchronous_commit=row["synchronous_commit"],
        )
        metrics.FAILOVER_UNSAFE.set(1 if found.risk() else 0)
        return found

    @translated("schema_revision")
    async def schema_revision(self) -> str | None:
        """The Alembic revision the database is at, or None before the first migration."""
        async with self._pool.acquire(timeout=self._options.acquire_timeout) as connection:
            exists = await connection.fetchval("SELECT to_regclass('alembic_version')")
            if exists is None:
                return None
            revision: str | None = await connection.fetchval(
                "SELECT version_num FROM alembic_version"
            )
            return revision
