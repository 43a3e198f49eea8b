"""The proxy port: every path, every method, through `service.Gateway`."""

from __future__ import annotations

import time
from typing import Annotated

from fastapi import APIRouter, Depends, Request
from starlette.requests import ClientDisconnect
from starlette.responses import Response

from app import errors, metrics
from app.http import problems
from app.service import Gateway, ProxyRequest, ProxyResponse, RouteTable

# The route label of a request that matched no route. Route names cannot contain parentheses,
# so it never collides with one.
UNMATCHED = "(unmatched)"
METHODS = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]

router = APIRouter()


def get_gateway(request: Request) -> Gateway:
    gateway: Gateway = request.app.state.gateway
    return gateway


def get_routes(request: Request) -> RouteTable:
    routes: RouteTable = request.app.state.routes
    return routes


@router.api_route("/{path:path}", methods=METHODS, include_in_schema=False)
async def proxy(
    request: Request,
    gateway: Annotated[Gateway, Depends(get_gateway)],
    routes: Annotated[RouteTable, Depends(get_routes)],
) -> Response:
    started = time.perf_counter()
    path = request.scope.get("raw_path", b"").decode("latin-1") or request.scope["path"]
    route = routes.match(path)
    route_name = route.name if route else UNMATCHED
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
                headers=[
                    (name.decode("latin-1"), value.decode("latin-1"))
                    for name, value in request.scope["headers"]
                ],
                body=body,
            ),
        )
        response = to_response(result)
        outcome, blocked = result.outcome, result.blocked
    except errors.GatewayError as error:
        response = problems.render(error)
        outcome, blocked = error.outcome, error.blocked_reason
    except ClientDisconnect:
        # The client left while sending its body: nothing was claimed, nobody to answer.
        return Response(status_code=400)
    metrics.REQUESTS.labels(route_name, request.method, outcome).inc()
    metrics.REQUEST_DURATION.labels(route_name, outcome).observe(time.perf_counter() - started)
    if blocked is not None:
        metrics.DUPLICATES_BLOCKED.labels(route_name, blocked).inc()
    return response


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
        (name.encode("latin-1"), value.encode("latin-1")) for name, value in result.headers
    )
    return response
