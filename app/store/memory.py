"""An in-memory key store (every port of `service.ports` on one object), for pure tests of the
state machine in one process, and for the bench's instrument that measures the gateway without
its store (bench/memory_gateway.py).

It is never the gateway's store: it forgets everything on exit and knows no other process. It
exists so that `service.Gateway` can be driven through laps no timing makes happen on demand
against PostgreSQL, and it passes the same conformance suite as the PostgreSQL store
(`tests/store/test_conformance.py`), so what the tests show of the service holds on both.

`key_state` is `oncegate_key_state` (migrations/schema.sql) in Python; tests/store/
test_state_rule.py runs the two on one clock over every case.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Literal

from ..model.answers import SealedRequest, StoredAnswer
from ..model.records import (
    Cause,
    Claim,
    KeyCount,
    KeyRecord,
    Listed,
    QueuedKey,
    Record,
    Replication,
    State,
)
from ..telemetry import metrics
from . import claimant
from .notify import Watch, Watchers


@dataclass(frozen=True, slots=True)
class _Row:
    id: int
    route: str
    scope: bytes
    key: str
    fingerprint: bytes
    state: Literal["in_progress", "completed", "unknown"]  # what the last writer did
    token: int
    lease_expires_at: float | None
    expires_at: float
    created_at: float
    completed_at: float | None = None
    answer: StoredAnswer | None = None
    request: SealedRequest | None = None  # kept until the key completes
    claimed_by: str | None = None
    failure: str | None = None
    waited: bool = False  # someone waits for it to settle (`mark_waited`): a settle notifies


def key_state(
    stored: Literal["in_progress", "completed", "unknown"],
    lease_expires_at: float | None,
    expires_at: float,
    now: float,
) -> State:
    """`oncegate_key_state` (migrations/schema.sql) in Python, on the same arguments: the
    stored state, the lease's and the TTL's ends, and the moment (seconds since the epoch).
    tests/store/test_state_rule.py runs both on one clock over every case."""
    if stored == "in_progress" and lease_expires_at is not None and lease_expires_at > now:
        return "in_progress"
    if expires_at <= now:
        return "expired"
    if stored == "in_progress":
        return "unknown"  # its lease ran out: its gateway died
    return stored


def state_of(row: _Row, now: float) -> State:
    return key_state(row.state, row.lease_expires_at, row.expires_at, now)


class MemoryStore:
    """The service's ports on a dict. `clock` gives seconds (wall time by default).

    `capacity`: at most this many keys; a claim beyond it first drops the oldest key, if it is
    settled. For bench/memory_gateway.py, whose store lives through a whole benchmark: the
    gateway keeps none of its keys in its own process, and neither should the instrument that
    stands in for it. Unbounded by default."""

    def __init__(self, clock: Callable[[], float] = time.time, capacity: int | None = None) -> None:
        self._clock = clock
        self._capacity = capacity
        self._rows: dict[tuple[bytes, str], _Row] = {}
        # Where each row is, by id: a row keeps its id and its place from its claim to its end.
        self._places: dict[int, tuple[bytes, str]] = {}
        self._ids = itertools.count(1)
        self._watchers = Watchers()
        self._ended_sessions: dict[bytes, float] = {}
        self._claimant = claimant()  # who claims keys here: this process

    def watch(self, record_id: int) -> Watch:
        return self._watchers.watch(record_id)

    def claims_idle(self) -> bool:
        return True  # no statement for a claim to wait behind

    async def renew(self, claim: Claim, lease: float) -> bool:
        await self._yield()
        now = self._clock()
        row = self._by_id(claim.id)
        if row is None or row.token != claim.token or state_of(row, now) != "in_progress":
            return False
        self._rows[(row.scope, row.key)] = replace(
            row, lease_expires_at=now + lease, expires_at=max(row.expires_at, now + lease + 1)
        )
        return True

    async def mark_waited(self, record: Record) -> bool:
        await self._yield()
        row = self._by_id(record.id)
        now = self._clock()
        if row is None or row.token != record.token or state_of(row, now) != "in_progress":
            return False
        self._rows[(row.scope, row.key)] = replace(row, waited=True)
        return True

    def _settled(self, row: _Row) -> None:
        if row.waited:  # as the SQL does: a settle notifies only rows someone waits on
            self._watchers.settled(row.id)

    async def _yield(self) -> None:
        # Every operation is a round trip in the real store: let other tasks run in between.
        await asyncio.sleep(0)

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
        await self._yield()
        existing = self._rows.get((scope, key))
        if existing is not None:
            return self._record(existing)
        now = self._clock()
        row = _Row(
            id=next(self._ids), route=route, scope=scope, key=key, fingerprint=fingerprint,
            state="in_progress", token=1, lease_expires_at=now + lease, expires_at=now + ttl,
            created_at=now, request=request, claimed_by=self._claimant,
        )  # fmt: skip
        if self._capacity is not None and len(self._rows) >= self._capacity:
            oldest = next(iter(self._rows.values()))  # a dict keeps its keys in claim order
            if state_of(oldest, now) != "in_progress":
                self._delete(oldest)
        self._rows[(scope, key)] = row
        self._places[row.id] = (scope, key)
        return Claim(row.id, row.token, row.key)

    async def get(self, scope: bytes, key: str) -> Record | None:
        await self._yield()
        row = self._rows.get((scope, key))
        return self._record(row) if row is not None else None

    async def reclaim_expired(
        self,
        record: Record,
        route: str,
        fingerprint: bytes,
        lease: float,
        ttl: float,
        request: SealedRequest | None = None,
    ) -> Claim | None:
        await self._yield()
        now = self._clock()
        row = self._by_id(record.id)
        if row is None or row.token != record.token or state_of(row, now) != "expired":
            return None
        fresh = _Row(
            id=row.id, route=route, scope=row.scope, key=row.key, fingerprint=fingerprint,
            state="in_progress", token=row.token + 1, lease_expires_at=now + lease,
            expires_at=now + ttl, created_at=now, request=request, claimed_by=self._claimant,
        )  # fmt: skip
        self._rows[(row.scope, row.key)] = fresh
        return Claim(fresh.id, fresh.token, fresh.key)

    async def take_over(self, record: Record, lease: float) -> Claim | None:
        await self._yield()
        now = self._clock()
        row = self._by_id(record.id)
        if row is None or row.token != record.token or state_of(row, now) != "unknown":
            return None
        taken = replace(
            row,
            state="in_progress",
            token=row.token + 1,
            lease_expires_at=now + lease,
            expires_at=max(row.expires_at, now + lease + 1),
            claimed_by=self._claimant,
            failure=None,
        )
        self._rows[(row.scope, row.key)] = taken
        return Claim(taken.id, taken.token, taken.key)

    async def complete(self, claim: Claim, answer: StoredAnswer) -> bool:
        await self._yield()
        row = self._held(claim, ("in_progress", "unknown"))
        if row is None:
            return False
        self._rows[(row.scope, row.key)] = replace(
            row,
            state="completed",
            answer=answer,
            completed_at=self._clock(),
            lease_expires_at=None,
            request=None,
            claimed_by=None,
        )
        self._settled(row)
        return True

    async def release(self, claim: Claim) -> bool:
        await self._yield()
        row = self._held(claim, ("in_progress",))
        if row is None:
            return False
        self._delete(row)
        self._settled(row)
        return True

    async def mark_unknown(self, claim: Claim, failure: str | None = None) -> bool:
        await self._yield()
        row = self._held(claim, ("in_progress",))
        if row is None:
            return False
        self._rows[(row.scope, row.key)] = replace(
            row, state="unknown", lease_expires_at=None, failure=failure
        )
        self._settled(row)
        return True

    async def purge(self, batch_size: int) -> int:
        await self._yield()
        now = self._clock()
        doomed = [place for place, row in self._rows.items() if state_of(row, now) == "expired"]
        for place in doomed[:batch_size]:
            self._delete(self._rows[place])
        return min(len(doomed), batch_size)

    async def schema_revision(self) -> str | None:
        return None

    async def replication(self) -> Replication:
        return Replication(standbys=0, synchronous=0, synchronous_standby_names="",
                           synchronous_commit="on")  # fmt: skip

    async def take_key_count(self) -> bool:
        return True  # one process, its own keys

    async def publish_key_count(self, totals: dict[Listed, int]) -> None:
        for state, count in totals.items():
            metrics.KEYS.labels(state).set(count)

    async def end_session(self, session: bytes, expires_at: datetime) -> None:
        await self._yield()
        now = self._clock()
        for ended in [name for name, ends in self._ended_sessions.items() if ends < now]:
            del self._ended_sessions[ended]
        self._ended_sessions.setdefault(session, expires_at.timestamp())

    async def session_ended(self, session: bytes) -> bool:
        await self._yield()
        return session in self._ended_sessions

    async def find(self, key: str, route: str | None) -> list[KeyRecord]:
        await self._yield()
        return [
            self._key_record(row)
            for row in sorted(self._rows.values(), key=lambda row: row.id)
            if row.key == key and (route is None or row.route == route)
        ]

    async def by_id(self, record_id: int) -> KeyRecord | None:
        await self._yield()
        row = self._by_id(record_id)
        return None if row is None else self._key_record(row)

    def _key_record(self, row: _Row) -> KeyRecord:
        return KeyRecord(
            id=row.id,
            route=row.route,
            scope=row.scope,
            key=row.key,
            state=state_of(row, self._clock()),
            answer=row.answer,
            created_at=_datetime(row.created_at),
            completed_at=None if row.completed_at is None else _datetime(row.completed_at),
            expires_at=_datetime(row.expires_at),
            token=row.token,
            request=row.request,
            claimed_by=row.claimed_by,
            failure=row.failure,
            fingerprint=row.fingerprint,
        )

    async def delete(self, record_id: int) -> bool | None:
        await self._yield()
        row = self._by_id(record_id)
        if row is None:
            return None
        if state_of(row, self._clock()) == "in_progress":
            return False
        self._delete(row)
        return True

    async def resolve_completed(self, record_id: int, token: int, answer: StoredAnswer) -> bool:
        await self._yield()
        now = self._clock()
        row = self._by_id(record_id)
        if row is None or row.token != token or state_of(row, now) != "unknown":
            return False
        self._rows[(row.scope, row.key)] = replace(
            row,
            state="completed",
            token=row.token + 1,
            lease_expires_at=None,
            answer=answer,
            completed_at=now,
            request=None,
            claimed_by=None,
        )
        return True

    async def scope_of(self, record_id: int) -> tuple[bytes, int] | None:
        await self._yield()
        row = self._by_id(record_id)
        return None if row is None else (row.scope, row.token)

    async def resolve_released(self, record_id: int) -> bool:
        await self._yield()
        row = self._by_id(record_id)
        if row is None or state_of(row, self._clock()) != "unknown":
            return False
        self._delete(row)
        return True

    async def queue(
        self,
        state: Listed,
        route: str | None,
        since: datetime | None,
        after: tuple[datetime, int] | None,
        limit: int,
    ) -> list[QueuedKey]:
        await self._yield()
        now = self._clock()
        found = sorted(
            (
                self._queued(row, now)
                for row in self._rows.values()
                if state_of(row, now) == state and (route is None or row.route == route)
            ),
            key=lambda queued: (queued.created_at, queued.id),
        )
        return [
            queued
            for queued in found
            if (since is None or queued.created_at >= since)
            and (after is None or (queued.created_at, queued.id) > after)
        ][:limit]

    async def describe(self, record_id: int) -> QueuedKey | None:
        await self._yield()
        row = self._by_id(record_id)
        return self._queued(row, self._clock()) if row is not None else None

    async def count_keys(self, after: int, limit: int) -> KeyCount:
        await self._yield()
        now = self._clock()
        rows = sorted(self._rows.values(), key=lambda row: row.id)
        page = [row for row in rows if row.id > after][:limit]
        counts: dict[Listed, int] = {"in_progress": 0, "completed": 0, "unknown": 0}
        for row in page:
            state = state_of(row, now)
            if state != "expired":
                counts[state] += 1
        return KeyCount(
            last_id=page[-1].id if page else None,
            rows=len(page),
            counts=counts,
            last=len(page) < limit,
        )

    def _queued(self, row: _Row, now: float) -> QueuedKey:
        state = state_of(row, now)
        cause: Cause | None = None
        if state == "unknown":
            cause = "answer_lost" if row.state == "unknown" else "lease_expired"
        return QueuedKey(
            id=row.id,
            route=row.route,
            key=row.key,
            state=state,
            cause=cause,
            status=None if row.answer is None else row.answer.status,
            created_at=_datetime(row.created_at),
            lease_expires_at=None
            if row.lease_expires_at is None
            else _datetime(row.lease_expires_at),
            completed_at=None if row.completed_at is None else _datetime(row.completed_at),
            expires_at=_datetime(row.expires_at),
        )

    def _by_id(self, record_id: int) -> _Row | None:
        place = self._places.get(record_id)
        return None if place is None else self._rows.get(place)

    def _delete(self, row: _Row) -> None:
        del self._rows[(row.scope, row.key)]
        del self._places[row.id]

    def _held(self, claim: Claim, states: tuple[str, ...]) -> _Row | None:
        row = self._by_id(claim.id)
        if (
            row is None
            or (row.key, row.token) != (claim.key, claim.token)
            or row.state not in states
        ):
            return None
        return row

    def _record(self, row: _Row) -> Record:
        return Record(
            id=row.id,
            token=row.token,
            key=row.key,
            fingerprint=row.fingerprint,
            state=state_of(row, self._clock()),
            answer=row.answer,
        )


def _datetime(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, UTC)
