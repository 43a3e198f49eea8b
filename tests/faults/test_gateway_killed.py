"""A gateway SIGKILLed in the middle of a forward, and what every later retry gets.

Two moments of death, each under `on_unknown: reject` and `on_unknown: forward`:

- *before the upstream answers*: the demo upstream has performed the action (it records it first,
  then sleeps `X-Demo-Delay`), the gateway is killed while it waits for the answer;
- *after the upstream answered, before the store was written*: the raw upstream kills the gateway
  from its own thread the moment `sendall` of its complete answer returns. The gateway then needs
  to be scheduled, read and parse the answer and send the `complete` statement, which takes far
  longer than the `kill(2)` that is already on its way. The test then checks that the row is
  still `in_progress`, so the store was not written; when the kill came too late (the row says
  `completed`), it tries again with a new gateway, up to `ATTEMPTS` times, and reports how many it
  took. What it cannot tell is whether the dead gateway had read the answer into its memory: only
  that the upstream had sent all of it and the store never saw it, which is the case that
  matters.

In each case the key stays `in_progress` until its lease runs out (retries: 409
`request-in-progress`), then reads `unknown` (retries: 409 `outcome-unknown`, never forwarded)
under `reject`, or is forwarded once more with the same `Idempotency-Key` under `forward`. An
operator's resolution (`POST /admin/keys/{id}/resolve`) settles it with a given answer or frees it.

Already covered in `tests/e2e`, not repeated: the lease running out (`test_proxy.py::
test_a_dead_gateways_lease_runs_out_and_the_key_turns_unknown`), SIGTERM draining in-flight
requests (`test_proxy.py::test_sigterm_finishes_and_stores_requests_in_flight`), resolving an
`unknown` key after a timeout (`test_admin.py::test_resolving_an_unknown_key_*`,
`test_releasing_an_unknown_key_lets_the_next_retry_through`).
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest

from tests.faults.conftest import (
    ADMIN_TOKEN,
    DemoUpstream,
    GatewayProcess,
    RawUpstream,
    problem_name,
    row,
    wait_for_state,
)
from tests.helpers import new_key

pytestmark = pytest.mark.slow

TIMEOUT, LEASE = 1.0, 2.0
ATTEMPTS = 5


def route_config(demo: str, raw: str) -> list[dict[str, Any]]:
    timing = {"timeout": f"{TIMEOUT}s", "lease": f"{LEASE}s", "strip_prefix": True}
    return [
        {"name": "demo-reject", "match": "/demo-reject", "upstream": demo, **timing},
        {
            "name": "demo-forward",
            "match": "/demo-forward",
            "upstream": demo,
            "on_unknown": "forward",
            **timing,
        },
        {"name": "raw-reject", "match": "/raw-reject", "upstream": raw, **timing},
        {
            "name": "raw-forward",
            "match": "/raw-forward",
            "upstream": raw,
            "on_unknown": "forward",
            **timing,
        },
    ]


@pytest.fixture(scope="module")
def routes(upstream: DemoUpstream, raw_upstream: RawUpstream) -> list[dict[str, Any]]:
    return route_config(upstream.url, raw_upstream.url)


@pytest.fixture(scope="module")
def survivor(
    module_dir: Path, database_url: str, routes: list[dict[str, Any]]
) -> Iterator[GatewayProcess]:
    """The gateway that stays up and answers the retries."""
    with GatewayProcess(
        module_dir, database_url, routes, name="survivor", admin_token=ADMIN_TOKEN
    ) as gateway:
        yield gateway


@pytest.fixture
async def client(survivor: GatewayProcess) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=survivor.url, timeout=30) as client:
        yield client


_doomed = iter(range(1000))


def doomed_gateway(
    module_dir: Path, database_url: str, routes: list[dict[str, Any]]
) -> GatewayProcess:
    return GatewayProcess(module_dir, database_url, routes, name=f"doomed-{next(_doomed)}")


async def killed_before_the_answer(
    gateway: GatewayProcess, upstream: DemoUpstream, db: asyncpg.Connection, path: str, key: str
) -> None:
    """Send through `gateway`, SIGKILL it once the demo upstream has performed the action and
    while it still holds the answer back."""
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as doomed:
        request = asyncio.create_task(
            doomed.post(
                path, json={"amount": 100}, headers={"Idempotency-Key": key, "X-Demo-Delay": "0.8"}
            )
        )
        for _ in range(200):
            if await asyncio.to_thread(upstream.actions, key):
                break
            await asyncio.sleep(0.01)
        gateway.process.signal(signal.SIGKILL)
        with pytest.raises(httpx.TransportError):
            await request
    assert gateway.process.wait() == -signal.SIGKILL
    stored = await row(db, key)
    assert stored is not None and stored["state"] == "in_progress"


async def killed_after_the_answer(
    module_dir: Path,
    database_url: str,
    routes: list[dict[str, Any]],
    raw_upstream: RawUpstream,
    db: asyncpg.Connection,
    path: str,
) -> str:
    """A key whose request the raw upstream answered in full, its gateway killed before the
    store was written. Returns the key."""
    for attempt in range(1, ATTEMPTS + 1):
        key = new_key()
        gateway = doomed_gateway(module_dir, database_url, routes)
        pid = gateway.process.pid

        def kill(request: Any, key: str = key, pid: int = pid) -> None:
            if request.key == key:
                os.kill(pid, signal.SIGKILL)

        raw_upstream.after_answer = kill
        try:
            async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as doomed:
                with pytest.raises(httpx.TransportError):
                    await doomed.post(path, json={"amount": 100}, headers={"Idempotency-Key": key})
        finally:
            raw_upstream.after_answer = None
            gateway.stop()
        assert gateway.process.popen.returncode == -signal.SIGKILL
        assert len(raw_upstream.requests(key)) == 1  # the upstream answered it, once
        stored = await row(db, key)
        assert stored is not None
        print(f"kill after the answer, attempt {attempt}: the row is {stored['state']}")  # noqa: T201 - the figures the fault suite reports (pytest -s)
        if stored["state"] == "in_progress":
            return key
    raise AssertionError(f"the kill never landed before the store write in {ATTEMPTS} attempts")


async def wait_out_the_lease(client: httpx.AsyncClient, path: str, key: str) -> httpx.Response:
    """Retry until the lease has run out; every answer before that is 409 in progress."""
    for _ in range(int(LEASE / 0.1) + 40):
        response = await client.post(path, json={"amount": 100}, headers={"Idempotency-Key": key})
        if not (response.status_code == 409 and problem_name(response) == "request-in-progress"):
            return response
        assert response.headers["retry-after"]
        await asyncio.sleep(0.1)
    raise AssertionError("the lease never ran out")


async def test_killed_before_the_answer_reject_then_settled_by_an_operator(
    module_dir: Path,
    database_url: str,
    routes: list[dict[str, Any]],
    survivor: GatewayProcess,
    client: httpx.AsyncClient,
    upstream: DemoUpstream,
    db: asyncpg.Connection,
) -> None:
    key, path = new_key(), "/demo-reject/charges"
    with doomed_gateway(module_dir, database_url, routes) as gateway:
        await killed_before_the_answer(gateway, upstream, db, path, key)
    unknown = await wait_out_the_lease(client, path, key)
    assert unknown.status_code == 409 and problem_name(unknown) == "outcome-unknown"
    assert "retry-after" not in unknown.headers
    for _ in range(3):  # never forwarded again, however often it is retried
        again = await client.post(path, json={"amount": 100}, headers={"Idempotency-Key": key})
        assert again.status_code == 409 and problem_name(again) == "outcome-unknown"
    assert len(upstream.actions(key)) == 1

    async with survivor.admin_client() as admin:
        (record,) = (await admin.get("/admin/keys", params={"key": key})).json()["records"]
        assert record["state"] == "unknown"
        settled = await admin.post(
            f"/admin/keys/{record['id']}/resolve",
            json={
                "action": "complete",
                "status": 201,
                "body": '{"id": "ch_settled"}',
                "headers": [["Content-Type", "application/json"]],
            },
        )
        assert settled.status_code == 200
    replay = await client.post(path, json={"amount": 100}, headers={"Idempotency-Key": key})
    assert replay.status_code == 201 and replay.headers["idempotent-replayed"] == "true"
    assert replay.json() == {"id": "ch_settled"}
    assert len(upstream.actions(key)) == 1


async def test_killed_before_the_answer_forward_sends_it_again_with_the_same_key(
    module_dir: Path,
    database_url: str,
    routes: list[dict[str, Any]],
    client: httpx.AsyncClient,
    upstream: DemoUpstream,
    db: asyncpg.Connection,
) -> None:
    key, path = new_key(), "/demo-forward/charges"
    with doomed_gateway(module_dir, database_url, routes) as gateway:
        await killed_before_the_answer(gateway, upstream, db, path, key)
    forwarded = await wait_out_the_lease(client, path, key)
    assert forwarded.status_code == 201 and "idempotent-replayed" not in forwarded.headers
    replay = await client.post(path, json={"amount": 100}, headers={"Idempotency-Key": key})
    assert replay.headers["idempotent-replayed"] == "true" and replay.content == forwarded.content
    assert [action["idempotency_key"] for action in upstream.actions(key)] == [key, key]
    stored = await row(db, key)
    assert stored is not None and stored["state"] == "completed"


async def test_killed_after_the_answer_reject_then_released_by_an_operator(
    module_dir: Path,
    database_url: str,
    routes: list[dict[str, Any]],
    survivor: GatewayProcess,
    client: httpx.AsyncClient,
    raw_upstream: RawUpstream,
    db: asyncpg.Connection,
) -> None:
    path = "/raw-reject/answer"
    key = await killed_after_the_answer(module_dir, database_url, routes, raw_upstream, db, path)
    unknown = await wait_out_the_lease(client, path, key)
    assert unknown.status_code == 409 and problem_name(unknown) == "outcome-unknown"
    assert len(raw_upstream.requests(key)) == 1  # not forwarded a second time

    async with survivor.admin_client() as admin:
        (record,) = (await admin.get("/admin/keys", params={"key": key})).json()["records"]
        assert record["state"] == "unknown"
        released = await admin.post(
            f"/admin/keys/{record['id']}/resolve", json={"action": "release"}
        )
        assert released.status_code == 200
    assert await row(db, key) is None
    retry = await client.post(path, json={"amount": 100}, headers={"Idempotency-Key": key})
    assert retry.status_code == 201 and "idempotent-replayed" not in retry.headers
    # The operator said "it did not happen", so the retry was forwarded: the second request.
    assert len(raw_upstream.requests(key)) == 2


async def test_killed_after_the_answer_forward_sends_it_again_with_the_same_key(
    module_dir: Path,
    database_url: str,
    routes: list[dict[str, Any]],
    client: httpx.AsyncClient,
    raw_upstream: RawUpstream,
    db: asyncpg.Connection,
) -> None:
    path = "/raw-forward/answer"
    key = await killed_after_the_answer(module_dir, database_url, routes, raw_upstream, db, path)
    forwarded = await wait_out_the_lease(client, path, key)
    assert forwarded.status_code == 201 and "idempotent-replayed" not in forwarded.headers
    received = raw_upstream.requests(key)
    assert len(received) == 2
    assert {request.key for request in received} == {key}  # the same key, so it can dedupe
    assert received[0].body == received[1].body
    await wait_for_state(db, key, "completed")
    replay = await client.post(path, json={"amount": 100}, headers={"Idempotency-Key": key})
    assert replay.headers["idempotent-replayed"] == "true"
    assert len(raw_upstream.requests(key)) == 2
