"""What a claim that keeps a large request costs, and whether it holds up other keys' claims.

It starts an embedded PostgreSQL (`oncegate.store.embedded`, migrated) and opens the gateway's
own store on it (`PostgresStore`: its pools, its batchers, its statements). Then:

- sizes: for each `--sizes` (MiB of JSON made of many small objects, as
  tests/e2e/test_bodies.py sends), `--claims` claims one after another, each keeping such a
  request: the claim's time, the CPU it cost PostgreSQL (the postmaster, its children, the
  children it reaped) and this process (asyncpg encoding the request on the event loop), the
  WAL it wrote, and the longest the event loop went without running a 1 ms ticker meanwhile;
- beside: `--beside` claims of the largest size at once, and small claims (100 bytes kept) of
  other keys one after another until they are done: the small ones' time, and how many claim
  statements were sent beside one that had not returned within the stall time
  (`oncegate_store_stalled_batches_total`: what waited behind a statement in flight).

    .venv/bin/python bench/large_claims.py [--sizes 0.25,1,8.6] [--claims 5] [--beside 3]

Figures: docs/performance.md, "Claims that keep large requests". Run it beside a busy loop
(`sh -c 'while :; do :; done' &`) to see a machine short of CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import platform
import statistics
import sys
import time
import uuid
from pathlib import Path

import asyncpg
from prometheus_client import REGISTRY

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import quick  # bench/ is on the path from here on
import run

from oncegate.model.answers import SealedRequest
from oncegate.model.records import Claim
from oncegate.store.postgres import PostgresStore

ROUTE = "large"
SCOPE = hashlib.sha256(b"large claims").digest()
LONG = 600.0
SMALL = SealedRequest(None, b"s" * 100)


def document(mebibytes: float) -> bytes:
    """About `mebibytes` MiB of JSON: many small objects, the costly and compressible kind."""
    count = max(1, int(mebibytes * 116_000 / 8.6))
    items = [{"id": index, "name": f"line item {index}", "amount": 1234, "tags": ["a", "b"]}
             for index in range(count)]  # fmt: skip
    return json.dumps({"items": items, "idempotency_key": uuid.uuid4().hex}).encode()


async def claim(store: PostgresStore, kept: SealedRequest) -> None:
    found = await store.requests.claim(
        ROUTE, SCOPE, uuid.uuid4().hex, hashlib.sha256(kept.data).digest(), LONG, LONG, kept
    )
    if not isinstance(found, Claim):
        raise RuntimeError(f"a new key was not claimed: {found!r}")


def stalls() -> float:
    labels = {"operation": "claim"}
    return REGISTRY.get_sample_value("oncegate_store_stalled_batches_total", labels) or 0.0


class Ticker:
    """A 1 ms ticker on the event loop: the longest gap between two of its ticks is the longest
    the loop was held by something else."""

    def __init__(self) -> None:
        self._ticking = True
        self._longest = 0.0
        self._task = asyncio.create_task(self._tick())

    async def _tick(self) -> None:
        last = time.perf_counter()
        while self._ticking:
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            self._longest = max(self._longest, now - last)
            last = now

    async def stop(self) -> float:
        self._ticking = False
        await self._task
        return self._longest


async def sizes(
    store: PostgresStore, side: asyncpg.Connection, postmaster: int, arguments: argparse.Namespace
) -> list[str]:
    rows = [
        "| kept request | claims | claim ms, p50 | PostgreSQL CPU ms a claim | this process's "
        "CPU ms a claim | WAL a claim | longest event-loop gap ms |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for size in arguments.sizes:
        body = document(size)
        await claim(store, SealedRequest(None, body))  # the first of a size, not counted
        walls: list[float] = []
        ticker = Ticker()
        wal = await side.fetchval("SELECT pg_current_wal_lsn()")
        postgres, own = run.cpu_seconds({"postgres": [postmaster]})["postgres"], time.process_time()
        for _ in range(arguments.claims):
            kept = SealedRequest(None, body[:-40] + uuid.uuid4().hex.encode() + body[-8:])
            started = time.perf_counter()
            await claim(store, kept)
            walls.append(time.perf_counter() - started)
        own = time.process_time() - own
        postgres = run.cpu_seconds({"postgres": [postmaster]})["postgres"] - postgres
        written = await side.fetchval("SELECT pg_current_wal_lsn() - $1::pg_lsn", wal)
        gap = await ticker.stop()
        count = arguments.claims
        rows.append(
            f"| {len(body) / 2**20:.2f} MiB | {count} | {statistics.median(walls) * 1000:.1f} | "
            f"{postgres / count * 1000:.1f} | {own / count * 1000:.1f} | "
            f"{float(written) / count / 2**20:.2f} MiB | {gap * 1000:.1f} |"
        )
    return rows


async def beside(store: PostgresStore, arguments: argparse.Namespace) -> list[str]:
    body = document(max(arguments.sizes))
    large = [SealedRequest(None, body[:-40] + uuid.uuid4().hex.encode() + body[-8:])
             for _ in range(arguments.beside)]  # fmt: skip
    before = stalls()
    loop = asyncio.get_running_loop()
    started = loop.time()
    claiming = asyncio.gather(*(claim(store, kept) for kept in large))
    small: list[float] = []
    while not claiming.done():
        sent = loop.time()
        await claim(store, SMALL)
        small.append(loop.time() - sent)
    await claiming
    took = loop.time() - started
    return [
        "| large claims at once | their time s | small claims beside | small p50 ms | "
        "small max ms | statements sent beside one stalled |",
        "|---:|---:|---:|---:|---:|---:|",
        f"| {arguments.beside} x {len(body) / 2**20:.1f} MiB | {took:.2f} | {len(small)} | "
        f"{statistics.median(small) * 1000:.1f} | {max(small) * 1000:.1f} | "
        f"{stalls() - before:.0f} |",
    ]


async def measure(url: str, postmaster: int, arguments: argparse.Namespace) -> list[str]:
    store = await PostgresStore.connect(url)
    side = await asyncpg.connect(url)
    try:
        found = await sizes(store, side, postmaster, arguments)
        return [*found, "", *await beside(store, arguments)]
    finally:
        await side.close()
        await store.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=lambda text: [float(part) for part in text.split(",")],
                        default=[0.25, 1.0, 8.6], help="MiB of JSON kept (0.25,1,8.6)")  # fmt: skip
    parser.add_argument("--claims", type=int, default=5, help="claims of each size (5)")
    parser.add_argument("--beside", type=int, default=3, help="large claims at once (3)")
    arguments = parser.parse_args()
    with quick.embedded_postgres("oncegate-large-claims-") as server:
        postmaster = run._postmaster_pid(server.pgdata)
        if postmaster is None:
            raise RuntimeError(f"no postmaster.pid in {server.pgdata}")
        rows = asyncio.run(measure(server.url, postmaster, arguments))
    with open("/proc/loadavg") as loadavg:
        load = loadavg.read().split()[0]
    print(f"    {quick.command_line()}")
    print(f"    {platform.node()}: Python {platform.python_version()}, load {load}\n")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
