"""The capacity model's figures (docs/scaling.md): what one gateway process and PostgreSQL each
spend per forwarded request at 64 connections, and what that makes of a deployment.

It starts an embedded PostgreSQL (`oncegate.store.embedded`, migrated), `oncegate demo-upstream`
and one
`oncegate serve` process on free loopback ports, warms up, then sends `POST /emails` with a new
Idempotency-Key per request over `--connections` keep-alive connections for `--duration` seconds
(bench/quick.py's load generator), `--repeats` times. For each run it reads from /proc the CPU
time of the gateway process, of PostgreSQL (the postmaster, its children and the children it
reaped) and of the demo upstream, and how busy the whole machine was; at the end the gateway's
peak resident memory (VmHWM) and the key table's size per stored key.

It prints, under the command, one row per run and the figures derived from the medians:
- forwards per second per gateway core = 1000 / gateway CPU ms per forward;
- claim+settle pairs per second per PostgreSQL core = 1000 / PostgreSQL CPU ms per forward
  (each forward is one claim and one complete, batched by the store);
- gateway processes one PostgreSQL core keeps up with = gateway ms / PostgreSQL ms.

CPU per request is much less sensitive than req/s to what else the machine does (bench/README.md);
the `machine busy` column says how loaded the machine was besides.

    .venv/bin/python bench/capacity.py [--duration 10] [--connections 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import asyncpg
import quick
import run

STARTUP_TIMEOUT = 60.0
WARMUP = 2.0


@dataclass
class Sample:
    forwards: int
    seconds: float
    gateway: float  # CPU seconds
    postgres: float
    upstream: float
    client: float  # this benchmark's load generator
    machine: float  # CPU seconds every process of the machine spent

    def per_forward(self, cpu: float) -> float:
        return cpu / self.forwards * 1000

    def row(self) -> str:
        others = self.machine - self.gateway - self.postgres - self.upstream - self.client
        return (
            f"| {self.forwards / self.seconds:,.0f} | {self.per_forward(self.gateway):.3f} | "
            f"{self.per_forward(self.postgres):.3f} | {self.per_forward(self.upstream):.3f} | "
            f"{others / self.seconds:.2f} of {os.cpu_count()} cores |"
        )


def postmaster_pid(pgdata: Path) -> int:
    return int((pgdata / "postmaster.pid").read_text().split("\n", 1)[0])


async def drive(port: int, connections: int, seconds: float, prefix: str) -> quick.PhaseResult:
    result = quick.PhaseResult(prefix)
    start = time.perf_counter()
    await quick.drive(
        result,
        port,
        quick.fresh_keys(port, prefix),
        connections,
        measure_from=start,
        until=start + seconds,
        check=quick.check_2xx,
    )
    return result


async def table_size(url: str) -> tuple[int, int]:
    connection = await asyncpg.connect(url)
    try:
        await connection.execute("VACUUM ANALYZE oncegate_keys")
        keys = await connection.fetchval("SELECT count(*) FROM oncegate_keys")
        size = await connection.fetchval("SELECT pg_total_relation_size('oncegate_keys')")
    finally:
        await connection.close()
    return keys, size


def peak_memory_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise LookupError("no VmHWM")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    arguments = parser.parse_args()
    started: list[subprocess.Popen[bytes]] = []
    with quick.embedded_postgres("oncegate-capacity-") as server:
        work = server.data_dir.parent  # the temporary directory: the servers' logs go there too
        try:
            url = server.url
            environment = {name: value for name, value in os.environ.items()
                           if not name.startswith("ONCEGATE_")}  # fmt: skip
            environment["ONCEGATE_DATABASE_URL"] = url
            upstream_port, port, admin_port = (quick.free_port() for _ in range(3))
            commands = [
                quick.oncegate("demo-upstream", "--host", quick.HOST, "--port", str(upstream_port)),
                quick.oncegate("serve", "--upstream", f"http://{quick.HOST}:{upstream_port}",
                               "--host", quick.HOST, "--port", str(port),
                               "--admin-port", str(admin_port), "--log-level", "warning"),
            ]  # fmt: skip
            for name, command in zip(("upstream", "gateway"), commands, strict=True):
                quick.start(command, work / f"{name}.log", environment, started)
            for process, (name, listening) in zip(
                started, (("upstream", upstream_port), ("gateway", port)), strict=True
            ):
                quick.wait_listening(process, listening, work / f"{name}.log", STARTUP_TIMEOUT)
            upstream, gateway = started
            groups = {"gateway": [gateway.pid], "postgres": [postmaster_pid(server.pgdata)],
                      "upstream": [upstream.pid]}  # fmt: skip
            asyncio.run(drive(port, arguments.connections, WARMUP, f"warm-{uuid.uuid4().hex[:8]}"))
            samples = []
            for _ in range(arguments.repeats):
                before, busy = run.cpu_seconds(groups), run.machine_busy_seconds()
                client = run.own_seconds()
                result = asyncio.run(
                    drive(port, arguments.connections, arguments.duration, uuid.uuid4().hex[:12])
                )
                after, busy_after = run.cpu_seconds(groups), run.machine_busy_seconds()
                client = run.own_seconds() - client
                if result.errors:
                    print(f"errors: {dict(result.errors)}", file=sys.stderr)
                    return 1
                used = [after[name] - before[name] for name in ("gateway", "postgres", "upstream")]
                samples.append(
                    Sample(result.requests, result.elapsed, *used, client, busy_after - busy)
                )
            peak = peak_memory_kib(gateway.pid)
            keys, size = asyncio.run(table_size(url))
        finally:
            for process in reversed(started):
                quick.stop(process)
    gateway_ms = statistics.median(sample.per_forward(sample.gateway) for sample in samples)
    postgres_ms = statistics.median(sample.per_forward(sample.postgres) for sample in samples)
    print(f"$ .venv/bin/python bench/capacity.py {' '.join(sys.argv[1:])}".rstrip())
    print(
        f"machine: nproc {os.cpu_count()}, {run.cpu_model()}, "
        f"Python {platform.python_version()}; client, gateway, upstream and PostgreSQL share it"
    )
    print(f"one gateway process, {arguments.connections} connections, new key per request, "
          f"{arguments.duration:g} s per run\n")  # fmt: skip
    print(
        "| forwards/s | gateway CPU ms/forward | PostgreSQL CPU ms/forward | upstream CPU "
        "ms/forward | other load on the machine (not this benchmark) |"
    )
    print("|---:|---:|---:|---:|---:|")
    for sample in samples:
        print(sample.row())
    print(
        f"\nmedians: {1000 / gateway_ms:,.0f} forwards/s per gateway core; "
        f"{1000 / postgres_ms:,.0f} claim+settle pairs/s per PostgreSQL core; "
        f"one PostgreSQL core keeps up with {gateway_ms / postgres_ms:.1f} gateway cores"
    )
    print(f"gateway peak resident memory: {peak / 1024:.0f} MiB")
    print(f"key table: {keys:,} keys, {size / 2**20:.1f} MiB with indexes, "
          f"{size / max(keys, 1):,.0f} bytes per key")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
