"""Every command that takes a database URL takes libpq's multi-host form (contract section 10,
"failover") and follows it to the host that answers: `serve`, `migrate`, `purge`, `rekey`, the
agent's checkpoint store and the lab (its LangGraph runtime too, on psycopg).

The URL used is the tests' PostgreSQL behind a dead first host (`behind_a_dead_host`): the
first host refuses connections, as a primary that died does, so each command must read the host
list and go on to the next. A real failover, primary and standby, is
`tests/faults/test_failover.py`. (`oncegate keys` takes the admin API's URL, not the database's.)
"""

from __future__ import annotations

import base64
import json
import os
import ssl
import subprocess
import sys
from pathlib import Path

import asyncpg
import httpx
import pytest

from oncegate.agent.checkpoints import Checkpoint
from oncegate.settings import database_url as urls
from oncegate.store import migrate
from oncegate.store.checkpoints import PostgresCheckpoints
from tests.e2e.conftest import DemoUpstream, GatewayProcess
from tests.helpers import behind_a_dead_host, insert_completed_keys, new_key

SECRET = "pw-never-logged"


def oncegate(*args: str, url: str, **env: str) -> subprocess.CompletedProcess[str]:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("ONCEGATE_")}
    return subprocess.run(
        [sys.executable, "-m", "oncegate.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**environment, "ONCEGATE_DATABASE_URL": url, **env},
    )


def with_password(url: str) -> str:
    """`url` with a password in its query (trust authentication ignores it; the log must not)."""
    return f"{url}&password={SECRET}"


def test_the_helper_url_really_lists_two_hosts(database_url: str) -> None:
    parsed = urls.parse(behind_a_dead_host(database_url))
    assert len(parsed.hosts) == 2 and parsed.target_session_attrs == "read-write"


async def test_serve_follows_the_host_list_and_names_it_without_the_password(
    database_url: str, module_dir: Path, upstream: DemoUpstream
) -> None:
    url = with_password(behind_a_dead_host(database_url))
    route = {"name": "mail", "match": "/", "upstream": upstream.url}
    with GatewayProcess(module_dir, url, [route], name="several-hosts") as gateway:
        key = new_key()
        async with httpx.AsyncClient(base_url=gateway.url) as client:
            first = await client.post("/emails", json={}, headers={"Idempotency-Key": key})
            again = await client.post("/emails", json={}, headers={"Idempotency-Key": key})
        assert first.status_code == 201
        assert again.headers["Idempotent-Replayed"] == "true"
        assert len(upstream.actions(key)) == 1
    log = gateway.process.output()
    dead, alive = urls.parse(url).hosts
    summary = next(line for line in log.splitlines() if "oncegate serving" in line)
    assert f"host={dead.name}:{dead.port},{alive.name}" in summary  # as written, not %2C, %3A
    assert f"primary {alive}" in summary  # the host that answered
    assert SECRET not in log and "Traceback" not in log


def test_migrate_follows_the_host_list(empty_database_url: str) -> None:
    result = oncegate("migrate", url=behind_a_dead_host(empty_database_url))
    assert result.returncode == 0, result.stderr
    assert f"schema revision {migrate.head()}" in result.stdout


def test_a_host_list_without_read_write_is_refused_with_a_sentence() -> None:
    url = "postgresql://u:hunter2@127.0.0.1:1,127.0.0.1:2/db"
    for command in ("migrate", "purge", "serve"):
        result = oncegate(command, url=url)
        assert result.returncode == 2, (command, result.stderr)
        assert "target_session_attrs=read-write" in result.stderr
        assert "Traceback" not in result.stderr and "hunter2" not in result.stderr


@pytest.mark.slow  # the URL read as serve and migrate read it: `make test-all`
async def test_purge_follows_the_host_list(database_url: str) -> None:
    connection = await asyncpg.connect(database_url)
    try:
        await connection.execute("DELETE FROM oncegate_keys")
        await insert_completed_keys(connection, 3, "now() - interval '1 hour'", prefix="gone")
        result = oncegate("purge", url=behind_a_dead_host(database_url))
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == "purged 3 expired keys"
    finally:
        await connection.close()


@pytest.mark.slow  # the URL read as serve and migrate read it: `make test-all`
def test_rekey_follows_the_host_list(database_url: str) -> None:
    keys = "k2:" + base64.b64encode(b"2" * 32).decode()
    result = oncegate("rekey", url=behind_a_dead_host(database_url), ONCEGATE_ENCRYPTION_KEYS=keys)
    assert result.returncode == 0, result.stderr
    assert "re-sealed" in result.stdout and "under key 'k2'" in result.stdout


async def test_the_agents_checkpoints_follow_the_host_list(database_url: str) -> None:
    checkpoints = await PostgresCheckpoints.connect(behind_a_dead_host(database_url))
    try:
        saved = Checkpoint(f"run-{new_key()}", "task", 2, ("a",))
        await checkpoints.save(saved)
        assert await checkpoints.load(saved.run_id) == saved
    finally:
        await checkpoints.close()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_lab_runs_on_a_host_list(database_url: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "oncegate.cli", "lab", "--runs", "3", "--strategies", "C",
         "--json", "--database-url", behind_a_dead_host(database_url)],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["strategies"]["C"]["duplicate_runs_pct"] == 0


@pytest.mark.slow  # the URL read as serve and migrate read it: `make test-all`
def test_the_lab_refuses_a_host_list_it_could_not_write_through() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "oncegate.cli", "lab", "--database-url", "postgresql://a,b/x"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2 and "target_session_attrs=read-write" in result.stderr


def test_the_langgraph_labs_connection_follows_the_host_list(database_url: str) -> None:
    from oncegate.lab import langgraph_runtime, worker

    url = behind_a_dead_host(database_url)  # ?host=h:p,... : asyncpg's form, not libpq's
    environment = worker.Environment(url, "", "", ssl.create_default_context())
    with langgraph_runtime.connect(environment) as connection:
        assert connection.execute("SELECT count(*) FROM oncegate_keys").fetchone() is not None


def test_libpq_reads_the_host_list_the_lab_gives_it_as_hosts_and_ports() -> None:
    from psycopg import conninfo

    url = "postgresql://u@/db?host=db1:5432,db2:5433&target_session_attrs=read-write"
    # As written, libpq would look for hosts named "db1:5432" and "db2:5433".
    assert conninfo.conninfo_to_dict(url)["host"] == "db1:5432,db2:5433"
    given = conninfo.conninfo_to_dict(urls.for_libpq(url))
    assert (given["host"], given["port"]) == ("db1,db2", "5432,5433")
