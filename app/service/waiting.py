"""Waiting for a key in flight to settle (`Prefer: wait=N`, contract section 9)."""

from __future__ import annotations

import asyncio
import math
from typing import Any

from .. import headers, metrics
from ..settings import Route
from ..store import Record, Store
from ..store.notify import Watch
from .messages import ClientGoneProbe, ProxyRequest

# A waiting request looks at its row this often, in case a settle notification was lost: often
# enough that a lost one costs half a second, rare enough that a hundred waiters cost PostgreSQL
# two hundred cheap reads a second.
WAIT_POLL_INTERVAL = 0.5
PREFERENCE_APPLIED = "preference-applied"


class ClientGone(Exception):
    """The client hung up while its request waited (`Prefer: wait`): nobody is left to answer,
    and nothing was claimed for it."""


class Wait:
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
    def asked(cls, request: ProxyRequest, route: Route, store: Store) -> Wait | None:
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
