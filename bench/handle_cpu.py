"""The gateway's own Python per request, in one process: `Gateway.handle` on the in-memory store
with an upstream that answers at once, so no socket, server stack or PostgreSQL is in the figure.

It prints, per row, the CPU time of this process per `handle` (µs), the minimum and the median of
`--repeats` interleaved runs of `--requests` requests each: a new key per request (`forward`), or
one of 100 stored keys (`replay`), each on a route that keeps the request behind its key (the
default) and on one that does not (`keep_request: never`). The difference between the two is
what building the kept request costs every keyed request (the claim carries it whether it inserts
or finds the key stored). The `wait` row is the forward on a route with `wait` (a retry of a key
in flight waits for its answer): nobody waits on a new key, so it should cost what the first row
costs. Requests run one after another: the figure is the gateway's code, not its batching.

The `edge` rows are the whole proxy port instead (`ProxyApp`, the ASGI call uvicorn makes, with
the gateway's JSON log line, written to /dev/null, and its metrics): everything the gateway's
process does for a request but the server stack, the upstream client and the store's driver.

Run it in another checkout's environment to compare two builds of the same code (a compiled one,
say) on this machine: `OTHER/.venv/bin/python bench/handle_cpu.py` imports OTHER's oncegate.

    .venv/bin/python bench/handle_cpu.py [--requests 20000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import statistics
import sys
import time
import uuid
from collections.abc import Sequence
from typing import Any

import quick

from oncegate.http.proxy import ProxyApp
from oncegate.service.flow import Gateway
from oncegate.service.messages import ProxyRequest
from oncegate.service.routing import RouteTable
from oncegate.settings import Route
from oncegate.store.memory import MemoryStore
from oncegate.telemetry import logs, metrics
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


def scope(key: str) -> dict[str, Any]:
    """What uvicorn hands the proxy port for the same request."""
    return {
        "type": "http",
        "http_version": "1.1",
        "method": "POST",
        "path": "/emails",
        "raw_path": b"/emails",
        "query_string": b"",
        "headers": [(name.encode(), value.encode()) for name, value in request(key).headers],
    }


async def receive() -> dict[str, Any]:
    return {"type": "http.request", "body": BODY, "more_body": False}


class Sent:
    """The proxy port's `send`: keeps the status it was given."""

    status = 0

    async def __call__(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]


async def one_run(mode: str, keep: str, count: int) -> float:
    """µs of this process's CPU per `handle` (or per proxy port call, `keep` "edge"), over
    `count` requests after the pool is stored."""
    route = Route.model_validate(
        {
            "name": "default",
            "match": "/",
            "upstream": "http://127.0.0.1:9",
            "keep_request": "until_settled" if keep in ("edge", "wait") else keep,
            # A route whose retries wait (`wait`): nobody waits on a new key, so it should
            # cost what the route without it costs.
            **({"wait": "10s"} if keep == "wait" else {}),
        }
    )
    gateway = Gateway(MemoryStore(capacity=CAPACITY), AtOnce())
    run = uuid.uuid4().hex[:8]
    keys = [f"{run}-pool-{index}" for index in range(POOL)]
    for key in keys:
        await gateway.handle(route, request(key))
    if mode == "replay":
        keys = [keys[index % POOL] for index in range(count)]
    else:
        keys = [f"{run}-new-{index}" for index in range(count)]
    if keep == "edge":
        application, sent = ProxyApp(gateway, RouteTable([route])), Sent()
        scopes = [scope(key) for key in keys]
        started = time.process_time()
        for each in scopes:
            await application(each, receive, sent)
            if sent.status != 201:
                raise RuntimeError(f"{mode}: the proxy port answered {sent.status}")
        return (time.process_time() - started) / count * 1e6
    requests = [request(key) for key in keys]
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
    # As the gateway logs and counts (`oncegate serve`), its lines written to /dev/null.
    logs.configure("json", "info")
    with open(os.devnull, "w") as devnull:
        for handler in logging.getLogger().handlers:
            if isinstance(handler, logging.StreamHandler):
                handler.setStream(devnull)
        metrics.setup()
        return _measure(arguments)


def _measure(arguments: argparse.Namespace) -> int:
    rows = [
        (mode, keep)
        for mode in ("forward", "replay")
        for keep in ("until_settled", "never", "edge")
    ]
    rows.insert(1, ("forward", "wait"))
    figures: dict[tuple[str, str], list[float]] = {row: [] for row in rows}
    for _ in range(arguments.repeats):
        for mode, keep in rows:
            figures[mode, keep].append(asyncio.run(one_run(mode, keep, arguments.requests)))
    print(f"$ {quick.command_line()}\n")
    print(f"Python {sys.version.split()[0]}; {arguments.repeats} interleaved runs per row\n")
    print(
        "| request | keep_request (edge: the whole proxy port; wait: until_settled on a route "
        "with `wait`) | µs CPU per call, min | median |"
    )
    print("|---|---|---:|---:|")
    for mode, keep in rows:
        values = figures[mode, keep]
        print(f"| {mode} | {keep} | {min(values):.1f} | {statistics.median(values):.1f} |")
    for mode in ("forward", "replay"):
        kept = statistics.median(figures[mode, "until_settled"])
        kept -= statistics.median(figures[mode, "never"])
        print(f"\nthe kept request, {mode}: {kept:+.1f} µs per request (medians)", end="")
    waited = statistics.median(figures["forward", "wait"])
    waited -= statistics.median(figures["forward", "until_settled"])
    print(f"\nthe route's wait, a forward nobody waits for: {waited:+.1f} µs per request (medians)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
