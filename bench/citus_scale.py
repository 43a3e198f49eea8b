"""Scale-out on Citus, shown: claim+complete pairs per second when every PostgreSQL node has the
same CPU, for one plain server and for clusters of 1, 2 and 4 workers.

Every node (the plain server, a cluster's coordinator and each worker) runs in a cgroup of its
own with the same CPU quota (`--quota` cores: cgroup v1 `cpu.cfs_quota_us`, or v2 `cpu.max`),
so a node stands for one machine of that size, and with the CPU weight its processes had at the
bench's own nice (a cgroup otherwise weighs as a process at nice 0: on a busy machine a node then
got less than its quota). Each cluster runs twice: its coordinator at the quota, and again with
the coordinator unlimited (what the workers carry when the coordinator is not the limit). The
load is the real store (`PostgresStore`, as bench/citus_pairs.py drives it: `--tasks` asyncio
tasks, each claiming a new key and completing it) in this process.

Every target is started first and stays up, with autovacuum off on every node. After every run,
outside it, `VACUUM (ANALYZE)` runs on every node of the target's database (the one server's key
table, a worker's shard tables), each node's quota lifted meanwhile; its CPU on the nodes that
carry the writes is printed per pair the run wrote. So every measured run starts on a key table
vacuumed and analyzed, on the one server as on the workers, and no vacuum falls inside a run:
left on, autovacuum started whenever a node's tables crossed its thresholds (once a minute at
most) and took a quota'd node's CPU inside whichever run was under way, a fourth of each
worker's quota in some runs of four workers, which then carried half their pairs, while other
runs, the one server's or the cluster's, happened to miss it. The vacuum's cost is not hidden:
both sides pay it, and the column shows what it costs each per pair. A run during which an
autovacuum or autoanalyze ran anyway gets no verdict. A warm-up round, not measured, drives
each database as a measured run would, so every measured run finds its key table written and
analyzed as a production server's is, rather than a fresh table planned without statistics
(the first round's one server read twice the CPU a pair of the later ones). Then `--rounds`
rounds (an odd number: the median is one round's figure) each drive every target in turn, the
order rotated by one target a round so that no target always runs first or after the same one;
a slow minute of the shared machine falls on every target of a round rather than on one, and
each cluster's ratio is taken against the one server of the same round. The summary gives each
target's median and range. (At a tenth of a core, the one server's pairs/s at its quota
differed by 2x between runs minutes apart.)

Printed per run: pairs/s and its ratio to the round's plain server; PostgreSQL's CPU per pair
(the one server's, or the workers' together); each node's CPU as a share of its quota and the
share of its cgroup's periods that were throttled (a node at its quota is the bound it stands
for: `bound` when it used 85% or more); the store's operations per statement (claims / completes
/ a worker's claims and completes together); the CPU of the `VACUUM (ANALYZE)` after the run
per pair it wrote (warm-up and the last tasks' pairs included); and the load side's CPU (this
process: it must not be the limit, `load-bound` when it used 85% of one core). The targets: 4
workers >= 3x the plain server, 2 workers >= 1.7x, judged on the median of the rounds' ratios,
and only where the comparison is the one they name: every node of the cluster at the quota (a
cluster with its coordinator unlimited prints its ratio and `n/a`), and in every round the one
server and each worker bound at it, the load side not, and no autovacuum during the run
(otherwise `n/a`, saying which round and node).

    .venv/bin/python bench/citus_scale.py [--quota 0.25] [--duration 5] [--warmup 3]
        [--tasks 64] [--workers 1,2,4] [--shards-per-worker 2] [--rounds 3]

Needs root and a writable cgroup hierarchy with the cpu controller (it says `skipped` and exits
0 where there is none), and Citus (as the tests do). Cgroups are made under the hierarchy's root
as `oncegate-scale-<pid>-<node>` and removed, and every server stopped, in a `finally`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import statistics
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import asyncpg

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH.parent))  # tests.citus: the cluster the tests start

import citus_pairs  # noqa: E402
import quick  # noqa: E402
import run  # noqa: E402

from oncegate.model.answers import StoredAnswer  # noqa: E402
from oncegate.model.records import Claim  # noqa: E402
from oncegate.store import migrate  # noqa: E402
from oncegate.store.postgres import PostgresStore  # noqa: E402
from oncegate.telemetry import metrics  # noqa: E402
from tests import citus  # noqa: E402

CGROUP_ROOT = Path("/sys/fs/cgroup")
PERIOD_US = 100_000
BOUND = 0.85  # a share of the quota (or of one core, for the load side) that counts as the limit
ANSWER = StoredAnswer(201, citus_pairs.ANSWER)


class Cgroup:
    """One node's cgroup with a CPU quota (v1 or v2)."""

    def __init__(self, name: str) -> None:
        self.v2 = (CGROUP_ROOT / "cgroup.controllers").exists()
        self.path = (CGROUP_ROOT if self.v2 else CGROUP_ROOT / "cpu") / name
        self.path.mkdir()
        # The weight the node's processes had at this process's nice, before they left its
        # autogroup for the cgroup: a cgroup weighs as a process at nice 0, so on a busy machine
        # a node at its quota got less than the quota (workers at 34-87% of it while other jobs
        # ran) and the run got no verdict. The quota still caps what it takes.
        weight = 1024 * 1.25 ** -os.getpriority(os.PRIO_PROCESS, 0)
        if self.v2:
            (self.path / "cpu.weight").write_text(str(min(10_000, max(1, round(weight / 10.24)))))
        else:
            (self.path / "cpu.shares").write_text(str(max(2, round(weight))))

    def limit(self, cores: float | None) -> None:
        quota = -1 if cores is None else int(cores * PERIOD_US)
        if self.v2:
            text = "max" if quota < 0 else str(quota)
            (self.path / "cpu.max").write_text(f"{text} {PERIOD_US}")
        else:
            (self.path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (self.path / "cpu.cfs_quota_us").write_text(str(quota))

    def take(self, root: int) -> None:
        """The process and every descendant it has now (later ones are born inside)."""
        children: dict[int, list[int]] = {}
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    continue
                children.setdefault(parent, []).append(int(entry.name))
        pending = [root]
        while pending:
            pid = pending.pop()
            try:
                (self.path / "cgroup.procs").write_text(str(pid))
            except OSError:
                continue  # gone meanwhile
            pending.extend(children.get(pid, []))

    def throttling(self) -> tuple[int, int]:
        """(periods, throttled periods) so far."""
        fields = dict(
            line.split() for line in (self.path / "cpu.stat").read_text().splitlines() if line
        )
        return int(fields.get("nr_periods", 0)), int(fields.get("nr_throttled", 0))

    def remove(self) -> None:
        parent = self.path.parent / "cgroup.procs"
        for pid in (self.path / "cgroup.procs").read_text().split():
            try:
                parent.write_text(pid)
            except OSError:
                continue
        self.path.rmdir()


def unavailable() -> str | None:
    """Why no node can be given a CPU quota here, or None."""
    if os.geteuid() != 0:
        return "not root: cannot make cgroups"
    v2 = (CGROUP_ROOT / "cgroup.controllers").exists()
    if v2:
        if "cpu" not in (CGROUP_ROOT / "cgroup.subtree_control").read_text().split():
            return "cgroup v2 without the cpu controller enabled at its root"
    elif not (CGROUP_ROOT / "cpu" / "cpu.cfs_quota_us").exists():
        return f"no cgroup cpu controller at {CGROUP_ROOT}"
    probe = (CGROUP_ROOT if v2 else CGROUP_ROOT / "cpu") / f"oncegate-scale-probe-{os.getpid()}"
    try:
        probe.mkdir()
        probe.rmdir()
    except OSError as exc:
        return f"cannot make a cgroup: {exc}"
    return citus.unavailable()


@dataclass
class Node:
    name: str
    pid: int
    cgroup: Cgroup
    quota: float | None  # cores, None: unlimited


@dataclass
class Result:
    target: str
    round: int
    pairs_per_second: float
    nodes: list[tuple[str, float | None, float, float]]  # name, quota, cores used, throttled
    load_cores: float
    failures: int
    batch: dict[str, float]  # operation -> mean operations per statement, during the run
    written: int = 0  # pairs the run wrote, warm-up and the last tasks' included
    vacuum: float | None = None  # CPU seconds of the VACUUM after the run (the writing nodes)
    autovacuums: int = 0  # autovacuum and autoanalyze runs on the nodes during the run


@dataclass
class Target:
    """One plain server, or a cluster with its coordinator at the quota or unlimited: the
    servers stay up for every round, so the rounds can alternate between the targets."""

    name: str
    url: str
    nodes: list[Node]
    coordinator_quota: float | None
    node_urls: list[str]  # each node's URL of the database, for VACUUM
    citus: bool


async def drive(target: Target, arguments: argparse.Namespace, round_: int) -> Result:
    nodes = target.nodes
    nodes[0].cgroup.limit(target.coordinator_quota)
    nodes[0].quota = target.coordinator_quota
    autovacuums_before = await citus_pairs.autovacuums(target.node_urls)
    store = await PostgresStore.connect(target.url)
    stop = asyncio.Event()
    measuring = False
    pairs = failures = written = 0

    async def task() -> None:
        nonlocal pairs, failures, written
        while not stop.is_set():
            claimed = await store.requests.claim(
                "bench", citus_pairs.SCOPE, str(uuid.uuid4()), citus_pairs.FINGERPRINT, 30, 86_400
            )
            if not isinstance(claimed, Claim) or not await store.requests.complete(claimed, ANSWER):
                failures += 1
                continue
            written += 1
            if measuring:
                pairs += 1

    try:
        tasks = [asyncio.create_task(task()) for _ in range(arguments.tasks)]
        await asyncio.sleep(arguments.warmup)
        groups = {node.name: [node.pid] for node in nodes}
        cpu_before = run.cpu_seconds(groups)
        throttling_before = {node.name: node.cgroup.throttling() for node in nodes}
        batches_before = citus_pairs.batch_means()
        load_before = time.process_time()
        measuring, started = True, time.monotonic()
        await asyncio.sleep(arguments.duration)
        measuring, elapsed = False, time.monotonic() - started
        load = (time.process_time() - load_before) / elapsed
        cpu_after = run.cpu_seconds(groups)
        batches_after = citus_pairs.batch_means()
        throttled = {}
        for node in nodes:
            periods, count = node.cgroup.throttling()
            periods_before, count_before = throttling_before[node.name]
            throttled[node.name] = (count - count_before) / max(periods - periods_before, 1)
        stop.set()
        await asyncio.gather(*tasks)
    finally:
        await store.close()
    used = [
        (node.name, node.quota, (cpu_after[node.name] - cpu_before[node.name]) / elapsed,
         throttled[node.name])
        for node in nodes
    ]  # fmt: skip
    batch = {}
    for operation in citus_pairs.OPERATIONS:
        total, count = batches_after.get(operation, (0.0, 0.0))
        total_before, count_before = batches_before.get(operation, (0.0, 0.0))
        if count > count_before:
            batch[operation] = (total - total_before) / (count - count_before)
    return Result(
        target.name, round_, pairs / elapsed, used, load, failures, batch, written,
        autovacuums=await citus_pairs.autovacuums(target.node_urls) - autovacuums_before,
    )  # fmt: skip


async def vacuum(target: Target) -> float:
    """`VACUUM (ANALYZE)` on every node of the target's database, each node's quota lifted
    meanwhile and set back after: the CPU seconds it took on the nodes that carry the writes
    (the one server, or the workers)."""
    used = 0.0
    for node, node_url in zip(target.nodes, target.node_urls, strict=True):
        node.cgroup.limit(None)
        try:
            before = run.cpu_seconds({node.name: [node.pid]})[node.name]
            connection = await asyncpg.connect(node_url)
            try:
                await connection.execute("VACUUM (ANALYZE)")
            finally:
                await connection.close()
            if node.name != "coordinator" or not target.citus:
                used += run.cpu_seconds({node.name: [node.pid]})[node.name] - before
        finally:
            node.cgroup.limit(node.quota)
    return used


def measure(target: Target, arguments: argparse.Namespace, round_: int) -> Result:
    """One run of the target, then `VACUUM (ANALYZE)` of what it wrote, outside the run."""
    result = asyncio.run(drive(target, arguments, round_))
    result.vacuum = asyncio.run(vacuum(target))
    return result


def nodes_of(cluster: citus.Cluster, quota: float, prefix: str) -> list[Node]:
    pids = cluster.postmasters()
    names = [node.name for node in cluster.nodes]
    found = []
    for name, pid in zip(names, pids, strict=True):
        cgroup = Cgroup(f"{prefix}-{name}")
        cgroup.limit(quota)
        cgroup.take(pid)
        found.append(Node(name, pid, cgroup, quota))
    return found


def start_targets(
    work: Path, workers: int, arguments: argparse.Namespace, clusters: list[citus.Cluster],
    cgroups: list[Cgroup],
) -> list[Target]:  # fmt: skip
    """One plain server (workers 0), or a cluster twice: its coordinator at the quota, and
    unlimited. Started, migrated and put in their cgroups; stopped by the caller."""
    with_citus = workers > 0
    cluster = citus.Cluster.start(work / f"nodes{workers}", workers=workers, with_citus=with_citus)
    clusters.append(cluster)
    url = cluster.create_database(citus_pairs.DATABASE)
    if with_citus:
        shards = max(1, arguments.shards_per_worker * workers)
        asyncio.run(citus_pairs.set_shard_count(url, shards))
    migrate.upgrade(url)
    asyncio.run(citus_pairs.autovacuum_off([node.url() for node in cluster.nodes]))
    nodes = nodes_of(cluster, arguments.quota, f"oncegate-scale-{os.getpid()}-{workers}")
    cgroups.extend(node.cgroup for node in nodes)
    node_urls = [node.url(citus_pairs.DATABASE) for node in cluster.nodes]
    if not with_citus:
        return [Target(SINGLE, url, nodes, arguments.quota, node_urls, False)]
    name = f"Citus, {workers} worker{'s' if workers > 1 else ''} ({shards} shards)"
    return [
        Target(f"{name}{AT_QUOTA}", url, nodes, arguments.quota, node_urls, True),
        Target(f"{name}{UNLIMITED}", url, nodes, None, node_urls, True),
    ]


def warm_up(targets: list[Target], arguments: argparse.Namespace) -> None:
    """The unmeasured round: each database driven as a measured run drives it, then vacuumed
    and analyzed."""
    first: dict[str, Target] = {}
    for target in targets:
        first.setdefault(target.url, target)  # a cluster's coordinator at the quota
    for target in first.values():
        result = measure(target, arguments, 0)
        run.progress(
            f"warm-up {target.name}: {result.pairs_per_second:,.0f} pairs/s, then VACUUM"
            " (ANALYZE) on every node"
        )


SINGLE = "PostgreSQL 15, one server"
AT_QUOTA = ", coordinator at quota"
UNLIMITED = ", coordinator unlimited"


def _nodes_shown(result: Result) -> str:
    shown = []
    for name, node_quota, cores, throttled in result.nodes:
        share = cores / node_quota if node_quota else None
        bound = share is not None and share >= BOUND
        used = f"{cores:.2f} cores" if share is None else f"{share:.0%}"
        shown.append(f"{name} {used}, {throttled:.0%} throttled{' (bound)' if bound else ''}")
    return "; ".join(shown)


def _batch_shown(result: Result) -> str:
    return " / ".join(
        f"{result.batch[operation]:.1f}" if operation in result.batch else "-"
        for operation in citus_pairs.OPERATIONS
    )


def _per_pair(result: Result) -> str:
    """PostgreSQL CPU per pair in ms: the one server's, or the workers' together (the
    coordinator's share is in the nodes column), to read beside the one server's."""
    used = [cores for name, _, cores, _ in result.nodes if name != "coordinator"]
    cores = sum(used) if used else result.nodes[0][2]
    return f"{cores * 1000 / max(result.pairs_per_second, 1e-9):.3f}"


def _vacuum_shown(result: Result) -> str:
    if result.vacuum is None or not result.written:
        return "-"
    return f"{result.vacuum * 1000 / result.written:.3f}"


def ratios(results: list[Result]) -> dict[str, list[float]]:
    """Per target, each round's pairs/s over the same round's one server."""
    single = {
        result.round: result.pairs_per_second for result in results if result.target == SINGLE
    }
    found: dict[str, list[float]] = {}
    for result in results:
        if single.get(result.round):
            found.setdefault(result.target, []).append(
                result.pairs_per_second / single[result.round]
            )
    return found


def table(results: list[Result]) -> str:
    lines = [
        "| round | target | pairs/s | x the round's one server | PostgreSQL CPU ms per pair (the"
        " one server, or the workers together) | each node: CPU used of its quota, throttled"
        " periods | operations per statement (claim / complete / both) | VACUUM (ANALYZE) after"
        " the run, CPU ms per pair it wrote | load side (cores) | failures |",
        "|---:|---|---:|---:|---:|---|---|---:|---:|---:|",
    ]
    single = {
        result.round: result.pairs_per_second for result in results if result.target == SINGLE
    }
    for result in results:
        ratio = result.pairs_per_second / single[result.round] if single.get(result.round) else 0.0
        load = f"{result.load_cores:.2f}{' (load-bound)' if result.load_cores >= BOUND else ''}"
        lines.append(
            f"| {result.round} | {result.target} | {result.pairs_per_second:,.0f} | {ratio:.2f}x |"
            f" {_per_pair(result)} | {_nodes_shown(result)} | {_batch_shown(result)} |"
            f" {_vacuum_shown(result)} | {load} | {result.failures} |"
        )
    return "\n".join(lines)


def summary(results: list[Result]) -> str:
    """Per target: the median of its rounds (pairs/s, and its ratio to the same round's one
    server), with the range."""
    lines = [
        "| target | pairs/s, median (range) | x one server, median of the rounds (range) |",
        "|---|---:|---:|",
    ]
    found = ratios(results)
    for target in dict.fromkeys(result.target for result in results):
        rates = [r.pairs_per_second for r in results if r.target == target]
        each = found.get(target, [0.0])
        lines.append(
            f"| {target} | {statistics.median(rates):,.0f} ({min(rates):,.0f}-{max(rates):,.0f})"
            f" | {statistics.median(each):.2f}x ({min(each):.2f}-{max(each):.2f}) |"
        )
    return "\n".join(lines)


def unfit(result: Result) -> str | None:
    """Why a run cannot stand for the scale-out its target names, or None: a node without a
    quota, the one server or a worker short of it, or the load side at its own limit."""
    for name, quota, _, _ in result.nodes:
        if quota is None:
            return f"the {name} unlimited, not every node at the quota"
    for name, quota, cores, _ in result.nodes:
        writes = name != "coordinator" or result.target == SINGLE  # a worker, or the one server
        if writes and quota is not None and cores / quota < BOUND:
            return f"round {result.round}: the {name} at {cores / quota:.0%} of its quota"
    if result.autovacuums:
        return f"round {result.round}: {result.autovacuums} autovacuum runs during the run"
    if result.load_cores >= BOUND:
        return f"round {result.round}: the load side bound ({result.load_cores:.2f} cores)"
    return None


def verdicts(results: list[Result]) -> list[str]:
    """PASS or FAIL per cluster of 4 and of 2 workers on the median of its rounds' ratios, or
    n/a with the reason where a run of it, or of its rounds' one server, does not qualify."""
    found = []
    found_ratios = ratios(results)
    for workers, target in ((4, 3.0), (2, 1.7)):
        for name, each in found_ratios.items():
            if not name.startswith(f"Citus, {workers} workers"):
                continue
            rounds = {result.round for result in results if result.target == name}
            why = next(
                (
                    reason
                    for result in results
                    if result.round in rounds and result.target in (name, SINGLE)
                    for reason in [unfit(result)]
                    if reason is not None
                ),
                None,
            )
            ratio = statistics.median(each)
            measured = f"{ratio:.2f}x (median of {len(each)} rounds)"
            if why is not None:
                found.append(f"n/a {name} >= {target}x one server: {measured}; no verdict: {why}")
            else:
                verdict = "PASS" if ratio >= target else "FAIL"
                found.append(f"{verdict} {name} >= {target}x one server: {measured}")
    return found


def odd_rounds(text: str) -> int:
    """`--rounds`: an odd count, so that the median of the rounds' ratios is one round's."""
    rounds = int(text)
    if rounds < 1 or rounds % 2 == 0:
        raise argparse.ArgumentTypeError(f"an odd number of rounds, 1 or more, not {rounds}")
    return rounds


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quota", type=float, default=0.25, help="cores per node")
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--tasks", type=int, default=64)
    parser.add_argument(
        "--workers",
        type=lambda text: [int(part) for part in text.split(",")],
        default=[1, 2, 4],
        metavar="N,N,...",
    )
    parser.add_argument("--shards-per-worker", type=int, default=2)
    parser.add_argument(
        "--rounds",
        type=odd_rounds,
        default=3,
        help="runs of every target, one after the other in each round, the order rotated each"
        " round (the servers stay up), after an unmeasured warm-up round; an odd number",
    )
    return parser.parse_args()


def main() -> int:
    arguments = parse_arguments()
    why = unavailable()
    if why is not None:
        print(f"citus_scale: skipped: {why}")
        return 0
    runs = arguments.rounds * (1 + 2 * len(arguments.workers)) + 1 + len(arguments.workers)
    budget = 300 + 60 * len(arguments.workers) + runs * (arguments.warmup + arguments.duration + 20)

    def out_of_time(signum: int, frame: object) -> None:
        raise TimeoutError(f"the benchmark ran out of its {budget:.0f}s budget")

    signal.signal(signal.SIGALRM, out_of_time)
    signal.alarm(int(budget))
    metrics.setup()
    work = citus.temporary_directory("oncegate-citus-scale-")
    results: list[Result] = []
    clusters: list[citus.Cluster] = []
    cgroups: list[Cgroup] = []
    try:
        targets = [
            target
            for workers in [0, *arguments.workers]
            for target in start_targets(work, workers, arguments, clusters, cgroups)
        ]
        warm_up(targets, arguments)
        for round_ in range(1, arguments.rounds + 1):
            for target in citus_pairs.in_order(targets, round_):
                result = measure(target, arguments, round_)
                results.append(result)
                run.progress(f"{round_} {target.name}: {result.pairs_per_second:,.0f} pairs/s")
        print(
            f"every PostgreSQL node in its own cgroup at {arguments.quota:g} cores;"
            f" {arguments.tasks} asyncio tasks on PostgresStore in this process, each a claim"
            f" then a complete of a new key; {arguments.warmup:g} s warm-up +"
            f" {arguments.duration:g} s per run, {arguments.rounds} rounds, every target in"
            " each, the order rotated each round, after a warm-up round; autovacuum off, and"
            " VACUUM (ANALYZE) on every node after every run, outside it;"
            f" {arguments.shards_per_worker} shards per worker; a node is `bound` at"
            f" {BOUND:.0%} of its quota"
        )
        print(f"\n$ {quick.command_line()}\n")
        print(table(results))
        print()
        print(summary(results))
        print()
        for line in verdicts(results):
            print(line)
        return 1 if any(result.failures for result in results) else 0
    finally:
        signal.alarm(0)
        for cluster in clusters:
            cluster.stop()
        for cgroup in cgroups:
            cgroup.remove()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
