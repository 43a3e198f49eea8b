"""Hostile and odd inputs: what reaches the upstream and the store is what the client sent.

Each test sends what an attacker or an unlucky client would (raw bytes where no well-behaved
client would produce them) to a real gateway in front of the demo upstream, and checks what the
client got, what the upstream performed or received (its `/echo` answers with what arrived), and
what the store holds. docs/security.md says what each defends against.
"""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import httpx
import psutil
import pytest

from oncegate import settings
from oncegate.model import errors
from oncegate.service import Gateway as InProcessGateway
from oncegate.service import ProxyRequest
from oncegate.store.postgres import PostgresStore
from oncegate.upstream import NotSent
from oncegate.upstream.client import HttpUpstream
from tests.e2e.conftest import PROBLEM, parse_head
from tests.faults.conftest import DemoUpstream, GatewayProcess, problem_name, row
from tests.helpers import free_port, new_key


@pytest.fixture(scope="module")
def dead_port() -> int:
    return free_port()  # nothing listens there


@pytest.fixture(scope="module")
def gateway(
    module_dir: Path, database_url: str, upstream: DemoUpstream, dead_port: int
) -> Iterator[GatewayProcess]:
    routes = [
        {"name": "dead", "match": "/dead", "upstream": f"http://127.0.0.1:{dead_port}"},
        {"name": "emails", "match": "/emails", "upstream": upstream.url},
        {"name": "echo", "match": "/echo", "upstream": upstream.url},
        {"name": "based", "match": "/based", "upstream": upstream.url + "/echo/api",
         "strip_prefix": True},
        {"name": "default", "match": "/", "upstream": upstream.url, "key": "optional"},
    ]  # fmt: skip
    with GatewayProcess(module_dir, database_url, routes) as process:
        yield process


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
    gateway: GatewayProcess, upstream: DemoUpstream, db: asyncpg.Connection
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


async def test_an_upgrade_offer_reaches_the_upstream_as_plain_http(gateway: GatewayProcess) -> None:
    body = b'{"n": 2}'
    [echoed] = exchange(gateway.port, post("/echo/x", body, f"Idempotency-Key: {new_key()}",
                                           *H2C_OFFER), 1)  # fmt: skip
    assert echoed[0] == 200
    received = json.loads(echoed[2])
    assert received["body"] == body.decode()
    names = {name for name, _ in received["headers"]}
    assert not names & {"upgrade", "http2-settings", "connection"}  # hop-by-hop, named or not


async def test_a_websocket_upgrade_is_served_as_a_plain_get(gateway: GatewayProcess) -> None:
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
    gateway: GatewayProcess, upstream: DemoUpstream
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
    gateway: GatewayProcess, upstream: DemoUpstream, spelling: str
) -> None:
    # /emails requires a key; the catch-all would forward without one.
    before = len(upstream.actions())
    [answer] = exchange(gateway.port, post(spelling, b'{"n": 4}'), 1)
    assert answer[0] == 400 and json.loads(answer[2])["type"].endswith(":missing-key")
    assert len(upstream.actions()) == before


async def test_one_key_sent_under_three_spellings_of_a_path_is_performed_once(
    gateway: GatewayProcess, upstream: DemoUpstream
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
    gateway: GatewayProcess, db: asyncpg.Connection
) -> None:
    key = new_key()
    [answer] = exchange(gateway.port, post("/based/../../admin/secret", b"{}",
                                           f"Idempotency-Key: {key}"), 1)  # fmt: skip
    assert answer[0] == 400 and answer[1]["content-type"] == PROBLEM
    assert json.loads(answer[2])["type"] == "urn:oncegate:problem:invalid-path"
    assert await row(db, key) is None


async def test_the_upstream_gets_the_normalized_path_under_the_route_s_base(
    gateway: GatewayProcess,
) -> None:
    request = b"GET /based/x/../%79/./z//w HTTP/1.1\r\nHost: gateway\r\n\r\n"
    [answer] = exchange(gateway.port, request, 1)
    assert answer[0] == 200
    assert json.loads(answer[2])["path"] == "/echo/api/y/z/w"


def raw_post(path: str, body: bytes, *headers: bytes) -> bytes:
    head = [b"POST " + path.encode() + b" HTTP/1.1", b"Host: gateway",
            b"Content-Type: application/json", b"Content-Length: %d" % len(body),
            *headers]  # fmt: skip
    return b"\r\n".join(head) + b"\r\n\r\n" + body


async def test_utf8_header_values_reach_the_upstream_byte_for_byte(gateway: GatewayProcess) -> None:
    key = b"Idempotency-Key: " + new_key().encode()
    request = raw_post("/echo/h", b"{}", b"X-Name: Jos\xc3\xa9 \xe2\x82\xac", key)
    [echoed] = exchange(gateway.port, request, 1)
    assert echoed[0] == 200
    received = dict(json.loads(echoed[2])["headers"])  # the demo decodes bytes as Latin-1
    assert received["x-name"].encode("latin-1") == b"Jos\xc3\xa9 \xe2\x82\xac"


async def test_a_header_value_that_is_not_utf8_is_refused_not_changed(
    gateway: GatewayProcess, upstream: DemoUpstream, db: asyncpg.Connection
) -> None:
    key = new_key()
    request = raw_post(
        "/emails", b'{"n": 6}', b"X-Name: caf\xe9", b"Idempotency-Key: " + key.encode()
    )
    [answer] = exchange(gateway.port, request, 1)
    assert answer[0] == 400
    assert json.loads(answer[2])["type"] == "urn:oncegate:problem:invalid-header"
    assert upstream.actions(key) == [] and await row(db, key) is None


async def test_answer_header_bytes_are_relayed_and_replayed_unchanged(
    gateway: GatewayProcess,
) -> None:
    key = new_key().encode()
    # The demo sends the header's value as Latin-1 bytes: caf\xe9, not UTF-8.
    request = raw_post("/emails?header=X-Shop:caf%C3%A9", b'{"n": 7}', b"Idempotency-Key: " + key)
    answers = [exchange(gateway.port, request, 1)[0] for _ in range(2)]
    for _, headers, _ in answers:
        assert headers["x-shop"].encode("latin-1") == b"caf\xe9"
    assert answers[1][1]["idempotent-replayed"] == "true"


async def test_gateway_answers_name_the_route_not_the_upstream_s_address(
    gateway: GatewayProcess, dead_port: int
) -> None:
    answers = [
        exchange(gateway.port, post("/dead/x", b"{}", f"Idempotency-Key: {new_key()}"), 1)[0],
        exchange(gateway.port, b"GET /dead/x HTTP/1.1\r\nHost: gateway\r\n\r\n", 1)[0],
    ]
    for status, _, body in answers:
        assert status == 502
        detail = json.loads(body)["detail"]
        assert "'dead'" in detail
        assert "127.0.0.1" not in detail and str(dead_port) not in detail
    assert f"127.0.0.1:{dead_port}" in gateway.process.output()  # the operator's log has it


async def test_an_unexpected_client_library_error_before_sending_is_not_sent() -> None:
    # aiohttp refuses credentials in the URL beside an Authorization header with a ValueError,
    # before anything is sent (the config refuses such URLs; this is the layer below it).
    accepted: list[socket.socket] = []
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.settimeout(0.5)
        port = listener.getsockname()[1]
        upstream = HttpUpstream()
        try:
            with pytest.raises(NotSent, match="unexpected ValueError"):
                await upstream.send("POST", f"http://user:pw@127.0.0.1:{port}/x",
                                    [("authorization", "Bearer t")], b"{}", 5.0)  # fmt: skip
        finally:
            await upstream.aclose()
        with contextlib.suppress(TimeoutError):
            accepted.append(listener.accept()[0])
    assert accepted == []


async def test_a_key_is_released_when_an_unexpected_error_kept_the_request_from_leaving(
    store: PostgresStore, db: asyncpg.Connection
) -> None:
    # The request path of a gateway in process, on the real store and the real upstream client;
    # only the config check is skipped, to reach the error the config now refuses.
    valid = settings.Route(name="creds", match="/", upstream="http://127.0.0.1:9")
    route = valid.model_copy(update={"upstream": "http://user:pw@127.0.0.1:9"})  # unvalidated
    key = new_key()
    request = ProxyRequest(
        method="POST", path="/x", query="", body=b"{}",
        headers=[("idempotency-key", key), ("authorization", "Bearer t"),
                 ("content-type", "application/json")],
    )  # fmt: skip
    upstream = HttpUpstream()
    try:
        with pytest.raises(errors.UpstreamUnavailable):
            await InProcessGateway(store.requests, upstream).handle(route, request)
    finally:
        await upstream.aclose()
    assert await row(db, key) is None  # released: a retry is forwarded, not 409 for ever


async def test_a_large_json_body_is_the_same_request_only_as_the_same_bytes(
    client: httpx.AsyncClient, upstream: DemoUpstream
) -> None:
    # Over 64 KiB, JSON is compared as bytes (parsing it would hold up every other request).
    items = [(f"k{index:06d}", index) for index in range(8000)]
    body, reordered = json.dumps(dict(items)), json.dumps(dict(reversed(items)))
    key = new_key()
    headers = {"Idempotency-Key": key, "Content-Type": "application/json"}
    first = await client.post("/emails", content=body, headers=headers)
    assert first.status_code == 201
    again = await client.post("/emails", content=body, headers=headers)
    assert again.status_code == 201 and again.headers["idempotent-replayed"] == "true"
    other = await client.post("/emails", content=reordered, headers=headers)
    assert other.status_code == 422 and problem_name(other) == "key-reused"
    assert len(upstream.actions(key)) == 1


async def test_a_transfer_coding_other_than_chunked_is_refused(
    gateway: GatewayProcess, upstream: DemoUpstream, db: asyncpg.Connection
) -> None:
    key = new_key()
    request = (
        b"POST /emails HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
        b"Idempotency-Key: " + key.encode() + b"\r\nTransfer-Encoding: gzip, chunked\r\n\r\n"
        b'8\r\n{"n": 8}\r\n0\r\n\r\n'
    )
    [answer] = exchange(gateway.port, request, 1)
    assert answer[0] == 501
    assert json.loads(answer[2])["type"] == "urn:oncegate:problem:unsupported-transfer-coding"
    assert upstream.actions(key) == [] and await row(db, key) is None
    chunked = request.replace(b"gzip, chunked", b"chunked")
    [accepted] = exchange(gateway.port, chunked, 1)
    assert accepted[0] == 201 and [a["request"] for a in upstream.actions(key)] == [{"n": 8}]


@pytest.mark.parametrize(
    ("head", "status"),
    [
        (b"GET /echo/h HTTP/1.1\r\n\r\n", 400),  # no Host
        (b"GET /echo/h HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", 400),  # two
        (b"GET /echo/h HTTP/1.0\r\n\r\n", 200),  # HTTP/1.0 has no Host to send
    ],
    ids=["none", "two", "http/1.0"],
)
async def test_an_http11_request_needs_exactly_one_host(
    gateway: GatewayProcess, head: bytes, status: int
) -> None:
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=10) as sock:
        sock.sendall(head)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    assert received.startswith(b"HTTP/1.1 %d" % status), received[:200]
    if status == 400:
        assert b"urn:oncegate:problem:invalid-request" in received


async def test_naming_the_key_in_connection_does_not_keep_it_from_the_upstream(
    gateway: GatewayProcess,
) -> None:
    key = new_key()
    request = post("/echo/k", b"{}", f"Idempotency-Key: {key}", "Connection: Idempotency-Key")
    [echoed] = exchange(gateway.port, request, 1)
    received = dict(json.loads(echoed[2])["headers"])
    assert received["idempotency-key"] == key


async def test_a_head_answer_keeps_the_upstream_s_content_length(gateway: GatewayProcess) -> None:
    request = (
        b"GET /emails HTTP/1.1\r\nHost: gateway\r\n\r\nHEAD /emails HTTP/1.1\r\nHost: g\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=10) as sock:
        sock.sendall(request)
        received = b""
        while received.count(b"\r\n\r\n") < 2 or not received.endswith(b"\r\n\r\n"):
            chunk = sock.recv(65536)
            assert chunk
            received += chunk
    get_head, _, rest = received.partition(b"\r\n\r\n")
    _, get_headers = parse_head(get_head)
    length = int(get_headers["content-length"])
    head_head = rest[length:].partition(b"\r\n\r\n")[0]
    assert head_head.startswith(b"HTTP/1.1 405")
    assert parse_head(head_head)[1]["content-length"] == str(length)


def test_a_client_that_shuts_its_side_after_the_request_still_reads_the_answer(
    gateway: GatewayProcess,
) -> None:
    """A client may shut its side of the connection down once its request is sent (`nc -N`,
    shutdown(SHUT_WR)) and read the answer. The gateway is held stopped while the request and
    that end arrive, so it reads them one loop turn apart, and a HEAD request without a Host
    (refused at once, 400) is answered between the two: a head alone, which the protocol holds
    for a body until the end of the turn (`protocol._JoinedWrites`). It must go out before the
    client's end closes the socket."""
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=10) as sock:
        gateway.process.signal(signal.SIGSTOP)
        try:
            stopped = psutil.Process(gateway.process.pid)
            while stopped.status() != psutil.STATUS_STOPPED:
                time.sleep(0.01)
            sock.sendall(b"HEAD /echo/h HTTP/1.1\r\n\r\n")
            sock.shutdown(socket.SHUT_WR)
        finally:
            gateway.process.signal(signal.SIGCONT)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    assert received.startswith(b"HTTP/1.1 400"), received


def _closed_with_408(sock: socket.socket) -> None:
    received = b""
    while chunk := sock.recv(65536):
        received += chunk
    assert received.startswith(b"HTTP/1.1 408"), received[:200]
    assert b"urn:oncegate:problem:request-timeout" in received


async def test_a_connection_that_sends_no_head_is_closed(gateway: GatewayProcess) -> None:
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=60) as sock:
        sock.sendall(b"POST /emails HTTP/1.1\r\nHost: ga")  # and nothing more
        _closed_with_408(sock)


async def test_a_connection_handed_over_by_an_upgrade_offer_keeps_the_head_timeout(
    gateway: GatewayProcess,
) -> None:
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=60) as sock:
        sock.sendall(post("/echo/up", b"{}", f"Idempotency-Key: {new_key()}", *H2C_OFFER))
        received = b""
        while b"\r\n\r\n" not in received:
            received += sock.recv(65536)
        assert received.startswith(b"HTTP/1.1 200")
        head, _, rest = received.partition(b"\r\n\r\n")
        length = int(parse_head(head)[1]["content-length"])
        while len(rest) < length:
            rest += sock.recv(65536)
        sock.sendall(b"P")  # the first byte of a request whose head never comes
        _closed_with_408(sock)


@pytest.mark.parametrize("spelling", ["/x%2F..%2Femails", "/x%2f..%2femails", "/x%5C..%5Cemails"])
async def test_encoded_slashes_cannot_smuggle_a_path_past_its_route(
    gateway: GatewayProcess, upstream: DemoUpstream, spelling: str
) -> None:
    # To an upstream that decodes %2F, this is /emails, which needs a key; the catch-all would
    # forward it without one.
    before = len(upstream.actions())
    [answer] = exchange(gateway.port, post(spelling, b'{"n": 9}'), 1)
    assert answer[0] == 400 and json.loads(answer[2])["type"].endswith(":invalid-path")
    assert len(upstream.actions()) == before


async def test_an_encoded_slash_that_stays_inside_its_route_is_passed_on(
    gateway: GatewayProcess,
) -> None:
    [echoed] = exchange(gateway.port, b"GET /echo/files/a%2Fb HTTP/1.1\r\nHost: g\r\n\r\n", 1)
    assert echoed[0] == 200
