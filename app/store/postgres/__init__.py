"""The PostgreSQL store: the `Store` and `AdminStore` Protocols on asyncpg.

`PostgresStore` is the table of contents; each idea has a room of its own:
- `connections`: the three pools by job (`Pools`) and the connection that LISTENs (`Listener`);
- `dialect`: what differs between plain PostgreSQL and Citus, chosen once when the store opens;
- `requests`: the batched request path (claims, reads, take-overs, settles), with `operations`,
  what each queued operation is and what a batch's rows say it got;
- `operator`: the operator's queries, the purger's batches, the key count;
- `rekey`: re-sealing stored answers under the newest key;
- `rows`: one named query, and rows to records and back.

Design rules:
- Every statement is autocommitted but a rekey batch's: one round trip, no transaction held open.
- Every driver or socket error becomes `errors.StoreUnavailable` (every method of the rooms
  above wears `store.errors.translated`, and they share one `Outage`): the gateway fails closed
  and never forwards a request it could not claim.
- Closing runs in an order that matters: the request path first (the claims, then the settles
  of claims nobody waited for, then the settles), then the listener, then the pools.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from ...kernel.sealing import Keyring
from ...model.answers import SealedRequest, StoredAnswer
from ...model.records import Claim, KeyCount, KeyRecord, Listed, QueuedKey, Record, Replication
from ...settings import StoreOptions, database_url
from ..errors import Outage, translated
from ..notify import Watch
from .connections import Listener, Pools
from .dialect import Dialect, RekeyBatch, for_pools
from .operator import OperatorQueries
from .rekey import Rekeying
from .requests import RequestPath

__all__ = ["Pools", "PostgresStore", "RekeyBatch"]


class PostgresStore:
    def __init__(
        self,
        pools: Pools,
        url: str,
        dialect: Dialect,
        where: str = "",
        options: StoreOptions | None = None,
    ) -> None:
        options = options or StoreOptions()
        self._pools = pools
        # With several hosts, the outage lines name the primary: which host failed, which took over.
        primary = pools.primary if pools.primary.several_hosts else None
        self.outage = Outage(where or "(unnamed)", primary)
        self._dialect = dialect
        self._requests = RequestPath(pools, options, self.outage, dialect)
        self._operator = OperatorQueries(pools.operator, options, self.outage, dialect)
        self._rekeying = Rekeying(pools.operator, options, self.outage, dialect)
        self._listener = Listener(url, options)

    @classmethod
    @translated("connect", "cannot connect to PostgreSQL")
    async def connect(
        cls, url: str, options: StoreOptions | None = None, *, min_size: int = 1
    ) -> PostgresStore:
        """A store on new pools. Fails with `StoreUnavailable` if PostgreSQL cannot be reached."""
        options = options or StoreOptions()
        pools = await Pools.open(url, options, min_size)
        try:
            dialect = await for_pools(pools, url, options)
        except BaseException:
            await pools.close()
            raise
        return cls(pools, url, dialect, database_url.describe(url), options)

    async def close(self) -> None:
        await self._requests.close()
        await self._listener.close()
        await self._dialect.close()
        await self._pools.close()

    # The request path (`requests`).

    async def claim(
        self,
        route: str,
        scope: bytes,
        key: str,
        fingerprint: bytes,
        lease: float,
        ttl: float,
        request: SealedRequest | None = None,
    ) -> Claim | Record | None:
        return await self._requests.claim(route, scope, key, fingerprint, lease, ttl, request)

    async def get(self, scope: bytes, key: str) -> Record | None:
        return await self._requests.get(scope, key)

    async def reclaim_expired(
        self,
        record: Record,
        route: str,
        fingerprint: bytes,
        lease: float,
        ttl: float,
        request: SealedRequest | None = None,
    ) -> Claim | None:
        return await self._requests.reclaim_expired(record, route, fingerprint, lease, ttl, request)

    async def take_over(self, record: Record, lease: float) -> Claim | None:
        return await self._requests.take_over(record, lease)

    async def complete(self, claim: Claim, answer: StoredAnswer) -> bool:
        return await self._requests.complete(claim, answer)

    async def release(self, claim: Claim) -> bool:
        return await self._requests.release(claim)

    async def mark_unknown(self, claim: Claim, failure: str | None = None) -> bool:
        return await self._requests.mark_unknown(claim, failure)

    async def renew(self, claim: Claim, lease: float) -> bool:
        return await self._requests.renew(claim, lease)

    async def mark_waited(self, record: Record) -> bool:
        return await self._requests.mark_waited(record)

    def watch(self, record_id: int) -> Watch:
        return self._listener.watch(record_id)

    # The operator's queries (`operator`).

    async def purge(self, batch_size: int) -> int:
        return await self._operator.purge(batch_size)

    async def find(self, key: str, route: str | None) -> list[KeyRecord]:
        return await self._operator.find(key, route)

    async def by_id(self, record_id: int) -> KeyRecord | None:
        return await self._operator.by_id(record_id)

    async def delete(self, record_id: int) -> bool | None:
        return await self._operator.delete(record_id)

    async def resolve_completed(self, record_id: int, token: int, answer: StoredAnswer) -> bool:
        return await self._operator.resolve_completed(record_id, token, answer)

    async def resolve_released(self, record_id: int) -> bool:
        return await self._operator.resolve_released(record_id)

    async def scope_of(self, record_id: int) -> tuple[bytes, int] | None:
        return await self._operator.scope_of(record_id)

    async def total_keys(self) -> int:
        return await self._operator.total_keys()

    async def queue(
        self,
        state: Listed,
        route: str | None,
        since: datetime | None,
        after: tuple[datetime, int] | None,
        limit: int,
    ) -> list[QueuedKey]:
        return await self._operator.queue(state, route, since, after, limit)

    async def describe(self, record_id: int) -> QueuedKey | None:
        return await self._operator.describe(record_id)

    async def count_keys(self, after: int, limit: int) -> KeyCount:
        return await self._operator.count_keys(after, limit)

    async def replication(self) -> Replication:
        return await self._operator.replication()

    @property
    def primary(self) -> str:
        """The host of the URL the newest connection reached (the primary)."""
        return str(self._pools.primary)

    async def schema_revision(self) -> str | None:
        return await self._operator.schema_revision()

    async def end_session(self, session: bytes, expires_at: datetime) -> None:
        await self._operator.end_session(session, expires_at)

    async def session_ended(self, session: bytes) -> bool:
        return await self._operator.session_ended(session)

    # Re-sealing (`rekey`).

    async def rekey(self, keyring: Keyring, batch_size: int, after: int) -> RekeyBatch:
        return await self._rekeying.rekey(keyring, batch_size, after)

    async def rekey_requests(self, keyring: Keyring, batch_size: int, after: int) -> RekeyBatch:
        return await self._rekeying.rekey_requests(keyring, batch_size, after)

    async def rekey_remaining(self, keyring: Keyring) -> int:
        return await self._rekeying.rekey_remaining(keyring)


# The rooms whose methods talk to PostgreSQL (each wears `store.errors.translated`).
ROOMS: Sequence[type] = (RequestPath, OperatorQueries, Rekeying)
