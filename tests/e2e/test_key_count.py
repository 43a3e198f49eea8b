"""The gauge `oncegate_keys{state}` with several gateways on one database: one sweep of the key
table per interval, whoever runs it, and every gateway's gauge current.

Each gateway process tries at each `key_count_interval` for the key count's advisory lock on its
listening connection; the holder sweeps and announces the totals with NOTIFY, and every process
sets its gauge from them. Counted from the gateways' own /metrics (the store's
`oncegate_store_operation_duration_seconds` counts each `count_keys` statement, one a sweep
here: fewer keys than a page) and from `pg_locks`. The store down under a gateway:
tests/e2e/test_store_down.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

import asyncpg
import httpx
import pytest

from oncegate.store.postgres.connections import KEY_COUNT_LOCK, LISTENER_NAME
from tests.e2e.conftest import GatewayProcess, prefix_route
from tests.helpers import insert_completed_keys, scrape, total, value

# On the embedded PostgreSQL and on a Citus cluster (the gateways LISTEN, lock and NOTIFY on
# the coordinator), the Citus run in `make test-all`.
pytestmark = pytest.mark.citus(slow=True)

INTERVAL = "0.2s"
STATES = ("in_progress", "completed", "unknown")
DEADLINE = 60.0  # a deadline only: each wait ends as soon as its condition holds


def gateway(module_dir: Path, database_url: str, name: str) -> GatewayProcess:
    route = prefix_route("unused", "http://127.0.0.1:9")  # the gauge needs no traffic
    env = {"ONCEGATE_KEY_COUNT_INTERVAL": INTERVAL}
    return GatewayProcess(module_dir, database_url, [route], name=name, env=env)


async def metrics(process: GatewayProcess) -> str:
    async with httpx.AsyncClient(base_url=process.admin_url) as admin:
        return (await admin.get("/metrics")).text


def sweeps(text: str) -> float:
    """`count_keys` statements this gateway ran (one per sweep, with fewer keys than a page)."""
    return total(text, "oncegate_store_operation_duration_seconds_count", operation="count_keys")


def tries(text: str) -> float:
    return total(
        text, "oncegate_store_operation_duration_seconds_count", operation="take_key_count"
    )


def gauge(text: str) -> dict[str, float]:
    samples = scrape(text)
    return {
        state: value(samples, "oncegate_keys", state=state)
        for state in STATES
        if ("oncegate_keys", frozenset({("state", state)})) in samples
    }


async def wait_until(condition: Callable[[], Awaitable[bool]], what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + DEADLINE
    while not await condition():
        assert loop.time() < deadline, f"waited {DEADLINE:g}s for {what}"
        await asyncio.sleep(0.1)


async def stored(db: asyncpg.Connection) -> dict[str, float]:
    rows = await db.fetch(
        "SELECT oncegate_key_state(state, lease_expires_at, expires_at) AS state, count(*)"
        " FROM oncegate_keys GROUP BY 1"
    )
    counts = {row["state"]: float(row["count"]) for row in rows}
    return {state: counts.get(state, 0.0) for state in STATES}


async def lock_holders(db: asyncpg.Connection) -> list[str]:
    """The application_name of each session holding the key count's lock, as pg_locks shows it
    (a bigint advisory lock: its high half in classid, its low half in objid, objsubid 1)."""
    rows = await db.fetch(
        "SELECT a.application_name FROM pg_locks AS l JOIN pg_stat_activity AS a USING (pid)"
        " WHERE l.locktype = 'advisory' AND l.granted AND l.database = a.datid"
        "   AND l.classid = $1 AND l.objid = $2 AND l.objsubid = 1",
        KEY_COUNT_LOCK >> 32,
        KEY_COUNT_LOCK & 0xFFFFFFFF,
    )
    return [row["application_name"] for row in rows]


async def shows(process: GatewayProcess, wanted: dict[str, float]) -> bool:
    return gauge(await metrics(process)) == wanted


async def test_one_gateway_sweeps_and_every_gateway_shows_the_totals(
    module_dir: Path, database_url: str, db: asyncpg.Connection
) -> None:
    with (
        gateway(module_dir, database_url, "first") as first,
        gateway(module_dir, database_url, "second") as second,
    ):
        await insert_completed_keys(db, 7, "now() + interval '1 day'", prefix="counted-")
        wanted = await stored(db)
        assert wanted["completed"] >= 7
        for process in (first, second):
            await wait_until(lambda p=process: shows(p, wanted), f"{process.process.args} gauge")

        # Both keep trying, for many intervals: only one of them ever sweeps.
        async def tried_often() -> bool:
            texts = [await metrics(process) for process in (first, second)]
            return min(tries(text) for text in texts) >= 10

        await wait_until(tried_often, "ten tries for the turn on each gateway")
        counted = sorted([sweeps(await metrics(process)) for process in (first, second)])
        assert counted[0] == 0 and counted[1] >= 9, counted  # (its tenth may be under way)
        assert await lock_holders(db) == [LISTENER_NAME]

        # New keys reach both gauges, from the one sweep.
        await insert_completed_keys(db, 3, "now() + interval '1 day'", prefix="later-")
        wanted = await stored(db)
        for process in (first, second):
            await wait_until(lambda p=process: shows(p, wanted), "the new totals on each gauge")


async def test_when_the_sweeping_gateway_stops_another_takes_over(
    module_dir: Path, database_url: str, db: asyncpg.Connection
) -> None:
    with (
        gateway(module_dir, database_url, "one") as one,
        gateway(module_dir, database_url, "two") as two,
    ):

        async def someone_sweeps() -> bool:
            return any([sweeps(await metrics(process)) > 0 for process in (one, two)])

        await wait_until(someone_sweeps, "a sweep")
        holder, other = (one, two) if sweeps(await metrics(one)) > 0 else (two, one)
        assert sweeps(await metrics(other)) == 0
        holder.stop()  # its session ends, and the lock with it

        await insert_completed_keys(db, 5, "now() + interval '1 day'", prefix="after-")
        wanted = await stored(db)

        async def other_sweeps() -> bool:
            return sweeps(await metrics(other)) > 0

        await wait_until(other_sweeps, "the other gateway to sweep")
        await wait_until(lambda: shows(other, wanted), "the other gateway's gauge")
        assert await lock_holders(db) == [LISTENER_NAME]
