"""Waiting for a key in flight to settle (`Prefer: wait=N`, contract section 9, and a route's
`wait`, section 10).

Invariants:
- A request waits only when it asked (`Prefer: wait=N`, N capped by `max_wait`; `wait=0` is no
  wait) or, when it did not ask, for its route's `wait`. Only an answer to a request that asked
  carries `Preference-Applied`.
- Waiting is bounded per gateway process (`WaitingRoom`): at most `max_waiters` requests wait,
  and at most `max_waiters_per_key` on one key. The one over a bound is answered as it would be
  without waiting (409 request-in-progress, Retry-After): a flood of duplicates costs one
  answer each, never a task, a watch and a poll each.
- A waiter holds no pooled connection. A request that finds no duplicate in flight pays for
  waiting with the parse of `Prefer` and, on a route with `wait`, one small object: no store
  call, no task, no notification (bench/run.py's `wait` row)."""

from __future__ import annotations

import asyncio
import math
from typing import Any

from ..kernel import headers
from ..model.records import Record
from ..settings import Route
from ..store.notify import Watch
from ..telemetry import metrics
from .messages import ClientGoneProbe, ProxyRequest
from .ports import RequestStore

# A waiting request looks at its row this often, in case a settle notification was lost: often
# enough that a lost one costs half a second, rare enough that a hundred waiters cost PostgreSQL
# two hundred cheap reads a second.
WAIT_POLL_INTERVAL = 0.5
PREFERENCE_APPLIED = "preference-applied"


class ClientGone(Exception):
    """The client hung up while its request waited (`Prefer: wait`): nobody is left to answer,
    and nothing was claimed for it."""


class WaitingRoom:
    """Who waits in this process: at most `most` in all and `most_per_key` on one row."""

    def __init__(self, most: int, most_per_key: int) -> None:
        self._most = most
        self._most_per_key = most_per_key
        self._total = 0
        self._by_row: dict[int, int] = {}

    def enter(self, record_id: int) -> bool:
        """Take a place to wait on row `record_id`; False when there is none."""
        on_row = self._by_row.get(record_id, 0)
        if self._total >= self._most or on_row >= self._most_per_key:
            return False
        self._total += 1
        self._by_row[record_id] = on_row + 1
        return True

    def leave(self, record_id: int) -> None:
        self._total -= 1
        left = self._by_row[record_id] - 1
        if left:
            self._by_row[record_id] = left
        else:
            del self._by_row[record_id]

    @property
    def waiting(self) -> int:
        return self._total


class Wait:
    """A request's `Prefer: wait=N` (contract section 9), or its route's `wait` (section 10):
    while its key is in flight, it waits, up to N seconds and the route's `max_wait`, for the key
    to settle, then is answered as if it had arrived afterwards. Woken by the store's settle
    notification; it also polls the row, so a lost notification costs time, not the answer. It
    holds no pooled connection while it waits, and stops when the client hangs up."""

    def __init__(
        self,
        seconds: float,
        route_name: str,
        store: RequestStore,
        room: WaitingRoom,
        client_gone: ClientGoneProbe | None,
        applied: str | None,
    ) -> None:
        self._route_name = route_name
        self._store = store
        self._room = room
        # `Preference-Applied`'s value, for a request that asked (`Prefer: wait=N`).
        self.applied = applied
        self.used = False
        loop = asyncio.get_running_loop()
        self._deadline = loop.time() + seconds
        self._spent = 0.0
        self._client_gone = client_gone
        self._gone: asyncio.Future[None] | None = None  # watching the client, once it waits

    @classmethod
    def asked(
        cls, request: ProxyRequest, route: Route, store: RequestStore, room: WaitingRoom
    ) -> Wait | None:
        """How this request waits: as it asked, else as its route says; None: it does not."""
        requested = headers.requested_wait(request.header_values(headers.PREFER))
        if requested is None:
            if not route.wait:
                return None
            return cls(route.wait, route.name, store, room, request.client_gone, applied=None)
        if not requested:
            return None  # `Prefer: wait=0`: answer at once, whatever the route's `wait`
        # Never past the route's max_wait; the header says whole seconds (RFC 7240's `wait`), so
        # a max_wait of 1.5 s waits 1.5 s and says wait=1.
        seconds = min(float(requested), route.max_wait)
        applied = f"wait={math.floor(seconds)}"
        return cls(seconds, route.name, store, room, request.client_gone, applied=applied)

    async def until_settled(self, record: Record, scope: bytes, key: str) -> bool:
        """Wait for `record`'s claim to settle: True when it did (or changed), False when the
        time ran out with it still in flight."""
        loop = asyncio.get_running_loop()
        if self._deadline <= loop.time():
            return False
        if not self._room.enter(record.id):
            # Too many wait already: answered as if it had not asked.
            metrics.WAITS_REFUSED.labels(self._route_name).inc()
            return False
        self.used = True
        started = loop.time()
        watch = self._store.watch(record.id)
        try:
            if not await self._store.mark_waited(record):
                return True  # settled between our read and now
            while (remaining := self._deadline - loop.time()) > 0:
                # Woken or not, look at the row: a wake-up may be for every waiter (the
                # listener reconnected), and one that leaves for nothing loses its place.
                await self._woken(watch, min(WAIT_POLL_INTERVAL, remaining))
                now = await self._store.get(scope, key)
                if now is None or now.token != record.token or now.state != "in_progress":
                    return True
                watch.rearm()
            return False
        finally:
            watch.close()
            self._room.leave(record.id)
            self._spent += loop.time() - started

    async def _woken(self, watch: Watch, timeout: float) -> None:  # noqa: ASYNC109 - a poll
        """Return when the row is said to settle or `timeout` seconds have passed; raise
        ClientGone when the client hangs up first."""
        if self._client_gone is None:
            await watch.wait(timeout)
            return
        if self._gone is None:
            self._gone = asyncio.ensure_future(self._client_gone())
        gone = self._gone
        woken = asyncio.ensure_future(watch.wait(timeout))
        racing: list[asyncio.Future[Any]] = [woken, gone]
        await asyncio.wait(racing, return_when=asyncio.FIRST_COMPLETED)
        if gone.done():
            woken.cancel()
            raise ClientGone

    def end(self, route: Route) -> None:
        if self._gone is not None:
            self._gone.cancel()
        if self.used:
            metrics.WAIT_DURATION.labels(route.name).observe(self._spent)
