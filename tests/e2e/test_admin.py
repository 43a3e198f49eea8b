"""The admin port (contract sections 6 and 7): health, readiness, the admin API and its token, no
generated documentation, and every counter's exact value after a scripted mix of requests."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from oncegate.store import migrate
from tests.e2e.conftest import DemoUpstream, GatewayProcess, problem_name
from tests.helpers import new_key, scrape, value

# On the embedded PostgreSQL and on a Citus cluster (`backend`, tests/conftest.py).
# On Citus too in `make test-all`: these tests are about the gateway, not the store (the
# store's own suite runs on Citus in `make test`, tests/store/test_conformance.py).
pytestmark = pytest.mark.citus(slow=True)

TOKEN = "s3cret-admin-token"


def route_config(upstream: str) -> list[dict[str, Any]]:
    return [
        {"name": "mail", "match": "/mail", "upstream": upstream, "strip_prefix": True},
        {"name": "slow", "match": "/slow", "upstream": upstream, "strip_prefix": True,
         "timeout": "1s"},
    ]  # fmt: skip


@pytest.fixture(scope="module")
def gateway(
    module_dir: Path, database_url: str, upstream: DemoUpstream
) -> Iterator[GatewayProcess]:
    with GatewayProcess(
        module_dir, database_url, route_config(upstream.url), admin_token=TOKEN
    ) as process:
        yield process


@pytest.fixture
async def admin(gateway: GatewayProcess) -> AsyncIterator[httpx.AsyncClient]:
    async with gateway.admin_client() as client:
        yield client


async def test_health_and_readiness(gateway: GatewayProcess) -> None:
    async with httpx.AsyncClient(base_url=gateway.admin_url) as plain:
        assert (await plain.get("/healthz")).status_code == 200
        ready = await plain.get("/readyz")
        assert ready.status_code == 200
        assert ready.json() == {"status": "ok", "revision": migrate.head()}
        metrics = await plain.get("/metrics")
        assert metrics.status_code == 200
        assert metrics.headers["content-type"].startswith("text/plain")


async def test_the_admin_port_serves_no_generated_documentation(gateway: GatewayProcess) -> None:
    # Swagger UI loads its script from a public CDN, on the origin of the operator's page.
    async with httpx.AsyncClient(base_url=gateway.admin_url) as plain:
        for path in ("/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect"):
            response = await plain.get(path)
            assert response.status_code == 404, path
            assert problem_name(response) == "not-found"
            assert "swagger" not in response.text.lower()


async def test_the_admin_api_needs_the_token(gateway: GatewayProcess) -> None:
    async with httpx.AsyncClient(base_url=gateway.admin_url) as plain:
        missing = await plain.get("/admin/keys", params={"key": "k"})
        assert missing.status_code == 401
        assert missing.headers["www-authenticate"] == "Bearer"
        wrong = await plain.get(
            "/admin/keys", params={"key": "k"}, headers={"Authorization": "Bearer nope"}
        )
        assert wrong.status_code == 401
        assert (await plain.delete("/admin/keys/1")).status_code == 401


async def test_without_a_token_the_admin_api_does_not_exist(
    module_dir: Path, database_url: str, upstream: DemoUpstream
) -> None:
    tokenless = GatewayProcess(
        module_dir, database_url, route_config(upstream.url), name="tokenless"
    )
    try:
        async with httpx.AsyncClient(base_url=tokenless.admin_url) as plain:
            for headers in ({}, {"Authorization": "Bearer anything"}):
                response = await plain.get("/admin/keys", params={"key": "k"}, headers=headers)
                assert response.status_code == 404
                assert problem_name(response) == "admin-disabled"
                assert "ONCEGATE_ADMIN_TOKEN" in response.json()["detail"]
            assert (await plain.get("/healthz")).status_code == 200
    finally:
        tokenless.stop()


async def test_a_key_is_listed_in_every_scope_bodies_only_when_asked(
    client: httpx.AsyncClient, admin: httpx.AsyncClient
) -> None:
    key = new_key()
    for tenant in ("alice", "bob"):
        response = await client.post(
            "/mail/emails",
            json={"to": tenant},
            headers={"Idempotency-Key": key, "Authorization": f"Bearer {tenant}"},
        )
        assert response.status_code == 201
    listed = (await admin.get("/admin/keys", params={"key": key})).json()["records"]
    assert len(listed) == 2
    for record in listed:
        assert (record["route"], record["key"], record["state"], record["status"]) == (
            "mail", key, "completed", 201,
        )  # fmt: skip
        assert record["body"] is None and record["headers"] is None
    with_body = (await admin.get("/admin/keys", params={"key": key, "body": 1})).json()["records"]
    assert {json_body["body"].count('"to"') for json_body in with_body} == {1}
    for record in with_body:
        names = {name.lower() for name, _ in record["headers"]}
        assert not names & {"authorization", "cookie", "set-cookie"}
    other_route = await admin.get("/admin/keys", params={"key": key, "route": "slow"})
    assert other_route.json() == {"records": []}


async def unknown_key(client: httpx.AsyncClient, admin: httpx.AsyncClient) -> tuple[str, int]:
    key = new_key()
    lost = await client.post(
        "/slow/charges", json={}, headers={"Idempotency-Key": key, "X-Demo-Delay": "2"}
    )
    assert lost.status_code == 504
    (record,) = (await admin.get("/admin/keys", params={"key": key})).json()["records"]
    assert record["state"] == "unknown"
    return key, record["id"]


async def test_resolving_an_unknown_key_as_completed_replays_the_given_answer(
    client: httpx.AsyncClient, admin: httpx.AsyncClient, upstream: DemoUpstream
) -> None:
    key, record_id = await unknown_key(client, admin)
    resolved = await admin.post(
        f"/admin/keys/{record_id}/resolve",
        json={"action": "complete", "status": 201, "body": '{"id": "ch_manual"}',
              "headers": [["Content-Type", "application/json"], ["Content-Length", "999"],
                          ["Set-Cookie", "session=operator"], ["Connection", "close"]]},
    )  # fmt: skip
    assert resolved.status_code == 200
    replay = await client.post("/slow/charges", json={}, headers={"Idempotency-Key": key})
    assert replay.status_code == 201
    assert replay.headers["idempotent-replayed"] == "true"
    assert replay.json() == {"id": "ch_manual"}
    # Only end-to-end headers are stored: Content-Length is the real one, no cookie is replayed.
    assert replay.headers.get_list("content-length") == [str(len(replay.content))]
    assert "set-cookie" not in replay.headers
    assert len(upstream.actions(key)) == 1
    again = await admin.post(f"/admin/keys/{record_id}/resolve", json={"action": "release"})
    assert again.status_code == 409  # completed now, no longer unknown


async def test_releasing_an_unknown_key_lets_the_next_retry_through(
    client: httpx.AsyncClient, admin: httpx.AsyncClient, upstream: DemoUpstream
) -> None:
    key, record_id = await unknown_key(client, admin)
    blocked = await client.post("/slow/charges", json={}, headers={"Idempotency-Key": key})
    assert blocked.status_code == 409
    released = await admin.post(f"/admin/keys/{record_id}/resolve", json={"action": "release"})
    assert released.status_code == 200
    retry = await client.post("/slow/charges", json={}, headers={"Idempotency-Key": key})
    assert retry.status_code == 201 and "idempotent-replayed" not in retry.headers
    assert len(upstream.actions(key)) == 2


async def test_delete_refuses_a_key_whose_request_is_in_flight(
    client: httpx.AsyncClient, admin: httpx.AsyncClient, upstream: DemoUpstream
) -> None:
    key = new_key()
    slow = asyncio.create_task(
        client.post("/mail/emails", json={}, headers={"Idempotency-Key": key, "X-Demo-Delay": "2"})
    )
    records: list[dict[str, Any]] = []
    for _ in range(100):
        records = (await admin.get("/admin/keys", params={"key": key})).json()["records"]
        if records:
            break
        await asyncio.sleep(0.05)
    (record,) = records
    refused = await admin.delete(f"/admin/keys/{record['id']}")
    assert refused.status_code == 409
    assert (await slow).status_code == 201
    assert (await admin.delete(f"/admin/keys/{record['id']}")).status_code == 204
    assert len(upstream.actions(key)) == 1


async def test_bad_resolutions_are_refused(admin: httpx.AsyncClient) -> None:
    no_status = await admin.post("/admin/keys/1/resolve", json={"action": "complete"})
    assert no_status.status_code == 422 and problem_name(no_status) == "invalid-request"
    bad_action = await admin.post("/admin/keys/1/resolve", json={"action": "forget"})
    assert bad_action.status_code == 422 and problem_name(bad_action) == "invalid-request"
    nowhere = await admin.post("/admin/keys/999999999/resolve", json={"action": "release"})
    assert nowhere.status_code == 404 and problem_name(nowhere) == "not-found"
    for resolution in (
        {"action": "complete", "status": 204, "body": "a 204 has no body"},
        {"action": "complete", "status": 101},
        {"action": "complete", "status": 201, "headers": [["Bad Name", "x"]]},
        {"action": "complete", "status": 201, "headers": [["X-Ok", "line\nbreak"]]},
        {"action": "complete", "status": 201, "body_base64": "not base64!"},
    ):
        refused = await admin.post("/admin/keys/1/resolve", json=resolution)
        assert refused.status_code == 422, resolution
        assert problem_name(refused) == "invalid-request"


@pytest.mark.parametrize(
    "document",
    [
        b'{"action": "complete", "status": 201, "body": "\\udc80"}',
        b'{"action": "complete", "status": 201, "headers": [["X-A", "\\ud800"]]}',
    ],
    ids=["body", "header"],
)
async def test_a_lone_surrogate_in_a_resolution_is_refused_not_a_500(
    admin: httpx.AsyncClient, document: bytes
) -> None:
    refused = await admin.post(
        "/admin/keys/1/resolve", content=document, headers={"Content-Type": "application/json"}
    )
    assert refused.status_code == 422 and problem_name(refused) == "invalid-request"


@pytest.mark.parametrize(
    ("method", "path", "params", "status", "name"),
    [
        ("DELETE", f"/admin/keys/{2**64}", {}, 404, "not-found"),
        ("DELETE", "/admin/keys/-1", {}, 404, "not-found"),
        ("POST", f"/admin/keys/{2**63}/resolve", {}, 404, "not-found"),
        ("DELETE", "/admin/keys/abc", {}, 400, "invalid-request"),
        ("GET", "/admin/keys", {"key": "a\x00b"}, 400, "invalid-request"),
        ("GET", "/admin/keys", {"key": "k", "route": "mail\x00"}, 400, "invalid-request"),
        ("GET", "/admin/keys", {"key": "x" * 256}, 400, "invalid-request"),
        ("GET", "/admin/keys", {}, 400, "invalid-request"),
        ("GET", "/admin/nothing", {}, 404, "not-found"),
    ],
)
async def test_bad_admin_input_is_a_named_problem_never_a_store_error(
    admin: httpx.AsyncClient,
    gateway: GatewayProcess,
    method: str,
    path: str,
    params: dict[str, str],
    status: int,
    name: str,
) -> None:
    json_body = {"action": "release"} if path.endswith("/resolve") else None
    response = await admin.request(method, path, params=params, json=json_body)
    assert response.status_code == status, response.text
    assert problem_name(response) == name
    assert " failed: " not in gateway.process.output()  # no store warning: nothing reached it


async def test_admin_errors_are_problems_like_the_proxy_s(gateway: GatewayProcess) -> None:
    async with httpx.AsyncClient(base_url=gateway.admin_url) as plain:
        missing = await plain.get("/admin/keys", params={"key": "k"})
    assert missing.status_code == 401 and problem_name(missing) == "unauthorized"
    assert missing.headers["www-authenticate"] == "Bearer"


async def test_delete_releases_a_settled_key(
    client: httpx.AsyncClient, admin: httpx.AsyncClient, upstream: DemoUpstream
) -> None:
    key = new_key()
    assert (await client.post("/mail/emails", json={}, headers={"Idempotency-Key": key})).is_success
    (record,) = (await admin.get("/admin/keys", params={"key": key})).json()["records"]
    assert (await admin.delete(f"/admin/keys/{record['id']}")).status_code == 204
    assert (await admin.delete(f"/admin/keys/{record['id']}")).status_code == 404
    again = await client.post("/mail/emails", json={}, headers={"Idempotency-Key": key})
    assert again.status_code == 201 and "idempotent-replayed" not in again.headers
    assert len(upstream.actions(key)) == 2


async def test_every_counter_counts_exactly(
    module_dir: Path, database_url: str, upstream: DemoUpstream
) -> None:
    # A gateway of its own: counters are per process and start at zero.
    counted = GatewayProcess(module_dir, database_url, route_config(upstream.url), name="counted")
    try:
        async with httpx.AsyncClient(base_url=counted.url, timeout=30) as client:
            first, second = new_key(), new_key()

            async def post(path: str, key: str | None, **headers: str) -> httpx.Response:
                if key is not None:
                    headers["Idempotency-Key"] = key
                return await client.post(path, json={"n": 1}, headers=headers)

            assert (await post("/mail/emails", first)).status_code == 201
            for _ in range(3):
                assert (await post("/mail/emails", first)).status_code == 201  # replayed
            slow = asyncio.create_task(post("/mail/emails", second, **{"X-Demo-Delay": "3"}))
            await asyncio.sleep(0.5)
            assert (await post("/mail/emails", second)).status_code == 409  # in progress
            assert (await slow).status_code == 201
            assert (await post("/mail/emails", None)).status_code == 400  # missing
            assert (await post("/mail/emails", "a,b")).status_code == 400  # invalid
            reused = await client.post("/mail/emails", json={"n": 2},
                                       headers={"Idempotency-Key": first})  # fmt: skip
            assert reused.status_code == 422
            assert (await client.get("/mail/actions")).status_code == 200  # passthrough
            lost = new_key()
            assert (await post("/slow/charges", lost, **{"X-Demo-Delay": "2"})).status_code == 504
            assert (await post("/slow/charges", lost)).status_code == 409  # unknown
            assert (await post("/nowhere", new_key())).status_code == 404
        async with httpx.AsyncClient(base_url=counted.admin_url) as plain:
            samples = scrape((await plain.get("/metrics")).text)
    finally:
        counted.stop()

    requests = "oncegate_requests_total"
    expected_requests = {
        ("mail", "POST", "forwarded"): 2,
        ("mail", "POST", "replayed"): 3,
        ("mail", "POST", "in_progress"): 1,
        ("mail", "POST", "missing_key"): 1,
        ("mail", "POST", "invalid_key"): 1,
        ("mail", "POST", "mismatch"): 1,
        ("mail", "GET", "passthrough"): 1,
        ("slow", "POST", "unknown"): 2,
        ("(unmatched)", "POST", "no_route"): 1,
    }
    counted_requests = {
        (dict(labels)["route"], dict(labels)["method"], dict(labels)["outcome"]): sample
        for (name, labels), sample in samples.items()
        if name == requests and sample
    }
    assert counted_requests == expected_requests
    blocked = "oncegate_duplicates_blocked_total"
    assert value(samples, blocked, route="mail", reason="replayed") == 3
    assert value(samples, blocked, route="mail", reason="in_progress") == 1
    assert value(samples, blocked, route="slow", reason="unknown") == 1  # the retry, not the 504
    assert sum(v for (name, _), v in samples.items() if name == blocked) == 5
    # The upstream was called for the 2 forwards and the passthrough on mail, and once on slow
    # (timed out, so no duration was observed there).
    upstream_count = "oncegate_upstream_request_duration_seconds_count"
    assert value(samples, upstream_count, route="mail") == 3
    assert value(samples, upstream_count, route="slow") == 0
    duration_count = "oncegate_request_duration_seconds_count"
    assert value(samples, duration_count, route="mail", outcome="replayed") == 3
    assert value(samples, "oncegate_inflight_requests", route="mail") == 0
    assert value(samples, "oncegate_keys_purged_total") == 0
    claims = value(samples, "oncegate_store_operation_duration_seconds_count", operation="claim")
    assert claims == 2 + 3 + 1 + 1 + 2  # every request that reached the claim


async def test_one_json_log_line_per_request_without_bodies_or_credentials(
    gateway: GatewayProcess, client: httpx.AsyncClient, upstream: DemoUpstream
) -> None:
    key, secret, marker = new_key(), "Bearer tenant-secret-" + new_key(), "body-" + new_key()
    response = await client.post(
        "/mail/emails",
        json={"marker": marker},
        headers={"Idempotency-Key": key, "Authorization": secret, "X-Request-Id": "trace-81"},
    )
    assert response.status_code == 201
    assert response.headers["x-request-id"] == "trace-81"
    assert upstream.actions(key)[0]["request"] == {"marker": marker}
    generated = await client.post("/mail/emails", json={}, headers={"Idempotency-Key": new_key()})
    request_id = generated.headers["x-request-id"]
    assert len(request_id) == 32
    await asyncio.sleep(0.2)  # let the log line reach the file
    output = gateway.process.output()
    assert marker not in output and secret not in output and "tenant-secret" not in output
    lines = [json.loads(line) for line in output.splitlines() if line.startswith("{")]
    by_id = {line.get("request_id"): line for line in lines if line["logger"] == "oncegate.request"}
    traced = by_id["trace-81"]
    assert (traced["route"], traced["method"], traced["outcome"], traced["status"]) == (
        "mail", "POST", "forwarded", 201,
    )  # fmt: skip
    assert traced["upstream_ms"] > 0 and traced["total_ms"] >= traced["upstream_ms"]
    assert by_id[request_id]["outcome"] == "forwarded"
