"""The chaos soak: clients, three gateways, one PostgreSQL and a recording upstream, all real
processes on loopback, with faults injected at random for a bounded time.

Design rules:
- Everything runs on 127.0.0.1 (PostgreSQL on a Unix socket), started here, and ended here by its
  PID: the gateways, the upstream, the fuzzer, PostgreSQL (through its data directory).
- Every random choice comes from generators seeded by `--seed`, so a run's mix of keys, faults and
  kills can be run again; the interleaving is the machine's.
- The chaos has a deadline; after it the driver heals everything (PostgreSQL up, every gateway
  up), lets every lease run out, reads the key table, probes a sample of keys once more, stops the
  processes, and only then hands the four histories to the checker.
- No figure is a pass condition except the checker's violations: volume is reported.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg
import yaml

from oncegate import keys, schema
from tests.faults import replication
from tests.helpers import free_port
from tests.soak import checker, history
from tests.soak.history import ATTEMPT_HEADER, Attempt, Event, Performed, Row
from tests.soak.postgres import Postgres, ReplicatedPostgres

ROUTES = {"mail": "reject", "charge": "reject", "ticket": "forward"}  # name: on_unknown
FORWARD_ROUTES = frozenset(name for name, policy in ROUTES.items() if policy == "forward")
ROUTE_WEIGHTS = {"mail": 4, "charge": 3, "ticket": 3}
TENANTS = ("", "Bearer alpha", "Bearer beta")
# The route timeout is short so that `slow` answers and dead gateways' leases (2 x timeout) turn
# keys `unknown` within the run, not after it.
ROUTE_TIMEOUT = 1.0
LEASE = 2 * ROUTE_TIMEOUT
SLOW_ANSWER = ROUTE_TIMEOUT + 0.5
# A client waits this long for an answer: far beyond anything the gateway may take (its store
# timeouts are 10 s), so a "timeout" in a history is worth a look.
CLIENT_PATIENCE = 30.0
STARTUP_PATIENCE = 60.0
# How a gateway is hit: mostly killed, sometimes stopped cleanly, sometimes frozen.
SIGNALS = {signal.SIGKILL: 0.75, signal.SIGTERM: 0.15, signal.SIGSTOP: 0.10}
PAUSE = LEASE + 1.0  # a frozen gateway wakes after its leases ran out
STARTS = 10  # attempts to start a gateway before the soak gives up on the machine
SETTLE_READS = 5
GATEWAYS = 3


@dataclass
class Options:
    seconds: float
    seed: int
    out: Path
    clients: int = 24
    fuzz_requests: int = 1000
    # Mean seconds between two gateway signals, and how many PostgreSQL outages.
    kill_interval: float = 4.0
    postgres_outages: int = 6
    probes: int = 2000
    fault_rate: float = 0.1
    # One PostgreSQL outage is a failover to a synchronous standby, when one can be started here
    # (Debian's postgresql-15, tests/faults/replication.py); None: whenever it can.
    failover: bool | None = None


@dataclass
class Summary:
    result: checker.Result
    figures: dict[str, Any]
    fuzz_violations: list[str]
    table: str

    @property
    def ok(self) -> bool:
        return self.result.ok and not self.fuzz_violations


def route_config(upstream: str) -> list[dict[str, Any]]:
    return [
        {"name": name, "match": f"/{name}", "upstream": upstream, "timeout": f"{ROUTE_TIMEOUT}s",
         "on_unknown": on_unknown}
        for name, on_unknown in ROUTES.items()
    ]  # fmt: skip


class Child:
    """A process of ours, logging to a file, ended by its PID."""

    def __init__(self, args: Sequence[str], log: Path, env: dict[str, str] | None = None) -> None:
        self._log = log.open("ab")
        self.popen = subprocess.Popen(
            list(args),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )

    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal(self, number: int) -> None:
        if self.alive():
            os.kill(self.popen.pid, number)

    async def wait(self, timeout: float) -> bool:  # noqa: ASYNC109 - a polling deadline
        """True once it exited, False if it still runs after `timeout` seconds."""
        try:
            await asyncio.to_thread(self.popen.wait, timeout)
        except subprocess.TimeoutExpired:
            return False
        return True

    def end(self) -> None:
        if self.alive():
            self.signal(signal.SIGTERM)
            self.signal(signal.SIGCONT)  # a frozen process acts on its SIGTERM only once woken
            try:
                self.popen.wait(20)
            except subprocess.TimeoutExpired:
                self.signal(signal.SIGKILL)
                self.popen.wait(10)
        self._log.close()


async def listening(port: int) -> bool:
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return False
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return True


class GatewayProcess:
    """One gateway at fixed ports, killed and started again many times."""

    def __init__(self, name: str, directory: Path, database_url: str, upstream: str) -> None:
        self.name = name
        self.port, self.admin_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.config = directory / f"{name}.yaml"
        self.config.write_text(yaml.safe_dump({"routes": route_config(upstream)}))
        self.log = directory / f"{name}.log"
        self.database_url = database_url
        self.child: Child | None = None
        self.up = False

    def start(self) -> None:
        self.child = Child(
            [sys.executable, "-m", "oncegate.cli", "serve", "--config", str(self.config),
             "--port", str(self.port), "--admin-port", str(self.admin_port),
             "--log-level", "warning"],
            self.log, env={"ONCEGATE_DATABASE_URL": self.database_url},
        )  # fmt: skip

    async def keep_up(self, events: list[Event]) -> None:
        """Start it, and again, until it listens (it cannot start while PostgreSQL is down)."""
        for _ in range(STARTS):
            self.start()
            assert self.child is not None
            deadline = time.monotonic() + STARTUP_PATIENCE
            while self.child.alive() and time.monotonic() < deadline:
                if await listening(self.port) and await listening(self.admin_port):
                    self.up = True
                    events.append(Event(time.time(), "gateway-start", self.name))
                    return
                await asyncio.sleep(0.1)
            self.child.end()
            await asyncio.sleep(0.5)
        raise RuntimeError(f"{self.name} did not start {STARTS} times; see {self.log}")

    async def hit(self, number: int, events: list[Event]) -> None:
        """Send `number` (SIGKILL or SIGTERM), wait for the exit, start it again; or SIGSTOP,
        and SIGCONT once its leases have run out."""
        assert self.child is not None
        self.up = False
        what = {signal.SIGKILL: "gateway-kill", signal.SIGTERM: "gateway-term"}
        events.append(Event(time.time(), what.get(number, "gateway-pause"), self.name))
        self.child.signal(number)
        if number == signal.SIGSTOP:
            # A gateway frozen (a long GC pause, a stopped VM) while others take its keys over;
            # when it wakes, its fencing token must no longer settle anything.
            await asyncio.sleep(PAUSE)
            self.child.signal(signal.SIGCONT)
            events.append(Event(time.time(), "gateway-resume", self.name))
            self.up = True
            return
        await self.child.wait(30)
        self.child.end()
        await self.keep_up(events)

    def end(self) -> None:
        self.up = False
        if self.child is not None:
            self.child.end()


@dataclass
class Operation:
    """What a client means to do once, and retries: one key, in one scope, with one body."""

    route: str
    tenant: str
    key: str
    number: int

    def body(self, variant: int = 0) -> str:
        """The operation's body; another `variant` is another request reusing its key."""
        return json.dumps({"to": f"user{self.number}@example.com", "n": self.number, "v": variant})


@dataclass
class Traffic:
    """The shared state of the clients: the keys in play and every attempt."""

    seed: int
    recent: collections.deque[Operation] = field(
        default_factory=lambda: collections.deque(maxlen=400)
    )
    every: list[Operation] = field(default_factory=list)
    attempts: list[Attempt] = field(default_factory=list)
    numbers: int = 0

    def new_key(self, dice: random.Random) -> Operation:
        self.numbers += 1
        route = dice.choices(list(ROUTE_WEIGHTS), list(ROUTE_WEIGHTS.values()))[0]
        tenant = dice.choice(TENANTS)
        # One new key in five reuses a key string in play under another route or tenant: the same
        # key in another scope, which must never see this one's answers.
        if self.recent and dice.random() < 0.2:
            key = dice.choice(self.recent).key
        else:
            key = f"soak-{self.seed}-{self.numbers}-{dice.getrandbits(32):08x}"
        operation = Operation(route, tenant, key, self.numbers)
        if any(
            (other.route, other.tenant, other.key) == (route, tenant, key) for other in self.recent
        ):
            return dice.choice(self.recent)
        self.recent.append(operation)
        self.every.append(operation)
        return operation


async def send(
    session: aiohttp.ClientSession,
    gateway: GatewayProcess,
    operation: Operation,
    attempt_id: str,
    body: str,
    hang_up_after: float | None = None,
    phase: str = "chaos",
) -> Attempt:
    headers = {
        "Idempotency-Key": operation.key,
        "Content-Type": "application/json",
        ATTEMPT_HEADER: attempt_id,
    }
    if operation.tenant:
        headers["Authorization"] = operation.tenant
    sent = time.time()
    outcome, status, content_type, replayed, answer = "no-answer", None, None, False, None
    try:
        async with asyncio.timeout(hang_up_after or CLIENT_PATIENCE):
            async with session.post(
                f"{gateway.url}/{operation.route}/emails", data=body.encode(), headers=headers
            ) as response:
                answer = await response.text(errors="replace")
                status = response.status
                content_type = response.headers.get("Content-Type")
                replayed = response.headers.get("Idempotent-Replayed") == "true"
                outcome = "answer"
    except TimeoutError:
        outcome = "hung-up" if hang_up_after else "timeout"
    except (aiohttp.ClientError, OSError):
        outcome = "no-answer"
    return Attempt(
        attempt=attempt_id, route=operation.route, tenant=operation.tenant, key=operation.key,
        body=body, sent=sent, ended=time.time(), outcome=outcome, status=status,
        content_type=content_type, replayed=replayed, answer=answer, gateway=gateway.name,
        phase=phase,
    )  # fmt: skip


async def client(
    number: int,
    traffic: Traffic,
    gateways: list[GatewayProcess],
    until: float,
) -> None:
    dice = random.Random(traffic.seed * 1000 + number)
    keep_alive = number % 2 == 0
    # Idle connections are dropped well before the gateway's own 5 s keep-alive timeout, so a
    # client does not reuse one the gateway is closing at that very moment.
    connector = (
        aiohttp.TCPConnector(limit=8, keepalive_timeout=1.0)
        if keep_alive
        else aiohttp.TCPConnector(limit=8, force_close=True)
    )
    serial = 0
    async with aiohttp.ClientSession(connector=connector) as session:
        while time.monotonic() < until:
            up = [gateway for gateway in gateways if gateway.up] or gateways
            draw = dice.random()
            if draw < 0.3 or not traffic.recent:
                operation, variant, copies = traffic.new_key(dice), 0, 1
            elif draw < 0.8:
                operation, variant, copies = dice.choice(traffic.recent), 0, 1
            elif draw < 0.85:
                operation = dice.choice(traffic.recent)
                variant, copies = dice.randint(1, 3), 1  # a reused key
            else:
                pool = traffic.recent if dice.random() < 0.5 else [traffic.new_key(dice)]
                operation, variant, copies = dice.choice(pool), 0, dice.randint(2, 4)
            sends = []
            for _ in range(copies):
                serial += 1
                hang_up = dice.uniform(0.001, 0.3) if dice.random() < 0.03 else None
                sends.append(
                    send(session, dice.choice(up), operation, f"c{number}-{serial}",
                         operation.body(variant), hang_up)
                )  # fmt: skip
            done = await asyncio.gather(*sends)
            traffic.attempts.extend(done)
            if any(attempt.outcome != "answer" for attempt in done):
                await asyncio.sleep(0.02)  # not a tight loop against a gateway that is down


async def gateway_chaos(
    gateways: list[GatewayProcess],
    dice: random.Random,
    until: float,
    interval: float,
    events: list[Event],
    restarts: set[asyncio.Task[None]],
) -> None:
    while True:
        await asyncio.sleep(dice.uniform(0.5, 1.5) * interval)
        if time.monotonic() >= until:
            return
        up = [gateway for gateway in gateways if gateway.up]
        if len(up) < 2:
            continue  # keep one serving: the clients' traffic is what makes kills interesting
        number = dice.choices(list(SIGNALS), list(SIGNALS.values()))[0]
        task = asyncio.create_task(dice.choice(up).hit(number, events))
        restarts.add(task)
        task.add_done_callback(restarts.discard)


def postgres_plan(
    dice: random.Random, seconds: float, outages: int, failover: bool = False
) -> list[tuple[float, str, float]]:
    """When (seconds into the chaos), how and for how long PostgreSQL goes down. One outage is
    always a `kill -9`, and with a standby one more is a failover; the others are drawn."""
    if outages <= 0:
        return []
    kinds = ["kill"] + [dice.choice(["fast", "immediate", "kill"]) for _ in range(outages - 1)]
    if failover:
        kinds.append("failover")
    slot = seconds / (len(kinds) + 1)
    dice.shuffle(kinds)
    return [
        (slot * (index + 1) + dice.uniform(-0.2, 0.2) * slot, kind, dice.uniform(1.0, 3.0))
        for index, kind in enumerate(kinds)
    ]


async def postgres_chaos(
    postgres: Postgres | ReplicatedPostgres,
    plan: list[tuple[float, str, float]],
    start: float,
    events: list[Event],
) -> None:
    for at, kind, down in plan:
        await asyncio.sleep(max(0.0, start + at - time.monotonic()))
        events.append(Event(time.time(), f"postgres-{kind}"))
        if kind == "failover":
            assert isinstance(postgres, ReplicatedPostgres)
            await asyncio.to_thread(postgres.fail_over)
            await asyncio.sleep(down)
            await asyncio.to_thread(postgres.promote)
            events.append(Event(time.time(), "postgres-promoted"))
            continue
        if kind == "kill":
            await asyncio.to_thread(postgres.kill)
        else:
            await asyncio.to_thread(postgres.stop, kind)
        await asyncio.sleep(down)
        await asyncio.to_thread(postgres.start)
        events.append(Event(time.time(), "postgres-start"))


async def dump_rows(url: str) -> list[Row]:
    """The key table with each row's effective state, scopes named back as (route, tenant)."""
    scopes = {
        keys.scope(route, [[tenant] if tenant else []]): (route, tenant)
        for route in ROUTES
        for tenant in TENANTS
    }
    connection = await asyncpg.connect(url)
    try:
        records = await connection.fetch(
            "SELECT scope, key, response_status, response_body, response_stored,"
            " CASE WHEN state = 'in_progress' AND lease_expires_at <= now() THEN 'unknown'"
            "      ELSE state END AS state"
            " FROM oncegate_keys"
        )
    finally:
        await connection.close()
    rows = []
    for record in records:
        route, tenant = scopes.get(bytes(record["scope"]), ("?", "?"))
        body = record["response_body"]
        rows.append(
            Row(route=route, tenant=tenant, key=record["key"], state=record["state"],
                status=record["response_status"],
                answer=bytes(body).decode("utf-8", "replace") if body is not None else None,
                stored=record["response_stored"])
        )  # fmt: skip
    return rows


async def settled_rows(url: str) -> tuple[float, list[Row]]:
    """The key table once every lease has run out, and when it was read.

    No client sends anything any more, but a request whose client hung up can still be on its
    way to a claim in a gateway (a claim may wait for the store up to its timeouts); such a late
    claim holds its row for one lease. So a table with a row in flight is read again after a
    lease, a few times: a row that stays `in_progress` through all of them is held for good."""
    await asyncio.sleep(LEASE + 3)
    for _ in range(SETTLE_READS):
        read_at = time.time()
        rows = await dump_rows(url)
        if all(row.state != "in_progress" for row in rows):
            break
        await asyncio.sleep(LEASE + 1)
    return read_at, rows


async def probe(
    traffic: Traffic, gateways: list[GatewayProcess], dice: random.Random, count: int
) -> list[Attempt]:
    """Each of `count` keys once more, through a healthy gateway, after everything settled."""
    chosen = dice.sample(traffic.every, min(count, len(traffic.every)))
    limit = asyncio.Semaphore(16)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=16)) as session:

        async def one(index: int, operation: Operation) -> Attempt:
            async with limit:
                return await send(
                    session, gateways[index % len(gateways)], operation, f"probe-{index}",
                    operation.body(), phase="probe",
                )  # fmt: skip

        return list(
            await asyncio.gather(*(one(index, operation) for index, operation in enumerate(chosen)))
        )


async def create_database(postgres: Postgres, name: str) -> str:
    connection = await asyncpg.connect(postgres.url())
    try:
        await connection.execute(f"CREATE DATABASE {name}")
    finally:
        await connection.close()
    url = postgres.url(name)
    await asyncio.to_thread(schema.upgrade, url)
    return url


async def run(options: Options) -> Summary:
    out = options.out
    out.mkdir(parents=True, exist_ok=True)
    dice = random.Random(options.seed)
    events: list[Event] = []
    # Not under `out`, which may be pytest's temporary tree: pytest makes its directories
    # private as it goes, and PostgreSQL runs as pgserver's own user when we are root.
    postgres_directory = Path(tempfile.mkdtemp(prefix="oncegate-soak-pg-"))
    failover = options.failover
    if failover is None:
        failover = replication.unavailable() is None
    postgres: Postgres | ReplicatedPostgres
    if failover:
        postgres = await asyncio.to_thread(ReplicatedPostgres)
    else:
        postgres = await asyncio.to_thread(Postgres, postgres_directory / "data")
    children: list[Child] = []
    gateways: list[GatewayProcess] = []
    fuzz_gateway: GatewayProcess | None = None
    chaos: list[asyncio.Task[None]] = []
    restarts: set[asyncio.Task[None]] = set()
    try:
        database = await create_database(postgres, "soak")
        fuzz_database = await create_database(postgres, "fuzz")
        upstream_port = free_port()
        upstream_log = out / "upstream.jsonl"
        upstream_log.unlink(missing_ok=True)
        upstream = Child(
            [sys.executable, "-m", "tests.soak.upstream", "--port", str(upstream_port),
             "--log", str(upstream_log), "--seed", str(options.seed),
             "--routes", ",".join(ROUTES), "--fault-rate", str(options.fault_rate),
             "--slow", str(SLOW_ANSWER)],
            out / "upstream.log",
        )  # fmt: skip
        children.append(upstream)
        upstream_url = f"http://127.0.0.1:{upstream_port}"
        gateways = [
            GatewayProcess(f"gateway-{index + 1}", out, database, upstream_url)
            for index in range(GATEWAYS)
        ]
        fuzz_gateway = GatewayProcess("gateway-fuzz", out, fuzz_database, upstream_url)
        fuzz_gateway.config.write_text(yaml.safe_dump({"routes": fuzz_routes(upstream_url)}))
        await asyncio.gather(*(gateway.keep_up(events) for gateway in [*gateways, fuzz_gateway]))
        fuzz_results = out / "fuzz.jsonl"
        fuzzer = Child(
            [sys.executable, "-m", "tests.soak.fuzz", "--port", str(fuzz_gateway.port),
             "--requests", str(options.fuzz_requests), "--seed", str(options.seed),
             "--out", str(fuzz_results)],
            out / "fuzz.log",
        )  # fmt: skip
        children.append(fuzzer)

        traffic = Traffic(options.seed)
        start = time.monotonic()
        until = start + options.seconds
        chaos = [
            asyncio.create_task(
                gateway_chaos(gateways, random.Random(dice.random()), until,
                              options.kill_interval, events, restarts)
            ),
            asyncio.create_task(
                postgres_chaos(postgres, postgres_plan(random.Random(dice.random()),
                               options.seconds, options.postgres_outages, failover), start, events)
            ),
        ]  # fmt: skip
        await asyncio.gather(
            *(client(number, traffic, gateways, until) for number in range(options.clients))
        )
        await asyncio.gather(*chaos)
        # Heal: PostgreSQL up (the plan ends with a start), every gateway started again.
        while restarts:
            await asyncio.gather(*list(restarts))
        read_at, rows = await settled_rows(database)
        events.append(Event(read_at, checker.ROWS_READ))
        probes = await probe(traffic, gateways, random.Random(dice.random()), options.probes)
        traffic.attempts.extend(probes)
        # The fuzzer is bounded by its request count; it has had the whole chaos to get there.
        if not await fuzzer.wait(600):
            fuzzer.signal(signal.SIGKILL)
        fuzz_violations = await check_fuzz(fuzz_results, fuzz_database, options.fuzz_requests)
    finally:
        # A run that failed half-way leaves no fault injector behind to hit what comes next.
        for task in [*chaos, *restarts]:
            task.cancel()
        for gateway in gateways:
            gateway.end()
        if fuzz_gateway is not None:
            fuzz_gateway.end()
        for child in children:
            child.end()
        await asyncio.to_thread(postgres.close)
        shutil.rmtree(postgres_directory, ignore_errors=True)

    performed = history.read(upstream_log, Performed)
    history.write(out / "attempts.jsonl", traffic.attempts)
    history.write(out / "keys.jsonl", rows)
    history.write(out / "events.jsonl", events)
    result = checker.check(
        traffic.attempts, performed, rows, events,
        forward_routes=FORWARD_ROUTES,
    )  # fmt: skip
    figures = tally(traffic, performed, rows, events, result, fuzz_results, options)
    table = render(figures)
    (out / "summary.json").write_text(json.dumps(figures, indent=2))
    with (out / "violations.txt").open("w") as file:
        for violation in result.violations:
            file.write(violation.report() + "\n")
        for line in fuzz_violations:
            file.write(f"[fuzz] {line}\n")
    return Summary(result, figures, fuzz_violations, table)


def fuzz_routes(upstream: str) -> list[dict[str, Any]]:
    def route(name: str, **options: Any) -> dict[str, Any]:
        return {"name": name, "match": f"/{name}", "upstream": upstream, **options}

    return [route("strict"), route("optional", key="optional"), route("small", max_body="1KiB")]


async def check_fuzz(results: Path, database: str, requested: int) -> list[str]:
    """The fuzzer's verdicts, checked against the fuzzing gateway's key table."""
    lines = results.read_text().splitlines() if results.exists() else []  # noqa: ASYNC240 - one file, once
    connection = await asyncpg.connect(database)
    try:
        stored = [row["key"] for row in await connection.fetch("SELECT key FROM oncegate_keys")]
    finally:
        await connection.close()
    return checker.check_fuzz([json.loads(line) for line in lines], stored, requested)


def tally(
    traffic: Traffic,
    performed: list[Performed],
    rows: list[Row],
    events: list[Event],
    result: checker.Result,
    fuzz_results: Path,
    options: Options,
) -> dict[str, Any]:
    chaos = [attempt for attempt in traffic.attempts if attempt.phase == "chaos"]
    outcomes = collections.Counter(attempt.outcome for attempt in chaos)
    problems = collections.Counter(
        checker.problem_name(attempt) or "?" for attempt in chaos
        if attempt.content_type == checker.PROBLEM
    )  # fmt: skip
    happened = collections.Counter(event.what for event in events)
    soak_records = [record for record in performed if record.route in ROUTES]
    faults = collections.Counter(record.fault for record in soak_records)
    fuzzed = len(fuzz_results.read_text().splitlines()) if fuzz_results.exists() else 0
    unknown = {checker.identity(row) for row in rows if row.state == "unknown"}
    # Keys whose client got the upstream's stored answer, and that still ended `unknown`: the
    # answer was lost with PostgreSQL (or could not be written while it was down).
    seen_then_unknown = {
        checker.identity(attempt) for attempt in chaos
        if attempt.outcome == "answer" and not attempt.replayed
        and attempt.content_type != checker.PROBLEM
        and attempt.status not in checker.RELEASE_STATUSES
    } & unknown  # fmt: skip
    return {
        "seed": options.seed,
        "seconds": options.seconds,
        "clients": options.clients,
        "requests": len(chaos),
        "answered": outcomes["answer"],
        "no_answer": outcomes["no-answer"] + outcomes["timeout"],
        "timeouts": outcomes["timeout"],
        "hung_up": outcomes["hung-up"],
        "replayed": sum(1 for attempt in chaos if attempt.replayed),
        "problems": dict(problems.most_common()),
        "keys": len({checker.identity(attempt) for attempt in chaos}),
        "probes": len(traffic.attempts) - len(chaos),
        "gateway_kills": happened["gateway-kill"],
        "gateway_terms": happened["gateway-term"],
        "gateway_pauses": happened["gateway-pause"],
        "postgres_restarts": happened["postgres-start"],
        "postgres_outages": {
            kind: happened[f"postgres-{kind}"] for kind in ("fast", "immediate", "kill", "failover")
        },
        "upstream_requests": len(soak_records),
        "upstream_performed": sum(1 for record in soak_records if record.performed),
        "upstream_faults": {fault: faults[fault] for fault in sorted(faults) if fault != "answer"},
        "fuzzed_requests": fuzzed,
        "rows": len(rows),
        "unknown": len(unknown),
        "answered_then_unknown": len(seen_then_unknown),
        "duplicates": result.count("duplicate") + result.count("sent-twice"),
        "lost": result.count("lost"),
        "cross_scope": result.count("cross-scope"),
        "unexpected_5xx": result.unexpected_5xx,
        "violations": {rule: result.count(rule) for rule in checker.RULES},
    }


def render(figures: dict[str, Any]) -> str:
    faults = figures["upstream_faults"]
    outages = figures["postgres_outages"]
    rows = [
        ("chaos", f"{figures['seconds']:g} s, {figures['clients']} clients, "
         f"seed {figures['seed']}"),
        ("requests (clients)", f"{figures['requests']:,} ({figures['answered']:,} answered, "
         f"{figures['no_answer']:,} no answer, {figures['hung_up']:,} hung up on purpose)"),
        ("replays served", f"{figures['replayed']:,}"),
        ("keys", f"{figures['keys']:,}"),
        ("gateway kills", f"{figures['gateway_kills']} SIGKILL, {figures['gateway_terms']} "
         f"SIGTERM, {figures['gateway_pauses']} SIGSTOP for {PAUSE:g} s"),
        ("PostgreSQL restarts", f"{figures['postgres_restarts']} (stop fast {outages['fast']}, "
         f"stop immediate {outages['immediate']}, kill -9 {outages['kill']}; failovers to "
         f"a synchronous standby {outages['failover']})"),
        ("upstream requests", f"{figures['upstream_requests']:,} "
         f"({figures['upstream_performed']:,} performed)"),
        ("upstream faults", ", ".join(f"{name} {count:,}" for name, count in faults.items())
         or "0"),
        ("keys at the end", f"{figures['rows']:,} rows, {figures['unknown']:,} unknown (of "
         f"which {figures['answered_then_unknown']:,} after a client had its answer)"),
        ("probes after the chaos", f"{figures['probes']:,}"),
        ("fuzzed requests", f"{figures['fuzzed_requests']:,}"),
        ("duplicates", str(figures["duplicates"])),
        ("lost", str(figures["lost"])),
        ("cross-scope", str(figures["cross_scope"])),
        ("5xx outside the contract", str(figures["unexpected_5xx"])),
        ("all violations", ", ".join(f"{rule} {count}" for rule, count in
                                     figures["violations"].items())),
    ]  # fmt: skip
    width = max(len(name) for name, _ in rows)
    lines = [f"| {'figure':<{width}} | value |", f"|{'-' * (width + 2)}|-------|"]
    lines += [f"| {name:<{width}} | {value} |" for name, value in rows]
    return "\n".join(lines)
