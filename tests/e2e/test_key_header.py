"""A route's own key header (`key_header: PayPal-Request-Id`) is held to what Idempotency-Key is
held to, through a real gateway: a byte no key may hold in it is 400 `invalid-key`, counted under
the route, whereas in a header that is only forwarded it is 400 `invalid-header`; a missing key
names the header the route reads."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import asyncpg
import httpx
import pytest

from tests.e2e.conftest import DemoUpstream, GatewayProcess, problem_name, raw_request, row_count
from tests.helpers import total


@pytest.fixture(scope="module")
def gateway(
    module_dir: Path, database_url: str, upstream: DemoUpstream
) -> Iterator[GatewayProcess]:
    routes = [
        {"name": "paypal", "match": "/orders", "upstream": upstream.url,
         "key_header": "PayPal-Request-Id"},
        {"name": "square", "match": "/payments", "upstream": upstream.url,
         "key_from_body": "/idempotency_key"},
        {"name": "mail", "match": "/emails", "upstream": upstream.url},
    ]  # fmt: skip
    with GatewayProcess(module_dir, database_url, routes) as started:
        yield started


def post(gateway: GatewayProcess, path: str, header: bytes) -> tuple[int, dict[str, str], bytes]:
    body = b'{"idempotency_key": "k-in-the-body"}'
    return raw_request(
        gateway.port,
        b"POST "
        + path.encode()
        + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + header
        + b"\r\nContent-Length: "
        + str(len(body)).encode()
        + b"\r\n"
        b"Connection: close\r\n\r\n" + body,
    )


def problem(answer: tuple[int, dict[str, str], bytes]) -> tuple[int, str, str]:
    status, headers, body = answer
    document = httpx.Response(status, headers=headers, content=body)
    return status, problem_name(document), document.json()["detail"]


async def invalid_keys(gateway: GatewayProcess, route: str) -> float:
    async with httpx.AsyncClient(base_url=gateway.admin_url) as admin:
        text = (await admin.get("/metrics")).text
    return total(text, "oncegate_requests_total", route=route, outcome="invalid_key")


@pytest.mark.parametrize(
    ("path", "route", "header"),
    [
        ("/orders", "paypal", b"PayPal-Request-Id: ord-\xff"),  # not UTF-8
        ("/orders", "paypal", b"paypal-request-id: ord-\xff"),  # names are case-insensitive
        ("/orders", "paypal", b"PayPal-Request-Id: ord-\xc3\xa9"),  # UTF-8, but not ASCII
        ("/emails", "mail", b"Idempotency-Key: k-\xff"),
        ("/emails", "mail", b"Idempotency-Key: k-\xc3\xa9"),
    ],
    ids=["custom-0xff", "custom-lower-case", "custom-utf8", "default-0xff", "default-utf8"],
)
async def test_a_byte_no_key_may_hold_in_the_routes_key_header_is_invalid_key(
    gateway: GatewayProcess,
    upstream: DemoUpstream,
    db: asyncpg.Connection,
    path: str,
    route: str,
    header: bytes,
) -> None:
    rows, performed = await row_count(db), len(upstream.actions())
    counted = await invalid_keys(gateway, route)
    status, name, detail = problem(post(gateway, path, header))
    assert (status, name) == (400, "invalid-key")
    shown = "PayPal-Request-Id" if route == "paypal" else "Idempotency-Key"
    assert f"the {shown} must be printable ASCII characters only" in detail
    # Counted under the route whose key it is, as any other malformed key is.
    assert await invalid_keys(gateway, route) == counted + 1
    assert await row_count(db) == rows and len(upstream.actions()) == performed


@pytest.mark.parametrize(
    ("path", "header", "named"),
    [
        # Idempotency-Key is an ordinary header on a route whose key is elsewhere: forwarded,
        # so a value that cannot be forwarded byte for byte is refused as any other header's.
        ("/orders", b"Idempotency-Key: k-\xff", "idempotency-key"),
        ("/payments", b"Idempotency-Key: k-\xff", "idempotency-key"),
        ("/emails", b"PayPal-Request-Id: ord-\xff", "paypal-request-id"),
    ],
    ids=["default-on-custom-route", "default-on-body-route", "custom-on-default-route"],
)
async def test_the_same_byte_in_a_header_that_is_only_forwarded_is_invalid_header(
    gateway: GatewayProcess,
    upstream: DemoUpstream,
    db: asyncpg.Connection,
    path: str,
    header: bytes,
    named: str,
) -> None:
    rows, performed = await row_count(db), len(upstream.actions())
    status, name, detail = problem(post(gateway, path, header))
    assert (status, name) == (400, "invalid-header")
    assert f"the value of the {named!r} header is not UTF-8 text" in detail
    assert await row_count(db) == rows and len(upstream.actions()) == performed


async def test_a_missing_key_names_the_header_the_route_reads(
    gateway: GatewayProcess, upstream: DemoUpstream, db: asyncpg.Connection
) -> None:
    rows, performed = await row_count(db), len(upstream.actions())
    async with httpx.AsyncClient(base_url=gateway.url) as client:
        # The key sent in the header another route reads is no key here.
        custom = await client.post("/orders", json={}, headers={"Idempotency-Key": "k-1"})
        default = await client.post("/emails", json={}, headers={"PayPal-Request-Id": "k-1"})
    assert custom.status_code == default.status_code == 400
    assert problem_name(custom) == problem_name(default) == "missing-key"
    assert custom.json()["detail"] == (
        "POST requests on route 'paypal' carry their key in the PayPal-Request-Id header, "
        'e.g. PayPal-Request-Id: "' + custom.json()["detail"].split('"')[1] + '"'
    )
    assert "carry their key in the Idempotency-Key header" in default.json()["detail"]
    assert " an PayPal" not in custom.json()["detail"]
    assert await row_count(db) == rows and len(upstream.actions()) == performed


async def test_a_good_key_in_the_custom_header_is_claimed_forwarded_once_and_replayed(
    gateway: GatewayProcess, upstream: DemoUpstream
) -> None:
    async with httpx.AsyncClient(base_url=gateway.url) as client:
        sent = [
            await client.post("/orders", json={"n": 1}, headers={"PayPal-Request-Id": "ord-81"})
            for _ in range(2)
        ]
    assert [answer.status_code for answer in sent] == [201, 201]
    assert "idempotent-replayed" not in sent[0].headers
    assert sent[1].headers["idempotent-replayed"] == "true"
    assert len(upstream.actions("ord-81")) == 1
