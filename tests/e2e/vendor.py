"""A fake vendor for the SDK recipes (docs/recipes.md): one process that answers, under
`/<vendor>/...`, the paths the nine vendors' SDKs call, in shapes their parsers accept, and
records every action it really performs, as the demo upstream does (`GET /actions`).

- A POST (or PUT, PATCH) to a path that ends in `token` answers an OAuth token, a new one on
  every call (`tok-1`, `tok-2`, ...), so a client that fetches one again sends another
  `Authorization`. It performs nothing.
- A POST to a path with a `search` segment answers an empty list. It performs nothing.
- Any other POST, PUT or PATCH performs an action: recorded with the request's headers and body,
  answered 201 with an id (`<vendor>_<n>`) under each name an SDK reads it from (`id`, `sid`,
  `pspReference`), inside the envelope the vendor's SDK expects (GoCardless `{"payments": ...}`,
  Square `{"payment": ...}`).
- `X-Demo-Delay: SECONDS`, or `vendor-delay-SECONDS` anywhere in the body (for SDKs that send no
  header of the caller's), answers that late, the action performed first (as the demo upstream).

Run as `python -m tests.e2e.vendor --port N`. It reads and answers HTTP as the demo upstream does
(its `read_body` and `respond`).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import re
import time
from typing import Any
from urllib.parse import parse_qsl

import uvicorn

from oncegate.commands.demo_upstream import Receive, Scope, Send, read_body, respond

DELAY = re.compile(rb"vendor-delay-([0-9.]+)")
# Vendors whose SDK reads the resource from an envelope named after it.
ENVELOPES = {"gocardless": "plural", "square": "singular"}


class FakeVendor:
    def __init__(self) -> None:
        self.actions: list[dict[str, Any]] = []
        self._ids = itertools.count(1)
        self._tokens = itertools.count(1)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        body = await read_body(receive)
        method, path = scope["method"], scope["path"]
        headers = {name.decode("latin-1"): value.decode("latin-1")
                   for name, value in scope["headers"]}  # fmt: skip
        if path == "/actions":
            await respond(send, 200, {"actions": self.actions})
            return
        vendor, _, rest = path.lstrip("/").partition("/")
        segments = [segment for segment in rest.split("/") if segment]
        if method == "GET" or not segments:
            await respond(send, 404, {"message": f"no such resource: {path}"})
            return
        if segments[-1] == "token":
            token = f"tok-{next(self._tokens)}"
            await respond(send, 200, {"access_token": token, "token_type": "Bearer",
                                       "expires_in": 32400, "scope": "all"})  # fmt: skip
            return
        if "search" in segments:
            await respond(send, 200, {"data": [], "items": [], "orders": [], "payments": []})
            return
        resource = self._perform(vendor, method, path, headers, body)
        asked = DELAY.search(body)
        delay = float(headers.get("x-demo-delay") or (asked.group(1) if asked else 0))
        if delay:
            await asyncio.sleep(delay)
        await respond(send, 201, _enveloped(vendor, segments, resource))

    def _perform(
        self, vendor: str, method: str, path: str, headers: dict[str, str], body: bytes
    ) -> dict[str, Any]:
        action_id = f"{vendor}_{next(self._ids):06d}"
        try:
            request: object = json.loads(body) if body else None
        except ValueError:
            request = dict(parse_qsl(body.decode("latin-1"), keep_blank_values=True))
        self.actions.append(
            {
                "id": action_id,
                "vendor": vendor,
                "method": method,
                "path": path,
                "headers": headers,
                "request": request,
                "performed_at": time.time(),
            }
        )
        return {"id": action_id, "sid": action_id, "pspReference": action_id,
                "object": vendor, "status": "created", "request": request}  # fmt: skip


def _enveloped(vendor: str, segments: list[str], resource: dict[str, Any]) -> dict[str, Any]:
    """The resource as the vendor's SDK reads it: bare, or under its collection's name."""
    envelope = ENVELOPES.get(vendor)
    if envelope is None:
        return resource
    collection = next(segment for segment in reversed(segments) if not segment[0].isupper())
    name = collection if envelope == "plural" else collection.removesuffix("s")
    return {name: resource}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    port = parser.parse_args().port
    uvicorn.run(FakeVendor(), host="127.0.0.1", port=port, log_level="warning", lifespan="off")


if __name__ == "__main__":
    main()
