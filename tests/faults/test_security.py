"""The security review's checks (docs/security.md says what they defend against).

- Scopes: one key from two credentials and from a client with none is three keys; no client is
  answered with another's record, and only the admin API (with its token) lists all three.
- Stored headers never hold `Authorization`, `Cookie` or `Set-Cookie` (`Set-Cookie2` neither),
  checked in the database rows themselves, whatever the upstream sends back.
- Log lines never hold bodies, credentials, cookies, query strings or the admin token, on every
  path: forwarded, replayed, mismatch, malformed key, body too large, upstream down, timeout,
  admin calls.
- The admin token is compared with `hmac.compare_digest` over the whole values; odd tokens
  (non-ASCII bytes, another length, another scheme) get 401, never 500.
- The proxy port does not serve the admin API.

`tests/e2e/test_proxy.py::test_the_same_key_from_two_clients_is_two_keys` and
`tests/e2e/test_admin.py::test_one_json_log_line_per_request_without_bodies_or_credentials` are
the first versions of the scope and log checks; these extend them.
"""

from __future__ import annotations

import asyncio
import inspect
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest
from fastapi.security import HTTPAuthorizationCredentials

from oncegate.http import admin as admin_api
from oncegate.model import errors
from tests.e2e.conftest import prefix_route
from tests.faults.conftest import ADMIN_TOKEN, DemoUpstream, GatewayProcess, admin_get
from tests.helpers import free_port, new_key

CREDENTIAL_HEADERS = {"authorization", "cookie", "set-cookie", "set-cookie2"}


@pytest.fixture(scope="module")
def gateway(
    module_dir: Path, database_url: str, upstream: DemoUpstream
) -> Iterator[GatewayProcess]:
    def route(name: str, **options: Any) -> dict[str, Any]:
        return prefix_route(name, **{"upstream": upstream.url, **options})

    routes = [
        route("pay"),
        route("small", max_body="1KiB"),
        route("slow", timeout="0.5s"),
        route("dead", upstream=f"http://127.0.0.1:{free_port()}"),
    ]
    with GatewayProcess(module_dir, database_url, routes, admin_token=ADMIN_TOKEN) as process:
        yield process


async def test_one_key_from_two_credentials_and_none_is_three_keys(
    gateway: GatewayProcess, client: httpx.AsyncClient, upstream: DemoUpstream
) -> None:
    key = new_key()
    clients = {
        "alice": {"Authorization": "Bearer alice"},
        "bob": {"Authorization": "Bearer bob"},
        "anonymous": {},
    }
    first: dict[str, str] = {}
    for name, credential in clients.items():
        response = await client.post(
            "/pay/charges", json={"amount": 1}, headers={"Idempotency-Key": key, **credential}
        )
        assert response.status_code == 201 and "idempotent-replayed" not in response.headers
        first[name] = response.json()["id"]
    assert len(set(first.values())) == 3  # three actions: nobody got another's answer
    for name, credential in clients.items():
        retry = await client.post(
            "/pay/charges", json={"amount": 1}, headers={"Idempotency-Key": key, **credential}
        )
        assert retry.headers["idempotent-replayed"] == "true"
        assert retry.json()["id"] == first[name]  # each its own record
    # A different request under the same key is refused in each scope on its own terms only.
    other = await client.post(
        "/pay/charges",
        json={"amount": 2},
        headers={"Idempotency-Key": key, "Authorization": "Bearer carol"},
    )
    assert other.status_code == 201 and other.json()["id"] not in first.values()
    assert len(upstream.actions(key)) == 4

    async with gateway.admin_client() as admin:
        listed = (await admin.get("/admin/keys", params={"key": key})).json()["records"]
        assert len(listed) == 4 and len({record["id"] for record in listed}) == 4
        assert all(record["body"] is None for record in listed)  # bodies only when asked
        async with httpx.AsyncClient(base_url=gateway.admin_url) as anyone:
            for headers in ({}, {"Authorization": "Bearer alice"}):
                refused = await anyone.get("/admin/keys", params={"key": key}, headers=headers)
                assert refused.status_code == 401


async def test_stored_headers_never_hold_credentials(
    gateway: GatewayProcess, client: httpx.AsyncClient, db: asyncpg.Connection
) -> None:
    key = new_key()
    sent_back = [
        "Set-Cookie:session=s3cr3t",
        "Set-Cookie2:old=1",
        "Authorization:Bearer up",
        "Cookie:c=1",
        "X-Kept:yes",
    ]
    query = "&".join(f"header={value}" for value in sent_back)
    headers = {
        "Idempotency-Key": key,
        "Authorization": "Bearer client-secret",
        "Cookie": "client-cookie=1",
    }
    first = await client.post(f"/pay/charges?{query}", json={}, headers=headers)
    assert first.status_code == 201
    assert first.headers["set-cookie"] == "session=s3cr3t"  # the first caller gets its cookie
    stored = await db.fetchval("SELECT response_headers FROM oncegate_keys WHERE key = $1", key)
    names = {name.lower() for name, _ in json.loads(stored)}
    assert "x-kept" in names
    assert not names & CREDENTIAL_HEADERS, names
    everything = await db.fetchrow("SELECT * FROM oncegate_keys WHERE key = $1", key)
    flat = repr(dict(everything))
    assert "client-secret" not in flat and "client-cookie" not in flat and "s3cr3t" not in flat
    replay = await client.post(f"/pay/charges?{query}", json={}, headers=headers)
    assert replay.headers["idempotent-replayed"] == "true"
    assert not {name.lower() for name in replay.headers} & CREDENTIAL_HEADERS


async def test_logs_never_hold_bodies_credentials_queries_or_the_admin_token(
    gateway: GatewayProcess, client: httpx.AsyncClient
) -> None:
    secret, cookie, marker = "Bearer log-secret-" + new_key(), "c=" + new_key(), new_key()
    query = "api_key=" + new_key()
    sensitive = {"Authorization": secret, "Cookie": cookie, "Content-Type": "application/json"}
    body = json.dumps({"marker": marker}).encode()

    async def post(path: str, key: str | None, content: bytes = body, **extra: str) -> int:
        headers = {**sensitive, **extra, **({"Idempotency-Key": key} if key else {})}
        response = await client.post(f"{path}?{query}", content=content, headers=headers)
        return response.status_code

    key = new_key()
    observed = [
        await post("/pay/charges", key),  # forwarded
        await post("/pay/charges", key),  # replayed
        await post("/pay/charges", key, content=body + b" "),  # same JSON: replayed
        await post("/pay/charges", key, content=b'{"marker": "other"}'),  # mismatch
        await post("/pay/charges", f"bad,{marker}"),  # malformed key
        await post("/pay/charges", None),  # missing key
        await post("/small/charges", new_key(), content=marker.encode() * 100),  # too large
        await post("/dead/charges", new_key()),  # upstream refuses
        await post("/slow/charges", new_key(), **{"X-Demo-Delay": "1"}),  # timeout
        await post("/nowhere", new_key()),  # no route
    ]
    assert observed == [201, 201, 201, 422, 400, 400, 413, 502, 504, 404]
    async with gateway.admin_client() as admin:
        assert (await admin.get("/admin/keys", params={"key": key, "body": 1})).is_success
    await asyncio.sleep(0.3)  # let the lines reach the file
    output = gateway.process.output()
    for needle in (secret, "log-secret", cookie, marker, query, ADMIN_TOKEN):
        assert needle not in output, f"{needle!r} is in the log"
    request_lines = [
        json.loads(line)
        for line in output.splitlines()
        if line.startswith("{") and '"oncegate.request"' in line
    ]
    assert len(request_lines) >= len(observed)
    assert all(
        set(line)
        <= {
            "time",
            "level",
            "logger",
            "message",
            "route",
            "method",
            "outcome",
            "status",
            "upstream_ms",
            "total_ms",
            "request_id",
        }
        for line in request_lines
    )


async def test_the_admin_token_is_compared_in_constant_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    compared: list[tuple[bytes, bytes]] = []
    real = admin_api.hmac.compare_digest

    def spy(given: bytes, expected: bytes) -> bool:
        compared.append((given, expected))
        return real(given, expected)

    monkeypatch.setattr(admin_api.hmac, "compare_digest", spy)

    class Settings:
        admin_token = ADMIN_TOKEN

    class Runtime:
        settings = Settings()

    async def check(token: str | None) -> int:
        credentials = (
            HTTPAuthorizationCredentials(scheme="Bearer", credentials=token) if token else None
        )
        try:
            decision = admin_api.require_admin(Runtime(), credentials)  # type: ignore[arg-type]
            if inspect.isawaitable(decision):  # the dependency may be sync or async
                await decision
        except errors.GatewayError as refused:
            return refused.status_code
        return 200

    assert await check(ADMIN_TOKEN) == 200
    assert await check(ADMIN_TOKEN[:-1]) == 401  # a prefix
    assert await check(ADMIN_TOKEN + "x") == 401  # longer
    assert await check("x" * len(ADMIN_TOKEN)) == 401  # same length
    assert await check(None) == 401
    assert await check("caf\xe9") == 401  # not ASCII
    # Every decision went through compare_digest, with the whole given and expected values.
    assert [expected for _, expected in compared] == [ADMIN_TOKEN.encode()] * 6
    assert compared[1][0] == ADMIN_TOKEN[:-1].encode()


@pytest.mark.parametrize(
    "authorization",
    [
        b"Bearer caf\xe9",
        b"Bearer " + b"\xff" * 40,
        b"bearer " + ADMIN_TOKEN.encode() + b"x",
        b"Basic " + ADMIN_TOKEN.encode(),
        b"Bearer",
        b"Bearer  " + b"a" * 10000,
    ],
    ids=["latin-1", "0xff", "lower-case-scheme-wrong", "basic", "no-token", "10k"],
)
def test_odd_admin_credentials_get_401_never_500(
    gateway: GatewayProcess, authorization: bytes
) -> None:
    answer = admin_get(gateway.admin_port, "/admin/keys?key=k", b"Authorization: " + authorization)
    assert answer.startswith(b"HTTP/1.1 401"), answer[:200]


async def test_the_proxy_port_does_not_serve_the_admin_api(
    gateway: GatewayProcess, client: httpx.AsyncClient
) -> None:
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    for path in ("/admin/keys", "/pay/admin/keys"):
        response = await client.get(path, params={"key": "k"}, headers=headers)
        assert "records" not in response.text
        assert response.status_code in (404, 405)
