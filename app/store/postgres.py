"""The PostgreSQL store, on three asyncpg pools by job (`Pools`).

Design rules:
- Every statement is autocommitted: one round trip, no transaction held open.
- The request path's operations are batched (`batching.Batcher`): concurrent claims share one
  statement and one commit, as do concurrent completes, releases, take-overs. A lone operation
  goes at once, alone. Each keeps its own result; the SQL is in queries.sql.
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
import functools
import json
import logging
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol, TypeVar

import asyncpg

from .. import database_url, sealing, tracing
from ..sealing import Keyring, SealedAnswer
from ..settings import StoreOptions
from . import Claim, Headers, KeyCount, KeyRecord, Listed, QueuedKey, Record
from .batching import Batcher
from .errors import DRIVER_ERRORS, Outage, isolable, translated
from .notify import Watch, Watchers
from .queries import QUERIES

log = logging.getLogger(__name__)


async def _no_reset(connection: asyncpg.Connection) -> None:
    """See the module docstring: nothing to reset."""


# `Prefer: wait`: settles of rows someone waits on are announced on this channel (queries.sql),
# and one connection per process listens to it, opened when the first request waits. Waiters
# also poll their row, so a broken listener only slows them until it is back.
CHANNEL = "oncegate_settled"
LISTENER_NAME = "oncegate-listener"  # its application_name, to find it in pg_stat_activity
LISTEN_RETRY = 1.0
# The operator's work (the admin API, the purger, the key count, rekey) runs on a pool of its
# own: it never takes a connection a request waits for, and its statements keep PostgreSQL's
# per-call plans, which its optional filters (`:route IS NULL OR ...`) need to use an index.
OPERATOR_POOL_SIZE = 3
# Answers are sent to PostgreSQL as one array per batch: a batch holds at most this many bytes
# of them (one larger answer goes alone), so 64 large answers never make one huge parameter.
COMPLETE_BATCH_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class Pools:
    """The store's connections, by job. `requests`: claims, releases, take-overs, reads;
    `answers`: completes, committed without waiting for the WAL flush (see above); `operator`:
    everything else. The request pools plan each statement once per connection
    (`plan_cache_mode = force_generic_plan`): left to choose, PostgreSQL re-plans the batched
    statements on every call (about 0.25 ms of its CPU, half a lone claim's round trip)."""

    requests: asyncpg.Pool
    answers: asyncpg.Pool
    operator: asyncpg.Pool


class PostgresStore:
    def __init__(
        self,
        pools: Pools,
        url: str,
        where: str = "",
        options: StoreOptions | None = None,
    ) -> None:
        self._pool = pools.requests
        self._answer_pool = pools.answers
        self._operator_pool = pools.operator
        self._url = url
        self._options = options = options or StoreOptions()
        self._watchers = Watchers()
        self._listening: asyncio.Task[None] | None = None
        self.outage = Outage(where or "(unnamed)")
        size, isolate = options.batch_size, isolable
        self._claims = Batcher(
            "claim", self._claim_batch, size, self._claimed_for_nobody, isolate=isolate
        )
        self._reclaims = Batcher(
            "reclaim_expired", self._reclaim_batch, size, self._claimed_for_nobody, isolate=isolate
        )
        self._take_overs = Batcher(
            "take_over", self._take_over_batch, size, self._taken_for_nobody, isolate=isolate
        )
        self._completes = Batcher(
            "complete",
            self._complete_batch,
            size,
            weight=_answer_size,
            max_weight=COMPLETE_BATCH_BYTES,
            isolate=isolate,
        )
        self._releases = Batcher(
            "release", functools.partial(self._settle_batch, "release"), size, isolate=isolate
        )
        self._unknowns = Batcher(
            "mark_unknown",
            functools.partial(self._settle_batch, "mark_unknown"),
            size,
            isolate=isolate,
        )
        # Closed in two steps: the claims, whose orphans are settled, before the settles.
        self._claiming: tuple[Batcher[Any, Any], ...] = (
            self._claims, self._reclaims, self._take_overs,
        )  # fmt: skip
        self._settling: tuple[Batcher[Any, Any], ...] = (
            self._completes, self._releases, self._unknowns,
        )  # fmt: skip
        self._cleanups: set[asyncio.Task[bool]] = set()

    @classmethod
    @translated("connect", "cannot connect to PostgreSQL")
    async def connect(
        cls, url: str, options: StoreOptions | None = None, *, min_size: int = 1
    ) -> PostgresStore:
        """A store on new pools. Fails with `StoreUnavailable` if PostgreSQL cannot be reached."""
        options = options or StoreOptions()
        common: dict[str, Any] = {
            "reset": _no_reset,
            "timeout": options.connect_timeout,
            "command_timeout": options.command_timeout,
        }
        generic = {"plan_cache_mode": "force_generic_plan"}
        opened: list[asyncpg.Pool] = []
        try:
            for size, settings in (
                (options.pool_size, generic),
                (max(1, options.pool_size // 2), {**generic, "synchronous_commit": "off"}),
                (OPERATOR_POOL_SIZE, {}),
            ):
                pool = await asyncpg.create_pool(
                    url,
                    min_size=min(min_size, size),
                    max_size=size,
                    server_settings=settings,
                    **common,
                )
                opened.append(pool)
        except BaseException:
            for pool in opened:
                await pool.close()
            raise
        return cls(Pools(*opened), url, database_url.describe(url), options)

    async def close(self) -> None:
        for batcher in self._claiming:
            await batcher.close()
        while self._cleanups:
            await asyncio.gather(*self._cleanups, return_exceptions=True)
        for batcher in self._settling:
            await batcher.close()
        if self._listening is not None:
            self._listening.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._listening
        await self._operator_pool.close()
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
            self._url,
            timeout=self._options.connect_timeout,
            server_settings={"application_name": LISTENER_NAME},
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
                await connection.close(timeout=self._options.connect_timeout)

    def _notified(self, connection: object, pid: int, channel: str, payload: str) -> None:
        self._watchers.settled(int(payload))

    @translated("mark_waited")
    async def mark_waited(self, record: Record) -> bool:
        row = await self._fetchrow(self._pool, "mark_waited", id=record.id, token=record.token)
        return row is not None

    async def _fetchrow(self, pool: asyncpg.Pool, operation: str, **parameters: object) -> Any:
        query = QUERIES[operation]
        with tracing.store_operation(operation):  # a `claim` or `settle` span, when tracing
            return await pool.fetchrow(query.sql, *query.arguments(parameters))

    async def _fetch_batch(
        self, operation: str, pool: asyncpg.Pool, **arrays: Sequence[object]
    ) -> list[asyncpg.Record]:
        """One batched statement: its parameters are arrays, one element per operation."""
        query = QUERIES[operation]
        async with pool.acquire(timeout=self._options.acquire_timeout) as connection:
            rows: list[asyncpg.Record] = await connection.fetch(query.sql, *query.arguments(arrays))
        return rows

    @translated("claim")
    async def claim(
        self, route: str, scope: bytes, key: str, fingerprint: bytes, lease: float, ttl: float
    ) -> Claim | Record | None:
        wanted = _Wanted(route, scope, key, fingerprint, lease, ttl)
        with tracing.store_operation("claim"):
            return await self._claims.run(wanted)

    async def _claim_batch(self, batch: Sequence[_Wanted]) -> list[Claim | Record | None]:
        # One row per key: of two copies of a key in one batch, the first is sent, and the
        # copy sees the row the first one found or made, as it would a statement later.
        first: dict[tuple[bytes, str], int] = {}
        for index, wanted in enumerate(batch):
            first.setdefault((wanted.scope, wanted.key), index)
        sent = [batch[index] for index in first.values()]
        rows = await self._fetch_batch(
            "claim",
            self._pool,
            routes=[wanted.route for wanted in sent],
            scopes=[wanted.scope for wanted in sent],
            keys=[wanted.key for wanted in sent],
            fingerprints=[wanted.fingerprint for wanted in sent],
            leases=[wanted.lease for wanted in sent],
            ttls=[wanted.ttl for wanted in sent],
        )
        found: dict[tuple[bytes, str], Claim | Record | None] = {}
        for row in rows:
            wanted = sent[row["n"] - 1]
            if row["id"] is None:
                found[wanted.scope, wanted.key] = None
            elif row["claimed"]:
                found[wanted.scope, wanted.key] = Claim(row["id"], row["fencing_token"])
            else:
                found[wanted.scope, wanted.key] = _record(row)
        outcomes: list[Claim | Record | None] = []
        for index, wanted in enumerate(batch):
            outcome = found[wanted.scope, wanted.key]
            if index != first[wanted.scope, wanted.key] and isinstance(outcome, Claim):
                outcome = _claimed_row(outcome, batch[first[wanted.scope, wanted.key]])
            outcomes.append(outcome)
        return outcomes

    def _claimed_for_nobody(self, _: object, outcome: Claim | Record | None) -> None:
        """A request stopped waiting for its claim (or its reclaim of an expired key) after the
        statement was sent, and the claim was won: release it, or the key would read `unknown`
        once its lease runs out although nothing was forwarded."""
        if isinstance(outcome, Claim):
            self._clean_up(self.release(outcome))

    def _taken_for_nobody(self, _: object, outcome: Claim | None) -> None:
        """The same for a take-over of an `unknown` key: it goes back to `unknown` (with the
        new token), still in the operator's queue, rather than being forgotten."""
        if outcome is not None:
            self._clean_up(self.mark_unknown(outcome))

    def _clean_up(self, settlement: Coroutine[Any, Any, bool]) -> None:
        cleanup = asyncio.create_task(settlement)
        self._cleanups.add(cleanup)
        cleanup.add_done_callback(self._cleaned_up)

    def _cleaned_up(self, cleanup: asyncio.Task[bool]) -> None:
        self._cleanups.discard(cleanup)
        if not cleanup.cancelled() and cleanup.exception() is not None:
            log.warning("could not settle a claim nobody waited for: %s", cleanup.exception())

    @translated("get")
    async def get(self, scope: bytes, key: str) -> Record | None:
        row = await self._fetchrow(self._pool, "get", scope=scope, key=key)
        return _record(row) if row is not None else None

    @translated("reclaim_expired")
    async def reclaim_expired(
        self, record: Record, route: str, fingerprint: bytes, lease: float, ttl: float
    ) -> Claim | None:
        taking = _Reclaim(record.id, record.token, route, fingerprint, lease, ttl)
        with tracing.store_operation("reclaim_expired"):
            return await self._reclaims.run(taking)

    async def _reclaim_batch(self, batch: Sequence[_Reclaim]) -> list[Claim | None]:
        sent = _once(batch)
        rows = await self._fetch_batch(
            "reclaim_expired",
            self._pool,
            ids=[taking.id for taking in sent],
            tokens=[taking.token for taking in sent],
            routes=[taking.route for taking in sent],
            fingerprints=[taking.fingerprint for taking in sent],
            leases=[taking.lease for taking in sent],
            ttls=[taking.ttl for taking in sent],
        )
        return _taken(batch, sent, rows)

    @translated("take_over")
    async def take_over(self, record: Record, lease: float) -> Claim | None:
        taking = _TakeOver(record.id, record.token, lease)
        with tracing.store_operation("take_over"):
            return await self._take_overs.run(taking)

    async def _take_over_batch(self, batch: Sequence[_TakeOver]) -> list[Claim | None]:
        sent = _once(batch)
        rows = await self._fetch_batch(
            "take_over",
            self._pool,
            ids=[taking.id for taking in sent],
            tokens=[taking.token for taking in sent],
            leases=[taking.lease for taking in sent],
        )
        return _taken(batch, sent, rows)

    @translated("complete")
    async def complete(self, claim: Claim, status: int, answer: SealedAnswer | None) -> bool:
        completing = _Complete(claim.record_id, claim.token, status, answer)
        with tracing.store_operation("complete"):
            return await self._completes.run(completing)

    async def _complete_batch(self, batch: Sequence[_Complete]) -> list[bool]:
        sent = _once(batch)
        columns = [_answer_columns(completing.answer) for completing in sent]
        rows = await self._fetch_batch(
            "complete",
            self._answer_pool,
            ids=[completing.id for completing in sent],
            tokens=[completing.token for completing in sent],
            statuses=[completing.status for completing in sent],
            stored=[completing.answer is not None for completing in sent],
            headers=[column["headers"] for column in columns],
            bodies=[column["body"] for column in columns],
            sealed_with=[column["sealed_with"] for column in columns],
            sealed_headers=[column["sealed_headers"] for column in columns],
        )
        return _settled(batch, sent, rows)

    @translated("release")
    async def release(self, claim: Claim) -> bool:
        with tracing.store_operation("release"):
            return await self._releases.run(_Settle(claim.record_id, claim.token))

    @translated("mark_unknown")
    async def mark_unknown(self, claim: Claim) -> bool:
        settling = _Settle(claim.record_id, claim.token)
        with tracing.store_operation("mark_unknown"):
            return await self._unknowns.run(settling)

    async def _settle_batch(self, operation: str, batch: Sequence[_Settle]) -> list[bool]:
        sent = _once(batch)
        rows = await self._fetch_batch(
            operation,
            self._pool,
            ids=[settling.id for settling in sent],
            tokens=[settling.token for settling in sent],
        )
        return _settled(batch, sent, rows)

    @translated("purge")
    async def purge(self, batch_size: int) -> int:
        query = QUERIES["purge"]
        async with self._operator_pool.acquire(timeout=self._options.acquire_timeout) as connection:
            status: str = await connection.execute(
                query.sql, *query.arguments({"batch_size": batch_size})
            )
        return int(status.rsplit(" ", 1)[1])

    @translated("admin_find")
    async def find(self, key: str, route: str | None) -> list[KeyRecord]:
        query = QUERIES["admin_find"]
        async with self._operator_pool.acquire(timeout=self._options.acquire_timeout) as connection:
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
        row = await self._fetchrow(self._operator_pool, "admin_delete", id=record_id)
        if row["deleted"]:
            return True
        return False if row["exists"] else None

    @translated("admin_resolve_completed")
    async def resolve_completed(self, record_id: int, status: int, answer: SealedAnswer) -> bool:
        row = await self._fetchrow(
            self._operator_pool,
            "admin_resolve_completed",
            id=record_id,
            status=status,
            **_answer_columns(answer),
        )
        return row is not None

    @translated("admin_scope")
    async def scope_of(self, record_id: int) -> bytes | None:
        row = await self._fetchrow(self._operator_pool, "admin_scope", id=record_id)
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
            self._operator_pool.acquire(timeout=self._options.acquire_timeout) as connection,
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
        remaining: int = await self._operator_pool.fetchval(
            QUERIES["rekey_remaining"].sql,
            *QUERIES["rekey_remaining"].arguments({"newest": keyring.current}),
        )
        return remaining

    @translated("admin_resolve_released")
    async def resolve_released(self, record_id: int) -> bool:
        return (
            await self._fetchrow(self._operator_pool, "admin_resolve_released", id=record_id)
            is not None
        )

    @translated("total_keys")
    async def total_keys(self) -> int:
        """Every row of the key table, expired ones not yet purged included."""
        keys: int = (await self._fetchrow(self._operator_pool, "total_keys"))["keys"]
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
        async with self._operator_pool.acquire(timeout=self._options.acquire_timeout) as connection:
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
        row = await self._fetchrow(self._operator_pool, "count_keys", after=after, page_size=limit)
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
        async with self._operator_pool.acquire(timeout=self._options.acquire_timeout) as connection:
            exists = await connection.fetchval("SELECT to_regclass('alembic_version')")
            if exists is None:
                return None
            revision: str | None = await connection.fetchval(
                "SELECT version_num FROM alembic_version"
            )
            return revision


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


# One operation of a batch, as the batcher queues it.


@dataclass(frozen=True, slots=True)
class _Wanted:
    route: str
    scope: bytes
    key: str
    fingerprint: bytes
    lease: float
    ttl: float


@dataclass(frozen=True, slots=True)
class _Reclaim:
    id: int
    token: int
    route: str
    fingerprint: bytes
    lease: float
    ttl: float


@dataclass(frozen=True, slots=True)
class _TakeOver:
    id: int
    token: int
    lease: float


@dataclass(frozen=True, slots=True)
class _Complete:
    id: int
    token: int
    status: int
    answer: SealedAnswer | None


@dataclass(frozen=True, slots=True)
class _Settle:
    id: int
    token: int


class _OnRow(Protocol):
    @property
    def id(self) -> int: ...
    @property
    def token(self) -> int: ...


Operation = TypeVar("Operation", bound=_OnRow)


def _once(batch: Sequence[Operation]) -> list[Operation]:
    """The operations to send: one per (row, token), the first, in id order (every batch writes
    its rows in one order, so two batches never deadlock). A copy gets what a second statement
    would: nothing, the first one did it."""
    first: dict[tuple[int, int], Operation] = {}
    for operation in batch:
        first.setdefault((operation.id, operation.token), operation)
    return sorted(first.values(), key=lambda operation: operation.id)


def _settled(
    batch: Sequence[Operation], sent: Sequence[Operation], rows: Sequence[asyncpg.Record]
) -> list[bool]:
    """Which operations settled their row: those whose (id, token) came back. A superseded
    token settles nothing, whatever the rest of the batch does."""
    done = {(row["id"], row["fencing_token"]) for row in rows}
    firsts = {id(operation) for operation in sent}
    return [id(operation) in firsts and (operation.id, operation.token) in done
            for operation in batch]  # fmt: skip


def _taken(
    batch: Sequence[Operation], sent: Sequence[Operation], rows: Sequence[asyncpg.Record]
) -> list[Claim | None]:
    """The claims won by a take-over or reclaim: the row came back with the token after the one
    it was read with."""
    taken = {(row["id"], row["fencing_token"] - 1): row["fencing_token"] for row in rows}
    firsts = {id(operation) for operation in sent}
    outcomes: list[Claim | None] = []
    for operation in batch:
        token = taken.get((operation.id, operation.token))
        won = token is not None and id(operation) in firsts
        outcomes.append(Claim(operation.id, token) if won and token is not None else None)
    return outcomes


def _answer_size(completing: _Complete) -> int:
    answer = completing.answer
    if answer is None:
        return 0
    return len(answer.body or b"") + len(answer.headers)


def _claimed_row(claim: Claim, wanted: _Wanted) -> Record:
    """The row a claim just made, as a copy of its key in the same batch sees it."""
    return Record(
        id=claim.record_id,
        token=claim.token,
        fingerprint=wanted.fingerprint,
        state="in_progress",
        status=None,
        headers=None,
        body=None,
        stored=False,
    )
