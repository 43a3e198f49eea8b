"""The quick benchmark behind `make bench`: what the gateway costs on one machine, in one run.

It starts `oncegate demo-upstream` and `oncegate serve` (embedded PostgreSQL in a fresh temporary
directory, unless ONCEGATE_DATABASE_URL is set) on free loopback ports, then drives, one after
the other and at the same number of keep-alive connections:

1. the demo upstream directly (`POST /emails`, a new Idempotency-Key per request);
2. the gateway's forward path (a new key per request: claim, forward, store);
3. the gateway's replay path (a pool of keys stored first, then every request repeats one of
   them with the same body, so it is answered from PostgreSQL with `Idempotent-Replayed: true`).

It prints the command, the machine and one Markdown table, then counts the actions the demo
upstream really performed: they must equal the requests the gateway forwarded, and the replay
phase must add none.

Design rules:
- The load generator is a small asyncio HTTP/1.1 client written here: httpx or aiohttp cost more
  per request than the proxy under test, and the table would measure the client.
- Client, gateway, upstream and PostgreSQL share the machine's CPUs; the figures compare the
  three configurations with each other, they are not the gateway's capacity on its own box.
- Every wait is bounded, and both servers are stopped by PID in a `finally` (SIGTERM, then
  SIGKILL after 10 s), so a failed run leaves nothing listening.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HOST = "127.0.0.1"
ROOT = Path(__file__).resolve().parent.parent  # the repository: where the servers run
BODY = json.dumps(
    {"to": "bench@example.com", "subject": "benchmark", "text": "hello"}, separators=(",", ":")
).encode()
# One answer slower than this is a hung connection, not a latency sample: it is counted as an
# error and the connection is opened again.
REQUEST_TIMEOUT = 10.0
# The embedded PostgreSQL runs initdb and the migrations before the gateway listens.
STARTUP_TIMEOUT = 45.0
STOP_TIMEOUT = 10.0
# A phase that has not finished this long after its planned end is stuck.
PHASE_GRACE = 15.0


@dataclass
class PhaseResult:
    name: str
    latencies: list[float] = field(default_factory=list)  # seconds, measured requests only
    sent: int = 0  # every request written, warm-up included
    errors: Counter[str] = field(default_factory=Counter)  # measured requests only
    first_start: float = math.inf
    last_end: float = 0.0

    @property
    def elapsed(self) -> float:
        return max(self.last_end - self.first_start, 1e-9)

    @property
    def requests(self) -> int:
        return len(self.latencies) + sum(self.errors.values())

    @property
    def per_second(self) -> float:
        return self.requests / self.elapsed if self.requests else 0.0

    def percentile(self, fraction: float) -> float:
        """Nearest-rank percentile in milliseconds."""
        if not self.latencies:
            return math.nan
        ordered = sorted(self.latencies)
        rank = max(1, math.ceil(fraction * len(ordered)))
        return ordered[rank - 1] * 1000


# --- the load generator --------------------------------------------------------------------


def build_request(port: int, key: str, body: bytes = BODY) -> bytes:
    head = (
        f"POST /emails HTTP/1.1\r\n"
        f"Host: {HOST}:{port}\r\n"
        f"Content-Type: application/json\r\n"
        f"Idempotency-Key: {key}\r\n"
        f"Content-Length: {len(body)}\r\n"
        f"\r\n"
    )
    return head.encode("ascii") + body


async def read_response(reader: asyncio.StreamReader) -> tuple[int, bytes, bytes]:
    """Read one HTTP/1.1 answer: the status, the raw lower-cased header block, the body."""
    head = await reader.readuntil(b"\r\n\r\n")
    status_line, _, header_block = head.partition(b"\r\n")
    status = int(status_line.split(b" ", 2)[1])
    headers = header_block.lower()
    length = None
    chunked = False
    for line in headers.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name == b"content-length":
            length = int(value)
        elif name == b"transfer-encoding" and b"chunked" in value:
            chunked = True
    if chunked:
        parts = []
        while True:
            size = int((await reader.readline()).split(b";", 1)[0], 16)
            if size == 0:
                while (await reader.readline()) not in (b"\r\n", b""):
                    pass  # trailers
                break
            parts.append((await reader.readexactly(size + 2))[:-2])
        return status, headers, b"".join(parts)
    if length is None:
        raise ValueError("answer without Content-Length or chunked encoding")
    return status, headers, await reader.readexactly(length)


Check = Callable[[int, bytes], str | None]


def check_2xx(status: int, headers: bytes) -> str | None:
    return None if 200 <= status < 300 else f"HTTP {status}"


def check_replayed(status: int, headers: bytes) -> str | None:
    if not 200 <= status < 300:
        return f"HTTP {status}"
    if b"\r\nidempotent-replayed: true" not in b"\r\n" + headers:
        return f"HTTP {status} not replayed"
    return None


async def drive(
    result: PhaseResult,
    port: int,
    next_request: Callable[[int, int], bytes | None],
    connections: int,
    measure_from: float,
    until: float,
    check: Check,
) -> None:
    """Keep `connections` keep-alive connections busy until `until` (or until no requests are
    left); record the requests that start at or after `measure_from`."""

    async def worker(number: int) -> None:
        reader: asyncio.StreamReader | None = None
        writer: asyncio.StreamWriter | None = None
        sequence = 0
        try:
            while time.perf_counter() < until:
                payload = next_request(number, sequence)
                if payload is None:
                    return
                sequence += 1
                if writer is None:
                    reader, writer = await asyncio.wait_for(
                        asyncio.open_connection(HOST, port), REQUEST_TIMEOUT
                    )
                assert reader is not None
                started = time.perf_counter()
                measured = started >= measure_from
                result.sent += 1
                problem: str | None
                try:
                    writer.write(payload)
                    await writer.drain()
                    status, headers, _ = await asyncio.wait_for(
                        read_response(reader), REQUEST_TIMEOUT
                    )
                    problem = check(status, headers)
                    # HTTP/1.1 keep-alive unless the server says otherwise.
                    closing = b"\r\nconnection: close" in b"\r\n" + headers
                except (OSError, asyncio.IncompleteReadError, TimeoutError, ValueError) as exc:
                    problem = type(exc).__name__
                    closing = True
                ended = time.perf_counter()
                if measured:
                    result.first_start = min(result.first_start, started)
                    result.last_end = max(result.last_end, ended)
                    if problem is None:
                        result.latencies.append(ended - started)
                    else:
                        result.errors[problem] += 1
                if closing:
                    writer.close()
                    reader = writer = None
        finally:
            if writer is not None:
                writer.close()

    await asyncio.wait_for(
        asyncio.gather(*(worker(number) for number in range(connections))),
        max(until - time.perf_counter(), 0) + PHASE_GRACE,
    )


async def run_phase(
    name: str,
    port: int,
    next_request: Callable[[int, int], bytes | None],
    arguments: argparse.Namespace,
    check: Check = check_2xx,
) -> PhaseResult:
    result = PhaseResult(name)
    start = time.perf_counter()
    await drive(
        result,
        port,
        next_request,
        arguments.connections,
        measure_from=start + arguments.warmup,
        until=start + arguments.warmup + arguments.duration,
        check=check,
    )
    return result


# --- the servers ---------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((HOST, 0))
        return int(probe.getsockname()[1])


def wait_listening(process: subprocess.Popen[bytes], port: int, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{shlex.join(map(str, process.args))} exited:\n{tail(log)}")
        with contextlib.suppress(OSError), socket.create_connection((HOST, port), timeout=0.5):
            return
        time.sleep(0.1)
    raise RuntimeError(f"port {port} not listening after {timeout:.0f}s:\n{tail(log)}")


def tail(log: Path, lines: int = 30) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def start(
    command: list[str],
    log: Path,
    environment: dict[str, str],
    started: list[subprocess.Popen[bytes]],
    cwd: Path = ROOT,
) -> subprocess.Popen[bytes]:
    """Start a server with its output in `log`, added to `started` (which the caller stops, by
    `stop`, whatever happens)."""
    with log.open("wb") as output:
        process = subprocess.Popen(
            command,
            stdout=output,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=environment,
            cwd=cwd,
        )
    started.append(process)
    return process


def stop(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM, wait, SIGKILL after STOP_TIMEOUT."""
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(STOP_TIMEOUT)
    except subprocess.TimeoutExpired:
        print(
            f"pid {process.pid} ignored SIGTERM for {STOP_TIMEOUT:.0f}s: SIGKILL", file=sys.stderr
        )
        process.kill()
        process.wait(STOP_TIMEOUT)


def stop_orphaned_postgres(pgdata: Path) -> None:
    """The gateway stops its embedded PostgreSQL on SIGTERM; one that was killed, or did not,
    leaves it running: stop it by the PID in its postmaster.pid."""
    pid_file = pgdata / "postmaster.pid"
    deadline = time.monotonic() + STOP_TIMEOUT / 2
    while pid_file.exists() and time.monotonic() < deadline:
        time.sleep(0.1)  # a clean stop may still be removing it
    with contextlib.suppress(OSError, ValueError, IndexError):
        pid = int(pid_file.read_text().splitlines()[0])
        print(f"embedded PostgreSQL (pid {pid}) still running: SIGTERM", file=sys.stderr)
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT
        while pid_file.exists() and time.monotonic() < deadline:
            time.sleep(0.1)


def work_directory(prefix: str) -> Path:
    """A fresh temporary directory for a benchmark's servers and logs, open to other users: as
    root the embedded PostgreSQL runs as pgserver's user, and must get into it."""
    work = Path(tempfile.mkdtemp(prefix=prefix))
    work.chmod(0o755)
    return work


@contextlib.contextmanager
def embedded_postgres(prefix: str, keep: bool = False) -> Iterator[Any]:
    """An embedded PostgreSQL (`oncegate.store.embedded`) with oncegate's migrations, in a fresh
    temporary directory named with `prefix`: stopped on the way out, whatever happened, and the
    directory removed unless `keep`. A SIGALRM budget of the caller's is cancelled before the
    clean-up, so running out of it cannot cut the server's stop short."""
    from oncegate.store import (  # the scripts that start one put the root on the path
        embedded,
    )

    work = work_directory(prefix)
    server = None
    try:
        server = embedded.start_migrated(work / "data")
        yield server
    finally:
        signal.alarm(0)
        if server is not None:
            server.stop()
            stop_orphaned_postgres(server.pgdata)
        if keep:
            print(f"temporary directory kept: {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)


# A real server to measure against, and how answers are committed there (bench/answer_commit.py).
KEPT_SETTINGS = ("ONCEGATE_DATABASE_URL", "ONCEGATE_STORE_ANSWER_COMMIT")


def server_environment(data_dir: Path) -> dict[str, str]:
    """The caller's environment minus ONCEGATE_* settings that would change the setup measured;
    KEPT_SETTINGS stay."""
    environment = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith("ONCEGATE_") or name in KEPT_SETTINGS
    }
    environment["ONCEGATE_DATA_DIR"] = str(data_dir)
    return environment


def checkout_database(
    url: str, name: str, checkout: Path, work: Path, timeout: float = STARTUP_TIMEOUT
) -> str:
    """A database `name` of its own on the server of `url`, migrated by the checkout at
    `checkout` (with its own .venv), and its URL: another checkout's gateway (a `--baseline`)
    runs on the schema its own migrations make, whatever this checkout's are. A gateway refuses
    a database at a schema revision it does not know."""
    import asyncpg

    async def create() -> None:
        connection = await asyncpg.connect(url, timeout=10)
        try:
            await connection.execute(f'DROP DATABASE IF EXISTS "{name}"')  # an earlier run's
            await connection.execute(f'CREATE DATABASE "{name}"')
        finally:
            await connection.close()

    asyncio.run(create())
    own = urllib.parse.urlunsplit(urllib.parse.urlsplit(url)._replace(path=f"/{name}"))
    environment = server_environment(work / "unused-data")
    environment["ONCEGATE_DATABASE_URL"] = own
    result = subprocess.run(
        [str(checkout / ".venv" / "bin" / "python"), "-m", "oncegate.cli", "migrate"],
        cwd=checkout,
        env=environment,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if result.returncode != 0:
        raise RuntimeError(f"migrate in {checkout} failed:\n{result.stdout}{result.stderr}")
    return own


def oncegate(*arguments: str) -> list[str]:
    return [sys.executable, "-m", "oncegate.cli", *arguments]


def count_actions(port: int) -> int:
    with urllib.request.urlopen(f"http://{HOST}:{port}/actions", timeout=REQUEST_TIMEOUT) as answer:
        return len(json.load(answer)["actions"])


def clear_actions(port: int) -> None:
    request = urllib.request.Request(f"http://{HOST}:{port}/actions", method="DELETE")
    with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT):
        pass


@contextlib.contextmanager
def servers(work: Path) -> Iterator[tuple[int, int]]:
    """The demo upstream and the gateway in front of it; yields (upstream port, gateway port)."""
    upstream_port, gateway_port, admin_port = free_port(), free_port(), free_port()
    environment = server_environment(work / "data")
    started: list[subprocess.Popen[bytes]] = []
    try:
        start(
            oncegate("demo-upstream", "--host", HOST, "--port", str(upstream_port)),
            work / "upstream.log",
            environment,
            started,
        )
        start(
            oncegate("serve", "--upstream", f"http://{HOST}:{upstream_port}", "--host", HOST,
                     "--port", str(gateway_port), "--admin-port", str(admin_port)),
            work / "gateway.log",
            environment,
            started,
        )  # fmt: skip
        wait_listening(started[0], upstream_port, work / "upstream.log", STARTUP_TIMEOUT)
        wait_listening(started[1], gateway_port, work / "gateway.log", STARTUP_TIMEOUT)
        yield upstream_port, gateway_port
    finally:
        for process in reversed(started):
            stop(process)
        stop_orphaned_postgres(work / "data" / "pgdata")


# --- the run -------------------------------------------------------------------------------


def fresh_keys(port: int, prefix: str) -> Callable[[int, int], bytes | None]:
    return lambda worker, sequence: build_request(port, f"{prefix}-{worker}-{sequence}")


def pooled_keys(pool: list[bytes], connections: int) -> Callable[[int, int], bytes | None]:
    # Round robin over the pool: worker w sends pool[w], pool[w + N], ... so concurrent
    # requests hit different keys and each key comes back once per pool length.
    return lambda worker, sequence: pool[(worker + sequence * connections) % len(pool)]


def pool_once(pool: list[bytes], connections: int) -> Callable[[int, int], bytes | None]:
    """Each pooled request exactly once, shared out between the workers."""

    def next_request(worker: int, sequence: int) -> bytes | None:
        index = worker + sequence * connections
        return pool[index] if index < len(pool) else None

    return next_request


async def measure(
    arguments: argparse.Namespace, upstream_port: int, gateway_port: int
) -> tuple[list[PhaseResult], list[str]]:
    run = uuid.uuid4().hex[:12]  # keys unique across runs, for a persistent database
    notes: list[str] = []
    connections = arguments.connections

    direct = await run_phase(
        "direct upstream",
        upstream_port,
        fresh_keys(upstream_port, f"bench-{run}-direct"),
        arguments,
    )
    direct_actions = count_actions(upstream_port)
    if direct_actions != direct.sent:
        notes.append(
            f"WARNING: the demo upstream recorded {direct_actions} actions for "
            f"{direct.sent} direct requests"
        )
    clear_actions(upstream_port)

    forward = await run_phase(
        "gateway, forward (new key)",
        gateway_port,
        fresh_keys(gateway_port, f"bench-{run}-forward"),
        arguments,
    )
    after_forward = count_actions(upstream_port)

    pool = [
        build_request(gateway_port, f"bench-{run}-replay-{index}")
        for index in range(arguments.pool)
    ]
    stored = PhaseResult("pool pre-store")
    start = time.perf_counter()
    await drive(
        stored,
        gateway_port,
        pool_once(pool, connections),
        connections,
        measure_from=start,
        until=start + 60,
        check=check_2xx,
    )
    if stored.errors:
        notes.append(f"WARNING: pre-storing the pool of {len(pool)} keys: {dict(stored.errors)}")
    after_store = count_actions(upstream_port)

    replay = await run_phase(
        "gateway, replay (stored key)",
        gateway_port,
        pooled_keys(pool, connections),
        arguments,
        check=check_replayed,
    )
    after_replay = count_actions(upstream_port)

    forwarded = forward.sent + stored.sent
    notes.append(
        f"upstream actions: {after_replay} recorded through the gateway; "
        f"{forwarded} forward-path requests sent ({forward.sent} forward phase incl. warm-up "
        f"+ {stored.sent} pool pre-store); the replay phase sent {replay.sent} and added "
        f"{after_replay - after_store}"
    )
    if after_forward != forward.sent:
        notes.append(
            f"WARNING: forward phase: {after_forward} actions recorded for "
            f"{forward.sent} requests sent"
        )
    if after_replay != forwarded:
        notes.append(
            f"WARNING: {after_replay} actions recorded != {forwarded} forward-path requests sent"
        )
    if after_replay != after_store:
        notes.append(
            f"WARNING: the replay phase reached the upstream {after_replay - after_store} times"
        )
    return [direct, forward, replay], notes


def table(results: list[PhaseResult]) -> str:
    direct = results[0].per_second
    rows = [
        "| configuration | requests | errors | req/s | p50 ms | p99 ms | ratio to direct |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for result in results:
        ratio = result.per_second / direct if direct else math.nan
        rows.append(
            f"| {result.name} | {result.requests} | {sum(result.errors.values())} "
            f"| {result.per_second:,.0f} | {result.percentile(0.50):.2f} "
            f"| {result.percentile(0.99):.2f} | {ratio:.2f} |"
        )
    return "\n".join(rows)


def command_line() -> str:
    python = sys.executable
    with contextlib.suppress(ValueError):
        relative = os.path.relpath(python)
        if not relative.startswith(".."):
            python = relative
    return shlex.join([python, *sys.argv])


def positive(kind: type[int] | type[float]) -> Callable[[str], float]:
    def parse(text: str) -> float:
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    return parse


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=positive(float), default=5.0, metavar="SECONDS")
    parser.add_argument("--connections", type=positive(int), default=32, metavar="N")
    parser.add_argument("--warmup", type=float, default=1.0, metavar="SECONDS")
    parser.add_argument("--pool", type=positive(int), default=1000, help="replayed keys")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory")
    arguments = parser.parse_args()
    arguments.warmup = max(arguments.warmup, 0.0)

    # Everything is bounded: startup, three phases, the pool, teardown.
    budget = STARTUP_TIMEOUT + 3 * (arguments.warmup + arguments.duration + PHASE_GRACE) + 90

    def out_of_time(signum: int, frame: object) -> None:
        raise TimeoutError(f"the benchmark ran out of its {budget:.0f}s budget")

    signal.signal(signal.SIGALRM, out_of_time)
    signal.alarm(math.ceil(budget))

    work = work_directory("oncegate-bench-")
    # The server logs are kept when anything went wrong: they are what explains it.
    keep = True
    try:
        with servers(work) as (upstream_port, gateway_port):
            results, notes = asyncio.run(measure(arguments, upstream_port, gateway_port))
        signal.alarm(0)
        failed = report(arguments, results, notes)
        keep = arguments.keep or failed
        if failed:
            print(f"server logs: {work}")
        return 1 if failed else 0
    except (RuntimeError, TimeoutError) as exc:
        # A server that would not start, or a run over its budget: the logs say why.
        print(f"benchmark failed: {exc}", file=sys.stderr)
        return 1
    finally:
        signal.alarm(0)
        if keep:
            print(f"temporary directory kept: {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)


def report(arguments: argparse.Namespace, results: list[PhaseResult], notes: list[str]) -> bool:
    """Print the run; True when it saw errors or a wrong action count."""
    store = "ONCEGATE_DATABASE_URL" if os.environ.get("ONCEGATE_DATABASE_URL") else "embedded"
    print(f"$ {command_line()}")
    print(
        f"machine: nproc {os.cpu_count()}, Python {platform.python_version()}, "
        f"{platform.system()} {platform.machine()}; client, servers and PostgreSQL share it"
    )
    print(
        f"{arguments.connections} keep-alive connections, {arguments.warmup:g} s warm-up + "
        f"{arguments.duration:g} s per configuration, POST /emails with a {len(BODY)}-byte JSON "
        f"body; replay pool {arguments.pool} keys; store: {store} PostgreSQL"
    )
    print()
    print(table(results))
    print()
    failed = False
    for result in results:
        if result.errors:
            failed = True
            print(f"errors, {result.name}: {dict(result.errors)}")
    for note in notes:
        failed = failed or note.startswith("WARNING")
        print(note)
    return failed


if __name__ == "__main__":
    sys.exit(main())
