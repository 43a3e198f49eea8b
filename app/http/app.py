"""The application factory. The lifespan owns the database pool, the upstream client and the
background purger; handlers reach them through `app.state` dependencies."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from fastapi import FastAPI

from app import errors, service
from app.http import proxy
from app.settings import Settings
from app.store.postgres import PostgresStore
from app.upstream import Upstream

log = logging.getLogger(__name__)


def create_app(settings: Settings, database_url: str) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        store = await PostgresStore.connect(database_url)
        upstream = Upstream()
        gateway = service.Gateway(store, upstream)
        app.state.gateway = gateway
        app.state.routes = service.RouteTable(settings.routes)
        purger = asyncio.create_task(_purge_forever(store, settings.purge_interval))
        try:
            yield
        finally:
            # Uvicorn has stopped accepting and answered what it could; forwards whose client
            # hung up may still be running. Finish and store them before letting go of anything.
            await gateway.drain()
            purger.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await purger
            await upstream.aclose()
            await store.close()

    # The proxy port forwards every path, /docs included: no documentation routes of its own.
    app = FastAPI(
        title="oncegate", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    app.include_router(proxy.router)
    return app


async def _purge_forever(store: PostgresStore, interval: float) -> None:
    """Delete expired keys now and then. Correctness never waits for this: every read checks
    `expires_at` itself; the purger only keeps the table small."""
    while True:
        await asyncio.sleep(interval)
        try:
            await service.purge_expired(store)
        except errors.StoreUnavailable:
            log.warning("purge skipped: the store is unavailable; trying again in %gs", interval)
