"""The checkpoint store on a real PostgreSQL (migration 0002)."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

import asyncpg
import pytest

from oncegate.agent.checkpoints import Checkpoint, CheckpointError, Pending, check_belongs
from oncegate.store import migrate
from oncegate.store.checkpoints import PostgresCheckpoints

# The agent's table on the embedded PostgreSQL and on a Citus cluster (distributed by run_id).
# On Citus too in `make test-all`: these tests are about the gateway, not the store (the
# store's own suite runs on Citus in `make test`, tests/store/test_conformance.py).
pytestmark = pytest.mark.citus(slow=True)


async def test_a_run_never_saved_has_no_checkpoint(checkpoints: PostgresCheckpoints) -> None:
    assert await checkpoints.load("never-saved") is None


async def test_a_saved_checkpoint_comes_back_as_saved(checkpoints: PostgresCheckpoints) -> None:
    checkpoint = Checkpoint("run-1", "task", 3, ({"a": 1}, [1, "two", None]))
    await checkpoints.save(checkpoint)
    assert await checkpoints.load("run-1") == checkpoint


async def test_the_pending_action_is_saved_and_cleared_by_the_next_step(
    checkpoints: PostgresCheckpoints,
) -> None:
    at_step_2 = Checkpoint("run-2", "task", 2, ("first",))
    saved_at = datetime(2026, 12, 1, 9, 30, 15, 250000, tzinfo=UTC)
    pending = at_step_2.with_pending({"amount_cents": 1250}, saved_at)
    await checkpoints.save(pending)
    loaded = await checkpoints.load("run-2")
    assert loaded is not None and loaded.pending == Pending(2, {"amount_cents": 1250}, saved_at)
    await checkpoints.save(pending.finish({"id": "ch_1"}))
    loaded = await checkpoints.load("run-2")
    assert loaded == Checkpoint("run-2", "task", 3, ("first", {"id": "ch_1"}))


async def test_a_checkpoint_of_another_task_is_refused(checkpoints: PostgresCheckpoints) -> None:
    await checkpoints.save(Checkpoint("run-3", "support", 2, ("x",)))
    with pytest.raises(CheckpointError, match="belongs to task 'support'"):
        await checkpoints.save(Checkpoint("run-3", "billing", 3, ("x", "y")))
    assert await checkpoints.load("run-3") == Checkpoint("run-3", "support", 2, ("x",))


async def test_an_older_checkpoint_cannot_rewind_a_run(checkpoints: PostgresCheckpoints) -> None:
    await checkpoints.save(Checkpoint("run-4", "task", 4, ("a", "b", "c")))
    with pytest.raises(CheckpointError, match="already at step 4"):
        await checkpoints.save(Checkpoint("run-4", "task", 2, ("a",)))
    loaded = await checkpoints.load("run-4")
    assert loaded is not None and loaded.next_step == 4


async def test_saving_the_same_step_again_is_allowed(checkpoints: PostgresCheckpoints) -> None:
    first = Checkpoint("run-5", "task", 2, ("a",))
    await checkpoints.save(first)
    with_pending = first.with_pending({"to": "ana@example.com"})
    await checkpoints.save(with_pending)
    loaded = await checkpoints.load("run-5")
    assert loaded is not None and loaded.pending == with_pending.pending


async def test_a_pending_action_saved_without_its_time_is_dated_by_its_row(
    checkpoints: PostgresCheckpoints, database_url: str
) -> None:
    # As the library saved pending actions before they carried `saved_at`: the save that set
    # the pending action was the row's last, so its `updated_at` is when the action was saved.
    connection = await asyncpg.connect(database_url)
    try:
        updated_at = await connection.fetchval(
            "INSERT INTO oncegate_checkpoints (run_id, task, next_step, outputs, pending, "
            "updated_at) VALUES ('run-old', 't', 2, '[\"a\"]', "
            '\'{"step": 2, "params": {"to": "ana"}}\', now() - interval \'3 days\') '
            "RETURNING updated_at"
        )
    finally:
        await connection.close()
    loaded = await checkpoints.load("run-old")
    assert loaded is not None and loaded.pending == Pending(2, {"to": "ana"}, updated_at)


def test_a_pending_action_needs_an_aware_time() -> None:
    with pytest.raises(CheckpointError, match="time zone"):
        Pending(2, {}, datetime(2026, 12, 1, 9, 30))
    assert Pending(2, {}, datetime.now(UTC) - timedelta(days=1)).step == 2


def test_a_loaded_checkpoint_of_another_run_or_task_is_refused() -> None:
    checkpoint = Checkpoint("run-6", "support", 1)
    check_belongs(checkpoint, "run-6", "support")
    with pytest.raises(CheckpointError, match="got the checkpoint of 'run-6'"):
        check_belongs(checkpoint, "run-7", "support")
    with pytest.raises(CheckpointError, match="started by task 'support'"):
        check_belongs(checkpoint, "run-6", "billing")


def test_a_checkpoint_has_one_output_per_finished_step() -> None:
    with pytest.raises(CheckpointError, match="needs 2 outputs"):
        Checkpoint("run-8", "task", 3, ("only one",))
    with pytest.raises(CheckpointError, match="pending action of step 2"):
        Checkpoint("run-8", "task", 3, ("a", "b"), Pending(2, {}, datetime.now(UTC)))


async def test_the_table_enforces_the_invariants_too(database_url: str) -> None:
    connection = await asyncpg.connect(database_url)
    try:
        with pytest.raises(asyncpg.CheckViolationError):
            await connection.execute(
                "INSERT INTO oncegate_checkpoints (run_id, task, next_step, outputs) "
                "VALUES ('bad', 't', 3, '[1]')"
            )
    finally:
        await connection.close()


async def test_migration_0002_goes_up_and_down(empty_database_url: str) -> None:
    async def tables() -> set[str]:
        connection = await asyncpg.connect(empty_database_url)
        try:
            rows = await connection.fetch("SELECT tablename FROM pg_tables")
        finally:
            await connection.close()
        return {row["tablename"] for row in rows}

    await asyncio.to_thread(migrate.upgrade, empty_database_url, "0002")
    assert {"oncegate_keys", "oncegate_checkpoints"} <= await tables()
    await asyncio.to_thread(migrate.downgrade, empty_database_url, "0001")
    assert "oncegate_checkpoints" not in await tables()
    assert "oncegate_keys" in await tables()
