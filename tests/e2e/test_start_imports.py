"""What a gateway's start loads: a real `oncegate serve` under `python -X importtime`, through
its start, a forward, a replay and a readiness probe, never imports what serving does not need.
Alembic and SQLAlchemy (only `oncegate migrate` runs migrations: the schema's revision is one
query, compared with the head read from the scripts), PyJWT (only routes with `scope_jwt`) and
httpx (only `oncegate keys`) were most of a start's CPU beyond what serves (bench/gateway_start.py).
"""

from __future__ import annotations

import re
from pathlib import Path

import httpx

from oncegate.store import migrate
from tests.e2e.conftest import DemoUpstream, Process
from tests.helpers import free_port, new_key

NOT_FOR_SERVING = ("alembic", "sqlalchemy", "mako", "jwt", "httpx")


def imported(log: str) -> set[str]:
    """The modules `-X importtime` reported, by their top-level package."""
    found = re.findall(r"^import time:\s+\d+ \|\s+\d+ \|\s*([\w.]+)$", log, re.MULTILINE)
    return {name.split(".")[0] for name in found}


async def test_serving_imports_neither_alembic_nor_what_other_commands_use(
    tmp_path: Path, database_url: str, upstream: DemoUpstream
) -> None:
    port, admin_port = free_port(), free_port()
    with Process(
        ["serve", "--upstream", upstream.url, "--port", str(port),
         "--admin-port", str(admin_port)],
        tmp_path / "gateway.log",
        env={"ONCEGATE_DATABASE_URL": database_url},
        program=("-X", "importtime", "-m", "oncegate.cli"),
    ) as gateway:  # fmt: skip
        gateway.wait_listening(port)
        async with httpx.AsyncClient(timeout=30) as client:
            ready = await client.get(f"http://127.0.0.1:{admin_port}/readyz")
            assert ready.json() == {"status": "ok", "revision": migrate.head()}
            key = new_key()
            for _ in range(2):  # a forward, then its replay
                answer = await client.post(
                    f"http://127.0.0.1:{port}/emails",
                    json={"to": "start@example.com"},
                    headers={"Idempotency-Key": key},
                )
                assert answer.status_code == 201, answer.text
            assert answer.headers["idempotent-replayed"] == "true"
    log = gateway.output()
    modules = imported(log)
    assert {"oncegate", "asyncpg", "fastapi", "aiohttp"} <= modules, log[-2000:]
    assert modules.isdisjoint(NOT_FOR_SERVING), sorted(modules & set(NOT_FOR_SERVING))
