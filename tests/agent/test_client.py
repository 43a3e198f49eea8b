"""The client's retry rules, against a real gateway in front of the real demo upstream.

What the upstream performed is counted by the demo upstream itself (`GET /actions?key=`)."""

from __future__ import annotations

import asyncio
import random
import re
import time
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path

import httpx
import pytest

from oncegate.agent.client import (
    ActionClient,
    ActionKeyReused,
    ActionOutcomeUnknown,
    ActionPerformedNotStored,
    ActionRejected,
    Attempts,
    GaveUp,
    KeyLifetime,
    RetryPolicy,
    problem_name,
    request_headers,
    retry_after,
)
from tests.e2e.conftest import DemoUpstream, GatewayProcess, Process
from tests.helpers import free_port, new_key, total


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=10.0) as client:
        yield client


def client_for(http: httpx.AsyncClient, url: str, deadline: float = 10.0) -> ActionClient:
    return ActionClient(http, url, policy=RetryPolicy(deadline=deadline))


def requests_sent(http: httpx.AsyncClient) -> list[httpx.Request]:
    """Every request `http` sends from now on, as it sends it."""
    sent: list[httpx.Request] = []

    async def record(request: httpx.Request) -> None:
        sent.append(request)

    http.event_hooks["request"].append(record)
    return sent


def new_action_key() -> str:
    return f"test-{new_key()}:step-4:email"


async def test_a_sent_action_and_its_resend_are_performed_once(
    gateway: GatewayProcess, upstream: DemoUpstream, http: httpx.AsyncClient
) -> None:
    client, key = client_for(http, gateway.url), new_action_key()
    first = await client.send("/emails", {"to": "ana@example.com"}, key)
    again = await client.send("/emails", {"to": "ana@example.com"}, key)
    assert first.status_code == again.status_code == 201
    assert again.headers["idempotent-replayed"] == "true"
    assert again.json() == first.json()
    assert len(upstream.actions(key)) == 1


async def test_a_retry_waits_at_the_gateway_for_the_first_attempt_by_default(
    gateway: GatewayProcess, upstream: DemoUpstream, http: httpx.AsyncClient
) -> None:
    client, key = client_for(http, gateway.url), new_action_key()
    slow = asyncio.create_task(
        client.send("/emails", {"to": "cy@example.com"}, key, headers={"X-Demo-Delay": "0.8"})
    )
    await asyncio.sleep(0.2)  # the first attempt holds the key now
    retried = await client.send("/emails", {"to": "cy@example.com"}, key)
    first = await slow
    assert retried.status_code == 201 and retried.json() == first.json()
    assert retried.headers["preference-applied"] == "wait=10"  # answered by waiting, no 409
    assert len(upstream.actions(key)) == 1


async def test_in_progress_is_retried_after_retry_after_and_gets_the_first_answer(
    gateway: GatewayProcess, upstream: DemoUpstream, http: httpx.AsyncClient
) -> None:
    # Without `Prefer: wait`, the client polls as the gateway's 409 and Retry-After say.
    client = ActionClient(http, gateway.url, policy=RetryPolicy(deadline=10.0, wait=0))
    key = new_action_key()
    slow = asyncio.create_task(
        client.send("/emails", {"to": "bo@example.com"}, key, headers={"X-Demo-Delay": "0.8"})
    )
    await asyncio.sleep(0.2)  # the first attempt holds the key now
    started = time.monotonic()
    retried = await client.send("/emails", {"to": "bo@example.com"}, key)
    waited = time.monotonic() - started
    first = await slow
    assert retried.status_code == 201 and retried.json() == first.json()
    assert retried.headers["idempotent-replayed"] == "true"
    assert waited >= 0.9  # the gateway's Retry-After is 1 s
    assert len(upstream.actions(key)) == 1


async def test_a_reused_key_raises_at_once_and_is_not_retried(
    gateway: GatewayProcess, upstream: DemoUpstream, http: httpx.AsyncClient
) -> None:
    client, key = client_for(http, gateway.url), new_action_key()
    await client.send("/charges", {"amount_cents": 100}, key)
    sent = requests_sent(http)
    with pytest.raises(ActionKeyReused) as raised:
        await client.send("/charges", {"amount_cents": 999}, key)
    assert len(sent) == 1  # not retried
    assert raised.value.key == key and raised.value.response is not None
    assert raised.value.response.status_code == 422
    assert [action["request"] for action in upstream.actions(key)] == [{"amount_cents": 100}]


async def test_outcome_unknown_raises_for_the_first_caller_and_for_a_retry(
    gateway: GatewayProcess, upstream: DemoUpstream, http: httpx.AsyncClient
) -> None:
    client, key = client_for(http, gateway.url), new_action_key()
    # The route's timeout is 1 s: the upstream performs the action, answers too late.
    with pytest.raises(ActionOutcomeUnknown) as first:
        await client.send("/tickets", {"queue": "q"}, key, headers={"X-Demo-Delay": "1.5"})
    assert first.value.response is not None and first.value.response.status_code == 504
    sent = requests_sent(http)
    with pytest.raises(ActionOutcomeUnknown) as retry:
        await client.send("/tickets", {"queue": "q"}, key)
    assert len(sent) == 1  # not retried
    assert retry.value.response is not None and retry.value.response.status_code == 409
    assert len(upstream.actions(key)) == 1


async def test_502_upstream_unavailable_is_retried_until_the_upstream_is_up(
    gateway: GatewayProcess, http: httpx.AsyncClient, tmp_path: Path, late_port: int
) -> None:
    client, key = client_for(http, gateway.url, deadline=30.0), new_action_key()
    sending = asyncio.create_task(client.send("/late/emails", {"to": "cy@example.com"}, key))
    await asyncio.sleep(0.5)
    assert not sending.done()  # still retrying the 502s
    late = Process(["demo-upstream", "--port", str(late_port)], tmp_path / "late.log")
    try:
        late.wait_listening(late_port)
        response = await sending
        assert response.status_code == 201
        performed = await http.get(f"http://127.0.0.1:{late_port}/actions", params={"key": key})
        assert len(performed.json()["actions"]) == 1
    finally:
        late.stop()


async def test_503_from_the_upstream_is_retried_with_backoff_then_given_up(
    gateway: GatewayProcess, upstream: DemoUpstream, http: httpx.AsyncClient
) -> None:
    def released() -> float:
        text = httpx.get(gateway.admin_url + "/metrics").text
        return total(text, "oncegate_requests_total", outcome="released")

    before = released()
    client, key = client_for(http, gateway.url, deadline=1.5), new_action_key()
    with pytest.raises(GaveUp, match="503"):
        await client.send(
            "/emails", {"to": "di@example.com"}, key, headers={"X-Demo-Status": "503"}
        )
    assert released() - before >= 3  # the same request, sent again and again
    assert upstream.actions(key) == []  # a 503 performs nothing


async def test_an_upstream_502_stored_and_replayed_is_final_not_retried_to_the_deadline(
    gateway: GatewayProcess, http: httpx.AsyncClient
) -> None:
    # 502 is not among the route's release statuses: the gateway stores it, and every retry is
    # that answer replayed, which no further retry can change.
    client, key = client_for(http, gateway.url, deadline=60.0), new_action_key()
    with pytest.raises(ActionRejected, match="502") as caught:
        await client.send(
            "/emails", {"to": "ed@example.com"}, key, headers={"X-Demo-Status": "502"}
        )
    assert caught.value.response is not None
    # The first attempt's 502 was retried once and met its own answer replayed: final there
    # (a client that kept retrying would end in GaveUp after its 60 s).
    assert caught.value.response.headers["idempotent-replayed"] == "true"


def test_an_answer_that_says_no_retry_can_change_it_is_final() -> None:
    # 503 `answer-sealed`: performed, its answer cannot be opened, never performed again.
    sealed = httpx.Response(
        503,
        headers={"content-type": "application/problem+json", "x-should-retry": "false"},
        json={"type": "urn:oncegate:problem:answer-sealed", "status": 503},
    )
    attempts = Attempts(RetryPolicy(), random.Random(0), "http://gw", "/charges", "k-81")
    with pytest.raises(ActionRejected, match="503 answer-sealed"):
        attempts.after(sealed)
    # Without the header, a 503 is retried (the gateway released the key or never claimed it).
    fresh = Attempts(RetryPolicy(), random.Random(0), "http://gw", "/charges", "k-81")
    assert isinstance(fresh.after(httpx.Response(503)), float)


async def test_connection_refused_is_retried_until_the_deadline(http: httpx.AsyncClient) -> None:
    client = client_for(http, f"http://127.0.0.1:{free_port()}", deadline=1.0)
    started = time.monotonic()
    with pytest.raises(GaveUp, match="cannot connect") as gave_up:
        await client.send("/emails", {}, new_action_key())
    # Not before the deadline (how long after it is the machine's, not the client's), and not
    # after one attempt: retried meanwhile.
    assert time.monotonic() - started >= 1.0
    attempts = re.search(r"after (\d+) attempts", str(gave_up.value))
    assert attempts is not None and int(attempts[1]) > 1


async def test_a_gateway_url_with_credentials_is_never_said_with_them(
    http: httpx.AsyncClient,
) -> None:
    # A gateway behind a proxy that wants credentials in its URL: the action's error names
    # where it could not connect (or where the connection broke), without them.
    url = f"http://agent:Secret9@127.0.0.1:{free_port()}"
    with pytest.raises(GaveUp, match=r"cannot connect to http://\*\*\*@127\.0\.0\.1") as refused:
        await client_for(http, url, deadline=0.2).send("/emails", {}, new_action_key())
    broke = Attempts(RetryPolicy(deadline=0), random.Random(0), url + "/emails", "/emails", "k-9")
    with pytest.raises(GaveUp, match=r"connection to http://\*\*\*@127") as broken:
        broke.after(httpx.ReadError("the connection was reset"))
    assert "Secret9" not in str(refused.value) + str(broken.value)


def test_retry_after_reads_seconds_and_dates() -> None:
    assert retry_after(httpx.Response(409, headers={"Retry-After": "3"})) == 3.0
    date = httpx.Response(409, headers={"Retry-After": "Wed, 21 Oct 2015 07:28:00 GMT"})
    assert retry_after(date) == 0.0  # in the past
    assert retry_after(httpx.Response(409)) is None


def test_only_the_gateways_problems_have_a_problem_name() -> None:
    problem = httpx.Response(
        409,
        headers={"content-type": "application/problem+json"},
        json={"type": "urn:oncegate:problem:request-in-progress"},
    )
    assert problem_name(problem) == "request-in-progress"
    assert problem_name(httpx.Response(409, json={"type": "x"})) is None


def test_a_key_lifetime_resends_until_its_ttl_less_the_margin() -> None:
    assert KeyLifetime().resend_until == timedelta(hours=23)
    lifetime = KeyLifetime(ttl=timedelta(seconds=2), margin=timedelta(seconds=0.5))
    assert lifetime.resend_until == timedelta(seconds=1.5)
    with pytest.raises(ValueError, match="must be positive"):
        KeyLifetime(ttl=timedelta(0))
    with pytest.raises(ValueError, match="less than the ttl"):
        KeyLifetime(ttl=timedelta(hours=1), margin=timedelta(hours=1))
    with pytest.raises(ValueError, match="at least 0"):
        KeyLifetime(margin=timedelta(seconds=-1))


async def test_any_method_and_a_forms_body_are_sent_with_the_key(
    gateway: GatewayProcess, upstream: DemoUpstream, http: httpx.AsyncClient
) -> None:
    client, key = client_for(http, gateway.url), new_action_key()
    form = {"to": "ana@example.com", "subject": "refund & thanks"}
    first = await client.request("POST", "/emails", key, form=form)
    again = await client.request("POST", "/emails", key, form=form)
    assert first.request.headers["content-type"] == "application/x-www-form-urlencoded"
    assert again.headers["idempotent-replayed"] == "true"
    [performed] = upstream.actions(key)
    assert performed["request"] == "to=ana%40example.com&subject=refund+%26+thanks"
    # The demo upstream takes POST only: the method went through, and so did its answer.
    with pytest.raises(ActionRejected, match="PATCH /emails answered 405"):
        await client.request("PATCH", "/emails", new_action_key(), json={"status": "closed"})
    with pytest.raises(ValueError, match="JSON or a form, not both"):
        await client.request("POST", "/emails", key, json={}, form={})


def problem(status: int, name: str, **headers: str) -> httpx.Response:
    return httpx.Response(
        status,
        headers={"content-type": "application/problem+json", **headers},
        json={"type": f"urn:oncegate:problem:{name}", "status": status},
    )


def test_a_released_429_or_503_is_retried_after_its_retry_after() -> None:
    """The route's `release_statuses` (429 and 503 by default) released the key: nothing was
    kept, so the same key may go again, when the upstream said to come back."""

    def first_wait(response: httpx.Response) -> float | httpx.Response:
        return Attempts(RetryPolicy(), random.Random(0), "http://gw", "/e", "k-81").after(response)

    assert first_wait(httpx.Response(429, headers={"Retry-After": "3"})) == 3.0
    assert first_wait(httpx.Response(503, headers={"Retry-After": "2"})) == 2.0
    assert first_wait(httpx.Response(503, headers={"Retry-After": "3600"})) == 10.0  # the cap
    assert isinstance(first_wait(httpx.Response(429)), float)  # no hint: backoff
    assert first_wait(problem(503, "store-unavailable", **{"Retry-After": "1"})) == 1.0
    # A 429 the route stored and replays is that answer: final.
    with pytest.raises(ActionRejected, match="429"):
        first_wait(httpx.Response(429, headers={"idempotent-replayed": "true"}))


def test_response_not_stored_says_the_action_was_performed() -> None:
    attempts = Attempts(RetryPolicy(), random.Random(0), "http://gw", "/reports", "k-81")
    with pytest.raises(ActionPerformedNotStored, match="performed this action") as caught:
        attempts.after(problem(409, "response-not-stored"))
    assert isinstance(caught.value, ActionRejected)  # what callers caught before still catches it


def test_a_caller_s_key_or_prefer_header_in_any_case_is_one_header() -> None:
    sent = request_headers(
        RetryPolicy(), "k-81", {"idempotency-key": "stale", "prefer": "wait=3", "X-Trace": "t"}
    )
    assert sent == {"Idempotency-Key": "k-81", "prefer": "wait=3", "X-Trace": "t"}
    assert request_headers(RetryPolicy(wait=5), "k-81", {}) == {
        "Idempotency-Key": "k-81",
        "Prefer": "wait=5",
    }


def test_langgraph_retry_on_never_retries_an_answer_that_says_no_retry_can_change_it() -> None:
    from oncegate.agent.langgraph import retry_on

    def rejected(response: httpx.Response) -> ActionRejected:
        return ActionRejected("no", key="k-81", response=response)

    assert retry_on(rejected(httpx.Response(500)))
    assert not retry_on(rejected(problem(503, "answer-sealed", **{"x-should-retry": "false"})))
    assert not retry_on(rejected(httpx.Response(502, headers={"idempotent-replayed": "true"})))
    assert not retry_on(rejected(httpx.Response(400)))


async def test_an_upstream_429_released_is_retried_then_given_up(
    gateway: GatewayProcess, upstream: DemoUpstream, http: httpx.AsyncClient
) -> None:
    client, key = client_for(http, gateway.url, deadline=1.5), new_action_key()
    with pytest.raises(GaveUp, match="429"):
        await client.send(
            "/emails", {"to": "fa@example.com"}, key, headers={"X-Demo-Status": "429"}
        )
    assert upstream.actions(key) == []  # a 429 performs nothing, and the gateway kept nothing
