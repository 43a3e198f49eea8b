"""The proxy port: every path, every method, through `service.Gateway`.

A plain ASGI application rather than a FastAPI route: the port has one catch-all handler and no
use for validation, documentation or middleware, and the framework's request machinery cost more
CPU per replayed request than the two database round trips (measured; docs/performance.md).

Each request is logged as one structured line (route, method, outcome, status, upstream and
total time, request id) and never with its body or credentials. The request id is the client's
`X-Request-Id` when it sent a sane one, else a new one; it is sent upstream and back.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from .. import errors, keys, metrics, paths
from ..service import Gateway, ProxyRequest, RouteTable
from . import problems

log = logging.getLogger("oncegate.request")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

# The route label of a request that matched no route. Route names cannot contain parentheses,
# so it never collides with one.
UNMATCHED = "(unmatched)"
REQUEST_ID = "x-request-id"
_SANE_REQUEST_ID = re.compile(r"^[\x21-\x7e]{1,128}$")
_NO_BODY_STATUSES = frozenset({204, 304})


class ClientDisconnected(Exception):
    """The client went away before its request body was complete."""


class ProxyApp:
    def __init__(self, gateway: Gateway, routes: RouteTable) -> None:
        self._gateway = gateway
        self._routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return  # no lifespan (the runtime owns resources) and no websockets
        started = time.perf_counter()
        method: str = scope["method"]
        headers = [(name.decode("latin-1"), value.decode("latin-1"))
                   for name, value in scope["headers"]]  # fmt: skip
        request_id = _request_id(headers)
        route_name = UNMATCHED
        upstream_seconds: float | None = None
        blocked: str | None
        try:
            check_head(scope.get("http_version", "1.1"), headers)
            path = paths.normalize(scope.get("raw_path", b"").decode("latin-1") or scope["path"])
            route = self._routes.match(path)
            if route is None:
                raise errors.RouteNotFound(f"no route of this gateway matches the path {path!r}")
            route_name = route.name
            body = await read_body(receive, headers, route.max_body)
            result = await self._gateway.handle(
                route,
                ProxyRequest(
                    method=method,
                    path=path,
                    query=scope.get("query_string", b"").decode("latin-1"),
                    headers=headers,
                    body=body,
                ),
            )
            status, body = result.status, result.body
            response_headers = [
                (name.encode("latin-1"), value.encode("latin-1"))
                for name, value in result.headers
                if name.lower() != REQUEST_ID  # ours is added once, below
            ]
            if status in _NO_BODY_STATUSES or method == "HEAD":
                body = b""  # whatever was stored or received, these answers carry none
            else:
                response_headers.append((b"content-length", str(len(body)).encode()))
            outcome, blocked, upstream_seconds = (
                result.outcome,
                result.blocked,
                result.upstream_seconds,
            )
        except errors.GatewayError as error:
            status, response_headers, body = problems.parts(error)
            outcome, blocked = error.outcome, error.blocked_reason
        except ClientDisconnected:
            return  # nothing was claimed, and nobody is left to answer
        except Exception:  # the edge's last resort: logged and answered, not swallowed
            # A bug: the client still gets a problem (with the request id to report), never a
            # bare 500; the key, if one was claimed, was settled by the layers below.
            log.exception("unexpected error while serving request %s", request_id)
            failure = errors.GatewayError(
                f"the gateway failed unexpectedly; report request id {request_id} to its operator"
            )
            status, response_headers, body = problems.parts(failure)
            outcome, blocked = failure.outcome, None
        response_headers.append((b"x-request-id", request_id.encode()))
        await send({"type": "http.response.start", "status": status, "headers": response_headers})
        await send({"type": "http.response.body", "body": body})
        elapsed = time.perf_counter() - started
        metrics.REQUESTS.labels(route_name, method, outcome).inc()
        metrics.REQUEST_DURATION.labels(route_name, outcome).observe(elapsed)
        if blocked is not None:
            metrics.DUPLICATES_BLOCKED.labels(route_name, blocked).inc()
        if log.isEnabledFor(logging.INFO):
            log.info(
                "%s %s %s -> %d %s",
                route_name, method, outcome, status, request_id,
                extra={"fields": {
                    "route": route_name,
                    "method": method,
                    "outcome": outcome,
                    "status": status,
                    "upstream_ms": None if upstream_seconds is None
                    else round(upstream_seconds * 1000, 3),
                    "total_ms": round(elapsed * 1000, 3),
                    "request_id": request_id,
                }},
            )  # fmt: skip


def check_head(http_version: str, headers: list[tuple[str, str]]) -> None:
    """Refuse what cannot be passed on as the client meant it (docs/security.md):
    - an HTTP/1.1 request without exactly one Host (RFC 9112 §3.2 says 400);
    - a transfer coding other than chunked: the body is read without it and sent with a
      Content-Length, so the upstream would get coded bytes it has no way to decode (501);
    - a header value that cannot reach the upstream byte for byte: values arrive as Latin-1
      text, one character per byte, and the upstream client writes text as UTF-8, so a value
      above ASCII passes unchanged only when its bytes are UTF-8."""
    hosts = 0
    for name, value in headers:
        if name == "host":
            hosts += 1
        elif name == "transfer-encoding" and value.strip().lower() != "chunked":
            raise errors.UnsupportedTransferCoding(
                f"the gateway supports the chunked transfer coding alone, not {value!r}; send "
                "the body without a transfer coding (a Content-Encoding is passed on unchanged)"
            )
        if not value.isascii():
            try:
                value.encode("latin-1").decode("utf-8")
            except UnicodeDecodeError:
                if name == keys.HEADER:
                    raise errors.InvalidKey("an Idempotency-Key is printable ASCII") from None
                raise errors.InvalidHeader(
                    f"the value of the {name!r} header is not UTF-8 text, and the gateway "
                    "forwards header values unchanged or not at all; send it as UTF-8 (or ASCII)"
                ) from None
    if hosts != 1 and (hosts or http_version == "1.1"):
        raise errors.MalformedRequest(
            f"an HTTP/{http_version} request carries exactly one Host header, not {hosts}"
        )


def _request_id(headers: list[tuple[str, str]]) -> str:
    """The client's request id if it sent one sane one; else a new one, added to `headers` so
    the upstream gets it too."""
    given = [value for name, value in headers if name == REQUEST_ID]
    if len(given) == 1 and _SANE_REQUEST_ID.match(given[0]):
        return given[0]
    headers[:] = [(name, value) for name, value in headers if name != REQUEST_ID]
    request_id = uuid.uuid4().hex
    headers.append((REQUEST_ID, request_id))
    return request_id


async def read_body(receive: Receive, headers: list[tuple[str, str]], limit: int) -> bytes:
    """The whole request body, refusing (413) as soon as it is known to exceed `limit`."""
    too_large = errors.BodyTooLarge(
        f"the request body is larger than this route's limit of {limit} bytes"
    )
    for name, value in headers:
        if name == "content-length" and value.isdigit() and int(value) > limit:
            raise too_large
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnected
        chunk: bytes = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)
