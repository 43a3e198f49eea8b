"""Sealed answers (contract section 9): `ONCEGATE_ENCRYPTION_KEYS`, rotation, `oncegate rekey`,
tampering, a missing key, and `store: status_only`, on real gateways and a real PostgreSQL whose
rows the tests read directly."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import asyncpg
import httpx
import pytest

from oncegate.kernel import sealing
from oncegate.kernel.sealing import Keyring
from tests.e2e.conftest import DemoUpstream, GatewayProcess, problem_name
from tests.helpers import new_key

OLD = f"k1:{base64.b64encode(os.urandom(32)).decode()}"
NEW = f"k2:{base64.b64encode(os.urandom(32)).decode()}"
SECRET = "card-4242-4242"
ADMIN_TOKEN = "sealed-admin-token"

# On the embedded PostgreSQL and on a Citus cluster (`backend`, tests/conftest.py); the Citus run
# is slow (gateways started again and again).
pytestmark = pytest.mark.citus(slow=True)


def routes(upstream: str) -> list[dict[str, object]]:
    return [
        {"name": "pay", "match": "/", "upstream": upstream},
        {"name": "quiet", "match": "/quiet", "upstream": upstream, "strip_prefix": True,
         "store": "status_only"},
    ]  # fmt: skip


@pytest.fixture(scope="module")
def sealed_gateway(
    module_dir: Path, database_url: str, upstream: DemoUpstream
) -> Iterator[GatewayProcess]:
    with GatewayProcess(module_dir, database_url, routes(upstream.url), name="sealed",
                 admin_token=ADMIN_TOKEN,
                 env={"ONCEGATE_ENCRYPTION_KEYS": OLD}) as gateway:  # fmt: skip
        yield gateway


async def charge(url: str, key: str, path: str = "/charges") -> httpx.Response:
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        return await client.post(
            path, json={"card": SECRET, "amount": 1200}, headers={"Idempotency-Key": key}
        )


async def stored(db: asyncpg.Connection, key: str) -> asyncpg.Record:
    found = await db.fetchrow(
        "SELECT id, sealed_with, sealed_headers, response_headers, response_body,"
        " response_status FROM oncegate_keys WHERE key = $1",
        key,
    )
    assert found is not None
    return found


async def test_the_database_holds_no_plaintext_answer(
    sealed_gateway: GatewayProcess, db: asyncpg.Connection, upstream: DemoUpstream
) -> None:
    key = new_key()
    first = await charge(sealed_gateway.url, key)
    assert first.status_code == 201 and SECRET in first.text  # the receipt echoes the request
    row = await stored(db, key)
    assert row["sealed_with"] == "k1:2" and row["response_headers"] is None
    assert row["response_status"] == 201  # the status alone stays readable
    assert SECRET.encode() not in row["response_body"]
    assert b"application/json" not in row["sealed_headers"]
    assert first.headers["location"].encode() not in row["sealed_headers"]
    replay = await charge(sealed_gateway.url, key)
    assert replay.status_code == 201 and replay.headers["idempotent-replayed"] == "true"
    assert replay.content == first.content
    assert replay.headers["location"] == first.headers["location"]
    assert len(upstream.actions(key)) == 1
    assert "in plaintext" not in sealed_gateway.process.log.read_text()  # sealed: no warning


async def test_a_changed_byte_is_refused_never_replayed_as_garbage_nor_forwarded(
    sealed_gateway: GatewayProcess, db: asyncpg.Connection, upstream: DemoUpstream
) -> None:
    key = new_key()
    assert (await charge(sealed_gateway.url, key)).status_code == 201
    await db.execute(
        "UPDATE oncegate_keys SET response_body = set_byte(response_body, 20,"
        " get_byte(response_body, 20) # 1) WHERE key = $1",
        key,
    )
    refused = await charge(sealed_gateway.url, key)
    assert refused.status_code == 503 and problem_name(refused) == "answer-sealed"
    assert "201" in refused.json()["detail"]  # it was performed
    assert len(upstream.actions(key)) == 1


def rekey(database_url: str) -> subprocess.CompletedProcess[str]:
    """`oncegate rekey` onto NEW, OLD still there to open what it sealed."""
    return subprocess.run(
        [sys.executable, "-m", "oncegate.cli", "rekey", "--batch-size", "2"],
        env={**os.environ, "ONCEGATE_DATABASE_URL": database_url,
             "ONCEGATE_ENCRYPTION_KEYS": f"{NEW},{OLD}"},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("column", "kept"),
    [("response_body", 0), ("response_body", 5), ("sealed_headers", 11), ("sealed_headers", 27)],
)
async def test_a_sealed_value_cut_short_is_answer_sealed_and_rekey_names_it(
    sealed_gateway: GatewayProcess,
    db: asyncpg.Connection,
    upstream: DemoUpstream,
    database_url: str,
    column: str,
    kept: int,
) -> None:
    # Below a nonce (12 bytes) AES-GCM raises ValueError, below a nonce and a tag InvalidTag.
    key = new_key()
    assert (await charge(sealed_gateway.url, key)).status_code == 201
    await db.execute(
        f"UPDATE oncegate_keys SET {column} = substring({column} FROM 1 FOR $2) WHERE key = $1",
        key,
        kept,
    )
    refused = await charge(sealed_gateway.url, key)
    assert refused.status_code == 503 and problem_name(refused) == "answer-sealed"
    assert len(upstream.actions(key)) == 1
    async with sealed_gateway.admin_client() as admin:
        shown = await admin.get("/admin/keys", params={"key": key, "body": "1"})
    assert shown.status_code == 200
    (record,) = shown.json()["records"]
    assert (record["status"], record["body"], record["headers"]) == (201, None, None)
    record_id = (await stored(db, key))["id"]
    rekeyed = await asyncio.to_thread(rekey, database_url)
    assert rekeyed.returncode == 1 and "Traceback" not in rekeyed.stderr
    assert f"key id {record_id}: " in rekeyed.stderr and "cut short" in rekeyed.stderr
    assert "under key 'k2'" in rekeyed.stdout
    # It went on past the row: what is left under the old key is what it could not open.
    left = await db.fetch(
        "SELECT id FROM oncegate_keys WHERE response_stored AND sealed_with IS DISTINCT FROM 'k2:2'"
    )
    named = {int(found) for found in re.findall(r"key id (\d+): ", rekeyed.stderr)}
    assert named == {row["id"] for row in left}
    await db.execute("DELETE FROM oncegate_keys WHERE key = $1", key)  # for the next test


async def test_an_older_answer_of_the_same_row_written_back_is_refused_for_a_new_claim(
    sealed_gateway: GatewayProcess, db: asyncpg.Connection, upstream: DemoUpstream
) -> None:
    key = new_key()
    first = await charge(sealed_gateway.url, key)
    assert first.status_code == 201
    old = await db.fetchrow(
        "SELECT id, fencing_token, sealed_with, sealed_headers, response_body"
        " FROM oncegate_keys WHERE key = $1",
        key,
    )
    # The key expires and is claimed again: the same row, a new claim (token + 1), a new answer.
    # (Times given as values: Citus refuses time arithmetic on columns in an UPDATE.)
    a_day_ago = datetime.now(UTC) - timedelta(days=1)
    await db.execute(
        "UPDATE oncegate_keys SET created_at = $2, completed_at = $2, expires_at = $3"
        " WHERE key = $1",
        key, a_day_ago, a_day_ago + timedelta(hours=1),
    )  # fmt: skip
    second = await charge(sealed_gateway.url, key)
    assert second.status_code == 201 and second.json()["id"] != first.json()["id"]
    now = await db.fetchrow("SELECT id, fencing_token FROM oncegate_keys WHERE key = $1", key)
    assert (now["id"], now["fencing_token"]) == (old["id"], old["fencing_token"] + 1)
    # The first answer's sealed columns written back: bound to the first claim, they do not open.
    await db.execute(
        "UPDATE oncegate_keys SET sealed_with = $2, sealed_headers = $3, response_body = $4"
        " WHERE key = $1",
        key, old["sealed_with"], old["sealed_headers"], old["response_body"],
    )  # fmt: skip
    replay = await charge(sealed_gateway.url, key)
    assert replay.status_code == 503 and problem_name(replay) == "answer-sealed"
    assert first.json()["id"] not in replay.text
    assert len(upstream.actions(key)) == 2  # never forwarded a third time


async def test_an_answer_sealed_before_the_claim_binding_is_refused_until_rekey_binds_it(
    module_dir: Path,
    database_url: str,
    upstream: DemoUpstream,
    sealed_gateway: GatewayProcess,
    db: asyncpg.Connection,
) -> None:
    # What an earlier release stored: sealed under k1, bound to the row alone (sealed_with 'k1').
    key = new_key()
    first = await charge(sealed_gateway.url, key)
    row = await db.fetchrow(
        "SELECT id, scope, response_body FROM oncegate_keys WHERE key = $1", key
    )
    ring = Keyring.parse(OLD)
    cipher = ring._ciphers["k1"]
    scope = bytes(row["scope"])
    headers = sealing._seal(cipher, b'[["content-type", "text/plain"]]',
                            sealing._row_bound(row["id"], scope, b"headers"))  # fmt: skip
    body = sealing._seal(cipher, b"as stored before", sealing._row_bound(row["id"], scope, b"body"))
    await db.execute(
        "UPDATE oncegate_keys SET sealed_with = 'k1', sealed_headers = $2, response_body = $3"
        " WHERE key = $1",
        key, headers, body,
    )  # fmt: skip
    refused = await charge(sealed_gateway.url, key)
    assert refused.status_code == 503 and problem_name(refused) == "answer-sealed"
    assert first.status_code == 201 and len(upstream.actions(key)) == 1
    rekeyed = await asyncio.to_thread(rekey, database_url)
    assert "Traceback" not in rekeyed.stderr
    assert (await stored(db, key))["sealed_with"] == "k2:2"
    with GatewayProcess(module_dir, database_url, routes(upstream.url), name="rebound",
                        env={"ONCEGATE_ENCRYPTION_KEYS": f"{NEW},{OLD}"}) as rebound:  # fmt: skip
        replay = await charge(rebound.url, key)
    assert (replay.status_code, replay.text) == (201, "as stored before")
    assert replay.headers["idempotent-replayed"] == "true"
    assert len(upstream.actions(key)) == 1


async def test_status_only_keeps_status_and_headers_but_no_body(
    sealed_gateway: GatewayProcess, db: asyncpg.Connection, upstream: DemoUpstream
) -> None:
    key = new_key()
    first = await charge(sealed_gateway.url, key, "/quiet/charges")
    assert first.status_code == 201 and SECRET in first.text  # the first caller gets it all
    replay = await charge(sealed_gateway.url, key, "/quiet/charges")
    assert replay.status_code == 201 and replay.content == b""
    assert replay.headers["location"] == first.headers["location"]
    assert len(upstream.actions(key)) == 1


async def test_rotation_and_rekey_retire_the_old_key(
    sealed_gateway: GatewayProcess,
    module_dir: Path,
    database_url: str,
    upstream: DemoUpstream,
    db: asyncpg.Connection,
) -> None:
    old_key = new_key()
    first = await charge(sealed_gateway.url, old_key)
    # Rotated: the new key first, the old one still there to open old rows.
    with GatewayProcess(module_dir, database_url, routes(upstream.url), name="rotated",
                 env={"ONCEGATE_ENCRYPTION_KEYS": f"{NEW},{OLD}"}) as rotated:  # fmt: skip
        assert (await charge(rotated.url, old_key)).content == first.content
        new_key_sent = new_key()
        assert (await charge(rotated.url, new_key_sent)).status_code == 201
        assert (await stored(db, new_key_sent))["sealed_with"] == "k2:2"
    # Without the old key, an old row cannot be opened: 503, and not performed again.
    with GatewayProcess(module_dir, database_url, routes(upstream.url), name="new-only",
                 env={"ONCEGATE_ENCRYPTION_KEYS": NEW}) as new_only:  # fmt: skip
        refused = await charge(new_only.url, old_key)
        assert refused.status_code == 503 and problem_name(refused) == "answer-sealed"
        again = await charge(new_only.url, old_key)
        assert again.status_code == 503
        assert new_only.process.output().count("cannot be opened") == 1  # logged once per key
    # One answer changed in the database: rekey leaves it as it is and says so; the rest moves.
    broken = new_key()
    assert (await charge(sealed_gateway.url, broken)).status_code == 201
    await db.execute(
        "UPDATE oncegate_keys SET sealed_headers = set_byte(sealed_headers, 20,"
        " get_byte(sealed_headers, 20) # 1) WHERE key = $1",
        broken,
    )
    rekeyed = await asyncio.to_thread(rekey, database_url)
    assert rekeyed.returncode == 1 and "under key 'k2'" in rekeyed.stdout
    left = await db.fetch(
        "SELECT id FROM oncegate_keys WHERE response_stored AND sealed_with IS DISTINCT FROM 'k2:2'"
    )
    assert (await stored(db, broken))["id"] in {row["id"] for row in left}
    assert rekeyed.stderr.count("key id ") == len(left)  # every row left behind is named
    assert (await stored(db, old_key))["sealed_with"] == "k2:2"
    with GatewayProcess(module_dir, database_url, routes(upstream.url), name="retired",
                 env={"ONCEGATE_ENCRYPTION_KEYS": NEW}) as retired:  # fmt: skip
        replay = await charge(retired.url, old_key)
        assert replay.status_code == 201 and replay.content == first.content
    assert len(upstream.actions(old_key)) == 1
    assert json.loads(first.content)["idempotency_key"] == old_key


def test_a_bad_key_stops_serve_without_showing_it(tmp_path: Path, database_url: str) -> None:
    short = base64.b64encode(os.urandom(16)).decode()
    result = subprocess.run(
        [sys.executable, "-m", "oncegate.cli", "serve", "--upstream", "http://127.0.0.1:9"],
        env={**os.environ, "ONCEGATE_DATABASE_URL": database_url,
             "ONCEGATE_ENCRYPTION_KEYS": f"k1:{short}"},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2
    assert "AES-256 needs 32" in result.stderr and short not in result.stderr
