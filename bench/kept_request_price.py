"""What keeping the request behind a key costs a key that completes: claim+complete pairs
through the real store (`PostgresStore`, batched as the gateway's) on the embedded PostgreSQL,
each claim with the request the gateway keeps for the bench's `POST /emails` (`run.
FLOOR_REQUEST`: method, path, two headers, the 63-byte JSON body) or with none (a route with
`keep_request: never`), in interleaved rounds on one server.

Printed per kind, median (min-max) over the rounds: pairs/s, PostgreSQL's CPU per pair (the
postmaster, its children and the children it reaped, from /proc) and the WAL it wrote per pair
(`pg_current_wal_lsn`), and the kept request's size. The difference is the price.

    .venv/bin/python bench/kept_request_price.py [--duration 5] [--warmup 1] [--tasks 64]
        [--rounds 4]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
import uuid
from pathlib import Path

import asyncpg

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import quick  # noqa: E402
import run  # noqa: E402

from oncegate.kernel.sealing import plaintext  # noqa: E402
from oncegate.model.answers import SealedRequest, StoredAnswer  # noqa: E402
from oncegate.model.records import Claim  # noqa: E402
from oncegate.store.postgres import PostgresStore  # noqa: E402

SCOPE = bytes(32)
FINGERPRINT = bytes(32)
ANSWER = plaintext([("content-type", "application/json")], run.FILL_BODY)
KINDS = {"kept": SealedRequest(None, run.FLOOR_REQUEST), "not kept": None}


async def wal(url: str) -> int:
    connection = await asyncpg.connect(url)
    try:
        position: int = await connection.fetchval(
            "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::bigint"
        )
        return position
    finally:
        await connection.close()


async def measure(
    url: str, postmaster: int, request: SealedRequest | None, arguments: argparse.Namespace
) -> tuple[float, float, float]:
    store = await PostgresStore.connect(url)
    measuring, pairs, stop = False, 0, asyncio.Event()

    async def task() -> None:
        nonlocal pairs
        while not stop.is_set():
            key = str(uuid.uuid4())
            claimed = await store.requests.claim(
                "bench", SCOPE, key, FINGERPRINT, 30, 86_400, request
            )
            assert isinstance(claimed, Claim)
            assert await store.requests.complete(claimed, StoredAnswer(201, ANSWER))
            if measuring:
                pairs += 1

    try:
        tasks = [asyncio.create_task(task()) for _ in range(arguments.tasks)]
        await asyncio.sleep(arguments.warmup)
        groups = {"postgres": [postmaster]}
        cpu, written = run.cpu_seconds(groups)["postgres"], await wal(url)
        measuring, started = True, time.monotonic()
        await asyncio.sleep(arguments.duration)
        measuring, elapsed = False, time.monotonic() - started
        cpu = run.cpu_seconds(groups)["postgres"] - cpu
        written = await wal(url) - written
        stop.set()
        await asyncio.gather(*tasks)
    finally:
        await store.close()
    return pairs / elapsed, cpu * 1000 / max(pairs, 1), written / max(pairs, 1)


def cell(values: list[float], digits: int) -> str:
    low, middle, high = min(values), statistics.median(values), max(values)
    return f"{middle:,.{digits}f} ({low:,.{digits}f}-{high:,.{digits}f})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--tasks", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=4)
    arguments = parser.parse_args()
    results: dict[str, list[tuple[float, float, float]]] = {kind: [] for kind in KINDS}
    with quick.embedded_postgres("oncegate-kept-price-") as server:
        postmaster = int((Path(server.pgdata) / "postmaster.pid").read_text().split()[0])
        for _ in range(arguments.rounds):
            for kind, request in KINDS.items():
                results[kind].append(
                    asyncio.run(measure(server.url, postmaster, request, arguments))
                )
    print(f"    .venv/bin/python bench/kept_request_price.py {' '.join(sys.argv[1:])}")
    print(f"kept request: {len(run.FLOOR_REQUEST)} bytes; {arguments.tasks} tasks; "
          f"{arguments.rounds} rounds of {arguments.duration:g} s, interleaved")  # fmt: skip
    print("| claims keep | pairs/s | PostgreSQL CPU ms/pair | WAL bytes/pair |")
    print("|---|---|---|---|")
    for kind, rows in results.items():
        rates, cpus, wals = zip(*rows, strict=True)
        print(
            f"| {kind} | {cell(list(rates), 0)} | {cell(list(cpus), 3)} | {cell(list(wals), 0)} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
