"""The admin port from outside (docs/security.md): what an unauthenticated or careless caller can
make the gateway do there, which shares its process with the proxy.

- No admin body is read before its sender is known, and none past its bound: the answer (401,
  413) comes while the client still has most of its body to send, so the gateway never held it.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from oncegate.http import ui
from tests.e2e.conftest import parse_head, prefix_route
from tests.faults.conftest import ADMIN_TOKEN, DemoUpstream, GatewayProcess

# The route stores answers up to this, so a resolution is bounded near 4/3 of it (base64).
STORED = 64 * 1024


@pytest.fixture(scope="module")
def gateway(
    module_dir: Path, database_url: str, upstream: DemoUpstream
) -> Iterator[GatewayProcess]:
    routes = [prefix_route("pay", upstream.url, max_stored_response=f"{STORED // 1024}KiB")]
    process = GatewayProcess(module_dir, database_url, routes, admin_token=ADMIN_TOKEN)
    try:
        yield process
    finally:
        process.stop()


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
