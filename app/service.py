"""The gateway's state machine (contract sections 4 and 5): claim -> forward -> settle.

Read `Gateway.handle` top to bottom:
1. A method not under control, or a missing key on a `key: optional` route, is forwarded
   untouched and nothing is stored.
2. Otherwise the key is parsed, its scope and the request's fingerprint computed, and the key
   claimed with one insert, which returns the existing row instead when there is one (one round
   trip either way). The unique constraint decides who owns it.
3. The owner forwards the request with no transaction open, then settles the key with its
   fencing token: `completed` with the answer, released (row deleted) when nothing was sent or the
   upstream asked for a retry, or `unknown` when the request may have been performed but the
   answer was lost. A token that was superseded settles nothing.
4. Anyone else gets the row, and `decide` (pure, no I/O) says what to do with it: an expired
   row is reclaimed as a new key; a different fingerprint is a reused key (422); a completed key
   is replayed; an in-flight one is 409 with Retry-After; an `unknown` one (including a claim
   whose lease ran out because its gateway died) is 409 until resolved, or with
   `on_unknown: forward` is taken over with a new token and forwarded again. A reclaim or a
   take-over that finds the row changed since it was read looks again, a few times at most.

Changing the lease rule (when an in-flight claim counts as abandoned) safely: the rule lives in
one SQL function, `oncegate_key_state` (migration 0005; change it with a new migration), which
every query and the admin API read states through; `decide` acts on the state it returns and
never on the clock, and `tests/store/test_conformance.py` runs the same cases against the
PostgreSQL store and the in-memory one (`store/memory.py`), whose `state_of` must say the same.
A route's lease must outlive its upstream timeout (`settings.Route`): shorter, and a slow but
live request would read as `unknown`, and be taken over under `on_unknown: forward`.

The forward and its settlement run in a task of their own, shielded from the request: a client
that hangs up does not cancel them, so its retry finds the answer stored. `drain` waits for
every such task at shutdown. If PostgreSQL is unreachable at claim time the request is refused
(503) and never forwarded; if it fails at settle time the caller still gets its answer and the
key turns `unknown` when its lease runs out: the safe direction.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import logging
import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from . import errors, fingerprint, headers, keys, metrics, sealing
from .routing import upstream_url
from .sealing import Keyring, Sealer
from .settings import ROUTE_NAME, Route
from .store import (
    LISTED_STATES,
    AdminStore,
    Claim,
    KeyRecord,
    Listed,
    QueuedKey,
    Record,
    Store,
)
from .store.notify import Watch
from .upstream import AnswerLost, NotSent, Upstream, UpstreamResponse

log = logging.getLogger(__name__)

# What a client waiting on an in-flight key should wait before asking again. Short, because most
# upstream calls take well under a second; clients back off further themselves.
IN_PROGRESS_RETRY_AFTER = 1
# Claim, read, claim again: the row can change between two statements (released, expired, taken
# over). Each lap means another request made progress, so a few laps are plenty.
CLAIM_ATTEMPTS = 5
# Bodies larger than this are fingerprinted in a worker thread; smaller ones hash in well under
# a millisecond, less than handing them to a thread costs.
OFF_LOOP_BODY = 1024 * 1024
# A waiting request looks at its row this often, in case a settle notification was lost: often
# enough that a lost one costs half a second, rare enough that a hundred waiters cost PostgreSQL
# two hundred cheap reads a second.
WAIT_POLL_INTERVAL = 0.5
PREFERENCE_APPLIED = "preference-applied"
# The purger deletes in bounded batches so each statement's locks and WAL stay small and claims
# on the same table never wait behind it; the pause between batches leaves room for traffic.
PURGE_BATCH_SIZE = 1000
PURGE_PAUSE = 0.05
# The gauge `oncegate_keys` is counted by a sweep over the table in primary-key pages: each
# statement reads at most this many rows (a few milliseconds), and the pause between pages
# leaves the database to the traffic, as the purger does.
KEY_COUNT_PAGE_SIZE = 5000
KEY_COUNT_PAUSE = 0.02
# One page of the operator's queue: enough for a screen, small enough to scan quickly.
QUEUE_PAGE_SIZE = 100
QUEUE_MAX_PAGE_SIZE = 1000


# Resolves when the client has hung up (the proxy port watches its connection).
ClientGoneProbe = Callable[[], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class ProxyRequest:
    method: str
    path: str  # normalized (paths.normalize), still percent-encoded
    query: str
    headers: Sequence[tuple[str, str]]  # names in lower case, values as received
    body: bytes
    client_gone: ClientGoneProbe | None = None

    def header_values(self, name: str) -> list[str]:
        return [value for header, value in self.headers if header == name]


@dataclass(slots=True)
class ProxyResponse:
    status: int
    headers: list[tuple[str, str]]
    body: bytes
    outcome: str
    # Set when the answer came from the store: the reason counted as a blocked duplicate.
    blocked: str | None = None
    upstream_seconds: float | None = field(default=None)


class Gateway:
    def __init__(self, store: Store, upstream: Upstream, keyring: Keyring | None = None) -> None:
        self._store = store
        self._upstream = upstream
        # Seals every stored answer when a keyring is set (ONCEGATE_ENCRYPTION_KEYS).
        self._sealer = Sealer(keyring)
        self._inflight: set[asyncio.Task[ProxyResponse]] = set()
        self._unopenable_logged: set[str] = set()

    async def handle(self, route: Route, request: ProxyRequest) -> ProxyResponse:
        if request.method not in route.methods:
            return await self._forward_unprotected(route, request, "passthrough")
        key = keys.parse(request.header_values(keys.HEADER))
        if key is None:
            if route.key == "optional":
                return await self._forward_unprotected(route, request, "unprotected")
            raise errors.MissingKey(
                f"{request.method} requests on route {route.name!r} need an Idempotency-Key "
                'header, e.g. Idempotency-Key: "8e03978e-40d5-43e8-bc93-6894a57f9324"'
            )
        scope = keys.scope(
            route.name, [request.header_values(name) for name in route.scope_headers]
        )
        digest = await _fingerprint(request)
        wait = _Wait.asked(request, route, self._store)
        try:
            response = await self._claim_or_answer(route, request, scope, key, digest, wait)
        except errors.GatewayError as error:
            if wait is not None and wait.used:
                error.headers[PREFERENCE_APPLIED] = wait.applied
            raise
        finally:
            if wait is not None:
                wait.end(route)
        if wait is not None and wait.used:
            response.headers = [*response.headers, (PREFERENCE_APPLIED, wait.applied)]
        return response

    async def _claim_or_answer(
        self,
        route: Route,
        request: ProxyRequest,
        scope: bytes,
        key: str,
        digest: bytes,
        wait: _Wait | None,
    ) -> ProxyResponse:
        laps = 0
        while laps < CLAIM_ATTEMPTS:
            found = await self._store.claim(
                route.name, scope, key, digest, route.lease_seconds, route.ttl
            )
            if found is None:
                # Held by a claim that committed while ours ran: read it now.
                found = await self._store.get(scope, key)
                if found is None:
                    laps += 1
                    continue  # and already released: claim again
            if isinstance(found, Record):
                decision = decide(found, digest, route, self._sealer, scope)
                if isinstance(decision, Replay):
                    return decision.response
                if isinstance(decision, Refuse):
                    self._log_sealed(decision.error)
                    in_flight = isinstance(decision.error, errors.RequestInProgress)
                    if (
                        in_flight
                        and wait is not None
                        and await wait.until_settled(found, scope, key)
                    ):
                        continue  # it settled (or changed): answer as if we came after it
                    raise decision.error
                if isinstance(decision, Reclaim):
                    claimed = await self._store.reclaim_expired(
                        found, route.name, digest, route.lease_seconds, route.ttl
                    )
                else:
                    claimed = await self._store.take_over(found, route.lease_seconds)
                if claimed is None:
                    laps += 1
                    continue  # it changed since we read it: look again
                found = claimed
            return await self._forward_protected(route, request, found, scope)
        raise errors.RequestInProgress(
            "this Idempotency-Key changed hands several times while we looked at it; retry",
            headers={"Retry-After": str(IN_PROGRESS_RETRY_AFTER)},
        )

    def _log_sealed(self, error: errors.GatewayError) -> None:
        """Say once per key name that stored answers cannot be opened: an operator must add
        the key; every retry meanwhile gets 503 answer-sealed."""
        if isinstance(error, errors.AnswerSealed) and error.key_name not in self._unopenable_logged:
            self._unopenable_logged.add(error.key_name)
            log.error("stored answers sealed with key %r cannot be opened: %s", error.key_name,
                      error.reason)  # fmt: skip

    async def _forward_protected(
        self, route: Route, request: ProxyRequest, claim: Claim, scope: bytes
    ) -> ProxyResponse:
        task = asyncio.create_task(self._forward_and_settle(route, request, claim, scope))
        self._inflight.add(task)
        task.add_done_callback(self._forget)
        return await asyncio.shield(task)

    def _forget(self, task: asyncio.Task[ProxyResponse]) -> None:
        self._inflight.discard(task)
        if not task.cancelled():
            # Retrieve the result so an answer nobody waits for (the client hung up) is not
            # reported as "never retrieved"; the store already holds what matters.
            task.exception()

    async def drain(self) -> None:
        """Wait for every forward in flight to finish and be settled."""
        while self._inflight:
            await asyncio.gather(*self._inflight, return_exceptions=True)

    async def _forward_and_settle(
        self, route: Route, request: ProxyRequest, claim: Claim, scope: bytes
    ) -> ProxyResponse:
        try:
            response = await self._send(route, request)
        except NotSent as exc:
            await self._settle("release", self._store.release(claim))
            raise errors.UpstreamUnavailable(
                f"the upstream of route {route.name!r} could not be reached; nothing was sent, "
                "the key was released, and a retry with the same key is safe"
            ) from exc
        except AnswerLost as exc:
            await self._settle("mark_unknown", self._store.mark_unknown(claim))
            raise errors.OutcomeUnknown(
                f"the upstream of route {route.name!r} received the request but its answer was "
                f"{'not back in time' if exc.timed_out else 'lost'}; it may have been performed. "
                "Retries get 409 until an operator resolves the key",
                status=504 if exc.timed_out else 502,
            ) from exc
        if response.status in route.release_statuses:
            await self._settle("release", self._store.release(claim))
            return _answer(response, "released")
        answer = None  # too large to store: the status alone
        if len(response.body) <= route.max_stored_response:
            body = response.body if route.store == "full" else b""
            answer = self._sealer.seal(
                claim.record_id, scope, headers.storable(response.headers), body
            )
        await self._settle("complete", self._store.complete(claim, response.status, answer))
        return _answer(response, "forwarded")

    async def _forward_unprotected(
        self, route: Route, request: ProxyRequest, outcome: str
    ) -> ProxyResponse:
        try:
            response = await self._send(route, request)
        except NotSent as exc:
            raise errors.UpstreamUnavailable(
                f"the upstream of route {route.name!r} could not be reached"
            ) from exc
        except AnswerLost as exc:
            raise errors.OutcomeUnknown(
                f"the upstream of route {route.name!r} did not answer"
                f"{' in time' if exc.timed_out else ''}",
                status=504 if exc.timed_out else 502,
            ) from exc
        return _answer(response, outcome)

    async def _send(self, route: Route, request: ProxyRequest) -> UpstreamResponse:
        inflight = metrics.INFLIGHT.labels(route.name)
        inflight.inc()
        url = upstream_url(route, request.path, request.query)
        try:
            response = await self._upstream.send(
                request.method, url, request.headers, request.body, route.timeout
            )
        except (NotSent, AnswerLost) as exc:
            # The address is for the operator's log; the client's answer names the route only.
            log.warning(
                "route %s: %s %s: %s: %s",
                route.name, request.method, route.upstream, type(exc).__name__, exc,
            )  # fmt: skip
            raise
        finally:
            inflight.dec()
        metrics.UPSTREAM_REQUEST_DURATION.labels(route.name).observe(response.duration)
        return response

    async def _settle(self, operation: str, settlement: Awaitable[bool]) -> None:
        """Run a store write after the upstream answered. The caller gets the upstream's answer
        whatever happens here: it was performed, and hiding it would only cause a retry."""
        try:
            settled = await settlement
        except errors.StoreUnavailable:
            log.error(
                "could not %s a key after the upstream answered: the store is unavailable; "
                "the key turns unknown when its lease runs out",
                operation,
            )
            return
        if not settled:
            log.warning(
                "could not %s a key: its claim was taken over (fencing token superseded)",
                operation,
            )


async def _fingerprint(request: ProxyRequest) -> bytes:
    arguments = (
        request.method,
        request.path,
        request.query,
        next(iter(request.header_values("content-type")), None),
        request.body,
    )
    if len(request.body) <= OFF_LOOP_BODY:
        return fingerprint.compute(*arguments)
    # SHA-256 releases the GIL over large buffers, so a worker thread hashes a large body
    # without holding up the requests on the event loop (10 MiB: about 10 ms of hashing).
    return await asyncio.to_thread(fingerprint.compute, *arguments)


class ClientGone(Exception):
    """The client hung up while its request waited (`Prefer: wait`): nobody is left to answer,
    and nothing was claimed for it."""


class _Wait:
    """A request's `Prefer: wait=N` (contract section 9): while its key is in flight, it waits,
    up to N seconds and the route's `max_wait`, for the key to settle, then is answered as if it
    had arrived afterwards. Woken by the store's settle notification; it also polls the row, so
    a lost notification costs time, not the answer. It holds no pooled connection while it
    waits, and stops when the client hangs up."""

    def __init__(self, seconds: int, store: Store, client_gone: ClientGoneProbe | None) -> None:
        self._store = store
        self.applied = f"wait={seconds}"
        self.used = False
        loop = asyncio.get_running_loop()
        self._deadline = loop.time() + seconds
        self._spent = 0.0
        self._client_gone = client_gone
        self._gone: asyncio.Future[None] | None = None  # watching the client, once it waits

    @classmethod
    def asked(cls, request: ProxyRequest, route: Route, store: Store) -> _Wait | None:
        requested = headers.requested_wait(request.header_values(headers.PREFER))
        if not requested:
            return None
        return cls(min(requested, math.ceil(route.max_wait)), store, request.client_gone)

    async def until_settled(self, record: Record, scope: bytes, key: str) -> bool:
        """Wait for `record`'s claim to settle: True when it did (or changed), False when the
        time ran out with it still in flight."""
        loop = asyncio.get_running_loop()
        if self._deadline <= loop.time():
            return False
        self.used = True
        started = loop.time()
        watch = self._store.watch(record.id)
        try:
            if not await self._store.mark_waited(record):
                return True  # settled between our read and now
            while (remaining := self._deadline - loop.time()) > 0:
                if await self._woken(watch, min(WAIT_POLL_INTERVAL, remaining)):
                    return True
                now = await self._store.get(scope, key)
                if now is None or now.token != record.token or now.state != "in_progress":
                    return True
            return False
        finally:
            watch.close()
            self._spent += loop.time() - started

    async def _woken(self, watch: Watch, timeout: float) -> bool:  # noqa: ASYNC109 - a poll
        if self._client_gone is None:
            return await watch.wait(timeout)
        if self._gone is None:
            self._gone = asyncio.ensure_future(self._client_gone())
        gone = self._gone
        woken = asyncio.ensure_future(watch.wait(timeout))
        racing: list[asyncio.Future[Any]] = [woken, gone]
        await asyncio.wait(racing, return_when=asyncio.FIRST_COMPLETED)
        if gone.done():
            woken.cancel()
            raise ClientGone
        return woken.result()

    def end(self, route: Route) -> None:
        if self._gone is not None:
            self._gone.cancel()
        if self.used:
            metrics.WAIT_DURATION.labels(route.name).observe(self._spent)


@dataclass(frozen=True, slots=True)
class Replay:
    """Answer with the stored response."""

    response: ProxyResponse


@dataclass(frozen=True, slots=True)
class Refuse:
    """Answer with this problem; nothing is forwarded."""

    error: errors.GatewayError


@dataclass(frozen=True, slots=True)
class Reclaim:
    """The key expired: claim its row as a new key, then forward."""


@dataclass(frozen=True, slots=True)
class TakeOver:
    """The outcome is unknown and the route says `on_unknown: forward`: take the row over with
    a new fencing token, then forward again."""


Decision = Replay | Refuse | Reclaim | TakeOver


def decide(
    record: Record,
    fingerprint: bytes,
    route: Route,
    sealer: Sealer,
    scope: bytes,
) -> Decision:
    """What to do with a request whose key someone claimed before (contract sections 4 and 5).
    Pure: `Gateway.handle` applies the decision through the store. A sealed answer is opened
    by `sealer`, bound to the row's id and `scope`."""
    if record.state == "expired":
        return Reclaim()  # a new key, whatever was sent under it before
    if record.fingerprint != fingerprint:
        return Refuse(
            errors.KeyReused(
                "this Idempotency-Key was first used with a different request (method, path, "
                "query or body); use a new key for a new request"
            )
        )
    if record.state == "completed":
        return _replay(record, sealer, scope)
    if record.state == "in_progress":
        return Refuse(
            errors.RequestInProgress(
                "a request with this Idempotency-Key is still being processed; retry later",
                headers={"Retry-After": str(IN_PROGRESS_RETRY_AFTER)},
            )
        )
    if route.on_unknown == "forward":
        return TakeOver()
    return Refuse(
        errors.OutcomeUnknown(
            "the request with this Idempotency-Key may have been performed, but its answer was "
            "lost; an operator must resolve the key before it can be answered"
        )
    )


def _replay(record: Record, sealer: Sealer, scope: bytes) -> Replay | Refuse:
    assert record.status is not None
    if not record.stored:
        return Refuse(
            errors.ResponseNotStored(
                f"the request with this Idempotency-Key completed with status {record.status}, "
                "but its response was larger than max_stored_response and cannot be replayed; "
                "it was not performed again"
            )
        )
    body: bytes | None
    if record.sealed_with is None:
        assert record.headers is not None and record.body is not None
        answer_headers, body = list(record.headers), record.body
    else:
        try:
            answer_headers, body = sealer.open(record.id, scope, record.stored_answer())
        except sealing.Unopenable as exc:
            return Refuse(
                errors.AnswerSealed(
                    f"the request with this Idempotency-Key was performed (status "
                    f"{record.status}), but its stored answer cannot be opened; it is replayed "
                    "once the gateway has its key. It will not be performed again",
                    key_name=exc.key_name,
                    reason=str(exc),
                )
            )
    return Replay(
        ProxyResponse(
            status=record.status,
            headers=[*answer_headers, headers.REPLAYED],
            body=body or b"",
            outcome="replayed",
            blocked="replayed",
        )
    )


def _answer(response: UpstreamResponse, outcome: str) -> ProxyResponse:
    return ProxyResponse(
        status=response.status,
        headers=response.headers,
        body=response.body,
        outcome=outcome,
        upstream_seconds=response.duration,
    )


class Operator:
    """What an operator may do to keys, for the admin API, its page and `oncegate keys` (contract
    sections 6 and 9): look a key up in every scope, list the queue of keys in a state, release
    a key, or settle an `unknown` one. The rules are here, not in the HTTP layer: a key in
    flight is never released under its request, only an `unknown` key is resolved, and input
    that cannot name a key never reaches the store. With a keyring, the answers it stores
    are sealed and the ones it shows are opened."""

    def __init__(self, store: AdminStore, keyring: Keyring | None = None) -> None:
        self._store = store
        self._sealer = Sealer(keyring)

    def opened(self, record: KeyRecord) -> tuple[list[tuple[str, str]] | None, bytes | None]:
        """A record's stored headers and body, opened; (None, None) when they cannot be."""
        if record.sealed_with is None:
            return (None if record.headers is None else list(record.headers)), record.body
        try:
            return self._sealer.open(record.id, record.scope, record.stored_answer())
        except sealing.Unopenable:
            return None, None

    async def queue(
        self,
        state: str,
        route: str | None = None,
        since: datetime | None = None,
        cursor: str | None = None,
        limit: int = QUEUE_PAGE_SIZE,
    ) -> QueuePage:
        """Keys in `state` (the operator's queue: `unknown`), oldest first, one page. The
        cursor is opaque to clients: the (created_at, id) of the last key of a page, so a page
        is never shifted by keys settled or added while an operator reads the one before."""
        listed = _listed(state)
        _check_route(route)
        if since is not None and since.tzinfo is None:
            raise errors.InvalidRequest(
                "since needs a time zone, e.g. 2026-12-03T06:00:00Z, so it names one moment"
            )
        if not 0 < limit <= QUEUE_MAX_PAGE_SIZE:
            raise errors.InvalidRequest(f"limit must be 1 to {QUEUE_MAX_PAGE_SIZE}")
        after = decode_cursor(cursor) if cursor is not None else None
        # One more than asked for says whether another page follows.
        found = await self._store.queue(listed, route, since, after, limit + 1)
        records = found[:limit]
        return QueuePage(records, encode_cursor(records[-1]) if len(found) > limit else None)

    async def describe(self, record_id: int) -> QueuedKey:
        found = await self._store.describe(_existing_id(record_id))
        if found is None:
            raise errors.NotFound(f"no key with id {record_id}")
        return found

    async def find(self, key: str, route: str | None) -> list[KeyRecord]:
        if not 0 < len(key) <= keys.MAX_KEY_LENGTH or not (key.isascii() and key.isprintable()):
            raise errors.InvalidRequest(
                f"key must be 1 to {keys.MAX_KEY_LENGTH} printable ASCII characters, as every "
                "Idempotency-Key is"
            )
        _check_route(route)
        return await self._store.find(key, route)

    async def release(self, record_id: int) -> None:
        deleted = await self._store.delete(_existing_id(record_id))
        if deleted is None:
            raise errors.NotFound(f"no key with id {record_id}")
        if not deleted:
            raise errors.KeyInFlight(
                f"key {record_id} has a request in flight; deleting it now would let a retry be "
                "forwarded while the first is still at the upstream. Try again when it has "
                "settled."
            )

    async def resolve(
        self, record_id: int, answer: tuple[int, Sequence[tuple[str, str]], bytes] | None
    ) -> None:
        """Settle an `unknown` key: as completed with `answer` (status, headers, body), or
        released when `answer` is None."""
        record_id = _existing_id(record_id)
        scope = await self._store.scope_of(record_id)
        if scope is None:
            raise errors.NotFound(f"no key with id {record_id}")
        if answer is None:
            settled = await self._store.resolve_released(record_id)
        else:
            status, answer_headers, body = answer
            # Content-Length is recomputed on replay, and credentials are never stored.
            storable = headers.storable(answer_headers)
            sealed = self._sealer.seal(record_id, scope, storable, body)
            settled = await self._store.resolve_completed(record_id, status, sealed)
        if not settled:
            raise errors.KeyNotUnknown(f"key {record_id} does not exist or is not in state unknown")


@dataclass(frozen=True, slots=True)
class QueuePage:
    records: list[QueuedKey]
    cursor: str | None  # where the next page starts; None on the last page


def _check_route(route: str | None) -> None:
    if route is not None and not ROUTE_NAME.match(route):
        raise errors.InvalidRequest(f"route must be a route name ({ROUTE_NAME.pattern})")


def _listed(state: str) -> Listed:
    for listed in LISTED_STATES:
        if state == listed:
            return listed
    raise errors.InvalidRequest(f"state must be one of {', '.join(LISTED_STATES)}")


def encode_cursor(record: QueuedKey) -> str:
    text = f"{record.created_at.isoformat()}|{record.id}"
    return base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")


def decode_cursor(cursor: str) -> tuple[datetime, int]:
    try:
        text = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
        moment, _, number = text.partition("|")
        after = (datetime.fromisoformat(moment), int(number))
    except (binascii.Error, UnicodeDecodeError, ValueError):
        raise errors.InvalidRequest(
            "cursor is not one this gateway gave out: pass the `cursor` of the previous page "
            "unchanged"
        ) from None
    if after[0].tzinfo is None or not 0 < after[1] < 2**63:
        raise errors.InvalidRequest("cursor is not one this gateway gave out")
    return after


def _existing_id(record_id: int) -> int:
    """Row ids are positive 64-bit integers: any other number names no key."""
    if not 0 < record_id < 2**63:
        raise errors.NotFound(f"no key with id {record_id}: key ids are positive 64-bit integers")
    return record_id


async def purge_expired(
    store: Store, batch_size: int = PURGE_BATCH_SIZE, pause: float = PURGE_PAUSE
) -> int:
    """Delete every expired key, one bounded batch at a time; return how many."""
    total = 0
    while True:
        deleted = await store.purge(batch_size)
        total += deleted
        metrics.KEYS_PURGED.inc(deleted)
        if deleted < batch_size:
            return total
        await asyncio.sleep(pause)


async def count_keys(
    store: AdminStore,
    page_size: int = KEY_COUNT_PAGE_SIZE,
    pause: float = KEY_COUNT_PAUSE,
) -> dict[Listed, int]:
    """Count every key by state, one bounded page at a time, then set `oncegate_keys{state}`.

    The gauge changes once per sweep, to the sweep's totals, never to a half-counted figure.
    A key that changes state while the sweep runs is counted as it was when its page was read."""
    totals: dict[Listed, int] = dict.fromkeys(LISTED_STATES, 0)
    after = 0
    while True:
        page = await store.count_keys(after, page_size)
        for state, count in page.counts.items():
            totals[state] += count
        if page.last_id is None or page.rows < page_size:
            break
        after = page.last_id
        await asyncio.sleep(pause)
    for state, count in totals.items():
        metrics.KEYS.labels(state).set(count)
    return totals
