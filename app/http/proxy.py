"""The proxy port: every path, every method, through `service.Gateway`.

A plain ASGI application rather than a FastAPI route: the port has one catch-all handler and no
use for validation, documentation or middleware, and the framework's request machinery cost more
CPU per replayed request than the two database round trips (measured; bench/HISTORY.md).

Each request is logged as one structured line (route, method, outcome, status, upstream and
total time, request id) and never with its body or credentials. The request id is the client's
`X-Request-Id` when it sent a sane one, else a new one; it is sent upstream and back.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from typing import Any, assert_never

from ..kernel import headers, keys, paths
from ..model import errors
from ..model.outcomes import Outcome
from ..service import Answer, ClientGone, Gateway, ProxyRequest
from ..service.routing import RouteTable
from ..service.streaming import Broken, Relay
from ..settings import DEFAULT_TIMEOUT, Route
from ..telemetry import logs, metrics, tracing
from . import problems

log = logging.getLogger("oncegate.request")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

# The route label of a request that matched no route. Route names cannot contain parentheses,
# so it never collides with one.
UNMATCHED = "(unmatched)"
# A body larger than this is sent in slices of it (a memoryview each: no copy).
SLICE = 64 * 1024


class ClientDisconnected(Exception):
    """The client went away before its request body was complete."""


# What the gateway said to a request: the upstream's answer (relayed), or a problem of its own.
Said = Answer | errors.GatewayError


class ProxyApp:
    def __init__(self, gateway: Gateway, routes: RouteTable) -> None:
        self._gateway = gateway
        self._routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return  # no lifespan (the runtime owns resources) and no websockets
        started = time.perf_counter()
        request_headers = [(name.decode("latin-1"), value.decode("latin-1"))
                           for name, value in scope["headers"]]  # fmt: skip
        request_id = headers.request_id(request_headers)
        try:
            route_name, said = await self._answer(scope, receive, request_headers, request_id)
        except (ClientDisconnected, ClientGone):
            return  # nothing was claimed, and nobody is left to answer
        match said:
            case Answer():
                status, response_headers, body, dropped = _relayed(said, scope["method"])
            case errors.GatewayError():
                status, response_headers, body = problems.parts(said)
                dropped = []
            case _:
                assert_never(said)
        response_headers.append((b"x-request-id", request_id.encode()))
        await send({"type": "http.response.start", "status": status,
                    "headers": response_headers})  # fmt: skip
        if isinstance(said, Answer) and said.stream is not None:
            if await _stream(said.stream, send, receive, route_name, request_id):
                said.outcome = Outcome.UNKNOWN  # counted as what the key now is
        elif len(body) > SLICE:
            route = self._routes.named(route_name)
            patience = DEFAULT_TIMEOUT if route is None else float(route.timeout)
            if not await _slices(body, send, patience):
                log.warning(
                    "%s: the client took nothing of the answer for %gs; the connection is closed "
                    "(request %s)", route_name, patience, request_id,
                    extra={"fields": {"route": route_name, "request_id": request_id}},
                )  # fmt: skip
                # Counted as answered all the same; the server closes a connection whose answer
                # did not end.
        else:
            await send({"type": "http.response.body", "body": body})
        elapsed = time.perf_counter() - started
        _account(route_name, scope["method"], said, status, dropped, elapsed, request_id)

    async def _answer(
        self,
        scope: Scope,
        receive: Receive,
        request_headers: list[tuple[str, str]],
        request_id: str,
    ) -> tuple[str, Said]:
        """The route's name (for metrics and logs) and what the gateway said: its answer, or the
        problem that stopped it."""
        route_name = UNMATCHED
        try:
            path = paths.normalize(scope.get("raw_path", b"").decode("latin-1") or scope["path"])
            route = self._routes.match(path)
            # The head is checked before anything else is said about the request, and which
            # header holds the key is the route's to say: a byte no key may hold in it is a
            # malformed key, counted under the route, as keys.parse's refusals are.
            try:
                headers.check_request(
                    scope.get("http_version", "1.1"), request_headers, _key_header(route)
                )
            except errors.InvalidKey:
                route_name = route.name if route is not None else UNMATCHED
                raise
            if route is None:
                raise errors.RouteNotFound(f"no route of this gateway matches the path {path!r}")
            slashed = paths.as_slashes(path)
            if slashed is not None and self._routes.match(slashed) is not route:
                # An upstream that decodes %2F would act on another route's path, under this
                # route's policy.
                raise errors.InvalidPath(
                    "the request path's percent-encoded slashes (%2F, %5C) would make it another "
                    "route's path to an upstream that decodes them; send the path it means"
                )
            route_name = route.name
            result = await self._gateway.handle(
                route,
                ProxyRequest(
                    method=scope["method"],
                    path=path,
                    query=scope.get("query_string", b"").decode("latin-1"),
                    headers=request_headers,
                    body=await read_body(
                        receive, request_headers, route.max_body, "this route's limit"
                    ),
                    client_gone=lambda: _hung_up(receive),
                ),
            )
            return route_name, result
        except errors.GatewayError as error:
            return route_name, error
        except (ClientDisconnected, ClientGone):
            raise
        except Exception:  # the edge's last resort: logged and answered, not swallowed
            # A bug: the client still gets a problem (with the request id to report), never a
            # bare 500; the key, if one was claimed, was settled by the layers below.
            log.exception("unexpected error while serving request %s", request_id)
            return route_name, errors.GatewayError(
                f"the gateway failed unexpectedly; report request id {request_id} to its operator"
            )


def _key_header(route: Route | None) -> str | None:
    """The header that holds the key of a request to `route`, as the route spells it: the
    contract's Idempotency-Key where no route matched, None where the key is in the body."""
    if route is None:
        return keys.HEADER
    return None if route.key_pointer is not None else route.key_header_shown


async def _stream(
    relay: Relay, send: Send, receive: Receive, route_name: str, request_id: str
) -> bool:
    """Relay a body as the upstream sends it; chunked, so an answer that breaks off ends
    without the last chunk and the client sees it cut short (the connection is closed).
    The client's hang-up lets the relay go at once (`Relay.abandon`): after it, the server's
    `send` returns without a word, so only the disconnect says so. True when the key (if any)
    turned `unknown` with the answer."""
    watch = asyncio.get_running_loop().create_task(_hung_up(receive))

    def hung_up(done: asyncio.Task[None]) -> None:
        if not done.cancelled():
            done.exception()  # retrieved: a receive that failed says the client is gone too
            relay.abandon()

    watch.add_done_callback(hung_up)
    try:
        async for chunk in relay:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
    except Broken as broken:
        if not relay.abandoned:
            log.warning("%s: %s; the connection is closed (request %s)",
                        route_name, broken.reason, request_id)  # fmt: skip
        return broken.unknown and not relay.abandoned  # the server closes the connection
    except BaseException:
        relay.abandon()  # the client's side is gone: the pump settles the key
        raise
    finally:
        watch.cancel()
    await send({"type": "http.response.body", "body": b""})
    return False


async def _slices(body: bytes, send: Send, patience: float) -> bool:
    """Send a large answer in slices of `SLICE` bytes, each copied out of `body`: the server's
    write buffer holds a slice or two, never a view that keeps all of `body` alive. False when
    a slice waited `patience` seconds for the client to take what came before (a client that
    reads nothing, or too slowly): the caller drops the answer, and with it its copy, rather
    than hold it as long as the client keeps the connection (as `streaming.Relay` lets a
    relayed answer go after the route's timeout)."""
    view = memoryview(body)
    for start in range(0, len(body), SLICE):
        message = {"type": "http.response.body", "body": bytes(view[start : start + SLICE]),
                   "more_body": start + SLICE < len(body)}  # fmt: skip
        try:
            await asyncio.wait_for(send(message), patience)
        except TimeoutError:
            return False
    return True


def _relayed(
    answer: Answer, method: str
) -> tuple[int, list[tuple[bytes, bytes]], bytes, list[str]]:
    """Status, headers and body to send, and the names of the headers left out (no HTTP/1.1
    answer may carry them). The request id is added once, by the caller."""
    response_headers, dropped = headers.relayable(answer.headers, skip=headers.REQUEST_ID)
    body = answer.body
    if answer.stream is not None:
        return answer.status, response_headers, body, dropped  # chunked: no length
    if headers.bodiless(method, answer.status):
        body = b""  # whatever was stored or received, these answers carry none
    else:
        response_headers.append((b"content-length", str(len(body)).encode()))
    return answer.status, response_headers, body, dropped


def _account(
    route_name: str,
    method: str,
    said: Said,
    status: int,
    dropped: list[str],
    elapsed: float,
    request_id: str,
) -> None:
    """Count the request once and log it as one line, never with its body or credentials."""
    outcome = said.outcome
    blocked = said.blocked if isinstance(said, Answer) else said.blocked_reason
    tracing.annotate(route_name, outcome)
    metrics.labelled(metrics.REQUESTS, route_name, method, outcome).inc()
    metrics.labelled(metrics.REQUEST_DURATION, route_name, outcome).observe(elapsed)
    if blocked is not None:
        metrics.labelled(metrics.DUPLICATES_BLOCKED, route_name, blocked).inc()
    if dropped:
        log.warning(
            "%s: left out the answer's headers %s: a control byte in a value (or a name that "
            "is not a token) cannot be sent in an HTTP/1.1 answer; the client was told in "
            "Oncegate-Dropped-Headers (request %s)",
            route_name, ", ".join(repr(name) for name in dropped), request_id,
            extra={"fields": {"route": route_name, "dropped_headers": dropped,
                              "request_id": request_id}},
        )  # fmt: skip
    if log.isEnabledFor(logging.INFO):
        upstream = said.upstream_seconds if isinstance(said, Answer) else None
        logs.request_line(
            log, route_name, method, outcome, status,
            None if upstream is None else round(upstream * 1000, 3),
            round(elapsed * 1000, 3), request_id,
        )  # fmt: skip


async def _hung_up(receive: Receive) -> None:
    """Return once the client has hung up: after the whole body, the server's next message for
    this request is the disconnect."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def read_body(
    receive: Receive, request_headers: Sequence[tuple[str, str]], limit: int, whose: str
) -> bytes:
    """The whole request body, refusing (413) as soon as it is known to exceed `limit` (`whose`
    limit, as the refusal names it): by its Content-Length before a byte is read, else as it
    arrives, so no more than `limit` bytes are ever held."""
    for name, value in request_headers:
        if name == "content-length" and value.isdigit() and int(value) > limit:
            raise _too_large(limit, whose)
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnected
        chunk: bytes = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise _too_large(limit, whose)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _too_large(limit: int, whose: str) -> errors.BodyTooLarge:
    return errors.BodyTooLarge(f"the request body is larger than {whose} of {limit} bytes")
