"""The chaos soak: clients, gateways, their stores and a recording upstream, all real processes on
loopback, with faults injected at random for a bounded time.

Design rules:
- Each scenario (`scenarios.py`: one PostgreSQL, a primary with its synchronous standby failed
  over again and again, a Citus cluster losing workers and moving a shard) is a deployment of its
  own: its store, its database, three gateways on it. The clients spread their keys over the
  deployments, and every request names its scenario in the history.
- The first gateway of each deployment is never signalled: its one process lives through every
  store failure and reconnect of the run, so its memory and file descriptors at the start and
  the end (`usage.py`) say whether a long-lived gateway leaks; the other two are killed, stopped
  and frozen at random, and started again.
- Everything runs on 127.0.0.1, started here, and ended here by its PID: the gateways, the
  upstream, the fuzzer, the PostgreSQL servers (through their data directories).
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
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg
import yaml

from oncegate.kernel import keys
from tests.helpers import free_port
from tests.soak import checker, history, scenarios, usage
from tests.soak.history import ATTEMPT_HEADER, Attempt, Event, Performed, Row
from tests.soak.scenarios import Scenario, Sizes

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
GATEWAYS = 3  # per deployment; the first is never signalled
USAGE_EVERY = 15.0  # seconds between two readings of every gateway's memory and descriptors
PROGRESS_EVERY = 300.0  # seconds between two lines of progress on the soak's output


@dataclass
class Options:
    seconds: float
    seed: int
    out: Path
    clients: int = 24
    fuzz_requests: int = 1000
    # Mean seconds between two gateway signals (over every deployment's gateways), and how many
    # store faults of each kind.
    kill_interval: float = 4.0
    sizes: Sizes = field(default_factory=Sizes)
    probes: int = 2000
    fault_rate: float = 0.1
    # The scenarios to run (scenarios.SCENARIOS); None: every one that can run here.
    scenarios: list[str] | None = None
    # A volume run ends its chaos once the clients sent this many requests, if that comes
    # before `seconds` are over (None: `seconds` alone).
    requests: int | None = None


@dataclass
class Deadline:
    """When the chaos ends: `until` (monotonic), or as soon as the clients sent `requests`
    requests. The request cap ends the fault injectors too: whatever of their plans has not
    come due by then is left out (the faults per minute stay what the plans made them)."""

    until: float
    requests: int | None = None
    capped: asyncio.Event = field(default_factory=asyncio.Event)

    def over(self, sent: int) -> bool:
        if self.requests is not None and sent >= self.requests:
            self.capped.set()
        return self.capped.is_set() or time.monotonic() >= self.until

    async def pause(self, seconds: float) -> bool:
        """Sleep `seconds`, less if the request cap is reached meanwhile; False once it is."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.capped.wait(), timeout=seconds)
        return not self.capped.is_set()


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
    """A process of ours, logging to a file, ended by its PID; reaped by `wait4`, so the CPU it
    used goes into `ledger` under `kind`."""

    def __init__(
        self,
        args: Sequence[str],
        log: Path,
        env: dict[str, str] | None = None,
        *,
        kind: str,
        ledger: usage.Ledger,
    ) -> None:
        self._log = log.open("ab")
        self.kind = kind
        self.ledger = ledger
        self.popen = subprocess.Popen(
            list(args),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )

    def alive(self) -> bool:
        """False once it exited (reaped here, its CPU counted)."""
        if self.popen.returncode is not None:
            return False
        try:
            pid, status, rusage = os.wait4(self.popen.pid, os.WNOHANG)
        except ChildProcessError:  # reaped elsewhere: its CPU is in RUSAGE_CHILDREN all the same
            self.popen.returncode = -1
            return False
        if pid == 0:
            return True
        self.popen.returncode = os.waitstatus_to_exitcode(status)
        self.ledger.add(self.kind, rusage)
        return False

    def signal(self, number: int) -> None:
        if self.alive():
            os.kill(self.popen.pid, number)

    async def wait(self, timeout: float) -> bool:  # noqa: ASYNC109 - a polling deadline
        """True once it exited, False if it still runs after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while self.alive():
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.05)
        return True

    def _reaped_within(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while self.alive():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)
        return True

    def end(self) -> None:
        if self.alive():
            self.signal(signal.SIGTERM)
            self.signal(signal.SIGCONT)  # a frozen process acts on its SIGTERM only once woken
            if not self._reaped_within(20):
                self.signal(signal.SIGKILL)
                self._reaped_within(10)
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
    """One gateway slot at fixed ports, its process killed and started again many times."""

    def __init__(
        self,
        name: str,
        directory: Path,
        database_url: str,
        upstream: str,
        ledger: usage.Ledger,
        scenario: str = "",
    ) -> None:
        self.name = name
        self.ledger = ledger
        self.scenario = scenario
        self.port, self.admin_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.config = directory / f"{name}.yaml"
        self.config.write_text(yaml.safe_dump({"routes": route_config(upstream)}))
        self.log = directory / f"{name}.log"
        self.database_url = database_url
        self.child: Child | None = None
        self.up = False
        self.processes = 0  # how many were started in this slot
        self.usage: list[usage.Sample] = []

    def start(self) -> None:
        self.child = Child(
            [sys.executable, "-m", "oncegate.cli", "serve", "--config", str(self.config),
             "--port", str(self.port), "--admin-port", str(self.admin_port),
             "--log-level", "warning"],
            self.log, env={"ONCEGATE_DATABASE_URL": self.database_url}, kind="gateways",
            ledger=self.ledger,
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
                    self.processes += 1
                    self.ledger.started(self.child.popen.pid)
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

    def measure(self) -> None:
        """Its process's memory and descriptors, if one is up (not one still starting)."""
        if self.up and self.child is not None and self.child.alive():
            sample = usage.measure(self.child.popen.pid)
            if sample is not None:
                self.usage.append(sample)

    def end(self) -> None:
        self.up = False
        if self.child is not None:
            self.child.end()


@dataclass
class Deployment:
    """One scenario's store, its soak database and its gateways."""

    scenario: Scenario
    database: str
    gateways: list[GatewayProcess]

    @property
    def name(self) -> str:
        return self.scenario.name


@dataclass
class Operation:
    """What a client means to do once, and retries: one key, in one scope, with one body, through
    one deployment's gateways."""

    route: str
    tenant: str
    key: str
    number: int
    deployment: Deployment

    def body(self, variant: int = 0) -> str:
        """The operation's body; another `variant` is another request reusing its key."""
        return json.dumps({"to": f"user{self.number}@example.com", "n": self.number, "v": variant})


@dataclass
class Traffic:
    """The shared state of the clients: the keys in play and every attempt."""

    seed: int
    # The keys in play, per deployment (a key string is reused only within its deployment).
    recent: dict[str, collections.deque[Operation]] = field(
        default_factory=lambda: collections.defaultdict(lambda: collections.deque(maxlen=400))
    )
    every: list[Operation] = field(default_factory=list)
    attempts: list[Attempt] = field(default_factory=list)
    numbers: int = 0

    def new_key(self, dice: random.Random, deployment: Deployment) -> Operation:
        self.numbers += 1
        recent = self.recent[deployment.name]
        route = dice.choices(list(ROUTE_WEIGHTS), list(ROUTE_WEIGHTS.values()))[0]
        tenant = dice.choice(TENANTS)
        # One new key in five reuses a key string in play under another route or tenant: the same
        # key in another scope, which must never see this one's answers. Key strings name their
        # deployment: each store holds its own, and the checker tells them apart.
        if recent and dice.random() < 0.2:
            key = dice.choice(recent).key
            # Only a reused key string can name an operation in play (a new one is numbered).
            if any((other.route, other.tenant, other.key) == (route, tenant, key)
                   for other in recent):  # fmt: skip
                return dice.choice(recent)
        else:
            key = f"soak-{self.seed}-{deployment.name}-{self.numbers}-{dice.getrandbits(32):08x}"
        operation = Operation(route, tenant, key, self.numbers, deployment)
        recent.append(operation)
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
        phase=phase, scenario=operation.deployment.name,
    )  # fmt: skip


async def client(
    number: int,
    traffic: Traffic,
    deployments: list[Deployment],
    deadline: Deadline,
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
        while not deadline.over(len(traffic.attempts)):
            deployment = dice.choice(deployments)
            gateways = deployment.gateways
            up = [gateway for gateway in gateways if gateway.up] or gateways
            recent = traffic.recent[deployment.name]
            draw = dice.random()
            if draw < 0.3 or not recent:
                operation, variant, copies = traffic.new_key(dice, deployment), 0, 1
            elif draw < 0.8:
                operation, variant, copies = dice.choice(recent), 0, 1
            elif draw < 0.85:
                operation = dice.choice(recent)
                variant, copies = dice.randint(1, 3), 1  # a reused key
            else:
                pool = recent if dice.random() < 0.5 else [traffic.new_key(dice, deployment)]
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
    deadline: Deadline,
    interval: float,
    events: list[Event],
    restarts: set[asyncio.Task[None]],
) -> None:
    """Signal one of `gateways` (those that may be hit: not the first of each deployment) every
    `interval` seconds on average until the deadline."""
    while True:
        if not await deadline.pause(dice.uniform(0.5, 1.5) * interval):
            return
        if time.monotonic() >= deadline.until:
            return
        up = [gateway for gateway in gateways if gateway.up]
        if not up:
            continue
        number = dice.choices(list(SIGNALS), list(SIGNALS.values()))[0]
        task = asyncio.create_task(dice.choice(up).hit(number, events))
        restarts.add(task)
        task.add_done_callback(restarts.discard)


async def store_chaos(
    scenario: Scenario,
    plan: list[scenarios.Fault],
    start: float,
    events: list[Event],
    deadline: Deadline,
) -> None:
    """One scenario's faults, each at its time (or at once, when the one before it ran late),
    until the request cap ends the chaos."""
    for fault in plan:
        if not await deadline.pause(max(0.0, start + fault.at - time.monotonic())):
            return
        await scenario.inflict(fault, events)


async def watch_usage(
    gateways: list[GatewayProcess],
    stores: list[Scenario],
    meter: usage.Meter,
    deadline: Deadline,
    traffic: Traffic,
    start: float,
) -> None:
    """Every gateway's memory and descriptors, the PostgreSQL servers' CPU and the machine's
    load, every `USAGE_EVERY` seconds of the chaos; a line of progress every `PROGRESS_EVERY`."""
    said = start
    while time.monotonic() < deadline.until:
        wait = min(USAGE_EVERY, max(0.0, deadline.until - time.monotonic()))
        if not await deadline.pause(wait):
            return
        for gateway in gateways:
            gateway.measure()
        meter.read(postmasters(stores))
        if time.monotonic() - said >= PROGRESS_EVERY:
            said = time.monotonic()
            print(progress(said - start, len(traffic.attempts), meter.loads[-1]), flush=True)  # noqa: T201


def progress(seconds: float, requests: int, load: float) -> str:
    """How far a run is: for a long one, whether it will reach its request count in time."""
    rate = requests / seconds if seconds > 0 else 0.0
    return (
        f"soak: {seconds / 60:.0f} min into the chaos, {requests:,} requests ({rate:,.0f}/s), "
        f"load {load:.1f}"
    )


def postmasters(stores: list[Scenario]) -> list[int]:
    return [pid for store in stores for pid in store.postmasters()]


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
            " failure->>'kind' AS failure,"
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
                stored=record["response_stored"], failure=record["failure"])
        )  # fmt: skip
    return rows


async def settled_rows(urls: list[str]) -> tuple[float, list[Row]]:
    """The key tables (one per deployment) once every lease has run out, and when they were read.

    No client sends anything any more, but a request whose client hung up can still be on its
    way to a claim in a gateway (a claim may wait for the store up to its timeouts); such a late
    claim holds its row for one lease. So a table with a row in flight is read again after a
    lease, a few times: a row that stays `in_progress` through all of them is held for good."""
    await asyncio.sleep(LEASE + 3)
    for _ in range(SETTLE_READS):
        read_at = time.time()
        rows = [row for url in urls for row in await dump_rows(url)]
        if all(row.state != "in_progress" for row in rows):
            break
        await asyncio.sleep(LEASE + 1)
    return read_at, rows


async def probe(traffic: Traffic, dice: random.Random, count: int) -> list[Attempt]:
    """Each of `count` keys once more, through a healthy gateway of its deployment, after
    everything settled."""
    chosen = dice.sample(traffic.every, min(count, len(traffic.every)))
    limit = asyncio.Semaphore(16)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=16)) as session:

        async def one(index: int, operation: Operation) -> Attempt:
            async with limit:
                gateways = operation.deployment.gateways
                return await send(
                    session, gateways[index % len(gateways)], operation, f"probe-{index}",
                    operation.body(), phase="probe",
                )  # fmt: skip

        return list(
            await asyncio.gather(*(one(index, operation) for index, operation in enumerate(chosen)))
        )


async def run(options: Options) -> Summary:
    out = options.out
    out.mkdir(parents=True, exist_ok=True)
    dice = random.Random(options.seed)
    events: list[Event] = []
    chosen, skipped = scenarios.choose(options.scenarios)
    stores = [scenarios.KINDS[name]() for name in chosen]
    children: list[Child] = []
    deployments: list[Deployment] = []
    fuzz_gateway: GatewayProcess | None = None
    chaos: list[asyncio.Task[None]] = []
    restarts: set[asyncio.Task[None]] = set()
    meter = usage.Meter()
    try:
        await asyncio.gather(*(asyncio.to_thread(store.start) for store in stores))
        upstream_port = free_port()
        upstream_log = out / "upstream.jsonl"
        upstream_log.unlink(missing_ok=True)
        upstream = Child(
            [sys.executable, "-m", "tests.soak.upstream", "--port", str(upstream_port),
             "--log", str(upstream_log), "--seed", str(options.seed),
             "--routes", ",".join(ROUTES), "--fault-rate", str(options.fault_rate),
             "--slow", str(SLOW_ANSWER)],
            out / "upstream.log", kind="upstream", ledger=meter.ledger,
        )  # fmt: skip
        children.append(upstream)
        upstream_url = f"http://127.0.0.1:{upstream_port}"
        for store in stores:
            database = await asyncio.to_thread(store.create_database, "soak")
            gateways = [
                GatewayProcess(f"{store.name}-{index + 1}", out, database, upstream_url,
                               meter.ledger, store.name)
                for index in range(GATEWAYS)
            ]  # fmt: skip
            deployments.append(Deployment(store, database, gateways))
        # The fuzzer's gateway on a database of its own, beside the first scenario's.
        fuzz_database = await asyncio.to_thread(stores[0].create_database, "fuzz")
        fuzz_gateway = GatewayProcess(
            "gateway-fuzz", out, fuzz_database, upstream_url, meter.ledger
        )
        fuzz_gateway.config.write_text(yaml.safe_dump({"routes": fuzz_routes(upstream_url)}))
        every_gateway = [
            *(gateway for deployment in deployments for gateway in deployment.gateways),
            fuzz_gateway,
        ]
        await asyncio.gather(*(gateway.keep_up(events) for gateway in every_gateway))
        fuzz_results = out / "fuzz.jsonl"
        fuzzer = Child(
            [sys.executable, "-m", "tests.soak.fuzz", "--port", str(fuzz_gateway.port),
             "--requests", str(options.fuzz_requests), "--seed", str(options.seed),
             "--out", str(fuzz_results)],
            out / "fuzz.log", kind="fuzzer", ledger=meter.ledger,
        )  # fmt: skip
        children.append(fuzzer)

        traffic = Traffic(options.seed)
        for gateway in every_gateway:
            gateway.measure()
        meter.begin(postmasters(stores))
        began, start = time.time(), time.monotonic()
        deadline = Deadline(start + options.seconds, options.requests)
        hit = [gateway for deployment in deployments for gateway in deployment.gateways[1:]]
        chaos = [
            asyncio.create_task(
                gateway_chaos(hit, random.Random(dice.random()), deadline, options.kill_interval,
                              events, restarts)
            ),
            asyncio.create_task(
                watch_usage(every_gateway, stores, meter, deadline, traffic, start)
            ),
            *(
                asyncio.create_task(
                    store_chaos(store, store.plan(random.Random(dice.random()), options.seconds,
                                                  options.sizes), start, events, deadline)
                )
                for store in stores
            ),
        ]  # fmt: skip
        await asyncio.gather(
            *(client(number, traffic, deployments, deadline) for number in range(options.clients))
        )
        chaos_seconds = time.monotonic() - start
        await asyncio.gather(*chaos)
        # Heal: every store back (each plan ends with a recovery), every gateway started again.
        while restarts:
            await asyncio.gather(*list(restarts))
        read_at, rows = await settled_rows([deployment.database for deployment in deployments])
        events.append(Event(read_at, checker.ROWS_READ))
        probes = await probe(traffic, random.Random(dice.random()), options.probes)
        traffic.attempts.extend(probes)
        for gateway in every_gateway:
            gateway.measure()
        meter.read(postmasters(stores))
        # The fuzzer is bounded by its request count; it has had the whole chaos to get there.
        if not await fuzzer.wait(600):
            fuzzer.signal(signal.SIGKILL)
        fuzz_violations = await check_fuzz(fuzz_results, fuzz_database, options.fuzz_requests)
    finally:
        # A run that failed half-way leaves no fault injector behind to hit what comes next.
        for task in [*chaos, *restarts]:
            task.cancel()
        for deployment in deployments:
            for gateway in deployment.gateways:
                gateway.end()
        if fuzz_gateway is not None:
            fuzz_gateway.end()
        for child in children:
            child.end()
        for store in stores:
            await asyncio.to_thread(store.close)

    # Before the histories are written and checked: the CPU of the run itself.
    cpu = meter.figures(len(traffic.attempts))
    performed = history.read(upstream_log, Performed)
    history.write(out / "attempts.jsonl", traffic.attempts)
    history.write(out / "keys.jsonl", rows)
    history.write(out / "events.jsonl", events)
    result = checker.check(
        traffic.attempts, performed, rows, events,
        forward_routes=FORWARD_ROUTES,
    )  # fmt: skip
    figures = tally(traffic, performed, rows, events, result, fuzz_results, options)
    figures["scenarios"] = chosen
    figures["skipped"] = skipped
    figures["cpu"] = cpu
    figures["chaos_seconds"] = chaos_seconds
    figures["requests_per_second"] = figures["requests"] / chaos_seconds if chaos_seconds else 0.0
    figures["usage"] = usage.report(
        [(gateway.name, gateway.processes, gateway.usage) for gateway in every_gateway],
        start=began,
    )
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
    by_scenario = collections.Counter(attempt.scenario for attempt in chaos)
    store_events: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for event in events:
        if event.target in by_scenario:
            store_events[event.target][event.what.split(":")[0]] += 1
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
        "requests_by_scenario": dict(by_scenario),
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
        "store_events": {name: dict(counts) for name, counts in store_events.items()},
        "upstream_requests": len(soak_records),
        "upstream_performed": sum(1 for record in soak_records if record.performed),
        "upstream_faults": {fault: faults[fault] for fault in sorted(faults) if fault != "answer"},
        "fuzzed_requests": fuzzed,
        "rows": len(rows),
        "unknown": len(unknown),
        "answered_then_unknown": len(seen_then_unknown),
        "unknown_causes": dict(result.unknown_causes.most_common()),
        "duplicates": result.count("duplicate") + result.count("sent-twice"),
        "lost": result.count("lost"),
        "cross_scope": result.count("cross-scope"),
        "unexpected_5xx": result.unexpected_5xx,
        "violations": {rule: result.count(rule) for rule in checker.RULES},
    }


def render(figures: dict[str, Any]) -> str:
    faults = figures["upstream_faults"]
    rows = [
        ("chaos", f"{figures.get('chaos_seconds', figures['seconds']):,.0f} s (of "
         f"{figures['seconds']:g} s allowed), {figures['clients']} clients, seed "
         f"{figures['seed']}"),
        ("requests (clients)", f"{figures['requests']:,}, "
         f"{figures.get('requests_per_second', 0.0):,.0f}/s ({figures['answered']:,} answered, "
         f"{figures['no_answer']:,} no answer, {figures['hung_up']:,} hung up on purpose)"),
        ("replays served", f"{figures['replayed']:,}"),
        ("keys", f"{figures['keys']:,}"),
        ("gateway kills", f"{figures['gateway_kills']} SIGKILL, {figures['gateway_terms']} "
         f"SIGTERM, {figures['gateway_pauses']} SIGSTOP for {PAUSE:g} s"),
        *store_rows(figures),
        ("upstream requests", f"{figures['upstream_requests']:,} "
         f"({figures['upstream_performed']:,} performed)"),
        ("upstream faults", ", ".join(f"{name} {count:,}" for name, count in faults.items())
         or "0"),
        ("keys at the end", f"{figures['rows']:,} rows, {figures['unknown']:,} unknown (of "
         f"which {figures['answered_then_unknown']:,} after a client had its answer)"),
        ("unknown keys, in flight at", ", ".join(
            f"{cause} {count:,}" for cause, count in figures["unknown_causes"].items()) or "-"),
        ("probes after the chaos", f"{figures['probes']:,}"),
        *cpu_rows(figures.get("cpu")),
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
    return "\n".join(lines) + "\n\n" + usage.render(figures.get("usage", []))


def cpu_rows(cpu: dict[str, float] | None) -> list[tuple[str, str]]:
    """The CPU the run used per client request, what 10^6 requests would take on two idle cores
    at that cost, and the machine's load meanwhile."""
    if not cpu:
        return []
    quiet_hours = 10**6 * cpu["ms_per_request"] / 1000 / 2 / 3600
    parts = cpu.get("parts", {})
    counts = cpu.get("part_processes", {})
    split = ", ".join(
        f"{kind} {seconds:,.0f}" + (f" ({counts[kind]:,} processes)" if kind == "gateways" else "")
        for kind, seconds in parts.items()
    )
    starts = cpu.get("gateway_starts", 0)
    if starts:
        split += (
            f"; a gateway's start to listening {cpu['gateway_start_seconds'] / starts:.2f} s"
            f" ({starts:,} starts)"
        )
    return [
        ("CPU used", f"{cpu['total_seconds']:,.0f} s: soak process {cpu['driver_seconds']:,.0f}, "
         f"{split + ', ' if split else ''}PostgreSQL tools and the rest "
         f"{cpu.get('tools_seconds', cpu['processes_seconds']):,.0f}, PostgreSQL servers "
         f"{cpu['postgres_seconds']:,.0f}; {cpu['ms_per_request']:.1f} ms a request (10^6 "
         f"requests: {quiet_hours:.1f} h on 2 idle cores)"),
        ("load average (1 min)", f"{cpu['load_mean']:.1f} mean, {cpu['load_max']:.1f} peak, "
         "read every 15 s"),
    ]  # fmt: skip


def store_rows(figures: dict[str, Any]) -> list[tuple[str, str]]:
    """What each scenario's store went through, and which scenarios did not run."""
    rows = []
    requests = figures["requests_by_scenario"]
    for name in figures.get("scenarios", []):
        happened = collections.Counter(figures["store_events"].get(name, {}))
        if name == "single":
            text = (
                f"{happened['postgres-start']} restarts after stop fast {happened['postgres-fast']}"
                f", stop immediate {happened['postgres-immediate']}, kill -9 "
                f"{happened['postgres-kill']}"
            )
        elif name == "failover":
            text = (
                f"{happened['postgres-failover']} failovers (primary kill -9ed, standby promoted "
                f"{happened['postgres-promoted']}x; old primary rejoined as the synchronous "
                f"standby by pg_rewind {happened['postgres-rejoined-rewind']}x, by a fresh base "
                f"backup {happened['postgres-rejoined-base-backup']}x)"
            )
        else:
            text = (
                f"{happened['citus-worker-stop']} worker stops -m immediate (started again "
                f"{happened['citus-worker-start']}x), {happened['citus-shard-move']} shard moves "
                f"({happened['citus-shard-move-failed']} failed)"
            )
        rows.append((f"store: {name}", f"{requests.get(name, 0):,} requests; {text}"))
    skipped = figures.get("skipped", {})
    if skipped:
        rows.append(
            ("scenarios left out", "; ".join(f"{name}: {why}" for name, why in skipped.items()))
        )
    return rows
