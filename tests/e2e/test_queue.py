"""The operator's queue of unknown keys (contract section 9), on a real gateway: the listing on the
admin API, the gauge `oncegate_keys`, `oncegate keys` from a terminal, and `/admin/ui` in plain
HTTP and in a real headless Chromium.

Keys turn `unknown` the way they do in production: the route's upstream timeout (1 s) runs out
while the demo upstream takes 3 s, after the request was sent. Each test uses a route of its own,
so the queue it reads holds its own keys only.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from datetime import datetime
from pathlib import Path

import asyncpg
import httpx
import pytest

from tests.e2e import browser
from tests.e2e.conftest import DemoUpstream, GatewayProcess, prefix_route, problem_name

TOKEN = "queue-admin-token"
QUEUE_ROUTES = ("lost", "gauge", "cli", "page", "browser")


@pytest.fixture(scope="module")
def gateway(
    module_dir: Path, database_url: str, upstream: DemoUpstream
) -> Iterator[GatewayProcess]:
    routes = [prefix_route(name, upstream.url, timeout="1s") for name in QUEUE_ROUTES]
    with GatewayProcess(
        module_dir,
        database_url,
        routes,
        admin_token=TOKEN,
        env={"ONCEGATE_KEY_COUNT_INTERVAL": "0.3s"},
    ) as process:
        yield process


@pytest.fixture
async def admin(gateway: GatewayProcess) -> AsyncIterator[httpx.AsyncClient]:
    async with gateway.admin_client() as client:
        yield client


CHARGE = {"amount": 81}


async def make_unknown(client: httpx.AsyncClient, route: str, count: int) -> list[str]:
    """`count` keys whose request reached the upstream and whose answer was lost (a timeout)."""
    keys = [str(uuid.uuid4()) for _ in range(count)]
    answers = await asyncio.gather(
        *(
            client.post(
                f"/{route}/charges",
                json=CHARGE,
                headers={"Idempotency-Key": key, "X-Demo-Delay": "3"},
            )
            for key in keys
        )
    )
    assert [answer.status_code for answer in answers] == [504] * count
    return keys


def moment(text: str) -> datetime:
    return datetime.fromisoformat(text)


# --- GET /admin/keys?state= ------------------------------------------------------------------


async def test_the_queue_lists_unknown_keys_oldest_first_page_by_page(
    client: httpx.AsyncClient, admin: httpx.AsyncClient
) -> None:
    made = await make_unknown(client, "lost", 3)
    query = {"state": "unknown", "route": "lost", "limit": "2"}
    first = (await admin.get("/admin/keys", params=query)).json()
    assert len(first["records"]) == 2 and first["next_cursor"]
    second = (
        await admin.get("/admin/keys", params={**query, "cursor": first["next_cursor"]})
    ).json()
    assert len(second["records"]) == 1 and second["next_cursor"] is None
    records = first["records"] + second["records"]

    assert sorted(record["key"] for record in records) == sorted(made)
    order = [(moment(record["created_at"]), record["id"]) for record in records]
    assert order == sorted(order), "oldest first"
    for record in records:
        assert (record["route"], record["state"], record["cause"]) == (
            "lost",
            "unknown",
            "answer_lost",
        )
        assert record["status"] is None  # the answer was lost
        assert moment(record["expires_at"]) > moment(record["created_at"])

    # `since` takes the keys created at or after it: those of records[1] on, and any made in the
    # same claim statement as it (one transaction, one `now()`: under load the three share one).
    since = {**query, "since": records[1]["created_at"], "limit": "10"}
    cut = moment(records[1]["created_at"])
    expected = [record for record in records if moment(record["created_at"]) >= cut]
    assert expected[-2:] == records[1:]
    assert (await admin.get("/admin/keys", params=since)).json()["records"] == expected
    one = await admin.get(f"/admin/keys/{records[0]['id']}")
    assert one.json() == records[0]
    # The look-up by key still answers as before, in every scope.
    (found,) = (await admin.get("/admin/keys", params={"key": made[0]})).json()["records"]
    assert (found["key"], found["state"]) == (made[0], "unknown")


# Within the years 1 to 9999 where they are, outside them in UTC.
EARLIEST, LATEST = "0001-01-01T00:00:00+05:00", "9999-12-31T23:59:59-05:00"


def edge_cursor(moment: str) -> str:
    """A cursor as the gateway spells them, for a moment at the edge of the calendar."""
    return base64.urlsafe_b64encode(f"{moment}|1".encode()).decode().rstrip("=")


@pytest.mark.parametrize(
    ("path", "params", "status"),
    [
        ("/admin/keys", {"state": "expired"}, 400),
        ("/admin/keys", {"state": "unknown", "cursor": "not-a-cursor"}, 400),
        ("/admin/keys", {"state": "unknown", "since": "2026-12-03T06:00:00"}, 400),  # no zone
        ("/admin/keys", {"state": "unknown", "since": "yesterday"}, 400),
        # Moments whose UTC falls outside the years 1 to 9999: bad input, not an outage.
        ("/admin/keys", {"state": "unknown", "since": EARLIEST}, 400),
        ("/admin/keys", {"state": "unknown", "since": LATEST}, 400),
        ("/admin/keys", {"state": "unknown", "cursor": edge_cursor(EARLIEST)}, 400),
        ("/admin/keys", {"state": "unknown", "cursor": edge_cursor(LATEST)}, 400),
        ("/admin/keys", {"state": "unknown", "limit": "0"}, 400),
        ("/admin/keys", {"state": "unknown", "route": "no such route!"}, 400),
        ("/admin/keys", {"state": "unknown", "key": "k"}, 400),
        ("/admin/keys/999999999", {}, 404),
        ("/admin/keys/0", {}, 404),
    ],
)
async def test_bad_queue_input_is_a_named_problem(
    admin: httpx.AsyncClient,
    gateway: GatewayProcess,
    path: str,
    params: dict[str, str],
    status: int,
) -> None:
    response = await admin.get(path, params=params)
    assert response.status_code == status, response.text
    assert problem_name(response) == ("not-found" if status == 404 else "invalid-request")
    assert " failed: " not in gateway.process.output()  # nothing reached the store as an error
    assert "unavailable" not in gateway.process.output()


@pytest.mark.parametrize("since", [EARLIEST, LATEST, "800000d", "99999999999d"])
async def test_an_edge_date_is_refused_with_a_message_by_the_page_and_the_cli(
    gateway: GatewayProcess, since: str
) -> None:
    async with httpx.AsyncClient(base_url=gateway.admin_url) as browser_like:
        await browser_like.post("/admin/ui/login", data={"token": TOKEN})
        if not since.endswith("d"):
            page = await browser_like.get("/admin/ui", params={"since": since})
            assert page.status_code == 400 and "outside the years 1 to 9999" in page.text
    status, out, error = await oncegate_keys(gateway, "list", "--since", since)
    assert status == 2 and out == "", error
    assert f"--since {since!r}" in error and "Traceback" not in error
    assert "unavailable" not in gateway.process.output()


async def test_the_queue_needs_the_token(gateway: GatewayProcess) -> None:
    async with httpx.AsyncClient(base_url=gateway.admin_url) as plain:
        refused = await plain.get("/admin/keys", params={"state": "unknown"})
        assert refused.status_code == 401 and problem_name(refused) == "unauthorized"
        assert (await plain.get("/admin/keys/1")).status_code == 401


# --- The gauge -------------------------------------------------------------------------------


async def test_the_gauge_counts_the_keys_of_every_state(
    client: httpx.AsyncClient, gateway: GatewayProcess, db: asyncpg.Connection
) -> None:
    await make_unknown(client, "gauge", 1)
    completed = await client.post(
        "/gauge/charges", json=CHARGE, headers={"Idempotency-Key": str(uuid.uuid4())}
    )
    assert completed.status_code == 201
    expected = {
        row["state"]: row["count"]
        for row in await db.fetch(
            "SELECT oncegate_key_state(state, lease_expires_at, expires_at) AS state, count(*)"
            " FROM oncegate_keys GROUP BY 1"
        )
    }
    assert expected["unknown"] >= 1 and expected["completed"] >= 1
    wanted = {
        state: float(expected.get(state, 0)) for state in ("in_progress", "completed", "unknown")
    }
    shown: dict[str, float] = {}
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 30
    async with httpx.AsyncClient(base_url=gateway.admin_url) as plain:
        while loop.time() < deadline:
            text = (await plain.get("/metrics")).text
            shown = {
                match.group(1): float(match.group(2))
                for match in re.finditer(r'^oncegate_keys\{state="(\w+)"\} (\S+)$', text, re.M)
            }
            if shown == wanted:
                break
            await asyncio.sleep(0.2)
    assert shown == wanted


# --- oncegate keys ---------------------------------------------------------------------------


async def oncegate_keys(
    gateway: GatewayProcess, *args: str, token: str | None = TOKEN
) -> tuple[int, str, str]:
    environment = {
        name: value for name, value in os.environ.items() if name != "ONCEGATE_ADMIN_TOKEN"
    }
    if token is not None:
        environment["ONCEGATE_ADMIN_TOKEN"] = token
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "oncegate.cli", "keys", "--admin-url", gateway.admin_url, *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=environment,
    )  # fmt: skip
    out, err = await process.communicate()
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


async def test_oncegate_keys_lists_shows_resolves_and_releases(
    gateway: GatewayProcess, client: httpx.AsyncClient, upstream: DemoUpstream
) -> None:
    performed, not_performed = await make_unknown(client, "cli", 2)

    status, table, _ = await oncegate_keys(gateway, "list", "--route", "cli")
    assert status == 0
    header, *lines = table.splitlines()
    assert header.split() == ["id", "route", "key", "state", "cause", "created_at", "expires_at"]
    assert sorted(line.split()[2] for line in lines) == sorted([performed, not_performed])
    assert all(line.split()[4] == "answer_lost" for line in lines)

    status, listed, _ = await oncegate_keys(
        gateway, "list", "--route", "cli", "--since", "1h", "--json"
    )
    assert status == 0
    ids = {record["key"]: record["id"] for record in json.loads(listed)}
    assert set(ids) == {performed, not_performed}

    status, shown, _ = await oncegate_keys(gateway, "show", str(ids[performed]))
    assert status == 0
    assert json.loads(shown)["cause"] == "answer_lost"

    receipt = '{"receipt": "ch_81"}'
    status, _, error = await oncegate_keys(
        gateway, "resolve", str(ids[performed]), "--status", "201",
        "--header", "Content-Type: application/json", "--body", receipt,
    )  # fmt: skip
    assert status == 0, error
    replayed = await client.post(
        "/cli/charges", json=CHARGE, headers={"Idempotency-Key": performed}
    )
    assert (replayed.status_code, replayed.text) == (201, receipt)
    assert replayed.headers["idempotent-replayed"] == "true"

    status, _, error = await oncegate_keys(gateway, "release", str(ids[not_performed]))
    assert status == 0, error
    retried = await client.post(
        "/cli/charges", json=CHARGE, headers={"Idempotency-Key": not_performed}
    )
    assert retried.status_code == 201 and "idempotent-replayed" not in retried.headers
    assert len(upstream.actions(not_performed)) == 2  # the lost one and the retry

    status, _, error = await oncegate_keys(gateway, "release", str(ids[performed]))
    assert status == 1 and "not in state unknown" in error
    status, table, _ = await oncegate_keys(gateway, "list", "--route", "cli")
    assert (status, table) == (0, "no unknown keys\n")
    status, listed, _ = await oncegate_keys(gateway, "list", "--route", "cli", "--json")
    assert (status, json.loads(listed)) == (0, [])  # an empty queue is an empty array


async def test_oncegate_keys_needs_the_right_token(gateway: GatewayProcess) -> None:
    status, _, error = await oncegate_keys(gateway, "list", token=None)
    assert status == 2 and "ONCEGATE_ADMIN_TOKEN" in error
    status, _, error = await oncegate_keys(gateway, "list", token="wrong")
    assert status == 1 and "(401)" in error


# --- /admin/ui over plain HTTP ---------------------------------------------------------------


def csrf_of(page: str) -> str:
    found = re.search(r'name="csrf" value="([0-9a-f]+)"', page)
    assert found, page
    return found.group(1)


async def test_the_page_needs_a_login_and_its_forms_a_csrf_token(
    gateway: GatewayProcess, client: httpx.AsyncClient, admin: httpx.AsyncClient
) -> None:
    (key,) = await make_unknown(client, "page", 1)
    (record,) = (
        await admin.get("/admin/keys", params={"state": "unknown", "route": "page"})
    ).json()["records"]
    target = f"/admin/ui/keys/{record['id']}/resolve"
    form = {"Content-Type": "application/x-www-form-urlencoded"}

    async with httpx.AsyncClient(base_url=gateway.admin_url) as browser_like:
        login = await browser_like.get("/admin/ui")
        assert login.status_code == 401 and 'name="token"' in login.text
        assert login.headers["content-type"].startswith("text/html")
        assert "default-src 'none'" in login.headers["content-security-policy"]
        assert "<script" not in login.text
        wrong = await browser_like.post("/admin/ui/login", data={"token": "wrong"})
        assert wrong.status_code == 401 and "oncegate_session" not in wrong.headers.get(
            "set-cookie", ""
        )

        logged_in = await browser_like.post("/admin/ui/login", data={"token": TOKEN})
        assert logged_in.status_code == 303
        cookie = logged_in.headers["set-cookie"]
        assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Path=/admin/ui" in cookie
        assert TOKEN not in cookie
        queue = await browser_like.get("/admin/ui", params={"route": "page"})
        assert queue.status_code == 200 and key in queue.text and "answer lost" in queue.text
        details = await browser_like.get(f"/admin/ui/keys/{record['id']}")
        csrf = csrf_of(details.text)

        forged = await browser_like.post(target, content="action=release", headers=form)
        assert forged.status_code == 403
        invalid = await browser_like.post(
            target, data={"csrf": csrf, "action": "complete", "status": "abc"}
        )
        assert invalid.status_code == 422
        assert (await admin.get(f"/admin/keys/{record['id']}")).json()["state"] == "unknown"

        settled = await browser_like.post(
            target,
            data={
                "csrf": csrf,
                "action": "complete",
                "status": "201",
                "headers": "Content-Type: text/plain",
                "body": "done",
            },
        )
        assert settled.status_code == 303
        assert settled.headers["location"] == f"/admin/ui?settled={record['id']}&action=complete"
    after = (await admin.get(f"/admin/keys/{record['id']}")).json()
    assert (after["state"], after["status"]) == ("completed", 201)
    replayed = await client.post("/page/charges", json=CHARGE, headers={"Idempotency-Key": key})
    assert (replayed.status_code, replayed.text) == (201, "done")

    async with httpx.AsyncClient(base_url=gateway.admin_url) as stranger:
        stranger.cookies.set("oncegate_session", "9999999999.forged", path="/admin/ui")
        assert (await stranger.get("/admin/ui")).status_code == 401


# --- /admin/ui in a real browser -------------------------------------------------------------


@pytest.mark.timeout(240)
async def test_an_operator_releases_a_key_in_a_real_browser(
    gateway: GatewayProcess, client: httpx.AsyncClient, admin: httpx.AsyncClient, module_dir: Path
) -> None:
    if browser.binary() is None:
        pytest.skip(
            f"chromium is not installed (Debian: {browser.INSTALL}); `make test` installs it"
        )
    keys = await make_unknown(client, "browser", 2)
    chromium = browser.Chromium(module_dir)
    try:
        await chromium.start()
        tab = await chromium.new_tab()
        await tab.navigate(f"{gateway.admin_url}/admin/ui?route=browser")
        assert await tab.evaluate("document.title") == "log in · oncegate"
        await tab.submit(
            f"document.querySelector('input[name=token]').value = {json.dumps(TOKEN)};"
            "document.querySelector('form[action=\"/admin/ui/login\"] button').click()"
        )
        await tab.navigate(f"{gateway.admin_url}/admin/ui?route=browser")
        text = await tab.evaluate("document.body.innerText")
        assert all(key in text for key in keys), text
        queue_image = await tab.screenshot(module_dir / "admin-ui-queue.png")
        scripts = [await tab.evaluate("document.scripts.length")]

        await tab.submit("document.querySelector('a[href^=\"/admin/ui/keys/\"]').click()")
        shown_key = await tab.evaluate("document.querySelector('td code').textContent")
        assert shown_key in keys
        record_id = int(await tab.evaluate("document.title.split(' ')[1]"))
        key_image = await tab.screenshot(module_dir / "admin-ui-key.png")
        scripts.append(await tab.evaluate("document.scripts.length"))

        await tab.submit(
            "document.querySelector('input[value=release]').form.querySelector('button').click()"
        )
        assert f"Key {record_id} released" in await tab.evaluate("document.body.innerText")
        scripts.append(await tab.evaluate("document.scripts.length"))
        requests = list(tab.requests)
    finally:
        await chromium.close()

    assert (await admin.get(f"/admin/keys/{record_id}")).status_code == 404  # released
    for image in (queue_image, key_image):
        assert image.startswith(b"\x89PNG\r\n\x1a\n") and len(image) > 1000
    assert scripts == [0, 0, 0]
    assert [request for request in requests if request.kind == "Script"] == []
    elsewhere = [
        request.url
        for request in requests
        if not request.url.startswith(gateway.admin_url + "/") and request.url != "about:blank"
    ]
    assert elsewhere == [], "the page loaded something from another origin"
    assert {request.kind for request in requests} >= {"Document", "Stylesheet"}
