"""CPU time per request of running processes, under a fixed load: the figure used to compare
changes to the request path one at a time (bench/HISTORY.md).

Point it at a running gateway (or any proxy) in front of `oncegate demo-upstream`, name the
processes to account (the gateway, and PostgreSQL's backends if wanted), and it sends POST
/emails for `--duration` seconds over `--connections` keep-alive connections: every request a
new key (`forward`) or one of a few stored keys (`replay`). It prints req/s and, per process,
CPU milliseconds per answered request (utime + stime from /proc). CPU per request is far less
sensitive than req/s to what else the machine is doing.

    .venv/bin/python bench/cpu_per_request.py --port 8080 --mode replay \\
        --pid "$(pgrep -f 'oncegate serve')"
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import time
import uuid

BODY = b'{"to":"a@example.com","subject":"hi"}'
TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


async def connection(port: int, mode: str, number: int, end: float, answers: list[bytes]) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    while time.monotonic() < end:
        key = uuid.uuid4().hex if mode == "forward" else f"cpu-bench-replay-{number % 8}"
        writer.write(
            b"POST /emails HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
            + f"Idempotency-Key: {key}\r\nContent-Length: {len(BODY)}\r\n\r\n".encode()
            + BODY
        )
        head = await reader.readuntil(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        await reader.readexactly(length)
        answers.append(head[9:12])
    writer.close()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--mode", choices=["forward", "replay"], default="forward")
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument("--pid", type=int, action="append", default=[], help="repeatable")
    arguments = parser.parse_args()
    answers: list[bytes] = []
    warm_end = time.monotonic() + 1
    await asyncio.gather(
        *(connection(arguments.port, arguments.mode, n, warm_end, []) for n in range(4))
    )
    before = [cpu_seconds(pid) for pid in arguments.pid]
    started = time.monotonic()
    end = started + arguments.duration
    await asyncio.gather(
        *(
            connection(arguments.port, arguments.mode, n, end, answers)
            for n in range(arguments.connections)
        )
    )
    elapsed = time.monotonic() - started
    after = [cpu_seconds(pid) for pid in arguments.pid]
    statuses = dict(collections.Counter(status.decode() for status in answers))
    print(
        f"{arguments.mode}: {len(answers) / elapsed:,.0f} req/s over {arguments.connections} "
        f"connections, statuses {statuses}"
    )
    for pid, first, last in zip(arguments.pid, before, after, strict=True):
        print(f"  pid {pid}: {1000 * (last - first) / max(1, len(answers)):.3f} ms CPU/request")


if __name__ == "__main__":
    asyncio.run(main())
