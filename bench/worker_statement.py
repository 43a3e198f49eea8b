"""What one Citus worker's statement costs it, beside what the one server's two statements cost it
for the same operations: a worker's claims and completes go in one statement naming every shard
table it holds, fenced (store/postgres/workers.py), the one server's in a claim statement and a
complete statement (queries.sql).

Starts a single PostgreSQL 15 and a coordinator with two workers (tests/citus.py), both migrated
(the cluster at migrate's two shards per worker), and over one connection each, set as the
store's request pools set theirs, sends the same work over and over: `--claims N` new keys
claimed and the N keys claimed by the statement before completed, with the store's own
statements. On the worker, four shapes of that statement side by side:

- `as sent`: what the store sends (the fence, both shard tables' parts; the keys over both);
- `no fence`: the same with the fence's call taken out (what the fence costs a statement);
- `one shard`: the same naming only the shard the keys are on (what a second shard table costs a
  statement, whether its parts have rows or not: migrate's choice is two shards per worker);
- `one shard, no fence`.

Each is run `--statements` times a round, `--rounds` rounds in an order that alternates; the
figure is the backend's CPU (from /proc) per statement, median (range). On the one server the
claim and the complete of one step together. A worker's statement of N claims and N completes is
1/k of the step's work on a cluster of k workers: the one server's two statements carry what k
workers' statements carry together (docs/scaling.md, "When one PostgreSQL is not enough: Citus",
the paragraphs "Through the gateway").

    .venv/bin/python bench/worker_statement.py [--claims 2,13] [--statements 1500] [--rounds 3]

Needs Citus installed (as the tests do); every server is stopped and the directory removed in a
`finally`.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import hashlib
import os
import shutil
import statistics
import sys
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

import asyncpg

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))  # tests.citus: the servers the tests start

import citus_pairs  # noqa: E402
import quick  # noqa: E402

from oncegate.store import migrate  # noqa: E402
from oncegate.store.citus import Shard, ShardMap  # noqa: E402
from oncegate.store.postgres.connections import citus_settings, request_settings  # noqa: E402
from oncegate.store.postgres.rows import claims_and_completes  # noqa: E402
from oncegate.store.postgres.workers import statement_of  # noqa: E402
from oncegate.store.queries import DIALECTS, Query  # noqa: E402
from tests import citus  # noqa: E402

DATABASE = "statement"
DIGEST = hashlib.sha256(b"bench").digest()  # a scope and a fingerprint
ANSWER_HEADERS = '[["content-type", "application/json"]]'
ANSWER_BODY = b'{"id":"em_000001"}'
ONE_SERVER = "one server: its claim and complete statements"

# (key, id, fencing token, shard) of a claim the next statement completes.
Claimed = tuple[str, int, int, int]


def backend_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def claims(keys: list[str]) -> dict[str, object]:
    count = len(keys)
    return {
        "routes": ["bench"] * count, "scopes": [DIGEST] * count, "keys": keys,
        "fingerprints": [DIGEST] * count, "leases": [30.0] * count, "ttls": [86_400.0] * count,
        "requests": [None] * count, "requests_sealed_with": [None] * count, "claimant": "bench",
    }  # fmt: skip


def completes(done: list[Claimed]) -> dict[str, object]:
    count = len(done)
    return {
        "keys": [each[0] for each in done], "ids": [each[1] for each in done],
        "tokens": [each[2] for each in done], "statuses": [201] * count,
        "headers": [ANSWER_HEADERS] * count, "bodies": [ANSWER_BODY] * count,
        "stored": [True] * count, "sealed_with": [None] * count, "sealed_headers": [None] * count,
    }  # fmt: skip


def unfenced(query: Query) -> Query:
    """The statement with the fence's call replaced by a test of its argument that passes."""
    if "oncegate_fence(" not in query.sql:
        raise RuntimeError("the worker's statement calls no oncegate_fence any more")
    sql = query.sql.replace("oncegate_fence(", "0 < cardinality(")
    return Query(query.name, sql, query.parameters)


class Worker:
    """One connection to a worker, and new keys drawn for each of its shards as Citus places
    them (`shard_of`: the store's own reading of the shard map)."""

    def __init__(self, connection: asyncpg.Connection, shard_of: Callable[[str], int]) -> None:
        self.connection = connection
        self.shard_of = shard_of
        self.previous: list[Claimed] = []

    def new_key(self, shard: int) -> str:
        while True:
            key = uuid.uuid4().hex
            if self.shard_of(key) == shard:
                return key

    async def step(self, query: Query, shards: list[int], count: int) -> None:
        """`count` claims over `shards` in turn, and the completes of the step before."""
        placed = [shards[index % len(shards)] for index in range(count)]
        keys = [self.new_key(shard) for shard in placed]
        done = self.previous
        values = {
            **claims_and_completes(
                {**claims(keys), "shards": placed},
                {**completes(done), "shards": [each[3] for each in done]},
            ),
            "fence": sorted({*placed, *(each[3] for each in done)}),
        }
        rows = await self.connection.fetch(
            query.sql, *query.arguments({name: values[name] for name in query.parameters})
        )
        self.previous = [
            (keys[row["n"] - 1], row["id"], row["fencing_token"], placed[row["n"] - 1])
            for row in rows
            if row["n"] is not None
        ]
        if len(self.previous) != count:
            raise RuntimeError(f"{count} claims, {len(self.previous)} claimed")


class Single:
    """One connection to the one server: a claim statement and a complete statement a step."""

    def __init__(self, connection: asyncpg.Connection) -> None:
        self.connection = connection
        self.previous: list[Claimed] = []

    async def step(self, count: int) -> None:
        keys = [uuid.uuid4().hex for _ in range(count)]
        claim, complete = DIALECTS["postgres"]["claim"], DIALECTS["postgres"]["complete"]
        rows = await self.connection.fetch(claim.sql, *claim.arguments(claims(keys)))
        if self.previous:
            await self.connection.fetch(complete.sql, *complete.arguments(completes(self.previous)))
        self.previous = [(keys[row["n"] - 1], row["id"], row["fencing_token"], 0) for row in rows]


async def measure(cluster: citus.Cluster, single_url: str, arguments: argparse.Namespace) -> None:
    coordinator = await asyncpg.connect(cluster.url(DATABASE))
    node = cluster.workers[0]
    shards = sorted(
        row["shardid"]
        for row in await coordinator.fetch(
            "SELECT shardid FROM citus_shards"
            " WHERE table_name = 'oncegate_keys'::regclass AND nodeport = $1",
            node.port,
        )
    )
    shard_map = ShardMap(
        [
            Shard(row["low"], row["shardid"], None)
            for row in await coordinator.fetch(
                "SELECT shardminvalue::int AS low, shardid FROM pg_dist_shard"
                " WHERE logicalrelid = 'oncegate_keys'::regclass"
            )
        ]
    )
    await coordinator.close()
    # As the store's pools of a worker and of the one server are set (postgres/workers.py).
    on_worker = await asyncpg.connect(
        node.url(DATABASE),
        server_settings={**request_settings(False), **citus_settings()},
        max_cacheable_statement_size=0,
    )
    on_single = await asyncpg.connect(single_url, server_settings=request_settings(False))
    try:
        worker, single = Worker(on_worker, shard_map.shard_of), Single(on_single)
        worker_pid = await on_worker.fetchval("SELECT pg_backend_pid()")
        single_pid = await on_single.fetchval("SELECT pg_backend_pid()")
        both = statement_of("claim_complete", shards)
        first = statement_of("claim_complete", shards[:1])
        shapes: dict[str, tuple[Query, list[int]]] = {
            "worker, as sent (fenced, 2 shard tables)": (both, shards),
            "worker, no fence": (unfenced(both), shards),
            "worker, one shard table": (first, shards[:1]),
            "worker, one shard table, no fence": (unfenced(first), shards[:1]),
        }
        print(f"$ {quick.command_line()}\n")
        print(
            f"one worker's statement of N claims and the N completes of the statement before"
            f" (the worker's {len(shards)} shards), beside the one server's claim and complete"
            f" statements of the same; backend CPU µs a statement (the one server: its two),"
            f" median (range) of {arguments.rounds} rounds of {arguments.statements}\n"
        )
        print("| N claims + N completes | " + " | ".join([*shapes, ONE_SERVER]) + " | load |")
        print("|---:|" + "---:|" * (len(shapes) + 2))
        for count in arguments.claims:
            runs: dict[str, Callable[[], Awaitable[None]]] = {
                name: functools.partial(worker.step, query, placed, count)
                for name, (query, placed) in shapes.items()
            }
            runs[ONE_SERVER] = functools.partial(single.step, count)
            pids = {name: worker_pid for name in shapes} | {ONE_SERVER: single_pid}
            for name in runs:  # plans made, the fence's function compiled, tables analyzed
                worker.previous = []
                for _ in range(WARM):
                    await runs[name]()
            await on_worker.execute("ANALYZE")
            await on_single.execute("ANALYZE")
            found: dict[str, list[float]] = {name: [] for name in runs}
            for round_ in range(arguments.rounds):
                names = list(runs) if round_ % 2 == 0 else list(reversed(runs))
                for name in names:
                    # Each shape completes only its own claims (another names other shard tables).
                    worker.previous = []
                    before = backend_cpu(pids[name])
                    for _ in range(arguments.statements):
                        await runs[name]()
                    used = backend_cpu(pids[name]) - before
                    found[name].append(used * 1e6 / arguments.statements)
            cells = [
                f"{statistics.median(each):.0f} ({min(each):.0f}-{max(each):.0f})"
                for each in found.values()
            ]
            load = os.getloadavg()[0]
            print(f"| {count} + {count} | " + " | ".join(cells) + f" | {load:.1f} |")
    finally:
        await on_worker.close()
        await on_single.close()


WARM = 200  # statements of each shape before a size's rounds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--claims", type=lambda text: [int(part) for part in text.split(",")], default=[2, 13]
    )
    parser.add_argument("--statements", type=int, default=1500)
    parser.add_argument("--rounds", type=int, default=3)
    arguments = parser.parse_args()
    why = citus.unavailable()
    if why is not None:
        print(f"worker_statement: no Citus here: {why}", file=sys.stderr)
        return 2
    work = citus.temporary_directory("oncegate-worker-statement-")
    try:
        single = citus.Cluster.start(work / "single", workers=0, with_citus=False)
        try:
            cluster = citus.Cluster.start(work / "citus")
            try:
                url = cluster.create_database(DATABASE)
                asyncio.run(citus_pairs.set_shard_count(url, citus_pairs.DEFAULT))
                migrate.upgrade(url)
                single_url = single.create_database(DATABASE)
                migrate.upgrade(single_url)
                asyncio.run(measure(cluster, single_url, arguments))
            finally:
                cluster.stop()
        finally:
            single.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
