"""Real client libraries, with their own retries and their own idempotency keys, against a real
gateway (contract section 10): stripe, gocardless-pro, increase (a Stainless-generated SDK) and
httpx, each pointed at http://127.0.0.1:PORT through its base-URL option, in front of the demo
upstream, which records every action it really performs.

The SDKs' first attempt times out while the upstream is still working (the demo upstream's
`X-Demo-Delay`, which is outside the fingerprint); each SDK retries on its own, with the key it
chose, and a route with `wait` holds the retry until the first answer exists.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import asyncpg
import gocardless_pro
import httpx
import increase
import pytest
import requests
import stripe
from gocardless_pro import errors as gocardless_errors

from oncegate.kernel import fingerprint, keys
from tests.e2e.conftest import DemoUpstream, GatewayProcess, problem_name
from tests.helpers import new_key, total

# Each SDK attempt gives up after this long; the upstream takes longer, so the first attempt
# always times out while the action is being performed, and a retry finds it in flight.
SDK_TIMEOUT = 2.0
UPSTREAM_DELAY = {"X-Demo-Delay": "3"}
WAIT = "10s"
FORM = "application/x-www-form-urlencoded"


def routes(upstream: str, wait: str) -> list[dict[str, Any]]:
    """The SDKs' paths, mapped onto the demo upstream's endpoints (a trailing slash is one)."""
    return [
        # Stripe: POST {base}/v1/charges, form-encoded.
        {"name": "stripe", "match": "/stripe/v1", "upstream": upstream, "strip_prefix": True,
         "wait": wait},
        # Stripe, with an upstream timeout shorter than the upstream's delay: outcome unknown.
        {"name": "stripe-short", "match": "/stripe-short/v1", "upstream": upstream,
         "strip_prefix": True, "timeout": "1s"},
        # GoCardless: POST /payments at the root, whatever the base URL's path.
        {"name": "gocardless", "match": "/payments", "upstream": upstream + "/charges",
         "strip_prefix": True, "wait": wait},
        # Increase: POST {base}/account_transfers, JSON.
        {"name": "increase", "match": "/increase/account_transfers",
         "upstream": upstream + "/tickets", "strip_prefix": True, "wait": wait},
        # APIs that take their key elsewhere: PayPal's header, Square's body field.
        {"name": "paypal", "match": "/paypal", "upstream": upstream, "strip_prefix": True,
         "key_header": "PayPal-Request-Id", "wait": wait},
        {"name": "square", "match": "/square", "upstream": upstream, "strip_prefix": True,
         "key_from_body": "/idempotency_key", "wait": wait},
    ]  # fmt: skip


@pytest.fixture(scope="module")
def gateway(
    module_dir: Path, database_url: str, upstream: DemoUpstream
) -> Iterator[GatewayProcess]:
    with GatewayProcess(module_dir, database_url, routes(upstream.url, WAIT)) as started:
        yield started


@pytest.fixture(scope="module")
def gateway_without_wait(
    module_dir: Path, database_url: str, upstream: DemoUpstream
) -> Iterator[GatewayProcess]:
    with GatewayProcess(
        module_dir, database_url, routes(upstream.url, "0s"), name="gateway-without-wait"
    ) as started:
        yield started


def stripe_client(
    gateway: GatewayProcess,
    prefix: str = "/stripe",
    sent: list[str] | None = None,
    timeout: float = SDK_TIMEOUT,
) -> stripe.StripeClient:
    """Stripe's client on the gateway; the bodies it sends are appended to `sent`."""
    session = requests.Session()
    if sent is not None:
        session.hooks["response"].append(
            lambda response, *args, **kwargs: sent.append(response.request.body)
        )
    return stripe.StripeClient(
        "sk_test_oncegate",
        base_addresses={"api": gateway.url + prefix},
        max_network_retries=3,
        http_client=stripe.RequestsClient(timeout=timeout, session=session),
    )


# -- an SDK's own retry after its timeout, through a route with `wait` ------------------------


def test_stripe_retry_after_a_timeout_returns_the_original_charge(
    gateway: GatewayProcess, upstream: DemoUpstream
) -> None:
    marker = uuid.uuid4().hex
    charge = stripe_client(gateway).v1.charges.create(
        params={"amount": 500, "currency": "usd", "description": marker},
        options={"headers": UPSTREAM_DELAY},
    )
    [action] = upstream.performed(marker)
    assert charge.id == action["id"]
    assert charge.last_response.headers["idempotent-replayed"] == "true"  # the SDK's retry
    assert action["idempotency_key"]  # the key the SDK chose, on every attempt


def test_gocardless_retry_after_a_timeout_returns_the_original_payment(
    gateway: GatewayProcess, upstream: DemoUpstream
) -> None:
    marker = uuid.uuid4().hex
    client = gocardless_pro.Client(
        access_token="sandbox_oncegate", base_url=gateway.url, timeout=SDK_TIMEOUT
    )
    payment = client.payments.create(
        params={"amount": 500, "currency": "GBP", "description": marker,
                "links": {"mandate": "MD0001"}},
        headers=UPSTREAM_DELAY,
    )  # fmt: skip
    [action] = upstream.performed(marker)
    assert payment.id == action["id"]
    assert payment.api_response.headers["idempotent-replayed"] == "true"


def test_gocardless_without_wait_fails_where_the_route_with_wait_succeeds(
    gateway_without_wait: GatewayProcess, upstream: DemoUpstream
) -> None:
    """The issue's symptom, kept as the control: gocardless-pro does not retry a 409."""
    marker = uuid.uuid4().hex
    client = gocardless_pro.Client(
        access_token="sandbox_oncegate", base_url=gateway_without_wait.url, timeout=SDK_TIMEOUT
    )
    with pytest.raises(gocardless_errors.GoCardlessProError):
        client.payments.create(
            params={"amount": 500, "currency": "GBP", "description": marker},
            # Long enough that the SDK's retry (after its 2 s timeout and 0.5 s) finds it in
            # flight however slow the machine.
            headers={"X-Demo-Delay": "8"},
        )
    assert len(upstream.performed(marker)) == 1  # performed once all the same


def test_increase_retry_after_a_timeout_returns_the_original_transfer(
    gateway: GatewayProcess, upstream: DemoUpstream
) -> None:
    marker = uuid.uuid4().hex
    client = increase.Increase(
        api_key="oncegate", base_url=gateway.url + "/increase", timeout=SDK_TIMEOUT, max_retries=3
    )
    raw = client.account_transfers.with_raw_response.create(
        account_id="account_in71c4amph0vgo2qllky",
        amount=500,
        description=marker,
        destination_account_id="account_uf16sut2ct5bevmq3eh",
        extra_headers=UPSTREAM_DELAY,
    )
    transfer = raw.parse()
    [action] = upstream.performed(marker)
    assert transfer.id == action["id"]
    assert raw.headers["idempotent-replayed"] == "true"
    assert raw.retries_taken >= 1


# -- form bodies, and what SDKs do with the gateway's own answers ------------------------------


def test_a_stripe_call_with_its_parameters_in_another_order_replays(
    gateway: GatewayProcess, upstream: DemoUpstream
) -> None:
    marker, key = uuid.uuid4().hex, new_key()
    first_params = {"amount": 700, "currency": "usd", "description": marker}
    again_params = {"description": marker, "currency": "usd", "amount": 700}
    sent: list[str] = []
    client = stripe_client(gateway, sent=sent)
    first = client.v1.charges.create(params=first_params, options={"idempotency_key": key})
    again = client.v1.charges.create(params=again_params, options={"idempotency_key": key})
    # The SDK encodes a dict in its order: two different bodies for one request.
    assert sent[0].startswith("amount=700&") and sent[1].startswith("description=")
    assert again.id == first.id
    assert again.last_response.headers["idempotent-replayed"] == "true"
    assert len(upstream.performed(marker)) == 1


def test_stripe_does_not_retry_an_outcome_unknown_and_retries_nothing_else_in_vain(
    gateway: GatewayProcess, upstream: DemoUpstream
) -> None:
    """A 504 outcome-unknown says `Stripe-Should-Retry: false`: the SDK (which retries every
    5xx and 409 by default) stops at once, instead of collecting 409s until its retries run
    out."""
    marker = uuid.uuid4().hex
    before = httpx.get(gateway.admin_url + "/metrics").text
    with pytest.raises(stripe.APIError) as caught:
        # The SDK waits longer than the route's upstream timeout: the 504 is what it reads.
        stripe_client(gateway, "/stripe-short", timeout=10).v1.charges.create(
            params={"amount": 5, "currency": "usd", "description": marker},
            options={"headers": UPSTREAM_DELAY},
        )
    after = httpx.get(gateway.admin_url + "/metrics").text
    assert caught.value.http_status == 504
    assert "outcome-unknown" in str(caught.value.http_body)  # the problem, as text
    labels = {"route": "stripe-short", "outcome": "unknown"}
    assert (
        total(after, "oncegate_requests_total", **labels)
        - total(before, "oncegate_requests_total", **labels)
        == 1
    )
    assert (
        total(after, "oncegate_requests_total", route="stripe-short")
        - total(before, "oncegate_requests_total", route="stripe-short")
        == 1
    )  # no retry at all
    assert len(upstream.performed(marker)) == 1


def test_the_sdks_see_a_reused_key_as_a_client_error_they_do_not_retry(
    gateway: GatewayProcess, upstream: DemoUpstream
) -> None:
    key = new_key()
    client = increase.Increase(
        api_key="oncegate", base_url=gateway.url + "/increase", timeout=SDK_TIMEOUT, max_retries=3
    )
    transfer: dict[str, Any] = {
        "account_id": "account_in71c4amph0vgo2qllky",
        "amount": 1,
        "description": "first",
        "destination_account_id": "account_uf16sut2ct5bevmq3eh",
    }
    client.account_transfers.create(**transfer, idempotency_key=key)
    with pytest.raises(increase.UnprocessableEntityError) as caught:
        client.account_transfers.create(**{**transfer, "description": "other"}, idempotency_key=key)
    assert caught.value.status_code == 422
    assert caught.value.response.headers["x-should-retry"] == "false"
    assert isinstance(caught.value.body, dict)
    assert caught.value.body["type"] == "urn:oncegate:problem:key-reused"


# -- keys in another header, and in the body ---------------------------------------------------


async def copies(
    gateway: GatewayProcess, count: int, path: str, **request: Any
) -> list[httpx.Response]:
    limits = httpx.Limits(max_connections=count)
    async with httpx.AsyncClient(base_url=gateway.url, limits=limits, timeout=30) as client:
        return await asyncio.gather(*(client.post(path, **request) for _ in range(count)))


async def test_twenty_copies_with_one_paypal_request_id_are_one_order(
    gateway: GatewayProcess, upstream: DemoUpstream
) -> None:
    key, marker = new_key(), uuid.uuid4().hex
    answers = await copies(
        gateway, 20, "/paypal/orders", json={"intent": "CAPTURE", "marker": marker},
        headers={"PayPal-Request-Id": key, "X-Demo-Delay": "0.5"},
    )  # fmt: skip
    assert {answer.status_code for answer in answers} == {201}
    assert len({answer.content for answer in answers}) == 1
    assert sum(answer.headers.get("idempotent-replayed") == "true" for answer in answers) == 19
    [action] = upstream.performed(marker)
    assert action["idempotency_key"] == key  # passed upstream under its own name


async def test_twenty_copies_with_one_key_in_the_body_are_one_payment(
    gateway: GatewayProcess, upstream: DemoUpstream
) -> None:
    key, marker = new_key(), uuid.uuid4().hex
    answers = await copies(
        gateway, 20, "/square/payments",
        json={"idempotency_key": key, "amount_money": {"amount": 100}, "marker": marker},
        headers={"X-Demo-Delay": "0.5"},
    )  # fmt: skip
    assert {answer.status_code for answer in answers} == {201}
    assert len({answer.content for answer in answers}) == 1
    assert sum(answer.headers.get("idempotent-replayed") == "true" for answer in answers) == 19
    [action] = upstream.performed(marker)
    assert action["idempotency_key"] == key


async def test_a_body_key_route_without_the_field_or_with_a_number_refuses(
    gateway: GatewayProcess, upstream: DemoUpstream
) -> None:
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as client:
        missing = await client.post("/square/payments", json={"amount": 1})
        number = await client.post("/square/payments", json={"idempotency_key": 12})
        not_json = await client.post("/square/payments", content=b"amount=1")
        header_only = await client.post(
            "/square/payments", json={"amount": 1}, headers={"Idempotency-Key": new_key()}
        )
    assert missing.status_code == 400 and problem_name(missing) == "missing-key"
    assert "/idempotency_key" in missing.json()["detail"]
    assert number.status_code == 400 and problem_name(number) == "invalid-key"
    assert not_json.status_code == 400 and problem_name(not_json) == "missing-key"
    # The route takes its key from the body alone.
    assert header_only.status_code == 400 and problem_name(header_only) == "missing-key"


async def test_the_same_body_key_with_another_body_is_a_reused_key(
    gateway: GatewayProcess, upstream: DemoUpstream
) -> None:
    key = new_key()
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as client:
        first = await client.post("/square/payments", json={"idempotency_key": key, "amount": 1})
        other = await client.post("/square/payments", json={"idempotency_key": key, "amount": 2})
    assert first.status_code == 201
    assert other.status_code == 422 and problem_name(other) == "key-reused"


async def test_a_paypal_route_names_its_header_and_ignores_idempotency_key(
    gateway: GatewayProcess,
) -> None:
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as client:
        missing = await client.post(
            "/paypal/orders", json={}, headers={"Idempotency-Key": new_key()}
        )
        twice = await client.post(
            "/paypal/orders",
            json={},
            headers=[("PayPal-Request-Id", "a"), ("PayPal-Request-Id", "b")],
        )
    assert missing.status_code == 400 and problem_name(missing) == "missing-key"
    assert "PayPal-Request-Id" in missing.json()["detail"]
    assert twice.status_code == 400 and problem_name(twice) == "invalid-key"
    assert missing.headers["x-should-retry"] == "false"


# -- keys stored before form bodies were canonicalised ----------------------------------------


async def test_a_form_key_stored_under_the_byte_rule_replays_its_bytes_and_refuses_a_reorder(
    gateway: GatewayProcess, upstream: DemoUpstream, db: asyncpg.Connection
) -> None:
    """A key a gateway of the previous release completed for a form body holds the digest of
    the body's bytes: a retry with the same bytes is replayed, a reordered one is 422, as it
    was then; neither reaches the upstream."""
    key, marker = new_key(), uuid.uuid4().hex
    body = f"amount=900&currency=usd&description={marker}"
    authorization = "Bearer sk_test_oncegate"
    path = "/stripe/v1/charges"
    old_digest = fingerprint.as_bytes("POST", path, "", FORM, body.encode())
    assert old_digest != fingerprint.of_request("POST", path, "", FORM, body.encode()).digest
    await db.execute(
        "INSERT INTO oncegate_keys (route, scope, key, fingerprint, state, fencing_token,"
        " response_status, response_headers, response_body, response_stored, expires_at)"
        " VALUES ('stripe', $1, $2, $3, 'completed', 1, 201,"
        " $4::jsonb, $5, true, now() + interval '1 day')",
        keys.scope("stripe", [[authorization]]),
        key,
        old_digest,
        json.dumps([["content-type", "application/json"]]),
        b'{"id": "ch_before"}',
    )
    sent = {"Idempotency-Key": key, "Authorization": authorization, "Content-Type": FORM}
    reordered = f"description={marker}&currency=usd&amount=900"
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as client:
        same = await client.post(path, content=body, headers=sent)
        other = await client.post(path, content=reordered, headers=sent)
    assert same.status_code == 201 and same.json() == {"id": "ch_before"}
    assert same.headers["idempotent-replayed"] == "true"
    assert other.status_code == 422 and problem_name(other) == "key-reused"
    assert upstream.performed(marker) == []
