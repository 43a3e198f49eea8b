"""Answers of any size (contract section 11, "large answers"), through a real gateway on real
sockets: relayed as the upstream sends them, stored up to the route's `max_stored_response`,
the gateway's memory flat, a client's hang-up changing nothing of what is stored.

The upstream here writes raw HTTP from a thread, and notes when it wrote the last byte of each
answer, so a test compares the order of events (the client's first byte before the upstream's
last), never a wall time.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import asyncpg
import httpx
import pytest

from tests.e2e.conftest import GatewayProcess, prefix_route, problem_name
from tests.helpers import ThreadedUpstream, total

MIB = 1024 * 1024


def pattern(size: int) -> bytes:
    """`size` bytes that are not all alike, so a body cut or reordered is caught."""
    block = hashlib.sha256(b"oncegate").digest() * (MIB // 32)
    return (block * (size // len(block) + 1))[:size]


class PacedUpstream(ThreadedUpstream):
    """`/paced?size=N&chunk=C&pause=S`: 200 with N bytes, C at a time with a pause between;
    `&length=0` sends it chunked without a Content-Length, `&cut=K` closes after K bytes;
    `/events?count=N`: N server-sent events, a pause between."""

    def __init__(self) -> None:
        self.finished: dict[str, float] = {}  # key -> when its last byte was written
        super().__init__()

    def serve(self, connection: socket.socket, target: str, fields: dict[str, str]) -> None:
        key = self.count(fields)
        url = urlsplit(target)
        query = {name: values[0] for name, values in parse_qs(url.query).items()}
        try:
            if url.path == "/events":
                self._events(connection, int(query["count"]))
            else:
                self._paced(connection, query)
        except OSError:
            pass  # the gateway went away
        with self._lock:
            self.finished[key] = time.monotonic()

    def _paced(self, connection: socket.socket, query: dict[str, str]) -> None:
        size, chunk = int(query["size"]), int(query.get("chunk", MIB))
        pause, cut = float(query.get("pause", "0")), int(query.get("cut", size))
        body = pattern(size)
        framing = f"Content-Length: {size}\r\n" if query.get("length", "1") == "1" else ""
        chunked = not framing
        if chunked:
            framing = "Transfer-Encoding: chunked\r\n"
        connection.sendall(
            f"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\n{framing}"
            f"X-Receipt: r-{size}\r\nConnection: close\r\n\r\n".encode()
        )
        for start in range(0, min(size, cut), chunk):
            piece = body[start : min(start + chunk, cut)]
            if chunked:
                piece = f"{len(piece):x}\r\n".encode() + piece + b"\r\n"
            connection.sendall(piece)
            time.sleep(pause)
        if cut < size:
            return  # closed short of its Content-Length
        if chunked:
            connection.sendall(b"0\r\n\r\n")

    def _events(self, connection: socket.socket, count: int) -> None:
        connection.sendall(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
        )
        for number in range(count):
            event = f"id: {number}\ndata: event {number}\n\n".encode()
            connection.sendall(f"{len(event):x}\r\n".encode() + event + b"\r\n")
            time.sleep(0.2)
        connection.sendall(b"0\r\n\r\n")

    async def finished_at(self, key: str) -> float:
        """When the upstream wrote the last byte of `key`'s answer."""
        for _ in range(200):
            with self._lock:
                if key in self.finished:
                    return self.finished[key]
            await asyncio.sleep(0.05)
        raise AssertionError(f"the upstream never finished {key}")


@pytest.fixture(scope="module")
def paced() -> Iterator[PacedUpstream]:
    upstream = PacedUpstream()
    try:
        yield upstream
    finally:
        upstream.close()


@pytest.fixture(scope="module")
def gateway(module_dir: Path, database_url: str, paced: PacedUpstream) -> Iterator[GatewayProcess]:
    routes = [
        prefix_route("small", paced.url, timeout="30s", max_stored_response="1MiB"),
        prefix_route("large", paced.url, timeout="30s", max_stored_response="8MiB"),
        # A lease far shorter than the answers relayed on it, and a retry of an `unknown` key
        # forwarded again: what a lease that ran out mid-answer would cost is a second request.
        prefix_route("long", paced.url, timeout="2s", lease="3s", on_unknown="forward"),
        # A client that takes nothing of an answer is let go after the route's timeout.
        prefix_route("patient", paced.url, timeout="2s"),
        prefix_route("quiet", paced.url, store="status_only", max_stored_response="1KiB"),
    ]
    with GatewayProcess(module_dir, database_url, routes) as process:
        yield process


@pytest.fixture
async def client(gateway: GatewayProcess) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as session:
        yield session


def rss(pid: int) -> int:
    """Resident memory of a process, in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


async def row(database_url: str, key: str) -> asyncpg.Record:
    connection = await asyncpg.connect(database_url)
    try:
        found: asyncpg.Record = await connection.fetchrow(
            "SELECT state, response_status, response_stored, response_body, request,"
            " response_headers, sealed_with, sealed_headers FROM oncegate_keys WHERE key = $1",
            key,
        )
        return found
    finally:
        await connection.close()


async def settled(database_url: str, key: str) -> asyncpg.Record:
    for _ in range(400):
        found = await row(database_url, key)
        if found is not None and found["state"] != "in_progress":
            return found
        await asyncio.sleep(0.05)
    raise AssertionError(f"key {key} did not settle")


async def test_a_50_mib_answer_streams_with_memory_flat_and_only_its_status_and_headers_are_stored(
    client: httpx.AsyncClient,
    gateway: GatewayProcess,
    paced: PacedUpstream,
    database_url: str,
) -> None:
    key = str(uuid.uuid4())
    size = 50 * MIB
    pid = gateway.process.popen.pid
    before = rss(pid)
    peak, received, first_byte = before, 0, None
    digest = hashlib.sha256()
    target = f"/small/paced?size={size}&chunk={MIB}&pause=0.05&length=0"
    async with client.stream("POST", target, headers={"Idempotency-Key": key}) as answer:
        assert answer.status_code == 200
        async for chunk in answer.aiter_raw():
            if first_byte is None:
                first_byte = time.monotonic()
            received += len(chunk)
            digest.update(chunk)
            peak = max(peak, rss(pid))
    assert received == size and digest.digest() == hashlib.sha256(pattern(size)).digest()
    assert first_byte is not None and first_byte < await paced.finished_at(
        key
    )  # not after the last
    # The gateway's memory did not grow with the answer: far less than its size.
    assert peak - before < 24 * MIB, (before, peak)

    stored = await settled(database_url, key)
    assert (stored["state"], stored["response_status"], stored["response_stored"]) == (
        "completed",
        200,
        False,
    )
    assert stored["response_body"] is None and stored["request"] is None
    assert ["X-Receipt", f"r-{size}"] in json.loads(stored["response_headers"])
    retry = await client.post(target, headers={"Idempotency-Key": key})
    assert (retry.status_code, problem_name(retry)) == (409, "response-not-stored")
    assert paced.performed[key] == 1


async def test_a_client_that_hangs_up_mid_stream_changes_nothing_stored(
    client: httpx.AsyncClient, paced: PacedUpstream, database_url: str
) -> None:
    key = str(uuid.uuid4())
    size = 4 * MIB
    target = f"/large/paced?size={size}&chunk={256 * 1024}&pause=0.05"
    async with client.stream("POST", target, headers={"Idempotency-Key": key}) as answer:
        assert answer.status_code == 200
        async for _ in answer.aiter_raw():
            break  # and hang up
    stored = await settled(database_url, key)
    assert (stored["state"], stored["response_stored"]) == ("completed", True)
    assert bytes(stored["response_body"]) == pattern(size)
    replay = await client.post(target, headers={"Idempotency-Key": key})
    assert replay.headers["idempotent-replayed"] == "true"
    assert replay.content == pattern(size)  # a multi-MiB replay, whole
    assert paced.performed[key] == 1


async def test_an_answer_that_breaks_off_is_cut_short_for_the_client_and_the_key_unknown(
    client: httpx.AsyncClient, paced: PacedUpstream, database_url: str
) -> None:
    key = str(uuid.uuid4())
    target = f"/large/paced?size={5 * MIB}&cut={MIB}&chunk={256 * 1024}"
    with pytest.raises(httpx.HTTPError):
        async with client.stream("POST", target, headers={"Idempotency-Key": key}) as answer:
            async for _ in answer.aiter_raw():
                pass
    stored = await settled(database_url, key)
    assert stored["state"] == "unknown"
    connection = await asyncpg.connect(database_url)
    try:
        failure = await connection.fetchval(
            "SELECT failure::text FROM oncegate_keys WHERE key = $1", key
        )
    finally:
        await connection.close()
    assert '"kind": "answer_broken"' in failure and '"status": 200' in failure
    retry = await client.post(target, headers={"Idempotency-Key": key})
    assert (retry.status_code, problem_name(retry)) == (409, "outcome-unknown")


async def test_an_answer_that_breaks_off_is_counted_unknown_not_forwarded(
    client: httpx.AsyncClient, gateway: GatewayProcess, database_url: str
) -> None:
    key = str(uuid.uuid4())
    target = f"/large/paced?size={5 * MIB}&cut={MIB}&chunk={256 * 1024}"
    metrics = f"{gateway.admin_url}/metrics"
    async with httpx.AsyncClient() as admin:
        before = (await admin.get(metrics)).text
        with pytest.raises(httpx.HTTPError):
            async with client.stream("POST", target, headers={"Idempotency-Key": key}) as answer:
                async for _ in answer.aiter_raw():
                    pass
        assert (await settled(database_url, key))["state"] == "unknown"
        after = before
        for _ in range(100):  # the request is counted when its answer ends
            after = (await admin.get(metrics)).text
            if total(after, "oncegate_requests_total", route="large") > total(
                before, "oncegate_requests_total", route="large"
            ):
                break
            await asyncio.sleep(0.05)

    def counted(outcome: str) -> float:
        labels = {"route": "large", "outcome": outcome}
        return total(after, "oncegate_requests_total", **labels) - total(
            before, "oncegate_requests_total", **labels
        )

    assert (counted("unknown"), counted("forwarded")) == (1, 0)


async def test_an_answer_relayed_for_longer_than_the_lease_keeps_its_key_in_flight(
    client: httpx.AsyncClient, paced: PacedUpstream, database_url: str
) -> None:
    """The gateway renews the lease of a key whose answer it is still relaying: a retry in the
    middle is told the request is in progress (not `outcome-unknown`, and on this
    `on_unknown: forward` route not sent upstream again), and the answer is stored whole."""
    key = str(uuid.uuid4())
    chunk, count = 64 * 1024, 14
    target = f"/long/paced?size={chunk * count}&chunk={chunk}&pause=0.5"
    received, retried = b"", None
    async with client.stream("POST", target, headers={"Idempotency-Key": key}) as answer:
        assert answer.status_code == 200
        async for piece in answer.aiter_raw():
            received += piece
            if retried is None and len(received) > 8 * chunk:
                # At least 8 pauses of 0.5 s since the claim: past the 3 s lease it was given.
                retried = await client.post(target, headers={"Idempotency-Key": key})
    assert retried is not None
    assert (retried.status_code, problem_name(retried)) == (409, "request-in-progress")
    assert received == pattern(chunk * count)
    stored = await settled(database_url, key)
    assert (stored["state"], stored["response_stored"]) == ("completed", True)
    replay = await client.post(target, headers={"Idempotency-Key": key})
    assert replay.headers["idempotent-replayed"] == "true" and replay.content == received
    assert paced.performed[key] == 1


async def test_server_sent_events_are_relayed_as_they_come_and_replayed_whole(
    client: httpx.AsyncClient, paced: PacedUpstream
) -> None:
    key = str(uuid.uuid4())
    first_event = None
    async with client.stream(
        "POST", "/large/events?count=5", headers={"Idempotency-Key": key}
    ) as answer:
        assert answer.headers["content-type"] == "text/event-stream"
        text = b""
        async for chunk in answer.aiter_raw():
            if first_event is None:
                first_event = time.monotonic()
            text += chunk
    assert first_event is not None and first_event < await paced.finished_at(key)
    replay = await client.post("/large/events?count=5", headers={"Idempotency-Key": key})
    assert replay.headers["idempotent-replayed"] == "true"
    assert replay.content == text and text.count(b"data: event") == 5


# A gateway whose operator reads what it stored: the admin API on, answers in plaintext or sealed.
ADMIN_TOKEN = "large-answers-admin-token"
SEALING = f"k1:{base64.b64encode(os.urandom(32)).decode()}"


@pytest.fixture(scope="module", params=["plaintext", "sealed"])
def operated(
    request: pytest.FixtureRequest, module_dir: Path, database_url: str, paced: PacedUpstream
) -> Iterator[tuple[GatewayProcess, bool]]:
    """The gateway, and whether it seals what it stores."""
    sealed = request.param == "sealed"
    routes = [prefix_route("tiny", paced.url, timeout="30s", max_stored_response="1KiB")]
    with GatewayProcess(
        module_dir, database_url, routes, name=f"operated-{request.param}",
        admin_token=ADMIN_TOKEN, env={"ONCEGATE_ENCRYPTION_KEYS": SEALING} if sealed else {},
    ) as process:  # fmt: skip
        yield process, sealed


@pytest.mark.parametrize("framing", ["read whole", "streamed"])
async def test_an_answer_too_large_to_store_keeps_its_headers_for_the_operator(
    operated: tuple[GatewayProcess, bool], paced: PacedUpstream, database_url: str, framing: str
) -> None:
    gateway, sealed = operated
    # 4 KiB past a max_stored_response of 1 KiB: announced with its length (read whole, under
    # 64 KiB) or chunked without one (relayed as it comes).
    key, size = str(uuid.uuid4()), 4096
    length = "1" if framing == "read whole" else "0"
    target = f"/tiny/paced?size={size}&chunk=1024&length={length}"
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as client:
        first = await client.post(target, headers={"Idempotency-Key": key})
        assert (first.status_code, first.content) == (200, pattern(size))
        assert first.headers["x-receipt"] == f"r-{size}"
        retry = await client.post(target, headers={"Idempotency-Key": key})
    # The client: the whole answer once; a retry 409 naming the status, never performed again.
    assert (retry.status_code, problem_name(retry)) == (409, "response-not-stored")
    assert "completed with status 200" in retry.json()["detail"]
    assert paced.performed[key] == 1

    # The store: the status and the headers (sealed when a key is set), no body.
    stored = await settled(database_url, key)
    assert (stored["state"], stored["response_status"], stored["response_stored"]) == (
        "completed", 200, False,
    )  # fmt: skip
    assert stored["response_body"] is None
    if sealed:
        assert stored["sealed_with"] == "k1:2" and stored["response_headers"] is None
        assert b"r-4096" not in stored["sealed_headers"]
    else:
        assert stored["sealed_with"] is None and stored["sealed_headers"] is None
        assert ["X-Receipt", f"r-{size}"] in json.loads(stored["response_headers"])

    # The operator: the headers opened, no body, and why (admin API and `oncegate keys show`).
    async with gateway.admin_client() as admin:
        found = await admin.get("/admin/keys", params={"key": key, "body": "1"})
    assert found.status_code == 200, found.text
    (record,) = found.json()["records"]
    assert (record["state"], record["status"], record["body_stored"]) == ("completed", 200, False)
    assert ["X-Receipt", f"r-{size}"] in record["headers"]
    assert record["body"] is None and record["body_base64"] is None
    shown = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "oncegate.cli", "keys", "show", "--key", key],
        capture_output=True, text=True, timeout=60,
        env={**os.environ, "ONCEGATE_ADMIN_TOKEN": ADMIN_TOKEN,
             "ONCEGATE_ADMIN_URL": gateway.admin_url},
    )  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout) == found.json()


# What the gateway logs when it lets a client that reads nothing go.
LET_GO = "the client took nothing of the answer for 2s"


def _stalled_replay(port: int, target: str, key: str) -> socket.socket:
    """A client that asks for the replay and reads nothing (a 4 KiB receive window)."""
    connection = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    connection.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    connection.connect(("127.0.0.1", port))
    connection.sendall(
        f"POST {target} HTTP/1.1\r\nHost: gateway\r\nIdempotency-Key: {key}\r\n"
        "Content-Length: 0\r\n\r\n".encode()
    )
    return connection


async def test_replays_nobody_reads_are_let_go_after_the_route_timeout(
    client: httpx.AsyncClient, gateway: GatewayProcess, paced: PacedUpstream
) -> None:
    # A stored answer is replayed from one copy read from PostgreSQL: a client that reads
    # nothing would hold that copy for as long as it kept the connection.
    key, size, stalled = str(uuid.uuid4()), 6 * MIB, 8
    target = f"/patient/paced?size={size}&chunk=65536&pause=0"
    first = await client.post(target, headers={"Idempotency-Key": key})
    assert first.status_code == 200 and len(first.content) == size
    said = gateway.process.output().count(LET_GO)
    held = []
    for _ in range(stalled):  # one after another: each replay's claim its own, with its copy
        held.append(_stalled_replay(gateway.port, target, key))
        await asyncio.sleep(0.2)
    try:
        # Each is let go once a slice has waited the route's timeout (2 s) for its client.
        for _ in range(600):
            if gateway.process.output().count(LET_GO) - said == stalled:
                break
            await asyncio.sleep(0.05)
        assert gateway.process.output().count(LET_GO) - said == stalled
        # With it, the answer's copy (not asserted on the gateway's RSS, which glibc's malloc
        # need not give back to the system at once). And its connection was closed: what was
        # written before is there, then the end, short of the whole answer.
        for connection in held:
            connection.settimeout(30)
            received = 0
            while chunk := connection.recv(65536):
                received += len(chunk)
            assert 0 < received < size
    finally:
        for connection in held:
            connection.close()
    assert paced.performed[key] == 1


@pytest.mark.parametrize("length", ["", "&length=0"], ids=["read-whole", "relayed"])
async def test_a_status_only_route_replays_the_status_whatever_the_answer_s_size(
    client: httpx.AsyncClient, paced: PacedUpstream, database_url: str, length: str
) -> None:
    # The route keeps no body, so the size of one it never stores cannot turn its replay into
    # 409 response-not-stored: 4 KiB against a max_stored_response of 1 KiB, read whole (a
    # Content-Length) and relayed as it came (chunked).
    key = str(uuid.uuid4())
    target = f"/quiet/paced?size=4096&chunk=1024&pause=0{length}"
    first = await client.post(target, headers={"Idempotency-Key": key})
    assert first.status_code == 200 and len(first.content) == 4096
    stored = await settled(database_url, key)
    assert (stored["state"], stored["response_stored"]) == ("completed", True)
    replay = await client.post(target, headers={"Idempotency-Key": key})
    assert (replay.status_code, replay.content) == (200, b"")
    assert replay.headers["idempotent-replayed"] == "true"
    assert paced.performed[key] == 1
