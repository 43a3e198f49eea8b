"""The PostgreSQL store, on an asyncpg pool.

Design rules:
- One statement per operation, autocommitted: one round trip, no transaction held open.
- The pool does not reset connections on release. Nothing here changes session state (no SET,
  no LISTEN, no advisory locks, no open transaction), so asyncpg's reset query would only add a
  round trip to every request.
- asyncpg prepares each statement once per connection and reuses it (its statement cache).
- Storing an answer (`complete`) commits without waiting for the WAL flush (a second, small pool
  whose sessions run with synchronous_commit off): one fsync fewer on every forward. The claim
  stays synchronous, because a claim lost in a PostgreSQL crash could let a retry forward twice.
  A lost `complete` cannot: the row falls back to its durable in-flight claim, whose lease runs
  out into `unknown`, and nothing is forwarded again.
- Every driver or socket error becomes `errors.StoreUnavailable`: the gateway fails closed and
  never forwards a request it could not claim. The pool replaces broken connections by itself,
  so service resumes when PostgreSQL comes back, with no restart.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import asyncpg

from .. import errors, metrics, tracing
from . import Claim, Headers, KeyRecord, Record
from .queries import QUERIES

log = logging.getLogger(__name__)

# Bounds on how long a request may wait for the store before it is answered 503: long enough
# for a busy database, short enough that a dead one does not hold clients for a minute.
CONNECT_TIMEOUT = 5.0
COMMAND_TIMEOUT = 10.0
ACQUIRE_TIMEOUT = 10.0

# InternalClientError is not an InterfaceError: a connection whose protocol was left mid-operation
# by a PostgreSQL shutdown raises it (seen under load in tests/faults/test_store_outage.py).
_DRIVER_ERRORS = (
    OSError,
    TimeoutError,
    asyncpg.PostgresError,
    asyncpg.InterfaceError,
    asyncpg.InternalClientError,
)


async def _no_reset(connection: asyncpg.Connection) -> None:
    """See the module docstring: nothing to reset."""


class PostgresStore:
    def __init__(self, pool: asyncpg.Pool, answer_pool: asyncpg.Pool, where: str = "") -> None:
        self._pool = pool
        self._answer_pool = answer_pool
        self._where = where
        # Whether the last operation failed: the log says once that PostgreSQL is down and once
        # that it is back, not a line per request while it is down.
        self._down = False
        self._timers = {
            operation: metrics.STORE_OPERATION_DURATION.labels(operation) for operation in QUERIES
        } | {"schema_revision": metrics.STORE_OPERATION_DURATION.labels("schema_revision")}

    @classmethod
    async def connect(cls, url: str, *, min_size: int = 1, max_size: int = 20) -> PostgresStore:
        """A store on a new pool. Fails with `StoreUnavailable` if PostgreSQL cannot be reached."""
        options: dict[str, Any] = {
            "reset": _no_reset,
            "timeout": CONNECT_TIMEOUT,
            "command_timeout": COMMAND_TIMEOUT,
        }
        where = describe(url)
        try:
            pool = await asyncpg.create_pool(url, min_size=min_size, max_size=max_size, **options)
        except _DRIVER_ERRORS as exc:
            raise errors.StoreUnavailable(
                f"cannot connect to PostgreSQL at {where}: {_reason(exc)}"
            ) from exc
        try:
            answer_pool = await asyncpg.create_pool(
                url,
                min_size=min(min_size, 1),
                max_size=max(1, max_size // 2),
                server_settings={"synchronous_commit": "off"},
                **options,
            )
        except _DRIVER_ERRORS as exc:
            await pool.close()
            raise errors.StoreUnavailable(
                f"cannot connect to PostgreSQL at {where}: {_reason(exc)}"
            ) from exc
        return cls(pool, answer_pool, where)

    async def close(self) -> None:
        await self._answer_pool.close()
        await self._pool.close()

    @asynccontextmanager
    async def _connection(self, operation: str) -> AsyncIterator[asyncpg.Connection]:
        started = time.perf_counter()
        try:
            async with self._pool.acquire(timeout=ACQUIRE_TIMEOUT) as connection:
                yield connection
        except _DRIVER_ERRORS as exc:
            raise self._unavailable(operation, exc) from exc
        finally:
            self._timers[operation].observe(time.perf_counter() - started)
        if self._down:
            self._back()

    async def _fetchrow(self, operation: str, *args: Any, pool: asyncpg.Pool | None = None) -> Any:
        """One query, one row; a `claim` or `settle` span around it when tracing is on."""
        if tracing.active():
            with tracing.store_operation(operation):
                return await self._fetchrow_untraced(operation, *args, pool=pool)
        return await self._fetchrow_untraced(operation, *args, pool=pool)

    async def _fetchrow_untraced(
        self, operation: str, *args: Any, pool: asyncpg.Pool | None = None
    ) -> Any:
        """The hot path: written out rather than through `_connection`, whose context-manager
        machinery measurably cost more than the pool itself."""
        started = time.perf_counter()
        try:
            row = await (pool or self._pool).fetchrow(QUERIES[operation], *args)
        except _DRIVER_ERRORS as exc:
            raise self._unavailable(operation, exc) from exc
        finally:
            self._timers[operation].observe(time.perf_counter() - started)
        if self._down:
            self._back()
        return row

    def _unavailable(self, operation: str, exc: BaseException) -> errors.StoreUnavailable:
        if self._down:
            log.debug("store %s failed: %s", operation, _reason(exc))
        else:
            self._down = True
            log.error(
                "PostgreSQL at %s is unavailable (%s): answering 503 store-unavailable and "
                "forwarding nothing until it is back",
                self._where,
                _reason(exc),
            )
        return errors.StoreUnavailable(
            "the idempotency store (PostgreSQL) is unavailable; the request was not forwarded. "
            "Retry with the same Idempotency-Key."
        )

    def _back(self) -> None:
        self._down = False
        log.warning("PostgreSQL at %s is back", self._where)

    async def claim(
        self, route: str, scope: bytes, key: str, fingerprint: bytes, lease: float, ttl: float
    ) -> Claim | Record | None:
        row = await self._fetchrow("claim", route, scope, key, fingerprint, lease, ttl)
        if row is None:
            return None
        if row["claimed"]:
            return Claim(row["id"], row["fencing_token"])
        return _record(row)

    async def get(self, scope: bytes, key: str) -> Record | None:
        row = await self._fetchrow("get", scope, key)
        return _record(row) if row is not None else None

    async def reclaim_expired(
        self, record: Record, route: str, fingerprint: bytes, lease: float, ttl: float
    ) -> Claim | None:
        row = await self._fetchrow(
            "reclaim_expired", record.id, record.token, route, fingerprint, lease, ttl
        )
        return Claim(row["id"], row["fencing_token"]) if row else None

    async def take_over(self, record: Record, lease: float) -> Claim | None:
        row = await self._fetchrow("take_over", record.id, record.token, lease)
        return Claim(row["id"], row["fencing_token"]) if row else None

    async def complete(
        self, claim: Claim, status: int, headers: Headers, body: bytes | None
    ) -> bool:
        stored = body is not None
        row = await self._fetchrow(
            "complete",
            claim.record_id,
            claim.token,
            status,
            _headers_json(headers) if stored else None,
            body,
            stored,
            pool=self._answer_pool,
        )
        return row is not None

    async def release(self, claim: Claim) -> bool:
        return await self._fetchrow("release", claim.record_id, claim.token) is not None

    async def mark_unknown(self, claim: Claim) -> bool:
        return await self._fetchrow("mark_unknown", claim.record_id, claim.token) is not None

    async def purge(self, batch_size: int) -> int:
        async with self._connection("purge") as connection:
            status: str = await connection.execute(QUERIES["purge"], batch_size)
        return int(status.rsplit(" ", 1)[1])

    async def find(self, key: str, route: str | None) -> list[KeyRecord]:
        async with self._connection("admin_find") as connection:
            rows = await connection.fetch(QUERIES["admin_find"], key, route)
        return [
            KeyRecord(
                id=row["id"],
                route=row["route"],
                key=row["key"],
                state=row["state"],
                status=row["response_status"],
                headers=_headers(row["response_headers"]),
                body=row["response_body"],
                created_at=row["created_at"],
                completed_at=row["completed_at"],
                expires_at=row["expires_at"],
                scope=row["scope"],
            )
            for row in rows
        ]

    async def delete(self, record_id: int) -> bool | None:
        row = await self._fetchrow("admin_delete", record_id)
        if row["deleted"]:
            return True
        return False if row["exists"] else None

    async def settle(self, record_id: int, status: int, headers: Headers, body: bytes) -> bool:
        row = await self._fetchrow("admin_settle", record_id, status, _headers_json(headers), body)
        return row is not None

    async def release_unknown(self, record_id: int) -> bool:
        return await self._fetchrow("admin_release_unknown", record_id) is not None

    async def count_keys(self) -> int:
        keys: int = (await self._fetchrow("count_keys"))["keys"]
        return keys

    async def schema_revision(self) -> str | None:
        """The Alembic revision the database is at, or None before the first migration."""
        async with self._connection("schema_revision") as connection:
            exists = await connection.fetchval("SELECT to_regclass('alembic_version')")
            if exists is None:
                return None
            revision: str | None = await connection.fetchval(
                "SELECT version_num FROM alembic_version"
            )
            return revision


def _headers(document: str | None) -> Headers | None:
    return [(name, value) for name, value in json.loads(document)] if document else None


def _headers_json(headers: Headers) -> str:
    return json.dumps([list(pair) for pair in headers])


def _record(row: asyncpg.Record) -> Record:
    return Record(
        id=row["id"],
        token=row["fencing_token"],
        fingerprint=row["fingerprint"],
        state=row["state"],
        expired=row["expired"],
        status=row["response_status"],
        headers=_headers(row["response_headers"]),
        body=row["response_body"],
        stored=row["response_stored"],
    )


def describe(url: str) -> str:
    """Where a PostgreSQL URL points, for messages: host and port or socket directory, and the
    database; never the user or password."""
    parts = urlsplit(url)
    query = dict(parse_qsl(parts.query))
    host = parts.hostname or query.get("host") or "localhost"
    database = parts.path.lstrip("/") or query.get("dbname") or "(default database)"
    if host.startswith("/"):
        return f"the Unix socket in {host}, database {database}"
    port = parts.port or query.get("port") or 5432
    return f"{host}:{port}, database {database}"


def _reason(exc: BaseException) -> str:
    """What went wrong, in words: a socket error's own text, not `[Errno 2]`."""
    if isinstance(exc, FileNotFoundError | ConnectionRefusedError):
        return "no server is listening there"
    if isinstance(exc, TimeoutError):
        return "no answer in time"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return f"{type(exc).__name__}: {exc}"
