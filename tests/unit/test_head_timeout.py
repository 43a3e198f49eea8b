"""The proxy port's head timeout (`http.protocol`) on a keep-alive connection, in one process:
the protocol on a transport that records what it is given, HEAD_TIMEOUT shortened.

One timer per connection times the head in progress (when it began), so these are the cases a
timer armed once could get wrong: a later request's head is timed from its own first byte, not
from the connection's start, and a head that comes whole in time is served."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from uvicorn.config import Config
from uvicorn.server import ServerState

from oncegate.http import protocol
from tests.transport import REQUEST, Calls

TIMEOUT = 1.0


async def app(scope: Any, receive: Any, send: Any) -> None:
    await receive()
    await send({"type": "http.response.start", "status": 201,
                "headers": [(b"content-length", b"2")]})  # fmt: skip
    await send({"type": "http.response.body", "body": b"{}"})


@pytest.fixture
async def connection(monkeypatch: pytest.MonkeyPatch) -> tuple[protocol.HttpProtocol, Calls]:
    monkeypatch.setattr(protocol, "HEAD_TIMEOUT", TIMEOUT)
    config = Config(app=app, http=protocol.HttpProtocol, log_config=None, lifespan="off")
    config.load()
    server = protocol.HttpProtocol(
        config=config, server_state=ServerState(), app_state={},
        _loop=asyncio.get_running_loop(),
    )  # fmt: skip
    transport = Calls()
    server.connection_made(transport)
    return server, transport


async def answered(transport: Calls, count: int) -> None:
    await transport.until(lambda: transport.sent().count(b"HTTP/1.1 201") >= count)


async def test_a_later_head_is_timed_from_its_own_first_byte(
    connection: tuple[protocol.HttpProtocol, Calls],
) -> None:
    server, transport = connection
    server.data_received(REQUEST)
    await answered(transport, 1)
    await asyncio.sleep(0.6 * TIMEOUT)
    server.data_received(REQUEST[:20])  # the next head begins, 0.6 timeouts after the start
    await asyncio.sleep(0.6 * TIMEOUT)  # past the connection's first timeout, not its own
    assert not transport.closing
    server.data_received(REQUEST[20:])
    await answered(transport, 2)
    assert b"408" not in transport.sent()
    server.connection_lost(None)


async def test_a_head_that_stops_coming_is_answered_408_and_closed(
    connection: tuple[protocol.HttpProtocol, Calls],
) -> None:
    server, transport = connection
    server.data_received(REQUEST)
    await answered(transport, 1)
    server.data_received(REQUEST[:20])  # and nothing more
    await transport.until(lambda: transport.closing)
    assert transport.sent().split(b"HTTP/1.1 ")[-1].startswith(b"408")
    server.connection_lost(None)


async def test_an_idle_keep_alive_connection_is_not_answered_408(
    connection: tuple[protocol.HttpProtocol, Calls],
) -> None:
    """Between requests no head is in progress: the keep-alive timeout (uvicorn's, 5 s by
    default) is the one that closes an idle connection, silently."""
    server, transport = connection
    server.data_received(REQUEST)
    await answered(transport, 1)
    await asyncio.sleep(1.5 * TIMEOUT)
    assert b"408" not in transport.sent()
    server.connection_lost(None)
