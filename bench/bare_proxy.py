"""The bare Python proxy of bench/run.py: the gateway's server stack with no idempotency.

Same stack as `oncegate serve`: uvicorn (its default loop, so uvloop when installed) with the
gateway's HTTP/1.1 protocol (`oncegate.http.protocol`, httptools underneath), the same server
options, and the gateway's own upstream client
(`oncegate.upstream.client.HttpUpstream`, imported, not copied), so the difference between this
proxy and the gateway's forward path is the idempotency work and nothing else. The application
is a plain ASGI callable like the gateway's proxy port (`oncegate.http.proxy.ProxyApp`), or with
`--stack fastapi` one catch-all FastAPI route (the gateway's proxy port before it left
FastAPI). When the gateway's server stack changes (workers, loop, HTTP parser, framework),
change it here too or the ratios stop meaning anything.

    .venv/bin/python bench/bare_proxy.py --upstream http://127.0.0.1:9000 --port 8090

`bench/idemkit_proxy.py` mounts idemkit's middleware on `create_app`."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

# The repository root, so `app` imports when this file runs as a script from anywhere.
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))

import uvicorn
from fastapi import FastAPI, Request
from starlette.requests import ClientDisconnect
from starlette.responses import Response

from oncegate.http.protocol import HttpProtocol
from oncegate.http.server import quiet_collector
from oncegate.upstream import AnswerLost, NotSent
from oncegate.upstream.client import HttpUpstream

# What the FastAPI route answers: every method the gateway's proxy port takes.
METHODS = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]
# The gateway's default route timeout.
TIMEOUT = 30.0
# Read by `from_environment`, the factory uvicorn's worker processes import (--workers > 1).
UPSTREAM_VARIABLE = "BENCH_UPSTREAM"
STACK_VARIABLE = "BENCH_STACK"


def create_app(upstream_url: str, stack: str = "asgi") -> Any:
    """The bare proxy as a plain ASGI application (`asgi`, like the gateway's proxy port,
    `oncegate.http.proxy.ProxyApp`) or as one catch-all FastAPI route (`fastapi`)."""
    target = upstream_url.rstrip("/")
    upstream: HttpUpstream | None = None

    async def forward(
        method: str, path: str, query: str, headers: list[tuple[bytes, bytes]], body: bytes
    ) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        assert upstream is not None
        try:
            answer = await upstream.send(
                method,
                target + path + ("?" + query if query else ""),
                [(name.decode("latin-1"), value.decode("latin-1")) for name, value in headers],
                body,
                TIMEOUT,
            )
        except NotSent:
            return 502, [], b""
        except AnswerLost as exc:
            return (504 if exc.timed_out else 502), [], b""
        return (
            answer.status,
            [(name.encode("latin-1"), value.encode("latin-1")) for name, value in answer.headers],
            answer.body,
        )

    @contextlib.asynccontextmanager
    async def lifespan(app: object) -> AsyncIterator[None]:
        nonlocal upstream
        upstream = HttpUpstream()
        try:
            yield
        finally:
            await upstream.aclose()

    if stack == "fastapi":
        return _fastapi_app(lifespan, forward)
    return _AsgiApp(lifespan, forward)


class _AsgiApp:
    def __init__(self, lifespan: Any, forward: Any) -> None:
        self._lifespan = lifespan
        self._forward = forward

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await self._run_lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        chunks = []
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left while sending its body (wrk stopping)
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        status, headers, body = await self._forward(
            scope["method"],
            scope.get("raw_path", b"").decode("latin-1") or scope["path"],
            scope.get("query_string", b"").decode("latin-1"),
            scope["headers"],
            b"".join(chunks),
        )
        headers.append((b"content-length", str(len(body)).encode()))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def _run_lifespan(self, receive: Any, send: Any) -> None:
        context = self._lifespan(self)
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await context.__aenter__()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await context.__aexit__(None, None, None)
                await send({"type": "lifespan.shutdown.complete"})
                return


def _fastapi_app(lifespan: Any, forward: Any) -> FastAPI:
    app = FastAPI(lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.api_route("/{path:path}", methods=METHODS, include_in_schema=False)
    async def proxy(request: Request) -> Response:
        try:
            body = await request.body()
        except ClientDisconnect:
            return Response(status_code=400)  # the client left while sending its body
        status, headers, content = await forward(
            request.method,
            request.scope.get("raw_path", b"").decode("latin-1") or request.scope["path"],
            request.scope.get("query_string", b"").decode("latin-1"),
            request.scope["headers"],
            body,
        )
        response = Response(content=content, status_code=status)
        response.raw_headers.extend(headers)
        return response

    return app


def from_environment() -> Any:
    application = create_app(os.environ[UPSTREAM_VARIABLE], os.environ.get(STACK_VARIABLE, "asgi"))
    # As the gateway does before it serves (imported, not copied): the cyclic collector stops
    # walking what is loaded by now, and collects young objects less often. The line every row
    # is compared to gets the same treatment as the rows.
    quiet_collector()
    return application


def serve(factory: str, host: str, port: int, workers: int) -> None:
    """Serve the app `factory` ("module:function") builds, with the gateway's uvicorn options
    (app/commands/cli.py `_serve`). With several workers each worker process calls the factory
    itself."""
    options = {
        "host": host,
        "port": port,
        "http": HttpProtocol,  # the gateway's HTTP/1.1 protocol (oncegate.http.protocol)
        "log_config": None,
        "access_log": False,
        "server_header": False,
        "date_header": False,
    }
    if workers > 1:
        uvicorn.run(factory, factory=True, workers=workers, **options)
        return
    module, _, name = factory.partition(":")
    application = getattr(importlib.import_module(module), name)()
    uvicorn.Server(uvicorn.Config(application, **options)).run()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--upstream", required=True, metavar="URL")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8090)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--stack", choices=["asgi", "fastapi"], default="asgi")
    arguments = parser.parse_args()
    os.environ[UPSTREAM_VARIABLE] = arguments.upstream
    os.environ[STACK_VARIABLE] = arguments.stack
    serve("bare_proxy:from_environment", arguments.host, arguments.port, arguments.workers)
    return 0


if __name__ == "__main__":
    sys.exit(main())
