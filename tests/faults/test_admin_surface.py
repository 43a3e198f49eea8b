"""The admin port from outside (docs/security.md): what an unauthenticated or careless caller can
make the gateway do there, which shares its process with the proxy.

- No admin body is read before its sender is known, and none past its bound: the answer (401,
  413) comes while the client still has most of its body to send, so the gateway never held it.
- The page's resolve form knows two actions; any other (or none) is a 400 and changes nothing.
- A session cookie is attacker input: whatever its bytes, a 401 and the login form, never a 500.
- A logout ends the session: a copy of the cookie is refused after it, by another gateway on the
  same database (as after a restart) too.
"""

from __future__ import annotations

import re
import socket
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest

from oncegate.http import sessions, ui
from tests.e2e.conftest import parse_head, prefix_route
from tests.faults.conftest import ADMIN_TOKEN, DemoUpstream, GatewayProcess, admin_get
from tests.helpers import new_key

# The largest route stores answers up to this, so a resolution is bounded near 4/3 of it (base64).
STORED = 64 * 1024


@pytest.fixture(scope="module")
def gateway(
    module_dir: Path, database_url: str, upstream: DemoUpstream
) -> Iterator[GatewayProcess]:
    routes = [
        prefix_route("pay", upstream.url, max_stored_response=f"{STORED // 1024}KiB"),
        prefix_route("slow", upstream.url, timeout="1s", max_stored_response="1KiB"),
    ]
    with GatewayProcess(module_dir, database_url, routes, admin_token=ADMIN_TOKEN) as process:
        yield process


def answer_while_sending(
    port: int, head: bytes, announced: int | None, sent: int
) -> tuple[int, dict[str, str], bytes]:
    """Send `head` announcing a body of `announced` bytes (None: chunked, never ended), send
    `sent` bytes of it, and read the answer without sending the rest: an answer that comes proves
    the gateway did not wait for (or hold) the rest."""
    framing = (
        b"Transfer-Encoding: chunked" if announced is None else b"Content-Length: %d" % (announced)
    )
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(head + framing + b"\r\n\r\n")
        piece = 64 * 1024
        written = 0
        while written < sent:
            chunk = b"a" * min(piece, sent - written)
            data = b"%x\r\n%s\r\n" % (len(chunk), chunk) if announced is None else chunk
            try:
                sock.sendall(data)
            except OSError:  # the gateway answered and closed: it read no further
                break
            written += len(chunk)
        received = b""
        while b"\r\n\r\n" not in received:
            chunk = sock.recv(65536)
            assert chunk, f"the connection closed without an answer: {received!r}"
            received += chunk
        head_bytes, _, body = received.partition(b"\r\n\r\n")
        status_line, headers = parse_head(head_bytes)
        while len(body) < int(headers.get("content-length", "0")):
            chunk = sock.recv(65536)
            if not chunk:
                break
            body += chunk
    return int(status_line.split()[1]), headers, body


def post_head(path: str, content_type: bytes, *extra: bytes) -> bytes:
    lines = [b"POST " + path.encode() + b" HTTP/1.1", b"Host: admin", b"Content-Type: " +
             content_type, *extra]  # fmt: skip
    return b"\r\n".join(lines) + b"\r\n"


BEARER = b"Authorization: Bearer " + ADMIN_TOKEN.encode()
FORM = b"application/x-www-form-urlencoded"


@pytest.mark.parametrize("announced", [16 * 1024**2, None], ids=["length", "chunked"])
def test_a_resolution_without_the_token_is_refused_before_its_body_is_read(
    gateway: GatewayProcess, announced: int | None
) -> None:
    head = post_head("/admin/keys/1/resolve", b"application/json")
    status, headers, body = answer_while_sending(gateway.admin_port, head, announced, 1024)
    assert status == 401 and headers["www-authenticate"] == "Bearer"
    assert b"unauthorized" in body


@pytest.mark.parametrize("announced", [16 * 1024**2, None], ids=["length", "chunked"])
def test_a_resolution_past_its_bound_is_refused_before_the_rest_is_read(
    gateway: GatewayProcess, announced: int | None
) -> None:
    head = post_head("/admin/keys/1/resolve", b"application/json", BEARER)
    # Chunked, the bound is found as the body arrives: a little past it, never the 16 MiB.
    sent = 1024 if announced is not None else 2 * STORED + 128 * 1024
    status, _, body = answer_while_sending(gateway.admin_port, head, announced, sent)
    assert status == 413 and b"body-too-large" in body


@pytest.mark.parametrize("announced", [48 * 1024**2, None], ids=["length", "chunked"])
def test_the_login_form_is_bounded_before_it_is_read(
    gateway: GatewayProcess, announced: int | None
) -> None:
    sent = 1024 if announced is not None else ui.MAX_LOGIN_BYTES + 64 * 1024
    status, _, body = answer_while_sending(
        gateway.admin_port, post_head("/admin/ui/login", FORM), announced, sent
    )
    assert status == 413 and b"body-too-large" in body


def test_a_page_form_without_a_session_is_refused_before_its_body_is_read(
    gateway: GatewayProcess,
) -> None:
    for path in ("/admin/ui/keys/1/resolve", "/admin/ui/logout"):
        status, _, body = answer_while_sending(
            gateway.admin_port, post_head(path, FORM), 48 * 1024**2, 1024
        )
        assert status == 401 and b"/admin/ui/login" in body  # the login form


@pytest.fixture
async def operator(gateway: GatewayProcess) -> AsyncIterator[httpx.AsyncClient]:
    """A browser-like client logged in to the page."""
    async with httpx.AsyncClient(base_url=gateway.admin_url) as browser_like:
        logged_in = await browser_like.post("/admin/ui/login", data={"token": ADMIN_TOKEN})
        assert logged_in.status_code == 303
        yield browser_like


async def unknown_key(gateway: GatewayProcess, client: httpx.AsyncClient) -> tuple[str, int]:
    """A key whose request reached the upstream and whose answer was lost (a timeout)."""
    key = new_key()
    lost = await client.post(
        "/slow/charges", json={"n": 1}, headers={"Idempotency-Key": key, "X-Demo-Delay": "3"}
    )
    assert lost.status_code == 504
    async with gateway.admin_client() as admin:
        (record,) = (await admin.get("/admin/keys", params={"key": key})).json()["records"]
    assert record["state"] == "unknown"
    return key, record["id"]


@pytest.mark.parametrize("action", ["Complete", "bogus", "", None])
async def test_the_page_s_resolve_form_refuses_an_action_it_does_not_know(
    gateway: GatewayProcess,
    client: httpx.AsyncClient,
    operator: httpx.AsyncClient,
    upstream: DemoUpstream,
    action: str | None,
) -> None:
    key, record_id = await unknown_key(gateway, client)
    page = (await operator.get(f"/admin/ui/keys/{record_id}")).text
    found = re.search(r'name="csrf" value="([0-9a-f]+)"', page)
    assert found, page
    form = {"csrf": found.group(1), "status": "201", "body": "x"}
    if action is not None:
        form["action"] = action
    refused = await operator.post(f"/admin/ui/keys/{record_id}/resolve", data=form)
    assert refused.status_code == 400 and "nothing was changed" in refused.text
    async with gateway.admin_client() as admin:
        assert (await admin.get(f"/admin/keys/{record_id}")).json()["state"] == "unknown"
    retry = await client.post("/slow/charges", json={"n": 1}, headers={"Idempotency-Key": key})
    assert retry.status_code == 409  # still unknown: not forwarded again
    assert len(upstream.actions(key)) == 1


@pytest.mark.parametrize(
    "cookie",
    [b"\xb2.x", b"9999999999.\xe9\xe9", b"9" * 5000 + b".x", b"\xd9\xa3" * 4 + b".x", b"."],
    ids=["superscript-digit", "non-ascii-signature", "5000-digits", "arabic-digits", "dot"],
)
def test_an_odd_session_cookie_is_a_401_never_a_500(gateway: GatewayProcess, cookie: bytes) -> None:
    answer = admin_get(gateway.admin_port, "/admin/ui", b"Cookie: oncegate_session=" + cookie)
    assert answer.startswith(b"HTTP/1.1 401"), answer[:300]
    assert b'name="token"' in answer  # the login form
    assert "Traceback" not in gateway.process.output()


async def test_a_logout_ends_the_session_everywhere_and_after_a_restart(
    gateway: GatewayProcess,
    module_dir: Path,
    database_url: str,
    upstream: DemoUpstream,
    operator: httpx.AsyncClient,
) -> None:
    # Each login is its own session, two in one second too: a logout ends that one alone.
    assert sessions.new_session(ADMIN_TOKEN, 1e9) != sessions.new_session(ADMIN_TOKEN, 1e9)
    cookie = operator.cookies["oncegate_session"]
    queue = await operator.get("/admin/ui")
    assert queue.status_code == 200
    found = re.search(r'name="csrf" value="([0-9a-f]+)"', queue.text)
    assert found, queue.text
    logged_out = await operator.post("/admin/ui/logout", data={"csrf": found.group(1)})
    assert logged_out.status_code == 303

    routes = [prefix_route("pay", upstream.url)]
    with GatewayProcess(module_dir, database_url, routes, name="restarted",
                        admin_token=ADMIN_TOKEN) as restarted:  # fmt: skip
        for admin_url in (gateway.admin_url, restarted.admin_url):
            async with httpx.AsyncClient(base_url=admin_url) as copy:
                copy.cookies.set("oncegate_session", cookie, path="/admin/ui")
                refused = await copy.get("/admin/ui")
                assert refused.status_code == 401 and 'name="token"' in refused.text
                # A new login still works: only that session ended.
                again = await copy.post("/admin/ui/login", data={"token": ADMIN_TOKEN})
                assert again.status_code == 303
                assert (await copy.get("/admin/ui")).status_code == 200
