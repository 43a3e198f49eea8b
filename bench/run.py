"""`make bench`: oncegate side by side with a bare proxy and a library peer, on one machine.

It starts on 127.0.0.1, on free ports: `oncegate demo-upstream`; `oncegate serve` (which starts
the embedded PostgreSQL in a fresh ONCEGATE_DATA_DIR, or uses ONCEGATE_DATABASE_URL when set);
`bench/bare_proxy.py` (the gateway's server stack and upstream client, no idempotency); and
`bench/idemkit_proxy.py` (the same bare proxy behind idemkit 1.0.2's middleware on the same
PostgreSQL). Then it drives each configuration with wrk and `bench/load.lua` (POST /emails with a
small JSON body; a new Idempotency-Key per request, a retry of a stored key, or a mix), and
prints Markdown tables: req/s, p50, p99, server-side CPU per request, ratios to the bare proxy,
and the targets as PASS/FAIL lines (printed, never asserted). Under each table, a line
per oncegate row gives the rows per statement its store sent (`oncegate_store_batch_size`, when
the store exports it); `--json PATH` writes every row's figures as one JSON object as well.

    .venv/bin/python bench/run.py                       # the main table + 1-connection latency
    .venv/bin/python bench/run.py --sweep concurrency   # 1, 16, 64, 256 connections
    .venv/bin/python bench/run.py --sweep keys          # 10^4, 10^6, 10^7 stored keys
    .venv/bin/python bench/run.py --sweep mix           # 0-100% retries, PostgreSQL and in memory
    .venv/bin/python bench/run.py --all                 # all of the above in one run
    .venv/bin/python bench/run.py --json bench.json     # and the figures as JSON
    .venv/bin/python bench/run.py --rows bare-proxy,oncegate-replay   # those rows alone

Design rules:
- One load generator for every configuration: wrk, its threads capped at the connections.
- Each configuration is run `--repeats` times, interleaved (round 1 of every configuration, then
  round 2, ...), so a drift of the machine spreads over all of them; the tables show the median
  and the spread (min-max).
- CPU per request is the CPU time (utime + stime from /proc/<pid>/stat) of the server side, the
  proxy under test with its worker processes, the demo upstream, and the PostgreSQL postmaster
  with every child (backends, WAL writer, checkpointer) and the children it reaped, during the
  measured run, divided by the requests answered. wrk and this script are not counted.
- Every wait is bounded: server start-up, each wrk run, the key-table fill, and the whole run
  (SIGALRM). Every process started here is stopped by PID in a `finally` (SIGTERM, then SIGKILL),
  and the embedded PostgreSQL is stopped when the last process holding it lets go.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import collections
import contextlib
import importlib.metadata
import json
import math
import os
import platform
import re
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
import profiling
import quick

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(1, str(ROOT))

from oncegate.kernel import keys  # noqa: E402 - the repository root is on the path from here on
from oncegate.service.evidence import KeptRequest  # noqa: E402
from oncegate.store import claimant  # noqa: E402

HOST = quick.HOST
PATH = "/emails"
BODY = quick.BODY
LOAD_SCRIPT = BENCH / "load.lua"
IDEMKIT_VERSION = "1.0.2"
# The gateway's catch-all route, and the scope of a request without Authorization: the key
# sweep pre-fills rows in the scope the benchmark's own requests use.
ROUTE = "default"
# wrk gives up on an answer after this long and counts a timeout; far above any p99 here.
WRK_TIMEOUT = "10s"
# A wrk run that has not exited this long after its planned end is stuck.
WRK_GRACE = 30.0
# Start-up: initdb and the migrations run before the gateway listens.
STARTUP_TIMEOUT = 60.0
# Connections used to store the replay pools before the measured runs.
POOL_CONNECTIONS = 16
POOL_TIMEOUT = 60.0
# The key sweep fills the table in batches of this many rows, checking its time budget between
# batches; one batch takes seconds, so the budget is overrun by one batch at most.
FILL_BATCH = 1_000_000
FILL_STATEMENT_TIMEOUT = 300.0
# A receipt like the demo upstream's, stored with every pre-filled row: the rows are as wide as
# real ones, so the table and its pages grow as they would.
FILL_BODY = json.dumps(
    {
        "id": "em_000000",
        "kind": "email",
        "path": PATH,
        "idempotency_key": "fill",
        "request": json.loads(BODY),
        "performed_at": 0.0,
    }
).encode()
FILL_HEADERS = json.dumps([["content-type", "application/json"], ["location", "/actions/em"]])
# The request a claim keeps behind its key (service.evidence), as the gateway keeps the bench's
# requests: the floor's claim writes it too, so the floor stays the gateway's two statements.
FLOOR_REQUEST = KeptRequest(
    "POST", PATH, "",
    [("content-type", "application/json"), ("idempotency-key", "bench-0-0000000")],
    BODY,
).encode()  # fmt: skip
FLOOR_CLAIMANT = claimant()

# Other work on the machine worth mentioning under the tables, in cores: the idle servers and
# the system use a few hundredths.
FOREIGN_NOTICEABLE = 0.2

CONCURRENCY_SWEEP = (1, 16, 64, 256)
KEY_SWEEP = (10**4, 10**6, 10**7)
# The mix sweep's shares of retries: each mix read against its parts, the forward (0) and the
# replay (100) of the same round.
MIX_SWEEP = (0, 20, 50, 80, 100)


# --- what is measured ----------------------------------------------------------------------


@dataclass(frozen=True)
class Configuration:
    label: str
    target: str  # which server: upstream | bare | gateway | idemkit
    retry_percent: int  # 0: every request a new key; 100: every request a retry of a stored key
    path: str = PATH  # where on the target the requests go

    @property
    def slug(self) -> str:
        return re.sub(r"[^a-z0-9]+", "-", self.label.lower()).strip("-")


DIRECT = Configuration("upstream direct", "upstream", 0)
BARE = Configuration("bare proxy", "bare", 0)
FORWARD = Configuration("oncegate forward", "gateway", 0)
# The same forwards through a route with `wait` (WAITED_ROUTE): nobody waits, so it should cost
# what FORWARD costs.
WAITED_ROUTE = "/waited"
WAIT_FORWARD = Configuration("oncegate forward, route wait", "gateway", 0, WAITED_ROUTE + PATH)
# The gateway's request path with the in-memory store (bench/memory_gateway.py): no statement
# sent, so the bare proxy's row, this one and FORWARD split a forward's proxy CPU into the server
# stack, the gateway's own Python and the store (`split_line`).
IN_MEMORY = Configuration("oncegate forward, in-memory store", "memory", 0)
REPLAY = Configuration("oncegate replay", "gateway", 100)
MIX = Configuration("oncegate mix 80/20", "gateway", 20)
# The same gateway with ONCEGATE_ENCRYPTION_KEYS: what sealing every stored answer costs.
SEALED_FORWARD = Configuration("oncegate sealed forward", "sealed", 0)
SEALED_REPLAY = Configuration("oncegate sealed replay", "sealed", 100)
IDEMKIT_FORWARD = Configuration("idemkit forward", "idemkit", 0)
IDEMKIT_REPLAY = Configuration("idemkit replay", "idemkit", 100)
IDEMKIT_MIX = Configuration("idemkit mix 80/20", "idemkit", 20)
MAIN = (
    DIRECT, BARE, FORWARD, WAIT_FORWARD, IN_MEMORY, REPLAY, MIX, SEALED_FORWARD, SEALED_REPLAY,
    IDEMKIT_FORWARD, IDEMKIT_REPLAY, IDEMKIT_MIX,
)  # fmt: skip
# No proxy: the gateway's own claim and complete statements, one after the other on asyncpg
# (its pools' settings) against the same PostgreSQL: the floor of a forward's added latency.
FLOOR = Configuration("raw claim+complete floor (asyncpg)", "floor", 0)
LATENCY = (BARE, FORWARD, IN_MEMORY, REPLAY, MIX, FLOOR)
SWEPT = (BARE, FORWARD, REPLAY)
# `--sweep mix`: the gateway from every request a new key to every request a retry of a stored
# key (`MIX_SWEEP`), interleaved among themselves: rows of their own, so that a mix is read
# against its parts measured in the same rounds. (Not on the in-memory store: it drops its
# oldest keys past its capacity, the stored keys a replay retries among them.)
MIXED = {
    percent: Configuration(f"oncegate, {percent}% retries", "gateway", percent)
    for percent in MIX_SWEEP
}
PEERS = {FORWARD: IDEMKIT_FORWARD, REPLAY: IDEMKIT_REPLAY, MIX: IDEMKIT_MIX}
# The same rows with two worker processes per proxy (`serve --workers 2`, the bare proxy's
# uvicorn workers): what a second core gives each. Measured when the run's --workers is 1.
BARE_2 = Configuration("bare proxy, 2 workers", "bare2", 0)
FORWARD_2 = Configuration("oncegate forward, 2 workers", "gateway2", 0)
REPLAY_2 = Configuration("oncegate replay, 2 workers", "gateway2", 100)
MIX_2 = Configuration("oncegate mix 80/20, 2 workers", "gateway2", 20)
TWO_WORKERS = (BARE_2, FORWARD_2, REPLAY_2, MIX_2)
# `--baseline DIR`: the gateway of another checkout (its own .venv), beside this one in the same
# run, so that a change is measured against what it changes on the same machine at the same time.
BASE_FORWARD = Configuration("baseline forward", "baseline", 0)
BASE_REPLAY = Configuration("baseline replay", "baseline", 100)
BASE_MIX = Configuration("baseline mix 80/20", "baseline", 20)
BASELINE = (BASE_FORWARD, BASE_REPLAY, BASE_MIX)
ONE_WORKER = {BARE_2: BARE, FORWARD_2: FORWARD, REPLAY_2: REPLAY, MIX_2: MIX}
# What `--rows` names: the main tables' rows (64 connections, two workers, 1 connection), each by
# its label's slug (`oncegate-mix-80-20`, `baseline-forward`).
NAMED_ROWS = {row.slug: row for row in (*MAIN, *LATENCY, *TWO_WORKERS, *BASELINE)}


def main_plan(arguments: argparse.Namespace) -> list[tuple[Configuration, int]]:
    """The main tables' (configuration, connections) pairs, in the order they are measured:
    the 64-connection rows, the two-worker rows (one worker per proxy), the 1-connection rows;
    only those `--rows` names when it is given."""
    main_rows = MAIN if arguments.baseline is None else MAIN + BASELINE
    latency_rows = LATENCY
    if arguments.workers > 1:  # no in-memory gateway (`servers`)
        main_rows = tuple(row for row in main_rows if row is not IN_MEMORY)
        latency_rows = tuple(row for row in LATENCY if row is not IN_MEMORY)
    plan = [(configuration, arguments.connections) for configuration in main_rows]
    if arguments.workers == 1:
        plan += [(two, arguments.connections) for two in TWO_WORKERS]
    plan += [(configuration, 1) for configuration in latency_rows]
    if arguments.baseline is not None:
        plan.append((BASE_FORWARD, 1))
    if arguments.rows:
        plan = [(row, connections) for row, connections in plan if row.slug in arguments.rows]
    return plan


@dataclass
class Sample:
    requests: int
    seconds: float
    p50_ms: float
    p99_ms: float
    cpu_ms_per_request: float  # nan when PostgreSQL's processes could not be found
    proxy_ms_per_request: float  # the part of it the proxy under test used
    postgres_ms_per_request: float  # the part PostgreSQL used
    errors: dict[str, int]
    new_sent: int
    retries_sent: int
    # What the demo upstream really performed for this run's keys: a new key performed more
    # than once, or a stored (pool) key performed again, is a duplicate that got through.
    duplicates: int = 0
    pool_performed: int = 0
    claim_ms: float = math.nan  # mean `claim` store-operation time (oncegate only)
    complete_ms: float = math.nan
    # What the store's statements held during the run, per operation (oncegate only); None when
    # the store exports no `oncegate_store_batch_size`.
    batch_sizes: dict[str, Histogram] | None = None
    # CPU (in cores) that processes outside the benchmark used during the run: another job on
    # the machine makes every figure of that run pessimistic.
    foreign_cores: float = 0.0
    # py-spy's samples of the proxy during the run, per part of the request path (`--profile`).
    profile: collections.Counter[str] | None = None

    @property
    def per_second(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0


@dataclass
class Results:
    samples: dict[tuple[Configuration, int], list[Sample]] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    def add(self, configuration: Configuration, connections: int, sample: Sample) -> None:
        self.samples.setdefault((configuration, connections), []).append(sample)

    def get(self, configuration: Configuration, connections: int) -> list[Sample]:
        return self.samples.get((configuration, connections), [])

    def median(
        self, configuration: Configuration, connections: int, metric: Callable[[Sample], float]
    ) -> float:
        values = [metric(sample) for sample in self.get(configuration, connections)]
        return statistics.median(values) if values else math.nan


# --- CPU time of the server side -----------------------------------------------------------

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _processes() -> dict[int, tuple[int, int, int]]:
    """pid -> (parent pid, own CPU ticks, CPU ticks of reaped children), for every process."""
    table = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as stat:
                text = stat.read()
        except OSError:
            continue  # exited while we looked
        # The command name is in parentheses and may contain anything: split after the last.
        fields = text[text.rindex(b")") + 2 :].split()
        table[int(entry.name)] = (
            int(fields[1]),
            int(fields[11]) + int(fields[12]),
            int(fields[13]) + int(fields[14]),
        )
    return table


def cpu_seconds(groups: dict[str, list[int]]) -> dict[str, float]:
    """CPU seconds used so far, per group, by the group's root processes, all their descendants,
    and the children they reaped. A process counts in the first group that reaches it."""
    table = _processes()
    children: dict[int, list[int]] = {}
    for pid, (parent, _, _) in table.items():
        children.setdefault(parent, []).append(pid)
    seen: set[int] = set()
    used = {}
    for name, roots in groups.items():
        ticks = 0
        pending = [root for root in roots if root in table]
        for root in set(pending):
            ticks += table[root][2]
        while pending:
            pid = pending.pop()
            if pid not in seen:
                seen.add(pid)
                ticks += table[pid][1]
                pending.extend(children.get(pid, []))
        used[name] = ticks / CLOCK_TICKS
    return used


def machine_busy_seconds() -> float:
    """CPU seconds every CPU of the machine spent busy since boot (/proc/stat)."""
    with open("/proc/stat") as stat:
        fields = [int(value) for value in stat.readline().split()[1:]]
    # user nice system idle iowait irq softirq steal: everything but idle and iowait.
    busy = fields[0] + fields[1] + fields[2] + sum(fields[5:8])
    return busy / CLOCK_TICKS


def own_seconds() -> float:
    """CPU seconds of this script and of the children it waited for (wrk)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


# --- the servers ---------------------------------------------------------------------------


@dataclass
class Servers:
    work: Path
    ports: dict[str, int]
    pids: dict[str, int]
    admin_ports: dict[str, int]  # target -> its admin port, for the oncegate gateways
    database_url: str
    embedded: bool
    postmaster: int | None  # None: PostgreSQL runs elsewhere, its CPU is not counted
    pools: dict[str, str] = field(default_factory=dict)  # target -> stored key prefix

    def process_groups(self, target: str) -> dict[str, list[int]]:
        """The server side of `target`: PostgreSQL first (so a postmaster started by the gateway
        counts as PostgreSQL), then the proxy under test, then the demo upstream."""
        groups = {"postgres": [self.postmaster] if self.postmaster is not None else []}
        groups["proxy"] = [self.pids[target]] if target != "upstream" else []
        groups["upstream"] = [self.pids["upstream"]]
        return groups


def _postmaster_pid(data_directory: Path) -> int | None:
    with contextlib.suppress(OSError, ValueError, IndexError):
        return int((data_directory / "postmaster.pid").read_text().splitlines()[0])
    return None


async def _fetch(url: str, query: str) -> Any:
    import asyncpg

    connection = await asyncpg.connect(url, timeout=10)
    try:
        return await connection.fetchval(query, timeout=30)
    finally:
        await connection.close()


@contextlib.contextmanager
def servers(work: Path, arguments: argparse.Namespace) -> Iterator[Servers]:
    environment = quick.server_environment(work / "data")
    external_url = environment.get("ONCEGATE_DATABASE_URL")
    two_workers = arguments.workers == 1 and arguments.main
    ports = {
        name: quick.free_port()
        for name in (
            "upstream", "gateway", "sealed", "bare", "idemkit", "bare2", "gateway2", "baseline",
            "memory",
        )
    }  # fmt: skip
    admin_ports = {
        name: quick.free_port() for name in ("gateway", "sealed", "gateway2", "baseline")
    }
    workers = ["--workers", str(arguments.workers)] if arguments.workers > 1 else []
    started: list[subprocess.Popen[bytes]] = []
    embedded_handle = None
    try:
        if external_url:
            migrate = subprocess.run(
                quick.oncegate("migrate"),
                env=environment,
                cwd=ROOT,
                capture_output=True,
                timeout=STARTUP_TIMEOUT,
            )
            if migrate.returncode != 0:
                raise RuntimeError(f"oncegate migrate failed:\n{migrate.stderr.decode()}")

        # Beside the catch-all route, one with `wait` (WAIT_FORWARD) to the same upstream.
        waited = work / "routes.yaml"
        waited.write_text(
            f"routes: [{{name: waited, match: {WAITED_ROUTE}, strip_prefix: true, wait: 10s,"
            f" upstream: 'http://{HOST}:{ports['upstream']}'}}]\n"
        )

        def serve(target: str, processes: list[str] = workers) -> list[str]:
            """`oncegate serve` for `target` (the plain, the sealed or the two-worker gateway)
            in front of the demo upstream, on the target's own ports."""
            return quick.oncegate(
                "serve", "--upstream", f"http://{HOST}:{ports['upstream']}", "--config",
                str(waited), "--host", HOST, "--port", str(ports[target]), "--admin-port",
                str(admin_ports[target]), *processes,
            )  # fmt: skip

        def bare_proxy(target: str, processes: list[str]) -> list[str]:
            return [
                sys.executable, str(BENCH / "bare_proxy.py"),
                "--upstream", f"http://{HOST}:{ports['upstream']}", "--host", HOST,
                "--port", str(ports[target]), f"--stack={arguments.bare_stack}", *processes,
            ]  # fmt: skip

        upstream = quick.start(
            quick.oncegate("demo-upstream", "--host", HOST, "--port", str(ports["upstream"])),
            work / "upstream.log",
            environment,
            started,
        )
        gateway = quick.start(
            serve("gateway"),
            work / "gateway.log",
            environment,
            started,
        )
        quick.wait_listening(upstream, ports["upstream"], work / "upstream.log", STARTUP_TIMEOUT)
        quick.wait_listening(gateway, ports["gateway"], work / "gateway.log", STARTUP_TIMEOUT)
        if external_url:
            database_url = external_url
            data_directory = Path(asyncio.run(_fetch(database_url, "SHOW data_directory")))
        else:
            # Join the gateway's embedded server (pgserver counts the processes holding it) for
            # its URL; the last holder to let go stops it.
            from oncegate.store import embedded

            embedded_handle = embedded.start(work / "data")
            database_url = embedded_handle.url
            data_directory = embedded_handle.pgdata
        sealed = quick.start(
            serve("sealed"),
            work / "sealed.log",
            {**environment, "ONCEGATE_DATABASE_URL": database_url,
             "ONCEGATE_ENCRYPTION_KEYS": "bench:" + base64.b64encode(os.urandom(32)).decode()},
            started,
        )  # fmt: skip
        bare = quick.start(bare_proxy("bare", workers), work / "bare.log", environment, started)
        extra: dict[str, subprocess.Popen[bytes]] = {}
        if arguments.workers == 1 and arguments.main:  # one process: read against FORWARD's
            extra["memory"] = quick.start(
                [sys.executable, str(BENCH / "memory_gateway.py"), "--upstream",
                 f"http://{HOST}:{ports['upstream']}", "--config", str(waited), "--host", HOST,
                 "--port", str(ports["memory"])],
                work / "memory.log",
                environment,
                started,
            )  # fmt: skip
        if arguments.baseline is not None:
            # A database of its own on the same server, at the baseline's own schema.
            baseline_url = quick.checkout_database(
                database_url, "oncegate_baseline", arguments.baseline, work
            )
            command = serve("baseline")
            command[0] = str(arguments.baseline / ".venv" / "bin" / "python")
            extra["baseline"] = quick.start(
                command,
                work / "baseline.log",
                {**environment, "ONCEGATE_DATABASE_URL": baseline_url},
                started,
                cwd=arguments.baseline,
            )
        if two_workers:
            two = ["--workers", "2"]
            extra["bare2"] = quick.start(
                bare_proxy("bare2", two), work / "bare2.log", environment, started
            )
            extra["gateway2"] = quick.start(
                serve("gateway2", two),
                work / "gateway2.log",
                {**environment, "ONCEGATE_DATABASE_URL": database_url},
                started,
            )
        idemkit = quick.start(
            [
                sys.executable,
                str(BENCH / "idemkit_proxy.py"),
                "--upstream",
                f"http://{HOST}:{ports['upstream']}",
                "--database-url",
                database_url,
                "--host",
                HOST,
                "--port",
                str(ports["idemkit"]),
                f"--stack={arguments.bare_stack}",
                *workers,
            ],
            work / "idemkit.log",
            environment,
            started,
        )
        quick.wait_listening(sealed, ports["sealed"], work / "sealed.log", STARTUP_TIMEOUT)
        quick.wait_listening(bare, ports["bare"], work / "bare.log", STARTUP_TIMEOUT)
        quick.wait_listening(idemkit, ports["idemkit"], work / "idemkit.log", STARTUP_TIMEOUT)
        for name, process in extra.items():
            quick.wait_listening(process, ports[name], work / f"{name}.log", STARTUP_TIMEOUT)
        yield Servers(
            work=work,
            ports=ports,
            pids={
                "upstream": upstream.pid,
                "gateway": gateway.pid,
                "sealed": sealed.pid,
                "bare": bare.pid,
                "idemkit": idemkit.pid,
                **{name: process.pid for name, process in extra.items()},
            },
            admin_ports=admin_ports,
            database_url=database_url,
            embedded=not external_url,
            postmaster=_postmaster_pid(data_directory),
        )
    finally:
        for process in reversed(started):
            quick.stop(process)
        if embedded_handle is not None:
            embedded_handle.stop()
        if not external_url:
            quick.stop_orphaned_postgres(work / "data" / "pgdata")


# --- driving one configuration -------------------------------------------------------------


def run_wrk(
    port: int,
    path: str,
    connections: int,
    seconds: int,
    threads: int,
    prefix: str,
    retry_percent: int,
    pool_prefix: str,
    pool_size: int,
) -> dict[str, Any]:
    command = [
        "wrk",
        f"--threads={min(threads, connections)}",
        f"--connections={connections}",
        f"--duration={seconds}s",
        f"--timeout={WRK_TIMEOUT}",
        f"--script={LOAD_SCRIPT}",
        f"http://{HOST}:{port}{path}",
        "--",
        prefix,
        str(retry_percent),
        pool_prefix,
        str(pool_size),
        path,
        BODY.decode(),
    ]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=seconds + WRK_GRACE)
    for line in completed.stdout.splitlines():
        if line.startswith('{"requests"'):
            report: dict[str, Any] = json.loads(line)
            return report
    raise RuntimeError(
        f"wrk exited {completed.returncode} without its report:\n"
        f"{completed.stdout[-2000:]}\n{completed.stderr[-2000:]}"
    )


def store_pool(servers: Servers, target: str, size: int, run: str) -> None:
    """Store `size` keys through `target` once, for the replay and mix configurations."""
    if target in servers.pools:
        return
    prefix = f"{run}-{target}-pool"
    port = servers.ports[target]
    pool = [quick.build_request(port, f"{prefix}-{index}") for index in range(size)]
    result = quick.PhaseResult(f"{target} pool")
    start = time.perf_counter()
    asyncio.run(
        quick.drive(
            result,
            port,
            quick.pool_once(pool, POOL_CONNECTIONS),
            POOL_CONNECTIONS,
            measure_from=start,
            until=start + POOL_TIMEOUT,
            check=quick.check_2xx,
        )
    )
    if result.errors or result.requests != size:
        raise RuntimeError(
            f"storing the replay pool through {target}: {result.requests} of {size} answered, "
            f"errors {dict(result.errors)}"
        )
    servers.pools[target] = prefix


def scrape(admin_port: int) -> str:
    """The gateway's /metrics page, as text."""
    url = f"http://{HOST}:{admin_port}/metrics"
    with urllib.request.urlopen(url, timeout=quick.REQUEST_TIMEOUT) as answer:
        text: str = answer.read().decode()
    return text


def store_metrics(text: str) -> dict[str, tuple[float, float]]:
    """operation -> (sum of seconds, count) of oncegate_store_operation_duration_seconds."""
    found: dict[str, list[float]] = {}
    pattern = re.compile(
        r'^oncegate_store_operation_duration_seconds_(sum|count)\{operation="(\w+)"\} (\S+)$'
    )
    for line in text.splitlines():
        match = pattern.match(line)
        if match:
            kind, operation, value = match.groups()
            found.setdefault(operation, [0.0, 0.0])[kind == "count"] = float(value)
    return {operation: (pair[0], pair[1]) for operation, pair in found.items()}


@dataclass
class Histogram:
    """One operation's series of a Prometheus histogram: cumulative counts per upper bound."""

    buckets: dict[float, float] = field(default_factory=dict)  # le -> observations <= le
    total: float = 0.0  # the _sum series
    count: float = 0.0

    def minus(self, earlier: Histogram | None) -> Histogram:
        if earlier is None:
            return Histogram(dict(self.buckets), self.total, self.count)
        return Histogram(
            {
                bound: value - earlier.buckets.get(bound, 0.0)
                for bound, value in self.buckets.items()
            },
            self.total - earlier.total,
            self.count - earlier.count,
        )

    def plus(self, other: Histogram) -> Histogram:
        bounds = self.buckets.keys() | other.buckets.keys()
        return Histogram(
            {
                bound: self.buckets.get(bound, 0.0) + other.buckets.get(bound, 0.0)
                for bound in bounds
            },
            self.total + other.total,
            self.count + other.count,
        )

    def at_most(self, fraction: float) -> float:
        """The smallest bucket bound holding `fraction` of the observations (inf: above all)."""
        for bound in sorted(self.buckets):
            if self.buckets[bound] >= fraction * self.count:
                return bound
        return math.inf


BATCH_SIZE_METRIC = "oncegate_store_batch_size"
# The batched store's operations, in the order the batch-size line names them.
BATCH_OPERATIONS = ("claim", "complete", "release", "mark_unknown", "take_over", "reclaim_expired")


def batch_sizes(text: str) -> dict[str, Histogram] | None:
    """operation -> the rows-per-statement histogram the store exports, or None when the page
    has no `oncegate_store_batch_size` (a store that does not batch)."""
    pattern = re.compile(rf"^{BATCH_SIZE_METRIC}_(bucket|sum|count)\{{([^}}]*)\}} (\S+)$")
    found: dict[str, Histogram] = {}
    declared = False
    for line in text.splitlines():
        if line.startswith(f"# TYPE {BATCH_SIZE_METRIC} "):
            declared = True
        match = pattern.match(line)
        if not match:
            continue
        kind, label_text, value = match.groups()
        labels = dict(re.findall(r'(\w+)="([^"]*)"', label_text))
        histogram = found.setdefault(labels.get("operation", ""), Histogram())
        if kind == "bucket":
            histogram.buckets[float(labels["le"])] = float(value)
        elif kind == "sum":
            histogram.total = float(value)
        else:
            histogram.count = float(value)
    return found if declared or found else None


def _batch_delta(
    before: dict[str, Histogram] | None, after: dict[str, Histogram] | None
) -> dict[str, Histogram] | None:
    if after is None:
        return None
    before = before or {}
    return {operation: seen.minus(before.get(operation)) for operation, seen in after.items()}


def _mean_ms(
    before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]], operation: str
) -> float:
    total, count = after.get(operation, (0.0, 0.0))
    earlier_total, earlier_count = before.get(operation, (0.0, 0.0))
    if count <= earlier_count:
        return math.nan
    return (total - earlier_total) / (count - earlier_count) * 1000


async def floor_connections(url: str) -> tuple[asyncpg.Connection, asyncpg.Connection]:
    """Two connections set as the gateway's request pools are on plain PostgreSQL: one for
    claims, one for answers (committed without waiting for the WAL flush, the default)."""
    from oncegate.store.postgres.connections import request_settings

    settings = request_settings(on_citus=False)
    claims = await asyncpg.connect(url, server_settings=settings, timeout=10)
    answers = await asyncpg.connect(
        url, server_settings={**settings, "synchronous_commit": "off"}, timeout=10
    )
    return claims, answers


async def _floor(
    database_url: str, seconds: float, warmup: float, tag: str
) -> tuple[list[float], list[float], int]:
    """Claim a new key, then complete it, one after the other for `warmup` + `seconds`, with the
    gateway's own statements (one-row arrays, as a lone operation is sent) on two connections
    set as its pools are (generic plans; answers committed without waiting for the WAL flush):
    the claim and complete times in ms of the measured pairs, and how many there were."""
    from oncegate.store.queries import DIALECTS

    claims, answers = await floor_connections(database_url)
    plain = DIALECTS["postgres"]
    claim, complete = plain["claim"], plain["complete"]
    scope = keys.scope(ROUTE, [[]])
    claim_ms: list[float] = []
    complete_ms: list[float] = []
    try:
        start = time.perf_counter()
        number = 0
        while (now := time.perf_counter()) < start + warmup + seconds:
            number += 1
            key = f"{tag}-{number}"
            arrays: dict[str, Sequence[object]] = {
                "routes": [ROUTE], "scopes": [scope], "keys": [key], "fingerprints": [bytes(32)],
                "leases": [60.0], "ttls": [86400.0], "requests": [FLOOR_REQUEST],
                "requests_sealed_with": [None], "claimant": FLOOR_CLAIMANT,
            }  # fmt: skip
            row = (await claims.fetch(claim.sql, *claim.arguments(arrays), timeout=30))[0]
            claimed = time.perf_counter()
            answer = {
                "ids": [row["id"]], "keys": [key], "tokens": [row["fencing_token"]],
                "statuses": [201],
                "stored": [True], "headers": [FILL_HEADERS], "bodies": [FILL_BODY],
                "sealed_with": [None], "sealed_headers": [None],
            }  # fmt: skip
            await answers.fetch(complete.sql, *complete.arguments(answer), timeout=30)
            if now >= start + warmup:
                claim_ms.append((claimed - now) * 1000)
                complete_ms.append((time.perf_counter() - claimed) * 1000)
    finally:
        await claims.close()
        await answers.close()
    return claim_ms, complete_ms, len(claim_ms)


def measure_floor(servers: Servers, arguments: argparse.Namespace, tag: str) -> Sample:
    """The `FLOOR` row: what a forward's two round trips cost at least, measured in the run."""
    groups = {"postgres": [servers.postmaster] if servers.postmaster is not None else []}
    cpu_before = cpu_seconds(groups)
    claim_ms, complete_ms, pairs = asyncio.run(
        _floor(servers.database_url, arguments.duration, arguments.warmup, f"{arguments.run}-{tag}")
    )
    postgres = cpu_seconds(groups)["postgres"] - cpu_before["postgres"]
    pair_ms = sorted(map(sum, zip(claim_ms, complete_ms, strict=True)))
    known = pairs and servers.postmaster is not None
    return Sample(
        requests=pairs,
        seconds=float(arguments.duration),
        p50_ms=statistics.median(pair_ms) if pair_ms else math.nan,
        p99_ms=pair_ms[min(len(pair_ms) - 1, int(len(pair_ms) * 0.99))] if pair_ms else math.nan,
        cpu_ms_per_request=postgres / pairs * 1000 if known else math.nan,
        proxy_ms_per_request=0.0,
        postgres_ms_per_request=postgres / pairs * 1000 if known else math.nan,
        errors={},
        new_sent=pairs,
        retries_sent=0,
        # Means, as the gateway's rows have them (its store-operation histogram): a median
        # here read 0.2 ms below the gateway's mean claim, most of it the tail a mean carries.
        claim_ms=statistics.mean(claim_ms) if claim_ms else math.nan,
        complete_ms=statistics.mean(complete_ms) if complete_ms else math.nan,
        foreign_cores=math.nan,
    )


def measure(
    servers: Servers,
    configuration: Configuration,
    connections: int,
    arguments: argparse.Namespace,
    tag: str,
) -> Sample:
    target = configuration.target
    if target == "floor":
        return measure_floor(servers, arguments, tag)
    port = servers.ports[target]
    pool_prefix, pool_size = "", 0
    if configuration.retry_percent:
        store_pool(servers, target, arguments.pool, arguments.run)
        pool_prefix, pool_size = servers.pools[target], arguments.pool
    prefix = f"{arguments.run}-{tag}"
    warm_prefix = f"{arguments.run}-warm-{tag}"  # not a prefix of `prefix`: counted apart
    if arguments.warmup:
        run_wrk(
            port,
            configuration.path,
            connections,
            arguments.warmup,
            arguments.threads,
            warm_prefix,
            configuration.retry_percent,
            pool_prefix,
            pool_size,
        )
    quick.clear_actions(servers.ports["upstream"])  # the demo upstream keeps every action
    admin_port = servers.admin_ports.get(target)  # an oncegate gateway: its store's metrics
    page_before = scrape(admin_port) if admin_port else ""
    groups = servers.process_groups(target)
    cpu_before = cpu_seconds(groups)
    machine_before, own_before = machine_busy_seconds(), own_seconds()
    wall_before = time.monotonic()
    spy, spied = None, None
    if arguments.profile is not None and target != "upstream":
        spied = arguments.profile / f"{tag}.txt"
        spy = profiling.start(servers.pids[target], arguments.duration, spied)
    report = run_wrk(
        port,
        configuration.path,
        connections,
        arguments.duration,
        arguments.threads,
        prefix,
        configuration.retry_percent,
        pool_prefix,
        pool_size,
    )
    cpu_after = cpu_seconds(groups)
    profile = profiling.finish(spy, spied) if spy is not None and spied is not None else None
    cpu_by_group = {name: cpu_after[name] - cpu_before[name] for name in groups}
    cpu_used = sum(cpu_by_group.values())
    foreign = (
        machine_busy_seconds() - machine_before - (own_seconds() - own_before) - cpu_used
    ) / (time.monotonic() - wall_before)
    page_after = scrape(admin_port) if admin_port else ""
    metrics_before, metrics_after = store_metrics(page_before), store_metrics(page_after)
    duplicates = pool_performed = 0
    if target != "upstream":
        time.sleep(0.3)  # forwards still in flight when wrk stopped reach the upstream now
        duplicates, pool_performed = audit_actions(
            servers.ports["upstream"], prefix + "-", pool_prefix + "-" if pool_prefix else None
        )
    requests = report["requests"]

    def per_request(seconds: float) -> float:
        known = requests and servers.postmaster is not None
        return seconds / requests * 1000 if known else math.nan

    errors = {
        name: report[name]
        for name in ("connect_errors", "read_errors", "write_errors", "status_errors", "timeouts")
        if report[name]
    }
    return Sample(
        requests=requests,
        seconds=report["duration_us"] / 1e6,
        p50_ms=report["p50_us"] / 1000,
        p99_ms=report["p99_us"] / 1000,
        cpu_ms_per_request=per_request(cpu_used),
        proxy_ms_per_request=per_request(cpu_by_group["proxy"]),
        postgres_ms_per_request=per_request(cpu_by_group["postgres"]),
        errors=errors,
        new_sent=report["new_sent"],
        retries_sent=report["retries_sent"],
        duplicates=duplicates,
        pool_performed=pool_performed,
        claim_ms=_mean_ms(metrics_before, metrics_after, "claim"),
        complete_ms=_mean_ms(metrics_before, metrics_after, "complete"),
        batch_sizes=_batch_delta(batch_sizes(page_before), batch_sizes(page_after)),
        foreign_cores=foreign if servers.postmaster is not None else math.nan,
        profile=profile,
    )


def audit_actions(upstream_port: int, prefix: str, pool_prefix: str | None) -> tuple[int, int]:
    """(new keys of this run performed more than once, stored keys performed again), from the
    actions the demo upstream recorded since it was last cleared."""
    url = f"http://{HOST}:{upstream_port}/actions"
    with urllib.request.urlopen(url, timeout=quick.REQUEST_TIMEOUT) as answer:
        actions = json.load(answer)["actions"]
    performed = [action["idempotency_key"] or "" for action in actions]
    new = [key for key in performed if key.startswith(prefix)]
    pooled = sum(1 for key in performed if pool_prefix and key.startswith(pool_prefix))
    return len(new) - len(set(new)), pooled


# --- the leak check ------------------------------------------------------------------------

LEAK_FIRST = 10**4  # RSS is read first after this many requests, when start-up is over
LEAK_CHUNK = 20  # seconds of wrk at a time between the two readings
LEAK_BUDGET = 3600.0  # seconds: past this the check stops at the count it reached, and says so


def rss_bytes(root: int) -> int:
    """Resident memory of `root` and its descendants (the workers), from /proc."""
    table = _processes()
    total, pending = 0, [root]
    while pending:
        pid = pending.pop()
        with contextlib.suppress(OSError, ValueError):
            for text in Path(f"/proc/{pid}/status").read_text().splitlines():
                if text.startswith("VmRSS:"):
                    total += int(text.split()[1]) * 1024
        pending.extend(child for child, (parent, _, _) in table.items() if parent == pid)
    return total


def leak_check(servers: Servers, arguments: argparse.Namespace) -> tuple[str, str]:
    """Drive the gateway with the mix (80% new keys, 20% retries) to `LEAK_FIRST` requests, read
    its RSS, go on to `--leak` requests, read it again: (the line, the PASS/FAIL target line)."""
    target, port = "gateway", servers.ports["gateway"]
    store_pool(servers, target, arguments.pool, arguments.run)
    pool_prefix = servers.pools[target]
    done, chunk, first = 0, 0, None
    deadline = time.monotonic() + LEAK_BUDGET
    while done < arguments.leak and time.monotonic() < deadline:
        chunk += 1
        seconds = 2 if first is None else LEAK_CHUNK
        tag = f"{arguments.run}-leak-{chunk}"
        report = run_wrk(
            port, PATH, arguments.connections, seconds, arguments.threads, tag, 20, pool_prefix,
            arguments.pool,
        )  # fmt: skip
        done += report["requests"]
        quick.clear_actions(servers.ports["upstream"])  # the demo upstream keeps every action
        if first is None and done >= LEAK_FIRST:
            first = (done, rss_bytes(servers.pids[target]))
            progress(f"leak check: RSS {first[1] / 2**20:.1f} MiB after {done:,} requests")
    last = (done, rss_bytes(servers.pids[target]))
    if first is None:
        return f"leak check: only {done:,} requests in the time allowed", "n/a  leak check"
    growth = last[1] / first[1] - 1
    short = "" if done >= arguments.leak else f" (stopped at {done:,} of {arguments.leak:,}: time)"
    line = (
        f"memory: the gateway's RSS {first[1] / 2**20:.1f} MiB after {first[0]:,} requests, "
        f"{last[1] / 2**20:.1f} MiB after {last[0]:,} ({growth:+.1%}){short}; mix 80/20 at "
        f"{arguments.connections} connections"
    )
    verdict = "PASS" if growth <= LEAK_TOLERANCE else "FAIL"
    target_line = (
        f"{verdict} the gateway's RSS after {last[0]:,} requests within "
        f"{LEAK_TOLERANCE:.0%} of its RSS after {first[0]:,}: {growth:+.1%}"
    )
    return line, target_line


def check_sample(results: Results, configuration: Configuration, sample: Sample) -> None:
    """Errors, and duplicates that reached the upstream, are listed under the tables."""
    if sample.errors:
        results.warnings.append(f"{configuration.label}: errors {sample.errors}")
    if sample.duplicates or sample.pool_performed:
        results.warnings.append(
            f"{configuration.label}: the upstream performed {sample.duplicates} new keys more "
            f"than once and {sample.pool_performed} stored keys again"
        )


def run_plan(
    servers: Servers,
    plan: Sequence[tuple[Configuration, int]],
    arguments: argparse.Namespace,
    results: Results,
) -> None:
    """Each (configuration, connections) `--repeats` times, interleaved, every other round in
    the reverse order: what one row leaves behind (the key table's autovacuum after a forward
    row's inserts, its WAL) falls on a different row each round, not always on the one after
    it; pairs this run already measured are not measured again."""
    plan = [item for item in dict.fromkeys(plan) if not results.get(*item)]
    total = len(plan) * arguments.repeats
    done = 0
    for repeat in range(arguments.repeats):
        for configuration, connections in plan if repeat % 2 == 0 else plan[::-1]:
            done += 1
            sample = measure(
                servers,
                configuration,
                connections,
                arguments,
                f"{configuration.slug}-c{connections}-r{repeat}",
            )
            results.add(configuration, connections, sample)
            check_sample(results, configuration, sample)
            progress(
                f"[{done}/{total}] {configuration.label}, {connections} connections: "
                f"{sample.per_second:,.0f} req/s, p50 {sample.p50_ms:.2f} ms, "
                f"p99 {sample.p99_ms:.2f} ms, CPU {sample.cpu_ms_per_request:.3f} ms/req, "
                f"other processes {sample.foreign_cores:.2f} cores"
                + (f", errors {sample.errors}" if sample.errors else "")
            )


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# --- the key-count sweep -------------------------------------------------------------------


async def fill_keys(database_url: str, target_rows: int, deadline: float) -> tuple[int, float, str]:
    """Pre-fill completed rows up to `target_rows` (fill rows); returns the fill rows there now,
    the seconds it took and the table's total size."""
    import asyncpg

    scope = keys.scope(ROUTE, [[]])  # the scope of a request without Authorization
    started = time.monotonic()
    connection = await asyncpg.connect(database_url, timeout=10)
    try:
        filled: int = await connection.fetchval(
            "SELECT count(*) FROM oncegate_keys WHERE key LIKE 'fill-%'"
        )
        while filled < target_rows and time.monotonic() < deadline:
            last = min(target_rows, filled + FILL_BATCH)
            # Keys in increasing order in one scope: the unique index grows at its right edge,
            # as it does for time-ordered keys (UUIDv7, ULID) of one tenant.
            await connection.execute(
                """
                INSERT INTO oncegate_keys
                    (route, scope, key, fingerprint, state, fencing_token, response_status,
                     response_headers, response_body, response_stored, completed_at, expires_at)
                SELECT $1, $2, 'fill-' || lpad(i::text, 10, '0'), sha256(int8send(i)),
                       'completed', i, 201, $3::jsonb, $4, true, now(), now() + interval '7 days'
                FROM generate_series($5::bigint, $6::bigint) AS i
                """,
                ROUTE,
                scope,
                FILL_HEADERS,
                FILL_BODY,
                filled + 1,
                last,
                timeout=FILL_STATEMENT_TIMEOUT,
            )
            filled = last
            progress(f"key sweep: {filled:,} rows filled ({time.monotonic() - started:.0f}s)")
        # Fresh statistics, and the dirty pages written now rather than during the measurement.
        await connection.execute("ANALYZE oncegate_keys", timeout=FILL_STATEMENT_TIMEOUT)
        await connection.execute("CHECKPOINT", timeout=FILL_STATEMENT_TIMEOUT)
        size: str = await connection.fetchval(
            "SELECT pg_size_pretty(pg_total_relation_size('oncegate_keys'))"
        )
    finally:
        await connection.close()
    return filled, time.monotonic() - started, size


async def _truncate(database_url: str) -> None:
    import asyncpg

    connection = await asyncpg.connect(database_url, timeout=10)
    try:
        await connection.execute("TRUNCATE oncegate_keys", timeout=60)
    finally:
        await connection.close()


def key_sweep(
    servers: Servers, arguments: argparse.Namespace, results: Results
) -> list[tuple[int, int, float, str]]:
    """Empty the table, then per step pre-fill it and measure the forward path; returns (asked
    rows, filled rows, fill seconds, table size) per step, the samples go to `results`."""
    steps = []
    asyncio.run(_truncate(servers.database_url))
    deadline = time.monotonic() + arguments.fill_budget
    for size in arguments.key_sizes:
        filled, seconds, table_size = asyncio.run(fill_keys(servers.database_url, size, deadline))
        steps.append((size, filled, seconds, table_size))
        configuration = Configuration(f"oncegate forward, {filled:,} keys", "gateway", 0)
        run_plan(servers, [(configuration, arguments.connections)], arguments, results)
        if filled < size:
            results.warnings.append(
                f"key sweep: the fill budget of {arguments.fill_budget:g}s ran out at "
                f"{filled:,} of {size:,} rows; larger steps skipped"
            )
            break
    return steps


# --- the report ----------------------------------------------------------------------------


def spread(values: Sequence[float], digits: int, thousands: bool = False) -> str:
    values = [value for value in values if not math.isnan(value)]
    if not values:
        return "n/a"
    form = f"{{:,.{digits}f}}" if thousands else f"{{:.{digits}f}}"
    middle = form.format(statistics.median(values))
    if len(values) == 1:
        return middle
    return f"{middle} ({form.format(min(values))}-{form.format(max(values))})"


def ratio(numerator: float, denominator: float) -> str:
    if math.isnan(numerator) or math.isnan(denominator) or not denominator:
        return "n/a"
    return f"{numerator / denominator:.2f}x"


def _errors(samples: Sequence[Sample]) -> int:
    return sum(sum(sample.errors.values()) for sample in samples)


def _per_second(sample: Sample) -> float:
    return sample.per_second


def _p99(sample: Sample) -> float:
    return sample.p99_ms


def _p50(sample: Sample) -> float:
    return sample.p50_ms


def _proxy_ms(sample: Sample) -> float:
    return sample.proxy_ms_per_request


def _cpu(sample: Sample) -> float:
    return sample.cpu_ms_per_request


def _proxy_cpu(sample: Sample) -> float:
    return sample.proxy_ms_per_request


def _postgres_cpu(sample: Sample) -> float:
    return sample.postgres_ms_per_request


def _cells(samples: Sequence[Sample], *columns: tuple[Callable[[Sample], float], int]) -> str:
    """One table cell per (metric, digits): its median (min-max) over the samples; req/s
    (0 digits) with thousands separators."""
    return "".join(
        f"| {spread([metric(s) for s in samples], digits, thousands=not digits)} "
        for metric, digits in columns
    )


RATE_AND_LATENCY = ((_per_second, 0), (_p50, 2), (_p99, 2))


def main_table(results: Results, connections: int, configurations: Sequence[Configuration]) -> str:
    bare = results.median(BARE, connections, _per_second)
    rows = [
        "| configuration | req/s | p50 ms | p99 ms | CPU ms/req | of which proxy | of which PG "
        "| req/s ÷ bare | errors |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for configuration in configurations:
        samples = results.get(configuration, connections)
        if not samples:
            continue
        rows.append(
            f"| {configuration.label} "
            + _cells(samples, *RATE_AND_LATENCY, (_cpu, 3), (_proxy_cpu, 3), (_postgres_cpu, 3))
            + f"| {ratio(results.median(configuration, connections, _per_second), bare)} "
            f"| {_errors(samples)} |"
        )
    return "\n".join(rows)


def wait_line(results: Results, connections: int) -> str:
    """What a route's `wait` costs a forward nobody waits for: its req/s and CPU per request
    against the same forward without it (1.0x is nothing)."""
    speed = ratio(
        results.median(WAIT_FORWARD, connections, _per_second),
        results.median(FORWARD, connections, _per_second),
    )
    cpu = ratio(
        results.median(WAIT_FORWARD, connections, lambda sample: sample.cpu_ms_per_request),
        results.median(FORWARD, connections, lambda sample: sample.cpu_ms_per_request),
    )
    return (
        f"\nroute wait, nobody waiting: req/s {speed}, CPU per request {cpu} of the forward without"
    )


def print_if(text: str) -> None:
    if text:
        print(text)


def split_line(results: Results, connections: int) -> str:
    """A forward's proxy CPU in three parts (medians): the server stack (the bare proxy's), the
    gateway's own Python (the in-memory store's row less the bare proxy's) and the store (the
    forward less the in-memory row), with PostgreSQL's own CPU beside it; at 1 connection, the
    same split of the p50 added over the bare proxy."""
    if not results.get(IN_MEMORY, connections):
        return ""  # not measured (--workers above 1)
    line = ""
    bare, memory, forward = (
        results.median(configuration, connections, _proxy_cpu)
        for configuration in (BARE, IN_MEMORY, FORWARD)
    )
    if not math.isnan(bare + memory + forward):  # CPU is known (PostgreSQL's processes found)
        line += (
            f"\nsplit of a forward's proxy CPU: the stack {bare:.3f} ms; the gateway's own "
            f"Python {memory - bare:+.3f} ms; the store, on the gateway's side, "
            f"{forward - memory:+.3f} ms (PostgreSQL's own CPU: "
            f"{results.median(FORWARD, connections, _postgres_cpu):.3f} ms)"
        )
    if connections == 1:
        bare_p50, memory_p50, forward_p50 = (
            results.median(configuration, 1, _p50) for configuration in (BARE, IN_MEMORY, FORWARD)
        )
        line += (
            f"\nsplit of a forward's p50: the bare proxy {bare_p50:.2f} ms; the gateway's own "
            f"{memory_p50 - bare_p50:+.2f} ms; the store {forward_p50 - memory_p50:+.2f} ms"
        )
    return line


def latency_table(results: Results) -> str:
    """The 1-connection rows: what a forward adds over the bare proxy at p50, against the floor
    row, the gateway's own statements measured raw (claim and complete are means: on the
    oncegate rows from the gateway's store-operation histogram, on the floor of its loop)."""
    bare_p50 = results.median(BARE, 1, _p50)
    rows = [
        "| configuration | req/s | p50 ms | p99 ms | p50 - bare p50 ms | claim ms | complete ms "
        "| CPU ms/req | errors |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for configuration in (*LATENCY, BASE_FORWARD):
        samples = results.get(configuration, 1)
        if not samples:
            continue
        difference = results.median(configuration, 1, _p50) - bare_p50
        rows.append(
            f"| {configuration.label} "
            + _cells(samples, *RATE_AND_LATENCY)
            + f"| {'' if configuration is FLOOR else f'{difference:+.2f}'} "
            + _cells(samples, (lambda s: s.claim_ms, 2), (lambda s: s.complete_ms, 2), (_cpu, 3))
            + f"| {_errors(samples)} |"
        )
    return "\n".join(rows)


def workers_table(results: Results, connections: int) -> str | None:
    """The two-worker rows, each against the bare proxy with two workers and against its own
    one-worker row: what a second core gives each proxy."""
    bare = results.median(BARE_2, connections, _per_second)
    rows = [
        "| configuration | req/s | p50 ms | p99 ms | CPU ms/req | of which proxy "
        "| req/s ÷ bare (2 workers) | req/s ÷ 1 worker | errors |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for configuration in TWO_WORKERS:
        samples = results.get(configuration, connections)
        if not samples:
            continue
        value = results.median(configuration, connections, _per_second)
        one = results.median(ONE_WORKER[configuration], connections, _per_second)
        rows.append(
            f"| {configuration.label} "
            + _cells(samples, *RATE_AND_LATENCY, (_cpu, 3), (_proxy_cpu, 3))
            + f"| {ratio(value, bare)} | {ratio(value, one)} | {_errors(samples)} |"
        )
    return "\n".join(rows) if len(rows) > 2 else None


def concurrency_table(results: Results, levels: Sequence[int]) -> str:
    rows = [
        "| configuration | connections | req/s | p50 ms | p99 ms | CPU ms/req | req/s ÷ bare "
        "| errors |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for configuration in SWEPT:
        for connections in levels:
            samples = results.get(configuration, connections)
            if not samples:
                continue
            bare = results.median(BARE, connections, _per_second)
            rows.append(
                f"| {configuration.label} | {connections} "
                f"| {spread([s.per_second for s in samples], 0, thousands=True)} "
                f"| {spread([s.p50_ms for s in samples], 2)} "
                f"| {spread([s.p99_ms for s in samples], 2)} "
                f"| {spread([s.cpu_ms_per_request for s in samples], 3)} "
                f"| {ratio(results.median(configuration, connections, _per_second), bare)} "
                f"| {_errors(samples)} |"
            )
    return "\n".join(rows)


def mix_table(results: Results, connections: int) -> str:
    """Each mix against its parts: the forward and the replay of the same round, weighted by
    the mix's shares ((100 - p)% of the one, p% of the other), and the difference per round,
    its median (min-max) in µs of the proxy's CPU per request."""
    rows = [
        "| retries | req/s | proxy CPU ms/req | its parts ms/req | mix - parts µs/req "
        "| PostgreSQL CPU ms/req | its parts ms/req | errors |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    forwards = results.get(MIXED[0], connections)
    replays = results.get(MIXED[100], connections)

    def parts(share: float, metric: Callable[[Sample], float]) -> list[float]:
        return [
            (1 - share) * metric(forward) + share * metric(replay)
            for forward, replay in zip(forwards, replays, strict=False)
        ]

    for percent, configuration in MIXED.items():
        samples = results.get(configuration, connections)
        if not samples:
            continue
        proxy = parts(percent / 100, _proxy_ms)
        excess = [
            round((sample.proxy_ms_per_request - part) * 1000, 6) or 0.0  # never "-0"
            for sample, part in zip(samples, proxy, strict=False)
        ]
        rows.append(
            f"| {percent}% | {spread([s.per_second for s in samples], 0, thousands=True)} "
            f"| {spread([s.proxy_ms_per_request for s in samples], 3)} "
            f"| {spread(proxy, 3)} | {spread(excess, 0)} "
            f"| {spread([s.postgres_ms_per_request for s in samples], 3)} "
            f"| {spread(parts(percent / 100, lambda s: s.postgres_ms_per_request), 3)} "
            f"| {_errors(samples)} |"
        )
    return "\n".join(rows)


def key_table(
    results: Results, steps: Sequence[tuple[int, int, float, str]], connections: int
) -> str:
    rows = [
        "| pre-filled keys | fill s | table size | req/s | p50 ms | p99 ms | claim ms (mean) "
        "| complete ms (mean) | CPU ms/req | errors |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for _, filled, seconds, size in steps:
        configuration = Configuration(f"oncegate forward, {filled:,} keys", "gateway", 0)
        samples = results.get(configuration, connections)
        rows.append(
            f"| {filled:,} | {seconds:.0f} | {size} "
            f"| {spread([s.per_second for s in samples], 0, thousands=True)} "
            f"| {spread([s.p50_ms for s in samples], 2)} "
            f"| {spread([s.p99_ms for s in samples], 2)} "
            f"| {spread([s.claim_ms for s in samples], 2)} "
            f"| {spread([s.complete_ms for s in samples], 2)} "
            f"| {spread([s.cpu_ms_per_request for s in samples], 3)} "
            f"| {_errors(samples)} |"
        )
    return "\n".join(rows)


# The configurations served by an oncegate gateway, whose store's metrics are scraped.
ONCEGATE_TARGETS = ("gateway", "sealed", "gateway2", "baseline")


def row_batch_sizes(samples: Sequence[Sample]) -> dict[str, Histogram] | None:
    """The batch sizes of a row's runs added up, or None when the store exported none."""
    seen = [sample.batch_sizes for sample in samples if sample.batch_sizes is not None]
    if not seen:
        return None
    total: dict[str, Histogram] = {}
    for sizes in seen:
        for operation, histogram in sizes.items():
            total[operation] = total[operation].plus(histogram) if operation in total else histogram
    return total


def _operations(sizes: dict[str, Histogram]) -> list[str]:
    known = [operation for operation in BATCH_OPERATIONS if operation in sizes]
    return known + sorted(set(sizes) - set(BATCH_OPERATIONS))


def _bound(histogram: Histogram, bound: float) -> str:
    if math.isinf(bound):
        finite = [value for value in histogram.buckets if not math.isinf(value)]
        return f">{max(finite):g}" if finite else ">?"
    return f"≤{bound:g}"


def batch_line(configuration: Configuration, connections: int, samples: Sequence[Sample]) -> str:
    """`batch sizes, forward 64c: claim mean 11.2, p50 ≤16, max ≤32; complete ...`: the rows per
    statement the store sent during the row's measured runs (all of them added up)."""
    head = f"batch sizes, {configuration.label.removeprefix('oncegate ')} {connections}c: "
    sizes = row_batch_sizes(samples)
    if sizes is None:
        return head + f"the store exported no batch sizes ({BATCH_SIZE_METRIC} not on /metrics)"
    parts = [
        f"{operation} mean {histogram.total / histogram.count:.1f}, "
        f"p50 {_bound(histogram, histogram.at_most(0.5))}, "
        f"max {_bound(histogram, histogram.at_most(1.0))}"
        for operation in _operations(sizes)
        if (histogram := sizes[operation]).count > 0
    ]
    return head + ("; ".join(parts) if parts else "no statement counted")


def print_batch_lines(
    results: Results, configurations: Sequence[Configuration], levels: Sequence[int]
) -> None:
    """One batch-size line per oncegate row of a table, under it."""
    lines = [
        batch_line(configuration, connections, results.get(configuration, connections))
        for configuration in configurations
        if configuration.target in ONCEGATE_TARGETS
        for connections in levels
        if results.get(configuration, connections)
    ]
    if lines:
        print("\n" + "\n".join(lines))


# The targets, on the proxy's CPU per request (the steadiest figure a shared machine gives),
# each a ratio of two rows of one run: a forward at most this many times the bare proxy's CPU,
FORWARD_CPU_TARGET = 1.8
# and at most this many times the same gateway's on the in-memory store (the store's share);
STORE_SHARE_TARGET = 1.1
# a replay at most this share of the bare proxy's forward;
REPLAY_CPU_TARGET = 0.8
# idemkit's proxy CPU per forward and per mix at least this many times oncegate's.
PEER_TARGET = 2.5
# At 1 connection: the forward's p99 at most this many times the bare proxy's p99, and its p50
# at most the bare proxy's p50 plus the floor (its two round trips, measured raw in the same run)
# plus this much of the gateway's own work.
TAIL_TARGET = 3.0
OWN_LATENCY_MS = 0.35
# The leak check: RSS after the long run within this fraction of RSS after the short one.
LEAK_TOLERANCE = 0.10


def targets(results: Results, connections: int) -> list[str]:
    """The targets, each one PASS/FAIL line (printed, never asserted), then what a core carries;
    the req/s ratio of the same rows beside each CPU ratio."""
    lines = []

    def line(passed: bool | None, text: str) -> None:
        verdict = "n/a " if passed is None else ("PASS" if passed else "FAIL")
        lines.append(f"{verdict} {text}")

    def proxy_cpu(configuration: Configuration) -> float:
        return results.median(configuration, connections, _proxy_ms)

    def per_second(configuration: Configuration) -> float:
        return results.median(configuration, connections, _per_second)

    def cpu_ratio(ours: Configuration, theirs: Configuration, most: float, text: str) -> None:
        value, base = proxy_cpu(ours), proxy_cpu(theirs)
        line(
            None if math.isnan(value * base) else value <= most * base,
            f"{text} <= {most:.2f}x at {connections} connections: {ratio(value, base)} "
            f"({value:.3f} vs {base:.3f} ms; req/s "
            f"{ratio(per_second(ours), per_second(theirs))})",
        )

    cpu_ratio(FORWARD, BARE, FORWARD_CPU_TARGET, "proxy CPU per forward ÷ the bare proxy's")
    cpu_ratio(FORWARD, IN_MEMORY, STORE_SHARE_TARGET, "the store's share (forward ÷ in-memory)")
    cpu_ratio(REPLAY, BARE, REPLAY_CPU_TARGET, "proxy CPU per replay ÷ the bare proxy's forward")
    for configuration in (FORWARD, MIX):
        peer = PEERS[configuration]
        ours, theirs = proxy_cpu(configuration), proxy_cpu(peer)
        line(
            None if math.isnan(ours * theirs) else theirs >= PEER_TARGET * ours,
            f"{peer.label}'s proxy CPU ÷ {configuration.label}'s >= {PEER_TARGET:.1f}x at "
            f"{connections} connections: {ratio(theirs, ours)} ({theirs:.3f} vs {ours:.3f} ms; "
            f"req/s {ratio(per_second(configuration), per_second(peer))})",
        )
    bare_p99, forward_p99 = (results.median(c, 1, _p99) for c in (BARE, FORWARD))
    line(
        None if math.isnan(bare_p99 * forward_p99) else forward_p99 <= TAIL_TARGET * bare_p99,
        f"{FORWARD.label} p99 ÷ the bare proxy's p99 at 1 connection <= {TAIL_TARGET:.0f}x: "
        f"{ratio(forward_p99, bare_p99)} ({forward_p99:.2f} vs {bare_p99:.2f} ms)",
    )
    bare_p50 = results.median(BARE, 1, _p50)
    added = results.median(FORWARD, 1, _p50) - bare_p50
    floor_p50 = results.median(FLOOR, 1, _p50)
    line(
        None if math.isnan(added * floor_p50) else added <= floor_p50 + OWN_LATENCY_MS,
        f"{FORWARD.label} p50 added over the bare proxy at 1 connection <= the raw claim+complete "
        f"floor + {OWN_LATENCY_MS} ms: {added:+.2f} ms vs {floor_p50:.2f} + {OWN_LATENCY_MS} ms "
        f"(the gateway's own: {added - floor_p50:+.2f} ms)",
    )
    lines.append(capacity_line(results, connections))
    return lines


def capacity_line(results: Results, connections: int) -> str:
    """What a core carries, as docs/scaling.md's capacity model uses it: forwards per second
    per gateway core (1 s ÷ the proxy's CPU per forward) and per PostgreSQL core (1 s ÷
    PostgreSQL's), and so how many gateway cores one PostgreSQL core keeps up with."""
    gateway = results.median(FORWARD, connections, _proxy_ms)
    postgres = results.median(FORWARD, connections, lambda s: s.postgres_ms_per_request)
    if math.isnan(gateway * postgres) or not gateway * postgres:
        return "what a core carries: not measured"
    return (
        f"what a core carries, oncegate forward at {connections} connections: "
        f"{1000 / gateway:,.0f} forwards/s per gateway core ({gateway:.3f} ms each), "
        f"{1000 / postgres:,.0f} per PostgreSQL core ({postgres:.3f} ms each): one PostgreSQL "
        f"core keeps up with {gateway / postgres:.1f} gateway cores"
    )


def profile_table(
    results: Results, connections: int, configurations: Sequence[Configuration]
) -> str | None:
    """Where each proxy's CPU went per request (`--profile`): py-spy's samples of all the runs
    of a row added up, each part's share times the row's median proxy CPU per request."""
    rows: dict[str, tuple[collections.Counter[str], float]] = {}
    for configuration in configurations:
        samples = results.get(configuration, connections)
        counted: collections.Counter[str] = collections.Counter()
        for sample in samples:
            counted += sample.profile or collections.Counter()
        if counted:
            cpu = results.median(configuration, connections, lambda s: s.proxy_ms_per_request)
            rows[configuration.label] = (counted, cpu)
    if not rows:
        return None
    return profiling.table(rows, baseline=BARE.label if BARE.label in rows else None)


def foreign_line(results: Results) -> str:
    """How busy the machine was with other work during the measured runs."""
    values = [
        sample.foreign_cores
        for samples in results.samples.values()
        for sample in samples
        if not math.isnan(sample.foreign_cores)
    ]
    if not values:
        return "other processes on the machine: not measured"
    line = (
        f"other processes on the machine during the measured runs: median "
        f"{statistics.median(values):.2f}, max {max(values):.2f} of {os.cpu_count()} cores"
    )
    if max(values) > FOREIGN_NOTICEABLE:
        line += " (something else was running: rerun on a quiet machine to trust the figures)"
    return line


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for text in Path("/proc/cpuinfo").read_text().splitlines():
            if text.startswith("model name"):
                return text.split(":", 1)[1].strip()
    return "unknown CPU"


def machine_line(servers: Servers) -> str:
    model = cpu_model()
    wrk = subprocess.run(["wrk", "-v"], capture_output=True, text=True, timeout=10)
    wrk_version = (wrk.stdout or wrk.stderr).split(" [", 1)[0].strip()
    postgres = asyncio.run(_fetch(servers.database_url, "SHOW server_version"))
    store = "embedded (pgserver)" if servers.embedded else "ONCEGATE_DATABASE_URL"
    return (
        f"machine: nproc {os.cpu_count()}, {model}, Python {platform.python_version()}, "
        f"{platform.system()} {platform.release()} {platform.machine()}; {wrk_version}; "
        f"PostgreSQL {postgres.split()[0]} {store}; idemkit "
        f"{importlib.metadata.version('idemkit')}; load generator, servers and PostgreSQL "
        "share the machine"
    )


def describe(arguments: argparse.Namespace) -> str:
    return (
        f"POST {PATH} with a {len(BODY)}-byte JSON body; wrk + bench/load.lua, "
        f"{arguments.threads} thread(s) at most; {arguments.warmup} s warm-up + "
        f"{arguments.duration} s per run, {arguments.repeats} runs per configuration "
        f"(interleaved), median (min-max); bare and idemkit proxies on the "
        f"{arguments.bare_stack} stack; replay pool {arguments.pool} stored keys per proxy; "
        "CPU = proxy + demo upstream + PostgreSQL processes per answered request"
    )


# --- the JSON report -----------------------------------------------------------------------


def _number(value: float) -> float | None:
    return None if math.isnan(value) else round(value, 4)


def _figure(values: Sequence[float]) -> dict[str, float | None] | None:
    """median, min and max over a row's runs, as the tables show them; None: not measured."""
    values = [value for value in values if not math.isnan(value)]
    if not values:
        return None
    return {
        "median": _number(statistics.median(values)),
        "min": _number(min(values)),
        "max": _number(max(values)),
    }


def _bound_json(bound: float) -> float | str:
    return "+Inf" if math.isinf(bound) else bound


def _histogram_json(histogram: Histogram) -> dict[str, Any]:
    counted = histogram.count > 0
    return {
        "statements": round(histogram.count),
        "rows": round(histogram.total),
        "mean": _number(histogram.total / histogram.count) if counted else None,
        "p50_at_most": _bound_json(histogram.at_most(0.5)) if counted else None,
        "max_at_most": _bound_json(histogram.at_most(1.0)) if counted else None,
        "buckets": {
            "+Inf" if math.isinf(bound) else f"{bound:g}": value
            for bound, value in sorted(histogram.buckets.items())
        },
    }


def _batch_json(sizes: dict[str, Histogram] | None) -> dict[str, Any] | None:
    if sizes is None:
        return None
    return {operation: _histogram_json(sizes[operation]) for operation in _operations(sizes)}


def json_report(measured: Sequence[Results], bare_from: Results, **context: Any) -> dict[str, Any]:
    """One object: `context` (command, machine, ...) and a row per (configuration, connections)
    measured, with the figures of the tables; `ratio_to_bare` divides by the bare proxy of
    `bare_from` at the same connections."""
    rows = []
    for results in measured:
        for (configuration, connections), samples in results.samples.items():
            bare = bare_from.median(BARE, connections, _per_second)
            own = results.median(configuration, connections, _per_second)
            row: dict[str, Any] = {
                "configuration": configuration.label,
                "target": configuration.target,
                "retry_percent": configuration.retry_percent,
                "connections": connections,
                "runs": len(samples),
                "req_per_s": _figure([sample.per_second for sample in samples]),
                "p50_ms": _figure([sample.p50_ms for sample in samples]),
                "p99_ms": _figure([sample.p99_ms for sample in samples]),
                "cpu_ms_per_request": _figure([s.cpu_ms_per_request for s in samples]),
                "proxy_cpu_ms_per_request": _figure([s.proxy_ms_per_request for s in samples]),
                "postgres_cpu_ms_per_request": _figure(
                    [s.postgres_ms_per_request for s in samples]
                ),
                "ratio_to_bare": _number(own / bare) if bare else None,
                "errors": _errors(samples),
            }
            if configuration.target in ONCEGATE_TARGETS:
                row["claim_ms"] = _figure([sample.claim_ms for sample in samples])
                row["complete_ms"] = _figure([sample.complete_ms for sample in samples])
                row["batch_sizes"] = _batch_json(row_batch_sizes(samples))
            rows.append(row)
    return {**context, "rows": rows}


def write_json(report: dict[str, Any], destination: str) -> None:
    text = json.dumps(report, indent=2, ensure_ascii=False, allow_nan=False)
    if destination == "-":
        print(f"\n{text}")
    else:
        Path(destination).write_text(text + "\n")
        progress(f"JSON report written to {destination}")


# --- the command ---------------------------------------------------------------------------


def ensure_idemkit() -> None:
    try:
        installed = importlib.metadata.version("idemkit")
    except importlib.metadata.PackageNotFoundError:
        installed = None
    if installed != IDEMKIT_VERSION:
        progress(f"installing idemkit=={IDEMKIT_VERSION} into {sys.prefix}")
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", f"idemkit=={IDEMKIT_VERSION}"],
            check=True,
            timeout=300,
        )


def budget_seconds(arguments: argparse.Namespace) -> float:
    runs = 0
    if arguments.main:
        runs += len(main_plan(arguments))
    if "concurrency" in arguments.sweep:
        runs += len(SWEPT) * len(CONCURRENCY_SWEEP)
    if "keys" in arguments.sweep:
        runs += len(arguments.key_sizes)
    if "mix" in arguments.sweep:
        runs += len(MIXED)
    per_run = arguments.warmup + arguments.duration + 10  # wrk start, CPU and action counts
    fill = arguments.fill_budget + 300 if "keys" in arguments.sweep else 0
    leak = LEAK_BUDGET + 2 * LEAK_CHUNK if arguments.leak else 0
    return STARTUP_TIMEOUT * 2 + 3 * POOL_TIMEOUT + runs * arguments.repeats * per_run + fill + leak


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--duration", type=int, default=5, metavar="SECONDS", help="per run")
    parser.add_argument("--warmup", type=int, default=1, metavar="SECONDS", help="before each")
    parser.add_argument("--repeats", type=int, default=3, metavar="N")
    parser.add_argument("--connections", type=int, default=64, metavar="N")
    parser.add_argument("--threads", type=int, default=2, metavar="N", help="wrk threads")
    parser.add_argument("--pool", type=int, default=1000, metavar="N", help="stored keys")
    parser.add_argument(
        "--workers", type=int, default=1, metavar="N", help="processes per proxy (>1: all three)"
    )
    parser.add_argument(
        "--bare-stack",
        choices=["asgi", "fastapi"],
        default="asgi",
        help="the bare (and idemkit) proxy's application: plain ASGI like the gateway's proxy "
        "port, or a FastAPI route",
    )
    parser.add_argument(
        "--sweep",
        action="append",
        choices=["concurrency", "keys", "mix"],
        default=[],
        help="run this sweep instead of the main tables (repeatable)",
    )
    parser.add_argument("--all", action="store_true", help="the main tables and the sweeps")
    parser.add_argument(
        "--rows",
        type=lambda text: {name.strip() for name in text.split(",") if name.strip()},
        default=set(),
        metavar="NAME,...",
        help="measure only these rows of the main tables, named by their labels as slugs "
        "(bare-proxy, oncegate-replay, oncegate-mix-80-20, baseline-forward, ...); a row named "
        "is measured at every level it has (64 connections and 1)",
    )
    parser.add_argument(
        "--key-sizes",
        type=lambda text: [int(float(part)) for part in text.split(",")],
        default=list(KEY_SWEEP),
        metavar="N,N,...",
        help="pre-filled keys per step of the key sweep (default 1e4,1e6,1e7)",
    )
    parser.add_argument(
        "--fill-budget", type=float, default=900, metavar="SECONDS", help="for all key fills"
    )
    parser.add_argument(
        "--json",
        metavar="PATH",
        help="also write every row's figures and batch sizes as one JSON object to PATH "
        "(-: to stdout, after the tables)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory")
    parser.add_argument(
        "--baseline",
        type=lambda text: Path(text).resolve(),
        metavar="DIR",
        help="also measure the gateway of the checkout DIR (run with DIR/.venv/bin/python) "
        "beside this one: 'baseline' rows",
    )
    parser.add_argument(
        "--leak",
        type=lambda text: int(float(text)),
        default=0,
        metavar="N",
        help="after the main tables, drive the gateway to N requests (1e6) and compare its RSS "
        f"with its RSS after {LEAK_FIRST:,} (default: not run; --all runs 1e6)",
    )
    parser.add_argument(
        "--profile",
        type=Path,
        metavar="DIR",
        help="sample every proxy with py-spy during its measured runs, keep the raw stacks in "
        "DIR, and print where each proxy's CPU went per request (bench/profiling.py)",
    )
    arguments = parser.parse_args()
    unknown = sorted(arguments.rows - NAMED_ROWS.keys())
    if unknown:
        parser.error(f"--rows: no row {', '.join(unknown)}; rows: {', '.join(NAMED_ROWS)}")
    if arguments.baseline is None and arguments.rows & {row.slug for row in BASELINE}:
        parser.error("--rows: the baseline rows are measured with --baseline DIR")
    for name in ("duration", "repeats", "connections", "threads", "pool", "workers"):
        if getattr(arguments, name) < 1:
            parser.error(f"--{name} must be at least 1")
    arguments.warmup = max(arguments.warmup, 0)
    if arguments.all:
        arguments.sweep = ["concurrency", "keys", "mix"]
        arguments.leak = arguments.leak or 10**6
    arguments.main = arguments.all or not arguments.sweep
    arguments.run = uuid.uuid4().hex[:10]  # keys unique across runs, for a persistent database
    return arguments


def main() -> int:
    arguments = parse_arguments()
    if shutil.which("wrk") is None:
        print("bench/run.py needs wrk: apt-get install -y wrk", file=sys.stderr)
        return 2
    if arguments.profile is not None:
        if not profiling.available():
            print("--profile needs py-spy: pip install -e '.[bench]'", file=sys.stderr)
            return 2
        arguments.profile.mkdir(parents=True, exist_ok=True)
    ensure_idemkit()
    budget = budget_seconds(arguments)

    def out_of_time(signum: int, frame: object) -> None:
        raise TimeoutError(f"the benchmark ran out of its {budget:.0f}s budget")

    signal.signal(signal.SIGALRM, out_of_time)
    signal.alarm(math.ceil(budget))
    started = time.monotonic()
    work = quick.work_directory("oncegate-bench-")
    keep = True  # the server logs explain a failure
    command = quick.command_line()
    try:
        with servers(work, arguments) as running:
            results, key_results = Results(), Results()
            machine = machine_line(running)
            print(machine)
            print(describe(arguments))
            target_lines: list[str] = []
            if arguments.main:
                main_rows = MAIN if arguments.baseline is None else MAIN + BASELINE
                latency_rows = LATENCY
                if arguments.workers > 1:  # no in-memory gateway (`servers`)
                    main_rows = tuple(row for row in main_rows if row is not IN_MEMORY)
                    latency_rows = tuple(row for row in LATENCY if row is not IN_MEMORY)
                run_plan(running, main_plan(arguments), arguments, results)
                print(f"\n$ {command}\n")
                print(f"{arguments.connections} connections:\n")
                print(main_table(results, arguments.connections, main_rows))
                print_batch_lines(results, main_rows, [arguments.connections])
                print(wait_line(results, arguments.connections))
                print_if(split_line(results, arguments.connections))
                two = workers_table(results, arguments.connections)
                if two is not None:
                    print(f"\ntwo workers per proxy, {arguments.connections} connections:\n")
                    print(two)
                    print_batch_lines(results, TWO_WORKERS, [arguments.connections])
                print("\n1 connection (the latency target):\n")
                print(latency_table(results))
                print_batch_lines(results, latency_rows, [1])
                print_if(split_line(results, 1))
                if arguments.profile is not None:
                    profiles = [
                        (
                            arguments.connections,
                            (BARE, IN_MEMORY, FORWARD, REPLAY, MIX, IDEMKIT_FORWARD),
                        ),
                        (1, (*LATENCY, BASE_FORWARD)),
                    ]
                    if arguments.baseline is not None:  # else a table of the bare proxy alone
                        profiles.insert(1, (arguments.connections, (BARE, *BASELINE)))
                    for level, profiled in profiles:
                        text = profile_table(results, level, profiled)
                        if text is not None:
                            print(f"\nwhere the proxy's CPU went, {level} connections (py-spy):\n")
                            print(text)
                print("\ntargets (printed, not asserted):")
                target_lines = targets(results, arguments.connections)
                if arguments.leak:
                    memory, verdict = leak_check(running, arguments)
                    print(memory)
                    target_lines.append(verdict)
                for text in target_lines:
                    print(text)
            if "concurrency" in arguments.sweep:
                plan = [
                    (configuration, level) for level in CONCURRENCY_SWEEP for configuration in SWEPT
                ]
                run_plan(running, plan, arguments, results)
                print(f"\n$ {command}\n")
                print("concurrency sweep:\n")
                print(concurrency_table(results, CONCURRENCY_SWEEP))
                print_batch_lines(results, SWEPT, CONCURRENCY_SWEEP)
            if "mix" in arguments.sweep:
                mixed = list(MIXED.values())
                run_plan(running, [(each, arguments.connections) for each in mixed], arguments,
                         results)  # fmt: skip
                print(f"\n$ {command}\n")
                print(f"mix sweep, proxy CPU per request at {arguments.connections} connections:\n")
                print(mix_table(results, arguments.connections))
                print_batch_lines(results, mixed, [arguments.connections])
            if "keys" in arguments.sweep:
                print(f"\n$ {command}\n")
                if running.embedded:
                    steps = key_sweep(running, arguments, key_results)
                    print(
                        f"key-count sweep, oncegate forward path at {arguments.connections} "
                        "connections, table emptied then pre-filled with completed keys of the "
                        "same scope:\n"
                    )
                    print(key_table(key_results, steps, arguments.connections))
                    swept = [configuration for configuration, _ in key_results.samples]
                    print_batch_lines(key_results, swept, [arguments.connections])
                else:
                    print(
                        "key-count sweep skipped: it empties oncegate_keys, so it runs only on "
                        "the embedded PostgreSQL (unset ONCEGATE_DATABASE_URL)"
                    )
            warnings = results.warnings + key_results.warnings
            for measured in (results, key_results):
                if measured.samples:
                    print(f"\n{foreign_line(measured)}")
            if warnings:
                print("\nwarnings:")
                for warning in warnings:
                    print(f"- {warning}")
            print(f"\ntotal time {time.monotonic() - started:.0f} s")
            if arguments.json:
                report = json_report(
                    [results, key_results],
                    results,
                    command=command,
                    machine=machine,
                    description=describe(arguments),
                    targets=target_lines,
                    warnings=warnings,
                )
                write_json(report, arguments.json)
        signal.alarm(0)
        keep = arguments.keep
        return 1 if warnings else 0
    except (RuntimeError, TimeoutError, subprocess.TimeoutExpired) as exc:
        print(f"benchmark failed: {exc}", file=sys.stderr)
        return 1
    finally:
        signal.alarm(0)
        if keep:
            print(f"temporary directory kept: {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
