"""The HTTP/1.1 server protocol of both ports: uvicorn's httptools one, with upgrade offers ignored.

RFC 9110 §7.8 lets a server ignore an `Upgrade` offer and answer in HTTP/1.1, and that is what a
proxy in front of an HTTP/1.1 API must do: `curl --http2` on an `http://` URL sends a POST with
`Connection: Upgrade, HTTP2-Settings` and `Upgrade: h2c`. The httptools parser stops at the end of
such a request's head and hands the rest of the connection over as "upgraded" bytes, so uvicorn
served the request with an empty body (forwarded and stored under its key as such) and never
read the requests pipelined after it.

A connection that makes such an offer is handed, from that request on, to uvicorn's h11 protocol,
which reads the body by its framing, ignores the offer and serves every later request of the
connection: the head is rebuilt from what httptools parsed (as uvicorn does for its WebSocket
hand-over) and fed to h11 with the bytes that followed it. Every other connection stays on
httptools, the cheaper parser (measured: 45-60 against 110-140 µs of server CPU per request).

A request's head must arrive whole within `HEAD_TIMEOUT` of the connection's start or of its
first byte: uvicorn closes connections that are idle between requests, but not one that sends
nothing at all, or its head a byte at a time, and each such connection is a socket held for ever.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any, cast

import h11
import httptools
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from ..model import errors
from . import problems

# Generous for any client that means to send a request (a head is a few hundred bytes), short
# enough that holding sockets open costs an attacker a connection every ten seconds.
HEAD_TIMEOUT = 10.0
# A write this small is held for the next one (an answer's body after its head) or until the end
# of the event loop's turn: bodies above it are sent as they come.
HELD_WRITE = 16 * 1024
# What a connection waiting for its hand-over may hold before reading stops: the request that
# offered the upgrade (the one being handed over) can have a body up to the route's max_body,
# read on by h11 once it takes over; only what arrives before then is held here.
HANDOVER_BUFFER = 1024 * 1024


def _request_timeout() -> bytes:
    _, headers, body = problems.parts(
        errors.RequestTimeout(
            f"the request's head did not arrive within {HEAD_TIMEOUT:g} s of the connection's "
            "start or of its first byte"
        )
    )
    head = [b"HTTP/1.1 408 Request Timeout"] + [name + b": " + value for name, value in headers]
    return b"\r\n".join([*head, b"connection: close", b"", body])


class _JoinedWrites(asyncio.Transport):
    """A connection's transport that sends an answer's head and body in one write.

    uvicorn writes an answer's head when the application starts the answer and its body when the
    application sends it: two `send` system calls and two TCP segments for every answer. Here a
    write of at most HELD_WRITE bytes is held until the next write, which sends both at once, or
    until the end of the event loop's turn, so an answer streamed later still gets its head at
    once and at most one small write is ever held: the transport sees every byte by the end of
    the turn (its flow control, `pause_writing`, counts a held write only from then). What is
    held goes out before anything that ends the connection: a close or `write_eof` through this
    one, or the client's end of its side (`_OneWriteAnswers.eof_received`), after which the
    transport closes itself. Measured on a server that answers every request as the proxy port
    does (a head and a 63-byte body, wrk at 64 connections): 26 against 34 µs of the server's
    CPU a request."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        self._transport = transport
        self._loop = loop
        self._held: bytes | None = None

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not data:
            return  # h11 ends a body with an empty write
        held = self._held
        if held is not None:
            self._held = None
            self._transport.writelines((held, data))
        elif len(data) <= HELD_WRITE:
            # A copy of anything but bytes: the caller may reuse its buffer once this returns.
            self._held = data if type(data) is bytes else bytes(data)
            self._loop.call_soon(self.flush)
        else:
            self._transport.write(data)

    def flush(self) -> None:
        """Write what is held to the transport under this one, now."""
        held = self._held
        if held is not None:
            self._held = None
            if not self._transport.is_closing():  # a lost connection has nobody to send to
                self._transport.write(held)

    def unwrapped(self) -> asyncio.Transport:
        """The transport under this one, once what this one holds is written to it."""
        self.flush()
        return self._transport

    def writelines(self, list_of_data: Iterable[bytes | bytearray | memoryview]) -> None:
        self.flush()
        self._transport.writelines(list_of_data)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def write_eof(self) -> None:
        self.flush()
        self._transport.write_eof()

    def abort(self) -> None:
        self._held = None
        self._transport.abort()

    def get_write_buffer_size(self) -> int:
        held = self._held
        return self._transport.get_write_buffer_size() + (0 if held is None else len(held))

    def can_write_eof(self) -> bool:
        return self._transport.can_write_eof()

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._transport.get_extra_info(name, default)

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._transport.set_protocol(protocol)

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._transport.get_protocol()

    def is_reading(self) -> bool:
        return self._transport.is_reading()

    def pause_reading(self) -> None:
        self._transport.pause_reading()

    def resume_reading(self) -> None:
        self._transport.resume_reading()

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self._transport.set_write_buffer_limits(high, low)

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self._transport.get_write_buffer_limits()


class _OneWriteAnswers:
    """A protocol whose connection writes through `_JoinedWrites`."""

    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport
    _joined: _JoinedWrites

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        self._joined = _JoinedWrites(cast(asyncio.Transport, transport), self.loop)
        self.transport = self._joined

    def eof_received(self) -> None:
        # The client has shut its side down and may still read. Both protocols return nothing
        # here, so the transport closes itself next, not through `_JoinedWrites.close`; and
        # uvloop reads that end between a write and the end of its turn: a HEAD answer's head,
        # held, would be dropped.
        self._joined.flush()
        super().eof_received()  # type: ignore[misc]


class _HeadTimeout:
    """A request's head arrives whole within HEAD_TIMEOUT, or the connection gets a 408 and is
    closed; never while an answer is on its way.

    A head in progress is the time it began (`_head_began`); one timer per connection looks at
    it when it could have run out, and is armed again only while a head is in progress. A
    keep-alive connection's request costs a clock reading, not a timer armed and cancelled."""

    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport
    cycle: Any  # both protocols' request cycle: `response_complete` once it is answered
    _head_timer: asyncio.TimerHandle | None = None
    _head_began: float | None = None

    def _answering(self) -> bool:
        return self.cycle is not None and not self.cycle.response_complete

    def _head_starts(self) -> None:
        self._head_began = self.loop.time()
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(HEAD_TIMEOUT, self._head_check)

    def _head_done(self) -> None:
        self._head_began = None  # the timer, when it fires, finds nothing to time

    def _cancel_head_timer(self) -> None:
        self._head_began = None
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_check(self) -> None:
        self._head_timer = None
        began = self._head_began
        if began is None:
            return
        left = began + HEAD_TIMEOUT - self.loop.time()
        if left > 0:
            self._head_timer = self.loop.call_later(left, self._head_check)
        elif self._answering():
            # An answer is on its way: closing now would cut it off. A full timeout more.
            self._head_began = self.loop.time()
            self._head_timer = self.loop.call_later(HEAD_TIMEOUT, self._head_check)
        elif not self.transport.is_closing():
            self.transport.write(_request_timeout())
            self.transport.close()


class IgnoringUpgradesH11(_OneWriteAnswers, _HeadTimeout, H11Protocol):
    """h11 serves an upgrade offer as the plain request it also is, nothing to warn about; and
    holds a client that sends no head to the same timeout as the httptools protocol."""

    def _unsupported_upgrade_warning(self) -> None:
        pass

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE and self._head_began is None:
            self._head_starts()  # the first bytes of a request: its head has HEAD_TIMEOUT
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:
            self._head_done()  # its head is in

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)


class HttpProtocol(_OneWriteAnswers, _HeadTimeout, HttpToolsProtocol):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._arguments = (args, kwargs)
        self._offers_upgrade = False
        # The bytes after the head of a request that offered an upgrade, kept until the requests
        # before it on this connection are answered: h11 must answer it after them, in order.
        self._handed_over: bytearray | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_starts()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_starts()

    def on_headers_complete(self) -> None:
        self._head_done()
        if self.parser.should_upgrade():
            # Not served here: httptools would drop the body. `data_received` hands it over.
            self._offers_upgrade = True
            return
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        if not self._offers_upgrade:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if not self._offers_upgrade:
            super().on_message_complete()

    def data_received(self, data: bytes) -> None:
        if self._handed_over is not None:
            self._handed_over += data
            if len(self._handed_over) >= HANDOVER_BUFFER:
                self.transport.pause_reading()  # until h11 takes over and reads on
            return
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade as upgrade:
            self._handed_over = bytearray(data[upgrade.args[0] :])
            self._hand_over_when_idle()
        except httptools.HttpParserError:
            msg = "Invalid HTTP request received."  # uvicorn's own answer
            self.logger.warning(msg)
            self.send_400_response(msg)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._hand_over_when_idle()

    def _hand_over_when_idle(self) -> None:
        if self._handed_over is None or self.transport.is_closing():
            return
        if self._answering() or self.pipeline:
            return  # after the requests before it: `on_response_complete` calls again
        args, kwargs = self._arguments
        successor = IgnoringUpgradesH11(*args, **kwargs)
        head = [self.parser.get_method(), b" ", self.url, b" HTTP/",
                self.parser.get_http_version().encode("ascii"), b"\r\n"]  # fmt: skip
        for name, value in self.headers:
            head += [name, b": ", value, b"\r\n"]
        head.append(b"\r\n")
        # This protocol's timers must not close the successor's connection.
        self._unset_keepalive_if_required()
        self._cancel_head_timer()
        self.connections.discard(self)
        # The successor writes through a transport of its own, after what this one holds.
        transport = self._joined.unwrapped()
        successor.connection_made(transport)
        transport.set_protocol(successor)
        # Reading resumes before h11 sees the bytes, so that a pause it asks for (it holds what
        # follows an upgrade offer until it has answered) is the one that stays.
        transport.resume_reading()
        successor.data_received(b"".join(head) + bytes(self._handed_over))
