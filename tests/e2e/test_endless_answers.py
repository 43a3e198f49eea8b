"""Answers that never end (server-sent events), whose clients hang up or stay, through real gateway
processes on real sockets with PostgreSQL: what the upstream is still asked for, what the store
holds, and that SIGTERM ends the gateway (contract sections 5 and 11; docs/operations.md,
"Large answers").

The upstream here writes an event every 0.1 s to every connection until a write fails, and counts
the connections it is still writing to: the gateway lets one go by closing it. Every wait is a
poll for a state with a generous deadline ("not for ever"), never a timing.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import asyncpg
import httpx
import pytest

from tests.e2e.conftest import DemoUpstream, GatewayProcess, prefix_route, problem_name, row
from tests.helpers import ThreadedUpstream

# How long a state the gateway should reach by itself may take on a loaded machine: far beyond
# what it needs (a second or two), far below "for ever".
DEADLINE = 30.0


class EndlessEvents(ThreadedUpstream):
    """Answers every request with server-sent events, one every `interval`, until a write fails
    (the gateway closed the connection). `open` counts the connections still written to;
    `performed` the requests per `Idempotency-Key`."""

    def __init__(self, interval: float = 0.1) -> None:
        self._interval = interval
        self.open = 0
        super().__init__(backlog=1024)

    def serve(self, connection: socket.socket, target: str, fields: dict[str, str]) -> None:
        self.count(fields)
        # `?status=CODE`: the events come under that status.
        status = target.partition("?status=")[2] or "200"
        with self._lock:
            self.open += 1
        try:
            connection.sendall(
                f"HTTP/1.1 {status} Events\r\nContent-Type: text/event-stream\r\n"
                "Transfer-Encoding: chunked\r\n\r\n".encode()
            )
            number = 0
            while True:
                event = f"id: {number}\ndata: tick\n\n".encode()
                connection.sendall(f"{len(event):x}\r\n".encode() + event + b"\r\n")
                number += 1
                time.sleep(self._interval)
        except OSError:
            pass  # the gateway let it go
        finally:
            with self._lock:
                self.open -= 1


@pytest.fixture(scope="module")
def endless() -> Iterator[EndlessEvents]:
    upstream = EndlessEvents()
    yield upstream
    upstream.close()


async def eventually(what: str, check: Callable[[], object]) -> None:
    """Poll `check` (sync or async) until it is true, for `DEADLINE` seconds at most."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + DEADLINE
    while loop.time() < deadline:
        result = check()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"not within {DEADLINE:g}s: {what}")


async def listen_and_hang_up(
    url: str, method: str, headers: dict[str, str], status: int = 200
) -> None:
    """Open the stream, read three events' worth, and close the connection."""
    async with (
        httpx.AsyncClient(timeout=10) as client,
        client.stream(method, url, headers=headers) as answer,
    ):
        assert answer.status_code == status
        assert answer.headers["content-type"] == "text/event-stream"
        seen = 0
        async for _ in answer.aiter_raw():
            seen += 1
            if seen >= 3:
                break


async def wait_exit(gateway: GatewayProcess) -> int | None:
    """The gateway's exit status, or None if it still runs after `DEADLINE`."""
    try:
        return await asyncio.to_thread(gateway.process.wait, DEADLINE)
    except subprocess.TimeoutExpired:
        return None


async def failure(db: asyncpg.Connection, key: str) -> dict[str, object]:
    text = await db.fetchval("SELECT failure::text FROM oncegate_keys WHERE key = $1", key)
    found: dict[str, object] = json.loads(text)
    return found


@pytest.mark.parametrize(
    ("method", "key"), [("GET", "passthrough"), ("POST", "unprotected")], ids=lambda x: x
)
async def test_a_stream_without_a_key_whose_client_hung_up_is_let_go_upstream(
    module_dir: Path,
    database_url: str,
    endless: EndlessEvents,
    db: asyncpg.Connection,
    method: str,
    key: str,
) -> None:
    """A GET (not under control: the shape docs recommend for streaming endpoints) or a POST
    without a key on a `key: optional` route: nothing is stored, so once the client hung up the
    gateway closes the upstream's connection; and SIGTERM then ends the gateway."""
    routes = [prefix_route("events", endless.url, timeout="1s", key="optional")]
    gateway = GatewayProcess(module_dir, database_url, routes, name=f"let-go-{key}")
    try:
        before = await db.fetchval("SELECT count(*) FROM oncegate_keys")
        await listen_and_hang_up(gateway.url + "/events/stream", method, {})
        await eventually("the upstream's connection closed", lambda: endless.open == 0)
        assert await db.fetchval("SELECT count(*) FROM oncegate_keys") == before
        gateway.process.signal(signal.SIGTERM)
        assert await wait_exit(gateway) == 0
    finally:
        gateway.stop()


async def test_a_keyed_endless_stream_whose_client_hung_up_settles_once_nothing_more_can_be_stored(
    module_dir: Path, database_url: str, endless: EndlessEvents, db: asyncpg.Connection
) -> None:
    """The gateway reads on for the store after the hang-up (a retry would get the answer),
    but only while the answer can still be stored: past `max_stored_response` it stops reading,
    the key completes with its status and headers (as any answer too large to store), the lease
    is no longer renewed, and a retry gets 409 response-not-stored, never a second request."""
    routes = [
        prefix_route("events", endless.url, timeout="1s", lease="3s", max_stored_response="1KiB")
    ]
    gateway = GatewayProcess(module_dir, database_url, routes, name="keyed-past-limit")
    key = str(uuid.uuid4())
    try:
        await listen_and_hang_up(gateway.url + "/events/stream", "POST", {"Idempotency-Key": key})

        async def completed() -> bool:
            found = await row(db, key)
            return found is not None and found["state"] == "completed"

        await eventually("the key completed", completed)
        await eventually("the upstream's connection closed", lambda: endless.open == 0)
        stored = await row(db, key)
        assert stored is not None
        assert (stored["effective_state"], stored["response_status"]) == ("completed", 200)
        assert stored["response_stored"] is False and stored["response_body"] is None
        assert ["Content-Type", "text/event-stream"] in json.loads(stored["response_headers"])
        async with httpx.AsyncClient(timeout=10) as client:
            retry = await client.post(
                gateway.url + "/events/stream", headers={"Idempotency-Key": key}
            )
        assert (retry.status_code, problem_name(retry)) == (409, "response-not-stored")
        assert "completed with status 200" in retry.json()["detail"]
        assert endless.performed[key] == 1
    finally:
        gateway.stop()


async def test_a_keyed_endless_stream_of_which_nothing_is_stored_is_settled_at_the_hang_up(
    module_dir: Path, database_url: str, endless: EndlessEvents, db: asyncpg.Connection
) -> None:
    """Nothing more of the answer could be stored from the start, so the hang-up stops the
    reading at once and the key settles as at the answer's end: on a `store: status_only` route
    completed with its status and headers (a retry replays them, with the empty body such a
    route replays); under a `release_statuses` status released (a retry is forwarded anew)."""
    routes = [
        prefix_route("quiet", endless.url, timeout="1s", lease="3s", store="status_only"),
        prefix_route("events", endless.url, timeout="1s", lease="3s"),
    ]
    gateway = GatewayProcess(module_dir, database_url, routes, name="keyed-nothing-stored")
    status_only, released = str(uuid.uuid4()), str(uuid.uuid4())
    try:
        await listen_and_hang_up(
            gateway.url + "/quiet/stream", "POST", {"Idempotency-Key": status_only}
        )
        await listen_and_hang_up(
            gateway.url + "/events/stream?status=503", "POST", {"Idempotency-Key": released}, 503
        )
        await eventually("the upstream's connections closed", lambda: endless.open == 0)

        async def settled() -> bool:
            kept, gone = await row(db, status_only), await row(db, released)
            return kept is not None and kept["state"] == "completed" and gone is None

        await eventually("both keys settled", settled)
        stored = await row(db, status_only)
        assert stored is not None and stored["response_status"] == 200
        assert ["Content-Type", "text/event-stream"] in json.loads(stored["response_headers"])
        async with httpx.AsyncClient(base_url=gateway.url, timeout=10) as client:
            replay = await client.post("/quiet/stream", headers={"Idempotency-Key": status_only})
            assert (replay.status_code, replay.content) == (200, b"")
            assert replay.headers["idempotent-replayed"] == "true"
            await listen_and_hang_up(
                gateway.url + "/events/stream?status=503", "POST",
                {"Idempotency-Key": released}, 503,
            )  # fmt: skip
        assert (endless.performed[status_only], endless.performed[released]) == (1, 2)
    finally:
        gateway.stop()


async def test_a_keyed_endless_stream_whose_client_hung_up_is_read_no_longer_than_its_key_lives(
    module_dir: Path, database_url: str, endless: EndlessEvents, db: asyncpg.Connection
) -> None:
    """An answer that could still be stored (far within `max_stored_response`) is read on after
    the hang-up, but not past the key's ttl: an answer stored later would be expired already.
    It is cut then, and the key, whose answer's body was lost, turns `unknown` (`answer_cut`)
    and expires: a retry is a new request."""
    routes = [prefix_route("events", endless.url, timeout="1s", lease="2s", ttl="4s")]
    gateway = GatewayProcess(module_dir, database_url, routes, name="keyed-ttl")
    key = str(uuid.uuid4())
    try:
        await listen_and_hang_up(gateway.url + "/events/stream", "POST", {"Idempotency-Key": key})

        async def cut() -> bool:
            found = await row(db, key)
            return found is not None and found["state"] == "unknown"

        await eventually("the key's answer cut", cut)
        await eventually("the upstream's connection closed", lambda: endless.open == 0)
        seen = await failure(db, key)
        assert (seen["kind"], seen["status"], seen["status_line_received"]) == (
            "answer_cut", 200, True,
        )  # fmt: skip
        assert "ttl" in str(seen["detail"]) and int(str(seen["bytes_received"])) > 0

        async def expired() -> bool:
            found = await row(db, key)
            return found is not None and found["effective_state"] == "expired"

        await eventually("the key expired", expired)
        assert endless.performed[key] == 1
    finally:
        gateway.stop()


async def test_sigterm_cuts_the_answers_still_relayed_and_the_gateway_exits(
    module_dir: Path, database_url: str, endless: EndlessEvents, db: asyncpg.Connection
) -> None:
    """Clients still listening to endless answers when SIGTERM comes: a grace period (the
    longest route timeout) later their answers are cut (each client sees a truncated stream,
    never a complete-looking one), every key settled as what is known of it, and the gateway
    exits. A keyed answer whose body could still be stored is lost: `unknown` (`answer_cut`),
    and a retry on another gateway is 409 outcome-unknown; one already past
    `max_stored_response` completes with its status and headers (409 response-not-stored)."""
    routes = [
        prefix_route("events", endless.url, timeout="1s", lease="3s"),
        prefix_route("tiny", endless.url, timeout="1s", lease="3s", max_stored_response="64B"),
    ]
    leaving = GatewayProcess(module_dir, database_url, routes, name="leaving")
    storable, too_large = str(uuid.uuid4()), str(uuid.uuid4())
    listening: dict[str, int] = {}

    async def listen(path: str, method: str, key: str | None) -> type[BaseException] | None:
        headers = {"Idempotency-Key": key} if key else {}
        async with httpx.AsyncClient(timeout=DEADLINE) as client:
            try:
                async with client.stream(method, leaving.url + path, headers=headers) as answer:
                    assert answer.status_code == 200
                    async for chunk in answer.aiter_raw():
                        listening[path] = listening.get(path, 0) + len(chunk)
            except httpx.HTTPError as exc:
                return type(exc)
        return None

    try:
        listeners = [
            asyncio.create_task(listen("/events/a", "GET", None)),
            asyncio.create_task(listen("/events/b", "POST", storable)),
            asyncio.create_task(listen("/tiny/c", "POST", too_large)),
        ]
        # Every answer under way, the tiny route's past its 64 bytes.
        await eventually(
            "three listeners reading",
            lambda: len(listening) == 3 and listening["/tiny/c"] > 64,
        )
        leaving.process.signal(signal.SIGTERM)
        assert await wait_exit(leaving) == 0, leaving.process.output()[-2000:]
        ended = await asyncio.gather(*listeners)
        # Each answer was cut short: the chunked body never ended.
        assert ended == [httpx.RemoteProtocolError] * 3, ended
    finally:
        leaving.stop()

    await eventually("the upstream's connections closed", lambda: endless.open == 0)
    cut = await row(db, storable)
    assert cut is not None and cut["state"] == "unknown"
    seen = await failure(db, storable)
    assert (seen["kind"], seen["status"]) == ("answer_cut", 200)
    assert "shutting down" in str(seen["detail"])
    whole = await row(db, too_large)
    assert whole is not None
    assert (whole["state"], whole["response_status"], whole["response_stored"]) == (
        "completed", 200, False,
    )  # fmt: skip

    other = GatewayProcess(module_dir, database_url, routes, name="other")
    try:
        async with httpx.AsyncClient(base_url=other.url, timeout=10) as client:
            lost = await client.post("/events/b", headers={"Idempotency-Key": storable})
            large = await client.post("/tiny/c", headers={"Idempotency-Key": too_large})
        assert (lost.status_code, problem_name(lost)) == (409, "outcome-unknown")
        assert (large.status_code, problem_name(large)) == (409, "response-not-stored")
    finally:
        other.stop()
    assert (endless.performed[storable], endless.performed[too_large]) == (1, 1)


async def test_hung_up_listeners_leave_the_upstream_connections_to_other_routes(
    module_dir: Path, database_url: str, upstream: DemoUpstream
) -> None:
    """512 clients (the upstream client's whole pool) open a server-sent-events stream (GET,
    passthrough) and hang up as soon as its head came; then a keyed POST on another route, to
    another upstream, is served as usual, and the stream's upstream has no connection left."""
    events = EndlessEvents(interval=1.0)
    routes = [
        prefix_route("events", events.url, timeout="2s"),
        prefix_route("emails", upstream.url, timeout="2s"),
    ]
    gateway = GatewayProcess(module_dir, database_url, routes, name="pool")
    try:

        async def hang_up() -> None:
            reader, writer = await asyncio.open_connection("127.0.0.1", gateway.port)
            writer.write(b"GET /events/stream HTTP/1.1\r\nHost: gateway\r\n\r\n")
            await writer.drain()
            await reader.readuntil(b"\r\n\r\n")  # the head: the stream is open upstream
            writer.close()
            await writer.wait_closed()

        for _ in range(8):
            await asyncio.gather(*(hang_up() for _ in range(64)))
        await eventually("the upstream's connections closed", lambda: events.open == 0)
        key = str(uuid.uuid4())
        async with httpx.AsyncClient(timeout=30) as client:
            answer = await client.post(
                gateway.url + "/emails/emails", json={"to": "a@example.com"},
                headers={"Idempotency-Key": key},
            )  # fmt: skip
        assert answer.status_code == 201, answer.text
        assert len(upstream.actions(key)) == 1
    finally:
        gateway.stop()
        events.close()


async def test_one_upstreams_listeners_leave_connections_to_the_other_upstreams(
    module_dir: Path, database_url: str, upstream: DemoUpstream
) -> None:
    """512 clients stay connected to a server-sent-events stream (GET, passthrough): its
    upstream holds the most connections one upstream may (512), and a 513th request to it waits
    for one, then gets 502 upstream-unavailable (nothing sent); a keyed POST on another route,
    to another upstream, is served as usual from the connections left."""
    events = EndlessEvents(interval=1.0)
    routes = [
        prefix_route("events", events.url, timeout="2s"),
        prefix_route("emails", upstream.url, timeout="2s"),
    ]
    gateway = GatewayProcess(module_dir, database_url, routes, name="per-host")
    listeners: list[asyncio.StreamWriter] = []
    try:

        async def listen() -> None:
            reader, writer = await asyncio.open_connection("127.0.0.1", gateway.port)
            listeners.append(writer)
            writer.write(b"GET /events/stream HTTP/1.1\r\nHost: gateway\r\n\r\n")
            await writer.drain()
            await reader.readuntil(b"\r\n\r\n")  # the head: the stream is open upstream

        for _ in range(8):
            await asyncio.gather(*(listen() for _ in range(64)))
        await eventually("512 upstream connections", lambda: events.open == 512)
        key = str(uuid.uuid4())
        async with httpx.AsyncClient(timeout=30) as client:
            another = await client.get(gateway.url + "/events/stream")
            answer = await client.post(
                gateway.url + "/emails/emails", json={"to": "a@example.com"},
                headers={"Idempotency-Key": key},
            )  # fmt: skip
        assert (another.status_code, problem_name(another)) == (502, "upstream-unavailable")
        assert answer.status_code == 201, answer.text
        assert len(upstream.actions(key)) == 1
        assert events.open == 512
    finally:
        for writer in listeners:
            writer.close()
        gateway.stop()
        events.close()
