"""Claims+completes per second on one PostgreSQL and on a Citus cluster, in one run: what a
claim+complete pair costs PostgreSQL on a shard beside what it costs on a single server.

Both are Debian's PostgreSQL 15 started here with the same settings (tests/citus.py: a
temporary directory, free ports on 127.0.0.1, fsync off on both): a single server, and a Citus
coordinator with two workers, its key table in `--shards` shards (a database per shard count;
`default` leaves `citus.shard_count` alone, so `migrate` chooses, two per worker: the cluster's
default, and the bench's). Each gets oncegate's migrations (`oncegate.store.migrate`: on the cluster
the key table is distributed by key), then the real store (`PostgresStore`, its
batching, per shard on Citus) is driven by `--tasks` asyncio tasks, each claiming a new key and
completing it, over and over, for `--duration` seconds after `--warmup`. Autovacuum is off on
every server; after every run, outside it, `VACUUM (ANALYZE)` runs on every node of the run's
database, and its CPU is printed per pair the run wrote: left on, autovacuum started whenever a
node's tables crossed its thresholds and took its CPU inside whichever run was under way (on
the cluster both workers at once, their shards filling at one pace), so a repeat's ratio turned
on which side it happened to fall. Both sides pay the vacuum, and the column shows what it costs
each. A run during which an autovacuum or autoanalyze ran anyway says so. Before the measured
repeats, each database is driven once so, unmeasured, and vacuumed and analyzed: no repeat runs
on a fresh key table planned without statistics (the one server's first repeat used to read
high). Each repeat runs every target in turn, the order rotated by one target a repeat, and each
row's ratio is to the same repeat's one server.

Printed per target: pairs/s; PostgreSQL's CPU per pair (every postmaster of the target, its
children and the children it reaped, from /proc: on the cluster the coordinator and both
workers); this process's CPU per pair (the store's side: batching, pools, asyncpg, and the
tasks that drive it); how Citus executed the statements (`citus_stat_counters`: single-shard and
multi-shard executions, and the two-phase commits the coordinator recorded in
`pg_dist_transaction` during the run); and the mean operations per statement of the store's
batches (`oncegate_store_batch_size`). Citus's recovery of two-phase commits, which deletes
their records from `pg_dist_transaction` once they are settled, is paused on every node for the
whole run (`citus.recover_2pc_interval = -1`): a count read before and after could otherwise
lose the records it cleared meanwhile, and read fewer commits than were made, or fewer than
none.

    .venv/bin/python bench/citus_pairs.py [--duration 5] [--warmup 1] [--tasks 64] [--repeats 1]
        [--shards default,32,8,2] [--apart] [--at REVISION]

`--apart` adds the cluster per shard count again with a worker's claims and completes in
statements of their own (as the one server always sends them): the two side by side in one run.
`--at REVISION` adds each target again on a database of its own migrated only up to that
revision (the schema before a migration, beside the schema at head); each row's ratio is to the
same repeat's one server of its own kind (at that revision, or at head).

On one machine the cluster cannot be faster than the single server (three servers share its
cores with the client); what the figures show is the cost of a pair on the cluster: docs/
scaling.md turns them into the capacity model. Needs Citus installed (as the tests do); every
server is stopped and the directory removed in a `finally`; the whole run is under SIGALRM.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import re
import shutil
import signal
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import asyncpg

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH.parent))  # tests.citus: the cluster the tests start

import quick  # noqa: E402
import run  # noqa: E402

from oncegate.kernel.sealing import plaintext  # noqa: E402
from oncegate.model.answers import StoredAnswer  # noqa: E402
from oncegate.model.records import Claim  # noqa: E402
from oncegate.store import migrate  # noqa: E402
from oncegate.store.citus import SHARDS_PER_WORKER  # noqa: E402
from oncegate.store.postgres import PostgresStore  # noqa: E402
from oncegate.store.postgres.dialect import OnCitus  # noqa: E402
from oncegate.telemetry import metrics  # noqa: E402
from tests import citus  # noqa: E402

SCOPE = bytes(32)
FINGERPRINT = bytes(32)
ANSWER = plaintext([("content-type", "application/json")], b'{"id":"em_000001"}')
DATABASE = "oncegate_bench"
ONE_SERVER = "PostgreSQL 15, one server"
APART = ", claims and completes apart"
DEFAULT = 0  # a `--shards` of `default`: citus.shard_count left alone, migrate chooses
STARTUP_TIMEOUT = 120.0
Target = TypeVar("Target")


# The store's batchers: claims, completes, and on Citus a worker's claims and completes together.
OPERATIONS = ("claim", "complete", "claim_complete")


@dataclass
class Sample:
    target: str
    repeat: int
    pairs_per_second: float
    postgres_ms_per_pair: float
    coordinator_ms_per_pair: float | None  # on the cluster: the coordinator's share
    client_ms_per_pair: float  # this process: the store's side (and the tasks that drive it)
    single_shard: int | None
    multi_shard: int | None
    two_phase: int | None
    batch: dict[str, float]
    failures: int
    written: int = 0  # pairs the run wrote, its warm-up and last tasks' included
    autovacuums: int = 0  # autovacuum and autoanalyze runs on its nodes during the run
    vacuum_ms_per_pair: float | None = None  # the VACUUM (ANALYZE) after it, per pair written


def batch_means() -> dict[str, tuple[float, float]]:
    """Per operation: (sum, count) of the store's batch sizes so far."""
    found: dict[str, list[float]] = {}
    for family in metrics.STORE_BATCH_SIZE.collect():
        for sample in family.samples:
            operation = sample.labels.get("operation", "")
            if sample.name.endswith("_sum"):
                found.setdefault(operation, [0.0, 0.0])[0] = sample.value
            elif sample.name.endswith("_count"):
                found.setdefault(operation, [0.0, 0.0])[1] = sample.value
    return {operation: (total, count) for operation, (total, count) in found.items()}


async def citus_counters(url: str) -> tuple[int, int, int] | None:
    connection = await asyncpg.connect(url)
    try:
        if not await connection.fetchval(
            "SELECT EXISTS (SELECT FROM pg_extension WHERE extname = 'citus')"
        ):
            return None
        row = await connection.fetchrow(
            "SELECT query_execution_single_shard, query_execution_multi_shard,"
            " (SELECT count(*) FROM pg_dist_transaction)"
            " FROM citus_stat_counters WHERE name = current_database()"
        )
        return (row[0], row[1], row[2])
    finally:
        await connection.close()


async def measure(
    target: str, endpoint: Endpoint, arguments: argparse.Namespace, repeat: int = 0
) -> Sample:
    url, postmasters = endpoint.url, endpoint.postmasters
    together = OnCitus.together
    OnCitus.together = not target.endswith(APART)  # read as the store opens
    try:
        store = await PostgresStore.connect(url)
    finally:
        OnCitus.together = together
    failures = 0
    measuring = False
    pairs = written = 0
    stop = asyncio.Event()
    autovacuums_before = await autovacuums(endpoint.node_urls)

    async def task() -> None:
        nonlocal failures, pairs, written
        while not stop.is_set():
            key = str(uuid.uuid4())
            claimed = await store.requests.claim("bench", SCOPE, key, FINGERPRINT, 30, 86_400)
            if not isinstance(claimed, Claim) or not await store.requests.complete(
                claimed, StoredAnswer(201, ANSWER)
            ):
                failures += 1
                continue
            written += 1
            if measuring:
                pairs += 1

    try:
        tasks = [asyncio.create_task(task()) for _ in range(arguments.tasks)]
        await asyncio.sleep(arguments.warmup)
        groups = {f"node{index}": [pid] for index, pid in enumerate(postmasters)}
        before_cpu = run.cpu_seconds(groups)
        before_client = time.process_time()
        before_counters = await citus_counters(url)
        before_batches = batch_means()
        measuring, started = True, time.monotonic()
        await asyncio.sleep(arguments.duration)
        measuring, elapsed = False, time.monotonic() - started
        after_cpu = run.cpu_seconds(groups)
        client = time.process_time() - before_client
        after_batches = batch_means()
        stop.set()
        await asyncio.gather(*tasks)
        after_counters = await citus_counters(url)
    finally:
        await store.close()
    batch = {}
    for operation in OPERATIONS:
        total, count = after_batches.get(operation, (0.0, 0.0))
        total_before, count_before = before_batches.get(operation, (0.0, 0.0))
        if count > count_before:
            batch[operation] = (total - total_before) / (count - count_before)
    single = multi = two_phase = None
    if before_counters is not None and after_counters is not None:
        single, multi, two_phase = (
            after - before for after, before in zip(after_counters, before_counters, strict=True)
        )
    used = {name: after_cpu[name] - before_cpu[name] for name in groups}
    return Sample(
        target,
        repeat,
        pairs / elapsed,
        sum(used.values()) * 1000 / max(pairs, 1),
        used["node0"] * 1000 / max(pairs, 1) if len(groups) > 1 else None,
        client * 1000 / max(pairs, 1),
        single,
        multi,
        two_phase,
        batch,
        failures,
        written,
        await autovacuums(endpoint.node_urls) - autovacuums_before,
    )


async def autovacuums(node_urls: list[str]) -> int:
    """Autovacuum and autoanalyze runs so far on these nodes' databases, of every table (a
    worker's shard tables too: Citus hides them from `pg_class` unless told not to)."""
    found = 0
    for node_url in node_urls:
        connection = await asyncpg.connect(node_url)
        try:
            # On plain PostgreSQL a placeholder setting, which hides nothing.
            await connection.execute("SET citus.override_table_visibility = off")
            found += await connection.fetchval(
                "SELECT coalesce(sum(autovacuum_count + autoanalyze_count), 0)::bigint"
                " FROM pg_stat_user_tables"
            )
        finally:
            await connection.close()
    return found


async def autovacuum_off(urls: list[str]) -> None:
    """No autovacuum on these servers: the bench vacuums after each run instead (`vacuum`).
    Left on, it started when a node's tables crossed its thresholds, once a minute at most, and
    took a node's CPU inside whichever run was under way: under `citus_scale.py`'s quota a
    fourth of each worker's in a run of four workers (0.20-0.36 of its 0.8 CPU seconds), which
    then carried half its pairs, while the one server's runs happened to miss it, or the other
    way round."""
    for url in urls:
        connection = await asyncpg.connect(url)
        try:
            await connection.execute("ALTER SYSTEM SET autovacuum = off")
            await connection.execute("SELECT pg_reload_conf()")
        finally:
            await connection.close()


async def vacuum(endpoint: Endpoint) -> float:
    """`VACUUM (ANALYZE)` on every node of the endpoint's database (the one server's key table,
    or the coordinator's and each worker's shard tables), outside any run: the CPU seconds its
    postmasters used meanwhile."""
    groups = {f"node{index}": [pid] for index, pid in enumerate(endpoint.postmasters)}
    before = run.cpu_seconds(groups)
    for node_url in endpoint.node_urls:
        connection = await asyncpg.connect(node_url)
        try:
            await connection.execute("VACUUM (ANALYZE)")
        finally:
            await connection.close()
    after = run.cpu_seconds(groups)
    return sum(after[name] - before[name] for name in groups)


def measured(target: str, endpoint: Endpoint, arguments: argparse.Namespace, repeat: int) -> Sample:
    """One run of the target, then the VACUUM (ANALYZE) of what it wrote, outside the run."""
    sample = asyncio.run(measure(target, endpoint, arguments, repeat))
    used = asyncio.run(vacuum(endpoint))
    sample.vacuum_ms_per_pair = used * 1000 / max(sample.written, 1)
    return sample


@dataclass
class Endpoint:
    url: str  # the database the store connects to (a cluster's coordinator)
    postmasters: list[int]
    node_urls: list[str]  # every node's URL of the database, for VACUUM (ANALYZE)
    revision: str = "head"  # what `migrate` upgrades it to


def at(revision: str) -> str:
    """The suffix of a target whose database is migrated only up to `revision`."""
    return f", schema at {revision}"


@contextmanager
def servers(
    work: Path, shard_counts: list[int], apart: bool = False, revision: str | None = None
) -> Iterator[dict[str, Endpoint]]:
    """The targets by name: one server, and the cluster once per shard count (a database of its
    own, distributed with that many shards); with `revision`, each again in a database of its
    own migrated up to it."""
    single = citus.Cluster.start(work / "single", workers=0, with_citus=False)
    try:
        cluster = citus.Cluster.start(work / "citus")
        try:
            asyncio.run(pause_2pc_recovery(cluster))
            asyncio.run(autovacuum_off([single.url()] + [node.url() for node in cluster.nodes]))
            single.create_database(DATABASE)
            one_server = ONE_SERVER
            targets = {
                one_server: Endpoint(
                    single.url(DATABASE), single.postmasters(), [single.url(DATABASE)]
                )
            }
            if revision is not None:
                single.create_database(f"{DATABASE}_at")
                url = single.url(f"{DATABASE}_at")
                targets[one_server + at(revision)] = Endpoint(
                    url, single.postmasters(), [url], revision
                )
            for shards in shard_counts:
                if shards == DEFAULT:
                    shards_named = f"{SHARDS_PER_WORKER * citus.WORKERS} shards (migrate's choice)"
                else:
                    shards_named = f"{shards} shards"
                name = f"Citus, coordinator + {citus.WORKERS} workers, {shards_named}"
                for suffix, database in [("", f"{DATABASE}_{shards}")] + (
                    [] if revision is None else [(at(revision), f"{DATABASE}_{shards}_at")]
                ):
                    url = cluster.create_database(database)
                    asyncio.run(set_shard_count(url, shards))
                    node_urls = [node.url(database) for node in cluster.nodes]
                    targets[name + suffix] = Endpoint(
                        url, cluster.postmasters(), node_urls, revision if suffix else "head"
                    )
                if apart:
                    targets[name + APART] = targets[name]
            yield targets
        finally:
            cluster.stop()
    finally:
        single.stop()


def in_order(targets: list[Target], repeat: int) -> list[Target]:
    """Repeat `repeat`'s order (from 1): the targets rotated by one place a repeat, so that none
    always runs first, on a machine fresh from the last target's run, or after the same one."""
    shift = (repeat - 1) % len(targets)
    return targets[shift:] + targets[:shift]


def ratio(sample: Sample, samples: list[Sample]) -> float | None:
    """The sample's PostgreSQL CPU per pair over the same repeat's one server's of its kind (at
    the revision for a target at a revision; the one server, which always sends claims and
    completes apart, for a cluster apart)."""
    kind = re.search(f"{re.escape(at(''))}.*$", sample.target)
    one_server = ONE_SERVER + (kind.group(0) if kind else "")
    for other in samples:
        if other.repeat == sample.repeat and other.target == one_server:
            return sample.postgres_ms_per_pair / max(other.postgres_ms_per_pair, 1e-9)
    return None


async def pause_2pc_recovery(cluster: citus.Cluster) -> None:
    """Keep every two-phase commit's record in `pg_dist_transaction` until the servers stop, so
    the count of those made during a run is the difference of two reads (the module's rules)."""
    for node in cluster.nodes:
        connection = await asyncpg.connect(node.url())
        try:
            await connection.execute("ALTER SYSTEM SET citus.recover_2pc_interval = -1")
            await connection.execute("SELECT pg_reload_conf()")
            # A reload is taken by each process at its next command: wait for this one's.
            for _ in range(100):
                if await connection.fetchval("SHOW citus.recover_2pc_interval") == "-1":
                    break
                await asyncio.sleep(0.05)
            else:
                raise RuntimeError(f"{node.name}: citus.recover_2pc_interval is not -1")
        finally:
            await connection.close()


def shard_counts(text: str) -> list[int]:
    """`--shards`: counts, or `default` (DEFAULT: `migrate` chooses)."""
    return [DEFAULT if part == "default" else int(part) for part in text.split(",")]


async def set_shard_count(url: str, shards: int) -> None:
    """`migrate` distributes the key table into the database's `citus.shard_count` shards;
    DEFAULT leaves it at Citus's default (the tests' cluster sets its own per database)."""
    connection = await asyncpg.connect(url)
    try:
        database = await connection.fetchval("SELECT current_database()")
        setting = (
            "RESET citus.shard_count"
            if shards == DEFAULT
            else f"SET citus.shard_count = {shards:d}"
        )
        await connection.execute(f"ALTER DATABASE {database} {setting}")
    finally:
        await connection.close()


def table(samples: list[Sample]) -> str:
    lines = [
        "| repeat | target | pairs/s | PostgreSQL CPU per pair (coordinator + workers)"
        " | x the repeat's one server | the store's process, CPU per pair"
        " | single-shard / multi-shard executions | two-phase commits"
        " | operations per statement (claim / complete / both)"
        " | VACUUM after, CPU per pair written | autovacuums in the run | failures |",
        "|---:|---|---:|---:|---:|---:|---|---:|---|---:|---:|---:|",
    ]
    for sample in samples:
        executions = (
            "(plain PostgreSQL)"
            if sample.single_shard is None
            else f"{sample.single_shard:,} / {sample.multi_shard:,}"
        )
        two_phase = "-" if sample.two_phase is None else f"{sample.two_phase}"
        batch = " / ".join(f"{sample.batch.get(operation, 0):.1f}" for operation in OPERATIONS)
        cpu = f"{sample.postgres_ms_per_pair:.3f} ms"
        if sample.coordinator_ms_per_pair is not None:
            workers = sample.postgres_ms_per_pair - sample.coordinator_ms_per_pair
            cpu += f" ({sample.coordinator_ms_per_pair:.3f} + {workers:.3f})"
        times = ratio(sample, samples)
        vacuumed = (
            "-" if sample.vacuum_ms_per_pair is None else f"{sample.vacuum_ms_per_pair:.3f} ms"
        )
        lines.append(
            f"| {sample.repeat} | {sample.target} | {sample.pairs_per_second:,.0f} | {cpu} |"
            f" {'-' if times is None else f'{times:.2f}x'} | {sample.client_ms_per_pair:.3f} ms |"
            f" {executions} | {two_phase} | {batch} | {vacuumed} | {sample.autovacuums} |"
            f" {sample.failures} |"
        )
    return "\n".join(lines)


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--tasks", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument(
        "--shards",
        type=shard_counts,
        default=[DEFAULT],
        metavar="N,N,...",
        help="the key table's shard counts on the cluster, one target each; `default` leaves"
        " citus.shard_count at Citus's default, and migrate chooses (the default)",
    )
    parser.add_argument(
        "--apart",
        action="store_true",
        help="each cluster again with a worker's claims and completes in statements of their own",
    )
    parser.add_argument(
        "--at",
        metavar="REVISION",
        help="each target again on a database migrated only up to REVISION, side by side",
    )
    return parser.parse_args()


def main() -> int:
    arguments = parse_arguments()
    why = citus.unavailable()
    if why is not None:
        print(f"citus_pairs: no Citus here: {why}", file=sys.stderr)
        return 2
    kinds = 1 + (arguments.at is not None)
    runs = (kinds + len(arguments.shards) * (kinds + arguments.apart)) * arguments.repeats
    runs += (1 + len(arguments.shards)) * kinds  # the warm-ups
    budget = STARTUP_TIMEOUT + runs * (arguments.warmup + arguments.duration + 30)

    def out_of_time(signum: int, frame: object) -> None:
        raise TimeoutError(f"the benchmark ran out of its {budget:.0f}s budget")

    signal.signal(signal.SIGALRM, out_of_time)
    signal.alarm(math.ceil(budget))
    metrics.setup()
    work = citus.temporary_directory("oncegate-citus-pairs-")
    samples: list[Sample] = []
    try:
        with servers(work, arguments.shards, arguments.apart, arguments.at) as targets:
            databases = {endpoint.url: name for name, endpoint in reversed(targets.items())}
            for url, name in databases.items():
                migrate.upgrade(url, targets[name].revision)
                sample = measured(name, targets[name], arguments, 0)
                run.progress(
                    f"warm-up {name}: {sample.pairs_per_second:,.0f} pairs/s, then VACUUM"
                    " (ANALYZE) on every node"
                )
            for repeat in range(1, arguments.repeats + 1):
                for target in in_order(list(targets), repeat):
                    sample = measured(target, targets[target], arguments, repeat)
                    samples.append(sample)
                    run.progress(
                        f"{target}: {sample.pairs_per_second:,.0f} pairs/s,"
                        f" PostgreSQL {sample.postgres_ms_per_pair:.3f} ms/pair"
                    )
        print(
            f"{arguments.tasks} asyncio tasks on PostgresStore, each a claim then a complete of a"
            f" new key; {arguments.warmup:g} s warm-up + {arguments.duration:g} s per run,"
            " every database first driven once unmeasured, autovacuum off and VACUUM (ANALYZE)"
            " on every node after every run, outside it, the order rotated each repeat; CPU"
            " from /proc"
        )
        print(f"\n$ {quick.command_line()}\n")
        print(table(samples))
        signal.alarm(0)
        return 1 if any(sample.failures for sample in samples) else 0
    except (RuntimeError, TimeoutError, asyncpg.PostgresError, OSError) as exc:
        print(f"citus_pairs failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        signal.alarm(0)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
