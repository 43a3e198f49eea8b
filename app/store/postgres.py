"""The PostgreSQL store, on an asyncpg pool.

Design rules:
- One statement per operation, autocommitted: one round trip, no transaction held open.
- The pool does not reset connections on release. Nothing here changes session state (no SET,
  no LISTEN, no advisory locks, no open transaction) on a pooled connection, so asyncpg's reset
  query would only add a round trip to every request. The one LISTEN is on a connection of its
  own (`watch`).
- asyncpg prepares each statement once per connection and reuses it (its statement cache).
- Storing an answer (`complete`) commits without waiting for the WAL flush (a second, small pool
  whose sessions run with synchronous_commit off): one fsync fewer on every forward. The claim
  stays synchronous, because a claim lost in a PostgreSQL crash could let a retry forward twice.
  A lost `complete` cannot: the row falls back to its durable in-flight claim, whose lease runs
  out into `unknown`, and nothing is forwarded again.
- Every driver or socket error becomes `errors.StoreUnavailable` (every method wears
  `store.errors.translated`): the gateway fails closed and never forwards a request it could
  not claim. The pool replaces broken connections by itself, so service resumes when PostgreSQL
  comes back, with no restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import asyncpg

from .. import sealing, tracing
from ..sealing import Keyring, SealedAnswer
from . import Claim, Headers, KeyCount, KeyRecord, Listed, QueuedKey, Record
from .errors import DRIVER_ERRORS, Outage, translated
from .notify import Watch, Watchers
from .queries import QUERIES

log = logging.getLogger(__name__)

# Bounds on how long a request may wait for the store before it is answered 503: long enough
# for a busy database, short enough that a dead one does not hold clients for a minute.
CONNECT_TIMEOUT = 5.0
COMMAND_TIMEOUT = 10.0
ACQUIRE_TIMEOUT = 10.0


async def _no_reset(connection: asyncpg.Connection) -> None:
    """See the module docstring: nothing to reset."""


# `Prefer: wait`: settles of rows someone waits on are announced on this channel (queries.sql),
# and one connection per process listens to it, opened when the first request waits. Waiters
# also poll their row, so a broken listener only slows them until it is back.
CHANNEL = "oncegate_settled"
LISTENER_NAME = "oncegate-listener"  # its application_name, to find it in pg_stat_activity
LISTEN_RETRY = 1.0


class PostgresStore:
    def __init__(
        self, pool: asyncpg.Pool, answer_pool: asyncpg.Pool, url: str, where: str = ""
    ) -> None:
        self._pool = pool
        self._answer_pool = answer_pool
        self._url = url
        self._watchers = Watchers()
        self._listening: asyncio.Task[None] | None = None
        self.outage = Outage(where or "(unnamed)")

    @classmethod
    @translated("connect", "cannot connect to PostgreSQL")
    async def connect(cls, url: str, *, min_size: int = 1, max_size: int = 20) -> PostgresStore:
        """A store on a new pool. Fails with `StoreUnavailable` if PostgreSQL cannot be reached."""
        options: dict[str, Any] = {
            "reset": _no_reset,
            "timeout": CONNECT_TIMEOUT,
            "command_timeout": COMMAND_TIMEOUT,
        }
        pool = await asyncpg.create_pool(url, min_size=min_size, max_size=max_size, **options)
        try:
            answer_pool = await asyncpg.create_pool(
                url,
                min_size=min(min_size, 1),
                max_size=max(1, max_size // 2),
                server_settings={"synchronous_commit": "off"},
                **options,
            )
        except BaseException:
            await pool.close()
            raise
        return cls(pool, answer_pool, url, describe(url))

    async def close(self) -> None:
        if self._listening is not None:
            self._listening.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._listening
        await self._answer_pool.close()
        await self._pool.close()

    def watch(self, record_id: int) -> Watch:
        if self._listening is None or self._listening.done():
            self._listening = asyncio.create_task(self._listen_forever())
        return self._watchers.watch(record_id)

    async def _listen_forever(self) -> None:
        while True:
            try:
                await self._listen_once()
            except DRIVER_ERRORS as exc:
                log.warning("listening for settled keys failed: %s: %s", type(exc).__name__, exc)
            except Exception:  # a supervisor: logged, and listening again; waiters still poll
                log.exception("listening for settled keys failed")
            self._watchers.wake_all()  # what settled while nobody listened: look again now
            await asyncio.sleep(LISTEN_RETRY)

    async def _listen_once(self) -> None:
        connection = await asyncpg.connect(
            self._url, timeout=CONNECT_TIMEOUT, server_settings={"application_name": LISTENER_NAME}
        )
        closed = asyncio.Event()
        connection.add_termination_listener(lambda _: closed.set())
        try:
            await connection.add_listener(CHANNEL, self._notified)
            self._watchers.wake_all()
            await closed.wait()
            log.warning("the connection listening for settled keys was lost; reconnecting")
        finally:
            with contextlib.suppress(*DRIVER_ERRORS):
                await connection.close(timeout=CONNECT_TIMEOUT)

    def _notified(self, connection: object, pid: int, channel: str, payload: str) -> None:
        self._watchers.settled(int(payload))

    @translated("mark_waited")
    async def mark_waited(self, record: Record) -> bool:
        row = await self._fetchrow("mark_waited", id=record.id, token=record.token)
        return row is not None

    async def _fetchrow(
        self, operation: str, pool: asyncpg.Pool | None = None, **parameters: object
    ) -> Any:
        query = QUERIES[operation]
        if tracing.active():  # a `claim` or `settle` span around the round trip
            with tracing.store_operation(operation):
                return await (pool or self._pool).fetchrow(query.sql, *query.arguments(parameters))
        return await (pool or self._pool).fetchrow(query.sql, *query.arguments(parameters))

    @translated("claim")
    async def claim(
        self, route: str, scope: bytes, key: str, fingerprint: bytes, lease: float, ttl: float
    ) -> Claim | Record | None:
        row = await self._fetchrow(
            "claim", route=route, scope=scope, key=key, fingerprint=fingerprint, lease=lease,
            ttl=ttl,
        )  # fmt: skip
        if row is None:
            return None
        if row["claimed"]:
            return Claim(row["id"], row["fencing_token"])
        return _record(row)

    @translated("get")
    async def get(self, scope: bytes, key: str) -> Record | None:
        row = await self._fetchrow("get", scope=scope, key=key)
        return _record(row) if row is not None else None

    @translated("reclaim_expired")
    async def reclaim_expired(
        self, record: Record, route: str, fingerprint: bytes, lease: float, ttl: float
    ) -> Claim | None:
        row = await self._fetchrow(
            "reclaim_expired", id=record.id, token=record.token, route=route,
            fingerprint=fingerprint, lease=lease, ttl=ttl,
        )  # fmt: skip
        return Claim(row["id"], row["fencing_token"]) if row else None

    @translated("take_over")
    async def take_over(self, record: Record, lease: float) -> Claim | None:
        row = await self._fetchrow("take_over", id=record.id, token=record.token, lease=lease)
        return Claim(row["id"], row["fencing_token"]) if row else None

    @translated("complete")
    async def complete(self, claim: Claim, status: int, answer: SealedAnswer | None) -> bool:
        row = await self._fetchrow(
            "complete",
            pool=self._answer_pool,
            id=claim.record_id,
            token=claim.token,
            status=status,
            stored=answer is not None,
            **_answer_columns(answer),
        )
        return row is not None

    @translated("release")
    async def release(self, claim: Claim) -> bool:
        row = await self._fetchrow("release", id=claim.record_id, token=claim.token)
        return row is not None

    @translated("mark_unknown")
    async def mark_unknown(self, claim: Claim) -> bool:
        row = await self._fetchrow("mark_unknown", id=claim.record_id, token=claim.token)
        return row is not None

    @translated("purge")
    async def purge(self, batch_size: int) -> int:
        query = QUERIES["purge"]
        async with self._pool.acquire(timeout=ACQUIRE_TIMEOUT) as connection:
            status: str = await connection.execute(
                query.sql, *query.arguments({"batch_size": batch_size})
            )
        return int(status.rsplit(" ", 1)[1])

    @translated("admin_find")
    async def find(self, key: str, route: str | None) -> list[KeyRecord]:
        query = QUERIES["admin_find"]
        async with self._pool.acquire(timeout=ACQUIRE_TIMEOUT) as connection:
            rows = await connection.fetch(query.sql, *query.arguments({"key": key, "route": route}))
        return [
            KeyRecord(
                id=row["id"],
                route=row["route"],
                scope=bytes(row["scope"]),
                key=row["key"],
                state=row["state"],
                status=row["response_status"],
                headers=_headers(row["response_headers"]),
                body=row["response_body"],
                created_at=row["created_at"],
                completed_at=row["completed_at"],
                expires_at=row["expires_at"],
                sealed_with=row["sealed_with"],
                sealed_headers=row["sealed_headers"],
            )
            for row in rows
        ]

    @translated("admin_delete")
    async def delete(self, record_id: int) -> bool | None:
        row = await self._fetchrow("admin_delete", id=record_id)
        if row["deleted"]:
            return True
        return False if row["exists"] else None

    @translated("admin_resolve_completed")
    async def resolve_completed(self, record_id: int, status: int, answer: SealedAnswer) -> bool:
        row = await self._fetchrow(
            "admin_resolve_completed", id=record_id, status=status, **_answer_columns(answer)
        )
        return row is not None

    @translated("admin_scope")
    async def scope_of(self, record_id: int) -> bytes | None:
        row = await self._fetchrow("admin_scope", id=record_id)
        return None if row is None else bytes(row["scope"])

    @translated("rekey")
    async def rekey(self, keyring: Keyring, batch_size: int, after: int) -> RekeyBatch:
        """Re-seal the next batch of stored answers (ids above `after`) under the keyring's
        newest key, in one transaction. An answer that cannot be opened is left as it is and
        reported: re-sealing must never lose one."""
        batch, update = QUERIES["rekey_batch"], QUERIES["rekey_rows"]
        resealed: list[tuple[int, int, bytes | None, bytes]] = []
        unopenable: list[tuple[int, str]] = []
        async with (
            self._pool.acquire(timeout=ACQUIRE_TIMEOUT) as connection,
            connection.transaction(),
        ):
            rows = await connection.fetch(
                batch.sql,
                *batch.arguments(
                    {"newest": keyring.current, "batch_size": batch_size, "after": after}
                ),
            )
            for row in rows:
                scope = bytes(row["scope"])
                try:
                    headers, body = keyring.open(row["id"], scope, _stored(row))
                except sealing.Unopenable as exc:
                    unopenable.append((row["id"], str(exc)))
                    continue
                sealed = keyring.seal(row["id"], scope, headers, body)
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

    @translated("admin_resolve_released")
    async def resolve_released(self, record_id: int) -> bool:
        return await self._fetchrow("admin_resolve_released", id=record_id) is not None

    @translated("total_keys")
    async def total_keys(self) -> int:
        """Every row of the key table, expired ones not yet purged included."""
        keys: int = (await self._fetchrow("total_keys"))["keys"]
        return keys

    @translated("admin_queue")
    async def queue(
        self,
        state: Listed,
        route: str | None,
        since: datetime | None,
        after: tuple[datetime, int] | None,
        limit: int,
    ) -> list[QueuedKey]:
        return await self._queued(
            id=None, state=state, route=route, since=since, after=after, limit=limit
        )

    @translated("admin_describe")
    async def describe(self, record_id: int) -> QueuedKey | None:
        found = await self._queued(
            id=record_id, state=None, route=None, since=None, after=None, limit=1
        )
        return found[0] if found else None

    async def _queued(
        self, after: tuple[datetime, int] | None, **parameters: object
    ) -> list[QueuedKey]:
        query = QUERIES["admin_queue"]
        after_time, after_id = after if after is not None else (None, None)
        arguments = query.arguments({**parameters, "after_time": after_time, "after_id": after_id})
        async with self._pool.acquire(timeout=ACQUIRE_TIMEOUT) as connection:
            rows = await connection.fetch(query.sql, *arguments)
        return [
            QueuedKey(
                id=row["id"],
                route=row["route"],
                key=row["key"],
                state=row["state"],
                cause=row["cause"],
                status=row["response_status"],
                created_at=row["created_at"],
                lease_expires_at=row["lease_expires_at"],
                completed_at=row["completed_at"],
                expires_at=row["expires_at"],
            )
            for row in rows
        ]

    @translated("count_keys")
    async def count_keys(self, after: int, limit: int) -> KeyCount:
        row = await self._fetchrow("count_keys", after=after, page_size=limit)
        return KeyCount(
            last_id=row["last_id"],
            rows=row["counted"],
            counts={
                "in_progress": row["in_progress"],
                "completed": row["completed"],
                "unknown": row["unknown"],
            },
        )

    @translated("schema_revision")
    async def schema_revision(self) -> str | None:
        """The Alembic revision the database is at, or None before the first migration."""
        async with self._pool.acquire(timeout=ACQUIRE_TIMEOUT) as connection:
            exists = await connection.fetchval("SELECT to_regclass('alembic_version')")
            if exists is None:
                return None
            revision: str | None = await connection.fetchval(
                "SELECT version_num FROM alembic_version"
            )
            return revision


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


def _headers(document: str | None) -> Headers | None:
    return [(name, value) for name, value in json.loads(document)] if document else None


def _record(row: asyncpg.Record) -> Record:
    return Record(
        id=row["id"],
        token=row["fencing_token"],
        fingerprint=row["fingerprint"],
        state=row["state"],
        status=row["response_status"],
        headers=_headers(row["response_headers"]),
        body=row["response_body"],
        stored=row["response_stored"],
        sealed_with=row["sealed_with"],
        sealed_headers=row["sealed_headers"],
    )


@dataclass(frozen=True, slots=True)
class RekeyBatch:
    resealed: int
    unopenable: list[tuple[int, str]]  # row id and why
    last: int  # the highest id looked at: the next batch starts after it
    done: bool  # the batch was not full: nothing after it to look at


def _answer_columns(answer: SealedAnswer | None) -> dict[str, object]:
    """The columns of a stored answer: sealed ones in `sealed_headers` and `response_body`,
    plaintext headers as JSON in `response_headers`."""
    if answer is None:
        return {"headers": None, "body": None, "sealed_with": None, "sealed_headers": None}
    if answer.key_name is None:
        return {"headers": answer.headers.decode(), "body": answer.body, "sealed_with": None,
                "sealed_headers": None}  # fmt: skip
    return {"headers": None, "body": answer.body, "sealed_with": answer.key_name,
            "sealed_headers": answer.headers}  # fmt: skip


def _stored(row: asyncpg.Record) -> SealedAnswer:
    if row["sealed_with"] is not None:
        return SealedAnswer(row["sealed_with"], row["sealed_headers"], row["response_body"])
    return sealing.plaintext(_headers(row["response_headers"]) or [], row["response_body"])
