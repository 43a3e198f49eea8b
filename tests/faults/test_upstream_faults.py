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

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import httpx
import pytest

from tests.faults.conftest import ESCAPES, GatewayProcess, RawUpstream, problem_name, row
from tests.helpers import new_key


@pytest.fixture(scope="module")
def gateway(
    module_dir: Path, database_url: str, raw_upstream: RawUpstream
) -> Iterator[GatewayProcess]:
    # No test here waits for the timeout (tests/e2e/test_proxy.py does): long enough that the
    # raw upstream, in the test's own process, answers in time on a machine as busy as CI's.
    routes = [{"name": "raw", "match": "/", "upstream": raw_upstream.url, "timeout": "30s"}]
    with GatewayProcess(module_dir, database_url, routes) as process:
        yield process


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


async def test_a_header_no_answer_may_carry_is_left_out_first_time_and_on_every_replay(
    gateway: GatewayProcess,
    client: httpx.AsyncClient,
    raw_upstream: RawUpstream,
    db: asyncpg.Connection,
) -> None:
    key = new_key()
    answers = [
        await client.post("/control-bytes", json={"n": 1}, headers={"Idempotency-Key": key})
        for _ in range(3)
    ]
    for number, answer in enumerate(answers):
        assert answer.status_code == 201
        assert answer.json() == {"performed": key}
        assert "x-esc" not in answer.headers and answer.headers["x-kept"] == "yes"
        assert answer.headers["oncegate-dropped-headers"] == "X-Esc"
        assert ("idempotent-replayed" in answer.headers) == (number > 0)
    assert len(raw_upstream.requests(key)) == 1
    # The store keeps the answer as received; it is the relaying that leaves the header out.
    stored = await row(db, key)
    assert stored is not None and stored["state"] == "completed"
    assert ["X-Esc", ESCAPES.decode("latin-1")] in json.loads(stored["response_headers"])
    log = gateway.process.output()
    assert log.count("Oncegate-Dropped-Headers") == 3 and "'X-Esc'" in log


async def test_a_no_content_answer_whose_body_comes_late_does_not_spoil_the_next_request(
    client: httpx.AsyncClient, raw_upstream: RawUpstream, db: asyncpg.Connection
) -> None:
    # The 204's 12 announced bytes reach the gateway just before the next answer on the same
    # connection; a pooled connection would read them as the start of that answer.
    first, second = new_key(), new_key()
    answer = await client.post("/no-content-then-body", json={}, headers={"Idempotency-Key": first})
    assert answer.status_code == 204 and answer.content == b""
    assert (await row(db, first))["state"] == "completed"
    after = await client.post("/kept", json={}, headers={"Idempotency-Key": second})
    assert after.status_code == 201 and after.json() == {"performed": second}
    assert (await row(db, second))["state"] == "completed"
    [no_content], [kept] = raw_upstream.requests(first), raw_upstream.requests(second)
    assert no_content.connection != kept.connection  # never reused after such an answer


async def test_a_no_content_answer_with_a_body_in_the_same_packet_is_an_unreadable_answer(
    client: httpx.AsyncClient, raw_upstream: RawUpstream, db: asyncpg.Connection
) -> None:
    # The upstream performed the request, but what came back cannot be read as HTTP: the key
    # turns unknown, as for any broken answer; and the connection goes with it.
    broken, after = new_key(), new_key()
    answer = await client.post(
        "/no-content-with-body", json={}, headers={"Idempotency-Key": broken}
    )
    assert answer.status_code == 502 and problem_name(answer) == "outcome-unknown"
    assert (await row(db, broken))["state"] == "unknown"
    following = await client.post("/kept", json={}, headers={"Idempotency-Key": after})
    assert following.status_code == 201
    assert raw_upstream.requests(broken)[0].connection != raw_upstream.requests(after)[0].connection


@pytest.mark.slow  # the same breakage as the test above, under load: `make test-all`
async def test_under_load_broken_no_content_answers_turn_no_other_key_unknown(
    client: httpx.AsyncClient, raw_upstream: RawUpstream, db: asyncpg.Connection
) -> None:
    # 400 requests, 32 at a time, one in four answered by a late-bodied 204 on a kept-alive
    # connection: every other request gets its own answer and its key completes.
    semaphore = asyncio.Semaphore(32)
    keys = [new_key() for _ in range(400)]

    async def send(index: int, key: str) -> tuple[str, int]:
        path = "/no-content-then-body" if index % 4 == 0 else "/kept"
        async with semaphore:
            response = await client.post(path, json={"n": index}, headers={"Idempotency-Key": key})
        return path, response.status_code

    results = await asyncio.gather(*(send(index, key) for index, key in enumerate(keys)))
    assert {status for path, status in results if path == "/kept"} == {201}
    assert {status for path, status in results if path != "/kept"} == {204}
    states = await db.fetch(
        "SELECT state, count(*) AS n FROM oncegate_keys WHERE key = ANY($1::text[]) GROUP BY 1",
        keys,
    )
    assert {record["state"]: record["n"] for record in states} == {"completed": 400}
