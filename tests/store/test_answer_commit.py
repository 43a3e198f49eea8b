"""`store_answer_commit` holds for every answer, and the server's `synchronous_commit` for every
claim, also when the two share one statement (`claim_complete`): the statement commits with the
stronger of the two (`Pools.claims_and_answers`).

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
from tests.store.test_batched_store import CLAIMS, HANG, LONG, ROUTE, SCOPE, batches

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
    ("server_commit", "answer_commit", "claims_alone_wait"),
    [
        ("local", "remote_apply", False),  # the answers' setting is the stronger
        ("on", "off", True),  # the claims' (the default `store_answer_commit`)
    ],
)
async def test_claims_and_an_answer_in_one_statement_commit_with_the_stronger_setting(
    server_url: str, server_commit: str, answer_commit: AnswerCommit, claims_alone_wait: bool
) -> None:
    """Two claims and a complete: the first claim goes alone, the second and the complete
    queue behind it and go in one statement. That statement waits for the standby whichever
    of the two settings asks for it; the claim alone waits only when the server's does."""
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
            before = batches(CLAIMS)
            alone = asyncio.create_task(claim())
            beside = asyncio.create_task(claim())
            answer = StoredAnswer(201, plaintext([], b"{}"))
            completed = asyncio.create_task(store.requests.complete(completing, answer))
            if not claims_alone_wait:
                assert isinstance(await asyncio.wait_for(alone, HANG), Claim)
            expected = 2 if claims_alone_wait else 1  # the claim alone's statement, and theirs
            async with asyncio.timeout(HANG):
                while await _waiting(server_url, "keys") < expected:
                    assert not completed.done(), (
                        f"the answer committed without waiting for the standby "
                        f"(store_answer_commit = {answer_commit}, server {server_commit})"
                    )
                    await asyncio.sleep(0.01)
            assert not beside.done() and not completed.done()
        # The name cleared: every commit returns, each operation with its own outcome.
        claimed, stored_now = await asyncio.wait_for(asyncio.gather(beside, completed), HANG)
        assert isinstance(await alone, Claim) and isinstance(claimed, Claim) and stored_now
        count, carried = batches(CLAIMS)
        assert (count - before[0], carried - before[1]) == (2, 3)  # 1 claim, then claim+complete
        record = await store.requests.get(SCOPE, completing.key)
        assert record is not None and record.state == "completed"
        record = await store.requests.get(SCOPE, claimed.key)
        assert record is not None and record.state == "in_progress"
    finally:
        await store.close()
        await _admin(server_url, "ALTER DATABASE keys RESET synchronous_commit")
