"""Re-sealing stored answers under the keyring's newest key (`oncegate rekey`), in bounded
batches on the operator's pool. The crypto is the keyring's (`sealing.Keyring.reseal`); how a
batch is read and written back is the dialect's (`dialect.Plain.rekey`, `dialect.OnCitus.rekey`):
every row written back is guarded by its fencing token.
"""

from __future__ import annotations

from ...kernel import sealing
from ...kernel.sealing import Keyring
from ...model.answers import SealedRequest
from ..errors import translated
from .dialect import RekeyBatch
from .room import OperatorRoom
from .rows import touched


class Rekeying(OperatorRoom):
    @translated("rekey")
    async def rekey(self, keyring: Keyring, batch_size: int, after: int) -> RekeyBatch:
        """Re-seal the next batch of stored answers (ids above `after`) under the keyring's
        newest key. An answer that cannot be opened is left as it is and reported: re-sealing
        must never lose one."""
        async with self._pool.acquire(timeout=self._options.acquire_timeout) as connection:
            return await self._dialect.rekey(connection, keyring, batch_size, after)

    @translated("rekey_requests")
    async def rekey_requests(self, keyring: Keyring, batch_size: int, after: int) -> RekeyBatch:
        """Re-seal the next batch of kept requests (ids above `after`) under the newest key,
        each written back only if unchanged since it was read; one that does not open is left
        as it is and reported."""
        statements = self._statements
        batch, update = statements["rekey_request_batch"], statements["rekey_request"]
        resealed, unopenable = 0, []
        async with self._pool.acquire(timeout=self._options.acquire_timeout) as connection:
            rows = await connection.fetch(
                batch.sql,
                *batch.arguments(
                    {
                        "newest": keyring.request_sealed_with,
                        "batch_size": batch_size,
                        "after": after,
                    }
                ),
            )
            for row in rows:
                stored = SealedRequest(row["request_sealed_with"], row["request"])
                try:
                    sealed = keyring.reseal_request(
                        bytes(row["scope"]), row["key"], bytes(row["fingerprint"]), stored
                    )
                except sealing.Unopenable as exc:
                    unopenable.append((row["id"], f"its kept request {exc}"))
                    continue
                status: str = await connection.execute(
                    update.sql,
                    *update.arguments(
                        {"request": sealed.data, "sealed_with": sealed.key_name,
                         "key": row["key"], "id": row["id"], "was": row["request"]}
                    ),
                )  # fmt: skip
                resealed += touched(status)
        last = rows[-1]["id"] if rows else after
        return RekeyBatch(resealed, unopenable, last, done=len(rows) < batch_size)

    @translated("rekey_remaining")
    async def rekey_remaining(self, keyring: Keyring) -> int:
        """Stored answers and kept requests anywhere in the table not sealed under the newest
        key."""
        query = self._statements["rekey_remaining"]
        remaining: int = await self._pool.fetchval(
            query.sql,
            *query.arguments(
                {"newest": keyring.sealed_with, "newest_request": keyring.request_sealed_with}
            ),
        )
        return remaining
