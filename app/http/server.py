"""Running the proxy and admin applications together under uvicorn, in one event loop.

Both servers stop on the first SIGTERM or SIGINT: they stop accepting, finish the requests they
have, then `running` waits for forwards still in flight and closes the pool. A second signal
forces the exit. The process then ends normally (status 0), so `finally` blocks and atexit
handlers run and the embedded PostgreSQL is stopped.
"""

from __future__ import annotations

import asyncio
import signal
import socket
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn

from app import errors
from app.http.app import create_admin_app, create_proxy_app, running
from app.settings import Settings

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class _Server(uvicorn.Server):
    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        # `serve` below handles signals once for both servers; uvicorn's own handling would let
        # the second server's handlers replace the first's, and re-raise the signal at the end.
        yield


def run(settings: Settings, database_url: str) -> None:
    sockets = [_bind(settings.host, settings.port), _bind(settings.host, settings.admin_port)]
    loop_factory = _config(None, settings).get_loop_factory()
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(_serve(settings, database_url, sockets))


async def _serve(settings: Settings, database_url: str, sockets: list[socket.socket]) -> None:
    async with running(settings, database_url) as runtime:
        servers = [
            _Server(_config(create_proxy_app(runtime), settings)),
            _Server(_config(create_admin_app(runtime), settings)),
        ]
        loop = asyncio.get_running_loop()

        def stop() -> None:
            for server in servers:
                if server.should_exit:
                    server.force_exit = True
                server.should_exit = True

        for number in _SIGNALS:
            loop.add_signal_handler(number, stop)
        try:
            await asyncio.gather(
                *(
                    server.serve(sockets=[sock])
                    for server, sock in zip(servers, sockets, strict=True)
                )
            )
        finally:
            for number in _SIGNALS:
                loop.remove_signal_handler(number)


def _config(app: object, settings: Settings) -> uvicorn.Config:
    return uvicorn.Config(
        app,  # type: ignore[arg-type]
        lifespan="off",  # `running` owns the resources of both applications
        log_config=None,
        access_log=False,  # the proxy logs one structured line per request itself
        # Proxied answers carry the upstream's Server and Date headers, not ours.
        server_header=False,
        date_header=False,
    )


def _bind(host: str, port: int) -> socket.socket:
    """Bind before anything starts, so a busy port is a clear message and not a traceback."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family, reuse_port=False, backlog=2048)
    except OSError as exc:
        raise errors.ConfigError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
