"""Test fixtures: a real PostgreSQL for the session, a fresh database per test module.

The session starts an embedded PostgreSQL (pgserver) of its own, or uses the server named by
`ONCEGATE_TEST_DATABASE_URL`. It migrates a template database once; every module that asks for
`database_url` gets its own copy (`CREATE DATABASE ... TEMPLATE`), so modules never see each
other's keys.

A module marked `pytest.mark.citus` runs twice: on that PostgreSQL and on a real Citus cluster
(a coordinator and two workers, tests/citus.py) started once for the session, its database
migrated by `oncegate migrate`'s own code, so distributed. One fixture, `backend`, parametrised:
`database_url` and everything built on it follow it. Where Citus cannot run (not installed, no
user to run it as) the Citus half is skipped, saying why.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import re
import shutil
import tempfile
import warnings
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import hypothesis
import pytest

from oncegate.store import migrate
from oncegate.store.postgres import PostgresStore
from tests import citus

TEMPLATE = "oncegate_test_template"
_databases = itertools.count(1)

# Property tests assert what they name, never how fast an example runs: hypothesis's default
# deadline (200 ms an example) failed one under make test's parallel load (353 ms).
hypothesis.settings.register_profile("oncegate", deadline=None)
hypothesis.settings.load_profile("oncegate")


def with_database(url: str, name: str) -> str:
    """`url` pointing at database `name` instead."""
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path="/" + name))


async def _admin(url: str, *statements: str) -> None:
    connection = await asyncpg.connect(url)
    try:
        for statement in statements:
            await connection.execute(statement)
    finally:
        await connection.close()


def start_embedded(directory: Path) -> object:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from pgserver.postgres_server import get_server

    return get_server(directory, cleanup_mode="delete")


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    """A maintenance URL (database `postgres`) of the session's PostgreSQL server."""
    given = os.environ.get("ONCEGATE_TEST_DATABASE_URL")
    if given:
        yield given
        return
    # Not under pytest's temporary tree: pytest makes its directories private (0700) as it goes,
    # and the server runs as pgserver's own unprivileged user when the tests run as root.
    directory = Path(tempfile.mkdtemp(prefix="oncegate-test-pg-"))
    server = start_embedded(directory / "data")
    try:
        yield server.get_uri()  # type: ignore[attr-defined]
    finally:
        server.cleanup()  # type: ignore[attr-defined]
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="session")
def template_url(postgres_url: str) -> str:
    asyncio.run(
        _admin(
            postgres_url,
            f"DROP DATABASE IF EXISTS {TEMPLATE} WITH (FORCE)",
            f"CREATE DATABASE {TEMPLATE}",
        )
    )
    url = with_database(postgres_url, TEMPLATE)
    migrate.upgrade(url)
    return url


def database_name(label: str) -> str:
    suffix = re.sub(r"\W", "_", label)[-30:].lower()
    return f"oncegate_test_{os.getpid()}_{next(_databases)}_{suffix}"


def create_database(postgres_url: str, template: str, label: str) -> str:
    name = database_name(label)
    asyncio.run(
        _admin(
            postgres_url,
            f"DROP DATABASE IF EXISTS {name} WITH (FORCE)",
            f"CREATE DATABASE {name} TEMPLATE {template}",
        )
    )
    return with_database(postgres_url, name)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Modules marked `citus` run on both backends (module-scoped: one database each)."""
    marker = metafunc.definition.get_closest_marker("citus")
    if marker and "backend" in metafunc.fixturenames:
        # `citus(slow=True)`: the Citus run is marked slow (`make test` leaves it out, `make
        # test-all` runs it), the PostgreSQL one stays in `make test`. For modules about the
        # gateway rather than the store: the store's own suite runs on Citus in `make test`.
        slow = [pytest.mark.slow] if marker.kwargs.get("slow") else []
        backends = [pytest.param("postgresql"), pytest.param("citus", marks=slow)]
        metafunc.parametrize("backend", backends, indirect=True, scope="module")


def work_unit(nodeid: str) -> str:
    """Which share of the suite a test is in when it runs on several workers (`make test`'s
    `-n`, pytest-xdist): a module's tests run together on one worker, in order, so its
    module-scoped gateway and database are made once; every test on Citus (a module's `[citus]`
    half, or a module about Citus) runs on one worker, so one Citus cluster starts, not one per
    worker. Each worker is a session of its own: its own PostgreSQL, temporary directories and
    ports."""
    path, _, name = nodeid.partition("::")
    parameters = name.partition("[")[2].rstrip("]").split("-")
    return "citus" if "citus" in parameters or "citus" in Path(path).name else path


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Shares handed out in the order they are collected, not largest first: tests/agent's
    LangGraph modules, few tests of many seconds each, start first and tests/unit's many quick
    ones fill the end, so no worker is left alone with a long module at the end."""
    from xdist.scheduler import LoadScopeScheduling

    class ByWorkUnit(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    config.option.loadscopereorder = False
    return ByWorkUnit(config, log)


@pytest.fixture(scope="module")
def backend(request: pytest.FixtureRequest) -> str:
    """What `database_url` is on: `postgresql` (the session's server) or `citus`."""
    return getattr(request, "param", "postgresql")


@pytest.fixture(scope="session")
def citus_cluster() -> Iterator[citus.Cluster]:
    """A Citus coordinator and two workers for the session; skipped where Citus cannot run."""
    why = citus.unavailable()
    if why is not None:
        pytest.skip(f"no Citus cluster: {why}")
    citus.stop_orphans()
    cluster = citus.Cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def database_url(backend: str, request: pytest.FixtureRequest) -> Iterator[str]:
    """A migrated database of this module's own, on the module's backend."""
    name = database_name(request.module.__name__)
    if backend == "citus":
        cluster: citus.Cluster = request.getfixturevalue("citus_cluster")
        url = cluster.create_database(name)
        migrate.upgrade(url)
        yield url
        cluster.drop_database(name)
        return
    postgres_url: str = request.getfixturevalue("postgres_url")
    request.getfixturevalue("template_url")
    url = create_database(postgres_url, TEMPLATE, request.module.__name__)
    yield url
    name = urlsplit(url).path.lstrip("/")
    asyncio.run(_admin(postgres_url, f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))


@pytest.fixture
def empty_database_url(postgres_url: str, request: pytest.FixtureRequest) -> Iterator[str]:
    """A database with no schema at all (for migration tests)."""
    url = create_database(postgres_url, "template0", request.node.name)
    yield url
    name = urlsplit(url).path.lstrip("/")
    asyncio.run(_admin(postgres_url, f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))


@pytest.fixture
async def store(database_url: str) -> AsyncIterator[PostgresStore]:
    store = await PostgresStore.connect(database_url)
    try:
        yield store
    finally:
        await store.close()


@pytest.fixture
async def db(database_url: str) -> AsyncIterator[asyncpg.Connection]:
    """A plain connection to this module's database, to look at what the store holds."""
    connection = await asyncpg.connect(database_url)
    try:
        yield connection
    finally:
        await connection.close()
