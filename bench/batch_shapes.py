"""What PostgreSQL and the client pay per claim+complete pair, one statement per operation
against multi-row `unnest` statements (issue 9's table, measured again here).

It starts an embedded PostgreSQL (`oncegate.store.embedded`) in a fresh temporary directory,
applies oncegate's own migrations (`oncegate.store.migrate`), so the table is the real
`oncegate_keys` with its constraints and indexes, and then, for each shape, runs 64 asyncio
tasks on asyncpg, each one claiming a new key and then completing it, over and over:

- `1`: one statement per operation, today's shape: the claim
  (`INSERT ... ON CONFLICT DO NOTHING RETURNING`) on a pool of 20 connections with synchronous
  commit, the answer (`UPDATE ... WHERE id AND fencing_token`) on a pool of 10 whose sessions run
  with `synchronous_commit = off`, as `PostgresStore.connect` opens them, both set as the
  gateway's request pools are (`connections.request_settings`: each statement planned once
  per connection, never as a seq scan of the key table);
- `N` > 1: the same two pools, but claims are grouped into one
  `INSERT ... SELECT FROM unnest(...)` and completes into one `UPDATE ... FROM unnest(...)` of
  at most N rows, by natural batching: an operation that finds no statement of its kind in
  flight is sent at once, alone; one that arrives while statements are in flight waits for the
  next one, which is sent when one of them returns, or at once when N rows are waiting; several
  statements of a kind may be in flight, up to the size of its pool.

It prints, under the command that made it, one Markdown row per shape: pairs/s, the CPU time of
PostgreSQL (the postmaster, its children, the children it reaped) and of this process per pair
(utime + stime from /proc, as `bench/run.py` counts them), and the mean rows per statement.

    .venv/bin/python bench/batch_shapes.py [--duration 3] [--warmup 1] [--repeats 1]
        [--rows 1,4,8,16,64] [--tasks 64] [--keep]

Design rules:
- The claim here is the plain `INSERT ... RETURNING` of issue 9's measurement, not the store's
  claim with its read of an existing row; every key is new, so no claim ever finds one.
- The table is emptied and checkpointed before every measured run, so no shape inherits another
  one's dead rows or dirty pages; shapes are interleaved when repeated, so a drift of the
  machine spreads over all of them.
- Every wait is bounded (statement timeouts, the whole run under SIGALRM); the embedded server
  is stopped and the temporary directory removed in a `finally`. Nothing is written elsewhere.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import platform
import signal
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))  # `python -m bench.batch_shapes` too: run.py imports quick so

import quick  # noqa: E402 - bench/ is on the path from here on
import run  # noqa: E402

from oncegate.kernel import keys  # noqa: E402
from oncegate.store.postgres.connections import request_settings  # noqa: E402

ROUTE = "default"
SCOPE = keys.scope(ROUTE, [[]])
FINGERPRINT = bytes(32)  # what the fingerprint is does not matter to PostgreSQL; its size does
LEASE_SECONDS = 30.0
TTL_SECONDS = 86_400.0
# An answer like the demo upstream's receipt: the rows are as wide as the gateway's.
ANSWER_STATUS = 201
ANSWER_HEADERS = '[["content-type", "application/json"], ["location", "/actions/em_000001"]]'
ANSWER_BODY = (
    b'{"id":"em_000001","kind":"email","path":"/emails","idempotency_key":"batch-shapes",'
    b'"request":{"to":"bench@example.com","subject":"benchmark","text":"hello"},'
    b'"performed_at":0.0}'
)
# The gateway's pools (PostgresStore.connect): claims with synchronous commit, answers without.
CLAIM_POOL = 20
ANSWER_POOL = 10
STATEMENT_TIMEOUT = 30.0
STARTUP_TIMEOUT = 60.0
# A run whose tasks have not all stopped this long after its end is stuck.
STOP_GRACE = 30.0

CLAIM = """
INSERT INTO oncegate_keys
    (route, scope, key, fingerprint, state, fencing_token, lease_expires_at, expires_at)
VALUES ($1, $2, $3, $4, 'in_progress', 1,
        now() + make_interval(secs => $5), now() + make_interval(secs => $6))
ON CONFLICT (scope, key) DO NOTHING
RETURNING id, fencing_token
"""
CLAIM_MANY = """
INSERT INTO oncegate_keys
    (route, scope, key, fingerprint, state, fencing_token, lease_expires_at, expires_at)
SELECT $1, batch.scope, batch.key, batch.fingerprint, 'in_progress', 1,
       now() + make_interval(secs => $2), now() + make_interval(secs => $3)
FROM unnest($4::bytea[], $5::text[], $6::bytea[]) AS batch(scope, key, fingerprint)
ON CONFLICT (scope, key) DO NOTHING
RETURNING id, fencing_token, key
"""
COMPLETE = """
UPDATE oncegate_keys
SET state = 'completed', response_status = $3, response_headers = $4::jsonb,
    response_body = $5, response_stored = true, completed_at = now(), lease_expires_at = NULL
WHERE id = $1 AND fencing_token = $2 AND state IN ('in_progress', 'unknown')
RETURNING id
"""
COMPLETE_MANY = """
UPDATE oncegate_keys AS row_
SET state = 'completed', response_status = batch.status, response_headers = batch.headers,
    response_body = batch.body, response_stored = true, completed_at = now(),
    lease_expires_at = NULL
FROM unnest($1::bigint[], $2::bigint[], $3::smallint[], $4::jsonb[], $5::bytea[])
    AS batch(id, token, status, headers, body)
WHERE row_.id = batch.id AND row_.fencing_token = batch.token
  AND row_.state IN ('in_progress', 'unknown')
RETURNING row_.id
"""


# --- natural batching ----------------------------------------------------------------------


class Batcher:
    """Groups concurrent operations of one kind into statements of at most `max_rows` rows.

    `send(connection, rows)` runs one statement and returns one result per row, in order. A row
    that finds nothing in flight goes at once; rows that arrive while statements are in flight
    wait, and the next statement leaves when one returns or when `max_rows` are waiting, with at
    most `max_in_flight` statements (the pool's size) in flight."""

    def __init__(
        self,
        pool: asyncpg.Pool,
        send: Callable[[asyncpg.Connection, list[Any]], Awaitable[list[Any]]],
        max_rows: int,
        max_in_flight: int,
    ) -> None:
        self._pool = pool
        self._send = send
        self._max_rows = max_rows
        self._max_in_flight = max_in_flight
        self._pending: list[tuple[Any, asyncio.Future[Any]]] = []
        self._in_flight = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self.statements = 0
        self.rows = 0

    async def submit(self, row: Any) -> Any:
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending.append((row, future))
        while (
            self._pending
            and self._in_flight < self._max_in_flight
            and (self._in_flight == 0 or len(self._pending) >= self._max_rows)
        ):
            self._launch()
        return await future

    def _launch(self) -> None:
        batch = self._pending[: self._max_rows]
        del self._pending[: self._max_rows]
        self._in_flight += 1
        self.statements += 1
        self.rows += len(batch)
        task = asyncio.create_task(self._run(batch))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, batch: list[tuple[Any, asyncio.Future[Any]]]) -> None:
        try:
            async with self._pool.acquire() as connection:
                results = await self._send(connection, [row for row, _ in batch])
        except Exception as exc:  # not kept going: every waiter of this batch gets it
            for _, future in batch:
                if not future.done():
                    future.set_exception(exc)
        else:
            for (_, future), result in zip(batch, results, strict=True):
                if not future.done():
                    future.set_result(result)
        finally:
            self._in_flight -= 1
            if self._pending:  # what gathered while this one was out leaves now
                self._launch()


async def claim_many(connection: asyncpg.Connection, rows: list[str]) -> list[Any]:
    returned = await connection.fetch(
        CLAIM_MANY,
        ROUTE,
        LEASE_SECONDS,
        TTL_SECONDS,
        [SCOPE] * len(rows),
        rows,
        [FINGERPRINT] * len(rows),
        timeout=STATEMENT_TIMEOUT,
    )
    claimed = {record["key"]: (record["id"], record["fencing_token"]) for record in returned}
    return [claimed.get(key) for key in rows]


async def complete_many(connection: asyncpg.Connection, rows: list[tuple[int, int]]) -> list[Any]:
    count = len(rows)
    returned = await connection.fetch(
        COMPLETE_MANY,
        [row_id for row_id, _ in rows],
        [token for _, token in rows],
        [ANSWER_STATUS] * count,
        [ANSWER_HEADERS] * count,
        [ANSWER_BODY] * count,
        timeout=STATEMENT_TIMEOUT,
    )
    completed = {record["id"] for record in returned}
    return [row_id in completed for row_id, _ in rows]


# --- one measured run ----------------------------------------------------------------------


@dataclass
class Sample:
    pairs_per_second: float
    postgres_ms_per_pair: float
    client_ms_per_pair: float
    claim_rows_per_statement: float
    complete_rows_per_statement: float
    failures: int  # claims that found their key taken, or completes that changed no row


@dataclass
class Counters:
    pairs: int = 0
    failures: int = 0
    errors: list[str] = field(default_factory=list)


async def measure(
    url: str, postmaster: int, max_rows: int, arguments: argparse.Namespace, tag: str
) -> Sample:
    setup = await asyncpg.connect(url, timeout=10)
    try:
        await setup.execute("TRUNCATE oncegate_keys", timeout=STATEMENT_TIMEOUT)
        await setup.execute("CHECKPOINT", timeout=STATEMENT_TIMEOUT)
    finally:
        await setup.close()
    options: dict[str, Any] = {"command_timeout": STATEMENT_TIMEOUT, "timeout": 10}
    # Set as the gateway's request pools are: planned once per connection, on a table this run
    # just emptied, so without `request_settings` a plan could scan the table as it grows.
    session = request_settings(on_citus=False)
    claims = await asyncpg.create_pool(
        url, min_size=CLAIM_POOL, max_size=CLAIM_POOL, server_settings=session, **options
    )
    answers = await asyncpg.create_pool(
        url,
        min_size=ANSWER_POOL,
        max_size=ANSWER_POOL,
        server_settings={**session, "synchronous_commit": "off"},
        **options,
    )
    claim_batcher = Batcher(claims, claim_many, max_rows, CLAIM_POOL)
    complete_batcher = Batcher(answers, complete_many, max_rows, ANSWER_POOL)

    async def claim(key: str) -> tuple[int, int] | None:
        if max_rows > 1:
            result: tuple[int, int] | None = await claim_batcher.submit(key)
            return result
        record = await claims.fetchrow(
            CLAIM, ROUTE, SCOPE, key, FINGERPRINT, LEASE_SECONDS, TTL_SECONDS
        )
        return None if record is None else (record["id"], record["fencing_token"])

    async def complete(row_id: int, token: int) -> bool:
        if max_rows > 1:
            done: bool = await complete_batcher.submit((row_id, token))
            return done
        returned = await answers.fetchval(
            COMPLETE, row_id, token, ANSWER_STATUS, ANSWER_HEADERS, ANSWER_BODY
        )
        return returned is not None

    counters = Counters()
    stop = asyncio.Event()

    async def worker(number: int) -> None:
        sequence = 0
        while not stop.is_set():
            sequence += 1
            try:
                claimed = await claim(f"{tag}-{number}-{sequence}")
                if claimed is None or not await complete(*claimed):
                    counters.failures += 1
                    continue
            except (TimeoutError, asyncpg.PostgresError, OSError) as exc:
                counters.errors.append(f"{type(exc).__name__}: {exc}")
                stop.set()
                return
            counters.pairs += 1

    groups = {"postgres": [postmaster], "client": [os.getpid()]}
    workers = [asyncio.create_task(worker(number)) for number in range(arguments.tasks)]
    try:
        await asyncio.sleep(arguments.warmup)
        pairs_before, cpu_before = counters.pairs, run.cpu_seconds(groups)
        statements_before = (claim_batcher.statements, complete_batcher.statements)
        rows_before = (claim_batcher.rows, complete_batcher.rows)
        started = time.monotonic()
        await asyncio.sleep(arguments.duration)
        pairs, cpu_after = counters.pairs - pairs_before, run.cpu_seconds(groups)
        elapsed = time.monotonic() - started
        statements = (
            claim_batcher.statements - statements_before[0],
            complete_batcher.statements - statements_before[1],
        )
        rows = (claim_batcher.rows - rows_before[0], complete_batcher.rows - rows_before[1])
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(*workers), STOP_GRACE)
        await answers.close()
        await claims.close()
    if counters.errors:
        raise RuntimeError(f"{len(counters.errors)} errors, the first: {counters.errors[0]}")

    def per_pair(group: str) -> float:
        return (cpu_after[group] - cpu_before[group]) / pairs * 1000 if pairs else math.nan

    def mean_rows(index: int) -> float:
        return rows[index] / statements[index] if statements[index] else 1.0

    return Sample(
        pairs_per_second=pairs / elapsed,
        postgres_ms_per_pair=per_pair("postgres"),
        client_ms_per_pair=per_pair("client"),
        claim_rows_per_statement=mean_rows(0),
        complete_rows_per_statement=mean_rows(1),
        failures=counters.failures,
    )


# --- the report ----------------------------------------------------------------------------


def shape_name(max_rows: int) -> str:
    if max_rows == 1:
        return "one statement per operation"
    return f"multi-row statements (`unnest` arrays), at most {max_rows} rows"


def table(samples: dict[int, list[Sample]]) -> str:
    lines = [
        "| how the statements are sent | claim+complete pairs/s | PostgreSQL CPU per pair "
        "| client CPU per pair | rows per statement, claim / complete (median) | failed pairs |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for max_rows, measured in samples.items():
        lines.append(
            f"| {shape_name(max_rows)} "
            f"| {run.spread([s.pairs_per_second for s in measured], 0, thousands=True)} "
            f"| {run.spread([s.postgres_ms_per_pair for s in measured], 3)} ms "
            f"| {run.spread([s.client_ms_per_pair for s in measured], 3)} ms "
            f"| {statistics.median(s.claim_rows_per_statement for s in measured):.1f} / "
            f"{statistics.median(s.complete_rows_per_statement for s in measured):.1f} "
            f"| {sum(s.failures for s in measured)} |"
        )
    return "\n".join(lines)


def machine_line(url: str) -> str:
    postgres = asyncio.run(run._fetch(url, "SHOW server_version")).split()[0]
    return (
        f"machine: nproc {os.cpu_count()}, {run.cpu_model()}, Python {platform.python_version()}, "
        f"asyncpg {asyncpg.__version__}, PostgreSQL {postgres} embedded (pgserver); client and "
        "PostgreSQL share the machine"
    )


def load_line() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f}, {five:.2f}, {fifteen:.2f}"


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--duration", type=quick.positive(float), default=3.0, metavar="SECONDS", help="per run"
    )
    parser.add_argument("--warmup", type=float, default=1.0, metavar="SECONDS", help="before each")
    parser.add_argument("--repeats", type=quick.positive(int), default=1, metavar="N")
    parser.add_argument(
        "--rows",
        type=lambda text: [int(part) for part in text.split(",")],
        default=[1, 4, 8, 16, 64],
        metavar="N,N,...",
        help="at most this many rows per statement, one shape each; 1: one statement per "
        "operation (default 1,4,8,16,64)",
    )
    parser.add_argument("--tasks", type=quick.positive(int), default=64, metavar="N")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory")
    arguments = parser.parse_args()
    if any(rows < 1 for rows in arguments.rows):
        parser.error("--rows: every size must be at least 1")
    arguments.warmup = max(arguments.warmup, 0.0)
    return arguments


def main() -> int:
    arguments = parse_arguments()
    runs = len(arguments.rows) * arguments.repeats
    budget = STARTUP_TIMEOUT * 2 + runs * (arguments.warmup + arguments.duration + STOP_GRACE)

    def out_of_time(signum: int, frame: object) -> None:
        raise TimeoutError(f"the benchmark ran out of its {budget:.0f}s budget")

    signal.signal(signal.SIGALRM, out_of_time)
    signal.alarm(math.ceil(budget))
    try:
        with quick.embedded_postgres("oncegate-batch-shapes-", arguments.keep) as server:
            postmaster = run._postmaster_pid(server.pgdata)
            if postmaster is None:
                raise RuntimeError(f"no postmaster.pid in {server.pgdata}")
            print(machine_line(server.url))
            print(
                f"{arguments.tasks} asyncio tasks, each a claim then a complete on a new key, "
                f"back to back; claim pool {CLAIM_POOL} connections (synchronous commit), answer "
                f"pool {ANSWER_POOL} (synchronous_commit = off); table oncegate_keys from the "
                f"migrations, emptied before each run; {arguments.warmup:g} s warm-up + "
                f"{arguments.duration:g} s per run, {arguments.repeats} run(s) per shape "
                "(interleaved), median (min-max); CPU from /proc"
            )
            print(f"before: {load_line()}")
            samples: dict[int, list[Sample]] = {max_rows: [] for max_rows in arguments.rows}
            for repeat in range(arguments.repeats):
                for max_rows in samples:
                    sample = asyncio.run(
                        measure(
                            server.url, postmaster, max_rows, arguments, f"r{repeat}-m{max_rows}"
                        )
                    )
                    samples[max_rows].append(sample)
                    run.progress(
                        f"at most {max_rows} rows: {sample.pairs_per_second:,.0f} pairs/s, "
                        f"PostgreSQL {sample.postgres_ms_per_pair:.3f} ms/pair, "
                        f"client {sample.client_ms_per_pair:.3f} ms/pair, rows per statement "
                        f"{sample.claim_rows_per_statement:.1f} / "
                        f"{sample.complete_rows_per_statement:.1f}"
                    )
            print(f"after: {load_line()}")
            print(f"\n$ {quick.command_line()}\n")
            print(table(samples))
            signal.alarm(0)
            return 1 if any(s.failures for measured in samples.values() for s in measured) else 0
    except (RuntimeError, TimeoutError, asyncpg.PostgresError, OSError) as exc:
        print(f"batch_shapes failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        signal.alarm(0)


if __name__ == "__main__":
    sys.exit(main())
