"""The gateway's request path with the in-memory store: `bench/run.py`'s row "oncegate forward,
in-memory store", which splits what a forward costs the gateway's process into the server stack
(the bare proxy's row), the gateway's own Python (this row less the bare proxy's) and the store
(the forward row less this one).

It is built as `oncegate serve` builds its proxy port (app/http/runtime.py, app/http/server.py):
the same settings and routes (`--upstream`, `--config`), logging, metrics, `Gateway`, `ProxyApp`,
event loop (uvloop) and uvicorn options. Only the store differs: `oncegate.store.memory`'s, whose
claims and completes are answered in the process, no statement sent; the in-memory store's own
Python (some 20 µs a forward at 64 connections) stays in the row. Left out, as no forward pays for
them: the admin port, the purge and key-count tasks, and the tracing wrapper (a no-op without an
OpenTelemetry endpoint). It is an instrument, never a way to run the gateway: the in-memory store
knows no other process and forgets everything when it stops.

    .venv/bin/python bench/memory_gateway.py --upstream URL [--config FILE] [--port PORT]
"""

from __future__ import annotations

import argparse
import asyncio
import sys

import uvicorn

from oncegate import settings
from oncegate.http import proxy, runtime, server
from oncegate.service.routing import RouteTable
from oncegate.store.memory import MemoryStore
from oncegate.telemetry import logs, metrics
from oncegate.upstream.client import HttpUpstream

# The keys the store holds at most: the gateway keeps none of its keys in its own process, so
# neither may its stand-in, or a run's keys (some 10^5) would cost it memory and collections the
# gateway never pays. Far more than the forwards in flight at once.
CAPACITY = 10_000


async def serve(config: settings.Settings) -> None:
    gateway = runtime.gateway_of(
        config, MemoryStore(capacity=CAPACITY), HttpUpstream(), config.keyring()
    )
    application = proxy.ProxyApp(gateway, RouteTable(config.routes))
    server.quiet_collector()  # as the gateway does right before it serves
    # Stopped by a signal, it ends with its server: it holds nothing to settle or hand back.
    await uvicorn.Server(
        server.uvicorn_config(application, host=config.host, port=config.port)
    ).serve()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--upstream", required=True, metavar="URL")
    parser.add_argument("--config", metavar="FILE")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8095)
    arguments = parser.parse_args()
    config = settings.load(vars(arguments))
    logs.configure(config.log_format, config.log_level)
    metrics.setup()
    # The gateway's event loop (uvloop where installed), as `serve` runs it (app/http/server.py).
    with asyncio.Runner(loop_factory=server.uvicorn_config(None).get_loop_factory()) as runner:
        runner.run(serve(config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
