"""The gateway's own Python per request, in one process: `Gateway.handle` on the in-memory store
with an upstream that answers at once, so no socket, server stack or PostgreSQL is in the figure.

It prints, per row, the CPU time of this process per `handle` (µs), the minimum and the median of
`--repeats` interleaved runs of `--requests` requests each: a new key per request (`forward`), or
one of 100 stored keys (`replay`), each on a route that keeps the request behind its key (the
default) and on one that does not (`keep_request: never`). The difference between the two is
what building the kept request costs every keyed request (the claim carries it whether it inserts
or finds the key stored). Requests run one after another: the figure is the gateway's code, not
its batching.

Run it in another checkout's environment to compare two builds of the same code (a compiled one,
say) on this machine: `OTHER/.venv/bin/python bench/handle_cpu.py` imports OTHER's oncegate.

    .venv/bin/python bench/handle_cpu.py [--requests 20000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
import uuid
from collections.abc import Sequence
from typing import Any

import quick

from oncegate.service.flow import Gateway
from oncegate.service.messages import ProxyRequest
from oncegate.settings import Route
from oncegate.store.memory import MemoryStore
from oncegate.upstream import UpstreamResponse

BODY = quick.BODY
ANSWER = b'{"id":"em_1","status":"queued"}'
POOL = 100  # stored keys a replay row repeats
# The keys the in-memory store holds at most: a run's new keys would otherwise cost it memory
# and collections the gateway never pays (bench/memory_gateway.py says the same).
CAPACITY = 10_000


class AtOnce:
    """An upstream that answers every request at once, as the demo upstream would."""

    async def send(self, *arguments: Any, **options: Any) -> UpstreamResponse:
        headers = [("content-type", "application/json"), ("content-length", str(len(ANSWER)))]
        return UpstreamResponse(201, headers, ANSWER, 0.0)

    async def aclose(self) -> None:
        return None


def request(key: str) -> ProxyRequest:
    """What the proxy edge hands the gateway for wrk's request (bench/load.lua)."""
    headers = [
        ("host", f"{quick.HOST}:8080"),
        ("content-type", "application/json"),
        ("idempotency-key", key),
        ("content-length", str(len(BODY))),
    ]
    return ProxyRequest("POST", "/emails", "", headers, BODY)


async def one_run(mode: str, keep: str, count: int) -> float:
    """µs of this process's CPU per `handle`, over `count` requests after the pool is stored."""
    route = Route.model_validate(
        {"name": "default", "match": "/", "upstream": "http://127.0.0.1:9", "keep_request": keep}
    )
    gateway = Gateway(MemoryStore(capacity=CAPACITY), AtOnce())
    run = uuid.uuid4().hex[:8]
    for index in range(POOL):
        await gateway.handle(route, request(f"{run}-pool-{index}"))
    if mode == "replay":
        requests = [request(f"{run}-pool-{index % POOL}") for index in range(count)]
    else:
        requests = [request(f"{run}-new-{index}") for index in range(count)]
    started = time.process_time()
    for each in requests:
        answer = await gateway.handle(route, each)
        if answer.status != 201:
            raise RuntimeError(f"{mode}: the gateway answered {answer.status}")
    return (time.process_time() - started) / count * 1e6


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=quick.positive(int), default=20_000, metavar="N")
    parser.add_argument("--repeats", type=quick.positive(int), default=5, metavar="N")
    arguments = parser.parse_args(argv)
    rows = [(mode, keep) for mode in ("forward", "replay") for keep in ("until_settled", "never")]
    figures: dict[tuple[str, str], list[float]] = {row: [] for row in rows}
    for _ in range(arguments.repeats):
        for mode, keep in rows:
            figures[mode, keep].append(asyncio.run(one_run(mode, keep, arguments.requests)))
    print(f"$ {quick.command_line()}\n")
    print(f"Python {sys.version.split()[0]}; {arguments.repeats} interleaved runs per row\n")
    print("| request | keep_request | µs CPU per handle, min | median |")
    print("|---|---|---:|---:|")
    for mode, keep in rows:
        values = figures[mode, keep]
        print(f"| {mode} | {keep} | {min(values):.1f} | {statistics.median(values):.1f} |")
    for mode in ("forward", "replay"):
        kept = statistics.median(figures[mode, "until_settled"])
        kept -= statistics.median(figures[mode, "never"])
        print(f"\nthe kept request, {mode}: {kept:+.1f} µs per request (medians)", end="")
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
