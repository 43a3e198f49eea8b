"""Answers relayed as the upstream sends them (contract section 11, "large answers").

An answer whose body is not read whole (`upstream.client.READ_WHOLE_UP_TO`) is relayed through
a `Relay`: the forward's own task (`Gateway._pump`) reads the upstream's chunks, hands each to
the client's side of the relay and keeps a copy for the store while the body is within the
route's `max_stored_response`; past it, the copy is dropped and the key completes with its
status and headers only (a retry gets 409 `response-not-stored`). So the client's first byte
never waits for the last, and the gateway holds at most `QUEUED` chunks for the client and
`max_stored_response` for the store, whatever the answer's size.

Invariants:
- The pump is the forward's: it settles the key when the upstream's answer ends (complete, or
  release for a release status), or marks it `unknown` when the answer breaks, before the client
  is told the end. A client that hangs up, or stops reading for longer than the route's timeout,
  is let go (`abandon`): the pump reads on and settles as if it were there.
- The client's side ends with the end of the answer, or with `Broken` when the upstream's
  answer broke: the edge then closes the connection without ending the body, so the client
  sees a truncated answer, never a complete-looking one.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

# Chunks (of up to 64 KiB, `upstream.client.STREAM_CHUNK`) queued for a client that reads slower
# than the upstream sends: enough to keep both sides busy, little enough to keep memory flat.
QUEUED = 8
_END = b""


class Broken(Exception):
    """The upstream's answer broke off: the client's copy must not look complete."""


class Relay:
    """The chunks of one answer, from the pump to the client."""

    def __init__(self, patience: float) -> None:
        self._queue: asyncio.Queue[bytes | Broken] = asyncio.Queue(QUEUED)
        self._patience = patience  # how long a chunk waits for the client to take it
        self.abandoned = False

    async def put(self, chunk: bytes) -> None:
        if chunk:
            await self._offer(chunk)

    async def end(self, broken: bool = False) -> None:
        await self._offer(Broken() if broken else _END)

    async def _offer(self, item: bytes | Broken) -> None:
        if self.abandoned:
            return
        try:
            await asyncio.wait_for(self._queue.put(item), self._patience)
        except TimeoutError:
            self.abandon()  # a client that reads nothing holds neither memory nor the key

    def abandon(self) -> None:
        """The client is gone (or stopped reading): drop what waits for it, end its side."""
        self.abandoned = True
        while not self._queue.empty():
            self._queue.get_nowait()
        self._queue.put_nowait(Broken())

    async def __aiter__(self) -> AsyncIterator[bytes]:
        while True:
            item = await self._queue.get()
            if isinstance(item, Broken):
                raise item
            if item == _END:
                return
            yield item
