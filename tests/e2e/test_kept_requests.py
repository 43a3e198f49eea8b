"""The request behind an unknown key (contract section 11), on a real gateway and a real
PostgreSQL (and Citus): kept by the claim, shown by the admin API, the page and `oncegate keys`,
re-sent once by an operator, and gone once the key settles.

Keys turn `unknown` as in production: the route's timeout (1 s) runs out after the request was
sent, because this module's upstream answers the first request of a key marked `X-Slow-First`
only after 3 s. It answers every later one at once, and counts what it performed per key.
"""

from __future__ import annotations

import asyncio
import base64
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest

from tests.e2e.conftest import GatewayProcess, prefix_route, problem_name
from tests.e2e.test_queue import csrf_of, oncegate_keys
from tests.helpers import scrape

pytestmark = pytest.mark.citus

TOKEN = "queue-admin-token"  # as test_queue's, whose `oncegate_keys` this module uses
BODY = {"amount": 81, "card": "tok_visa"}


class SlowFirstUpstream:
    """Performs every request it reads (counted per Idempotency-Key); the first of a key sent
    with `X-Slow-First` is answered 3 s late, after the gateway's timeout. A later one sent with
    `X-Refuse-Later` is refused 401 and not performed, as an expired credential would be."""

    def __init__(self) -> None:
        self.performed: dict[str, list[dict[str, Any]]] = {}
        self._lock = threading.Lock()
        upstream = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                key = self.headers.get("idempotency-key", "")
                if self.headers.get("x-refuse-later") and upstream.times(key) > 0:
                    self.send_response(401)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                with upstream._lock:
                    seen = upstream.performed.setdefault(key, [])
                    headers = {name.lower(): value for name, value in self.headers.items()}
                    seen.append({"path": self.path, "body": body, "headers": headers})
                    number = len(seen)
                if number == 1 and self.headers.get("x-slow-first"):
                    time.sleep(3)
                answer = json.dumps({"charge": f"ch_{number}", "key": key}).encode()
                try:
                    self.send_response(201)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(answer)))
                    self.end_headers()
                    self.wfile.write(answer)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the gateway stopped waiting (its timeout): the action was performed

            def log_message(self, *arguments: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def times(self, key: str) -> int:
        with self._lock:
            return len(self.performed.get(key, []))

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


@pytest.fixture(scope="module")
def slow_first() -> Iterator[SlowFirstUpstream]:
    upstream = SlowFirstUpstream()
    try:
        yield upstream
    finally:
        upstream.close()


@pytest.fixture(scope="module")
def gateway(
    module_dir: Path, database_url: str, slow_first: SlowFirstUpstream
) -> Iterator[GatewayProcess]:
    routes = [
        prefix_route("kept", slow_first.url, timeout="1s"),
        prefix_route("never", slow_first.url, timeout="1s", keep_request="never"),
    ]
    with GatewayProcess(module_dir, database_url, routes, admin_token=TOKEN) as process:
        yield process


@pytest.fixture
async def admin(gateway: GatewayProcess) -> AsyncIterator[httpx.AsyncClient]:
    async with gateway.admin_client(timeout=30) as client:
        yield client


async def lost(client: httpx.AsyncClient, route: str) -> str:
    """A key whose request reached the upstream and whose answer was lost (a timeout)."""
    key = str(uuid.uuid4())
    answer = await client.post(
        f"/{route}/charges?currency=eur",
        json=BODY,
        headers={"Idempotency-Key": key, "X-Slow-First": "1", "Authorization": "Bearer sk_81"},
    )
    assert answer.status_code == 504 and problem_name(answer) == "outcome-unknown"
    return key


def retried(key: str) -> dict[str, str]:
    """A client's retry of `lost`'s request: the same key and credential (its scope)."""
    return {"Idempotency-Key": key, "Authorization": "Bearer sk_81"}


async def record_of(admin: httpx.AsyncClient, key: str) -> dict[str, Any]:
    found = await admin.get("/admin/keys", params={"key": key, "request": "1"})
    (record,) = found.json()["records"]
    return dict(record)


async def test_an_unknown_key_shows_its_request_who_claimed_it_and_what_it_saw(
    client: httpx.AsyncClient, admin: httpx.AsyncClient
) -> None:
    key = await lost(client, "kept")
    record = await record_of(admin, key)
    assert record["state"] == "unknown"
    request = record["request"]
    assert (request["method"], request["path"], request["query"]) == (
        "POST",
        "/kept/charges",
        "currency=eur",
    )
    assert json.loads(base64.b64decode(request["body_base64"])) == BODY
    headers = {name: value for name, value in request["headers"]}
    assert headers["idempotency-key"] == key and headers["x-slow-first"] == "1"
    assert headers["authorization"] == "Bearer ***"  # shown masked, never the secret
    assert "host" not in headers and "content-length" not in headers
    claimed = record["claimed_by"]
    assert set(claimed) == {"host", "pid", "started_at"} and claimed["pid"] > 0
    failure = record["failure"]
    assert (failure["kind"], failure["status_line_received"]) == ("read_timeout", False)
    assert failure["bytes_received"] == 0
    # Without ?request=1 none of it is sent.
    plain = (await admin.get("/admin/keys", params={"key": key})).json()["records"][0]
    assert plain["request"] is None and plain["claimed_by"] is None


async def test_a_resend_performs_the_request_once_more_and_the_retry_replays_its_answer(
    client: httpx.AsyncClient,
    admin: httpx.AsyncClient,
    gateway: GatewayProcess,
    slow_first: SlowFirstUpstream,
    database_url: str,
) -> None:
    key = await lost(client, "kept")
    record = await record_of(admin, key)
    await _wait_until(lambda: slow_first.times(key) == 1)  # the lost one was performed
    before = scrape((await admin.get("/metrics")).text)

    resent = await admin.post(f"/admin/keys/{record['id']}/resolve", json={"action": "resend"})
    assert resent.status_code == 200, resent.text
    document = resent.json()
    assert (document["resolved"], document["answer"]["status"]) == ("resend", 201)
    assert json.loads(document["answer"]["body"]) == {"charge": "ch_2", "key": key}
    assert slow_first.times(key) == 2  # exactly once more
    (again,) = slow_first.performed[key][1:]
    assert again["path"] == "/charges?currency=eur" and json.loads(again["body"]) == BODY
    assert again["headers"]["authorization"] == "Bearer sk_81"  # the credential it was sent with

    retry = await client.post("/kept/charges?currency=eur", json=BODY, headers=retried(key))
    assert (retry.status_code, retry.headers["idempotent-replayed"]) == (201, "true")
    assert retry.json() == {"charge": "ch_2", "key": key}
    assert slow_first.times(key) == 2

    # A second re-send sends nothing: the key is completed.
    twice = await admin.post(f"/admin/keys/{record['id']}/resolve", json={"action": "resend"})
    assert (twice.status_code, problem_name(twice)) == (409, "key-not-unknown")
    assert slow_first.times(key) == 2
    after = scrape((await admin.get("/metrics")).text)
    for result, added in (("forwarded", 1), ("refused", 1)):
        labels = frozenset({("action", "resend"), ("result", result)})
        counted = after.get(("oncegate_resolutions_total", labels), 0.0)
        assert counted - before.get(("oncegate_resolutions_total", labels), 0.0) == added
    assert "resolution of key" in gateway.process.log.read_text()

    # The completed key keeps its answer and no longer its request, nor who claimed it.
    completed = await record_of(admin, key)
    assert (completed["state"], completed["request"], completed["claimed_by"]) == (
        "completed",
        None,
        None,
    )
    connection = await asyncpg.connect(database_url)
    try:
        row = await connection.fetchrow(
            "SELECT request, claimed_by FROM oncegate_keys WHERE key = $1", key
        )
    finally:
        await connection.close()
    assert (row["request"], row["claimed_by"]) == (None, None)


async def test_a_resend_refused_for_its_expired_credentials_releases_the_key(
    client: httpx.AsyncClient, admin: httpx.AsyncClient, slow_first: SlowFirstUpstream
) -> None:
    """The kept request carries its first attempt's credentials: an upstream that refuses them
    (401) performed nothing, so the key is released, not stored, and the client's own retry is
    forwarded instead of being answered 401 for the rest of the TTL."""
    key = str(uuid.uuid4())
    sent = {**retried(key), "X-Slow-First": "1", "X-Refuse-Later": "1"}
    answer = await client.post("/kept/charges?currency=eur", json=BODY, headers=sent)
    assert answer.status_code == 504 and problem_name(answer) == "outcome-unknown"
    record = await record_of(admin, key)
    await _wait_until(lambda: slow_first.times(key) == 1)

    with_answer = await admin.post(
        f"/admin/keys/{record['id']}/resolve", json={"action": "resend", "status": 201}
    )
    assert with_answer.status_code == 422  # an answer is complete's, not resend's: refused
    assert (await record_of(admin, key))["state"] == "unknown"

    resent = await admin.post(f"/admin/keys/{record['id']}/resolve", json={"action": "resend"})
    assert resent.status_code == 200, resent.text
    assert (resent.json()["answer"]["status"], resent.json()["answer"]["outcome"]) == (
        401,
        "released",
    )
    assert (await admin.get("/admin/keys", params={"key": key})).json()["records"] == []
    assert slow_first.times(key) == 1  # the refused re-send performed nothing

    retry = await client.post("/kept/charges?currency=eur", json=BODY, headers=retried(key))
    assert retry.status_code == 201 and "idempotent-replayed" not in retry.headers
    assert retry.json() == {"charge": "ch_2", "key": key}
    assert slow_first.times(key) == 2


async def test_a_gateway_keeping_requests_unsealed_says_so_when_it_starts(
    gateway: GatewayProcess,
) -> None:
    def warned() -> list[str]:
        text = gateway.process.log.read_text()
        return [line for line in text.splitlines() if "in plaintext" in line]

    await _wait_until(lambda: warned() != [])  # said as the runtime starts, after the bind
    (line,) = warned()
    assert "routes kept keep the request" in line  # and not the keep_request: never route's


async def test_a_completed_key_holds_no_request(
    client: httpx.AsyncClient, admin: httpx.AsyncClient, database_url: str
) -> None:
    key = str(uuid.uuid4())
    answer = await client.post("/kept/charges", json=BODY, headers={"Idempotency-Key": key})
    assert answer.status_code == 201
    record = await record_of(admin, key)
    assert (record["state"], record["request"], record["claimed_by"]) == ("completed", None, None)


async def test_a_route_that_keeps_no_request_refuses_a_resend(
    client: httpx.AsyncClient, admin: httpx.AsyncClient, slow_first: SlowFirstUpstream
) -> None:
    key = await lost(client, "never")
    record = await record_of(admin, key)
    assert record["request"] is None and record["failure"]["kind"] == "read_timeout"
    refused = await admin.post(f"/admin/keys/{record['id']}/resolve", json={"action": "resend"})
    assert (refused.status_code, problem_name(refused)) == (409, "request-not-kept")
    await asyncio.sleep(0.2)
    assert slow_first.times(key) == 1  # nothing was sent again
    assert (await record_of(admin, key))["state"] == "unknown"


async def test_the_page_shows_the_request_and_re_sends_it(
    client: httpx.AsyncClient,
    admin: httpx.AsyncClient,
    gateway: GatewayProcess,
    slow_first: SlowFirstUpstream,
) -> None:
    key = await lost(client, "kept")
    record = await record_of(admin, key)
    async with httpx.AsyncClient(base_url=gateway.admin_url, timeout=30) as browser_like:
        assert (await browser_like.post("/admin/ui/login", data={"token": TOKEN})).status_code
        page = await browser_like.get(f"/admin/ui/keys/{record['id']}")
        assert page.status_code == 200
        text = page.text
        assert "POST /kept/charges?currency=eur" in text
        assert "authorization: Bearer ***" in text and "sk_81" not in text
        assert "&quot;card&quot;: &quot;tok_visa&quot;" in text  # the JSON body, indented
        assert "did not come back in time" in text and "status line not received" in text
        assert 'value="resend"' in text
        sent = await browser_like.post(
            f"/admin/ui/keys/{record['id']}/resolve",
            data={"action": "resend", "csrf": csrf_of(text)},
        )
        assert sent.status_code == 303, sent.text
    assert slow_first.times(key) == 2
    retry = await client.post("/kept/charges?currency=eur", json=BODY, headers=retried(key))
    assert retry.status_code == 201 and retry.json()["charge"] == "ch_2"


async def test_oncegate_keys_shows_the_request_and_re_sends_it(
    client: httpx.AsyncClient, gateway: GatewayProcess, slow_first: SlowFirstUpstream
) -> None:
    key = await lost(client, "kept")
    status, shown, error = await oncegate_keys(gateway, "show", "--key", key, "--request")
    assert status == 0, error
    (record,) = json.loads(shown)["records"]
    assert record["request"]["path"] == "/kept/charges" and record["failure"] is not None
    status, out, error = await oncegate_keys(gateway, "resolve", str(record["id"]), "--resend")
    assert status == 0, error
    assert f"key {record['id']} re-sent: the upstream answered 201" in out
    assert slow_first.times(key) == 2
    retry = await client.post("/kept/charges?currency=eur", json=BODY, headers=retried(key))
    assert retry.status_code == 201 and retry.json()["charge"] == "ch_2"


async def _wait_until(condition: Any, seconds: float = 10) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)
