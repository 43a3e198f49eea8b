"""What a gateway's own work on the store costs as the key table grows: at start-up and every
interval, on one PostgreSQL 15 and on a Citus cluster, in one run.

The servers are bench/citus_pairs.py's (tests/citus.py's nodes: one plain PostgreSQL, and a
coordinator with two workers, the key table in `--shards` shards, autovacuum off). The key table
of each is grown to each of `--keys` in turn (completed keys written through the coordinator:
`INSERT ... SELECT generate_series`, 100,000 a statement), VACUUM (ANALYZE) on every node, then,
each measured on its own, with the CPU of every PostgreSQL node around it (postmasters, their
children and the children they reaped, from /proc: `run.cpu_seconds`), twice, the second printed:

- the start-up line's count of keys (`Upkeep.held_keys`: up to 1,000 counted, then PostgreSQL's
  estimate), and, for comparison, the `count(*)` of the table it replaced;
- one sweep of the key count (`service.count_keys` without its pauses: what the process holding
  the key count's turn runs at start and every `key_count_interval`), and its statements; and,
  for comparison, the same sweep by pages of `ORDER BY id LIMIT` (plain PostgreSQL's page, and
  what Citus ran before its pages became ranges of ids);
- one pass of the purger with nothing expired (`service.purge_expired`: every process, every
  `purge_interval`);
- `oncegate serve` started on the database and left `--settle` seconds: every node's CPU from
  its launch (its schema check, the start-up count, its first sweep: it is the only gateway on
  the database, so it holds the key count's turn).

Prints one Markdown table; nothing asserted.

    .venv/bin/python bench/gateway_upkeep.py [--keys 100000,1000000] [--shards default]
        [--settle 15]

Needs Citus installed (as the tests do). Every process and server is stopped, and the directory
removed, in a `finally`; the run is under SIGALRM.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import asyncpg
from prometheus_client import REGISTRY

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH.parent))  # tests.citus: the cluster the tests start

import citus_pairs  # noqa: E402
import quick  # noqa: E402
import run  # noqa: E402

from oncegate import service  # noqa: E402
from oncegate.store import migrate  # noqa: E402
from oncegate.store.postgres import PostgresStore  # noqa: E402
from oncegate.store.queries import DIALECTS  # noqa: E402
from tests import citus  # noqa: E402

STARTUP_TIMEOUT = 60.0
FILL_STEP = 100_000
FILL = """
INSERT INTO oncegate_keys (route, scope, key, fingerprint, state, fencing_token, response_status,
                           response_headers, response_body, response_stored, completed_at,
                           expires_at)
SELECT 'emails', sha256(n::text::bytea), 'upkeep-' || n, sha256(n::text::bytea), 'completed', 1,
       201, '[["content-type", "application/json"]]'::jsonb,
       convert_to('{"id": "' || n || '", "status": "sent"}', 'UTF8'), true, now(),
       now() + interval '1 day'
FROM generate_series($1::bigint, $2::bigint) AS n
"""


async def grow(url: str, keys: int) -> None:
    """The key table of `url` grown to `keys` rows."""
    connection = await asyncpg.connect(url)
    try:
        held: int = await connection.fetchval("SELECT count(*) FROM oncegate_keys")
        for start in range(held + 1, keys + 1, FILL_STEP):
            await connection.execute(FILL, start, min(keys, start + FILL_STEP - 1))
    finally:
        await connection.close()


Work = Callable[[PostgresStore, asyncpg.Connection], Awaitable[object]]


async def measured(endpoint: citus_pairs.Endpoint, work: Work) -> tuple[dict[str, float], object]:
    """Each node's CPU seconds while `work` ran on a store and a connection already open (their
    connections made and warm: it runs once unmeasured first), and what it returned."""
    groups = node_groups(endpoint)
    store = await PostgresStore.connect(endpoint.url)
    connection = await asyncpg.connect(endpoint.url)
    try:
        await work(store, connection)
        before = run.cpu_seconds(groups)
        result = await work(store, connection)
        after = run.cpu_seconds(groups)
    finally:
        await connection.close()
        await store.close()
    return {name: after[name] - before[name] for name in groups}, result


def node_groups(endpoint: citus_pairs.Endpoint) -> dict[str, list[int]]:
    names = ["coordinator", *(f"worker{n}" for n in range(1, len(endpoint.postmasters)))]
    if len(endpoint.postmasters) == 1:
        names = ["server"]
    return {name: [pid] for name, pid in zip(names, endpoint.postmasters, strict=True)}


async def held_keys(store: PostgresStore, connection: asyncpg.Connection) -> str:
    return str(await store.upkeep.held_keys())


async def count_star(store: PostgresStore, connection: asyncpg.Connection) -> int:
    counted: int = await connection.fetchval("SELECT count(*) FROM oncegate_keys")
    return counted


def sent(operation: str) -> float:
    """The store's statements of `operation` so far, in this process (its timer's count)."""
    labels = {"operation": operation}
    return REGISTRY.get_sample_value("oncegate_store_operation_duration_seconds_count", labels) or 0


async def sweep(store: PostgresStore, connection: asyncpg.Connection) -> int:
    """One sweep of the key count, without its pauses; its statements."""
    before = sent("count_keys")
    await service.count_keys(store.upkeep, pause=0)
    return int(sent("count_keys") - before)


async def sweep_by_limit(store: PostgresStore, connection: asyncpg.Connection) -> int:
    """The sweep as it was on Citus before its pages became ranges of ids: plain PostgreSQL's
    page (the next rows by id, `ORDER BY id LIMIT`) sent through the coordinator, which Citus
    runs by sending the LIMIT to every shard and sorting what they all send back. On plain
    PostgreSQL, the sweep itself."""
    page = DIALECTS["postgres"]["count_keys"]
    after, statements = 0, 0
    while True:
        values = {"after": after, "page_size": service.KEY_COUNT_PAGE_SIZE}
        row = await connection.fetchrow(page.sql, *page.arguments(values))
        statements += 1
        if row["counted"] < service.KEY_COUNT_PAGE_SIZE:
            return statements
        after = row["last_id"]


async def purge(store: PostgresStore, connection: asyncpg.Connection) -> int:
    return await service.purge_expired(store.upkeep)


def gateway_start(endpoint: citus_pairs.Endpoint, work: Path, settle: float) -> dict[str, float]:
    """Each node's CPU seconds in the `settle` seconds from an `oncegate serve`'s launch."""
    environment = {name: value for name, value in os.environ.items()
                   if not name.startswith("ONCEGATE_")}  # fmt: skip
    environment["ONCEGATE_DATABASE_URL"] = endpoint.url
    port, admin_port = quick.free_port(), quick.free_port()
    groups = node_groups(endpoint)
    started: list[subprocess.Popen[bytes]] = []
    log = work / f"gateway-{port}.log"
    before = run.cpu_seconds(groups)
    launched = time.monotonic()
    try:
        quick.start(
            quick.oncegate("serve", "--upstream", f"http://{quick.HOST}:9", "--host", quick.HOST,
                           "--port", str(port), "--admin-port", str(admin_port),
                           "--log-level", "warning"),
            log, environment, started,
        )  # fmt: skip
        quick.wait_listening(started[0], port, log, STARTUP_TIMEOUT)
        time.sleep(max(0.0, settle - (time.monotonic() - launched)))
        after = run.cpu_seconds(groups)
    finally:
        for process in started:
            quick.stop(process)
    return {name: after[name] - before[name] for name in groups}


def cell(used: dict[str, float]) -> str:
    return " + ".join(f"{seconds:.2f}" for seconds in used.values())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", default="100000,1000000", help="key-table sizes, in turn")
    parser.add_argument("--shards", type=citus_pairs.shard_counts, default=[citus_pairs.DEFAULT])
    parser.add_argument("--settle", type=float, default=15.0)
    arguments = parser.parse_args()
    sizes = sorted(int(size) for size in arguments.keys.split(","))
    why = citus.unavailable()
    if why is not None:
        print(f"gateway_upkeep: no Citus here: {why}", file=sys.stderr)
        return 2
    budget = 300 + len(sizes) * (1 + len(arguments.shards)) * (arguments.settle + 300)

    def out_of_time(signum: int, frame: object) -> None:
        raise TimeoutError(f"the benchmark ran out of its {budget:.0f}s budget")

    signal.signal(signal.SIGALRM, out_of_time)
    signal.alarm(math.ceil(budget))
    work = citus.temporary_directory("oncegate-gateway-upkeep-")
    lines = []
    try:
        with citus_pairs.servers(work, arguments.shards) as targets:
            for endpoint in targets.values():
                migrate.upgrade(endpoint.url)
            for size in sizes:
                for target, endpoint in targets.items():
                    asyncio.run(grow(endpoint.url, size))
                    asyncio.run(citus_pairs.vacuum(endpoint))
                    held_cpu, held = asyncio.run(measured(endpoint, held_keys))
                    star_cpu, _ = asyncio.run(measured(endpoint, count_star))
                    sweep_cpu, statements = asyncio.run(measured(endpoint, sweep))
                    limit_cpu, _ = asyncio.run(measured(endpoint, sweep_by_limit))
                    purge_cpu, _ = asyncio.run(measured(endpoint, purge))
                    start_cpu = gateway_start(endpoint, work, arguments.settle)
                    lines.append(
                        f"| {size:,} | {target} | {cell(held_cpu)} ({held}) | {cell(star_cpu)} |"
                        f" {cell(sweep_cpu)} ({statements} statements) | {cell(limit_cpu)} |"
                        f" {cell(purge_cpu)} |"
                        f" {cell(start_cpu)} | {os.getloadavg()[0]:.1f} |"
                    )
                    run.progress(lines[-1])
        print(
            "PostgreSQL CPU seconds (one server, or coordinator + workers), each the second of two"
            f" runs; the gateway's start: every node in the {arguments.settle:g} s from its launch"
        )
        print(f"\n$ {quick.command_line()}\n")
        print(
            "| keys | target | start-up count (held_keys, what it said) | count(*) (before)"
            " | one key-count sweep | the same by LIMIT pages (Citus before)"
            " | one purge pass, nothing expired"
            f" | `oncegate serve`, first {arguments.settle:g} s | load average |"
        )
        print("|---:|---|---|---:|---|---:|---:|---:|---:|")
        print("\n".join(lines))
        return 0
    except (RuntimeError, TimeoutError, OSError) as exc:
        print(f"gateway_upkeep failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        signal.alarm(0)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
