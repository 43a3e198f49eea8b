"""Every outcome a client can see, in one process: the proxy port's ASGI application
(`http.proxy.ProxyApp`) over `service.Gateway`, the in-memory store and the upstream port's fake.

Each test says what the client got (status, problem, headers), what the request was counted
under (`oncegate_requests_total{outcome}`, `oncegate_duplicates_blocked_total{reason}`), what the
store holds afterwards, and what reached the upstream. The same rows run against PostgreSQL and a
real upstream on sockets in tests/e2e/test_proxy.py and tests/faults; these are the ones a new
outcome is added to first.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import pytest
from prometheus_client import REGISTRY

from oncegate import service, settings
from oncegate.http.proxy import ProxyApp
from oncegate.kernel.sealing import Keyring
from oncegate.model import errors
from oncegate.model.outcomes import Outcome
from oncegate.model.records import KeyRecord
from oncegate.service.routing import RouteTable
from oncegate.store.memory import MemoryStore
from oncegate.upstream import AnswerLost, NotSent
from tests.fake_upstream import FakeUpstream, Respond
from tests.helpers import stored


@dataclass(frozen=True, slots=True)
class Seen:
    status: int
    headers: dict[str, str]
    body: bytes

    @property
    def problem(self) -> str:
        document = json.loads(self.body)
        assert self.headers["content-type"] == "application/problem+json"
        return str(document["type"]).removeprefix(errors.PROBLEM_TYPE_PREFIX)


class Proxy:
    """One gateway in one process: the proxy port's application, the in-memory store and the
    fake upstream, on one route named after the test."""

    def __init__(self, keyring: Keyring | None = None, **options: object) -> None:
        self.route = settings.Route(
            name=f"r{uuid.uuid4().hex[:8]}", match="/", upstream="http://upstream.test", **options
        )
        self.store = MemoryStore()
        self.upstream = FakeUpstream()
        self.gateway = service.Gateway(self.store, self.upstream, keyring)
        self.app = ProxyApp(self.gateway, RouteTable([self.route]))

    async def send(
        self,
        key: str | None,
        body: bytes = b'{"to": "ana"}',
        method: str = "POST",
        extra: Sequence[tuple[str, str]] = (),
    ) -> Seen:
        request_headers = [("host", "gateway.test"), ("content-type", "application/json")]
        if key is not None:
            request_headers.append(("idempotency-key", key))
        request_headers += extra
        scope = {
            "type": "http", "http_version": "1.1", "method": method, "path": "/emails",
            "raw_path": b"/emails", "query_string": b"",
            "headers": [(name.encode(), value.encode()) for name, value in request_headers],
        }  # fmt: skip
        incoming = [{"type": "http.request", "body": body, "more_body": False}]
        sent: list[dict[str, object]] = []

        async def receive() -> dict[str, object]:
            if incoming:
                return incoming.pop()
            await asyncio.Event().wait()  # the client never hangs up
            raise AssertionError

        async def send(message: dict[str, object]) -> None:
            sent.append(message)

        await self.app(scope, receive, send)  # type: ignore[arg-type]
        start, content = sent
        raw = start["headers"]
        assert isinstance(raw, list)
        seen_headers = {name.decode(): value.decode() for name, value in raw}
        assert isinstance(start["status"], int) and isinstance(content["body"], bytes)
        return Seen(start["status"], seen_headers, content["body"])

    def counted(self, outcome: Outcome, method: str = "POST") -> float:
        labels = {"route": self.route.name, "method": method, "outcome": outcome.value}
        return REGISTRY.get_sample_value("oncegate_requests_total", labels) or 0.0

    def blocked(self, reason: str) -> float:
        labels = {"route": self.route.name, "reason": reason}
        return REGISTRY.get_sample_value("oncegate_duplicates_blocked_total", labels) or 0.0

    async def stored(self, key: str) -> KeyRecord | None:
        found = await self.store.find(key, None)
        return found[0] if found else None


async def test_forwarded_then_replayed_performed_once() -> None:
    proxy = Proxy()
    first = await proxy.send("k")
    assert first.status == 201 and first.body == b'{"performed": true}'
    assert proxy.counted(Outcome.FORWARDED) == 1
    record = await proxy.stored("k")
    assert record is not None and record.state == "completed"
    assert stored(record).status == 201
    again = await proxy.send("k")
    assert (again.status, again.body) == (201, first.body)
    assert again.headers["idempotent-replayed"] == "true"
    assert proxy.counted(Outcome.REPLAYED) == 1 and proxy.blocked("replayed") == 1
    assert len(proxy.upstream.requests("k")) == 1


async def test_mismatch_is_422_and_nothing_is_sent() -> None:
    proxy = Proxy()
    await proxy.send("k")
    reused = await proxy.send("k", body=b'{"to": "bob"}')
    assert (reused.status, reused.problem) == (422, "key-reused")
    assert proxy.counted(Outcome.MISMATCH) == 1
    assert len(proxy.upstream.requests("k")) == 1


async def test_released_frees_the_key_and_the_retry_is_forwarded_again() -> None:
    proxy = Proxy(release_statuses=frozenset({503}))
    proxy.upstream.will(Respond(status=503, body=b"busy"))
    busy = await proxy.send("k")
    assert (busy.status, busy.body) == (503, b"busy")
    assert proxy.counted(Outcome.RELEASED) == 1
    assert await proxy.stored("k") is None
    assert (await proxy.send("k")).status == 201
    assert proxy.counted(Outcome.FORWARDED) == 1
    assert len(proxy.upstream.requests("k")) == 2


async def test_passthrough_and_unprotected_store_nothing() -> None:
    proxy = Proxy(key="optional")
    assert (await proxy.send(None, method="GET", body=b"")).status == 201
    assert proxy.counted(Outcome.PASSTHROUGH, method="GET") == 1
    assert (await proxy.send(None)).status == 201
    assert proxy.counted(Outcome.UNPROTECTED) == 1
    assert (await proxy.store.count_keys(0, 100)).rows == 0
    assert len(proxy.upstream.reached) == 2


async def test_missing_key_is_400_and_nothing_is_sent() -> None:
    proxy = Proxy()
    missing = await proxy.send(None)
    assert (missing.status, missing.problem) == (400, "missing-key")
    assert proxy.counted(Outcome.MISSING_KEY) == 1
    assert proxy.upstream.reached == []


async def test_in_progress_is_409_with_retry_after_while_the_first_is_at_the_upstream() -> None:
    proxy = Proxy()
    arrived, answered = asyncio.Event(), asyncio.Event()
    proxy.upstream.will(Respond(arrived=arrived, until=answered))
    first = asyncio.create_task(proxy.send("k"))
    await arrived.wait()
    second = await proxy.send("k")
    assert (second.status, second.problem) == (409, "request-in-progress")
    assert second.headers["retry-after"] == str(service.IN_PROGRESS_RETRY_AFTER)
    assert proxy.counted(Outcome.IN_PROGRESS) == 1 and proxy.blocked("in_progress") == 1
    record = await proxy.stored("k")
    assert record is not None and record.state == "in_progress"
    answered.set()
    assert (await first).status == 201
    assert len(proxy.upstream.requests("k")) == 1


async def test_not_sent_is_502_upstream_unavailable_and_the_key_released() -> None:
    proxy = Proxy()
    proxy.upstream.will(NotSent("connection refused"))
    refused = await proxy.send("k")
    assert (refused.status, refused.problem) == (502, "upstream-unavailable")
    assert proxy.counted(Outcome.UPSTREAM_UNAVAILABLE) == 1
    assert await proxy.stored("k") is None
    assert (await proxy.send("k")).status == 201  # a retry is safe: nothing was sent
    assert len(proxy.upstream.requests("k")) == 1


@pytest.mark.parametrize(("timed_out", "status"), [(True, 504), (False, 502)])
async def test_an_answer_lost_is_unknown_and_its_retries_409_until_resolved(
    timed_out: bool, status: int
) -> None:
    proxy = Proxy()
    proxy.upstream.will(AnswerLost("reset", timed_out=timed_out))
    lost = await proxy.send("k")
    assert (lost.status, lost.problem) == (status, "outcome-unknown")
    record = await proxy.stored("k")
    assert record is not None and record.state == "unknown"
    retry = await proxy.send("k")
    assert (retry.status, retry.problem) == (409, "outcome-unknown")
    assert proxy.counted(Outcome.UNKNOWN) == 2 and proxy.blocked("unknown") == 1
    assert len(proxy.upstream.requests("k")) == 1


async def test_an_unknown_key_on_a_forwarding_route_is_taken_over_and_forwarded() -> None:
    proxy = Proxy(on_unknown="forward")
    proxy.upstream.will(AnswerLost("reset", timed_out=False))
    assert (await proxy.send("k")).status == 502
    again = await proxy.send("k")
    assert again.status == 201
    assert proxy.counted(Outcome.FORWARDED) == 1
    record = await proxy.stored("k")
    assert record is not None and record.state == "completed"
    assert len(proxy.upstream.requests("k")) == 2


async def test_an_answer_too_large_to_store_is_409_response_not_stored_on_retry() -> None:
    proxy = Proxy(max_stored_response=4)
    assert (await proxy.send("k")).status == 201
    retry = await proxy.send("k")
    assert (retry.status, retry.problem) == (409, "response-not-stored")
    assert proxy.counted(Outcome.REPLAYED) == 1 and proxy.blocked("replayed") == 1
    assert len(proxy.upstream.requests("k")) == 1


async def test_an_answer_sealed_under_a_key_the_gateway_lacks_is_503_and_not_sent_again() -> None:
    proxy = Proxy(keyring=Keyring([("old", bytes(32))]))
    assert (await proxy.send("k")).status == 201
    without = service.Gateway(proxy.store, proxy.upstream, Keyring([("new", bytes(range(32)))]))
    proxy.app = ProxyApp(without, RouteTable([proxy.route]))
    sealed = await proxy.send("k")
    assert (sealed.status, sealed.problem) == (503, "answer-sealed")
    assert proxy.counted(Outcome.ANSWER_SEALED) == 1
    assert len(proxy.upstream.requests("k")) == 1


async def test_a_store_that_cannot_claim_is_503_and_nothing_is_sent() -> None:
    class Down(MemoryStore):
        async def claim(self, *args: object, **kwargs: object) -> None:
            raise errors.StoreUnavailable("PostgreSQL is down")

    proxy = Proxy()
    proxy.store = Down()
    proxy.app = ProxyApp(service.Gateway(proxy.store, proxy.upstream), RouteTable([proxy.route]))
    down = await proxy.send("k")
    assert (down.status, down.problem) == (503, "store-unavailable")
    assert proxy.counted(Outcome.STORE_UNAVAILABLE) == 1
    assert proxy.upstream.reached == []
