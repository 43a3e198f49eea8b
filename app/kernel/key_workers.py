"""The key of a large JSON body (a route's `key_from_body`), read in worker processes.

Why processes (contract section 11, "key from a large body"): parsing JSON holds the interpreter
lock for the whole document (json.loads: about 85 ms per MiB), so a worker thread stalls the
event loop as much as the loop itself would: three 8.6 MiB bodies held every other request up to
2 s. A worker process parses with its own interpreter; the gateway only writes the body into a
pipe, a chunk at a time from the event loop. Measured side by side (bench/key_from_body.py and
docs/performance.md): other requests wait about as long as beside a header-key route under the
same load.

Design rules:
- The workers run `keys.from_body` itself, so a key read in a worker is the key read inline:
  the same JSON, the same pointer rules, the same messages.
- A worker is started on first need and kept; at most `WORKERS` run, so a flood of large bodies
  queues for a worker instead of forking without end.
- Workers run at a lower priority (`NICENESS`): when the machine is busy, the CPU goes to the
  requests in flight first and the large body waits, not the other way round.
- A worker that dies, or whose request was cancelled half-way through the exchange, is ended
  and never reused: the next request gets a fresh one. A body whose worker died twice is
  refused with a 500 (`errors.GatewayError`), before anything is claimed.
- Start: `python -m oncegate.kernel.key_workers`, which imports `oncegate.kernel.keys` and
  nothing of the gateway (0.02 s, 15 MiB, against 1.7 s and 67 MiB for the service).

The exchange, over the worker's stdin and stdout: 16 bytes (two big-endian 8-byte lengths), the
pointer and its spelling as JSON, the body; then one JSON line back: `{"key": "..."}`,
`{"key": null}` (nothing there, or not JSON) or `{"invalid": "detail"}` (`errors.InvalidKey`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import struct
import sys
from collections.abc import Sequence
from typing import Protocol

from ..model import errors
from . import keys

# Parsing is CPU-bound: more workers than cores would only share them. Four at most, so a
# gateway on a large machine keeps most of it for requests.
WORKERS = max(1, min(4, os.cpu_count() or 1))
# Added to the workers' nice value: the kernel then gives a worker about a tenth of the CPU a
# request's process gets when both want it (CFS weights 110 against 1024), and all of what is
# spare.
NICENESS = 10
# How long a closing worker may take to exit after its stdin is closed.
EXIT_TIMEOUT = 5.0
_HEAD = struct.Struct(">QQ")


class WorkerLost(Exception):
    """A worker ended (or broke its exchange) before it answered."""


class KeyWorkers:
    """Worker processes that read keys from large JSON bodies. Owned by whoever closes it."""

    def __init__(self, size: int = WORKERS) -> None:
        self._slots = asyncio.Semaphore(size)
        self._idle: list[_Worker] = []
        self._closed = False

    async def from_body(self, body: bytes, pointer: Sequence[str], shown: str) -> str | None:
        """`keys.from_body(body, pointer, shown)`, computed in a worker process."""
        async with self._slots:
            try:
                answer = await self._ask(body, pointer, shown)
            except WorkerLost:
                try:
                    answer = await self._ask(body, pointer, shown)  # a fresh worker, once
                except WorkerLost as exc:
                    raise errors.GatewayError(
                        f"the worker process reading the key at {shown} from this body ended "
                        "twice before it answered; nothing was claimed or forwarded"
                    ) from exc
        if "invalid" in answer:
            raise errors.InvalidKey(str(answer["invalid"]))
        key = answer["key"]
        return None if key is None else str(key)

    async def _ask(self, body: bytes, pointer: Sequence[str], shown: str) -> dict[str, object]:
        if self._closed:
            raise errors.GatewayError("the gateway is shutting down")
        worker = self._idle.pop() if self._idle else await _Worker.start()
        try:
            answer = await worker.ask(body, pointer, shown)
        except BaseException:  # lost, or cancelled half-way: its pipe is in an unknown state
            await worker.kill()
            raise
        self._idle.append(worker)
        return answer

    async def close(self) -> None:
        """End every idle worker (one busy now is ended by its request, which finds us closed
        next time) and start no more."""
        self._closed = True
        idle, self._idle = self._idle, []
        await asyncio.gather(*(worker.end() for worker in idle))


class _Worker:
    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self._process = process

    @classmethod
    async def start(cls) -> _Worker:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", __name__,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        return cls(process)

    async def ask(self, body: bytes, pointer: Sequence[str], shown: str) -> dict[str, object]:
        stdin, stdout = self._process.stdin, self._process.stdout
        assert stdin is not None and stdout is not None  # both are pipes (start)
        about = json.dumps([list(pointer), shown]).encode()
        try:
            stdin.write(_HEAD.pack(len(about), len(body)) + about)
            stdin.write(body)
            await stdin.drain()
            line = await stdout.readline()
        except (ConnectionError, OSError) as exc:
            raise WorkerLost from exc
        if not line.endswith(b"\n"):
            raise WorkerLost
        answer: dict[str, object] = json.loads(line)
        return answer

    async def kill(self) -> None:
        """End it now: it may be parsing a body nobody waits for any more."""
        with contextlib.suppress(ProcessLookupError):
            self._process.kill()
        await self._process.wait()

    async def end(self) -> None:
        """Let it finish and exit: its stdin closes, which ends its loop."""
        process = self._process
        if process.stdin is not None:
            process.stdin.close()
        try:
            await asyncio.wait_for(process.wait(), EXIT_TIMEOUT)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()


class _Reader(Protocol):  # the two ends of the worker's pipes, as `serve` uses them
    def read(self, size: int, /) -> bytes: ...


class _Writer(Protocol):
    def write(self, data: bytes, /) -> object: ...

    def flush(self) -> None: ...


def serve(source: _Reader, sink: _Writer) -> None:
    """A worker's life: answer each body read from `source` until it ends."""
    while len(head := source.read(_HEAD.size)) == _HEAD.size:
        about_length, body_length = _HEAD.unpack(head)
        pointer, shown = json.loads(source.read(about_length))
        body = source.read(body_length)
        try:
            answer: dict[str, object] = {"key": keys.from_body(body, tuple(pointer), shown)}
        except errors.InvalidKey as error:
            answer = {"invalid": error.detail}
        sink.write(json.dumps(answer).encode() + b"\n")
        sink.flush()


if __name__ == "__main__":
    os.nice(NICENESS)
    serve(sys.stdin.buffer, sys.stdout.buffer)
