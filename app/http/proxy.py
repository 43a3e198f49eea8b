"""The proxy port: every path, every method, through `service.Gateway`.

Each request is logged as one structured line (route, method, outcome, status, upstream and
total time, request id) and never with its body or credentials. The request id is the client's
`X-Request-Id` when it sent a sane one, else a new one; it is sent upstream and back.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from typing import Annotated

from fastapi import APIRouter, Depends, Request
from starlette.requests import ClientDisconnect
from starlette.responses import Response

from app import errors, metrics
from app.http import problems
from app.http.app import Runtime
from app.service import Gateway, ProxyRequest, ProxyResponse, RouteTable

log = logging.getLogger("oncegate.request")

# The route label of a request that matched no route. Route names cannot contain parentheses,
# so it never collides with one.
UNMATCHED = "(unmatched)"
METHODS = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]
REQUEST_ID = "x-request-id"
_SANE_REQUEST_ID = re.compile(r"^[\x21-\x7e]{1,128}$")

router = APIRouter()


def get_gateway(request: Request) -> Gateway:
    runtime: Runtime = request.app.state.runtime
    return runtime.gateway


def get_routes(request: Request) -> RouteTable:
    runtime: Runtime = request.app.state.runtime
    return runtime.routes


@router.api_route("/{path:path}", methods=METHODS, include_in_schema=False)
async def proxy(
    request: Request,
    gateway: Annotated[Gateway, Depends(get_gateway)],
    routes: Annotated[RouteTable, Depends(get_routes)],
) -> Response:
    started = time.perf_counter()
    path = request.scope.get("raw_path", b"").decode("latin-1") or request.scope["path"]
    headers = [
        (name.decode("latin-1"), value.decode("latin-1"))
        for name, value in request.scope["headers"]
    ]
    request_id = _request_id(headers)
    route = routes.match(path)
    route_name = route.name if route else UNMATCHED
    upstream_seconds: float | None = None
    blocked: str | None
    try:
        if route is None:
            raise errors.RouteNotFound(f"no route of this gateway matches the path {path!r}")
        body = await read_body(request, route.max_body)
        result = await gateway.handle(
            route,
            ProxyRequest(
                method=request.method,
                path=path,
                query=request.scope.get("query_string", b"").decode("latin-1"),
                headers=headers,
                body=body,
            ),
        )
        response = to_response(result)
        outcome, blocked, upstream_seconds = result.outcome, result.blocked, result.upstream_seconds
    except errors.GatewayError as error:
        response = problems.render(error)
        outcome, blocked = error.outcome, error.blocked_reason
    except ClientDisconnect:
        # The client left while sending its body: nothing was claimed, nobody to answer.
        return Response(status_code=400)
    response.raw_headers.append((b"x-request-id", request_id.encode()))
    elapsed = time.perf_counter() - started
    metrics.REQUESTS.labels(route_name, request.method, outcome).inc()
    metrics.REQUEST_DURATION.labels(route_name, outcome).observe(elapsed)
    if blocked is not None:
        metrics.DUPLICATES_BLOCKED.labels(route_name, blocked).inc()
    log.info(
        "%s %s %s -> %d %s",
        route_name, request.method, outcome, response.status_code, request_id,
        extra={"fields": {
            "route": route_name,
            "method": request.method,
            "outcome": outcome,
            "status": response.status_code,
            "upstream_ms": None if upstream_seconds is None else round(upstream_seconds * 1000, 3),
            "total_ms": round(elapsed * 1000, 3),
            "request_id": request_id,
        }},
    )  # fmt: skip
    return response


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


async def read_body(request: Request, limit: int) -> bytes:
    """The whole request body, refusing (413) as soon as it is known to exceed `limit`."""
    too_large = errors.BodyTooLarge(
        f"the request body is larger than this route's limit of {limit} bytes"
    )
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


def to_response(result: ProxyResponse) -> Response:
    response = Response(content=result.body, status_code=result.status)
    response.raw_headers.extend(
        (name.encode("latin-1"), value.encode("latin-1"))
        for name, value in result.headers
        if name.lower() != REQUEST_ID  # ours is added once, after
    )
    return response
