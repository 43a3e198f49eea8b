"""`Prefer: wait=N` (contract section 9): a request that finds its key in flight waits for it to
settle and is answered as if it had arrived afterwards, on one gateway and across several on one
database. Real gateways, the demo upstream, PostgreSQL's LISTEN/NOTIFY and its fallback poll.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import asyncpg
import httpx
import pytest

from tests.e2e.conftest import DemoUpstream, GatewayProcess, problem_name
from tests.helpers import new_key

# On the embedded PostgreSQL and on a Citus cluster (`backend`, tests/conftest.py).
# On Citus too in `make test-all`: these tests are about the gateway, not the store (the
# store's own suite runs on Citus in `make test`, tests/store/test_conformance.py).
pytestmark = pytest.mark.citus(slow=True)

LISTENER = "oncegate-listener"


def routes(upstream: str) -> list[dict[str, object]]:
    return [
        {"name": "mail", "match": "/", "upstream": upstream},
        {"name": "short", "match": "/short", "upstream": upstream, "strip_prefix": True,
         "max_wait": "1s"},
        # A route's `wait` (contract section 10): duplicates wait without asking.
        {"name": "waiting", "match": "/waiting", "upstream": upstream, "strip_prefix": True,
         "wait": "10s"},
        # An upstream slower than this timeout leaves the key `unknown`.
        {"name": "brief", "match": "/brief", "upstream": upstream, "strip_prefix": True,
         "timeout": "1s"},
    ]  # fmt: skip


@pytest.fixture(scope="module")
def gateways(
    module_dir: Path, database_url: str, upstream: DemoUpstream
) -> Iterator[list[GatewayProcess]]:
    started: list[GatewayProcess] = []
    try:
        for index in range(3):
            started.append(
                GatewayProcess(
                    module_dir, database_url, routes(upstream.url), name=f"gateway-{index}"
                )
            )
        yield started
    finally:
        for gateway in started:
            gateway.stop()


@pytest.fixture
async def clients(gateways: list[GatewayProcess]) -> AsyncIterator[list[httpx.AsyncClient]]:
    limits = httpx.Limits(max_connections=100)
    async with contextlib.AsyncExitStack() as stack:
        yield [
            await stack.enter_async_context(
                httpx.AsyncClient(base_url=gateway.url, limits=limits, timeout=30)
            )
            for gateway in gateways
        ]


def headers(key: str, wait: int | None = 10, **extra: str) -> dict[str, str]:
    sent = {"Idempotency-Key": key, **extra}
    if wait is not None:
        sent["Prefer"] = f"wait={wait}"
    return sent


def assert_replays_of(original: httpx.Response, copies: list[httpx.Response]) -> None:
    """The first was forwarded, and every copy got its answer, replayed."""
    assert original.status_code == 201
    for copy in copies:
        assert copy.status_code == 201, copy.text
        assert copy.content == original.content
        assert copy.headers["idempotent-replayed"] == "true"


@pytest.mark.parametrize("spread", [1, 3], ids=["one-gateway", "three-gateways"])
async def test_concurrent_copies_that_wait_all_get_the_one_stored_answer(
    clients: list[httpx.AsyncClient], upstream: DemoUpstream, spread: int
) -> None:
    key = new_key()
    first = asyncio.create_task(
        clients[0].post("/emails", json={"n": 1}, headers=headers(key, **{"X-Demo-Delay": "1"}))
    )
    await asyncio.sleep(0.2)  # the first is claimed and at the upstream
    copies = await asyncio.gather(
        *(
            clients[index % spread].post("/emails", json={"n": 1}, headers=headers(key))
            for index in range(20)
        )
    )
    original = await first
    assert_replays_of(original, copies)
    assert any(copy.headers.get("preference-applied") == "wait=10" for copy in copies)
    assert len(upstream.actions(key)) == 1


async def test_without_the_header_nothing_changes(
    clients: list[httpx.AsyncClient], upstream: DemoUpstream
) -> None:
    key = new_key()
    first = asyncio.create_task(
        clients[0].post("/emails", json={}, headers=headers(key, None, **{"X-Demo-Delay": "1"}))
    )
    await asyncio.sleep(0.2)
    busy = await clients[1].post("/emails", json={}, headers=headers(key, None))
    assert busy.status_code == 409 and problem_name(busy) == "request-in-progress"
    assert "preference-applied" not in busy.headers
    assert (await first).status_code == 201


async def test_a_release_while_waiting_lets_exactly_one_waiter_forward(
    clients: list[httpx.AsyncClient], upstream: DemoUpstream
) -> None:
    key = new_key()
    # The first is answered 503 after a second: a release status, so the key is freed.
    first = asyncio.create_task(
        clients[0].post(
            "/emails",
            json={"n": 2},
            headers=headers(key, **{"X-Demo-Delay": "1", "X-Demo-Status": "503"}),
        )
    )
    await asyncio.sleep(0.2)
    waiters = await asyncio.gather(
        *(clients[index % 3].post("/emails", json={"n": 2}, headers=headers(key))
          for index in range(6))
    )  # fmt: skip
    assert (await first).status_code == 503
    assert [waiter.status_code for waiter in waiters] == [201] * 6
    forwarded = [waiter for waiter in waiters if "idempotent-replayed" not in waiter.headers]
    assert len(forwarded) == 1
    assert {waiter.content for waiter in waiters} == {forwarded[0].content}
    assert len(upstream.actions(key)) == 1  # the 503 performed nothing


async def test_a_lost_notification_is_made_up_by_the_poll(
    clients: list[httpx.AsyncClient], db: asyncpg.Connection, upstream: DemoUpstream
) -> None:
    key = new_key()
    first = asyncio.create_task(
        clients[0].post("/emails", json={"n": 3}, headers=headers(key, **{"X-Demo-Delay": "2"}))
    )
    await asyncio.sleep(0.2)
    waiter = asyncio.create_task(clients[0].post("/emails", json={"n": 3}, headers=headers(key)))
    # Once the gateway listens, cut its listening connection: the settle's notification is lost.
    for _ in range(100):
        if await db.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1", LISTENER
        ):
            break
        await asyncio.sleep(0.05)
    terminated = await db.fetchval(
        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE application_name = $1",
        LISTENER,
    )
    assert terminated >= 1
    answered = await waiter
    assert answered.status_code == 201 and answered.headers["idempotent-replayed"] == "true"
    assert answered.content == (await first).content
    assert len(upstream.actions(key)) == 1


async def test_the_wait_is_capped_by_the_route_and_ends_in_409(
    clients: list[httpx.AsyncClient], upstream: DemoUpstream
) -> None:
    key = new_key()
    first = asyncio.create_task(
        clients[0].post("/short/emails", json={}, headers=headers(key, **{"X-Demo-Delay": "3"}))
    )
    await asyncio.sleep(0.2)
    waited = await clients[1].post("/short/emails", json={}, headers=headers(key, wait=30))
    assert waited.status_code == 409 and problem_name(waited) == "request-in-progress"
    assert waited.headers["preference-applied"] == "wait=1"  # the route's max_wait
    assert waited.headers["retry-after"]
    assert (await first).status_code == 201
    assert len(upstream.actions(key)) == 1


async def test_waiters_on_a_gateway_killed_mid_flight_get_409(
    module_dir: Path, database_url: str, upstream: DemoUpstream, gateways: list[GatewayProcess]
) -> None:
    doomed = GatewayProcess(module_dir, database_url, routes(upstream.url), name="doomed")
    key = new_key()
    try:
        async with httpx.AsyncClient(base_url=doomed.url, timeout=30) as doomed_client:
            first = asyncio.create_task(
                doomed_client.post(
                    "/emails", json={}, headers=headers(key, **{"X-Demo-Delay": "5"})
                )
            )
            for _ in range(100):  # until the upstream has it
                if upstream.actions(key):
                    break
                await asyncio.sleep(0.05)
            doomed.process.signal(signal.SIGKILL)
            with pytest.raises(httpx.TransportError):
                await first
    finally:
        doomed.stop()
    async with httpx.AsyncClient(base_url=gateways[0].url, timeout=30) as client:
        waited = await client.post("/emails", json={}, headers=headers(key, wait=1))
    # Its lease (2 x the 30 s timeout) still runs: still in flight, as far as anyone can know.
    assert waited.status_code == 409 and problem_name(waited) == "request-in-progress"
    assert waited.headers["preference-applied"] == "wait=1"
    assert waited.headers["retry-after"]
    assert len(upstream.actions(key)) == 1


async def test_a_waiter_whose_key_turns_unknown_gets_409_outcome_unknown(
    clients: list[httpx.AsyncClient], upstream: DemoUpstream
) -> None:
    key = new_key()
    # The upstream answers after 2 s, past the route's 1 s timeout: the key turns `unknown`.
    first = asyncio.create_task(
        clients[0].post("/brief/emails", json={}, headers=headers(key, **{"X-Demo-Delay": "2"}))
    )
    await asyncio.sleep(0.2)
    waited = await clients[1].post("/brief/emails", json={}, headers=headers(key, wait=10))
    timed_out = await first
    assert timed_out.status_code == 504 and problem_name(timed_out) == "outcome-unknown"
    assert waited.status_code == 409 and problem_name(waited) == "outcome-unknown"
    assert waited.headers["preference-applied"] == "wait=10"
    assert "retry-after" not in waited.headers  # only an operator's resolution ends it
    assert len(upstream.actions(key)) == 1


async def test_a_route_with_wait_holds_unasked_duplicates_on_every_gateway(
    clients: list[httpx.AsyncClient], upstream: DemoUpstream
) -> None:
    """The same mechanism as `Prefer: wait`, across gateways: the settle on one gateway's
    forward wakes duplicates waiting on the others. Nobody asked, so nothing says it applied."""
    key = new_key()
    first = asyncio.create_task(
        clients[0].post(
            "/waiting/emails", json={"n": 4}, headers=headers(key, None, **{"X-Demo-Delay": "1"})
        )
    )
    await asyncio.sleep(0.2)
    copies = await asyncio.gather(
        *(clients[index % 3].post("/waiting/emails", json={"n": 4}, headers=headers(key, None))
          for index in range(9))
    )  # fmt: skip
    assert_replays_of(await first, copies)
    assert not [copy for copy in copies if "preference-applied" in copy.headers]
    assert len(upstream.actions(key)) == 1


async def test_prefer_wait_asks_for_its_own_time_on_a_route_with_wait(
    clients: list[httpx.AsyncClient], upstream: DemoUpstream
) -> None:
    key = new_key()
    first = asyncio.create_task(
        clients[0].post(
            "/waiting/emails", json={}, headers=headers(key, None, **{"X-Demo-Delay": "3"})
        )
    )
    await asyncio.sleep(0.2)
    at_once = await clients[1].post("/waiting/emails", json={}, headers=headers(key, wait=0))
    briefly = await clients[2].post("/waiting/emails", json={}, headers=headers(key, wait=1))
    assert at_once.status_code == 409 and "preference-applied" not in at_once.headers
    assert briefly.status_code == 409 and briefly.headers["preference-applied"] == "wait=1"
    assert at_once.headers["retry-after"] and briefly.headers["retry-after"]
    assert (await first).status_code == 201
    assert len(upstream.actions(key)) == 1
