"""One suite, two upstreams: the port's promises (`oncegate.upstream.Upstream`) hold for the
aiohttp client on real sockets and for the in-process fake (tests/fake_upstream.py) that the
service's outcome tests run on, so what those tests show holds for the real client.

The promises: an answer comes back whole; a request that never left is `NotSent` and never
reached the upstream; one that reached it and lost its answer is `AnswerLost`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import pytest

from oncegate.upstream import AnswerLost, NotSent, Upstream
from oncegate.upstream.client import HttpUpstream
from tests.fake_upstream import FakeUpstream, Respond
from tests.faults.conftest import RawUpstream
from tests.helpers import free_port, new_key


@dataclass
class Port:
    """An upstream behind the port, and how to make its next request answer, fail before it
    leaves, or lose its answer after it arrived."""

    upstream: Upstream
    url: Callable[[str], str]  # the URL of a request that will behave so
    reached: Callable[[str], int]  # how many requests with this key reached the upstream


@pytest.fixture(params=["http", "fake"])
async def port(request: pytest.FixtureRequest) -> AsyncIterator[Port]:
    if request.param == "fake":
        fake = FakeUpstream()
        behaviours = {"answer": Respond(), "refused": NotSent("refused"),
                      "close": AnswerLost("closed", timed_out=False)}  # fmt: skip

        def scripted(behaviour: str) -> str:
            fake.will(behaviours[behaviour])
            return f"http://upstream.test/{behaviour}"

        yield Port(fake, scripted, lambda key: len(fake.requests(key)))
        return
    server = RawUpstream()
    client = HttpUpstream()
    refused = f"http://127.0.0.1:{free_port()}"
    try:
        yield Port(
            client,
            lambda behaviour: (
                f"{refused}/x" if behaviour == "refused" else f"{server.url}/{behaviour}"
            ),
            lambda key: len(server.requests(key)),
        )
    finally:
        await client.aclose()
        server.close()


def keyed(key: str) -> list[tuple[str, str]]:
    return [("idempotency-key", key), ("content-type", "application/json")]


async def test_an_answer_comes_back_whole(port: Port) -> None:
    key = new_key()
    answer = await port.upstream.send("POST", port.url("answer"), keyed(key), b"{}", 5)
    assert answer.status == 201 and answer.body
    assert port.reached(key) == 1


async def test_a_request_that_never_left_is_not_sent_and_never_reached(port: Port) -> None:
    key = new_key()
    with pytest.raises(NotSent):
        await port.upstream.send("POST", port.url("refused"), keyed(key), b"{}", 5)
    assert port.reached(key) == 0


async def test_a_request_whose_answer_was_lost_reached_the_upstream(port: Port) -> None:
    key = new_key()
    with pytest.raises(AnswerLost) as lost:
        await port.upstream.send("POST", port.url("close"), keyed(key), b"{}", 5)
    assert not lost.value.timed_out
    assert port.reached(key) == 1
