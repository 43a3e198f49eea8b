"""`store_answer_commit` holds for every answer, and the server's `synchronous_commit` for every
claim, also when the two are in flight at once: each goes in a statement of its own, on its
own pool (`Pools`), and commits with its own setting, never the other's.

How a commit is seen to wait for a standby without one: the server names a synchronous standby
that never connects (`synchronous_standby_names`), so every commit whose `synchronous_commit` is
`remote_write` or more waits (`wait_event = 'SyncRep'`) until the name is cleared, and one with
`local` or `off` does not. That setting is the server's, not a database's, so this module runs
a PostgreSQL of its own: no other test's commits wait on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from oncegate.kernel.sealing import plaintext
from oncegate.model.answers import StoredAnswer
from oncegate.model.records import Claim
from oncegate.settings import AnswerCommit, StoreOptions
from oncegate.store import migrate
from oncegate.store.postgres import PostgresStore
from tests.conftest import _admin, start_embedded, with_database
from tests.helpers import digest, new_key
from tests.store.test_batched_store import HANG, LONG, ROUTE, SCOPE, batches

ABSENT = "oncegate_absent_standby"  # a synchronous standby that never connects
PROBE = "INSERT INTO probe VALUES (1)"  # a commit that writes WAL (one that does not never waits)


@pytest.fixture(scope="module")
def server_url() -> Iterator[str]:
    """A maintenance URL of this module's own PostgreSQL, with a migrated database `keys`."""
    directory = Path(tempfile.mkdtemp(prefix="oncegate-test-commit-"))
    server: Any = start_embedded(directory / "data")
    try:
        url = server.get_uri()
        asyncio.run(_admin(url, "CREATE DATABASE keys"))
        migrate.upgrade(with_database(url, "keys"))
        yield url
    finally:
        server.cleanup()
        shutil.rmtree(directory, ignore_errors=True)


@contextlib.asynccontextmanager
async def standby_named(server_url: str) -> AsyncIterator[None]:
    """The absent standby named, and a probe's commit (`on`) seen waiting for it: the server
    applies a reloaded setting a moment later, and the test goes on only once it has. Cleared
    at the end, which releases every waiter."""
    await _admin(server_url, "CREATE TABLE IF NOT EXISTS probe (written int)")
    await _admin(server_url, f"ALTER SYSTEM SET synchronous_standby_names = '{ABSENT}'")
    await _admin(server_url, "SELECT pg_reload_conf()")
    probe = await asyncpg.connect(server_url, server_settings={"synchronous_commit": "on"})
    probing = asyncio.create_task(probe.execute(PROBE))
    try:
        async with asyncio.timeout(HANG):
            while await _waiting(server_url, "postgres") == 0:
                if probing.done():  # committed before the server applied the name: again
                    probing = asyncio.create_task(probe.execute(PROBE))
                await asyncio.sleep(0.01)
        yield
    finally:
        await _admin(server_url, "ALTER SYSTEM RESET synchronous_standby_names")
        await _admin(server_url, "SELECT pg_reload_conf()")
        await asyncio.wait_for(probing, HANG)
        await probe.close()


async def _waiting(server_url: str, database: str) -> int:
    """How many backends of `database` wait for a synchronous standby to confirm a commit."""
    connection = await asyncpg.connect(server_url)
    try:
        found: int = await connection.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = $1 AND wait_event = 'SyncRep'",
            database,
        )
    finally:
        await connection.close()
    return found


@pytest.mark.parametrize(
    ("server_commit", "answer_commit", "claims_wait", "answer_waits"),
    [
        ("local", "remote_apply", False, True),  # the answer's setting is the stronger
        ("on", "off", True, False),  # the server's (the default `store_answer_commit`)
    ],
)
async def test_claims_and_an_answer_in_flight_at_once_each_commit_with_their_own_setting(
    server_url: str,
    server_commit: str,
    answer_commit: AnswerCommit,
    claims_wait: bool,
    answer_waits: bool,
) -> None:
    """Two claims and a complete at once: the first claim goes alone, the second queues behind
    it, the complete goes beside them. The claims wait for the standby when the server's setting
    asks for it, the answer when `store_answer_commit` does, and neither for the other's."""
    await _admin(server_url, f"ALTER DATABASE keys SET synchronous_commit = {server_commit}")
    store = await PostgresStore.connect(
        with_database(server_url, "keys"),
        StoreOptions(pool_size=4, batch_size=8, answer_commit=answer_commit),
    )
    try:

        def claim() -> Any:
            return store.requests.claim(ROUTE, SCOPE, new_key(), digest("a"), LONG, LONG)

        completing = await claim()  # before the standby is named: commits at once
        assert isinstance(completing, Claim)
        async with standby_named(server_url):
            claims_before, completes_before = batches("claim"), batches("complete")
            alone = asyncio.create_task(claim())
            beside = asyncio.create_task(claim())
            answer = StoredAnswer(201, plaintext([], b"{}"))
            completed = asyncio.create_task(store.requests.complete(completing, answer))
            # What does not wait commits while the standby is named ...
            if not claims_wait:
                assert isinstance(await asyncio.wait_for(alone, HANG), Claim)
                assert isinstance(await asyncio.wait_for(beside, HANG), Claim)
            if not answer_waits:
                assert await asyncio.wait_for(completed, HANG) is True
            # ... and what does, waits for it: the claim alone's statement (the second queued
            # behind it), or the answer's.
            expected = int(claims_wait) + int(answer_waits)
            async with asyncio.timeout(HANG):
                while await _waiting(server_url, "keys") < expected:
                    assert not (claims_wait and beside.done()), "a claim did not wait"
                    assert not (answer_waits and completed.done()), "the answer did not wait"
                    await asyncio.sleep(0.01)
            assert await _waiting(server_url, "keys") == expected
            if claims_wait:
                assert not beside.done()
            if answer_waits:
                assert not completed.done()
        # The name cleared: every commit returns, each operation with its own outcome.
        claimed, stored_now = await asyncio.wait_for(asyncio.gather(beside, completed), HANG)
        assert isinstance(await alone, Claim) and isinstance(claimed, Claim) and stored_now
        # [alone], [beside]; the answer in a statement of its own.
        assert batches("claim") == (claims_before[0] + 2, claims_before[1] + 2)
        assert batches("complete") == (completes_before[0] + 1, completes_before[1] + 1)
        record = await store.requests.get(SCOPE, completing.key)
        assert record is not None and record.state == "completed"
        record = await store.requests.get(SCOPE, claimed.key)
        assert record is not None and record.state == "in_progress"
    finally:
        await store.close()
        await _admin(server_url, "ALTER DATABASE keys RESET synchronous_commit")
