"""`Gateway.drain` with a grace period, in one process (the gateway's service on the in-memory
store, the real upstream client, an upstream that never ends its answers): answers still relayed
when the grace runs out are cut, and so is one whose head comes after it, so a shutdown never
waits for an endless answer. tests/e2e/test_endless_answers.py holds the same through real
gateway processes and PostgreSQL."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from oncegate import settings
from oncegate.kernel import keys
from oncegate.service import Gateway, ProxyRequest
from oncegate.service.streaming import SHUTDOWN, Broken, Relay
from oncegate.store.memory import MemoryStore
from oncegate.upstream.client import HttpUpstream
from tests.e2e.test_endless_answers import DEADLINE, EndlessEvents, eventually


@pytest.fixture(scope="module")
def endless() -> Iterator[EndlessEvents]:
    upstream = EndlessEvents()
    yield upstream
    upstream.close()


def request(method: str, key: str | None = None) -> ProxyRequest:
    fields = [("idempotency-key", key)] if key else []
    return ProxyRequest(method=method, path="/stream", query="", headers=fields, body=b"")


async def relayed(stream: Relay | None) -> Broken:
    """Read an answer's relayed body to its end, which must be a cut."""
    assert stream is not None
    with pytest.raises(Broken) as ended:
        async for _ in stream:
            pass
    return ended.value


async def test_answers_still_relayed_after_the_grace_are_cut_and_so_is_a_head_that_comes_later(
    endless: EndlessEvents, http_upstream: HttpUpstream
) -> None:
    store = MemoryStore()
    gateway = Gateway(store, http_upstream)
    route = settings.Route(name="r", match="/", upstream=endless.url, timeout="1s")
    passing = await gateway.handle(route, request("GET"))
    keyed = await gateway.handle(route, request("POST", "k1"))
    readers = [asyncio.create_task(relayed(answer.stream)) for answer in (passing, keyed)]
    await eventually("both answers under way", lambda: endless.open == 2)

    await asyncio.wait_for(gateway.drain(0.5), DEADLINE)  # not for ever: cut after 0.5 s
    cut = await asyncio.wait_for(asyncio.gather(*readers), DEADLINE)
    assert [SHUTDOWN in broken.reason for broken in cut] == [True, True]
    # No key: nothing to say; the keyed answer's body could still have been stored: unknown.
    assert [broken.unknown for broken in cut] == [False, True]
    held = await store.get(keys.scope(route.name, [[] for _ in route.scope_headers]), "k1")
    assert held is not None and held.state == "unknown"
    await eventually("the upstream's connections closed", lambda: endless.open == 0)

    # A forward whose head comes after the grace: cut at once, its connection given back.
    late = await gateway.handle(route, request("GET"))
    assert SHUTDOWN in (await asyncio.wait_for(relayed(late.stream), DEADLINE)).reason
    await asyncio.wait_for(gateway.drain(0.5), DEADLINE)
    await eventually("the late connection closed", lambda: endless.open == 0)
