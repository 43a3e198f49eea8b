"""The request path's connection pool (store/postgres/pool.py), on the session's real PostgreSQL:
what is reused, what is closed, who waits and for how long, what a closed pool says."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import asyncpg
import pytest

from oncegate.store.postgres import pool as pool_module
from oncegate.store.postgres.pool import Pool

HANG = 30.0  # a test that has no answer by then fails instead of hanging


class Opened:
    """The pool's `connect` and `init`, counting the connections opened and passed to `init`."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.connections: list[asyncpg.Connection] = []
        self.inits = 0
        self.refuse = 0  # fail this many of the next connects

    async def connect(self) -> asyncpg.Connection:
        if self.refuse:
            self.refuse -= 1
            raise ConnectionRefusedError("refused by the test")
        connection = await asyncpg.connect(self.url)
        self.connections.append(connection)
        return connection

    async def init(self, connection: asyncpg.Connection) -> None:
        self.inits += 1


@pytest.fixture
async def opened(postgres_url: str) -> AsyncIterator[Opened]:
    opened = Opened(postgres_url)
    yield opened
    for connection in opened.connections:
        connection.terminate()


async def open_pool(opened: Opened, max_size: int = 2, min_size: int = 0) -> Pool:
    return await Pool.open(opened.connect, opened.init, max_size, min_size, acquire_timeout=HANG)


async def backend_of(pool: Pool) -> int:
    async with pool.acquire() as connection:
        pid: int = await connection.fetchval("SELECT pg_backend_pid()")
        return pid


async def admin_value(url: str, sql: str, *arguments: object) -> object:
    """One value of a statement on a connection of its own, outside every pool."""
    admin = await asyncpg.connect(url)
    try:
        return await admin.fetchval(sql, *arguments)
    finally:
        await admin.close()


async def test_min_size_connections_are_opened_at_once_and_passed_to_init(opened: Opened) -> None:
    pool = await open_pool(opened, max_size=4, min_size=2)
    try:
        assert len(opened.connections) == 2
        assert opened.inits == 2
    finally:
        await pool.close()


async def test_an_idle_connection_is_reused_and_none_is_opened(opened: Opened) -> None:
    pool = await open_pool(opened)
    try:
        first = await backend_of(pool)
        for _ in range(5):
            assert await backend_of(pool) == first
        assert len(opened.connections) == 1
    finally:
        await pool.close()


async def test_a_statement_postgres_refused_leaves_its_connection_in_the_pool(
    opened: Opened,
) -> None:
    pool = await open_pool(opened)
    try:
        first = await backend_of(pool)
        with pytest.raises(asyncpg.DivisionByZeroError):
            async with pool.acquire() as connection:
                await connection.fetchval("SELECT 1 / 0")
        assert await backend_of(pool) == first
        assert len(opened.connections) == 1
    finally:
        await pool.close()


async def test_a_statement_cancelled_midway_is_cancelled_in_postgres_and_its_connection_kept(
    opened: Opened, postgres_url: str
) -> None:
    pool = await open_pool(opened, max_size=1)
    try:
        first = await backend_of(pool)

        async def sleep_in_postgres() -> None:
            async with pool.acquire() as connection:
                await connection.execute("SELECT pg_sleep(30) -- cancelled by the test")

        sleeping = asyncio.create_task(sleep_in_postgres())
        await asyncio.sleep(0.3)
        sleeping.cancel()
        with pytest.raises(asyncio.CancelledError):
            await sleeping
        # The same connection serves the next statement, once PostgreSQL has cancelled the
        # first: the statement does not go on running in a backend nobody holds.
        assert await backend_of(pool) == first
        assert len(opened.connections) == 1
        running = await admin_value(
            postgres_url,
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE state = 'active' AND query LIKE '%cancelled by the test'",
        )
        assert running == 0
    finally:
        await pool.close()


async def test_a_connection_given_back_inside_a_transaction_is_closed(opened: Opened) -> None:
    pool = await open_pool(opened, max_size=1)
    try:
        first = await backend_of(pool)
        async with pool.acquire() as connection:
            await connection.execute("BEGIN")
        assert opened.connections[0].is_closed()
        assert await backend_of(pool) != first
        assert pool._size == 1
    finally:
        await pool.close()


async def test_a_lease_holds_one_connection_at_a_time(opened: Opened) -> None:
    pool = await open_pool(opened)
    try:
        lease = pool.acquire()
        await lease.__aenter__()
        with pytest.raises(asyncpg.InterfaceError):
            await lease.__aenter__()
        await lease.__aexit__(None, None, None)
        assert pool._size == 1
    finally:
        await pool.close()


async def test_a_connection_postgres_ended_while_idle_is_replaced(
    opened: Opened, postgres_url: str
) -> None:
    pool = await open_pool(opened, max_size=1)
    try:
        first = await backend_of(pool)
        assert await admin_value(postgres_url, "SELECT pg_terminate_backend($1)", first)
        async with asyncio.timeout(HANG):
            while not opened.connections[0].is_closed():  # noqa: ASYNC110 (no event to wait on)
                await asyncio.sleep(0.01)  # the loop sees the socket close
        assert await backend_of(pool) != first
        assert pool._size == 1
    finally:
        await pool.close()


async def test_a_caller_over_max_size_waits_for_the_next_connection_given_back(
    opened: Opened,
) -> None:
    pool = await open_pool(opened, max_size=1)
    try:
        holding = pool.acquire()
        held = await holding.__aenter__()
        waiting = asyncio.create_task(backend_of(pool))
        await asyncio.sleep(0.2)
        assert not waiting.done()
        holder_pid = await held.fetchval("SELECT pg_backend_pid()")
        await holding.__aexit__(None, None, None)
        assert await asyncio.wait_for(waiting, HANG) == holder_pid
        assert len(opened.connections) == 1
    finally:
        await pool.close()


async def test_a_caller_that_waits_longer_than_its_timeout_gets_timeout_error(
    opened: Opened,
) -> None:
    pool = await open_pool(opened, max_size=1)
    try:
        holding = pool.acquire()
        await holding.__aenter__()
        with pytest.raises(TimeoutError):
            async with pool.acquire(timeout=0.2):
                pass
        await holding.__aexit__(None, None, None)
        assert not pool._waiters
        assert pool._size == 1
        await backend_of(pool)  # the place is still usable
    finally:
        await pool.close()


async def test_a_waiter_gets_the_place_of_a_connection_that_closed(opened: Opened) -> None:
    pool = await open_pool(opened, max_size=1)
    try:
        holding = pool.acquire()
        held = await holding.__aenter__()
        waiting = asyncio.create_task(backend_of(pool))
        await asyncio.sleep(0.2)
        # The holder's statement was cut short (not an error PostgreSQL answered): its
        # connection is closed, and the waiter opens a new one in its place.
        await holding.__aexit__(OSError, OSError("cut"), None)
        assert held.is_closed()
        assert await asyncio.wait_for(waiting, HANG) > 0
        assert len(opened.connections) == 2
    finally:
        await pool.close()


async def test_a_connect_that_fails_frees_its_place(opened: Opened) -> None:
    pool = await open_pool(opened, max_size=1)
    try:
        opened.refuse = 1
        with pytest.raises(ConnectionRefusedError):
            await backend_of(pool)
        assert await backend_of(pool) > 0  # the place was not lost with the failed connect
    finally:
        await pool.close()


async def test_an_init_that_fails_closes_the_connection_and_frees_its_place(
    opened: Opened,
) -> None:
    refusals = [RuntimeError("init refused by the test")]

    async def init(connection: asyncpg.Connection) -> None:
        if refusals:
            raise refusals.pop()

    pool = await Pool.open(opened.connect, init, 1, acquire_timeout=HANG)
    try:
        with pytest.raises(RuntimeError):
            await backend_of(pool)
        assert opened.connections[0].is_closed()
        assert await backend_of(pool) > 0
        assert pool._size == 1
    finally:
        await pool.close()


async def test_a_closed_pool_refuses_leases_and_ends_its_waiters(opened: Opened) -> None:
    pool = await open_pool(opened, max_size=1, min_size=1)
    holding = pool.acquire()
    held = await holding.__aenter__()
    waiting = asyncio.create_task(backend_of(pool))
    await asyncio.sleep(0.2)
    await pool.close()
    with pytest.raises(asyncpg.InterfaceError):
        await asyncio.wait_for(waiting, HANG)
    with pytest.raises(asyncpg.InterfaceError):
        await backend_of(pool)
    await holding.__aexit__(None, None, None)
    assert held.is_closed()  # given back to a closed pool: closed, not kept


async def test_connections_idle_past_their_lifetime_are_closed_down_to_min_size(
    opened: Opened, monkeypatch: pytest.MonkeyPatch
) -> None:
    pool = await open_pool(opened, max_size=3, min_size=1)
    try:
        leases = [pool.acquire() for _ in range(3)]
        for lease in leases:
            await lease.__aenter__()
        for lease in leases:
            await lease.__aexit__(None, None, None)
        assert len(opened.connections) == 3
        monkeypatch.setattr(pool_module, "IDLE_LIFETIME", 0.0)
        pool._trim()
        await asyncio.wait_for(asyncio.gather(*pool._closing), HANG)
        assert sum(not connection.is_closed() for connection in opened.connections) == 1
        assert pool._size == 1
        assert await backend_of(pool) > 0
    finally:
        await pool.close()


async def test_a_pool_made_without_open_closes_its_idle_connections_too(
    opened: Opened, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pool made as a Citus worker's is (`Pool(...)`, opened lazily: store.postgres.workers)
    trims its idle connections as one made by `open` does; else every connection a burst opened
    to a worker stays open for as long as the gateway runs, to a worker that moved or was
    removed too."""
    monkeypatch.setattr(pool_module, "IDLE_CHECK", 0.01)
    monkeypatch.setattr(pool_module, "IDLE_LIFETIME", 0.0)
    pool = Pool(opened.connect, opened.init, 3, acquire_timeout=HANG)
    try:
        leases = [pool.acquire() for _ in range(2)]
        for lease in leases:
            await lease.__aenter__()
        for lease in leases:
            await lease.__aexit__(None, None, None)
        assert len(opened.connections) == 2
        for _ in range(500):  # each look is IDLE_CHECK apart: a few at most
            if all(connection.is_closed() for connection in opened.connections):
                break
            await asyncio.sleep(0.01)
        assert [connection.is_closed() for connection in opened.connections] == [True, True]
        assert pool._size == 0
        assert await backend_of(pool) > 0  # and opens one again when needed
    finally:
        await pool.close()
