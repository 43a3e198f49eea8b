"""Re-sealing stored answers under the keyring's newest key (`oncegate rekey`), in bounded
batches on the operator's pool. The crypto is the keyring's (`sealing.Keyring.reseal`); this
reads the rows and writes them back, each batch in one transaction guarded by the fencing token.
On Citus (`shards` given) a batch is read without a lock and written back per shard, each row
a compare-and-set on its token and the key that had sealed it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import asyncpg

from ... import sealing
from ...sealing import Keyring
from ...settings import StoreOptions
from ..citus import ShardMap
from ..errors import Outage, translated
from ..queries import QUERIES
from .rows import content_of


@dataclass(frozen=True, slots=True)
class RekeyBatch:
    resealed: int
    unopenable: list[tuple[int, str]]  # row id and why
    last: int  # the highest id looked at: the next batch starts after it
    done: bool  # the batch was not full: nothing after it to look at


class Rekeying:
    def __init__(
        self,
        pool: asyncpg.Pool,
        options: StoreOptions,
        outage: Outage,
        shards: ShardMap | None = None,
    ) -> None:
        self._pool = pool
        self._options = options
        self.outage = outage
        self._shards = shards

    @translated("rekey")
    async def rekey(self, keyring: Keyring, batch_size: int, after: int) -> RekeyBatch:
        """Re-seal the next batch of stored answers (ids above `after`) under the keyring's
        newest key, in one transaction. An answer that cannot be opened is left as it is and
        reported: re-sealing must never lose one."""
        if self._shards is not None:
            return await self._rekey_by_shard(self._shards, keyring, batch_size, after)
        batch, update = QUERIES["rekey_batch"], QUERIES["rekey_rows"]
        resealed: list[tuple[int, int, bytes | None, bytes]] = []
        unopenable: list[tuple[int, str]] = []
        async with (
            self._pool.acquire(timeout=self._options.acquire_timeout) as connection,
            connection.transaction(),
        ):
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

    async def _rekey_by_shard(
        self, shards: ShardMap, keyring: Keyring, batch_size: int, after: int
    ) -> RekeyBatch:
        batch, update = QUERIES["citus_rekey_batch"], QUERIES["citus_rekey_rows"]
        unopenable: list[tuple[int, str]] = []
        by_shard: dict[int, list[dict[str, object]]] = {}
        resealed = 0
        async with self._pool.acquire(timeout=self._options.acquire_timeout) as connection:
            rows = await connection.fetch(
                batch.sql,
                *batch.arguments(
                    {"newest": keyring.sealed_with, "batch_size": batch_size, "after": after}
                ),
            )
            for row, sealed in _resealed(rows, keyring, unopenable):
                by_shard.setdefault(shards.shard_of(row["key"]), []).append(
                    {"key": row["key"], "id": row["id"], "token": row["fencing_token"],
                     "was": row["sealed_with"], "body": sealed.body, "headers": sealed.headers}
                )  # fmt: skip
            for written in by_shard.values():
                arrays = {
                    name: [each[column] for each in written]
                    for name, column in (("keys", "key"), ("ids", "id"), ("tokens", "token"),
                                         ("was", "was"), ("bodies", "body"),
                                         ("headers", "headers"))
                }  # fmt: skip
                status: str = await connection.execute(
                    update.sql, *update.arguments({"sealed_with": keyring.sealed_with, **arrays})
                )
                resealed += int(status.rsplit(" ", 1)[1])
        last = rows[-1]["id"] if rows else after
        return RekeyBatch(resealed, unopenable, last, done=len(rows) < batch_size)

    @translated("rekey_remaining")
    async def rekey_remaining(self, keyring: Keyring) -> int:
        """Stored answers anywhere in the table not sealed under the newest key."""
        remaining: int = await self._pool.fetchval(
            QUERIES["rekey_remaining"].sql,
            *QUERIES["rekey_remaining"].arguments({"newest": keyring.sealed_with}),
        )
        return remaining


def _resealed(
    rows: list[asyncpg.Record], keyring: Keyring, unopenable: list[tuple[int, str]]
) -> Iterator[tuple[asyncpg.Record, sealing.SealedAnswer]]:
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
