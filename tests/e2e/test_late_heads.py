"""A relayed answer whose head came late keeps its key in flight: the claim's lease has run
since the claim, so its first renewal must not wait a third of the lease after the head. Real
gateway, PostgreSQL and sockets; the route is one `settings.Route` accepts (its lease, 2.5 s,
exceeds its timeout, 2 s), the head comes after 1.9 s, inside the timeout."""

from __future__ import annotations

import asyncio
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import httpx
import pytest

from tests.e2e.conftest import GatewayProcess, prefix_route, problem_name, row
from tests.helpers import ThreadedUpstream

HEAD_DELAY = 1.9
CHUNKS, CHUNK_PAUSE = 10, 0.3


class SlowHead(ThreadedUpstream):
    """Counts the requests per Idempotency-Key; answers after HEAD_DELAY with a chunked body of
    CHUNKS x 16 KiB, a chunk every CHUNK_PAUSE seconds."""

    def serve(self, connection: socket.socket, target: str, fields: dict[str, str]) -> None:
        self.count(fields)
        time.sleep(HEAD_DELAY)
        try:
            connection.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n"
                               b"Content-Type: application/octet-stream\r\n\r\n")  # fmt: skip
            for _ in range(CHUNKS):
                piece = b"x" * 16384
                connection.sendall(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
                time.sleep(CHUNK_PAUSE)
            connection.sendall(b"0\r\n\r\n")
        except OSError:
            pass


@pytest.fixture(scope="module")
def slow() -> Iterator[SlowHead]:
    upstream = SlowHead()
    yield upstream
    upstream.close()


@pytest.fixture(scope="module")
def gateway(module_dir: Path, database_url: str, slow: SlowHead) -> Iterator[GatewayProcess]:
    routes = [
        prefix_route("forward", slow.url, timeout="2s", lease="2.5s", on_unknown="forward"),
        prefix_route("reject", slow.url, timeout="2s", lease="2.5s"),
    ]
    with GatewayProcess(module_dir, database_url, routes) as process:
        yield process


@pytest.mark.parametrize("route", ["forward", "reject"])
async def test_a_retry_while_a_late_headed_answer_streams_is_told_it_is_in_progress(
    gateway: GatewayProcess, slow: SlowHead, db: asyncpg.Connection, route: str
) -> None:
    key = str(uuid.uuid4())
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as client:

        async def first() -> int:
            size = 0
            async with client.stream("POST", f"/{route}/x", headers={"Idempotency-Key": key}) as a:
                async for piece in a.aiter_raw():
                    size += len(piece)
            return size

        streaming = asyncio.create_task(first())
        # Past the claim's first lease (2.5 s); the answer streams until about 4.9 s.
        await asyncio.sleep(3.2)
        assert not streaming.done()
        retry = await client.post(f"/{route}/x", headers={"Idempotency-Key": key})
        received = await streaming
    assert (retry.status_code, problem_name(retry)) == (409, "request-in-progress")
    assert received == CHUNKS * 16384
    assert slow.performed[key] == 1
    # The first request's answer settles its key: completed, as it would had its head come
    # at once.
    for _ in range(200):
        stored = await row(db, key)
        if stored is not None and stored["state"] != "in_progress":
            break
        await asyncio.sleep(0.05)
    assert stored is not None and stored["state"] == "completed"
