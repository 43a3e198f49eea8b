"""What a claim and a complete cost when PostgreSQL has been idle as long as it is in a forward.

`bench/run.py`'s floor row sends the gateway's claim and complete back to back, so each backend
has been idle for one round trip of the other statement when its next statement arrives. In a
forward at 1 connection a backend is idle for a whole request: the upstream's round trip lies
between the claim and the complete, and the client's between one request and the next. On a
virtual machine whose idle vCPUs halt, waking a backend that idled longer costs more.

This runs the floor's pair (the gateway's statements, one-row arrays, on two connections set as
its pools are) with a pause after each statement, and prints the claim's and the complete's
median time for each pause. The pause is one of:
- `busy`: this process spins; only PostgreSQL idles (what a gateway busy with other requests,
  or with the rest of this one, looks like from PostgreSQL);
- `sleep`: this process sleeps too (`asyncio.sleep`, whose wake-up is rounded to the loop's
  clock: the `pause ms` column says what it was).

It starts an embedded PostgreSQL (`oncegate.embedded`) in a fresh temporary directory with the
gateway's migrations, and removes both in a `finally`.

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
from pathlib import Path

import asyncpg

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import quick  # noqa: E402 - bench/ is on the path from here on
import run  # noqa: E402

from oncegate import keys  # noqa: E402
from oncegate.store.queries import QUERIES  # noqa: E402

WARMUP_PAIRS = 2000
STATEMENT_TIMEOUT = 30.0
# Generous: a run of 1,000 pairs takes seconds; the server's start, tens of seconds at worst.
BUDGET = 600


async def _pause(how: str, seconds: float) -> None:
    if seconds <= 0:
        return
    if how == "sleep":
        await asyncio.sleep(seconds)
        return
    until = time.perf_counter() + seconds
    while time.perf_counter() < until:
        pass


async def measure(url: str, how: str, pause_ms: float, pairs: int, tag: str) -> list[float]:
    """Median claim ms, complete ms and pause ms of `pairs` pairs."""
    generic = {"plan_cache_mode": "force_generic_plan"}
    claims = await asyncpg.connect(url, server_settings=generic, timeout=10)
    answers = await asyncpg.connect(
        url, server_settings={**generic, "synchronous_commit": "off"}, timeout=10
    )
    claim, complete = QUERIES["claim"], QUERIES["complete"]
    scope = keys.scope(run.ROUTE, [[]])
    claim_ms: list[float] = []
    complete_ms: list[float] = []
    paused_ms: list[float] = []
    try:
        for number in range(pairs):
            key = f"{tag}-{number}"
            arrays = {
                "routes": [run.ROUTE], "scopes": [scope], "keys": [key],
                "fingerprints": [bytes(32)], "leases": [60.0], "ttls": [86400.0],
            }  # fmt: skip
            started = time.perf_counter()
            row = (await claims.fetch(claim.sql, *claim.arguments(arrays),
                                      timeout=STATEMENT_TIMEOUT))[0]  # fmt: skip
            claimed = time.perf_counter()
            await _pause(how, pause_ms / 1000)
            answer = {
                "ids": [row["id"]], "keys": [key], "tokens": [row["fencing_token"]],
                "statuses": [201], "stored": [True], "headers": [run.FILL_HEADERS],
                "bodies": [run.FILL_BODY], "sealed_with": [None], "sealed_headers": [None],
            }  # fmt: skip
            resumed = time.perf_counter()
            await answers.fetch(complete.sql, *complete.arguments(answer),
                                timeout=STATEMENT_TIMEOUT)  # fmt: skip
            completed = time.perf_counter()
            await _pause(how, pause_ms / 1000)
            claim_ms.append((claimed - started) * 1000)
            complete_ms.append((completed - resumed) * 1000)
            paused_ms.append((resumed - claimed) * 1000)
    finally:
        await claims.close()
        await answers.close()
    return [statistics.median(claim_ms), statistics.median(complete_ms),
            statistics.median(paused_ms)]  # fmt: skip


def table(rows: Sequence[tuple[str, float, list[float]]]) -> str:
    lines = [
        "| pause | pause ms | claim ms (p50) | complete ms (p50) | pair ms | pair - no pause |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    base = next((c + k for how, _, (c, k, _) in rows if how == "none"), math.nan)
    for how, _, (claim_ms, complete_ms, paused) in rows:
        pair = claim_ms + complete_ms
        lines.append(
            f"| {how} | {paused:.2f} | {claim_ms:.3f} | {complete_ms:.3f} | {pair:.3f} | "
            f"{pair - base:+.3f} |"
        )
    return "\n".join(lines)


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=quick.positive(int), default=1000, metavar="N")
    parser.add_argument("--repeats", type=quick.positive(int), default=5, metavar="N")
    parser.add_argument(
        "--pauses", default="0.3,1", metavar="MS,MS,...",
        help="pauses after each statement, in ms, each run busy and asleep (and none first)",
    )  # fmt: skip
    arguments = parser.parse_args()
    try:
        arguments.pauses = [float(part) for part in arguments.pauses.split(",") if part]
    except ValueError:
        parser.error(f"--pauses: not a list of numbers: {arguments.pauses!r}")
    if any(pause <= 0 or not math.isfinite(pause) for pause in arguments.pauses):
        parser.error("--pauses: every pause must be a number of ms above 0")
    return arguments


def main() -> int:
    arguments = parse_arguments()

    def out_of_time(signum: int, frame: object) -> None:
        raise TimeoutError(f"the benchmark ran out of its {BUDGET}s budget")

    signal.signal(signal.SIGALRM, out_of_time)
    signal.alarm(BUDGET)
    try:
        with quick.embedded_postgres("oncegate-idle-penalty-") as server:
            asyncio.run(measure(server.url, "none", 0.0, WARMUP_PAIRS, "warm-up"))
            plan = [("none", 0.0)] + [
                (how, pause) for pause in arguments.pauses for how in ("busy", "sleep")
            ]
            runs: dict[tuple[str, float], list[list[float]]] = {step: [] for step in plan}
            for repeat in range(arguments.repeats):
                for how, pause in plan:
                    tag = f"r{repeat}-{how}-{pause}"
                    medians = asyncio.run(measure(server.url, how, pause, arguments.pairs, tag))
                    runs[how, pause].append(medians)
                    run.progress(
                        f"{how} {pause:g} ms: claim {medians[0]:.3f} complete {medians[1]:.3f} ms"
                    )
            print(f"\n$ {quick.command_line()}\n")
            print(
                f"{arguments.pairs} pairs per run, {arguments.repeats} runs per row (interleaved), "
                f"after {WARMUP_PAIRS} pairs of warm-up; medians of the runs' medians"
            )
            rows = [
                (how, pause, [statistics.median(column) for column in zip(*measured, strict=True)])
                for (how, pause), measured in runs.items()
            ]
            print(table(rows))
            return 0
    except (RuntimeError, TimeoutError, asyncpg.PostgresError, OSError) as exc:
        print(f"idle_penalty failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        signal.alarm(0)


if __name__ == "__main__":
    sys.exit(main())
