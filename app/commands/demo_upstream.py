"""`oncegate demo-upstream`: a small fake email, ticket and payment service.

- `POST /emails`, `/tickets`, `/charges` perform an action (it is recorded at once) and answer
  201 with a JSON receipt, a `Location` and an `ETag`. So do two endpoints of APIs that take
  their key elsewhere: `POST /payments` reads it from its JSON body's `idempotency_key` (as
  Square's does) and `POST /orders` from `PayPal-Request-Id` (as PayPal's does). A trailing
  slash is ignored (`/charges/`).
- `GET /actions` lists every action really performed, with the key it came with
  (`?key=K` filters); `DELETE /actions` forgets them all.
- Any path under `/echo` answers 200 with what it received: method, path, query, headers, body.
- Any path under `/sink` reads the request whole and answers 201 `{}`, performing and keeping
  nothing: a far end for large bodies, which `/echo` and the actions would send back or parse.
- Query parameters make a call misbehave: `?delay=SECONDS` answers late (the action is performed
  first, as a slow real service would), `?status=CODE` answers that status (an error status
  performs nothing), `?size=BYTES` pads the receipt to that many bytes, and
  `?header=Name:Value` (repeatable) adds a response header. The headers `X-Demo-Delay` and
  `X-Demo-Status` do what `delay` and `status` do without changing the request's fingerprint at
  the gateway, so a retry of "the same request" can behave differently.

Action ids are unique across restarts: each start draws a token of its own (`em_3fa9c2d1_000001`),
so an answer a gateway stored before a restart never names an id a new action gets.

A raw ASGI application with no framework: the demo upstream is also the benchmark's far end, and
it should cost as little as possible.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import secrets
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any
from urllib.parse import parse_qsl

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

KINDS = {
    "/emails": "email",
    "/tickets": "ticket",
    "/charges": "charge",
    "/payments": "payment",
    "/orders": "order",
}
PREFIXES = {"email": "em", "ticket": "tk", "charge": "ch", "payment": "py", "order": "or"}
# Where each kind's idempotency key is: a header, or (None) the JSON body's `idempotency_key`.
KEY_HEADERS = {"payment": None, "order": "paypal-request-id"}
_NO_CONTENT = frozenset({204, 304})


class DemoUpstream:
    def __init__(self) -> None:
        self.actions: list[dict[str, Any]] = []
        self._ids = itertools.count(1)
        # Nothing is kept across restarts, so ids are unique per start instead: a stored answer
        # from an earlier start names an id no new action of this one can have.
        self._start = secrets.token_hex(4)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        body = await read_body(receive)
        method, path = scope["method"], scope["path"]
        query = parse_qsl(scope["query_string"].decode("latin-1"), keep_blank_values=True)
        params = dict(query)
        headers = {
            name.decode("latin-1"): value.decode("latin-1") for name, value in scope["headers"]
        }
        if path.startswith("/sink"):
            await respond(send, 201, {})
            return
        if path.startswith("/echo"):
            received = {
                "method": method,
                "path": path,
                "query": scope["query_string"].decode("latin-1"),
                "headers": [
                    [n.decode("latin-1"), v.decode("latin-1")] for n, v in scope["headers"]
                ],
                "body": body.decode("utf-8", "replace"),
            }
            await respond(send, 200, received, extra=_extra_headers(query))
            return
        if path == "/actions":
            if method == "DELETE":
                self.actions.clear()
                await respond(send, 204, None)
                return
            actions = self.actions
            if "key" in params:
                actions = [
                    action for action in actions if action["idempotency_key"] == params["key"]
                ]
            await respond(send, 200, {"actions": actions})
            return
        kind = KINDS.get(path.rstrip("/") or "/")
        if kind is None:
            await respond(send, 404, {"error": f"no such endpoint: {path}"})
            return
        if method != "POST":
            await respond(send, 405, {"error": f"{path} takes POST"}, extra=[("allow", "POST")])
            return
        try:
            status = int(headers.get("x-demo-status") or params.get("status", 201))
            delay = float(headers.get("x-demo-delay") or params.get("delay", 0))
            size = int(params.get("size", 0))
        except ValueError:
            await respond(send, 400, {"error": "status, delay and size take numbers"})
            return
        receipt: dict[str, Any] = {"status": status}
        if status < 400:
            receipt = self._perform(kind, path, headers, body)
        if size:
            receipt["padding"] = ""
            receipt["padding"] = "x" * max(0, size - len(json.dumps(receipt)))
        if delay:
            await asyncio.sleep(delay)
        extra = _extra_headers(query)
        if status < 400:
            extra += [("location", f"/actions/{receipt['id']}"), ("etag", f'"{receipt["id"]}"')]
        await respond(send, status, receipt, extra=extra)

    def _perform(
        self, kind: str, path: str, headers: dict[str, str], body: bytes
    ) -> dict[str, Any]:
        action_id = f"{PREFIXES[kind]}_{self._start}_{next(self._ids):06d}"
        try:
            request = json.loads(body) if body else None
        except (ValueError, RecursionError):  # not JSON, or nested past Python's stack
            request = body.decode("utf-8", "replace")
        key_header = KEY_HEADERS.get(kind, "idempotency-key")
        if key_header is not None:
            key = headers.get(key_header)
        else:
            key = request.get("idempotency_key") if isinstance(request, dict) else None
        action = {
            "id": action_id,
            "kind": kind,
            "path": path,
            "idempotency_key": key,
            "request": request,
            "performed_at": time.time(),
        }
        self.actions.append(action)
        return dict(action)


def _extra_headers(query: list[tuple[str, str]]) -> list[tuple[str, str]]:
    return [
        (name.strip().lower(), value.strip())
        for key, spec in query
        if key == "header" and ":" in spec
        for name, value in [spec.split(":", 1)]
    ]


async def read_body(receive: Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            break
    return b"".join(chunks)


async def respond(
    send: Send, status: int, document: object, extra: list[tuple[str, str]] | None = None
) -> None:
    if status in _NO_CONTENT:
        document = None  # these answers have no body (RFC 9112 §6.3), whatever was asked
    body = b"" if document is None else json.dumps(document).encode()
    headers = [] if status in _NO_CONTENT else [(b"content-length", str(len(body)).encode())]
    if document is not None:
        headers.append((b"content-type", b"application/json"))
    headers += [(name.encode("latin-1"), value.encode("latin-1")) for name, value in extra or []]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
