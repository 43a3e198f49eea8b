"""The composition root: the runtime (store, upstream client, service) and the two applications
built on it. The one module of `oncegate.http` that names the PostgreSQL store and the upstream
client (import-linter holds the rest of the layer to the service).

`running` owns the database pool, the upstream client, the background purger and the key counter
for as long as the gateway runs; the proxy application is given the service and the route table,
the admin application reaches the runtime through `app.state.runtime` (the `Annotated`
dependency of `deps.py`, which the route modules import instead of this module). On the way out
it waits for every forward still in flight before letting go of anything, so a request whose
client hung up is still finished and stored; an answer still relayed the longest route timeout
after the stop began is cut (`relaying_grace`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import service
from ..kernel.key_workers import KeyWorkers
from ..kernel.sealing import Keyring
from ..model import errors
from ..service.routing import RouteTable
from ..service.tokens import Identities
from ..settings import Settings
from ..store.postgres import PostgresStore
from ..telemetry import metrics
from ..upstream import Upstream
from ..upstream.client import HttpUpstream
from . import admin, problems, proxy, sessions, ui
from .deps import Runtime

log = logging.getLogger(__name__)


@contextlib.asynccontextmanager
async def running(settings: Settings, database_url: str) -> AsyncIterator[Runtime]:
    metrics.require_setup()  # where values live is the process's choice, made before this
    store = await PostgresStore.connect(database_url, settings.store_options())
    upstream = HttpUpstream()
    keyring = settings.keyring()
    keeping = [route.name for route in settings.routes if route.keep_request != "never"]
    if keyring is None and keeping:
        log.warning(
            "routes %s keep the request behind each key in flight, its credentials included, in "
            "plaintext in PostgreSQL: set ONCEGATE_ENCRYPTION_KEYS to seal them, or give a route "
            "keep_request: never (docs/operations.md)",
            ", ".join(keeping),
        )
    key_workers = KeyWorkers()
    identities = Identities(settings.routes)
    await identities.start()
    gateway = gateway_of(settings, store.requests, upstream, keyring, key_workers, identities)
    purger = asyncio.create_task(_purge_forever(store.upkeep, settings.purge_interval))
    counter = asyncio.create_task(_count_keys_forever(store.upkeep, settings.key_count_interval))
    for route in settings.routes:
        # Every route's block counters exist from the start, at zero, so a dashboard's rate()
        # has a series to show before the first duplicate arrives.
        for reason in metrics.BLOCK_REASONS:
            metrics.DUPLICATES_BLOCKED.labels(route.name, reason)
    try:
        yield Runtime(
            settings,
            gateway,
            service.Operator(store.operator, keyring, gateway, settings.routes),
            service.Health(store.upkeep),
            RouteTable(settings.routes),
        )
    finally:
        await gateway.drain(relaying_grace(settings))
        for task in (purger, counter):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await key_workers.close()
        await identities.close()
        await upstream.aclose()
        await store.close()


def relaying_grace(settings: Settings) -> float:
    """How long answers still relayed when the gateway is told to stop may take to end before
    they are cut (`Gateway.stop_relaying`): the longest route `timeout`, the time a forward
    sent just before the signal may take to bring its head; docs/operations.md tells
    orchestrators to wait longer than that."""
    return max((route.timeout for route in settings.routes), default=0.0)


def gateway_of(
    settings: Settings,
    store: service.RequestStore,
    upstream: Upstream,
    keyring: Keyring | None,
    key_workers: KeyWorkers | None = None,
    identities: Identities | None = None,
) -> service.Gateway:
    """The request path's service, as the settings make it (bench/memory_gateway.py makes it
    with the in-memory store)."""
    waiters = (settings.max_waiters, settings.max_waiters_per_key)
    return service.Gateway(store, upstream, keyring, waiters, key_workers, identities)


def create_proxy_app(runtime: Runtime) -> proxy.ProxyApp:
    # The proxy port forwards every path, /docs included: no routes of its own.
    return proxy.ProxyApp(runtime.gateway, runtime.routes)


def create_admin_app(runtime: Runtime) -> FastAPI:
    # No generated documentation (/docs, /redoc, /openapi.json): Swagger UI would load its script
    # from a public CDN on the same origin as /admin/ui, unauthenticated; docs/reference.md is
    # the reference.
    app = FastAPI(
        title="oncegate admin",
        description="Metrics, health, and the keys of the idempotency store.",
        version="1",
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.state.runtime = runtime
    app.include_router(admin.router)
    app.include_router(ui.router)
    app.add_exception_handler(sessions.LoginNeeded, ui.login_needed)
    # One error format on both ports: FastAPI's own errors are turned into problems too.
    app.add_exception_handler(errors.GatewayError, _render_problem)
    app.add_exception_handler(RequestValidationError, _render_invalid_request)
    app.add_exception_handler(StarletteHTTPException, _render_http_error)
    return app


async def _render_problem(request: Request, error: Exception) -> Response:
    assert isinstance(error, errors.GatewayError)
    return problems.render(error)


async def _render_invalid_request(request: Request, error: Exception) -> Response:
    assert isinstance(error, RequestValidationError)
    in_body = any(detail["loc"][:1] == ("body",) for detail in error.errors())
    messages = "; ".join(
        f"{'.'.join(str(part) for part in detail['loc'])}: {detail['msg']}"
        for detail in error.errors()
    )
    return problems.render(errors.InvalidRequest(messages, status=422 if in_body else 400))


async def _render_http_error(request: Request, error: Exception) -> Response:
    """The framework's own answers (no such path, method not allowed) as problems."""
    assert isinstance(error, StarletteHTTPException)
    if error.status_code == 404:
        problem: errors.GatewayError = errors.NotFound(
            f"the admin port has no {request.url.path!r}: it serves /metrics, /healthz, "
            "/readyz, /admin/keys and /admin/ui"
        )
    else:
        problem = errors.InvalidRequest(str(error.detail), status=error.status_code)
    problem.headers.update(error.headers or {})
    return problems.render(problem)


async def _purge_forever(store: service.UpkeepStore, interval: float) -> None:
    """Delete expired keys now and then. Correctness never waits for this: every read checks
    `expires_at` itself; the purger only keeps the table small."""
    while True:
        await asyncio.sleep(interval)
        try:
            await service.purge_expired(store)
        except errors.StoreUnavailable:
            log.warning("purge skipped: the store is unavailable; trying again in %gs", interval)


async def _count_keys_forever(store: service.UpkeepStore, interval: float) -> None:
    """Keep `oncegate_keys{state}` current, and `oncegate_store_failover_unsafe` with it: at
    start, then every `interval`, try for the key count's turn; the one process per database
    holding it sweeps the keys and announces the totals, and every process sets its gauge from
    the announcement when it arrives (none is shown before the first). Each process reads the
    primary's standbys itself (one cheap statement)."""
    while True:
        try:
            if await store.take_key_count():
                await store.publish_key_count(await service.count_keys(store))
            await store.replication()
        except errors.StoreUnavailable:
            log.warning("key count skipped: the store is unavailable; again in %gs", interval)
        await asyncio.sleep(interval)
