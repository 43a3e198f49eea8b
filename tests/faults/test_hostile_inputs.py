"""Hostile and odd inputs: what reaches the upstream and the store is what the client sent.

Each test sends what an attacker or an unlucky client would (raw bytes where no well-behaved
client would produce them) to a real gateway in front of the demo upstream, and checks what the
client got, what the upstream performed or received (its `/echo` answers with what arrived), and
what the store holds. docs/security.md says what each defends against.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import httpx
import pytest

from tests.e2e.conftest import PROBLEM, parse_head
from tests.faults.conftest import DemoUpstream, Gateway, new_key, problem_name, row


@pytest.fixture(scope="module")
def gateway(module_dir: Path, database_url: str, upstream: DemoUpstream) -> Iterator[Gateway]:
    routes = [
        {"name": "emails", "match": "/emails", "upstream": upstream.url},
        {"name": "echo", "match": "/echo", "upstream": upstream.url},
        {"name": "based", "match": "/based", "upstream": upstream.url + "/echo/api",
         "strip_prefix": True},
        {"name": "default", "match": "/", "upstream": upstream.url, "key": "optional"},
    ]  # fmt: skip
    process = Gateway(module_dir, database_url, routes)
    try:
        yield process
    finally:
        process.stop()


def exchange(port: int, data: bytes, answers: int) -> list[tuple[int, dict[str, str], bytes]]:
    """Send `data` on one connection and read `answers` answers (framed by Content-Length)."""
    received = b""
    results = []
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(data)
        while len(results) < answers:
            while b"\r\n\r\n" not in received:
                chunk = sock.recv(65536)
                assert chunk, f"the connection closed after {len(results)} answers"
                received += chunk
            head, _, received = received.partition(b"\r\n\r\n")
            status_line, headers = parse_head(head)
            length = int(headers.get("content-length", "0"))
            while len(received) < length:
                chunk = sock.recv(65536)
                assert chunk, "the connection closed mid-answer"
                received += chunk
            body, received = received[:length], received[length:]
            results.append((int(status_line.split()[1]), headers, body))
    return results


def post(path: str, body: bytes, *headers: str) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: gateway", "Content-Type: application/json",
             f"Content-Length: {len(body)}", *headers]  # fmt: skip
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


H2C_OFFER = ("Connection: Upgrade, HTTP2-Settings", "Upgrade: h2c",
             "HTTP2-Settings: AAMAAABkAAQCAAAAAAIAAAAA")  # fmt: skip


async def test_an_h2c_upgrade_offer_is_ignored_and_the_body_kept(
    gateway: Gateway, upstream: DemoUpstream, db: asyncpg.Connection
) -> None:
    key = new_key()
    body = b'{"to": "ana@example.com", "n": 1}'
    pipelined = b"GET /echo/after HTTP/1.1\r\nHost: gateway\r\n\r\n"
    first, after = exchange(
        gateway.port, post("/emails", body, f"Idempotency-Key: {key}", *H2C_OFFER) + pipelined, 2
    )
    assert first[0] == 201, first
    [action] = upstream.actions(key)
    assert action["request"] == json.loads(body)  # the body reached the upstream whole
    assert after[0] == 200 and json.loads(after[2])["path"] == "/echo/after"
    # The same request without the offer is the same request: replayed, not 422.
    [replay] = exchange(gateway.port, post("/emails", body, f"Idempotency-Key: {key}"), 1)
    assert replay[0] == 201 and replay[1]["idempotent-replayed"] == "true"
    assert replay[2] == first[2]
    assert (await row(db, key))["state"] == "completed"
    assert len(upstream.actions(key)) == 1


async def test_an_upgrade_offer_reaches_the_upstream_as_plain_http(gateway: Gateway) -> None:
    body = b'{"n": 2}'
    [echoed] = exchange(gateway.port, post("/echo/x", body, f"Idempotency-Key: {new_key()}",
                                           *H2C_OFFER), 1)  # fmt: skip
    assert echoed[0] == 200
    received = json.loads(echoed[2])
    assert received["body"] == body.decode()
    names = {name for name, _ in received["headers"]}
    assert not names & {"upgrade", "http2-settings", "connection"}  # hop-by-hop, named or not


async def test_a_websocket_upgrade_is_served_as_a_plain_get(gateway: Gateway) -> None:
    request = (
        b"GET /echo/socket HTTP/1.1\r\nHost: gateway\r\nConnection: Upgrade\r\n"
        b"Upgrade: websocket\r\nSec-WebSocket-Version: 13\r\n"
        b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n"
        b"GET /echo/next HTTP/1.1\r\nHost: gateway\r\n\r\n"
    )
    socket_answer, next_answer = exchange(gateway.port, request, 2)
    assert socket_answer[0] == 200  # the upstream's answer to a GET: no 101, no bare 500
    assert json.loads(socket_answer[2])["path"] == "/echo/socket"
    assert json.loads(next_answer[2])["path"] == "/echo/next"


async def test_an_upgrade_offer_pipelined_behind_a_request_in_flight_is_answered_after_it(
    gateway: Gateway, upstream: DemoUpstream
) -> None:
    key, slow_key = new_key(), new_key()
    # Answered a second late by the upstream: in flight when the offer behind it is read.
    slow = post("/emails", b'{"n": 0}', f"Idempotency-Key: {slow_key}", "X-Demo-Delay: 1")
    offer = post("/emails", b'{"n": 3}', f"Idempotency-Key: {key}", *H2C_OFFER)
    first, second = exchange(gateway.port, slow + offer, 2)
    assert json.loads(first[2])["idempotency_key"] == slow_key  # in order
    assert json.loads(second[2])["idempotency_key"] == key
    assert [action["request"] for action in upstream.actions(key)] == [{"n": 3}]


async def test_http_clients_still_work_after_upgrade_offers(client: httpx.AsyncClient) -> None:
    response = await client.get("/echo/plain")
    assert response.status_code == 200
    assert response.headers["content-type"] != PROBLEM
    assert problem_name(await client.post("/emails", json={})) == "missing-key"


@pytest.mark.parametrize("spelling", ["/%65mails", "/./emails", "/x/../emails", "//emails"])
async def test_every_spelling_of_a_path_gets_its_route_s_policy(
    gateway: Gateway, upstream: DemoUpstream, spelling: str
) -> None:
    # /emails requires a key; the catch-all would forward without one.
    before = len(upstream.actions())
    [answer] = exchange(gateway.port, post(spelling, b'{"n": 4}'), 1)
    assert answer[0] == 400 and json.loads(answer[2])["type"].endswith(":missing-key")
    assert len(upstream.actions()) == before


async def test_one_key_sent_under_three_spellings_of_a_path_is_performed_once(
    gateway: Gateway, upstream: DemoUpstream
) -> None:
    key = new_key()
    answers = [
        exchange(gateway.port, post(spelling, b'{"n": 5}', f"Idempotency-Key: {key}"), 1)[0]
        for spelling in ("/emails", "/%65mails", "/payments/../emails")
    ]
    assert [status for status, _, _ in answers] == [201, 201, 201]
    assert [headers.get("idempotent-replayed") for _, headers, _ in answers] == [
        None, "true", "true"
    ]  # fmt: skip
    [action] = upstream.actions(key)
    assert action["path"] == "/emails"


async def test_a_path_that_climbs_above_the_root_is_refused(
    gateway: Gateway, db: asyncpg.Connection
) -> None:
    key = new_key()
    [answer] = exchange(gateway.port, post("/based/../../admin/secret", b"{}",
                                           f"Idempotency-Key: {key}"), 1)  # fmt: skip
    assert answer[0] == 400 and answer[1]["content-type"] == PROBLEM
    assert json.loads(answer[2])["type"] == "urn:oncegate:problem:invalid-path"
    assert await row(db, key) is None


async def test_the_upstream_gets_the_normalized_path_under_the_route_s_base(
    gateway: Gateway,
) -> None:
    request = b"GET /based/x/../%79/./z//w HTTP/1.1\r\nHost: gateway\r\n\r\n"
    [answer] = exchange(gateway.port, request, 1)
    assert answer[0] == 200
    assert json.loads(answer[2])["path"] == "/echo/api/y/z/w"
