"""Keys scoped by a verified JWT (`scope_jwt`) through a real gateway in front of the demo
upstream, on a real PostgreSQL, with tokens signed in the test: a token refreshed between a
timeout and its retry keeps the key; two clients are two scopes; a token that fails
verification is refused before anything is claimed or sent."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import asyncpg
import httpx
import pytest

from tests.e2e.conftest import DemoUpstream, GatewayProcess, prefix_route, problem_name, row
from tests.helpers import new_key
from tests.issuer import ISSUER, Issuer


@pytest.fixture(scope="module")
def issuer(module_dir: Path) -> Issuer:
    return Issuer(module_dir / "jwks.json")


@pytest.fixture(scope="module")
def gateway(
    module_dir: Path, database_url: str, upstream: DemoUpstream, issuer: Issuer
) -> Iterator[GatewayProcess]:
    scope = {"issuer": ISSUER, "jwks_file": str(issuer.jwks_file)}
    routes = [prefix_route("paypal", upstream.url, key_header="PayPal-Request-Id",
                           scope_jwt=scope)]  # fmt: skip
    with GatewayProcess(module_dir, database_url, routes) as process:
        yield process


def order(key: str, token: str) -> dict[str, object]:
    return {
        "json": {"intent": "CAPTURE", "amount": {"currency_code": "EUR", "value": "10.00"}},
        "headers": {"PayPal-Request-Id": key, "Authorization": f"Bearer {token}"},
    }


async def test_a_token_refreshed_before_the_retry_keeps_the_key(
    client: httpx.AsyncClient, upstream: DemoUpstream, issuer: Issuer, db: asyncpg.Connection
) -> None:
    key = new_key()
    first = await client.post("/paypal/orders", **order(key, issuer.token()))  # type: ignore[arg-type]
    assert first.status_code == 201
    refreshed = issuer.token(kid="ec-1")  # a new token of the same client, another key even
    retry = await client.post("/paypal/orders", **order(key, refreshed))  # type: ignore[arg-type]
    assert retry.status_code == 201 and retry.headers["idempotent-replayed"] == "true"
    assert retry.content == first.content
    assert len(upstream.actions(key)) == 1
    stored = await row(db, key)
    assert stored is not None and stored["state"] == "completed"


async def test_two_clients_with_one_request_id_are_two_orders(
    client: httpx.AsyncClient, upstream: DemoUpstream, issuer: Issuer
) -> None:
    key = new_key()
    one = await client.post("/paypal/orders", **order(key, issuer.token("client-1")))  # type: ignore[arg-type]
    other = await client.post("/paypal/orders", **order(key, issuer.token("client-2")))  # type: ignore[arg-type]
    assert one.status_code == other.status_code == 201
    assert "idempotent-replayed" not in other.headers
    assert len(upstream.actions(key)) == 2


@pytest.mark.parametrize(
    "token",
    ["expired", "forged", "another-issuer", "none"],
)
async def test_a_token_that_fails_verification_is_401_and_nothing_is_claimed_or_sent(
    client: httpx.AsyncClient, upstream: DemoUpstream, issuer: Issuer, db: asyncpg.Connection,
    tmp_path: Path, token: str,
) -> None:  # fmt: skip
    key = new_key()
    headers = {"PayPal-Request-Id": key}
    match token:
        case "expired":
            headers["Authorization"] = f"Bearer {issuer.token(lifetime=-120)}"
        case "forged":  # signed by a key of the same id that the issuer never published
            headers["Authorization"] = f"Bearer {Issuer(tmp_path / 'forger.json').token()}"
        case "another-issuer":
            other = issuer.token(claims={"iss": "https://evil.test/"})
            headers["Authorization"] = f"Bearer {other}"
    refused = await client.post("/paypal/orders", json={"intent": "CAPTURE"}, headers=headers)
    assert refused.status_code == 401 and problem_name(refused) == "invalid-token"
    assert refused.headers["www-authenticate"].startswith("Bearer")
    assert await row(db, key) is None
    assert upstream.actions(key) == []


async def test_keys_are_read_from_a_jwks_url_and_again_when_the_issuer_rotates(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`jwks_url`: the set is fetched over HTTP (a real server on a socket), and fetched again
    when a token names a key the set lacks."""
    import functools
    import http.server
    import threading

    from oncegate import settings
    from oncegate.service import token_keys, tokens

    served = Issuer(tmp_path / "jwks.json")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/jwks.json"
        route = settings.Route(
            name="paypal", match="/", upstream="http://upstream.test",
            scope_jwt={"issuer": ISSUER, "jwks_url": url},
        )  # fmt: skip
        identities = tokens.Identities([route])
        await identities.start()
        try:
            part = await identities.scope_part(route, [f"Bearer {served.token()}"])
            assert part == [["jwt", ISSUER, "client-1"]]
            served.add("ec-2", "ES256")
            monkeypatch.setattr(token_keys, "MIN_REFRESH", 0.0)
            rotated = f"Bearer {served.token('client-1', 'ec-2')}"
            assert await identities.scope_part(route, [rotated]) == part
        finally:
            await identities.close()
    finally:
        server.shutdown()
        server.server_close()
