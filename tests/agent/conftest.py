"""The agent library against real parts: PostgreSQL from the session, the demo upstream and a
gateway as real processes (the helpers of tests/e2e)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

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
    with GatewayProcess(module_dir, database_url, routes) as process:
        yield process


@pytest.fixture
async def checkpoints(database_url: str) -> AsyncIterator[PostgresCheckpoints]:
    """The checkpoint store on this module's database, one connection per test."""
    store = await PostgresCheckpoints.connect(database_url)
    try:
        yield store
    finally:
        await store.close()


ROOT = Path(__file__).parents[2]


class GraphProcess:
    """A LangGraph graph run by `python -m <module>` (tests/agent/langgraph_graph.py by default,
    or langgraph_tools.py), its JSON lines read one by one."""

    def __init__(
        self,
        database_url: str,
        gateway: GatewayProcess,
        thread: str,
        *args: str,
        module: str = "tests.agent.langgraph_graph",
    ):
        self.popen = subprocess.Popen(
            [sys.executable, "-m", module, "--database-url", database_url, "--gateway",
             gateway.url, "--thread", thread, *args],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip

    def events(self) -> Iterator[dict[str, Any]]:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            yield json.loads(line)

    def until(self, event: str) -> list[dict[str, Any]]:
        """Every event up to and with `event`; then the process is frozen, waiting for a kill."""
        seen = []
        for item in self.events():
            seen.append(item)
            if item["event"] == event:
                return seen
        raise AssertionError(f"ended before {event!r}: {seen}, {self.stderr()}")

    def kill(self) -> None:
        os.kill(self.popen.pid, signal.SIGKILL)
        assert self.popen.wait(10) == -signal.SIGKILL

    def finish(self, receipts: int | None = None) -> list[dict[str, Any]]:
        """Every event to the end, which must be `finished` (with `receipts`, when given)."""
        seen = list(self.events())
        assert self.popen.wait(60) == 0, self.stderr()
        assert seen[-1]["event"] == "finished", seen
        if receipts is not None:
            assert seen[-1]["receipts"] == receipts, seen
        return seen

    def stderr(self) -> str:
        assert self.popen.stderr is not None
        return self.popen.stderr.read()

    def close(self) -> None:
        if self.popen.poll() is None:
            self.kill()
        for stream in (self.popen.stdout, self.popen.stderr):
            if stream is not None:
                stream.close()


@pytest.fixture
def processes() -> Iterator[list[GraphProcess]]:
    started: list[GraphProcess] = []
    try:
        yield started
    finally:
        for process in started:
            process.close()
