"""The recording upstream: an HTTP/1.1 server that writes down every request it reads, durably,
before it answers, and misbehaves now and then on purpose.

Run as `python -m tests.soak.upstream --port P --log FILE --seed S`. For each request it reads
under one of the soak's routes it draws a fate (seeded, so a run can be replayed):

- `answer`: performed, 201 with a JSON receipt;
- `slow`: performed, answered only after `--slow` seconds, past the route's timeout;
- `error500`: performed, then 500 (a stored answer, not a release status);
- `reset`: performed, then the connection is reset instead of answered;
- `429`, `503`: refused, nothing performed (the gateway releases the key).

Requests under other paths (the fuzzer's routes) are always answered 200 and never faulted.
Every request read is appended to the log as one JSON line (`history.Performed`) and the file
fsync'ed before the answer leaves: what the log says was performed really was, whatever is killed
afterwards. Appends of concurrent requests share one fsync (group commit), so the log keeps up.

Every answer body names the request it answers (route, tenant, key, attempt, serial), so the
checker can trace any answer a client saw, replayed or not, back to this log.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import random
import signal
import socket
import struct
import time
from pathlib import Path

from tests.soak.history import ATTEMPT_HEADER, UPSTREAM_MARK, Performed

FAULTS = ("slow", "error500", "reset", "429", "503")
REASONS = {200: "OK", 201: "Created", 429: "Too Many Requests", 500: "Internal Server Error",
           503: "Service Unavailable"}  # fmt: skip


class Journal:
    """Appends lines to a file; `append` returns once the line is on disk (one fsync per batch
    of lines appended while the previous fsync ran)."""

    def __init__(self, path: Path) -> None:
        self._file = path.open("ab")
        self._pending: list[tuple[bytes, asyncio.Future[None]]] = []
        self._wake = asyncio.Event()
        self._task = asyncio.create_task(self._flush_forever())

    async def append(self, line: bytes) -> None:
        done = asyncio.get_running_loop().create_future()
        self._pending.append((line, done))
        self._wake.set()
        await done

    async def _flush_forever(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            batch, self._pending = self._pending, []
            self._file.write(b"".join(line for line, _ in batch))
            self._file.flush()
            await asyncio.to_thread(os.fsync, self._file.fileno())
            for _, done in batch:
                if not done.done():
                    done.set_result(None)

    async def close(self) -> None:
        """Called once the server stopped reading: whatever is pending gets written first."""
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._file.write(b"".join(line for line, _ in self._pending))
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()


class RecordingUpstream:
    def __init__(
        self, journal: Journal, routes: frozenset[str], seed: int, fault_rate: float, slow: float
    ) -> None:
        self.journal = journal
        self.routes = routes
        self.random = random.Random(seed)
        self.fault_rate = fault_rate
        self.slow = slow
        self.serial = 0

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while await self.one_request(reader, writer):
                pass
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass  # the gateway went away (or was killed) mid-request
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    async def one_request(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Serve one request; False when the connection is to be closed."""
        head = await reader.readuntil(b"\r\n\r\n")
        request_line, *lines = head.decode("latin-1").split("\r\n")
        target = request_line.split(" ")[1] if " " in request_line else "/"
        headers: dict[str, str] = {}
        for line in lines:
            name, _, value = line.partition(":")
            if name:
                headers[name.strip().lower()] = value.strip()
        body = await read_body(reader, headers)
        route = target.lstrip("/").split("/", 1)[0].split("?", 1)[0]
        self.serial += 1
        fault = "answer"
        if route in self.routes and self.random.random() < self.fault_rate:
            fault = self.random.choice(FAULTS)
        record = Performed(
            serial=self.serial,
            attempt=headers.get(ATTEMPT_HEADER.lower()),
            route=route,
            tenant=headers.get("authorization", ""),
            key=headers.get("idempotency-key"),
            body=body.decode("utf-8", "replace"),
            received=time.time(),
            fault=fault,
            performed=fault not in ("429", "503"),
            status=None if fault == "reset" else status_of(fault, route in self.routes),
            answer=None,
        )
        if record.status is not None:
            receipt = {
                "mark": UPSTREAM_MARK,
                "serial": record.serial,
                "attempt": record.attempt,
                "route": record.route,
                "tenant": record.tenant,
                "key": record.key,
                "status": record.status,
            }
            record = dataclasses.replace(record, answer=json.dumps(receipt))
        await self.journal.append(json.dumps(dataclasses.asdict(record)).encode() + b"\n")
        if fault == "reset":
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            return False
        if fault == "slow":
            await asyncio.sleep(self.slow)
        assert record.status is not None and record.answer is not None
        payload = record.answer.encode()
        writer.write(
            f"HTTP/1.1 {record.status} {REASONS[record.status]}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n".encode()
            + payload
        )
        await writer.drain()
        return headers.get("connection", "").lower() != "close"


def status_of(fault: str, soak_route: bool) -> int:
    if not soak_route:
        return 200
    return {"answer": 201, "slow": 201, "error500": 500, "429": 429, "503": 503}[fault]


async def read_body(reader: asyncio.StreamReader, headers: dict[str, str]) -> bytes:
    if "chunked" in headers.get("transfer-encoding", "").lower():
        chunks = []
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0].strip() or b"0", 16)
            chunk = await reader.readexactly(size + 2)
            if size == 0:
                return b"".join(chunks)
            chunks.append(chunk[:-2])
    return await reader.readexactly(int(headers.get("content-length", "0") or 0))


async def main(arguments: argparse.Namespace) -> None:
    journal = Journal(Path(arguments.log))
    upstream = RecordingUpstream(
        journal, frozenset(arguments.routes.split(",")), arguments.seed, arguments.fault_rate,
        arguments.slow,
    )  # fmt: skip
    server = await asyncio.start_server(
        upstream.serve, "127.0.0.1", arguments.port, backlog=1024, limit=1 << 20
    )
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for number in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(number, stopping.set)
    async with server:
        await stopping.wait()
    await journal.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--log", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--routes", required=True, help="comma-separated soak route names")
    parser.add_argument("--fault-rate", type=float, default=0.1)
    parser.add_argument("--slow", type=float, default=1.5)
    asyncio.run(main(parser.parse_args()))
