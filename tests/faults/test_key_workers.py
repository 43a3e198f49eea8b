"""The worker processes that read keys from large JSON bodies (`oncegate.kernel.key_workers`): they
answer as `keys.from_body` does, run at a lower priority, and a worker that dies costs the
request nothing but a fresh worker; twice, and the request is refused before anything is
claimed or sent."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import AsyncIterator

import pytest

from oncegate import service, settings
from oncegate.kernel import key_workers, keys
from oncegate.model import errors
from oncegate.store.memory import MemoryStore
from tests.fake_upstream import FakeUpstream
from tests.helpers import new_key

POINTER = keys.parse_pointer("/idempotency_key")
SHOWN = "/idempotency_key"
PADDING = b" " * 100_000  # past the size a key is read inline


@pytest.fixture
async def workers() -> AsyncIterator[key_workers.KeyWorkers]:
    pool = key_workers.KeyWorkers(size=2)
    try:
        yield pool
    finally:
        await pool.close()


def worker_pids(pool: key_workers.KeyWorkers) -> list[int]:
    return [worker._process.pid for worker in pool._idle]


@pytest.mark.parametrize(
    "body",
    [
        b'{"idempotency_key": "k-1", "items": [1, 2, 3]}',
        b'{"items": []}',
        b'{"idempotency_key": "k-1"',
        b"\xff\xfe not json",
        b'{"idempotency_key": 7}',
        b'{"idempotency_key": "caf\\u00e9"}',
        b'{"idempotency_key": ""}',
    ],
    ids=["a-key", "none-there", "not-json", "not-text", "a-number", "not-ascii", "empty"],
)
async def test_a_worker_answers_as_from_body_does(
    workers: key_workers.KeyWorkers, body: bytes
) -> None:
    try:
        inline: str | errors.InvalidKey | None = keys.from_body(body, POINTER, SHOWN)
    except errors.InvalidKey as error:
        inline = error
    if isinstance(inline, errors.InvalidKey):
        with pytest.raises(errors.InvalidKey) as raised:
            await workers.from_body(body + PADDING, POINTER, SHOWN)
        assert raised.value.detail == inline.detail
    else:
        assert await workers.from_body(body + PADDING, POINTER, SHOWN) == inline


async def test_workers_are_reused_bounded_and_run_at_a_lower_priority(
    workers: key_workers.KeyWorkers,
) -> None:
    bodies = [json.dumps({"idempotency_key": f"k-{n}"}).encode() + PADDING for n in range(6)]
    found = await asyncio.gather(*(workers.from_body(body, POINTER, SHOWN) for body in bodies))
    assert found == [f"k-{n}" for n in range(6)]
    pids = worker_pids(workers)
    assert 1 <= len(pids) <= 2  # six bodies at once, two workers at most
    for pid in pids:
        assert os.getpriority(os.PRIO_PROCESS, pid) >= os.getpriority(os.PRIO_PROCESS, 0) + 1
    await workers.from_body(bodies[0], POINTER, SHOWN)
    assert set(worker_pids(workers)) <= set(pids)  # kept, not started anew


async def test_a_dead_worker_is_replaced_and_the_request_answered(
    workers: key_workers.KeyWorkers,
) -> None:
    body = b'{"idempotency_key": "k-1"}' + PADDING
    assert await workers.from_body(body, POINTER, SHOWN) == "k-1"
    (pid,) = worker_pids(workers)
    os.kill(pid, signal.SIGKILL)
    await asyncio.sleep(0.1)
    assert await workers.from_body(body, POINTER, SHOWN) == "k-1"
    assert worker_pids(workers) != [pid]


async def test_closing_ends_every_worker(workers: key_workers.KeyWorkers) -> None:
    await workers.from_body(b'{"idempotency_key": "k-1"}' + PADDING, POINTER, SHOWN)
    (pid,) = worker_pids(workers)
    await workers.close()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    with pytest.raises(errors.GatewayError):
        await workers.from_body(b'{"idempotency_key": "k-1"}' + PADDING, POINTER, SHOWN)


async def test_a_body_whose_workers_keep_dying_is_refused_and_nothing_claimed_or_sent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A "worker" that exits at once, as one killed by the kernel for its memory would.
    monkeypatch.setattr(key_workers.sys, "executable", "/bin/false")
    pool = key_workers.KeyWorkers(size=1)
    store, upstream = MemoryStore(), FakeUpstream()
    gateway = service.Gateway(store, upstream, key_workers=pool)
    route = settings.Route(
        name="square", match="/", upstream="http://upstream.test", key_from_body=SHOWN
    )
    key = new_key()
    request = service.ProxyRequest(
        method="POST",
        path="/payments",
        query="",
        headers=[("content-type", "application/json")],
        body=json.dumps({"idempotency_key": key}).encode() + PADDING,
    )
    try:
        with pytest.raises(errors.GatewayError) as raised:
            await gateway.handle(route, request)
    finally:
        await pool.close()
    assert raised.value.status == 500 and "ended twice" in raised.value.detail
    assert await store.find(key, None) == []  # nothing claimed
    assert upstream.requests(key) == []  # nothing sent
