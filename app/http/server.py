"""Running the proxy and admin applications together under uvicorn, in one event loop.

Both servers stop on the first SIGTERM or SIGINT: they stop accepting, finish the requests they
have, then `running` waits for forwards still in flight and closes the pool. A second signal
forces the exit. The process then ends normally (status 0), so `finally` blocks and atexit
handlers run and the embedded PostgreSQL is stopped.

With `--workers N` the sockets are bound once and N forked worker processes serve them, each with
its own event loop, pool and upstream client: several processes are safe because PostgreSQL
arbitrates every claim. The parent only supervises: it passes signals on, waits for the workers
to drain, and starts a new worker if one dies. Metrics are then collected across the workers
(prometheus_client's multiprocess mode, set up by the CLI before anything imports it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn

from .. import errors
from ..settings import Settings
from . import protocol
from .app import create_admin_app, create_proxy_app, running

log = logging.getLogger(__name__)
_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class _Server(uvicorn.Server):
    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        # `serve` below handles signals once for both servers; uvicorn's own handling would let
        # the second server's handlers replace the first's, and re-raise the signal at the end.
        yield


def run(settings: Settings, database_url: str) -> None:
    sockets = [_bind(settings.host, settings.port), _bind(settings.host, settings.admin_port)]
    if settings.workers == 1:
        _work(settings, database_url, sockets)
    else:
        _supervise(settings, database_url, sockets)


def _work(settings: Settings, database_url: str, sockets: list[socket.socket]) -> None:
    loop_factory = _config(None, settings).get_loop_factory()
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(_serve(settings, database_url, sockets))


def _supervise(settings: Settings, database_url: str, sockets: list[socket.socket]) -> None:
    from prometheus_client import multiprocess

    workers: set[int] = set()
    stopping = False

    def start_worker() -> None:
        pid = os.fork()
        if pid == 0:  # the worker
            for number in _SIGNALS:
                signal.signal(number, signal.SIG_DFL)
            status = 1
            try:
                _work(settings, database_url, sockets)
                status = 0
            except BaseException:
                log.exception("worker %d failed", os.getpid())
            finally:
                # Never run the parent's cleanup (atexit: the embedded PostgreSQL) in a worker.
                os._exit(status)
        workers.add(pid)

    def pass_on(number: int, frame: object) -> None:
        nonlocal stopping
        stopping = True
        for pid in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, number)

    previous = {number: signal.signal(number, pass_on) for number in _SIGNALS}
    try:
        for _ in range(settings.workers):
            start_worker()
        log.info("serving with %d worker processes", settings.workers)
        while workers:
            pid, status = os.wait()
            workers.discard(pid)
            multiprocess.mark_process_dead(pid)  # type: ignore[no-untyped-call]  # untyped upstream
            if not stopping:
                log.error("worker %d ended (wait status %d); starting another", pid, status)
                start_worker()
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


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
        http=protocol.HttpProtocol,  # upgrade offers are ignored, bodies kept (protocol.py)
        ws="none",  # no WebSocket: an upgrade to it is an offer like any other
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
