"""Grammar-based fuzzing at volume: hypothesis draws whole requests (request line, path, query,
headers, `Idempotency-Key` values, bodies and their framing) and sends each on a raw socket to a
running gateway, counting every one.

Run as `python -m tests.soak.fuzz --port P --requests N --seed S --out FILE`. It writes one JSON
line per request sent: the status, whether the gateway refused it, the key it stored it under
(when it accepted it), and a violation, if any:

- a 5xx that is not one of the contract's problems with its status;
- a hang: no answer, and no close, within `PATIENCE` seconds.

Whether a refused request left a row is checked afterwards against the key table
(`driver.check_fuzz`), as the driver owns the database. The request grammar extends the fault
suite's (`tests/faults/test_fuzz.py`) with framings: chunked bodies, HTTP/1.0, odd header case,
and path forms that normalization must fold (dot segments, doubled slashes, percent-encoding).
"""

from __future__ import annotations

import argparse
import json
import socket
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

from oncegate.kernel import keys
from oncegate.model import errors
from tests.e2e.conftest import parse_head
from tests.faults.test_fuzz import requests
from tests.soak.checker import CONTRACT_PROBLEMS, PROBLEM, PROBLEM_PREFIX

# The gateway's refusals that come before any claim: such a request must leave no row.
REFUSALS = frozenset(
    {"missing-key", "invalid-key", "invalid-path", "body-too-large", "route-not-found",
     "invalid-header", "invalid-request", "unsupported-transfer-coding"}
)  # fmt: skip
# Far beyond the gateway's own bounds (its store gives up after 10 s): silence this long is a hang.
PATIENCE = 30.0

framings = st.sampled_from(["length", "chunked", "http/1.0", "lower-case"])
path_forms = st.sampled_from(["plain", "dot-segment", "double-slash", "percent"])


def shaped_path(route: str, tail: str, form: str) -> str:
    if form == "dot-segment":
        return f"/{route}/./x/../{tail}"
    if form == "double-slash":
        return f"//{route}//{tail}"
    if form == "percent":
        return "/" + "".join(f"%{ord(c):02x}" if c.isalpha() else c for c in route) + f"/{tail}"
    return f"/{route}/{tail}"


def encode(request: dict[str, Any], framing: str, form: str) -> bytes:
    query = "&".join(f"{name}={value}" for name, value in request["query"])
    path = shaped_path(request["route"], request["tail"], form) + (f"?{query}" if query else "")
    version = "HTTP/1.0" if framing == "http/1.0" else "HTTP/1.1"
    lines = [f"{request['method']} {path} {version}", "Host: gateway", "Connection: close"]
    lines += [f"Idempotency-Key: {value}" for value in request["keys"]]
    if request["content_type"] is not None:
        lines.append(f"Content-Type: {request['content_type']}")
    lines += [f"{name}: {value}" for name, value in request["extra"]]
    body: bytes = request["body"]
    if framing == "chunked":
        lines.append("Transfer-Encoding: chunked")
        middle = len(body) // 2
        parts = [part for part in (body[:middle], body[middle:]) if part]
        payload = b"".join(f"{len(part):x}\r\n".encode() + part + b"\r\n" for part in parts)
        payload += b"0\r\n\r\n"
    else:
        lines.append(f"{'content-length' if framing == 'lower-case' else 'Content-Length'}: "
                     f"{len(body)}")  # fmt: skip
        payload = body
    return "\r\n".join(lines).encode("latin-1") + b"\r\n\r\n" + payload


def exchange(port: int, raw: bytes) -> tuple[int, dict[str, str], bytes] | None:
    """Send, read until the gateway closes; None if it neither answered nor closed in time."""
    with socket.create_connection(("127.0.0.1", port), timeout=PATIENCE) as sock:
        try:
            sock.sendall(raw)
            received = b""
            while chunk := sock.recv(65536):
                received += chunk
        except TimeoutError:
            return None
        except ConnectionError:
            pass  # the parser refused and reset: an answer of sorts, and no hang
    if not received:
        return 0, {}, b""
    head, _, body = received.partition(b"\r\n\r\n")
    status_line, headers = parse_head(head)
    return int(status_line.split()[1]), headers, body


def stored_key(values: list[str]) -> str | None:
    """The key the gateway stores for these header lines, as its parser will see them."""
    try:
        return keys.parse([value.strip(" \t") for value in values])
    except errors.InvalidKey:
        return None


def refused(status: int, headers: dict[str, str], body: bytes) -> bool:
    """Refused before a claim: one of `REFUSALS`, the HTTP parser's own 400, or a close."""
    if status == 0:
        return True
    if headers.get("content-type") == PROBLEM:
        try:
            name = str(json.loads(body).get("type", "")).removeprefix(PROBLEM_PREFIX)
        except (ValueError, AttributeError):
            return False
        return name in REFUSALS
    return status == 400 and "idempotent-replayed" not in headers and "etag" not in headers


def verdict(status: int, headers: dict[str, str], body: bytes) -> str | None:
    if status < 500:
        return None
    if headers.get("content-type") == PROBLEM:
        try:
            document = json.loads(body)
        except ValueError:
            document = {}
        name = str(document.get("type", "")).removeprefix(PROBLEM_PREFIX)
        if status in CONTRACT_PROBLEMS.get(name, frozenset()):
            return None
    return f"{status} outside the contract: {body[:200]!r}"


def run(port: int, count: int, seed_value: int, out: Path) -> None:
    results = out.open("w")

    @seed(seed_value)
    @settings(
        max_examples=count,
        database=None,
        deadline=None,
        phases=[Phase.generate],  # every example is a request to send, none a failure to shrink
        suppress_health_check=list(HealthCheck),
    )
    @given(request=requests, framing=framings, form=path_forms)
    def one(request: dict[str, Any], framing: str, form: str) -> None:
        answer = exchange(port, encode(request, framing, form))
        if answer is None:
            hang = f"hang: no answer in {PATIENCE:g}s to {request!r:.300}"
            line = {"status": None, "refused": True, "key": None, "violation": hang}
        else:
            status, headers, body = answer
            refusal = refused(status, headers, body)
            line = {"status": status, "refused": refusal,
                    "key": None if refusal else stored_key(request["keys"]),
                    "violation": verdict(status, headers, body)}  # fmt: skip
        results.write(json.dumps(line) + "\n")
        results.flush()

    try:
        one()
    finally:
        results.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--requests", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)
    options = parser.parse_args()
    run(options.port, options.requests, options.seed, Path(options.out))
