"""What differs between plain PostgreSQL and a Citus coordinator, chosen once (`for_pools`).

Every statement of queries.sql is written once for both servers but six, which must differ:
the claim, the purge, the operator's delete and rekey, a page of the key count and the estimate
of the table's rows. A `Dialect` is one server's: its
statements (`queries.DIALECTS`, which refuse a statement the server has no shape of), how the
request path batches (one batcher per operation, or one per shard), the claim's arguments, and
the three operator paths that take a different shape of work. The rooms of the store ask their
dialect and never which server they are on.

- Plain PostgreSQL: one batcher per operation (claims and completes in statements of their own,
  each on its pool: `requests`); the purge deletes a locked batch in one statement;
  a delete says in the same statement whether the row exists; rekey locks a batch and writes it
  back in one transaction; a page of the key count is the next rows by id.
- Citus (the key table distributed by `key`): claims and completes batched per worker and sent
  to that worker's shard tables directly, fenced against shard moves (`workers`); the other
  request-path statements batched per shard and sent through the coordinator, which sends each
  to its shard alone (`citus.ShardMap`), the claim of a shard whose worker cannot take
  statements itself as the function Citus pushes down to the worker of its `anchor`; the purge,
  the delete and rekey find their rows on every shard first, unlocked, then write each shard's,
  checked again as they go; a page of the key count is a range of ids, counted on each shard.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine, Hashable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import asyncpg

from ...kernel import sealing
from ...kernel.sealing import Keyring
from ...model.answers import SealedAnswer
from ...settings import StoreOptions
from ..batching import Batcher, PerShard
from ..citus import ShardMap
from ..errors import Outage
from ..queries import DIALECTS, Server, Statements
from .connections import Pools
from .operations import Claiming, OnKey
from .pool import Pool
from .rows import content_of, touched
from .workers import ON_WORKERS, Rerouted, Workers, split_away

log = logging.getLogger("oncegate.store.postgres")

Keyed = TypeVar("Keyed", bound=OnKey)
Outcome = TypeVar("Outcome")
Row = TypeVar("Row")

# How long a refusal for a shard a split replaces waits for the split's new map (`_moved`):
# SPLIT_READS reads of the map, SPLIT_PAUSE apart (2 s in all; a blocking split of a shard takes
# well under that on the test cluster).
SPLIT_READS = 21
SPLIT_PAUSE = 0.1

# What the gateway does while the Citus coordinator is down and the workers are up (the log's
# words, once): claims and completes go to the workers themselves (`workers`), everything else
# of the store goes through the coordinator (tests/faults/test_citus_workers.py).
COORDINATOR_DOWN = (
    "answering 503 store-unavailable for what goes through it (reading a key a claim found"
    " held, waiting on one, taking one over, releasing one or marking it unknown, renewing a"
    " lease; the purge, the key count, /readyz) until it is back; claims and stored answers go"
    " to the workers themselves, so new keys are still forwarded and answered ones replayed"
)


@dataclass(frozen=True, slots=True)
class RekeyBatch:
    resealed: int
    unopenable: list[tuple[int, str]]  # row id and why
    last: int  # the highest id looked at: the next batch starts after it
    done: bool  # the batch was not full: nothing after it to look at


class Dialect(Protocol):
    server: Server
    statements: Statements
    # Claims and completes share one batcher and, where the dialect can, one statement
    # (`fetch_both`): on Citus, one statement per worker carrying both (one fence and one commit
    # fewer). Plain PostgreSQL sends each kind in statements of its own: one statement of both
    # saved its CPU nothing and cost the gateway's (docs/performance.md, "64 connections").
    together: bool
    # A page of the key count (`count_keys`) that did not fill is the last one: true of plain
    # PostgreSQL's pages (the next rows by id, up to the page's size); on Citus a page is a
    # range of ids, which holds fewer rows wherever ids were skipped, and the sweep ends at an
    # empty one.
    short_page_is_last: bool

    def batcher(
        self, operation: str, make: Callable[[], Batcher[Keyed, Outcome]]
    ) -> Batcher[Keyed, Outcome] | PerShard[Keyed, Outcome]:
        """The request path's batcher of `operation`, from `make`, which makes one."""

    async def fetch(
        self, operation: str, pool: Pool, values: dict[str, object]
    ) -> list[asyncpg.Record]:
        """One batch of `operation` (its keys are `values["keys"]`), on `pool` or where the
        dialect sends it; raises `workers.Rerouted` when it must be sent again, operation by
        operation (Citus: its shards moved)."""

    async def fetchrow(self, pool: Pool, name: str, values: dict[str, object]) -> Any:
        """One statement of one key (`values["key"]`), not batched, on `pool`: its first row
        (or None). On Citus, one refused because a split replaced the key's shard while it was
        planned is sent again once, if the map read again says the key's shard changed."""

    async def fetch_both(
        self, claims: dict[str, object], completes: dict[str, object]
    ) -> tuple[list[asyncpg.Record], list[asyncpg.Record]]:
        """A batch of claims and one of completes whose keys go to one place that takes them
        in one statement (a batcher of both kinds, `batcher`, where `together`): their rows,
        from that one statement."""

    def claim_arguments(self, sent: Sequence[Claiming]) -> dict[str, object]:
        """What the claim's shape takes besides the batch's arrays."""

    def on_server(self, key: str) -> bool:
        """Whether `key`'s claim and complete go to the server the store connects to (on
        Citus: the coordinator), rather than elsewhere (the key's worker)."""

    def outage(self, where: str, primary: object) -> Outage:
        """The `Outage` of the server the store connects to, at `where`: its words for what
        the gateway does while that server is down."""

    async def purge(self, connection: asyncpg.Connection, batch_size: int) -> int:
        """Delete one bounded batch of expired rows; how many went."""

    async def delete(self, connection: asyncpg.Connection, record_id: int) -> bool | None:
        """An operator's delete: True deleted, False in flight (kept), None no such row."""

    async def rekey(
        self, connection: asyncpg.Connection, keyring: Keyring, batch_size: int, after: int
    ) -> RekeyBatch:
        """Re-seal the next batch of stored answers (ids above `after`) under the newest key."""

    async def close(self) -> None: ...


async def for_pools(pools: Pools, url: str, options: StoreOptions) -> Dialect:
    """The dialect of the server the pools reached (`Pools.citus`, read as they opened); on
    Citus, `url` (the coordinator's) is how the store reaches its workers too, at their host and
    port."""
    if pools.citus:
        shards = await ShardMap.load(pools.operator)
        return OnCitus(shards, Workers(url, options, shards))
    return Plain()


class _Server:
    """What both servers share; each sends the request path's statements its own way (`fetch`)."""

    statements: Statements

    async def close(self) -> None:
        pass

    async def fetch_both(
        self, claims: dict[str, object], completes: dict[str, object]
    ) -> tuple[list[asyncpg.Record], list[asyncpg.Record]]:
        raise TypeError("this server takes claims and completes in statements of their own")

    async def fetchrow(self, pool: Pool, name: str, values: dict[str, object]) -> Any:
        return await self._fetchrow_on(pool, name, values)

    async def _fetchrow_on(self, pool: Pool, name: str, values: dict[str, object]) -> Any:
        query = self.statements[name]
        return await pool.fetchrow(query.sql, *query.arguments(values))

    async def _fetch_on(
        self, pool: Pool, operation: str, values: dict[str, object]
    ) -> list[asyncpg.Record]:
        query = self.statements[operation]
        async with pool.acquire() as connection:  # within the pool's acquire timeout
            rows: list[asyncpg.Record] = await connection.fetch(query.sql, *query.arguments(values))
        return rows

    async def _execute(self, connection: asyncpg.Connection, name: str, **values: object) -> str:
        query = self.statements[name]
        status: str = await connection.execute(query.sql, *query.arguments(values))
        return status

    async def _fetchrow(self, connection: asyncpg.Connection, name: str, **values: object) -> Any:
        query = self.statements[name]
        return await connection.fetchrow(query.sql, *query.arguments(values))


class Plain(_Server):
    server: Server = "postgres"
    statements = DIALECTS["postgres"]
    together = False
    short_page_is_last = True

    def batcher(
        self, operation: str, make: Callable[[], Batcher[Keyed, Outcome]]
    ) -> Batcher[Keyed, Outcome] | PerShard[Keyed, Outcome]:
        return make()

    def fetch(
        self, operation: str, pool: Pool, values: dict[str, object]
    ) -> Coroutine[Any, Any, list[asyncpg.Record]]:
        # The statement's own coroutine, not one that awaits it: one frame fewer for every
        # statement to pass through twice (sent, and resumed with its rows).
        return self._fetch_on(pool, operation, values)

    def claim_arguments(self, sent: Sequence[Claiming]) -> dict[str, object]:
        return {}

    def on_server(self, key: str) -> bool:
        return True

    def outage(self, where: str, primary: object) -> Outage:
        return Outage(where, primary)

    async def purge(self, connection: asyncpg.Connection, batch_size: int) -> int:
        return touched(await self._execute(connection, "purge", batch_size=batch_size))

    async def delete(self, connection: asyncpg.Connection, record_id: int) -> bool | None:
        row = await self._fetchrow(connection, "admin_delete", id=record_id)
        if row["deleted"]:
            return True
        return False if row["exists"] else None

    async def rekey(
        self, connection: asyncpg.Connection, keyring: Keyring, batch_size: int, after: int
    ) -> RekeyBatch:
        """One transaction: the batch locked as it is read (a writer waits for it, and it for a
        writer), written back by (id, token)."""
        batch, update = self.statements["rekey_batch"], self.statements["rekey_rows"]
        resealed: list[tuple[int, int, bytes | None, bytes]] = []
        unopenable: list[tuple[int, str]] = []
        async with connection.transaction():
            rows = await connection.fetch(
                batch.sql,
                *batch.arguments(
                    {"newest": keyring.sealed_with, "batch_size": batch_size, "after": after}
                ),
            )
            for row, sealed in _resealed(rows, keyring, unopenable):
                resealed.append((row["id"], row["fencing_token"], sealed.body, sealed.headers))
            if resealed:
                ids, tokens, bodies, sealed_headers = zip(*resealed, strict=True)
                await connection.execute(
                    update.sql,
                    *update.arguments(
                        {"sealed_with": keyring.sealed_with, "ids": list(ids),
                         "tokens": list(tokens), "bodies": list(bodies),
                         "headers": list(sealed_headers)}
                    ),
                )  # fmt: skip
        last = rows[-1]["id"] if rows else after
        return RekeyBatch(len(resealed), unopenable, last, done=len(rows) < batch_size)


class OnCitus(_Server):
    server: Server = "citus"
    statements = DIALECTS["citus"]
    together = True
    short_page_is_last = False

    def __init__(self, shards: ShardMap, workers: Workers) -> None:
        self.shards = shards
        self.workers = workers
        self._batchers: list[PerShard[Any, Any]] = []
        shards.on_read.append(self._forget_gone)

    def batcher(
        self, operation: str, make: Callable[[], Batcher[Keyed, Outcome]]
    ) -> Batcher[Keyed, Outcome] | PerShard[Keyed, Outcome]:
        shards = self.shards
        made: PerShard[Keyed, Outcome]
        if operation in ON_WORKERS:
            made = PerShard(self._route, make)
        else:
            made = PerShard(lambda each: shards.shard_of(each.key), make)
        self._batchers.append(made)
        return made

    def _forget_gone(self) -> None:
        """After each read of the map: the pools of the workers it no longer names closed
        (`Workers.forget_gone`), and the idle batchers of workers and shards it no longer routes
        to dropped, so neither grows with every worker or shard the store ever met."""
        self.workers.forget_gone()
        placements = self.shards.placements()
        current: set[Hashable] = {*placements, *placements.values()}  # `_route`'s, and shards
        current.update(
            (kind, shard)
            for shard, node in placements.items()
            if node is None
            for kind in ("claim", "complete")
        )
        for batchers in self._batchers:
            batchers.forget(current)

    async def fetch(
        self, operation: str, pool: Pool, values: dict[str, object]
    ) -> list[asyncpg.Record]:
        keys: Sequence[str] = values["keys"]  # type: ignore[assignment]  # the batch's keys
        if operation in ON_WORKERS:
            node = self.workers.route(keys[0])
            if node is not None:
                return await self.workers.fetch(operation, node, values)
        shards = [self.shards.shard_of(key) for key in keys]
        if len(set(shards)) > 1:
            raise Rerouted("the batch spans shards since the map changed")
        try:
            return await self._fetch_on(pool, operation, values)
        except asyncpg.PostgresError as exc:
            # Nothing was written. Sent again, operation by operation, where the map read again
            # says; if it still says the same shards, the refusal stands (an outage to the
            # caller), not a loop.
            if not split_away(exc) or not await self._moved(keys, shards):
                raise
            raise Rerouted(f"through the coordinator: {exc}") from exc

    async def fetchrow(self, pool: Pool, name: str, values: dict[str, object]) -> Any:
        key: str = values["key"]  # type: ignore[assignment]  # the statement's key
        shard = self.shards.shard_of(key)
        try:
            return await self._fetchrow_on(pool, name, values)
        except asyncpg.PostgresError as exc:
            # As a batch's (`fetch`): nothing was written; sent again once, where Citus now
            # routes it, if the map read again says the key's shard changed.
            if not split_away(exc) or not await self._moved([key], [shard]):
                raise
            log.info("a %s statement is sent again: through the coordinator: %s", name, exc)
        return await self._fetchrow_on(pool, name, values)

    async def _moved(self, keys: Sequence[str], shards: Sequence[int]) -> bool:
        """Whether the map, read again, puts `keys` on other shards than `shards`. Read up to
        `SPLIT_READS` times, `SPLIT_PAUSE` apart: Citus can refuse a statement for a shard a
        split is replacing before the split has committed its new map (make test under load
        once met it: a read right after the refusal, and a second, still saw the old map, and
        the request got 503 `store-unavailable`). Nothing was written, so the operation waits
        for the map rather than fail; a map that still says the same after that is an outage."""
        for read in range(SPLIT_READS):
            if read:
                await asyncio.sleep(SPLIT_PAUSE)
            await self.shards.refresh()
            if [self.shards.shard_of(key) for key in keys] != list(shards):
                return True
        return False

    async def fetch_both(
        self, claims: dict[str, object], completes: dict[str, object]
    ) -> tuple[list[asyncpg.Record], list[asyncpg.Record]]:
        """On the worker of their keys, one statement (on the worker's pools). A shard whose
        worker can no longer take statements itself is refused before anything is sent: each
        operation goes again."""
        keys: Sequence[str] = claims["keys"]  # type: ignore[assignment]  # the batch's keys
        node = self.workers.route(keys[0])
        if node is None:
            raise Rerouted("the batch's worker takes no statements of its own any more")
        return await self.workers.fetch_both(node, claims, completes)

    def _route(self, each: OnKey) -> Hashable:
        """The batch a claim or complete joins: its worker's (both kinds, one statement), or,
        where the worker cannot take statements itself, its shard's through the coordinator,
        one kind a batch (a statement each there: the completes' failure must not touch claims
        the other committed, and the batcher isolates and reroutes each kind on its own)."""
        node = self.workers.route(each.key)
        if node is not None:
            return node
        return "claim" if isinstance(each, Claiming) else "complete", self.shards.shard_of(each.key)

    def claim_arguments(self, sent: Sequence[Claiming]) -> dict[str, object]:
        return {"anchor": sent[0].key}  # the batch's keys share its shard

    def on_server(self, key: str) -> bool:
        return self.workers.route(key) is None

    def outage(self, where: str, primary: object) -> Outage:
        return Outage(f"{where} (the Citus coordinator)", primary, COORDINATOR_DOWN)

    async def purge(self, connection: asyncpg.Connection, batch_size: int) -> int:
        found = self.statements["purge_candidates"]
        rows = await connection.fetch(found.sql, *found.arguments({"batch_size": batch_size}))
        deleted = 0
        for doomed in self._by_shard(rows, lambda row: str(row["key"])):
            status = await self._execute(
                connection,
                "purge",
                keys=[row["key"] for row in doomed],
                ids=[row["id"] for row in doomed],
            )
            deleted += touched(status)
        return deleted

    async def delete(self, connection: asyncpg.Connection, record_id: int) -> bool | None:
        key = await self._key_of(connection, record_id)
        if key is None:
            return None
        if await self._fetchrow(connection, "admin_delete", key=key, id=record_id):
            return True
        return False if await self._key_of(connection, record_id) is not None else None

    async def rekey(
        self, connection: asyncpg.Connection, keyring: Keyring, batch_size: int, after: int
    ) -> RekeyBatch:
        """The batch read without a lock (Citus takes none over several shards), written back
        per shard, each row a compare-and-set on its token and the key that had sealed it."""
        batch = self.statements["rekey_batch"]
        unopenable: list[tuple[int, str]] = []
        written: list[dict[str, object]] = []
        rows = await connection.fetch(
            batch.sql,
            *batch.arguments(
                {"newest": keyring.sealed_with, "batch_size": batch_size, "after": after}
            ),
        )
        for row, sealed in _resealed(rows, keyring, unopenable):
            written.append(
                {"key": row["key"], "id": row["id"], "token": row["fencing_token"],
                 "was": row["sealed_with"], "body": sealed.body, "headers": sealed.headers}
            )  # fmt: skip
        resealed = 0
        for shard in self._by_shard(written, lambda each: str(each["key"])):
            arrays = {
                name: [each[column] for each in shard]
                for name, column in (("keys", "key"), ("ids", "id"), ("tokens", "token"),
                                     ("was", "was"), ("bodies", "body"), ("headers", "headers"))
            }  # fmt: skip
            status = await self._execute(
                connection, "rekey_rows", sealed_with=keyring.sealed_with, **arrays
            )
            resealed += touched(status)
        last = rows[-1]["id"] if rows else after
        return RekeyBatch(resealed, unopenable, last, done=len(rows) < batch_size)

    async def close(self) -> None:
        await self.shards.close()  # first: no read of the map forgets a worker meanwhile
        await self.workers.close()

    async def _key_of(self, connection: asyncpg.Connection, record_id: int) -> str | None:
        row = await self._fetchrow(connection, "key_of", id=record_id)
        return None if row is None else str(row["key"])

    def _by_shard(self, rows: Sequence[Row], key: Callable[[Row], str]) -> list[list[Row]]:
        grouped: dict[int, list[Row]] = {}
        for row in rows:
            grouped.setdefault(self.shards.shard_of(key(row)), []).append(row)
        return list(grouped.values())


def _resealed(
    rows: list[asyncpg.Record], keyring: Keyring, unopenable: list[tuple[int, str]]
) -> Iterator[tuple[asyncpg.Record, SealedAnswer]]:
    """Each row whose answer opens, with it sealed again under the newest key for the row's
    claim (its id and fencing token); a row that does not open goes to `unopenable`, untouched."""
    for row in rows:
        try:
            claim = (row["id"], row["fencing_token"])
            sealed = keyring.reseal(claim, bytes(row["scope"]), content_of(row))
        except sealing.Unopenable as exc:
            unopenable.append((row["id"], str(exc)))
            continue
        yield row, sealed
