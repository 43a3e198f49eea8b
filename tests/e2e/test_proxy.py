"""Every row of the contract's table (section 4), through a real gateway process in front of the
real demo upstream, on a real PostgreSQL. Each test says what the client saw, what the upstream
performed (counted by the demo upstream itself) and what the store holds."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import socket
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest

from tests.e2e.conftest import (
    PROBLEM,
    DemoUpstream,
    GatewayProcess,
    keyed,
    prefix_route,
    problem_name,
    raw_request,
    row,
    row_count,
    wait_for_state,
)
from tests.helpers import free_port, new_key

# Every row holds on the embedded PostgreSQL and on a Citus cluster (`backend`, tests/conftest.py).
# On Citus too in `make test-all`: these tests are about the gateway, not the store (the
# store's own suite runs on Citus in `make test`, tests/store/test_conformance.py).
pytestmark = pytest.mark.citus(slow=True)


def routes(upstream: str, blackhole: int) -> list[dict[str, Any]]:
    def route(name: str, **options: Any) -> dict[str, Any]:
        return prefix_route(name, **{"upstream": upstream, **options})

    return [
        route("strict", timeout="5s"),
        route("optional", key="optional"),
        route("tenant"),
        route("unknown", timeout="1s"),
        route("forward", timeout="1s", on_unknown="forward"),
        route("small", max_body="1KiB", max_stored_response="1KiB"),
        route("short", ttl="3s", timeout="0.5s", lease="1s"),
        route("lease", timeout="3s", lease="8s"),  # room for a slow machine to kill in time
        route("dead", upstream=f"http://127.0.0.1:{free_port()}"),
        route("blackhole", upstream=f"http://127.0.0.1:{blackhole}", timeout="1s"),
    ]


@pytest.fixture(scope="module")
def route_config(upstream: DemoUpstream, blackhole: int) -> list[dict[str, Any]]:
    return routes(upstream.url, blackhole)


@pytest.fixture(scope="module")
def blackhole() -> Iterator[int]:
    """A port whose TCP handshake never completes: a listener with a full accept queue, so the
    kernel drops every further SYN, as a firewall or a dead host would."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port: int = listener.getsockname()[1]
    fillers = []
    for _ in range(3):
        filler = socket.socket()
        filler.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            filler.connect(("127.0.0.1", port))
        fillers.append(filler)
    try:
        yield port
    finally:
        for sock in [*fillers, listener]:
            sock.close()


@pytest.fixture(scope="module")
def gateway(
    module_dir: Path, database_url: str, route_config: list[dict[str, Any]]
) -> Iterator[GatewayProcess]:
    with GatewayProcess(module_dir, database_url, route_config) as process:
        yield process


def post(path: str, *header_lines: str, body: bytes = b"{}") -> bytes:
    lines = [
        f"POST {path} HTTP/1.1",
        "Host: gateway",
        "Connection: close",
        "Content-Type: application/json",
        f"Content-Length: {len(body)}",
        *header_lines,
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


# --- the table, row by row ---------------------------------------------------------------------


async def test_method_not_under_control_is_passed_through_and_nothing_stored(
    client: httpx.AsyncClient, db: asyncpg.Connection
) -> None:
    before = await row_count(db)
    response = await client.get("/strict/actions", headers=keyed(new_key()))
    assert response.status_code == 200
    assert "actions" in response.json()
    assert await row_count(db) == before


async def test_missing_key_on_an_optional_route_is_forwarded_unprotected(
    client: httpx.AsyncClient, upstream: DemoUpstream, db: asyncpg.Connection
) -> None:
    before = await row_count(db)
    marker = new_key()
    response = await client.post("/optional/emails", json={"marker": marker})
    assert response.status_code == 201
    performed = [a for a in upstream.actions() if a["request"] == {"marker": marker}]
    assert len(performed) == 1 and performed[0]["idempotency_key"] is None
    assert await row_count(db) == before


async def test_missing_key_on_a_required_route_is_refused(
    client: httpx.AsyncClient, upstream: DemoUpstream, db: asyncpg.Connection
) -> None:
    before_actions, before_rows = len(upstream.actions()), await row_count(db)
    response = await client.post("/strict/emails", json={"to": "a@example.com"})
    assert response.status_code == 400
    assert problem_name(response) == "missing-key"
    assert len(upstream.actions()) == before_actions
    assert await row_count(db) == before_rows


@pytest.mark.parametrize(
    "header_lines",
    [
        ["Idempotency-Key: "],  # empty
        ['Idempotency-Key: ""'],  # empty string
        ["Idempotency-Key: " + "k" * 256],  # too long, bare
        ['Idempotency-Key: "' + "k" * 256 + '"'],  # too long, quoted
        ["Idempotency-Key: a,b"],  # a bare value with a comma is a list
        ["Idempotency-Key: one", "Idempotency-Key: two"],  # two header lines
        ["Idempotency-Key: tab\there"],  # not printable
        ["Idempotency-Key: caf\xe9"],  # not ASCII
        ['Idempotency-Key: "unterminated'],
        ['Idempotency-Key: "bad\\escape"'],
        ['Idempotency-Key: "trailing"junk'],
    ],
    ids=lambda lines: repr(lines)[:40],
)
async def test_malformed_keys_are_refused_and_nothing_stored(
    gateway: GatewayProcess, upstream: DemoUpstream, db: asyncpg.Connection, header_lines: list[str]
) -> None:
    before_actions, before_rows = len(upstream.actions()), await row_count(db)
    status, headers, body = await asyncio.to_thread(
        raw_request, gateway.port, post("/strict/emails", *header_lines)
    )
    assert status == 400
    assert headers["content-type"] == PROBLEM
    assert json.loads(body)["type"] == "urn:oncegate:problem:invalid-key"
    assert len(upstream.actions()) == before_actions
    assert await row_count(db) == before_rows


@pytest.mark.parametrize(
    "value", ["abc\rX-Injected: 1", "del\x7fete", "nul\x00l"], ids=["CR", "DEL", "NUL"]
)
async def test_a_key_with_a_control_character_never_reaches_the_upstream(
    gateway: GatewayProcess, upstream: DemoUpstream, db: asyncpg.Connection, value: str
) -> None:
    before_actions, before_rows = len(upstream.actions()), await row_count(db)
    status, headers, body = await asyncio.to_thread(
        raw_request, gateway.port, post("/strict/emails", f"Idempotency-Key: {value}")
    )
    # The HTTP parser may refuse it first with a plain 400 (contract section 4); if it lets it
    # through, the gateway must.
    assert status == 400
    if headers.get("content-type") == PROBLEM:
        assert json.loads(body)["type"] == "urn:oncegate:problem:invalid-key"
    assert len(upstream.actions()) == before_actions
    assert await row_count(db) == before_rows


async def test_body_over_the_limit_is_refused_and_nothing_stored(
    client: httpx.AsyncClient, upstream: DemoUpstream, db: asyncpg.Connection
) -> None:
    before_actions, before_rows = len(upstream.actions()), await row_count(db)
    large = b"x" * 2048
    declared = await client.post("/small/emails", content=large, headers=keyed(new_key()))
    assert declared.status_code == 413
    assert problem_name(declared) == "body-too-large"

    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(4):
            yield b"y" * 512

    streamed = await client.post("/small/emails", content=chunks(), headers=keyed(new_key()))
    assert streamed.status_code == 413
    assert len(upstream.actions()) == before_actions
    assert await row_count(db) == before_rows


async def test_new_key_is_forwarded_once_stored_and_replayed(
    client: httpx.AsyncClient, upstream: DemoUpstream, db: asyncpg.Connection
) -> None:
    key = new_key()
    first = await client.post(
        "/strict/emails", json={"to": "a@example.com", "n": 1}, headers=keyed(key)
    )
    assert first.status_code == 201
    assert "idempotent-replayed" not in first.headers
    stored = await row(db, key)
    assert stored is not None
    assert (stored["state"], stored["response_status"]) == ("completed", 201)
    # The same request in other clothes: quoted key, keys reordered, other white space.
    retry = await client.post(
        "/strict/emails",
        content=b'{ "n" : 1,  "to" : "a@example.com" }',
        headers={"Idempotency-Key": f'"{key}"', "Content-Type": "application/json"},
    )
    assert retry.status_code == 201
    assert retry.headers["idempotent-replayed"] == "true"
    assert retry.content == first.content
    for name in ("location", "etag", "content-type"):
        assert retry.headers[name] == first.headers[name]
    assert retry.headers["content-length"] == str(len(first.content))
    performed = upstream.actions(key)
    assert len(performed) == 1
    assert performed[0]["idempotency_key"] == key  # the key is passed upstream


async def test_retry_while_in_flight_is_told_to_wait_then_replayed(
    client: httpx.AsyncClient, upstream: DemoUpstream, db: asyncpg.Connection
) -> None:
    key = new_key()
    body = {"to": "slow@example.com"}
    slow = asyncio.create_task(
        client.post("/strict/emails", json=body, headers=keyed(key, **{"X-Demo-Delay": "2"}))
    )
    await wait_for_state(db, key, "in_progress")
    waiting = await client.post("/strict/emails", json=body, headers=keyed(key))
    assert waiting.status_code == 409
    assert problem_name(waiting) == "request-in-progress"
    assert int(waiting.headers["retry-after"]) >= 1
    reused = await client.post("/strict/emails", json={"to": "other"}, headers=keyed(key))
    assert reused.status_code == 422
    assert problem_name(reused) == "key-reused"
    first = await slow
    assert first.status_code == 201
    replayed = await client.post("/strict/emails", json=body, headers=keyed(key))
    assert replayed.status_code == 201 and replayed.headers["idempotent-replayed"] == "true"
    assert replayed.content == first.content
    assert len(upstream.actions(key)) == 1


@pytest.mark.parametrize(
    "change",
    [
        {"json": {"to": "b@example.com"}},
        {"json": {"to": "a@example.com"}, "params": {"priority": "high"}},
        {"json": {"to": "a@example.com"}, "path": "/strict/tickets"},
    ],
    ids=["body", "query", "path"],
)
async def test_same_key_different_request_is_refused(
    client: httpx.AsyncClient, upstream: DemoUpstream, change: dict[str, Any]
) -> None:
    key = new_key()
    first = await client.post("/strict/emails", json={"to": "a@example.com"}, headers=keyed(key))
    assert first.status_code == 201
    change = dict(change)  # the parameter is shared by both backends' runs: not popped from
    path = change.pop("path", "/strict/emails")
    response = await client.post(path, headers=keyed(key), **change)
    assert response.status_code == 422
    assert problem_name(response) == "key-reused"
    assert len(upstream.actions(key)) == 1


async def test_an_expired_key_is_a_new_key(
    client: httpx.AsyncClient, upstream: DemoUpstream
) -> None:
    key = new_key()
    assert (
        await client.post("/short/emails", json={"n": 1}, headers=keyed(key))
    ).status_code == 201
    await asyncio.sleep(3.3)  # the route's ttl is 3s
    again = await client.post("/short/emails", json={"n": 2}, headers=keyed(key))
    assert again.status_code == 201
    assert "idempotent-replayed" not in again.headers
    assert [action["request"] for action in upstream.actions(key)] == [{"n": 1}, {"n": 2}]


async def test_a_handshake_that_never_completes_releases_the_key(
    client: httpx.AsyncClient, db: asyncpg.Connection
) -> None:
    key = new_key()
    for _ in range(2):  # nothing was sent, so the key is free for the retry
        response = await client.post("/blackhole/emails", json={}, headers=keyed(key))
        assert response.status_code == 502
        assert problem_name(response) == "upstream-unavailable"
        assert await row(db, key) is None


async def test_refused_connection_releases_the_key(
    client: httpx.AsyncClient, db: asyncpg.Connection
) -> None:
    key = new_key()
    for _ in range(2):  # released, so the retry is tried again rather than blocked
        response = await client.post("/dead/emails", json={}, headers=keyed(key))
        assert response.status_code == 502
        assert problem_name(response) == "upstream-unavailable"
        assert await row(db, key) is None


@pytest.mark.parametrize("status", [429, 503])
async def test_a_release_status_frees_the_key(
    client: httpx.AsyncClient, upstream: DemoUpstream, db: asyncpg.Connection, status: int
) -> None:
    key = new_key()
    refused = await client.post(
        "/strict/emails", json={}, headers=keyed(key, **{"X-Demo-Status": str(status)})
    )
    assert refused.status_code == status
    assert refused.headers["content-type"] == "application/json"  # the upstream's own answer
    assert await row(db, key) is None
    retry = await client.post("/strict/emails", json={}, headers=keyed(key))
    assert retry.status_code == 201 and "idempotent-replayed" not in retry.headers
    assert len(upstream.actions(key)) == 1


async def test_a_timeout_after_sending_makes_the_key_unknown(
    client: httpx.AsyncClient, upstream: DemoUpstream, db: asyncpg.Connection
) -> None:
    key = new_key()
    first = await client.post(
        "/unknown/emails", json={}, headers=keyed(key, **{"X-Demo-Delay": "2"})
    )
    assert first.status_code == 504
    assert problem_name(first) == "outcome-unknown"
    stored = await row(db, key)
    assert stored is not None and stored["state"] == "unknown"
    retry = await client.post("/unknown/emails", json={}, headers=keyed(key))
    assert retry.status_code == 409
    assert problem_name(retry) == "outcome-unknown"
    assert "retry-after" not in retry.headers
    other = await client.post("/unknown/emails", json={"n": 2}, headers=keyed(key))
    assert other.status_code == 422 and problem_name(other) == "key-reused"
    assert len(upstream.actions(key)) == 1  # performed once, and never again


async def test_on_unknown_forward_sends_the_retry_again_with_the_same_key(
    client: httpx.AsyncClient, upstream: DemoUpstream
) -> None:
    key = new_key()
    first = await client.post(
        "/forward/emails", json={}, headers=keyed(key, **{"X-Demo-Delay": "2"})
    )
    assert first.status_code == 504
    retry = await client.post("/forward/emails", json={}, headers=keyed(key))
    assert retry.status_code == 201 and "idempotent-replayed" not in retry.headers
    replay = await client.post("/forward/emails", json={}, headers=keyed(key))
    assert replay.status_code == 201 and replay.headers["idempotent-replayed"] == "true"
    assert replay.content == retry.content
    assert [action["idempotency_key"] for action in upstream.actions(key)] == [key, key]


async def test_a_dead_gateways_lease_runs_out_and_the_key_turns_unknown(
    module_dir: Path,
    database_url: str,
    route_config: list[dict[str, Any]],
    client: httpx.AsyncClient,
    upstream: DemoUpstream,
    db: asyncpg.Connection,
) -> None:
    doomed = GatewayProcess(module_dir, database_url, route_config, name="doomed")
    try:
        key = new_key()
        async with httpx.AsyncClient(base_url=doomed.url, timeout=30) as doomed_client:
            request = asyncio.create_task(
                doomed_client.post(
                    "/lease/emails", json={}, headers=keyed(key, **{"X-Demo-Delay": "1.5"})
                )
            )
            # Kill it while the upstream works on the request: the action is recorded on
            # arrival, the answer comes 1.5 s later.
            for _ in range(200):
                if upstream.actions(key):
                    break
                await asyncio.sleep(0.02)
            doomed.process.signal(signal.SIGKILL)
            with pytest.raises(httpx.TransportError):
                await request
    finally:
        doomed.stop()
    waiting = await client.post("/lease/emails", json={}, headers=keyed(key))
    assert waiting.status_code == 409 and problem_name(waiting) == "request-in-progress"
    assert waiting.headers["retry-after"]
    # The lease runs out now rather than in 8 s: set to a moment past by PostgreSQL's clock (a
    # value, not arithmetic on the column, which Citus refuses in an UPDATE).
    past = await db.fetchval("SELECT now() - interval '1 second'")
    await db.execute("UPDATE oncegate_keys SET lease_expires_at = $2 WHERE key = $1", key, past)
    found = await row(db, key)
    assert found is not None and found["effective_state"] == "unknown"
    unknown = await client.post("/lease/emails", json={}, headers=keyed(key))
    assert unknown.status_code == 409 and problem_name(unknown) == "outcome-unknown"
    assert "retry-after" not in unknown.headers  # only an operator's resolution ends it
    assert len(upstream.actions(key)) == 1


# --- beyond the table: scopes, headers, sizes, concurrency, hang-ups, shutdown ----------------


async def test_the_same_key_from_two_clients_is_two_keys(
    client: httpx.AsyncClient, upstream: DemoUpstream
) -> None:
    key = new_key()
    alice = keyed(key, Authorization="Bearer alice")
    bob = keyed(key, Authorization="Bearer bob")
    alice_first = await client.post("/tenant/charges", json={"amount": 1}, headers=alice)
    bob_first = await client.post("/tenant/charges", json={"amount": 1}, headers=bob)
    assert alice_first.status_code == bob_first.status_code == 201
    assert alice_first.json()["id"] != bob_first.json()["id"]
    alice_retry = await client.post("/tenant/charges", json={"amount": 1}, headers=alice)
    bob_retry = await client.post("/tenant/charges", json={"amount": 1}, headers=bob)
    assert alice_retry.json()["id"] == alice_first.json()["id"]
    assert bob_retry.json()["id"] == bob_first.json()["id"]
    assert len(upstream.actions(key)) == 2


async def test_a_json_content_type_with_a_body_that_is_not_json(
    client: httpx.AsyncClient, upstream: DemoUpstream
) -> None:
    key = new_key()
    headers = keyed(key, **{"Content-Type": "application/json"})
    first = await client.post("/strict/emails", content=b"{not json", headers=headers)
    assert first.status_code == 201
    retry = await client.post("/strict/emails", content=b"{not json", headers=headers)
    assert retry.status_code == 201 and retry.headers["idempotent-replayed"] == "true"
    other = await client.post("/strict/emails", content=b"{not  json", headers=headers)
    assert other.status_code == 422
    assert len(upstream.actions(key)) == 1


async def test_hop_by_hop_headers_are_neither_forwarded_nor_stored(
    gateway: GatewayProcess, db: asyncpg.Connection
) -> None:
    key = new_key()
    request = post(
        "/strict/echo/x?header=Set-Cookie:session%3Dsecret&header=X-Trace:1",
        f"Idempotency-Key: {key}",
        "Keep-Alive: timeout=5",
        "TE: trailers",
        "X-Hop: private",
        "X-End-To-End: kept",
    ).replace(b"Connection: close", b"Connection: close, X-Hop")
    status, headers, body = await asyncio.to_thread(raw_request, gateway.port, request)
    assert status == 200
    received = {name for name, _ in json.loads(body)["headers"]}
    assert {"idempotency-key", "x-end-to-end"} <= received
    assert not received & {"keep-alive", "te", "x-hop", "connection"}
    assert headers["set-cookie"] == "session=secret"  # the first caller gets its cookie
    stored = await row(db, key)
    assert stored is not None
    stored_names = {name.lower() for name, _ in json.loads(stored["response_headers"])}
    assert "x-trace" in stored_names
    assert not stored_names & {"set-cookie", "content-length", "connection"}
    _, replay_headers, replay_body = await asyncio.to_thread(raw_request, gateway.port, request)
    assert replay_headers["idempotent-replayed"] == "true"
    assert "set-cookie" not in replay_headers
    assert replay_body == body


async def test_an_answer_too_large_to_store_reaches_the_first_caller_only(
    client: httpx.AsyncClient, upstream: DemoUpstream, db: asyncpg.Connection
) -> None:
    key = new_key()
    first = await client.post("/small/emails?size=4096", json={}, headers=keyed(key))
    assert first.status_code == 201 and len(first.content) >= 4096
    stored = await row(db, key)
    assert stored is not None
    assert (stored["state"], stored["response_stored"], stored["response_body"]) == (
        "completed",
        False,
        None,
    )
    retry = await client.post("/small/emails?size=4096", json={}, headers=keyed(key))
    assert retry.status_code == 409
    assert problem_name(retry) == "response-not-stored"
    assert "201" in retry.json()["detail"]
    assert len(upstream.actions(key)) == 1


async def test_fifty_concurrent_copies_reach_the_upstream_once(
    client: httpx.AsyncClient, upstream: DemoUpstream
) -> None:
    key = new_key()
    headers = keyed(key, **{"X-Demo-Delay": "0.5"})
    responses = await asyncio.gather(
        *(client.post("/strict/charges", json={"amount": 4200}, headers=headers) for _ in range(50))
    )
    forwarded = [
        r for r in responses if r.status_code == 201 and "idempotent-replayed" not in r.headers
    ]
    replayed = [r for r in responses if r.headers.get("idempotent-replayed") == "true"]
    waiting = [r for r in responses if r.status_code == 409]
    assert len(forwarded) == 1
    assert len(forwarded) + len(replayed) + len(waiting) == 50
    assert all(problem_name(r) == "request-in-progress" for r in waiting)
    assert all(r.content == forwarded[0].content for r in replayed)
    assert len(upstream.actions(key)) == 1


async def test_a_client_that_hangs_up_does_not_cancel_the_forward(
    gateway: GatewayProcess,
    client: httpx.AsyncClient,
    upstream: DemoUpstream,
    db: asyncpg.Connection,
) -> None:
    key = new_key()
    with socket.create_connection(("127.0.0.1", gateway.port)) as sock:
        sock.sendall(post("/strict/emails", f"Idempotency-Key: {key}", "X-Demo-Delay: 1"))
        await wait_for_state(db, key, "in_progress")
    await wait_for_state(db, key, "completed")
    retry = await client.post(
        "/strict/emails", content=b"{}", headers=keyed(key, **{"Content-Type": "application/json"})
    )
    assert retry.status_code == 201 and retry.headers["idempotent-replayed"] == "true"
    assert len(upstream.actions(key)) == 1


async def test_sigterm_finishes_and_stores_requests_in_flight(
    module_dir: Path,
    database_url: str,
    route_config: list[dict[str, Any]],
    client: httpx.AsyncClient,
    upstream: DemoUpstream,
    db: asyncpg.Connection,
) -> None:
    leaving = GatewayProcess(module_dir, database_url, route_config, name="leaving")
    key = new_key()
    try:
        async with httpx.AsyncClient(base_url=leaving.url, timeout=30) as leaving_client:
            request = asyncio.create_task(
                leaving_client.post(
                    "/strict/emails", json={}, headers=keyed(key, **{"X-Demo-Delay": "1"})
                )
            )
            await wait_for_state(db, key, "in_progress")
            leaving.process.signal(signal.SIGTERM)
            response = await request
        assert response.status_code == 201
        assert await asyncio.to_thread(leaving.process.wait) == 0
    finally:
        leaving.stop()
    stored = await row(db, key)
    assert stored is not None and stored["state"] == "completed"
    replay = await client.post("/strict/emails", json={}, headers=keyed(key))
    assert replay.headers["idempotent-replayed"] == "true"
    assert replay.content == response.content
    assert len(upstream.actions(key)) == 1


async def test_a_path_no_route_matches_is_404(client: httpx.AsyncClient) -> None:
    response = await client.post("/nowhere/emails", json={}, headers=keyed(new_key()))
    assert response.status_code == 404
    assert problem_name(response) == "route-not-found"
    prefix_only = await client.post("/strictly/emails", json={}, headers=keyed(new_key()))
    assert prefix_only.status_code == 404


async def test_the_upstream_gets_the_clients_headers_and_no_others(gateway: GatewayProcess) -> None:
    request = (
        "POST /strict/echo/raw%2Fpath?b=2&a=1 HTTP/1.1\r\nHost: gateway\r\nConnection: close\r\n"
        f"Idempotency-Key: {new_key()}\r\nX-Request-Id: trace-7\r\nContent-Length: 3\r\n\r\nabc"
    ).encode()
    status, headers, body = await asyncio.to_thread(raw_request, gateway.port, request)
    assert status == 200
    received = json.loads(body)
    names = [name for name, _ in received["headers"]]
    # Host and Content-Length are the client library's to set; nothing else may be added.
    assert sorted(set(names) - {"host", "content-length"}) == ["idempotency-key", "x-request-id"]
    assert received["body"] == "abc"
    assert received["query"] == "b=2&a=1"
    assert headers["x-request-id"] == "trace-7"


async def test_answers_without_a_body_stay_without_one(
    client: httpx.AsyncClient, upstream: DemoUpstream
) -> None:
    key = new_key()
    # A 204 carries no body, stored or not. (An upstream that sends one anyway is
    # tests/faults/test_upstream_faults.py's no-content cases.)
    first = await client.post(
        "/strict/emails", json={}, headers=keyed(key, **{"X-Demo-Status": "204"})
    )
    assert first.status_code == 204 and first.content == b""
    replay = await client.post(
        "/strict/emails", json={}, headers=keyed(key, **{"X-Demo-Status": "204"})
    )
    assert replay.status_code == 204 and replay.content == b""
    assert replay.headers["idempotent-replayed"] == "true"
    assert "content-length" not in replay.headers
    assert len(upstream.actions(key)) == 1
    head = await client.head("/strict/actions")
    assert head.status_code == 200 and head.content == b""
