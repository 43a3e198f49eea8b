"""Running the proxy and admin applications together under uvicorn, in one event loop.

Both servers stop on the first SIGTERM or SIGINT: they stop accepting, finish the requests they
have (answers still relayed the longest route timeout later are cut), then `running` waits for
forwards still in flight and closes the pool. A second signal
forces the exit. The process then ends normally, so `finally` blocks and atexit handlers run and
the embedded PostgreSQL is stopped; `run` returns the signal that stopped it, and the CLI's exit
status says which (0 after SIGTERM, 130 after SIGINT: a shell's parent learns it was interrupted).

With `--workers N` the sockets are bound once and N forked worker processes serve them, each with
its own event loop, pool and upstream client: several processes are safe because PostgreSQL
arbitrates every claim. The parent only supervises: it passes signals on, waits for the workers
to drain, and starts a new worker if one dies. Metrics are then collected across the workers
(`metrics.setup(multiprocess_dir=...)`, called by the CLI before the workers are forked).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import uvicorn

from ..model import errors
from ..model.records import HeldKeys
from ..settings import Settings
from ..telemetry import metrics, tracing
from . import protocol
from .runtime import create_admin_app, create_proxy_app, relaying_grace, running

# See `quiet_collector`.
YOUNG_COLLECTIONS_EVERY = 20_000

log = logging.getLogger(__name__)
_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class _Server(uvicorn.Server):
    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        # `serve` below handles signals once for both servers; uvicorn's own handling would let
        # the second server's handlers replace the first's, and re-raise the signal at the end.
        yield


@dataclass(frozen=True)
class Summary:
    """What the start-up line says about the store."""

    database: str  # the embedded data directory, or the URL without its password
    keys: HeldKeys  # exact up to a thousand, estimated above (store.postgres.upkeep)


def run(
    settings: Settings, database_url: str, summary: Summary, received: list[int] | None = None
) -> int | None:
    """Serve until a signal, and return it (None if none came). `received`: signals that came
    before the servers could handle them (the CLI holds them while the gateway starts); the
    servers then stop as soon as they start. Signals that come later are added to it."""
    received = [] if received is None else received
    sockets = [bind(settings.host, settings.port), bind(settings.host, settings.admin_port)]
    _announce(settings, sockets, summary)
    if settings.workers == 1:
        _work(settings, database_url, sockets, received)
    elif not received:
        _supervise(settings, database_url, sockets, received)
    return received[0] if received else None


def _announce(settings: Settings, sockets: list[socket.socket], summary: Summary) -> None:
    """The one start-up line: where to reach it, which store it opened, what the admin API is."""
    proxy, admin = (_address(sock) for sock in sockets)
    admin_api = (
        "enabled (Authorization: Bearer $ONCEGATE_ADMIN_TOKEN)"
        if settings.admin_token
        else "disabled (set ONCEGATE_ADMIN_TOKEN to enable it)"
    )
    log.info(
        "oncegate serving: proxy on %s, admin on %s (/metrics, /healthz, /readyz); database: "
        "%s, keys held: %s; admin API %s",
        proxy,
        admin,
        summary.database,
        summary.keys,
        admin_api,
        extra={
            "fields": {
                "proxy": proxy,
                "admin": admin,
                "database": summary.database,
                "keys": summary.keys.keys,
                "keys_exact": summary.keys.exact,
                "admin_api": bool(settings.admin_token),
                "workers": settings.workers,
            }
        },
    )


def _address(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _work(
    settings: Settings, database_url: str, sockets: list[socket.socket], received: list[int]
) -> None:
    loop_factory = uvicorn_config(None).get_loop_factory()
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(_serve(settings, database_url, sockets, received))


def _supervise(
    settings: Settings, database_url: str, sockets: list[socket.socket], received: list[int]
) -> None:
    workers: set[int] = set()
    stopping = False

    def start_worker() -> None:
        pid = os.fork()
        if pid == 0:  # the worker
            for number in _SIGNALS:
                signal.signal(number, signal.SIG_DFL)
            status = 1
            try:
                _work(settings, database_url, sockets, [])
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
        received.append(number)
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
            metrics.mark_process_dead(pid)
            if not stopping:
                log.error("worker %d ended (wait status %d); starting another", pid, status)
                start_worker()
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


async def _serve(
    settings: Settings, database_url: str, sockets: list[socket.socket], received: list[int]
) -> None:
    # Per process: with --workers, each worker exports its own spans (an exporter's thread does
    # not survive a fork).
    if tracing.setup(settings.otel_variables):
        log.info(
            "tracing: exporting spans to %s", settings.otel_variables[tracing.ENDPOINT_VARIABLE]
        )
    try:
        await _serve_traced(settings, database_url, sockets, received)
    finally:
        tracing.shutdown()


async def _serve_traced(
    settings: Settings, database_url: str, sockets: list[socket.socket], received: list[int]
) -> None:
    async with running(settings, database_url) as runtime:
        servers = [
            _Server(uvicorn_config(tracing.wrap(create_proxy_app(runtime)))),
            _Server(uvicorn_config(create_admin_app(runtime))),
        ]
        loop = asyncio.get_running_loop()

        def stop() -> None:
            if any(server.should_exit for server in servers):
                log.warning("second signal: exiting without waiting")
            else:
                log.info("stopping: no new connections; finishing the requests in flight")
            for server in servers:
                if server.should_exit:
                    server.force_exit = True
                server.should_exit = True
            # The servers wait for every request, and an endless answer never ends by itself.
            runtime.gateway.stop_relaying(relaying_grace(settings))

        for number in _SIGNALS:
            loop.add_signal_handler(number, _recorded, number, received, stop)
        if received:  # a signal came while the gateway was starting
            stop()
        quiet_collector()
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


def _recorded(number: int, received: list[int], stop: Callable[[], None]) -> None:
    received.append(number)
    stop()


def uvicorn_config(app: object, **where: Any) -> uvicorn.Config:
    """How the gateway serves an ASGI application: its sockets come from `run`, or `where`
    (host, port) says where to listen (bench/memory_gateway.py)."""
    return uvicorn.Config(
        app,  # type: ignore[arg-type]
        **where,
        lifespan="off",  # `running` owns the resources of both applications
        http=protocol.HttpProtocol,  # upgrade offers are ignored, bodies kept (protocol.py)
        ws="none",  # no WebSocket: an upgrade to it is an offer like any other
        log_config=None,
        access_log=False,  # the proxy logs one structured line per request itself
        # Proxied answers carry the upstream's Server and Date headers, not ours.
        server_header=False,
        date_header=False,
    )


def quiet_collector() -> None:
    """Tune the cyclic garbage collector for serving; called once, right before serving.

    - What exists by then (the libraries, the pools, the apps: some 120,000 objects) lives as long
      as the process. Frozen out of the collector's sight, a full collection walks only what
      requests left behind; otherwise each one walked all of it, 30-100 ms with every request on
      the loop stopped: the replay p99 (docs/performance.md).
    - A young collection runs every `YOUNG_COLLECTIONS_EVERY` net allocations, not every 700:
      at 700 one ran every dozen forwards and cost 0.53 s of 0.74 s of collecting in a 16 s run
      (gen 0, 1, 2), about 22 µs per request; at 20,000, 2 collections and 12 ms in the same run.
      Cyclic garbage is collected as surely, a few hundred requests later.
    """
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_COLLECTIONS_EVERY, middle, old)


def bind(host: str, port: int) -> socket.socket:
    """Bind before anything starts, so a busy port is a clear message and not a traceback."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family, reuse_port=False, backlog=2048)
    except OSError as exc:
        raise errors.ConfigError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
