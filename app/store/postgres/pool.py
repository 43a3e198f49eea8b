"""The request path's connection pool: a statement's connection taken and given back with no
task, no future and no timer when one is idle.

asyncpg's own pool wraps every acquire in `wait_for` (a task) and every release in `shield` (a
second task), arms and cancels an idle timer, and builds a proxy object around the connection.
For a lone statement that cost more than the statement: a one-row claim through the store took
0.76 ms p50 and 231 µs of client CPU with it, 0.44 ms and 131 µs with this pool, against 0.42 ms
and 85 µs on a bare connection (docs/performance.md). Here an idle connection is popped from a
list and pushed back after the statement; only a pool that is empty or full waits.

Design rules:
- Last in, first out: the connections in use stay hot, the extra ones go quiet at the bottom of
  the list, and one that has been idle for `IDLE_LIFETIME` is closed (PostgreSQL's backend with
  it), as asyncpg's pool did, down to `min_size` (opened at the start; one that breaks is
  replaced when a statement next needs it), whether the pool was made by `open` or, as a Citus
  worker's, made empty and opened as statements need it. Connections are not recycled after a
  number of queries: they run the same dozen prepared statements for ever.
- A connection goes back to the list after its statement ended cleanly, with an error
  PostgreSQL answered (a constraint, a refused value: the autocommitted statement changed
  nothing), or cancelled or timed out midway: asyncpg has then asked PostgreSQL to cancel the
  statement, and the connection's next statement waits until it has (closing the connection
  instead would leave the statement running in its backend, and a new backend beside it).
  Broken, or left inside a transaction, it is closed; its place is free for a new one.
- A new connection is opened the way the pool's `connect` says (URL, timeouts, the session's
  settings) and then passed to `init` (`Primary.connected`): with several hosts in the URL, it
  reaches whichever takes writes, so the pool follows a failover by itself.
- When every place is taken, callers wait in arrival order, at most `timeout` (TimeoutError, an
  outage to the store), and are handed the next connection given back or the place of one that
  closed (then they open a connection in it, within the connect timeout). `fetchrow` waits at
  most the pool's `acquire_timeout`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Any

import asyncpg

log = logging.getLogger("oncegate.store.postgres")

# What a connection's statement may have ended with, and the connection still be reused.
_REUSABLE = (asyncpg.PostgresError, asyncio.CancelledError, TimeoutError)

# How long a connection may sit unused before it is closed (asyncpg's pool default), and how
# often that is looked at.
IDLE_LIFETIME = 300.0
IDLE_CHECK = 30.0


class Pool:
    def __init__(
        self,
        connect: Callable[[], Awaitable[asyncpg.Connection]],
        init: Callable[[asyncpg.Connection], Awaitable[None]],
        max_size: int,
        min_size: int = 0,
        acquire_timeout: float | None = None,
    ) -> None:
        if max_size < 1:
            raise ValueError("a pool holds at least one connection")
        self._connect = connect
        self._init = init
        self._max_size = max_size
        self._min_size = min(min_size, max_size)
        self._acquire_timeout = acquire_timeout
        # Idle connections, the most recently used last, with when each was given back.
        self._idle: list[tuple[asyncpg.Connection, float]] = []
        self._size = 0  # connections open or being opened, idle or in use
        # Callers waiting for a connection: each gets one given back, or None (a free place).
        self._waiters: collections.deque[asyncio.Future[asyncpg.Connection | None]] = (
            collections.deque()
        )
        self._closed = False
        self._trim_timer: asyncio.TimerHandle | None = None
        self._closing: set[asyncio.Task[None]] = set()

    @classmethod
    async def open(
        cls,
        connect: Callable[[], Awaitable[asyncpg.Connection]],
        init: Callable[[asyncpg.Connection], Awaitable[None]],
        max_size: int,
        min_size: int = 0,
        acquire_timeout: float | None = None,
    ) -> Pool:
        """A pool with `min_size` connections open (so an unreachable database fails here)."""
        pool = cls(connect, init, max_size, min_size, acquire_timeout)
        try:
            for _ in range(pool._min_size):
                pool._size += 1
                connection = await pool._open()
                pool._idle.append((connection, time.monotonic()))
        except BaseException:
            await pool.close()
            raise
        pool._trim_timer = asyncio.get_running_loop().call_later(IDLE_CHECK, pool._trim)
        return pool

    def acquire(self, timeout: float | None = None) -> Lease:
        """`async with pool.acquire() as connection:` one connection for the block."""
        return Lease(self, self._acquire_timeout if timeout is None else timeout)

    async def fetchrow(self, sql: str, *arguments: object) -> Any:
        async with self.acquire() as connection:
            return await connection.fetchrow(sql, *arguments)

    def unused(self) -> bool:
        """Whether no connection is lent or being opened and nobody waits for one: closing the
        pool now cuts no statement short (`workers.Workers.forget_gone`)."""
        return self._size == len(self._idle) and not self._waiters

    def take_idle(self) -> asyncpg.Connection | None:
        """An idle connection, or None: taken without a coroutine, as most statements are."""
        if self._closed:
            raise asyncpg.InterfaceError("the store's connections are closed")
        idle = self._idle
        while idle:
            connection, _ = idle.pop()
            if not connection.is_closed():
                return connection
            self._size -= 1  # broken while idle (PostgreSQL restarted): its place is free
        return None

    async def take(self, within: float | None) -> asyncpg.Connection:
        """A connection: an idle one, a new one in a free place, or the next given back (waiting
        at most `within` seconds for it: TimeoutError)."""
        connection = self.take_idle()
        if connection is not None:
            return connection
        if self._size < self._max_size:
            self._size += 1
            return await self._open()
        waiter: asyncio.Future[asyncpg.Connection | None] = (
            asyncio.get_running_loop().create_future()
        )
        self._waiters.append(waiter)
        try:
            async with asyncio.timeout(within):
                connection = await waiter
        except BaseException:
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                # Handed a connection (or a place) as the wait ended: pass it on.
                given = waiter.result()
                if given is None:
                    self._free_place()
                else:
                    self.give_back(given, reusable=True)
            else:
                waiter.cancel()
                with contextlib.suppress(ValueError):
                    self._waiters.remove(waiter)
            raise
        if connection is None or connection.is_closed():
            # A place freed by a connection that closed (or the connection handed over closed
            # before this caller woke): open one in it.
            return await self._open()
        return connection

    async def _open(self) -> asyncpg.Connection:
        """A new connection for a place already counted in `_size`."""
        try:
            connection = await self._connect()
        except BaseException:
            self._free_place()
            raise
        try:
            await self._init(connection)
        except BaseException:
            connection.terminate()
            self._free_place()
            raise
        if self._closed:  # closed while this one was opening
            connection.terminate()
            self._free_place()
            raise asyncpg.InterfaceError("the store's connections are closed")
        return connection

    def give_back(self, connection: asyncpg.Connection, reusable: bool) -> None:
        if self._closed or not reusable or connection.is_closed() or connection.is_in_transaction():
            if not connection.is_closed():
                connection.terminate()
            self._free_place()
            return
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(connection)
                return
        self._idle.append((connection, time.monotonic()))
        if self._trim_timer is None:
            # A pool made without `open` (a Citus worker's, opened when first needed) starts
            # looking at its idle connections with the first one given back.
            self._trim_timer = asyncio.get_running_loop().call_later(IDLE_CHECK, self._trim)

    def _free_place(self) -> None:
        """A connection closed (or never opened): its place goes to the first waiter, if any."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the waiter opens a connection in this place
                return
        self._size -= 1

    def _trim(self) -> None:
        """Close the connections unused for IDLE_LIFETIME, beyond `min_size`."""
        self._trim_timer = None
        if self._closed:
            return
        stale_before = time.monotonic() - IDLE_LIFETIME
        while self._idle and self._idle[0][1] < stale_before and self._size > self._min_size:
            connection, _ = self._idle.pop(0)
            self._size -= 1
            closing = asyncio.create_task(_close(connection))
            self._closing.add(closing)
            closing.add_done_callback(self._closing.discard)
        self._trim_timer = asyncio.get_running_loop().call_later(IDLE_CHECK, self._trim)

    async def close(self) -> None:
        """Close every idle connection and refuse new leases; one in use is closed when it is
        given back. Waiters get the error a closed pool gives."""
        self._closed = True
        if self._trim_timer is not None:
            self._trim_timer.cancel()
            self._trim_timer = None
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_exception(asyncpg.InterfaceError("the store's connections are closed"))
        idle, self._idle = self._idle, []
        self._size -= len(idle)
        await asyncio.gather(*(_close(connection) for connection, _ in idle))
        if self._closing:
            await asyncio.gather(*self._closing)


async def _close(connection: asyncpg.Connection) -> None:
    try:
        await connection.close(timeout=5)
    except Exception as exc:  # a connection that cannot say goodbye is simply dropped
        log.debug("closing a pooled connection: %s", exc)
        connection.terminate()


class Lease:
    """One connection for an `async with` block: given back clean, or closed."""

    __slots__ = ("_connection", "_pool", "_timeout")

    def __init__(self, pool: Pool, timeout: float | None) -> None:
        self._pool = pool
        self._timeout = timeout
        self._connection: asyncpg.Connection | None = None

    async def __aenter__(self) -> asyncpg.Connection:
        if self._connection is not None:
            raise asyncpg.InterfaceError("a lease holds one connection at a time")
        connection = self._pool.take_idle()
        if connection is None:
            connection = await self._pool.take(self._timeout)
        self._connection = connection
        return connection

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            # A statement PostgreSQL answered with an error left the connection as it was; one
            # cancelled or timed out is being cancelled in PostgreSQL too (the module's rules);
            # anything else (a broken socket, a driver error) may have broken it.
            self._pool.give_back(connection, reusable=error is None or isinstance(error, _REUSABLE))
