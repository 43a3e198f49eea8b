"""An upstream that breaks after it read the request, or answers 500.

The raw upstream reads each request in full (so the "side effect" happened: it is counted), then
closes the connection without answering, resets it, sends half an answer, or sends garbage. In
every case the first caller gets 502 `outcome-unknown`, the key turns `unknown`, and retries get
409 `outcome-unknown` and are never forwarded. A 500 is an answer like any other (it is not in the
default `release_statuses`): stored and replayed, and the upstream called once.

Already covered in `tests/e2e/test_proxy.py`, not repeated: refused connections
(`test_refused_connection_releases_the_key`), an answer slower than the timeout
(`test_a_timeout_after_sending_makes_the_key_unknown`, 504), 429/503 releasing the key
(`test_a_release_status_frees_the_key`), a client hanging up mid-flight
(`test_a_client_that_hangs_up_does_not_cancel_the_forward`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import httpx
import pytest

from tests.faults.conftest import Gateway, RawUpstream, new_key, problem_name, row


@pytest.fixture(scope="module")
def gateway(module_dir: Path, database_url: str, raw_upstream: RawUpstream) -> Iterator[Gateway]:
    routes = [{"name": "raw", "match": "/", "upstream": raw_upstream.url, "timeout": "2s"}]
    process = Gateway(module_dir, database_url, routes)
    try:
        yield process
    finally:
        process.stop()


@pytest.mark.parametrize("behaviour", ["close", "reset", "half", "garbage"])
async def test_a_broken_answer_after_the_request_was_read_makes_the_key_unknown(
    client: httpx.AsyncClient, raw_upstream: RawUpstream, db: asyncpg.Connection, behaviour: str
) -> None:
    key = new_key()
    first = await client.post(f"/{behaviour}", json={"n": 1}, headers={"Idempotency-Key": key})
    assert first.status_code == 502
    assert problem_name(first) == "outcome-unknown"
    stored = await row(db, key)
    assert stored is not None and stored["state"] == "unknown"
    for _ in range(2):
        retry = await client.post(f"/{behaviour}", json={"n": 1}, headers={"Idempotency-Key": key})
        assert retry.status_code == 409 and problem_name(retry) == "outcome-unknown"
        assert "retry-after" not in retry.headers
    assert len(raw_upstream.requests(key)) == 1


async def test_a_500_is_stored_and_replayed(
    client: httpx.AsyncClient, raw_upstream: RawUpstream, db: asyncpg.Connection
) -> None:
    key = new_key()
    first = await client.post("/error500", json={"n": 1}, headers={"Idempotency-Key": key})
    assert first.status_code == 500
    assert first.json() == {"error": "the upstream broke"}  # the upstream's, not a problem
    stored = await row(db, key)
    assert stored is not None
    assert (stored["state"], stored["response_status"]) == ("completed", 500)
    assert json.loads(stored["response_body"]) == {"error": "the upstream broke"}
    replay = await client.post("/error500", json={"n": 1}, headers={"Idempotency-Key": key})
    assert replay.status_code == 500 and replay.headers["idempotent-replayed"] == "true"
    assert replay.content == first.content
    assert len(raw_upstream.requests(key)) == 1
