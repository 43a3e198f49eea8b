"""An answer's head and body in one write (`http.protocol._JoinedWrites`), in one process: both
ports' protocols on a transport that records each call it is given.

What is held must still go out, in order, and never to a connection that is gone: a lone head (an
answer streamed later) by the end of the loop's turn, anything held before a close, a large body,
or a hand-over to another protocol."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from uvicorn.config import Config
from uvicorn.server import ServerState

from oncegate.http import protocol
from tests.transport import BODY, REQUEST, Calls


async def answer(scope: Any, receive: Any, send: Any) -> None:
    await receive()
    await send({"type": "http.response.start", "status": 201,
                "headers": [(b"content-length", b"2")]})  # fmt: skip
    await send({"type": "http.response.body", "body": b"{}"})


def served(kind: type, app: Any) -> tuple[Any, Calls]:
    config = Config(app=app, http=kind, log_config=None, lifespan="off")
    config.load()
    server = kind(
        config=config, server_state=ServerState(), app_state={}, _loop=asyncio.get_running_loop()
    )
    transport = Calls()
    server.connection_made(transport)
    return server, transport


@pytest.mark.parametrize("kind", [protocol.HttpProtocol, protocol.IgnoringUpgradesH11])
async def test_an_answer_leaves_in_one_write(kind: type) -> None:
    server, transport = served(kind, answer)
    server.data_received(REQUEST)
    await transport.until(lambda: b"{}" in transport.sent())
    sends = [call for call in transport.calls if call[0] != "close"]
    assert len(sends) == 1, sends
    head, _, body = sends[0][1].partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 201") and body == b"{}"
    server.connection_lost(None)


async def test_a_head_whose_body_comes_later_goes_out_in_the_same_turn() -> None:
    """An answer streamed as the upstream sends it: the client sees its head before the body."""
    more = asyncio.Event()

    async def streamed(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await more.wait()
        await send({"type": "http.response.body", "body": b"late", "more_body": False})

    server, transport = served(protocol.HttpProtocol, streamed)
    server.data_received(REQUEST)
    await transport.until(lambda: transport.calls)
    assert transport.calls[0][0] == "write" and transport.calls[0][1].startswith(b"HTTP/1.1 200")
    assert b"late" not in transport.sent()  # the head went out alone, before the body existed
    more.set()
    await transport.until(lambda: b"late" in transport.sent())
    server.connection_lost(None)


async def test_what_is_held_goes_out_before_a_close_and_in_order() -> None:
    transport = Calls()
    joined = protocol._JoinedWrites(transport, asyncio.get_running_loop())
    joined.write(b"head")
    assert transport.calls == []
    assert joined.get_write_buffer_size() == 4  # flow control counts what is held
    joined.close()
    assert transport.calls == [("write", b"head"), ("close", b"")]
    await asyncio.sleep(0)  # the end of the turn finds nothing left to send
    assert transport.calls == [("write", b"head"), ("close", b"")]


async def test_nothing_is_written_to_a_connection_that_is_gone() -> None:
    transport = Calls()
    joined = protocol._JoinedWrites(transport, asyncio.get_running_loop())
    joined.write(b"head")
    transport.closing = True  # the peer went away; the protocol's connection_lost follows
    await asyncio.sleep(0)
    assert transport.calls == []
    joined.write(b"x")
    joined.abort()
    await asyncio.sleep(0)
    assert transport.calls == [("abort", b"")]


async def test_a_large_write_is_not_held_and_follows_what_is() -> None:
    transport = Calls()
    joined = protocol._JoinedWrites(transport, asyncio.get_running_loop())
    large = b"x" * (protocol.HELD_WRITE + 1)
    joined.write(large)
    assert transport.calls == [("write", large)]
    joined.write(b"head")
    joined.write(large)
    assert transport.calls == [("write", large), ("writelines", b"head" + large)]


async def test_a_held_buffer_is_a_copy() -> None:
    """A caller may reuse its buffer once `write` returns, as with any transport."""
    transport = Calls()
    joined = protocol._JoinedWrites(transport, asyncio.get_running_loop())
    buffer = bytearray(b"head")
    joined.write(buffer)
    buffer[:] = b"XXXX"
    await asyncio.sleep(0)
    assert transport.calls == [("write", b"head")]


async def test_a_hand_over_sends_what_was_held_first() -> None:
    """A connection that offers an upgrade is handed to h11 once the requests before it are
    answered; h11 writes to the transport under this one, after what this one held."""
    transport = Calls()
    joined = protocol._JoinedWrites(transport, asyncio.get_running_loop())
    joined.write(b"}")
    assert joined.unwrapped() is transport
    assert transport.calls == [("write", b"}")]


async def test_answers_before_and_after_a_hand_over_leave_in_order() -> None:
    async def in_two_parts(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 201,
                    "headers": [(b"content-length", b"2")]})  # fmt: skip
        await send({"type": "http.response.body", "body": b"{", "more_body": True})
        await send({"type": "http.response.body", "body": b"}"})  # held: the last write

    upgrade = (
        b"POST /emails HTTP/1.1\r\nHost: gateway\r\nConnection: Upgrade\r\nUpgrade: h2c\r\n"
        b"Content-Length: " + str(len(BODY)).encode() + b"\r\n\r\n" + BODY
    )
    server, transport = served(protocol.HttpProtocol, in_two_parts)
    server.data_received(REQUEST + upgrade)
    await transport.until(lambda: transport.sent().count(b"{}") == 2)
    first, second = transport.sent().split(b"HTTP/1.1 201")[1:]
    assert first.endswith(b"\r\n\r\n{}") and second.endswith(b"\r\n\r\n{}")


@pytest.mark.parametrize("kind", [protocol.HttpProtocol, protocol.IgnoringUpgradesH11])
async def test_what_is_held_goes_out_before_the_transport_closes_on_the_client_s_end(
    kind: type,
) -> None:
    """A client may shut its side down once its request is sent and read on. Told of that end,
    the transport calls `eof_received` and then closes itself (asyncio and uvloop alike, as
    these protocols return nothing). Either loop can run that read between a held write and the
    end of the turn: what is held must be sent before that close, as it would have been unheld."""
    server, transport = served(kind, answer)
    server.transport.write(b"HTTP/1.1 400 Bad Request\r\n\r\n")  # a HEAD answer: its head alone
    server.eof_received()
    transport.close()
    await asyncio.sleep(0)
    assert transport.calls == [("write", b"HTTP/1.1 400 Bad Request\r\n\r\n"), ("close", b"")]
    server.connection_lost(None)
