"""PostgreSQL stopped and restarted *under load*: the gateway fails closed, then heals by itself.

`WORKERS` clients send POSTs with fresh keys back to back (and retries of one completed key) for
the whole run: before the outage, while PostgreSQL is stopped (`pg_ctl stop -m fast`, which also
cuts the pool's connections), and after it is started again. Nothing restarts the gateway.

Counted from what the demo upstream really performed:
- every request answered 503 `store-unavailable` reached the upstream zero times (never forwarded
  unclaimed);
- every request answered 201 reached it exactly once;
- no other answer occurs;
- after the restart, once the first request passes, every later request succeeds, and every key
  refused during the outage is accepted when retried (nothing is lost).

The single-request version (no load) is `tests/e2e/test_store_down.py`.
"""

from __future__ import annotations

import asyncio
import collections
import time
import uuid
from pathlib import Path
from typing import Any

import asyncpg
import asyncpg.connection
import httpx
import pytest

from oncegate.kernel.sealing import plaintext
from oncegate.model import errors
from oncegate.model.answers import StoredAnswer
from oncegate.model.records import Claim
from oncegate.store.postgres import PostgresStore
from tests.e2e.test_store_down import server, start, stop
from tests.faults.conftest import DemoUpstream, GatewayProcess, problem_name

__all__ = ["server"]  # the fixture: PostgreSQL of this module's own


WORKERS = 30
# Kept under 5 s in all: the gateway's idle keep-alive connections to the demo upstream must not
# reach uvicorn's 5 s keep-alive timeout during the outage (see the 502 note below).
BEFORE, DOWN = 1.0, 2.0


async def retry(client: httpx.AsyncClient, key: str) -> httpx.Response:
    """What a client does after a 503: send the same request again."""
    return await client.post("/emails", json={"retry": True}, headers={"Idempotency-Key": key})


@pytest.mark.slow
async def test_postgres_stopped_and_restarted_under_load(
    server: Any, module_dir: Path, upstream: DemoUpstream
) -> None:
    route = {"name": "mail", "match": "/", "upstream": upstream.url}
    gateway = GatewayProcess(module_dir, server.get_uri(), [route])
    answers: list[tuple[str, int, str, float]] = []  # key, status, problem, time
    phase = {"name": "before"}
    stop_sending = asyncio.Event()
    # Idle connections are dropped well before the gateway's 5 s keep-alive timeout, so the
    # client never reuses one the gateway is closing at that very moment.
    limits = httpx.Limits(max_connections=WORKERS, keepalive_expiry=1)
    try:
        async with httpx.AsyncClient(base_url=gateway.url, timeout=30, limits=limits) as client:
            done = str(uuid.uuid4())
            assert (
                await client.post("/emails", json={}, headers={"Idempotency-Key": done})
            ).status_code == 201

            async def worker(number: int) -> None:
                while not stop_sending.is_set():
                    key = done if number == 0 else str(uuid.uuid4())
                    body = {} if key == done else {"worker": number}
                    try:
                        response = await client.post(
                            "/emails", json=body, headers={"Idempotency-Key": key}
                        )
                    except httpx.TransportError:
                        answers.append((key, 0, "no answer", time.monotonic()))
                        continue
                    problem = (
                        problem_name(response)
                        if response.headers.get("content-type") == "application/problem+json"
                        else ""
                    )
                    answers.append((key, response.status_code, problem, time.monotonic()))
                    if response.status_code == 503:
                        await asyncio.sleep(0.01)  # a client backing off a little

            workers = [asyncio.create_task(worker(number)) for number in range(WORKERS)]
            await asyncio.sleep(BEFORE)
            stopping = time.monotonic()
            await asyncio.to_thread(stop, server)
            phase["name"] = "down"
            await asyncio.sleep(DOWN)
            await asyncio.to_thread(start, server)
            started = time.monotonic()
            # Run on until 200 answers in a row after the restart were all 201.
            deadline = started + 30
            while time.monotonic() < deadline:
                await asyncio.sleep(0.25)
                after = [status for _, status, _, at in answers if at > started]
                if len(after) >= 200 and set(after[-200:]) == {201}:
                    break
            stop_sending.set()
            await asyncio.gather(*workers)

            performed = collections.Counter(
                action["idempotency_key"]
                for action in await asyncio.to_thread(upstream.actions)
                if action["idempotency_key"]
            )
            refused = {key for key, status, _, _ in answers if status == 503 and key != done}
            # Retried after the outage, each refused key is forwarded now: nothing is lost.
            retries = await asyncio.gather(*(retry(client, key) for key in sorted(refused)[:200]))
    finally:
        gateway.stop()

    after_retries = collections.Counter(
        action["idempotency_key"] for action in upstream.actions() if action["idempotency_key"]
    )
    statuses = collections.Counter(status for _, status, _, _ in answers)
    problems = collections.Counter(problem for _, _, problem, _ in answers if problem)
    first_success_after = next(
        (at - started for _, status, _, at in answers if at > started and status == 201), None
    )
    last_failure = max((at for _, status, _, at in answers if status != 201), default=stopping)
    print(  # noqa: T201 - the figures the fault suite reports (pytest -s)
        f"\nstore outage under load: {len(answers)} requests by {WORKERS} workers; statuses "
        f"{dict(statuses)}; problems {dict(problems)}; first 201 {first_success_after:.2f}s "
        f"after the restart; last failure {last_failure - started:+.2f}s from the restart; "
        f"{len(refused)} keys refused, {len(retries)} retried after the outage; "
        f"duplicates at the upstream: {sum(n - 1 for n in performed.values() if n > 1)}"
    )
    # 500: the bug of `test_a_driver_state_error_is_a_store_error_not_a_500` below, an asyncpg
    # error the store does not translate, at the moment PostgreSQL shuts down. Seen on `claim`
    # (not forwarded) and on `complete` (forwarded once, and the client got 500 instead of the
    # upstream's 201). Either way the key was performed at most once.
    # 502 `outcome-unknown`: a pooled upstream connection closed by the upstream's keep-alive
    # timer just as the gateway reused it (seen once, when the outage lasted ~5 s). The contract's
    # answer for a connection broken after sending; such a key was performed at most once.
    # 0: the client got no answer at all: the connection closed (seen with the 500s above, same
    # cause); such a key was performed at most once.
    assert set(statuses) <= {201, 503, 500, 502, 0}, statuses
    assert set(problems) <= {"store-unavailable", "outcome-unknown", "no answer"}, problems
    assert statuses[503] > WORKERS  # the outage really was under load
    for key, status, _, _ in answers:
        if key == done:
            continue
        if status in (502, 500, 0):
            assert performed[key] <= 1
            continue
        assert performed[key] == (1 if status == 201 else 0), (key, status, performed[key])
    assert performed[done] == 1
    assert all(count == 1 for count in performed.values())  # no key performed twice
    # Healed by itself: no failure after the first success following the restart.
    assert first_success_after is not None and last_failure < started + first_success_after
    assert all(retry.status_code == 201 for retry in retries)
    for key in sorted(refused)[:200]:
        assert after_retries[key] == 1


@pytest.mark.parametrize("operation", ["claim", "complete"])
async def test_a_driver_state_error_is_a_store_error_not_a_500(
    database_url: str, monkeypatch: pytest.MonkeyPatch, operation: str
) -> None:
    """Seen under load when PostgreSQL shuts down (the test above): a pooled connection whose
    protocol still believes an operation is running raises `InternalClientError: cannot switch
    to state 11; another operation (2) is in progress`. The store must translate it like every
    other driver error (503 `store-unavailable` at claim; at complete, the client gets the
    upstream's answer and the key turns unknown when its lease runs out), not let it through
    as a 500. Reproduced here deterministically by making every statement raise it."""

    async def broken(*args: object, **kwargs: object) -> None:
        raise asyncpg.InternalClientError(
            "cannot switch to state 11; another operation (2) is in progress"
        )

    store = await PostgresStore.connect(database_url)
    try:
        for method in ("fetch", "fetchrow"):  # batched operations, single ones
            monkeypatch.setattr(asyncpg.connection.Connection, method, broken)
        with pytest.raises(errors.StoreUnavailable):
            if operation == "claim":
                await store.requests.claim("r", b"s" * 32, "key", b"f" * 32, 60, 3600)
            else:
                await store.requests.complete(
                    Claim(1, 1, "k"), StoredAnswer(201, plaintext([], b"{}"))
                )
    finally:
        monkeypatch.undo()
        await store.close()
