"""The PostgreSQL store: the rooms that implement the service's ports (`service.ports`), on one
set of pools, opened and closed together. The composition root hands each consumer its room:

- `requests` (`requests.RequestPath`, the `RequestStore` port): the batched request path (claims,
  reads, take-overs, settles), with `operations`, what each queued operation is and what a
  batch's rows say it got, and the watches of waiting retries (the `Listener`'s);
- `upkeep` (`upkeep.Upkeep`, `UpkeepStore`): the purger's batches, the key count, the standbys,
  the schema's revision;
- `operator` (`operator.OperatorQueries`, `OperatorStore`): the operator's queries;
- `rekeying` (`rekey.Rekeying`): re-sealing stored answers under the newest key (`oncegate rekey`).

Beside them: `connections`, the three pools by job (`Pools`) and the connection that LISTENs and
holds the key count's lock (`Listener`); `dialect`, what differs between plain PostgreSQL and
Citus, chosen once when the store opens; `rows`, one named query, and rows to records and back.

Design rules:
- Every statement is autocommitted but a rekey batch's: one round trip, no transaction held open.
- Every driver or socket error becomes `errors.StoreUnavailable` (every method of the rooms
  wears `store.errors.translated`, and they share one `Outage`, the server's the URL names, made
  by the dialect: on Citus the coordinator's, which a claim or complete sent to a worker never
  tells, each worker having its own): the gateway fails closed and never forwards a request it
  could not claim.
- Closing runs in an order that matters: the request path first (the claims, then the settles
  of claims nobody waited for, then the settles), then the listener, then the pools.
"""

from __future__ import annotations

from collections.abc import Sequence

from ...settings import StoreOptions, database_url
from ..errors import translated
from .connections import Listener, Pools
from .dialect import Dialect, RekeyBatch, for_pools
from .operator import OperatorQueries
from .rekey import Rekeying
from .requests import RequestPath
from .upkeep import Upkeep

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
        self.outage = dialect.outage(where or "(unnamed)", primary)
        self._dialect = dialect
        self._listener = Listener(url, options)
        self.requests = RequestPath(pools, options, self.outage, dialect, self._listener)
        self.upkeep = Upkeep(pools.operator, options, self.outage, dialect, self._listener)
        self.operator = OperatorQueries(pools.operator, options, self.outage, dialect)
        self.rekeying = Rekeying(pools.operator, options, self.outage, dialect)

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
        await self.requests.close()
        await self._listener.close()
        await self._dialect.close()
        await self._pools.close()

    @property
    def primary(self) -> str:
        """The host of the URL the newest connection reached (the primary)."""
        return str(self._pools.primary)


# The rooms whose methods talk to PostgreSQL (each wears `store.errors.translated`).
ROOMS: Sequence[type] = (RequestPath, Upkeep, OperatorQueries, Rekeying)
