"""What a claim and a complete cost when PostgreSQL's backends idle between statements.

`bench/run.py`'s floor row sends the gateway's claim and complete back to back, so each of the
two connections' backends has been idle only for the other statement's round trip when its next
statement arrives. In a forward at 1 connection each has been idle for most of a request (the
upstream's round trip lies between the claim and the complete, the client's between one request
and the next). On a virtual machine whose idle vCPUs halt, waking a backend that idled longer can
cost more.

This runs the floor's pair (the gateway's statements, one-row arrays, on two connections set as
its pools are) with a pause after each statement, and prints per pause the median time each
connection's backend was idle before its statement (`idle` columns: the time since that
connection's previous statement returned), the claim's and the complete's median time, and the
median pair. The pause is one of:
- `busy`: this process spins; only PostgreSQL idles (what a gateway busy with other requests, or
  with the rest of this one, looks like from PostgreSQL);
- `sleep`: this process sleeps too (`asyncio.sleep`; the default loop's epoll wait is rounded up
  to whole milliseconds, so pauses under 1 ms are run busy only).

It starts an embedded PostgreSQL (`oncegate.store.embedded`) in a fresh temporary directory with the
gateway's migrations, and removes both at the end, failure or not. Runs are interleaved, each on
two new connections warmed with `WARMUP_PAIRS` pairs first; the figures are medians of the runs'
medians. It exits 1 if a claim did not claim or a complete did not complete.

    .venv/bin/python bench/idle_penalty.py [--pairs 1000] [--repeats 5] [--pauses 0.3,1]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import signal
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import asyncpg

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import quick  # noqa: E402 - bench/ is on the path from here on
import run  # noqa: E402
from batch_shapes import load_line, machine_line  # noqa: E402

from oncegate.kernel import keys  # noqa: E402
from oncegate.store.queries import DIALECTS  # noqa: E402

WARMUP_PAIRS = 200
STATEMENT_TIMEOUT = 30.0
# The embedded server's start and the migrations, at worst; and a pair's round trips, at worst.
STARTUP_SECONDS = 120.0
PAIR_SECONDS = 0.01
SLEEP_FLOOR_MS = 1.0


@dataclass(frozen=True)
class Run:
    claim_idle_ms: float
    complete_idle_ms: float
    claim_ms: float
    complete_ms: float
    pair_ms: float
    failures: int


async def _pause(how: str, seconds: float) -> None:
    if seconds <= 0:
        return
    if how == "sleep":
        await asyncio.sleep(seconds)
        return
    until = time.perf_counter() + seconds
    while time.perf_counter() < until:
        pass


async def measure(url: str, how: str, pause_ms: float, pairs: int, tag: str) -> Run:
    """`WARMUP_PAIRS` pairs, then `pairs` measured ones, with `pause_ms` after each statement."""
    claims, answers = await run.floor_connections(url)
    plain = DIALECTS["postgres"]
    claim, complete = plain["claim"], plain["complete"]
    scope = keys.scope(run.ROUTE, [[]])
    columns: dict[str, list[float]] = {"claim_idle": [], "complete_idle": [], "claim": [],
                                       "complete": [], "pair": []}  # fmt: skip
    failures = 0
    claim_returned = complete_returned = time.perf_counter()
    try:
        for number in range(WARMUP_PAIRS + pairs):
            key = f"{tag}-{number}"
            arrays = {
                "routes": [run.ROUTE], "scopes": [scope], "keys": [key],
                "fingerprints": [bytes(32)], "leases": [60.0], "ttls": [86400.0],
                "requests": [run.FLOOR_REQUEST], "requests_sealed_with": [None],
                "claimant": run.FLOOR_CLAIMANT,
            }  # fmt: skip
            started = time.perf_counter()
            rows = await claims.fetch(
                claim.sql, *claim.arguments(arrays), timeout=STATEMENT_TIMEOUT
            )
            claimed = time.perf_counter()
            await _pause(how, pause_ms / 1000)
            answer = {
                "ids": [rows[0]["id"]], "keys": [key], "tokens": [rows[0]["fencing_token"]],
                "statuses": [201], "stored": [True], "headers": [run.FILL_HEADERS],
                "bodies": [run.FILL_BODY], "sealed_with": [None], "sealed_headers": [None],
            }  # fmt: skip
            resumed = time.perf_counter()
            settled = await answers.fetch(
                complete.sql, *complete.arguments(answer), timeout=STATEMENT_TIMEOUT
            )
            completed = time.perf_counter()
            if not rows[0]["claimed"]:
                failures += 1
            if len(settled) != 1:
                failures += 1
            if number >= WARMUP_PAIRS:
                columns["claim_idle"].append((started - claim_returned) * 1000)
                columns["complete_idle"].append((resumed - complete_returned) * 1000)
                columns["claim"].append((claimed - started) * 1000)
                columns["complete"].append((completed - resumed) * 1000)
                columns["pair"].append((claimed - started + completed - resumed) * 1000)
            claim_returned, complete_returned = claimed, completed
            await _pause(how, pause_ms / 1000)
    finally:
        await claims.close()
        await answers.close()
    medians = {name: statistics.median(values) for name, values in columns.items()}
    return Run(
        medians["claim_idle"], medians["complete_idle"], medians["claim"], medians["complete"],
        medians["pair"], failures,
    )  # fmt: skip


def _medians(runs: Sequence[Run]) -> Run:
    """One row: the median of each figure over the runs, and their failures in all."""
    return Run(
        statistics.median(each.claim_idle_ms for each in runs),
        statistics.median(each.complete_idle_ms for each in runs),
        statistics.median(each.claim_ms for each in runs),
        statistics.median(each.complete_ms for each in runs),
        statistics.median(each.pair_ms for each in runs),
        sum(each.failures for each in runs),
    )


def table(rows: Sequence[tuple[str, float, Run]]) -> str:
    lines = [
        "| pause | pause ms | claim's backend idle ms | complete's backend idle ms | claim ms "
        "| complete ms | pair ms | pair - no pause |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    base = next((each.pair_ms for how, _, each in rows if how == "none"), math.nan)
    for how, pause, each in rows:
        lines.append(
            f"| {how} | {pause:g} | {each.claim_idle_ms:.2f} | {each.complete_idle_ms:.2f} | "
            f"{each.claim_ms:.3f} | {each.complete_ms:.3f} | {each.pair_ms:.3f} | "
            f"{each.pair_ms - base:+.3f} |"
        )
    return "\n".join(lines)


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=quick.positive(int), default=1000, metavar="N")
    parser.add_argument("--repeats", type=quick.positive(int), default=5, metavar="N")
    parser.add_argument(
        "--pauses", default="0.3,1", metavar="MS,MS,...",
        help="pauses after each statement, in ms (each run busy, and asleep from 1 ms)",
    )  # fmt: skip
    arguments = parser.parse_args()
    try:
        pauses = [float(part) for part in arguments.pauses.split(",")]
    except ValueError:
        parser.error(f"--pauses: not a list of numbers: {arguments.pauses!r}")
    if not all(0 < pause < math.inf for pause in pauses):
        parser.error("--pauses: every pause must be a number of ms above 0")
    if len(set(pauses)) != len(pauses):
        parser.error("--pauses: a pause is given twice")
    arguments.pauses = pauses
    return arguments


def plan_of(pauses: Sequence[float]) -> list[tuple[str, float]]:
    steps = [("none", 0.0)]
    for pause in pauses:
        steps.append(("busy", pause))
        if pause >= SLEEP_FLOOR_MS:
            steps.append(("sleep", pause))
    return steps


def main() -> int:
    arguments = parse_arguments()
    plan = plan_of(arguments.pauses)
    # Every run's pairs at a generous PAIR_SECONDS each, plus its pauses, twice over.
    seconds = sum(
        arguments.repeats * (WARMUP_PAIRS + arguments.pairs) * (PAIR_SECONDS + 2 * pause / 1000)
        for _, pause in plan
    )
    budget = math.ceil(STARTUP_SECONDS + 2 * seconds)

    def out_of_time(signum: int, frame: object) -> None:
        raise TimeoutError(f"the benchmark ran out of its {budget}s budget")

    signal.signal(signal.SIGALRM, out_of_time)
    signal.alarm(budget)
    try:
        with quick.embedded_postgres("oncegate-idle-penalty-") as server:
            print(machine_line(server.url))
            print(f"before: {load_line()}")
            runs: dict[tuple[str, float], list[Run]] = {step: [] for step in plan}
            for repeat in range(arguments.repeats):
                for how, pause in plan:
                    tag = f"r{repeat}-{how}-{pause:g}"
                    each = asyncio.run(measure(server.url, how, pause, arguments.pairs, tag))
                    runs[how, pause].append(each)
                    run.progress(
                        f"{how} {pause:g} ms: claim {each.claim_ms:.3f} ms, complete "
                        f"{each.complete_ms:.3f} ms, idle {each.claim_idle_ms:.2f} / "
                        f"{each.complete_idle_ms:.2f} ms"
                    )
            print(f"after: {load_line()}")
            print(f"\n$ {quick.command_line()}\n")
            print(
                f"{arguments.pairs} pairs per run after {WARMUP_PAIRS} of warm-up on the same "
                f"two connections, {arguments.repeats} runs per row (interleaved); medians of "
                "the runs' medians (pair ms: of each run's median claim+complete)"
            )
            rows = [(how, pause, _medians(measured)) for (how, pause), measured in runs.items()]
            print(table(rows))
            failed = sum(each.failures for _, _, each in rows)
            if failed:
                print(f"{failed} statements did not claim or complete their key", file=sys.stderr)
            return 1 if failed else 0
    except (RuntimeError, TimeoutError, asyncpg.PostgresError, OSError) as exc:
        print(f"idle_penalty failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        signal.alarm(0)


if __name__ == "__main__":
    sys.exit(main())
