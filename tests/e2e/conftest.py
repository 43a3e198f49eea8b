"""Real processes on real sockets: the demo upstream and gateways, started as `oncegate` would be.

Every process is started by a fixture, logs to a file under the test's temporary directory, and
is ended by its PID when the fixture finishes (SIGTERM, then SIGKILL if it lingers). `Process`,
`DemoUpstream` and `GatewayProcess` are context managers, so a fixture reads
`with GatewayProcess(...) as gateway: yield gateway`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest
import yaml

from tests.helpers import free_port

# How long a started process may take to listen before the test fails: a deadline only (a start
# that listens sooner is waited for no longer). A gateway on its embedded default runs initdb and
# every migration first: 30 s was not enough at load 20 with the suite on three workers.
STARTUP_TIMEOUT = 60.0
PROBLEM = "application/problem+json"


class Process:
    """A started `oncegate` command (or another `program` of this Python's)."""

    def __init__(
        self,
        args: list[str],
        log: Path,
        env: dict[str, str] | None = None,
        program: Sequence[str] = ("-m", "oncegate.cli"),
    ) -> None:
        self.args = args
        self.log = log
        self._log_file = log.open("ab")
        self.popen = subprocess.Popen(
            [sys.executable, *program, *args],
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_listening(self, port: int, timeout: float = STARTUP_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                self._give_up()
                raise RuntimeError(f"{self.args} exited early:\n{self.output()}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
                return
            time.sleep(0.05)
        self._give_up()
        raise RuntimeError(f"{self.args} did not listen on {port}:\n{self.output()}")

    def _give_up(self) -> None:
        """Stop a start that failed, so it leaves nothing to later tests; the caller's error,
        with the log, is what the test reports."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.stop()

    def signal(self, number: int) -> None:
        if self.popen.poll() is None:
            os.kill(self.pid, number)

    def wait(self, timeout: float = 30.0) -> int:
        return self.popen.wait(timeout)

    def stop(self) -> None:
        try:
            if self.popen.poll() is None:
                self.signal(signal.SIGTERM)
                try:
                    self.popen.wait(15)
                except subprocess.TimeoutExpired:
                    self.signal(signal.SIGKILL)
                    self.popen.wait(5)
        finally:
            self._log_file.close()  # whatever happened: an open log fails a later test

    def __enter__(self) -> Process:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


class DemoUpstream:
    """`oncegate demo-upstream`, or another upstream that lists what it performed the same way
    (`GET /actions`): tests/e2e/vendor.py's fake vendor, `program=("-m", "tests.e2e.vendor")`."""

    def __init__(
        self,
        directory: Path,
        program: Sequence[str] = ("-m", "oncegate.cli", "demo-upstream"),
        name: str = "demo-upstream",
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process = Process(
            ["--port", str(self.port)], directory / f"{name}.log", program=program
        )
        self.process.wait_listening(self.port)

    def actions(self, key: str | None = None) -> list[dict[str, Any]]:
        params = {"key": key} if key is not None else {}
        response = httpx.get(self.url + "/actions", params=params)
        response.raise_for_status()
        actions: list[dict[str, Any]] = response.json()["actions"]
        return actions

    def performed(self, marker: str) -> list[dict[str, Any]]:
        """The actions performed for the requests that carry `marker` (in their body)."""
        return [action for action in self.actions() if marker in str(action["request"])]

    def __enter__(self) -> DemoUpstream:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.process.stop()


class GatewayProcess:
    def __init__(
        self,
        directory: Path,
        database_url: str,
        routes: list[dict[str, Any]],
        name: str = "gateway",
        admin_token: str = "",
        args: Sequence[str] = (),
        env: dict[str, str] | None = None,
    ) -> None:
        self.port, self.admin_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.admin_url = f"http://127.0.0.1:{self.admin_port}"
        self.admin_token = admin_token
        config = directory / f"{name}.yaml"
        config.write_text(yaml.safe_dump({"routes": routes}))
        self.process = Process(
            ["serve", "--config", str(config), "--port", str(self.port),
             "--admin-port", str(self.admin_port), *args],
            directory / f"{name}.log",
            env={"ONCEGATE_DATABASE_URL": database_url, "ONCEGATE_ADMIN_TOKEN": admin_token,
                 **(env or {})},
        )  # fmt: skip
        self.process.wait_listening(self.port)
        self.process.wait_listening(self.admin_port)

    def stop(self) -> None:
        self.process.stop()

    def admin_client(self, timeout: float = 10) -> httpx.AsyncClient:
        """A client of the admin port, with this gateway's admin token."""
        headers = {"Authorization": f"Bearer {self.admin_token}"}
        return httpx.AsyncClient(base_url=self.admin_url, headers=headers, timeout=timeout)

    def __enter__(self) -> GatewayProcess:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


@pytest.fixture(scope="module")
def module_dir(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest, backend: str
) -> Path:
    """The module's directory, one per backend (a module marked `citus` runs twice: its
    processes' logs must not mix)."""
    return tmp_path_factory.mktemp(f"{request.module.__name__.rsplit('.', 1)[-1]}-{backend}")


@pytest.fixture(scope="module")
def upstream(module_dir: Path) -> Iterator[DemoUpstream]:
    with DemoUpstream(module_dir) as demo:
        yield demo


@pytest.fixture
async def client(gateway: GatewayProcess) -> AsyncIterator[httpx.AsyncClient]:
    """A client of the `gateway` fixture of the module that asks for it."""
    limits = httpx.Limits(max_connections=100)
    async with httpx.AsyncClient(base_url=gateway.url, limits=limits, timeout=30) as client:
        yield client


def prefix_route(name: str, upstream: str, **options: Any) -> dict[str, Any]:
    """A route of the config file: `/name/...` forwarded to `upstream` as `/...`."""
    return {"name": name, "match": f"/{name}", "upstream": upstream, "strip_prefix": True,
            **options}  # fmt: skip


def keyed(key: str, **headers: str) -> dict[str, str]:
    return {"Idempotency-Key": key, **headers}


def problem_name(response: httpx.Response) -> str:
    """The problem name of a gateway-made answer, after checking it is a well-formed one."""
    assert response.headers["content-type"] == PROBLEM, response.text
    document = response.json()
    assert document["status"] == response.status_code
    assert document["title"] and document["detail"]
    name: str = document["type"].removeprefix("urn:oncegate:problem:")
    return name


async def row(db: asyncpg.Connection, key: str) -> asyncpg.Record | None:
    """What the store holds for `key` (in any scope; tests use keys of their own): `state` is
    what the last writer stored, `effective_state` what the key is now, by the schema's one
    rule (`oncegate_key_state`, migration 0005)."""
    return await db.fetchrow(
        "SELECT id, state, fencing_token,"
        " oncegate_key_state(state, lease_expires_at, expires_at) AS effective_state,"
        " response_status, response_headers, response_body, response_stored"
        " FROM oncegate_keys WHERE key = $1",
        key,
    )


async def row_count(db: asyncpg.Connection) -> int:
    count: int = await db.fetchval("SELECT count(*) FROM oncegate_keys")
    return count


async def wait_for_state(
    db: asyncpg.Connection,
    key: str,
    state: str,
    timeout: float = 10.0,  # noqa: ASYNC109 - a polling deadline, not a cancellation scope
) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        found = await row(db, key)
        if found is not None and found["state"] == state:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"key {key} never reached state {state}")


def raw_request(port: int, request: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send bytes exactly as given; for requests no well-behaved client would produce."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    head, _, body = received.partition(b"\r\n\r\n")
    status_line, headers = parse_head(head)
    return int(status_line.split()[1]), headers, body


def parse_head(head: bytes) -> tuple[str, dict[str, str]]:
    """The first line of an HTTP message head and its headers (names in lower case)."""
    first_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return first_line, headers
