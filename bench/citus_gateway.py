"""Through the gateway: what a forward costs PostgreSQL on one server and on a Citus cluster,
end to end, in one run.

One `oncegate demo-upstream` and, per target, one `oncegate serve` process (one worker) in
front of it, its `ONCEGATE_DATABASE_URL` the target: one plain PostgreSQL 15, or the coordinator
of a Citus cluster of two workers (tests/citus.py's servers, the same settings), its key table
in `--shards` shards (a database per shard count). `POST /emails` with a new Idempotency-Key per
request over `--connections` keep-alive connections (bench/quick.py's load generator) for
`--duration` seconds after a warm-up, `--repeats` times, the targets in turn, once per count of
connections: at 64 one gateway process sets the pace and a worker's statements carry half of
what the one server's do; at 256 they fill, as where PostgreSQL is the limit. Each gateway,
once listening, is left to finish its start-up work on the store (the key count's sweep of the
whole key table) until it and every node are idle, then warmed up, then measured. Before the
measured repeats, each target is driven once so, unmeasured, and `VACUUM (ANALYZE)` runs on every
node of its database (as bench/citus_pairs.py and bench/citus_scale.py do): no repeat runs on a
fresh key table planned without statistics. Autovacuum is off on every server and each run's
writes are vacuumed after it, outside it, so no vacuum falls inside a run. Each repeat runs the
targets in an order rotated by one, and each row's ratio is to the one server of the same repeat
and connections. From
/proc: the CPU per forward of the gateway process and of every PostgreSQL node (postmasters, their
children and the children they reaped; on the cluster the coordinator apart). From the gateway's
/metrics (`oncegate_store_batch_size`): the operations per statement of its claims and completes
(on the cluster a worker's, both kinds in one) and how many such statements a forward took.

    .venv/bin/python bench/citus_gateway.py [--duration 5] [--connections 64,256] [--repeats 2]
        [--shards default,32] [--profile DIR]

Needs Citus installed (as the tests do). Every process and server is stopped, and the directory
removed, in a `finally`; the run is under SIGALRM.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from itertools import product
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH.parent))  # tests.citus: the cluster the tests start

import capacity  # noqa: E402
import citus_pairs  # noqa: E402
import profiling  # noqa: E402
import quick  # noqa: E402
import run  # noqa: E402

from oncegate.store import migrate  # noqa: E402
from tests import citus  # noqa: E402

STARTUP_TIMEOUT = 60.0
WARMUP = 2.0
IDLE, IDLE_WINDOW = 0.05, 0.5  # `settled`: under a twentieth of a core over half a second
# The batched operations of a forward: the one server's claims and completes, a Citus worker's
# both in one statement (store/postgres/workers.py).
OPERATIONS = ("claim", "complete", "claim_complete")


@dataclass
class Row:
    target: str
    repeat: int
    connections: int
    forwards_per_second: float
    forwards: int
    gateway_ms: float
    postgres_ms: float
    coordinator_ms: float | None
    load: float  # the machine's load average (1 min) at the end of the run
    # Per batched operation the store sent in the run: (operations, statements).
    batches: dict[str, tuple[float, float]]
    # py-spy's samples of the gateway during the run, per part of the request path (`--profile`).
    profile: collections.Counter[str] | None = None

    def line(self, rows: list[Row]) -> str:
        postgres = f"{self.postgres_ms:.3f}"
        if self.coordinator_ms is not None:
            postgres += (
                f" ({self.coordinator_ms:.3f} + {self.postgres_ms - self.coordinator_ms:.3f})"
            )
        one_server = [
            row.postgres_ms for row in rows
            if row.repeat == self.repeat and row.connections == self.connections
            and row.target == citus_pairs.ONE_SERVER
        ]  # fmt: skip
        times = f"{self.postgres_ms / one_server[0]:.2f}x" if one_server else "-"
        return (
            f"| {self.repeat} | {self.connections} | {self.target} |"
            f" {self.forwards_per_second:,.0f} |"
            f" {self.gateway_ms:.3f} | {postgres} | {times} | {self.sizes()} |"
            f" {self.statements_per_forward():.2f} | {self.load:.1f} |"
        )

    def sizes(self) -> str:
        """Operations per statement: claims / completes / both in one (a Citus worker's)."""
        means = []
        for operation in OPERATIONS:
            operations, statements = self.batches.get(operation, (0.0, 0.0))
            means.append(f"{operations / statements:.1f}" if statements else "-")
        return " / ".join(means)

    def statements_per_forward(self) -> float:
        """The store's claim and complete statements (of both kinds or either) a forward."""
        sent = sum(self.batches.get(operation, (0.0, 0.0))[1] for operation in OPERATIONS)
        return sent / max(self.forwards, 1)


def measure(
    target: str, endpoint: citus_pairs.Endpoint, connections: int, upstream_port: int,
    work: Path, arguments: argparse.Namespace, repeat: int = 0,
) -> Row:  # fmt: skip
    """One gateway on `endpoint`, driven over `connections` connections: a warm-up, then the
    measured run."""
    url, postmasters = endpoint.url, endpoint.postmasters
    environment = {name: value for name, value in os.environ.items()
                   if not name.startswith("ONCEGATE_")}  # fmt: skip
    environment["ONCEGATE_DATABASE_URL"] = url
    port, admin_port = quick.free_port(), quick.free_port()
    started: list[subprocess.Popen[bytes]] = []
    log = work / f"gateway-{port}.log"
    try:
        quick.start(
            quick.oncegate("serve", "--upstream", f"http://{quick.HOST}:{upstream_port}",
                           "--host", quick.HOST, "--port", str(port),
                           "--admin-port", str(admin_port), "--log-level", "warning"),
            log, environment, started,
        )  # fmt: skip
        gateway = started[0]
        quick.wait_listening(gateway, port, log, STARTUP_TIMEOUT)
        groups = {"gateway": [gateway.pid]} | {
            f"node{index}": [pid] for index, pid in enumerate(postmasters)
        }
        settled(groups)
        asyncio.run(capacity.drive(port, connections, WARMUP, f"warm-{uuid.uuid4().hex[:8]}"))
        page_before = run.scrape(admin_port)
        spy, spied = None, None
        if arguments.profile is not None:
            spied = arguments.profile / f"{target}-{connections}-{repeat}.txt"
            spy = profiling.start(gateway.pid, math.ceil(arguments.duration), spied)
        before = run.cpu_seconds(groups)
        result = asyncio.run(
            capacity.drive(port, connections, arguments.duration, uuid.uuid4().hex[:12])
        )
        after = run.cpu_seconds(groups)
        profile = profiling.finish(spy, spied) if spy is not None and spied is not None else None
        batches = sent(
            run.batch_sizes(page_before) or {}, run.batch_sizes(run.scrape(admin_port)) or {}
        )
        if result.errors:
            raise RuntimeError(f"{target}: errors {dict(result.errors)} ({quick.tail(log)})")
    finally:
        for process in started:
            quick.stop(process)
    used = {name: after[name] - before[name] for name in groups}
    forwards = max(result.requests, 1)
    nodes = [name for name in groups if name != "gateway"]
    return Row(
        target,
        repeat,
        connections,
        result.requests / result.elapsed,
        result.requests,
        used["gateway"] * 1000 / forwards,
        sum(used[name] for name in nodes) * 1000 / forwards,
        used["node0"] * 1000 / forwards if len(nodes) > 1 else None,
        os.getloadavg()[0],
        batches,
        profile,
    )


def settled(groups: dict[str, list[int]]) -> None:
    """Wait until the gateway and every PostgreSQL node are idle (under `IDLE` of a core over
    `IDLE_WINDOW`): a gateway starts with work of its own on the store, which grows with the key
    table: the only gateway on its database, it holds the key count's turn and sweeps the whole
    table at once (docs/operations.md, section 6, "What a gateway does to the store"). On the
    cluster's largest table it ran on into the measured window: 0.42 s of the coordinator's CPU
    in the 2.8 s after the gateway started, a 2 s warm-up. That was the sweep's Citus page
    (ORDER BY id LIMIT 5000, sent to every shard and sorted on the coordinator: 0.35 s a sweep
    of 10^5 keys in 4 shards); its pages are ranges of ids since (0.05 s, the workers 0.07 s
    each), and the wait stays for what the workers still read."""
    deadline = time.monotonic() + STARTUP_TIMEOUT
    before = run.cpu_seconds(groups)
    while True:
        time.sleep(IDLE_WINDOW)
        now = run.cpu_seconds(groups)
        if sum(now[name] - before[name] for name in groups) < IDLE * IDLE_WINDOW:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the gateway and PostgreSQL still busy {STARTUP_TIMEOUT:g} s on")
        before = now


def sent(
    before: dict[str, run.Histogram], after: dict[str, run.Histogram]
) -> dict[str, tuple[float, float]]:
    """Per operation, the operations and statements of the store's batches between two scrapes
    of the gateway's `oncegate_store_batch_size`."""
    found = {}
    for operation, histogram in after.items():
        delta = histogram.minus(before.get(operation))
        found[operation] = (delta.total, delta.count)
    return found


def counts(text: str) -> list[int]:
    """`--connections`: positive counts, comma-separated."""
    try:
        found = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not counts: {text!r}") from None
    if not found or min(found) < 1:
        raise argparse.ArgumentTypeError(f"counts of at least 1: {text!r}")
    return found


def profile_table(rows: list[Row], connections: int) -> str:
    """At `connections`, each target's samples over its repeats, each part's share times the
    target's median gateway CPU a forward; the differences to the one server."""
    measured: dict[str, tuple[collections.Counter[str], float]] = {}
    for target in dict.fromkeys(row.target for row in rows):
        mine = [row for row in rows if row.target == target and row.connections == connections]
        counted: collections.Counter[str] = collections.Counter()
        for row in mine:
            counted += row.profile or collections.Counter()
        measured[target] = (counted, statistics.median(row.gateway_ms for row in mine))
    return profiling.table(measured, baseline=citus_pairs.ONE_SERVER)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument(
        "--connections",
        type=counts,
        default=[64, 256],
        metavar="N,N,...",
        help="the load's connections, each count a run per target and repeat (default: 64,256:"
        " where the gateway sets the pace, and where PostgreSQL's statements fill)",
    )
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--shards",
        type=citus_pairs.shard_counts,
        default=[citus_pairs.DEFAULT, 32],
        metavar="N,N,...",
        help="the key table's shard counts on the cluster (default: `default`, migrate's"
        " choice, two per worker; and 32)",
    )
    parser.add_argument(
        "--profile",
        type=Path,
        metavar="DIR",
        help="sample each gateway with py-spy during the measured runs (raw stacks kept in"
        " DIR) and print where its CPU went per forward, per part of the request path",
    )
    arguments = parser.parse_args()
    if arguments.profile is not None:
        if not profiling.available():
            print(
                "citus_gateway: --profile needs py-spy (make .venv/.bench-tools)", file=sys.stderr
            )
            return 2
        arguments.profile.mkdir(parents=True, exist_ok=True)
    why = citus.unavailable()
    if why is not None:
        print(f"citus_gateway: no Citus here: {why}", file=sys.stderr)
        return 2
    runs = (1 + len(arguments.shards)) * (len(arguments.connections) * arguments.repeats + 1)
    budget = 2 * STARTUP_TIMEOUT + runs * (WARMUP + arguments.duration + STARTUP_TIMEOUT)

    def out_of_time(signum: int, frame: object) -> None:
        raise TimeoutError(f"the benchmark ran out of its {budget:.0f}s budget")

    signal.signal(signal.SIGALRM, out_of_time)
    signal.alarm(math.ceil(budget))
    work = citus.temporary_directory("oncegate-citus-gateway-")
    rows: list[Row] = []
    upstream: list[subprocess.Popen[bytes]] = []
    try:
        with citus_pairs.servers(work, arguments.shards) as targets:
            for endpoint in targets.values():
                migrate.upgrade(endpoint.url)
            upstream_port = quick.free_port()
            quick.start(
                quick.oncegate("demo-upstream", "--host", quick.HOST, "--port", str(upstream_port)),
                work / "upstream.log", os.environ.copy(), upstream,
            )  # fmt: skip
            quick.wait_listening(upstream[0], upstream_port, work / "upstream.log", STARTUP_TIMEOUT)
            for target, endpoint in targets.items():
                row = measure(
                    target, endpoint, arguments.connections[0], upstream_port, work, arguments,
                )  # fmt: skip
                asyncio.run(citus_pairs.vacuum(endpoint))
                run.progress(
                    f"warm-up {target}: {row.forwards_per_second:,.0f} forwards/s, then VACUUM"
                    " (ANALYZE) on every node"
                )
            for repeat in range(1, arguments.repeats + 1):
                for connections, target in product(
                    arguments.connections, citus_pairs.in_order(list(targets), repeat)
                ):
                    endpoint = targets[target]
                    row = measure(
                        target, endpoint, connections, upstream_port, work, arguments, repeat
                    )  # fmt: skip
                    rows.append(row)
                    # What the run wrote, vacuumed outside it (autovacuum is off on every
                    # server, as in bench/citus_pairs.py): no vacuum falls inside another run.
                    asyncio.run(citus_pairs.vacuum(endpoint))
                    run.progress(
                        f"{target}, {connections} connections:"
                        f" {row.forwards_per_second:,.0f} forwards/s"
                    )
        print(
            "one `oncegate serve` process per target and run, a new"
            f" key per request, {WARMUP:g} s warm-up + {arguments.duration:g} s per run, every"
            " database first driven once unmeasured, autovacuum off and VACUUM (ANALYZE) on every"
            " node after every run, outside it, the order rotated each repeat; CPU from /proc"
        )
        print(f"\n$ {quick.command_line()}\n")
        print(
            "| repeat | connections | target | forwards/s | gateway CPU ms/forward"
            " | PostgreSQL CPU ms/forward"
            " (coordinator + workers) | x the one server (same repeat, connections)"
            " | operations per statement"
            " (claim / complete / both) | the store's statements a forward | load average |"
        )
        print("|---:|---:|---|---:|---:|---:|---:|---|---:|---:|")
        for row in rows:
            print(row.line(rows))
        for connections in arguments.connections if arguments.profile is not None else []:
            print(
                f"\nwhere the gateway's CPU went per forward at {connections} connections (py-spy,"
                f" {profiling.RATE} Hz):\n"
            )
            print(profile_table(rows, connections))
        return 0
    except (RuntimeError, TimeoutError, OSError) as exc:
        print(f"citus_gateway failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        signal.alarm(0)
        for process in upstream:
            quick.stop(process)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
