"""What the fence costs a Citus worker per statement: `oncegate_fence(shards)` (migration 0012),
which every statement the store sends a worker calls first, beside a statement that does nothing.

Starts a coordinator and two workers (tests/citus.py), migrates a database (two shards per
worker), and on one worker, over one connection, sends `--calls` times `SELECT
oncegate_fence($1)` with the worker's shards, then as many `SELECT cardinality($1)` (the same
round trip and parameter, no fence), in `--rounds` rounds whose order alternates. The backend's
CPU (from /proc) per call of each, and the difference: the fence's own cost, to set beside a
worker's statement (bench/citus_pairs.py: about 1-1.7 ms of CPU a statement of 26 operations at
64 in flight over two workers).

    .venv/bin/python bench/fence_cost.py [--calls 3000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
from pathlib import Path

import asyncpg

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))  # tests.citus: the servers the tests start

import citus_pairs  # noqa: E402

from oncegate.store import migrate  # noqa: E402
from tests import citus  # noqa: E402

STATEMENTS = {
    "fence": "SELECT oncegate_fence($1::bigint[])",
    # Its parts: Citus's lock alone, and the check of the placements alone.
    "lock": "SELECT lock_shard_metadata(5, $1::bigint[])",
    "check": "SELECT count(*) = cardinality($1::bigint[]) FROM pg_dist_placement"
    " WHERE shardid = ANY($1::bigint[])"
    " AND groupid = (SELECT groupid FROM pg_dist_local_group)",
    "nothing": "SELECT cardinality($1::bigint[])",
}


def backend_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def measure(cluster: citus.Cluster, url: str, arguments: argparse.Namespace) -> None:
    worker = cluster.workers[0]
    coordinator = await asyncpg.connect(url)
    try:
        shards = sorted(
            row["shardid"]
            for row in await coordinator.fetch(
                "SELECT shardid FROM citus_shards"
                " WHERE table_name = 'oncegate_keys'::regclass AND nodeport = $1",
                worker.port,
            )
        )
        database = await coordinator.fetchval("SELECT current_database()")
    finally:
        await coordinator.close()
    connection = await asyncpg.connect(worker.url(database))
    try:
        pid = await connection.fetchval("SELECT pg_backend_pid()")
        prepared = {name: await connection.prepare(sql) for name, sql in STATEMENTS.items()}
        found: dict[str, list[float]] = {name: [] for name in STATEMENTS}
        for name in STATEMENTS:  # warm: plans cached, the function compiled
            for _ in range(200):
                await prepared[name].fetchval(shards)
        for round_ in range(arguments.rounds):
            order = list(STATEMENTS) if round_ % 2 == 0 else list(reversed(STATEMENTS))
            for name in order:
                before = backend_cpu(pid)
                for _ in range(arguments.calls):
                    await prepared[name].fetchval(shards)
                found[name].append((backend_cpu(pid) - before) * 1e6 / arguments.calls)
    finally:
        await connection.close()
    print(f"one worker, its {len(shards)} shards fenced; backend CPU µs per call, median (range)")
    for name, each in found.items():
        print(f"{name}: {statistics.median(each):.1f} ({min(each):.1f}-{max(each):.1f})")
    for name in ("fence", "lock", "check"):
        own = [a - b for a, b in zip(found[name], found["nothing"], strict=True)]
        print(f"{name} less nothing: {statistics.median(own):.1f} ({min(own):.1f}-{max(own):.1f})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=5)
    arguments = parser.parse_args()
    why = citus.unavailable()
    if why is not None:
        print(f"fence_cost: no Citus here: {why}", file=sys.stderr)
        return 2
    cluster = citus.Cluster.start()
    try:
        url = cluster.create_database("fence")
        asyncio.run(citus_pairs.set_shard_count(url, citus_pairs.DEFAULT))  # migrate's choice
        migrate.upgrade(url)
        asyncio.run(measure(cluster, url, arguments))
    finally:
        cluster.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
