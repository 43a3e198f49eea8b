"""Answers relayed as the upstream sends them (contract section 11, "large answers").

An answer whose body is not read whole (`upstream.client.READ_WHOLE_UP_TO`) is relayed through
a `Relay`: the forward's own task (`Gateway._pump`) reads the upstream's chunks, hands each to
the client's side of the relay and keeps a copy for the store (`Reading`) while the body is
within the route's `max_stored_response`; past it, the copy is dropped and the key completes
with its status and headers only (a retry gets 409 `response-not-stored`). So the client's
first byte never waits for the last, and the gateway holds at most `QUEUED` chunks for the
client and `max_stored_response` for the store, whatever the answer's size.

Invariants:
- The pump is the forward's: it settles the key when the upstream's answer ends (complete, or
  release for a release status), or marks it `unknown` when the answer breaks, before the client
  is told the end.
- A client that hangs up (the edge sees its disconnect), or stops reading for longer than the
  route's timeout, is let go (`Relay.abandon`). The upstream is read on only for the store: an
  answer with no key (pass-through, unprotected) is closed at once, and a keyed one is read on
  while its copy can still be stored, up to the key's TTL; then it is cut (`Reading.stop`).
- The gateway cuts every answer still relayed a grace period after it is told to stop
  (`Gateway.stop_relaying`). A cut answer settles as what is known of it: no key, nothing; a
  release status releases; an answer that could not be stored anyway (past
  `max_stored_response`, or `store: status_only`) completes with its status and headers; one
  whose body could still have been stored turns `unknown` (`answer_cut`): its body was lost.
- The client's side ends with the end of the answer, or with `Broken` when the answer broke or
  was cut: the edge then closes the connection without ending the body, so the client sees a
  truncated answer, never a complete-looking one.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from ..upstream import BodyStream

# Chunks (of up to 64 KiB, `upstream.client.STREAM_CHUNK`) queued for a client that reads slower
# than the upstream sends: enough to keep both sides busy, little enough to keep memory flat.
QUEUED = 8
_END = b""

# Why the gateway stopped reading an answer before its end (`Reading.cut`).
CLIENT_GONE = "its client had gone and nothing more of it could be stored"
EXPIRED = "its client had gone and its key reached its ttl"
SHUTDOWN = "the gateway was shutting down"
BROKE_OFF = "the upstream's answer broke off while it was relayed"


class Broken(Exception):
    """The answer broke off, or was cut: the client's copy must not look complete. `unknown`:
    the request's key (if any) turned `unknown` with it."""

    def __init__(self, reason: str = BROKE_OFF, unknown: bool = True) -> None:
        super().__init__(reason)
        self.reason = reason
        self.unknown = unknown


class Relay:
    """The chunks of one answer, from the pump to the client."""

    def __init__(self, patience: float) -> None:
        self._queue: asyncio.Queue[bytes | Broken] = asyncio.Queue(QUEUED)
        self._patience = patience  # how long a chunk waits for the client to take it
        self.abandoned = False
        self._on_abandon: Callable[[], None] | None = None

    def when_abandoned(self, callback: Callable[[], None]) -> None:
        """Call `callback` once, when the client is let go (at once if it already was)."""
        self._on_abandon = callback
        if self.abandoned:
            callback()

    async def put(self, chunk: bytes) -> None:
        if chunk:
            await self._offer(chunk)

    async def end(self, broken: Broken | None = None) -> None:
        await self._offer(_END if broken is None else broken)

    async def _offer(self, item: bytes | Broken) -> None:
        if self.abandoned:
            return
        try:
            await asyncio.wait_for(self._queue.put(item), self._patience)
        except TimeoutError:
            self.abandon()  # a client that reads nothing holds neither memory nor the key

    def abandon(self) -> None:
        """The client is gone (or stopped reading): drop what waits for it, end its side."""
        first = not self.abandoned
        self.abandoned = True
        while not self._queue.empty():
            self._queue.get_nowait()
        self._queue.put_nowait(Broken())
        if first and self._on_abandon is not None:
            self._on_abandon()

    async def __aiter__(self) -> AsyncIterator[bytes]:
        while True:
            item = await self._queue.get()
            if isinstance(item, Broken):
                raise item
            if item == _END:
                return
            yield item


class Reading:
    """One relayed answer as its pump reads it: the copy kept for the store, and why the gateway
    stopped reading before the answer's end, if it did (`cut`)."""

    def __init__(self, stream: BodyStream, limit: int | None, copying: bool, ttl: float) -> None:
        self._stream = stream
        # The route's max_stored_response, for an answer settled with its key; None without one.
        self._limit = limit
        self._copying = copying  # the body is stored (not `status_only`, not a release status)
        self.kept: list[bytes] | None = None if limit is None else []  # None: past the limit
        self.size = 0
        self.cut: str | None = None
        # When the key expires (on the loop's clock, counted from the answer's head: its claim
        # was a little earlier); an answer stored later would be expired already.
        self._expires = asyncio.get_running_loop().time() + ttl
        self._gone = False  # its client was let go
        self._expiry: asyncio.TimerHandle | None = None

    @property
    def received(self) -> int:
        return self._stream.received

    @property
    def storable(self) -> bool:
        """More of the answer could still be stored: the one reason to read on for nobody."""
        return self.kept is not None and self._copying

    def take(self, chunk: bytes) -> None:
        """Keep `chunk` for the store, while the answer is within the limit."""
        if self.kept is None:
            return
        self.size += len(chunk)
        if self._limit is not None and self.size > self._limit:
            self.kept = None  # too large to store: the status and headers only
            if self._gone:
                self.stop(CLIENT_GONE)
        elif self._copying:
            self.kept.append(chunk)

    def let_go(self) -> None:
        """The client is gone: stop at once unless the answer can still be stored, and then by
        the key's expiry at the latest."""
        self._gone = True
        if not self.storable:
            self.stop(CLIENT_GONE)
        elif self._expiry is None and self.cut is None:
            loop = asyncio.get_running_loop()
            self._expiry = loop.call_at(self._expires, self.stop, EXPIRED)

    def stop(self, why: str) -> None:
        """Stop reading now (a read in progress ends at once) and give the connection up."""
        if self.cut is None:
            self.cut = why
            self._stream.close()
        self.forget()

    def forget(self) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None
