"""The waiter bounds under a flood (contract section 10, route `wait`): 1,000 duplicates of one
key in flight on a real gateway. At most `max_waiters_per_key` of them wait; every other one is
answered at once, 409 `request-in-progress` with `Retry-After`, as without waiting. Meanwhile
other keys are served, the gateway's PostgreSQL connections stay those its pools allow, its
file descriptors are its clients' sockets and a constant, its memory grows by little, and every
duplicate gets an answer.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import asyncpg
import httpx
import psutil
import pytest

from tests.e2e.conftest import DemoUpstream, GatewayProcess, parse_head, wait_for_state
from tests.helpers import new_key, total

# A load test (hundreds of waiting copies): `make test-all`. tests/e2e/test_wait.py is `Prefer:
# wait` itself, in `make test`.
pytestmark = pytest.mark.slow

FLOOD = 1000
PER_KEY = 16
# A small pool makes the connection bound tight: claims and settles, answers (half as many),
# the operator's 3, and one listening connection.
POOL = 4
CONNECTIONS = POOL + POOL // 2 + 3 + 1


@pytest.fixture(scope="module")
def gateway(
    module_dir: Path, database_url: str, upstream: DemoUpstream
) -> Iterator[GatewayProcess]:
    route = {"name": "flood", "match": "/", "upstream": upstream.url, "wait": "30s",
             "max_wait": "30s"}  # fmt: skip
    env = {
        "ONCEGATE_MAX_WAITERS_PER_KEY": str(PER_KEY),
        "ONCEGATE_MAX_WAITERS": "100",
        "ONCEGATE_STORE_POOL_SIZE": str(POOL),
    }
    with GatewayProcess(module_dir, database_url, [route], env=env) as started:
        yield started


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes


def raw_post(path: str, body: bytes, key: str) -> bytes:
    """One POST as bytes: a thousand of them cost the test little more than their sockets."""
    return (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Idempotency-Key: {key}\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode() + body


async def post(port: int, request: bytes) -> Answer:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        received = await reader.read()  # Connection: close: the answer, then the end
    finally:
        writer.close()
    head, _, body = received.partition(b"\r\n\r\n")
    status_line, headers = parse_head(head)
    return Answer(int(status_line.split()[1]), headers, body)


async def connections(db: asyncpg.Connection) -> int:
    """Connections to the test's database other than the test's own."""
    count: int = await db.fetchval(
        "SELECT count(*) FROM pg_stat_activity"
        " WHERE datname = current_database() AND pid <> pg_backend_pid()"
    )
    return count


async def test_a_flood_of_duplicates_is_bounded_and_every_one_is_answered(
    gateway: GatewayProcess, upstream: DemoUpstream, db: asyncpg.Connection
) -> None:
    process = psutil.Process(gateway.process.pid)
    key = new_key()
    limits = httpx.Limits(max_connections=20)
    async with (
        httpx.AsyncClient(base_url=gateway.url, limits=limits, timeout=60) as client,
        httpx.AsyncClient(base_url=gateway.admin_url) as admin,
    ):
        warm = await client.post(
            "/emails", json={"warm": True}, headers={"Idempotency-Key": new_key()}
        )
        assert warm.status_code == 201
        fds_before, memory_before = process.num_fds(), process.memory_info().rss
        first = asyncio.create_task(
            client.post(
                "/emails", json={"n": 1}, headers={"Idempotency-Key": key, "X-Demo-Delay": "8"}
            )
        )
        await wait_for_state(db, key, "in_progress")
        answered: list[Answer] = []
        refused_all = asyncio.Event()  # everyone but the waiters has been answered

        async def duplicate() -> Answer:
            answer = await post(gateway.port, request)
            answered.append(answer)
            if len(answered) == FLOOD - PER_KEY:
                refused_all.set()
            return answer

        request = raw_post("/emails", b'{"n":1}', key)
        flood = [asyncio.create_task(duplicate()) for _ in range(FLOOD)]
        # Everyone but the waiters is answered while the first is still at the upstream.
        await asyncio.wait(
            [asyncio.ensure_future(refused_all.wait()), first],
            return_when=asyncio.FIRST_COMPLETED,
        )
        assert not first.done(), f"the first finished when {len(answered)} were answered"
        busy_fds, busy_memory = process.num_fds(), process.memory_info().rss
        busy_connections = await connections(db)
        others = await asyncio.gather(
            *(
                client.post("/emails", json={"other": n}, headers={"Idempotency-Key": new_key()})
                for n in range(5)
            )
        )
        assert not first.done()  # the others were served meanwhile
        assert [other.status_code for other in others] == [201] * 5
        original = await first
        answers = await asyncio.gather(*flood)
        metrics = (await admin.get("/metrics")).text

    assert original.status_code == 201
    refused = [answer for answer in answers if answer.status == 409]
    replayed = [answer for answer in answers if answer.status == 201]
    assert len(refused) + len(replayed) == FLOOD  # every duplicate got one of the two answers
    assert len(refused) == FLOOD - PER_KEY
    for answer in refused:
        assert json.loads(answer.body)["type"] == "urn:oncegate:problem:request-in-progress"
        assert answer.headers["retry-after"] == "1"
        assert answer.headers["x-should-retry"] == "true"
    for answer in replayed:
        assert answer.body == original.content
        assert answer.headers["idempotent-replayed"] == "true"
        assert "preference-applied" not in answer.headers  # nobody asked
    assert total(metrics, "oncegate_wait_duration_seconds_count", route="flood") == PER_KEY
    assert total(metrics, "oncegate_waits_refused_total", route="flood") == FLOOD - PER_KEY
    assert len(upstream.actions(key)) == 1
    # Bounded: no PostgreSQL connection per waiter; one socket per client and a few more; a
    # few kilobytes per connection.
    assert busy_connections <= CONNECTIONS
    assert busy_fds <= fds_before + FLOOD + 50
    assert busy_memory - memory_before < 150 * 1024**2
