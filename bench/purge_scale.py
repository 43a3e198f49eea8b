"""Purge at scale: a million expired keys, deleted while traffic goes on.

Fills `oncegate_keys` with `--rows` expired rows (one `INSERT ... SELECT generate_series`), then:

1. baseline: forward requests (a new key each) through a gateway for `--baseline` seconds, no
   purge running: p50/p99 latency;
2. `oncegate purge` (the CLI, its own process) deletes them while the same load runs: rows/s, and
   the latency meanwhile;
3. refills, restarts the gateway with `ONCEGATE_PURGE_INTERVAL=--interval`, and lets its own
   background purger (`service.purge_expired`, batches of 1000 with a 50 ms pause) delete them while
   the load runs: rows/s (from `oncegate_keys_purged_total` on /metrics), and the latency
   meanwhile.

Not part of `make test`. PostgreSQL: `ONCEGATE_DATABASE_URL` when set (a scratch database is
created on that server and dropped after), else an embedded one in a temporary directory.

    .venv/bin/python bench/purge_scale.py [--rows 1000000] [--connections 8] [--baseline 10]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import httpx

from oncegate.store import migrate

FILL = """
INSERT INTO oncegate_keys
    (route, scope, key, fingerprint, state, fencing_token, response_status, response_headers,
     response_body, response_stored, created_at, completed_at, expires_at)
SELECT 'bench', sha256(int8send(n)), 'purge-' || n, sha256(int8send(-n)), 'completed', n, 201,
       '[["content-type", "application/json"]]'::jsonb, '{"id": "em_000001"}'::bytea, true,
       now() - interval '2 days', now() - interval '2 days', now() - interval '1 day'
FROM generate_series($1::bigint, $2::bigint) AS n
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def wait_listening(process: subprocess.Popen[bytes], port: int, log: Path) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"exited early, see {log}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.05)
    raise SystemExit(f"not listening on {port}, see {log}")


def start(args: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    with log.open("ab") as output:
        return subprocess.Popen(
            [sys.executable, "-m", "oncegate.cli", *args],
            stdout=output,
            stderr=subprocess.STDOUT,
            env={**os.environ, **env},
        )


def stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5)


@contextlib.contextmanager
def database() -> Iterator[str]:
    """A migrated scratch database, dropped afterwards."""
    given = os.environ.get("ONCEGATE_DATABASE_URL")
    directory = None
    server = None
    if given:
        admin_url = given
    else:
        directory = Path(tempfile.mkdtemp(prefix="oncegate-purge-scale-"))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from pgserver.postgres_server import get_server
        server = get_server(directory / "data", cleanup_mode="delete")
        admin_url = server.get_uri()
    name = f"oncegate_purge_scale_{os.getpid()}"
    asyncio.run(execute(admin_url, f"CREATE DATABASE {name}"))
    url = urlunsplit(urlsplit(admin_url)._replace(path="/" + name))
    try:
        migrate.upgrade(url)
        yield url
    finally:
        asyncio.run(execute(admin_url, f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
        if server is not None:
            server.cleanup()
        if directory is not None:
            shutil.rmtree(directory, ignore_errors=True)


async def execute(url: str, *statements: str) -> None:
    connection = await asyncpg.connect(url)
    try:
        for statement in statements:
            await connection.execute(statement)
    finally:
        await connection.close()


async def fill(url: str, rows: int) -> float:
    started = time.perf_counter()
    connection = await asyncpg.connect(url)
    try:
        step = 100_000
        for first in range(1, rows + 1, step):
            await connection.execute(FILL, first, min(first + step - 1, rows))
        await connection.execute("VACUUM ANALYZE oncegate_keys")
    finally:
        await connection.close()
    return time.perf_counter() - started


async def expired_rows(url: str) -> int:
    connection = await asyncpg.connect(url)
    try:
        count: int = await connection.fetchval(
            "SELECT count(*) FROM oncegate_keys WHERE expires_at <= now()"
        )
        return count
    finally:
        await connection.close()


class Load:
    """`connections` clients sending POST /emails with a new key each, back to back."""

    def __init__(self, url: str, connections: int) -> None:
        self.url, self.connections = url, connections
        self.samples: list[tuple[float, float]] = []  # (finished at, seconds)
        self.errors = 0
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    async def __aenter__(self) -> Load:
        limits = httpx.Limits(max_connections=self.connections)
        self._client = httpx.AsyncClient(base_url=self.url, limits=limits, timeout=30)
        self._tasks = [asyncio.create_task(self._worker()) for _ in range(self.connections)]
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)
        await self._client.aclose()

    async def _worker(self) -> None:
        while not self._stop.is_set():
            started = time.perf_counter()
            response = await self._client.post(
                "/emails", json={"to": "bench"}, headers={"Idempotency-Key": str(uuid.uuid4())}
            )
            finished = time.perf_counter()
            if response.status_code != 201:
                self.errors += 1
            self.samples.append((finished, finished - started))

    def between(self, start: float, end: float) -> list[float]:
        return [seconds for at, seconds in self.samples if start <= at <= end]


def percentiles(samples: list[float]) -> tuple[float, float]:
    cuts = statistics.quantiles(samples, n=100, method="inclusive")
    return cuts[49] * 1000, cuts[98] * 1000


async def purged_total(admin_url: str) -> float:
    async with httpx.AsyncClient() as client:
        text = (await client.get(admin_url + "/metrics")).text
    for line in text.splitlines():
        if line.startswith("oncegate_keys_purged_total "):
            return float(line.split()[1])
    return 0.0


async def run(options: argparse.Namespace, url: str, directory: Path) -> list[list[str]]:
    env = {"ONCEGATE_DATABASE_URL": url, "ONCEGATE_LOG_LEVEL": "warning"}
    demo_port = free_port()
    demo = start(["demo-upstream", "--port", str(demo_port)], directory / "demo.log", {})
    wait_listening(demo, demo_port, directory / "demo.log")
    table: list[list[str]] = []

    def gateway(interval: str) -> tuple[subprocess.Popen[bytes], str, str]:
        port, admin_port = free_port(), free_port()
        log = directory / f"gateway-{port}.log"
        process = start(
            [
                "serve",
                "--upstream",
                f"http://127.0.0.1:{demo_port}",
                "--port",
                str(port),
                "--admin-port",
                str(admin_port),
            ],
            log,
            {**env, "ONCEGATE_PURGE_INTERVAL": interval},
        )
        wait_listening(process, port, log)
        wait_listening(process, admin_port, log)
        return process, f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin_port}"

    def row(phase: str, load: Load, start: float, end: float, rows: str, rate: str) -> None:
        samples = load.between(start, end)
        p50, p99 = percentiles(samples)
        table.append(
            [
                phase,
                rows,
                f"{end - start:.1f}",
                rate,
                str(len(samples)),
                f"{len(samples) / (end - start):.0f}",
                f"{p50:.1f}",
                f"{p99:.1f}",
            ]
        )

    try:
        seconds = await fill(url, options.rows)
        print(f"filled {options.rows} expired rows in {seconds:.1f}s", flush=True)
        process, proxy_url, _ = gateway("3600s")
        try:
            async with Load(proxy_url, options.connections) as load:
                await asyncio.sleep(1)  # warm up
                start_at = time.perf_counter()
                await asyncio.sleep(options.baseline)
                row("no purge (baseline)", load, start_at, time.perf_counter(), "-", "-")

                start_at = time.perf_counter()
                purge = await asyncio.create_subprocess_exec(
                    sys.executable,
                    "-m",
                    "oncegate.cli",
                    "purge",
                    env={**os.environ, **env},
                    stdout=asyncio.subprocess.PIPE,
                )
                output, _ = await purge.communicate()
                end_at = time.perf_counter()
                print(output.decode().strip(), flush=True)
                deleted = int(output.split()[1])
                row(
                    "`oncegate purge`",
                    load,
                    start_at,
                    end_at,
                    str(deleted),
                    f"{deleted / (end_at - start_at):,.0f}",
                )
            errors = load.errors
        finally:
            stop(process)
        assert await expired_rows(url) == 0

        seconds = await fill(url, options.rows)
        print(f"refilled {options.rows} expired rows in {seconds:.1f}s", flush=True)
        process, proxy_url, admin_url = gateway(f"{options.interval}s")
        try:
            async with Load(proxy_url, options.connections) as load:
                while await purged_total(admin_url) == 0:  # noqa: ASYNC110 - polling /metrics
                    await asyncio.sleep(0.05)
                start_at = time.perf_counter()
                while await purged_total(admin_url) < options.rows:  # noqa: ASYNC110
                    await asyncio.sleep(0.2)
                end_at = time.perf_counter()
                row(
                    "background purger (in the gateway)",
                    load,
                    start_at,
                    end_at,
                    str(options.rows),
                    f"{options.rows / (end_at - start_at):,.0f}",
                )
                start_at = time.perf_counter()
                await asyncio.sleep(options.baseline)
                row("after the purge", load, start_at, time.perf_counter(), "-", "-")
            errors += load.errors
        finally:
            stop(process)
        print(f"requests that were not 201: {errors}")
    finally:
        stop(demo)
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--connections", type=int, default=8)
    parser.add_argument("--baseline", type=float, default=10.0, help="seconds of load alone")
    parser.add_argument("--interval", type=float, default=3.0, help="the gateway's purge interval")
    options = parser.parse_args()
    directory = Path(tempfile.mkdtemp(prefix="oncegate-purge-scale-logs-"))
    with database() as url:
        table = asyncio.run(run(options, url, directory))
    print(
        f"\n`{' '.join(['.venv/bin/python', *sys.argv])}` on {platform.node()}: "
        f"{os.cpu_count()} CPUs, Python {platform.python_version()}; logs in {directory}\n"
    )
    header = ["phase", "rows deleted", "seconds", "rows/s", "requests", "req/s", "p50 ms", "p99 ms"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for line in table:
        print("| " + " | ".join(line) + " |")


if __name__ == "__main__":
    main()
