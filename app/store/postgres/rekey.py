"""Re-sealing stored answers under the keyring's newest key (`oncegate rekey`), in bounded
batches on the operator's pool. The crypto is the keyring's (`sealing.Keyring.reseal`); this
reads the rows and writes them back, each batch in one transaction guarded by the fencing token.
"""

from __future__ import annotations

from dataclasses import dataclass

import asyncpg

from ... import sealing
from ...sealing import Keyring
from ...settings import StoreOptions
from ..errors import Outage, translated
from ..queries import QUERIES
from .rows import stored_answer_of


@dataclass(frozen=True, slots=True)
class RekeyBatch:
    resealed: int
    unopenable: list[tuple[int, str]]  # row id and why
    last: int  # the highest id looked at: the next batch starts after it
    done: bool  # the batch was not full: nothing after it to look at


class Rekeying:
    def __init__(self, pool: asyncpg.Pool, options: StoreOptions, outage: Outage) -> None:
        self._pool = pool
        self._options = options
        self.outage = outage

    @translated("rekey")
    async def rekey(self, keyring: Keyring, batch_size: int, after: int) -> RekeyBatch:
        """Re-seal the next batch of stored answers (ids above `after`) under the keyring's
        newest key, in one transaction. An answer that cannot be opened is left as it is and
        reported: re-sealing must never lose one."""
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
                    {"newest": keyring.current, "batch_size": batch_size, "after": after}
                ),
            )
            for row in rows:
                try:
                    sealed = keyring.reseal(row["id"], bytes(row["scope"]), stored_answer_of(row))
                except sealing.Unopenable as exc:
                    unopenable.append((row["id"], str(exc)))
                    continue
                resealed.append((row["id"], row["fencing_token"], sealed.body, sealed.headers))
            if resealed:
                ids, tokens, bodies, sealed_headers = zip(*resealed, strict=True)
                await connection.execute(
                    update.sql,
                    *update.arguments(
                        {"sealed_with": keyring.current, "ids": list(ids),
                         "tokens": list(tokens), "bodies": list(bodies),
                         "headers": list(sealed_headers)}
                    ),
                )  # fmt: skip
        last = rows[-1]["id"] if rows else after
        return RekeyBatch(len(resealed), unopenable, last, done=len(rows) < batch_size)

    @translated("rekey_remaining")
    async def rekey_remaining(self, keyring: Keyring) -> int:
        """Stored answers anywhere in the table not sealed under the newest key."""
        remaining: int = await self._pool.fetchval(
            QUERIES["rekey_remaining"].sql,
            *QUERIES["rekey_remaining"].arguments({"newest": keyring.current}),
        )
        return remaining
