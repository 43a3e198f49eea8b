"""The upstream HTTP client (`HttpUpstream`, the `Upstream` port on aiohttp): one pooled client
for all routes, timeouts, what the request got to.

The port's two failures (`NotSent`, `AnswerLost`) are told apart here:
- `NotSent`: connection refused, connect or pool timeout, a URL that cannot be requested.
- `AnswerLost`: read timeout, reset, malformed answer, a status that is not HTTP.
Any other exception (a bug here or in aiohttp) is classified by whether the request was handed to
a connection (`_Request`): `NotSent` before, `AnswerLost` after.
A connection the upstream closes before any byte of the answer is `AnswerLost`, even a reused
one: an idle connection closed by the server as the request left looks the same as a server that
read the request, performed it and crashed, and only the second one matters for "at most once".
The first is kept from happening instead: pooled connections are dropped before common servers
drop them (`KEEPALIVE_TIMEOUT`), and a connection whose last answer broke its own framing (a 204
with a body) is closed, never reused, so its stray bytes cannot spoil the next answer.
Bodies travel as raw bytes in both directions: no decompression, so a stored
`Content-Encoding: gzip` answer is replayed byte for byte.
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from collections.abc import AsyncIterator, Sequence

import aiohttp
import yarl

from ..kernel import headers, keys
from ..telemetry import tracing
from . import AnswerLost, NotSent, UpstreamResponse

# Connecting to an upstream on the same network takes milliseconds; waiting longer than this
# for a TCP handshake means it is down, and saying so quickly is kinder than the route timeout.
CONNECT_TIMEOUT = 5.0
# Connections to one upstream (scheme, host and port: every route to it together), and to all of
# them together. An upstream whose answers are long (server-sent events: one connection per
# listener for as long as it listens) or that stops answering holds at most its own share: the
# other upstreams keep at least MAX_CONNECTIONS - MAX_CONNECTIONS_PER_HOST, where one pool for
# all let one upstream's 512 listeners leave every other route 502. A gateway with one upstream
# keeps the 512 it always had.
MAX_CONNECTIONS_PER_HOST = 512
MAX_CONNECTIONS = 768
# An idle pooled connection is dropped before common servers drop it (uvicorn and Node close
# idle connections after 5 s): a request sent on a connection the server is closing at that
# moment gets no answer, and its key would turn `unknown` for nothing.
KEEPALIVE_TIMEOUT = 4.0


class _Attempt:
    """How far one request got: whether it was handed to a connection to be written (`_Request`),
    after which the upstream may have seen it."""

    __slots__ = ("sent",)

    def __init__(self) -> None:
        self.sent = False


# The attempt of the request being sent in this task: aiohttp sends it in the caller's task, so a
# context variable reaches `_Request.send` without the cost of aiohttp's tracing signals.
_ATTEMPT: contextvars.ContextVar[_Attempt | None] = contextvars.ContextVar(
    "oncegate_attempt", default=None
)


class _Request(aiohttp.ClientRequest):
    """Marks the attempt sent as the request is handed to its connection."""

    async def send(self, conn: aiohttp.connector.Connection) -> aiohttp.ClientResponse:
        attempt = _ATTEMPT.get()
        if attempt is not None:
            attempt.sent = True
        return await super().send(conn)


class _Response(aiohttp.ClientResponse):
    """Closes the connection of an answer that breaks its own framing instead of pooling it.

    aiohttp returns the connection of a bodiless answer to the pool while it reads the head, so
    the check runs here, where the connection is still in hand.
    """

    async def start(self, connection: aiohttp.connector.Connection) -> _Response:
        protocol = connection.protocol
        await super().start(connection)
        if protocol is not None and headers.announces_forbidden_body(self.status, self.headers):
            # The bytes it announced may still be on their way, to be read as the start of the
            # next answer on this connection: a request that worked would read as one whose
            # answer was lost, and its key turn `unknown` for nothing.
            protocol.close()
        return self


# An answer announced with at most this many bytes is read whole before it is relayed: one or
# a few reads, which streaming would only make dearer. Any other answer (larger, chunked without
# a length, `text/event-stream`) is relayed as it comes (`_Stream`).
READ_WHOLE_UP_TO = 64 * 1024
STREAM_CHUNK = 64 * 1024  # the most one read of a streamed body hands on


def _read_whole(method: str, response: aiohttp.ClientResponse) -> bool:
    if headers.bodiless(method, response.status):
        return True
    length = response.content_length
    return length is not None and length <= READ_WHOLE_UP_TO


class _Stream:
    """The body of a streamed answer (`BodyStream`): aiohttp's reads, with their failures as
    `AnswerLost`; a read waits at most the route's timeout (the connection's `sock_read`)."""

    def __init__(self, response: aiohttp.ClientResponse, timeout: float) -> None:
        self._response = response
        self._timeout = timeout
        self.received = 0

    async def __aiter__(self) -> AsyncIterator[bytes]:
        response = self._response
        try:
            while True:
                try:
                    chunk = await response.content.read(STREAM_CHUNK)
                except (aiohttp.ServerTimeoutError, TimeoutError) as exc:
                    raise _lost(
                        f"no more of the answer within {self._timeout:g}s", response,
                        timed_out=True,
                    ) from exc  # fmt: skip
                except aiohttp.ClientError as exc:
                    raise _lost(f"{type(exc).__name__}: {exc}", response) from exc
                if not chunk:
                    return
                self.received += len(chunk)
                yield chunk
        finally:
            response.release()

    def close(self) -> None:
        self._response.close()


def _lost(
    message: str, answer: aiohttp.ClientResponse | None, *, timed_out: bool = False
) -> AnswerLost:
    """The answer was lost: with what came back of it, when its status line did."""
    if answer is None:
        return AnswerLost(message, timed_out=timed_out)
    received = answer.content.total_bytes
    return AnswerLost(message, timed_out=timed_out, status=answer.status, received=received)


def _as_sent(fields: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Header values as aiohttp must be given them to send the client's bytes unchanged.

    Values arrive as Latin-1 text (one character per byte) and aiohttp writes text as UTF-8, so a
    value with a byte above 0x7F would arrive changed (`caf\\xe9` as `caf\\xc3\\xa9`). Such a value
    is handed over as the UTF-8 text it is; the edge refuses the values that are not UTF-8
    (`headers.check_request`): aiohttp cannot send those unchanged.
    """
    return [
        (name, value if value.isascii() else value.encode("latin-1").decode("utf-8"))
        for name, value in fields
    ]


class HttpUpstream:
    """The `Upstream` port on a pooled HTTP client. Owned by the runtime; close it with `aclose`.

    aiohttp rather than httpx: on the forward path httpx's connection pool cost 3.1 ms of CPU per
    request against aiohttp's 1.2 ms, with everything else equal (bench/HISTORY.md).
    """

    def __init__(self) -> None:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(
                limit=MAX_CONNECTIONS,
                limit_per_host=MAX_CONNECTIONS_PER_HOST,
                keepalive_timeout=KEEPALIVE_TIMEOUT,
            ),
            auto_decompress=False,
            response_class=_Response,
            # A proxy sends what its client sent: none of the client library's own headers.
            skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
            cookie_jar=aiohttp.DummyCookieJar(),
            # Answers are relayed, not judged: accept what a real upstream may send.
            max_field_size=65536,
            max_headers=512,
            request_class=_Request,
        )
        self._timeouts: dict[float, aiohttp.ClientTimeout] = {}
        # The headers sent whatever `Connection` names, per key header: the key.
        self._keeps: dict[str, frozenset[str]] = {}

    async def aclose(self) -> None:
        await self._session.close()

    async def send(
        self,
        method: str,
        url: str,
        request_headers: Sequence[tuple[str, str]],
        body: bytes,
        timeout: float,  # noqa: ASYNC109 - a per-route budget, applied by aiohttp
        key_header: str = keys.HEADER_NAME,
    ) -> UpstreamResponse:
        """Send one request and read its whole answer within `timeout` seconds. `key_header`
        (lower case) is sent even when the client names it in `Connection`: the key."""
        client_timeout = self._timeouts.get(timeout)
        if client_timeout is None:
            # `connect` covers waiting for a pooled connection and the handshake: nothing has been
            # sent when it runs out, so that failure is NotSent. It must run out before the
            # route's timeout does, or an upstream that never answers the handshake would read
            # as a request whose answer was lost. The head and a body read whole must come
            # within `timeout` (below); a streamed body, within `timeout` of each chunk.
            client_timeout = aiohttp.ClientTimeout(
                total=None, connect=min(CONNECT_TIMEOUT, timeout / 2), sock_read=timeout
            )
            self._timeouts[timeout] = client_timeout
        started = time.perf_counter()
        attempt = _Attempt()
        current = _ATTEMPT.set(attempt)
        keep = self._keeps.get(key_header)
        if keep is None:
            keep = self._keeps[key_header] = frozenset({key_header})
        outgoing = headers.end_to_end(request_headers, drop=headers.REQUEST_ONLY, keep=keep)
        # The `forward` span, when tracing: the upstream's trace context names it.
        answer: aiohttp.ClientResponse | None = None  # once its status line came back
        stream: _Stream | None = None
        with tracing.forwarding(outgoing) as forwarded:
            try:
                async with asyncio.timeout(timeout):
                    response = await self._session.request(
                        method,
                        yarl.URL(url, encoded=True),  # the path as received, escapes untouched
                        headers=_as_sent(forwarded),
                        data=body or None,
                        allow_redirects=False,
                        timeout=client_timeout,
                    )
                    answer = response
                    raw_headers = response.raw_headers
                    status = response.status
                    if _read_whole(method, response):
                        try:
                            content = await response.read()
                        finally:
                            response.release()
                    else:
                        content = b""
                        stream = _Stream(response, timeout)
            except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
                raise NotSent(f"{type(exc).__name__}: {exc}") from exc
            except (aiohttp.InvalidURL, aiohttp.NonHttpUrlClientError) as exc:
                raise NotSent(f"{type(exc).__name__}: not a URL that can be requested") from exc
            except (aiohttp.ServerTimeoutError, TimeoutError) as exc:
                raise _lost(f"no answer within {timeout:g}s", answer, timed_out=True) from exc
            except aiohttp.ClientResponseError as exc:
                # Its text would name the URL, query included: logs hold neither.
                raise _lost(f"{type(exc).__name__}: {exc.message}", answer) from exc
            except aiohttp.ClientError as exc:
                raise _lost(f"{type(exc).__name__}: {exc}", answer) from exc
            except Exception as exc:  # translated below, never swallowed
                # Anything else (a bug here or in the client library) is classified by how far the
                # request got, so that no key is left claimed by an error: released when the
                # upstream cannot have seen the request, `unknown` when it may have.
                reason = f"unexpected {type(exc).__name__}: {exc}"
                if attempt.sent:
                    raise _lost(reason, answer) from exc
                raise NotSent(reason) from exc
            finally:
                _ATTEMPT.reset(current)
        if not 100 <= status <= 599:
            # Not an HTTP status (RFC 9110 §15): an answer that cannot be relayed or stored, to a
            # request that was performed.
            raise AnswerLost(f"the upstream answered status {status}", timed_out=False)
        return UpstreamResponse(
            status=status,
            headers=headers.end_to_end(
                [(name.decode("latin-1"), value.decode("latin-1")) for name, value in raw_headers],
                keep=headers.HEAD_ANSWER_KEEPS if method == "HEAD" else frozenset(),
            ),
            body=content,
            duration=time.perf_counter() - started,
            stream=stream,
        )
