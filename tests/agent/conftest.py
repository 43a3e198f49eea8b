"""The agent library against real parts: PostgreSQL from the session, the demo upstream and a
gateway as real processes (the helpers of tests/e2e)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from oncegate.store.checkpoints import PostgresCheckpoints
from tests.e2e.conftest import DemoUpstream, GatewayProcess
from tests.e2e.conftest import module_dir as module_dir
from tests.e2e.conftest import upstream as upstream
from tests.helpers import free_port


@pytest.fixture(scope="module")
def late_port() -> int:
    """A port nothing listens on, until a test starts an upstream there (route `/late`)."""
    return free_port()


@pytest.fixture(scope="module")
def gateway(
    module_dir: Path, database_url: str, upstream: DemoUpstream, late_port: int
) -> Iterator[GatewayProcess]:
    routes = [
        {"name": "actions", "match": "/", "upstream": upstream.url, "timeout": "1s",
         "lease": "2s"},
        {"name": "late", "match": "/late", "strip_prefix": True,
         "upstream": f"http://127.0.0.1:{late_port}"},
        {"name": "released", "match": "/released", "strip_prefix": True,
         "upstream": upstream.url, "release_statuses": [429, 500, 503]},
    ]  # fmt: skip
    process = GatewayProcess(module_dir, database_url, routes)
    try:
        yield process
    finally:
        process.stop()


@pytest.fixture
async def checkpoints(database_url: str) -> AsyncIterator[PostgresCheckpoints]:
    """The checkpoint store on this module's database, one connection per test."""
    store = await PostgresCheckpoints.connect(database_url)
    try:
        yield store
    finally:
        await store.close()
