"""Scale-out on Citus, shown: claim+complete pairs per second when every PostgreSQL node has the
same CPU, for one plain server and for clusters of 1, 2 and 4 workers.

Every node (the plain server, a cluster's coordinator and each worker) runs in a cgroup of its
own with the same CPU quota (`--quota` cores: cgroup v1 `cpu.cfs_quota_us`, or v2 `cpu.max`),
so a node stands for one machine of that size. Each cluster runs twice: its coordinator at the
quota, and again with the coordinator unlimited (what the workers carry when the coordinator is
not the limit). The load is the real store (`PostgresStore`, as bench/citus_pairs.py drives
it: `--tasks` asyncio tasks, each claiming a new key and completing it) in this process.

Printed per run: pairs/s and its ratio to the plain server; each node's CPU as a share of its
quota and the share of its cgroup's periods that were throttled (a node at its quota is the
bound it stands for: `bound` when it used 85% or more); and the load side's CPU (this process:
it must not be the limit, `load-bound` when it used 85% of one core). The targets: 4 workers
>= 3x the plain server, 2 workers >= 1.7x.

    .venv/bin/python bench/citus_scale.py [--quota 0.25] [--duration 5] [--warmup 3]
        [--tasks 64] [--workers 1,2,4] [--shards-per-worker 2]

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
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

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
    pairs_per_second: float
    nodes: list[tuple[str, float | None, float, float]]  # name, quota, cores used, throttled
    load_cores: float
    failures: int


async def drive(url: str, nodes: list[Node], arguments: argparse.Namespace, target: str) -> Result:
    store = await PostgresStore.connect(url)
    stop = asyncio.Event()
    measuring = False
    pairs = failures = 0

    async def task() -> None:
        nonlocal pairs, failures
        while not stop.is_set():
            claimed = await store.requests.claim(
                "bench", citus_pairs.SCOPE, str(uuid.uuid4()), citus_pairs.FINGERPRINT, 30, 86_400
            )
            if not isinstance(claimed, Claim) or not await store.requests.complete(claimed, ANSWER):
                failures += 1
            elif measuring:
                pairs += 1

    try:
        tasks = [asyncio.create_task(task()) for _ in range(arguments.tasks)]
        await asyncio.sleep(arguments.warmup)
        groups = {node.name: [node.pid] for node in nodes}
        cpu_before = run.cpu_seconds(groups)
        throttling_before = {node.name: node.cgroup.throttling() for node in nodes}
        load_before = time.process_time()
        measuring, started = True, time.monotonic()
        await asyncio.sleep(arguments.duration)
        measuring, elapsed = False, time.monotonic() - started
        load = (time.process_time() - load_before) / elapsed
        cpu_after = run.cpu_seconds(groups)
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
    return Result(target, pairs / elapsed, used, load, failures)


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


def measure_target(
    work: Path, workers: int, arguments: argparse.Namespace, results: list[Result]
) -> None:
    """One plain server (workers 0), or a cluster measured with its coordinator at the quota and
    again unlimited."""
    with_citus = workers > 0
    cluster = citus.Cluster.start(work / f"nodes{workers}", workers=workers, with_citus=with_citus)
    nodes: list[Node] = []
    try:
        url = cluster.create_database(citus_pairs.DATABASE)
        if with_citus:
            shards = max(1, arguments.shards_per_worker * workers)
            asyncio.run(citus_pairs.set_shard_count(url, shards))
        migrate.upgrade(url)
        nodes = nodes_of(cluster, arguments.quota, f"oncegate-scale-{os.getpid()}-{workers}")
        if not with_citus:
            results.append(asyncio.run(drive(url, nodes, arguments, "PostgreSQL 15, one server")))
            return
        name = f"Citus, {workers} worker{'s' if workers > 1 else ''} ({shards} shards)"
        results.append(asyncio.run(drive(url, nodes, arguments, f"{name}, coordinator at quota")))
        nodes[0].cgroup.limit(None)
        nodes[0].quota = None
        results.append(asyncio.run(drive(url, nodes, arguments, f"{name}, coordinator unlimited")))
    finally:
        cluster.stop()
        for node in nodes:
            node.cgroup.remove()
    run.progress(f"{results[-1].target}: {results[-1].pairs_per_second:,.0f} pairs/s")


def table(results: list[Result], quota: float) -> str:
    single = results[0].pairs_per_second if results else 0.0
    lines = [
        "| target | pairs/s | x one server | each node: CPU used of its quota, throttled periods"
        " | load side (cores) | failures |",
        "|---|---:|---:|---|---:|---:|",
    ]
    for result in results:
        shown = []
        for name, node_quota, cores, throttled in result.nodes:
            share = cores / node_quota if node_quota else None
            bound = share is not None and share >= BOUND
            used = f"{cores:.2f} cores" if share is None else f"{share:.0%}"
            shown.append(f"{name} {used}, {throttled:.0%} throttled{' (bound)' if bound else ''}")
        load = f"{result.load_cores:.2f}{' (load-bound)' if result.load_cores >= BOUND else ''}"
        ratio = result.pairs_per_second / single if single else 0.0
        lines.append(
            f"| {result.target} | {result.pairs_per_second:,.0f} | {ratio:.2f}x |"
            f" {'; '.join(shown)} | {load} | {result.failures} |"
        )
    return "\n".join(lines)


def verdicts(results: list[Result]) -> list[str]:
    single = results[0].pairs_per_second
    found = []
    for workers, target in ((4, 3.0), (2, 1.7)):
        for result in results[1:]:
            if result.target.startswith(f"Citus, {workers} workers"):
                ratio = result.pairs_per_second / single
                verdict = "PASS" if ratio >= target else "FAIL"
                found.append(f"{verdict} {result.target} >= {target}x one server: {ratio:.2f}x")
    return found


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
    return parser.parse_args()


def main() -> int:
    arguments = parse_arguments()
    why = unavailable()
    if why is not None:
        print(f"citus_scale: skipped: {why}")
        return 0
    budget = 300 + (1 + 2 * len(arguments.workers)) * (arguments.warmup + arguments.duration + 60)

    def out_of_time(signum: int, frame: object) -> None:
        raise TimeoutError(f"the benchmark ran out of its {budget:.0f}s budget")

    signal.signal(signal.SIGALRM, out_of_time)
    signal.alarm(int(budget))
    metrics.setup()
    work = citus.temporary_directory("oncegate-citus-scale-")
    results: list[Result] = []
    try:
        for workers in [0, *arguments.workers]:
            measure_target(work, workers, arguments, results)
        print(
            f"every PostgreSQL node in its own cgroup at {arguments.quota:g} cores;"
            f" {arguments.tasks} asyncio tasks on PostgresStore in this process, each a claim"
            f" then a complete of a new key; {arguments.warmup:g} s warm-up +"
            f" {arguments.duration:g} s per run; {arguments.shards_per_worker} shards per worker;"
            f" a node is `bound` at {BOUND:.0%} of its quota"
        )
        print(f"\n$ {quick.command_line()}\n")
        print(table(results, arguments.quota))
        print()
        for line in verdicts(results):
            print(line)
        return 1 if any(result.failures for result in results) else 0
    finally:
        signal.alarm(0)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
