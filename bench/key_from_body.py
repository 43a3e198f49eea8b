"""How long other requests wait while large JSON bodies are read for their key.

Starts, on 127.0.0.1 and free ports: the demo upstream (its `/sink` reads each large request
whole and answers 201 `{}`; its `/echo` answers the probes), and two gateways on one embedded
PostgreSQL: the gateway as it is, and the same gateway with the key of a large body
read in a worker thread, as it was before `oncegate.kernel.key_workers` (patched in by this
script: an
instrument, never a way to run the gateway). Each gateway has three routes: `/bulk` (the key in
`Idempotency-Key`), `/bulkbody` (`key_from_body: /idempotency_key`) and `/probe` (a passed
through GET to the demo upstream).

Then, for each row and `--rounds` times, interleaved so that a busy machine slows every row
alike: `--bodies` POSTs of about 8.6 MiB of JSON at once (100,000 small objects, the key last),
and, while they are in flight, one GET after another to `/probe`; the table gives the probes'
latency (p50, p90, max, over every round) and the large requests' time. Every server is stopped
by PID at the end, failure or not.

    .venv/bin/python bench/key_from_body.py [--bodies 3] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import quick

# The gateway of before: `_key` parses a large body in a worker thread.
THREAD_GATEWAY = """
import asyncio, sys
from oncegate.kernel import keys
from oncegate.service import flow

async def _thread(body, pointer, shown):
    return await asyncio.to_thread(keys.from_body, body, pointer, shown)

class ThreadWorkers:
    from_body = staticmethod(_thread)

    async def close(self):
        pass

flow.KeyWorkers = ThreadWorkers
from oncegate.kernel import key_workers
key_workers.KeyWorkers = ThreadWorkers
import oncegate.http.runtime as runtime
runtime.KeyWorkers = ThreadWorkers
from oncegate.commands.cli import main
sys.exit(main())
"""
ROWS = (
    ("header key (`/bulk`)", "now", "/bulk"),
    ("key from body, worker processes (`/bulkbody`)", "now", "/bulkbody"),
    ("key from body, worker thread, as before (`/bulkbody`)", "before", "/bulkbody"),
)


def config(work: Path, name: str, demo_url: str) -> Path:
    def route(path: str, upstream: str, **options: object) -> dict[str, object]:
        return {"name": path, "match": f"/{path}", "upstream": upstream, "strip_prefix": True,
                **options}  # fmt: skip

    routes = [
        route("bulk", demo_url),
        route("bulkbody", demo_url, key_from_body="/idempotency_key"),
        route("probe", demo_url),
    ]
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"routes": routes}))
    return path


async def measure(
    gateways: dict[str, str], bodies: int, rounds: int
) -> dict[str, tuple[list[float], list[float]]]:
    items = [{"id": index, "name": f"line item {index}", "amount": 1234, "tags": ["a", "b"]}
             for index in range(116_000)]  # fmt: skip
    head, tail = json.dumps({"items": items, "idempotency_key": "KEY"}).encode().split(b'"KEY"')
    print(f"each large body: {(len(head) + len(tail)) / 2**20:.1f} MiB", file=sys.stderr)
    figures: dict[str, tuple[list[float], list[float]]] = {row[0]: ([], []) for row in ROWS}
    limits = httpx.Limits(max_connections=bodies)
    async with (
        httpx.AsyncClient(timeout=120, limits=limits) as uploads,
        httpx.AsyncClient(timeout=120) as probes,
    ):
        for url in gateways.values():
            await probes.get(f"{url}/probe/echo/warm")
        for _ in range(rounds):
            for label, gateway, path in ROWS:
                url = gateways[gateway]
                keys = [uuid.uuid4().hex for _ in range(bodies)]
                posts = [
                    uploads.post(
                        f"{url}{path}/sink",
                        content=head + json.dumps(key).encode() + tail,
                        headers={"content-type": "application/json", "idempotency-key": key},
                    )
                    for key in keys
                ]
                latencies, durations = figures[label]
                loop = asyncio.get_running_loop()
                started = loop.time()
                uploading = asyncio.gather(*posts)
                while not uploading.done():
                    sent = loop.time()
                    answer = await probes.get(f"{url}/probe/echo/probe")
                    latencies.append(loop.time() - sent)
                    answer.raise_for_status()
                answers = await uploading
                durations.append(loop.time() - started)
                if [answer.status_code for answer in answers] != [201] * bodies:
                    raise SystemExit(f"{label}: {[answer.status_code for answer in answers]}")
    return figures


def table(figures: dict[str, tuple[list[float], list[float]]]) -> str:
    lines = [
        "| route | probes | probe p50 ms | probe p90 ms | probe max ms | large requests, s |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for label, (latencies, durations) in figures.items():
        deciles = statistics.quantiles(latencies, n=10)
        lines.append(
            f"| {label} | {len(latencies)} | {statistics.median(latencies) * 1000:.1f} | "
            f"{deciles[-1] * 1000:.1f} | {max(latencies) * 1000:.1f} | "
            f"{statistics.mean(durations):.2f} |"
        )
    return "\n".join(lines)


def start_servers(
    work: Path, database_url: str, started: list[subprocess.Popen[bytes]]
) -> dict[str, str]:
    """The demo upstream and both gateways, listening; the gateways' URLs by name."""
    environment = {**quick.server_environment(work / "data"), "ONCEGATE_DATABASE_URL": database_url}
    demo_port = quick.free_port()
    demo_url = f"http://{quick.HOST}:{demo_port}"
    programs = {
        "demo": (quick.oncegate("demo-upstream", "--host", quick.HOST, "--port", str(demo_port)),
                 demo_port),
    }  # fmt: skip
    gateways: dict[str, str] = {}
    for name, program in (
        ("now", ["-m", "oncegate.cli"]),
        ("before", ["-c", THREAD_GATEWAY]),
    ):
        port, admin = quick.free_port(), quick.free_port()
        serve = ["serve", "--config", str(config(work, name, demo_url)),
                 "--host", quick.HOST, "--port", str(port), "--admin-port", str(admin)]  # fmt: skip
        programs[f"gateway-{name}"] = ([sys.executable, *program, *serve], port)
        gateways[name] = f"http://{quick.HOST}:{port}"
    for name, (command, port) in programs.items():
        log = work / f"{name}.log"
        process = quick.start(command, log, environment, started)
        quick.wait_listening(process, port, log, quick.STARTUP_TIMEOUT)
    return gateways


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bodies", type=int, default=3, help="large bodies at once (3)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every row (3)")
    arguments = parser.parse_args()
    work = quick.work_directory("oncegate-key-from-body-")
    started: list[subprocess.Popen[bytes]] = []
    try:
        with quick.embedded_postgres("oncegate-key-from-body-pg-") as server:
            gateways = start_servers(work, server.url, started)
            began = time.monotonic()
            figures = asyncio.run(measure(gateways, arguments.bodies, arguments.rounds))
            print(f"    {quick.command_line()}")
            print(
                f"    {platform.node()}: {platform.machine()}, Python "
                f"{platform.python_version()}, {arguments.bodies} bodies at once, "
                f"{arguments.rounds} rounds of each row, interleaved; "
                f"{time.monotonic() - began:.0f} s\n"
            )
            print(table(figures))
    finally:
        for process in reversed(started):
            quick.stop(process)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
