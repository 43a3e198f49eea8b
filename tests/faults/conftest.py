"""Fixtures and helpers of the fault suite: real processes, real signals, a misbehaving upstream.

The demo upstream and the gateway processes are the ones of `tests/e2e` (re-exported here, so
both suites start them the same way). `RawUpstream` is an HTTP/1.1 server on a plain socket in the
test process, for the answers no well-behaved server gives: a connection closed or reset after the
request was read, half a response, garbage. It counts every request it read, with its
`Idempotency-Key`, so a test can say how many times the "side effect" really happened.
"""

from __future__ import annotations

import contextlib
import json
import socket
import struct
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest

from tests.e2e.conftest import (
    PROBLEM,
    DemoUpstream,
    GatewayProcess,
    client,
    module_dir,
    parse_head,
    problem_name,
    row,
    upstream,
    wait_for_state,
)

__all__ = [
    "PROBLEM",
    "DemoUpstream",
    "GatewayProcess",
    "RawUpstream",
    "client",
    "module_dir",
    "problem_name",
    "row",
    "upstream",
    "wait_for_state",
]

ADMIN_TOKEN = "faults-admin-token"
# A header value that colours a terminal red and sets its title: what `control-bytes` sends.
ESCAPES = b"\x1b[31mred\x1b[0m\x1b]0;t\x07"


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: bytes
    connection: int = 0  # which connection it came on: equal values, one reused connection

    @property
    def key(self) -> str | None:
        return self.headers.get("idempotency-key")


@dataclass
class RawUpstream:
    """A one-thread-per-connection HTTP/1.1 server whose behaviour is chosen by the path's last
    segment:

    - `answer`: 201 with a small JSON body; then calls `after_answer` (if set) at once
    - `error500`: 500 with a JSON body
    - `close`: reads the request, then closes the connection without a byte of answer (FIN)
    - `reset`: reads the request, then resets the connection (RST, SO_LINGER 0)
    - `half`: sends the status line, headers and 10 of the 100 promised body bytes, then closes
    - `garbage`: answers bytes that are not HTTP, then closes
    - `kept`: 201 with a small JSON body, keeping the connection open for the next request
    - `no-content-with-body`: 204 that announces and sends a 12-byte body in the same write (a
      framing no HTTP/1.1 client can read: a 204 has no body), keeping the connection open
    - `control-bytes`: 201 with a small JSON body and a header whose value holds terminal escapes
      and a BEL (`X-Esc`), which an HTTP parser lets through and no HTTP/1.1 server may send on
    - `no-content-then-body`: the head of that 204 alone; its 12 bytes are sent just before the
      answer to the next request on the same connection, as a slow broken server would
    """

    received: list[Received] = field(default_factory=list)
    after_answer: Callable[[Received], None] | None = None

    def __post_init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0), backlog=256)
        self.port: int = self._listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._lock = threading.Lock()
        self._closing = False
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def requests(self, key: str) -> list[Received]:
        with self._lock:
            return [request for request in self.received if request.key == key]

    def close(self) -> None:
        self._closing = True
        self._listener.close()
        self._thread.join(5)

    def _accept(self) -> None:
        while not self._closing:
            try:
                connection, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(connection,), daemon=True).start()

    def _serve(self, connection: socket.socket) -> None:
        connection_id = id(connection)
        buffered = b""
        pending = b""  # bytes a broken answer still owes this connection
        with connection:
            while True:
                parsed = _read_request(connection, buffered)
                if parsed is None:
                    return
                request, buffered = parsed
                request.connection = connection_id
                with self._lock:
                    self.received.append(request)
                behaviour = request.path.rstrip("/").rsplit("/", 1)[-1]
                if behaviour == "kept":
                    connection.sendall(pending + _response(201, {"performed": request.key}, True))
                    pending = b""
                    continue
                if behaviour in ("no-content-with-body", "no-content-then-body"):
                    head = b"HTTP/1.1 204 No Content\r\nContent-Length: 12\r\n\r\n"
                    junk = b'{"id":"abc"}'
                    if behaviour == "no-content-with-body":
                        connection.sendall(pending + head + junk)
                    else:
                        connection.sendall(pending + head)
                        pending = junk
                    continue
                if behaviour == "answer":
                    connection.sendall(_response(201, {"performed": request.key}))
                    if self.after_answer is not None:
                        self.after_answer(request)
                elif behaviour == "control-bytes":
                    connection.sendall(
                        _response(201, {"performed": request.key}).replace(
                            b"\r\n\r\n", b"\r\nX-Esc: " + ESCAPES + b"\r\nX-Kept: yes\r\n\r\n", 1
                        )
                    )
                elif behaviour == "error500":
                    connection.sendall(_response(500, {"error": "the upstream broke"}))
                elif behaviour == "reset":
                    linger = struct.pack("ii", 1, 0)
                    connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger)
                elif behaviour == "half":
                    connection.sendall(
                        b"HTTP/1.1 201 Created\r\nContent-Type: application/json\r\n"
                        b"Content-Length: 100\r\n\r\n" + b'{"partial'
                    )
                elif behaviour == "garbage":
                    connection.sendall(b"this is not HTTP at all\r\n\r\n")
                # `close` and everything else: leave the `with`, which closes the connection.
                return


def _read_request(connection: socket.socket, data: bytes) -> tuple[Received, bytes] | None:
    """The next request on `connection`, whose first bytes may already be in `data`; and the
    bytes read past its end."""
    connection.settimeout(10)
    with contextlib.suppress(OSError):
        while b"\r\n\r\n" not in data:
            chunk = connection.recv(65536)
            if not chunk:
                return None
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        request_line, headers = parse_head(head)
        length = int(headers.get("content-length", "0"))
        while len(body) < length:
            chunk = connection.recv(65536)
            if not chunk:
                return None
            body += chunk
        return Received(request_line.split()[1], headers, body[:length]), body[length:]
    return None


def _response(status: int, document: object, keep_alive: bool = False) -> bytes:
    body = json.dumps(document).encode()
    reason = {201: "Created", 500: "Internal Server Error"}[status]
    connection = "" if keep_alive else "Connection: close\r\n"
    return (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n{connection}\r\n"
    ).encode() + body


def admin_get(port: int, path: str, header: bytes) -> bytes:
    """A GET of the admin port with one raw header line (any bytes), and the whole answer,
    read until the gateway closes the connection."""
    request = (
        b"GET "
        + path.encode()
        + b" HTTP/1.1\r\nHost: admin\r\nConnection: close\r\n"
        + header
        + b"\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return answer


@pytest.fixture(scope="module")
def raw_upstream() -> Iterator[RawUpstream]:
    server = RawUpstream()
    try:
        yield server
    finally:
        server.close()
