"""A lone claim and complete through the store against the same two statements raw: where the
1-connection forward's store time goes beyond its two round trips.

`bench/run.py`'s floor row sends the gateway's claim and complete on two bare asyncpg
connections; a forward at 1 connection sends the same statements through the store (the pool,
the arrays, the outcome; from a caller within its client's reach, the batcher's task and future
too). This runs them in one process on the gateway's event loop (uvloop), pair by pair,
alternating which goes first, against one embedded PostgreSQL: raw, through the store from a
caller within its client's reach, and through the store from a task out of it, as a keyed
request's claim and settle are sent (`model.reach.SHIELDED`: a lone statement in the caller's
task). It prints per row the claim's and the complete's median and mean (µs),
the pair's median, and this process's CPU per pair. `--steps` also prints, per row, the median
time between stamps taken at the store's steps: the call, the batch task's start, the
statement's start and end (asyncpg's `fetch`), the task's end, and the caller resumed.

With `--instant`, a fourth row runs the store on a connection that answers at once (no
PostgreSQL): the store's own Python per lone pair on a warm CPU. At 1 connection the process
sleeps while PostgreSQL works, and every step after a wake-up runs slower than it does warm.

It starts an embedded PostgreSQL (`oncegate.store.embedded`) in a fresh temporary directory
with the gateway's migrations and removes both at the end. It exits 1 if a claim did not claim
or a complete did not complete.

    .venv/bin/python bench/store_path.py [--pairs 2000] [--instant] [--steps]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
import uvloop

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import quick  # noqa: E402 - bench/ is on the path from here on
import run  # noqa: E402
from batch_shapes import load_line, machine_line  # noqa: E402

from oncegate.kernel import keys  # noqa: E402
from oncegate.model import reach  # noqa: E402
from oncegate.model.answers import SealedAnswer, SealedRequest, StoredAnswer  # noqa: E402
from oncegate.model.records import Claim  # noqa: E402
from oncegate.settings import StoreOptions  # noqa: E402
from oncegate.store import batching  # noqa: E402
from oncegate.store.errors import Outage  # noqa: E402
from oncegate.store.postgres import PostgresStore  # noqa: E402
from oncegate.store.postgres.connections import Listener, Pools, Primary  # noqa: E402
from oncegate.store.postgres.dialect import Plain  # noqa: E402
from oncegate.store.postgres.pool import Pool  # noqa: E402
from oncegate.store.postgres.requests import RequestPath  # noqa: E402
from oncegate.store.queries import DIALECTS  # noqa: E402
from oncegate.telemetry import metrics  # noqa: E402

WARMUP_PAIRS = 100
STATEMENT_TIMEOUT = 30.0
STARTUP_SECONDS = 120.0
PAIR_SECONDS = 0.02  # a pair's round trips at worst, on a busy shared machine
SCOPE = keys.scope(run.ROUTE, [[]])
KEPT = SealedRequest(None, run.FLOOR_REQUEST)
ANSWER = StoredAnswer(201, SealedAnswer(None, run.FILL_HEADERS.encode(), run.FILL_BODY))

# (step, time.perf_counter_ns()) of the pair being measured, when --steps.
STAMPS: list[tuple[str, int]] = []


def stamp(step: str) -> None:
    STAMPS.append((step, time.perf_counter_ns()))


@dataclass
class Row:
    label: str
    claim_us: list[float] = field(default_factory=list)
    complete_us: list[float] = field(default_factory=list)
    cpu_seconds: float = 0.0
    steps: list[list[tuple[str, int]]] = field(default_factory=list)
    failures: int = 0


Pair = Callable[[str], Awaitable[tuple[int, int, int, bool]]]


def stamped() -> None:
    """Stamps at the batch task's start and end and around asyncpg's `fetch` (both rows)."""
    carry = batching.Batcher._carry
    fetch = asyncpg.Connection.fetch

    async def carried(self: Any, batch: Any) -> None:
        stamp("task started")
        try:
            await carry(self, batch)
        finally:
            stamp("task ended")

    async def fetched(self: Any, *arguments: Any, **options: Any) -> Any:
        stamp("statement sent")
        try:
            return await fetch(self, *arguments, **options)
        finally:
            stamp("statement returned")

    batching.Batcher._carry = carried  # type: ignore[method-assign]  # stamped, for this run
    asyncpg.Connection.fetch = fetched  # type: ignore[method-assign]  # stamped, for this run


def through(path: RequestPath) -> Pair:
    """A claim and its complete through the store's request path."""

    async def pair(key: str) -> tuple[int, int, int, bool]:
        started = time.perf_counter_ns()
        stamp("called")
        claim = await path.claim(run.ROUTE, SCOPE, key, bytes(32), 60.0, 86400.0, KEPT)
        claimed = time.perf_counter_ns()
        stamp("claim returned")
        if not isinstance(claim, Claim):
            return started, claimed, time.perf_counter_ns(), False
        stored = await path.complete(claim, ANSWER)
        stamp("complete returned")
        return started, claimed, time.perf_counter_ns(), stored

    return pair


def shielded(pair: Pair) -> Pair:
    """The same pair from a task out of its client's reach (`reach.SHIELDED`), as the gateway
    sends a keyed request's claim and complete: a lone operation goes in the caller's task."""

    async def in_reach(key: str) -> tuple[int, int, int, bool]:
        token = reach.SHIELDED.set(True)
        try:
            return await pair(key)
        finally:
            reach.SHIELDED.reset(token)

    return in_reach


def raw(claims: asyncpg.Connection, answers: asyncpg.Connection) -> Pair:
    """The floor's pair: the same statements on two bare connections (`run._floor`)."""
    plain = DIALECTS["postgres"]
    claim, complete = plain["claim"], plain["complete"]

    async def pair(key: str) -> tuple[int, int, int, bool]:
        started = time.perf_counter_ns()
        stamp("called")
        arrays = {
            "routes": [run.ROUTE], "scopes": [SCOPE], "keys": [key], "fingerprints": [bytes(32)],
            "leases": [60.0], "ttls": [86400.0], "requests": [run.FLOOR_REQUEST],
            "requests_sealed_with": [None], "claimant": run.FLOOR_CLAIMANT,
        }  # fmt: skip
        rows = await claims.fetch(claim.sql, *claim.arguments(arrays), timeout=STATEMENT_TIMEOUT)
        claimed = time.perf_counter_ns()
        stamp("claim returned")
        answer = {
            "ids": [rows[0]["id"]], "keys": [key], "tokens": [rows[0]["fencing_token"]],
            "statuses": [201], "stored": [True], "headers": [run.FILL_HEADERS],
            "bodies": [run.FILL_BODY], "sealed_with": [None], "sealed_headers": [None],
        }  # fmt: skip
        settled = await answers.fetch(
            complete.sql, *complete.arguments(answer), timeout=STATEMENT_TIMEOUT
        )
        stamp("complete returned")
        return started, claimed, time.perf_counter_ns(), rows[0]["claimed"] and len(settled) == 1

    return pair


class Instant:
    """A connection that answers every statement at once, a loop iteration later, as if
    PostgreSQL had: the claim won, the complete stored, nobody waiting."""

    async def fetch(self, sql: str, *arguments: object) -> Any:
        await asyncio.sleep(0)
        if "INSERT" in sql:
            return [{"n": 1, "claimed": True, "id": 1, "fencing_token": 1}]
        return [{"id": 1, "fencing_token": 1, "waited": False}]

    def is_closed(self) -> bool:
        return False

    def is_in_transaction(self) -> bool:
        return False


async def instant_path(options: StoreOptions) -> RequestPath:
    async def connect() -> Any:
        return Instant()

    async def init(connection: Any) -> None:
        pass

    url = "postgresql://instant/none"  # never connected to: the listener opens on a watch
    pools = Pools(
        await Pool.open(connect, init, options.pool_size),
        await Pool.open(connect, init, options.pool_size // 2),
        None,  # type: ignore[arg-type]  # the operator's pool: no lone pair uses it
        Primary(url),
    )
    return RequestPath(pools, options, Outage("instant"), Plain(), Listener(url, options))


async def measure(url: str, pairs: int, instant: bool) -> list[Row]:
    options = StoreOptions()
    store = await PostgresStore.connect(url, options)
    claims, answers = await run.floor_connections(url)
    rows = {
        "raw": Row("raw: the floor's statements"),
        "store": Row("through the store, a caller within its client's reach"),
        "shielded": Row("through the store, a shielded task's (a keyed request's)"),
    }
    sends: dict[str, Pair] = {
        "raw": raw(claims, answers),
        "store": through(store.requests),
        "shielded": shielded(through(store.requests)),
    }
    if instant:
        rows["instant"] = Row("through the store, a connection that answers at once")
        sends["instant"] = through(await instant_path(options))
    tag = os.urandom(4).hex()
    names = list(rows)
    try:
        for number in range(WARMUP_PAIRS + pairs):
            # Which goes first alternates, so a drift of the machine falls on each alike.
            order = names if number % 2 == 0 else names[::-1]
            for name in order:
                # A loop iteration between pairs, as between a gateway's requests: the batch task
                # of the pair before ends (`Batcher._landed`) before this one's claim is called.
                await asyncio.sleep(0)
                STAMPS.clear()
                cpu = time.process_time()
                started, claimed, ended, done = await sends[name](f"{tag}-{name}-{number}")
                cpu = time.process_time() - cpu
                if number < WARMUP_PAIRS:
                    continue
                row = rows[name]
                row.claim_us.append((claimed - started) / 1000)
                row.complete_us.append((ended - claimed) / 1000)
                row.cpu_seconds += cpu
                row.failures += not done
                if STAMPS:
                    row.steps.append(list(STAMPS))
    finally:
        await claims.close()
        await answers.close()
        await store.close()
    return list(rows.values())


def table(rows: Sequence[Row], pairs: int) -> str:
    lines = [
        "| row | claim µs p50 | claim µs mean | complete µs p50 | complete µs mean "
        "| pair µs p50 | CPU µs per pair |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        pair = [sum(both) for both in zip(row.claim_us, row.complete_us, strict=True)]
        lines.append(
            f"| {row.label} | {statistics.median(row.claim_us):.0f} "
            f"| {statistics.mean(row.claim_us):.0f} | {statistics.median(row.complete_us):.0f} "
            f"| {statistics.mean(row.complete_us):.0f} | {statistics.median(pair):.0f} "
            f"| {row.cpu_seconds / pairs * 1e6:.0f} |"
        )
    return "\n".join(lines)


def steps_table(row: Row) -> str:
    """The median µs between consecutive stamps, over the pairs whose stamps came in the usual
    order (a pair that took another path is left out, and counted)."""
    usual = [step for step, _ in row.steps[0]]
    same = [each for each in row.steps if [step for step, _ in each] == usual]
    lines = [f"{row.label} ({len(same)} pairs of {len(row.steps)} stamped alike):", ""]
    lines += ["| from | to | µs, median |", "|---|---|---:|"]
    for index in range(1, len(usual)):
        gap = statistics.median((each[index][1] - each[index - 1][1]) / 1000 for each in same)
        lines.append(f"| {usual[index - 1]} | {usual[index]} | {gap:.1f} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=quick.positive(int), default=2000, metavar="N")
    parser.add_argument(
        "--instant", action="store_true", help="and the store on a connection that answers at once"
    )
    parser.add_argument("--steps", action="store_true", help="and the median time between steps")
    arguments = parser.parse_args()
    budget = int(STARTUP_SECONDS + 3 * (WARMUP_PAIRS + arguments.pairs) * PAIR_SECONDS)

    def out_of_time(signum: int, frame: object) -> None:
        raise TimeoutError(f"the benchmark ran out of its {budget}s budget")

    signal.signal(signal.SIGALRM, out_of_time)
    signal.alarm(budget)
    metrics.setup()
    if arguments.steps:
        stamped()
    with quick.embedded_postgres("oncegate-store-path-") as server:
        print(machine_line(server.url))
        print(f"before: {load_line()}")
        rows = uvloop.run(measure(server.url, arguments.pairs, arguments.instant))
        print(f"after: {load_line()}")
    print(f"\n$ {quick.command_line()}\n")
    print(f"{arguments.pairs} pairs per row, interleaved pair by pair (uvloop)\n")
    print(table(rows, arguments.pairs))
    if arguments.steps:
        for row in rows:
            print()
            print(steps_table(row))
    failures = sum(row.failures for row in rows)
    if failures:
        print(f"\n{failures} pairs did not claim and complete", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
