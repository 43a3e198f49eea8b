"""The store's side of a failover, without one: which host a connection reached (asyncpg keeps it
in a private attribute: this fails loudly if that moves), and what the start-up warning says for
each shape of replication (`store.Replication.risk`)."""

from __future__ import annotations

import asyncio
import logging

import asyncpg
import pytest

from oncegate.model.records import Claim, Replication
from oncegate.settings import StoreOptions
from oncegate.settings.database_url import Host
from oncegate.store.postgres import PostgresStore
from oncegate.store.postgres.connections import Primary, reached
from oncegate.store.postgres.failover import RecentAnswers
from oncegate.store.queries import DIALECTS
from tests.helpers import behind_a_dead_host


async def test_the_address_a_connection_reached_is_readable(database_url: str) -> None:
    connection = await asyncpg.connect(behind_a_dead_host(database_url))
    try:
        address = reached(connection)
    finally:
        await connection.close()
    assert isinstance(address, str) and address.endswith(".s.PGSQL.5432"), address


async def test_the_store_names_the_host_it_reached_and_sees_no_standby(database_url: str) -> None:
    store = await PostgresStore.connect(behind_a_dead_host(database_url))
    try:
        assert store.primary.startswith("the Unix socket in /")
        assert store.outage.primary is not None  # several hosts: the outage lines name it
        replication = await store.upkeep.replication()
    finally:
        await store.close()
    assert replication.standbys == 0 and replication.risk() is None


@pytest.mark.parametrize(("back_on_same_host", "counted"), [(True, 0), (False, 2)])
async def test_answers_not_stored_in_an_outage_that_ended_on_the_same_host_are_not_counted_later(
    database_url: str, caplog: pytest.LogCaptureFixture, back_on_same_host: bool, counted: int
) -> None:
    """Two answers could not be stored while PostgreSQL was away. It came back on the same host
    (a restart): their keys are in flight there, no failover lost them, so a later failover must
    not count them. Without the same host coming back, they are counted."""
    url = behind_a_dead_host(database_url)
    primary = Primary(url)
    pool = await asyncpg.create_pool(url, min_size=1, max_size=2, init=primary.connected)
    answers = RecentAnswers(pool, DIALECTS["postgres"], StoreOptions())
    primary.on_same_host.append(answers.back_on_same_host)
    try:
        here = primary.host
        assert here is not None
        answers.unstored(Claim(id=1, token=1, key="a"))
        answers.unstored(Claim(id=2, token=1, key="b"))
        if back_on_same_host:
            connection = await asyncpg.connect(url)
            try:
                await primary.connected(connection)
            finally:
                await connection.close()
        with caplog.at_level(logging.INFO, logger="oncegate.store.postgres"):
            answers.failed_over(Host("127.0.0.2", 5432), here)
            # The count is a task the store runs in the background; its log line is the result.
            while "failed over" not in caplog.text:  # noqa: ASYNC110 (a log line, no event)
                await asyncio.sleep(0.01)
    finally:
        await answers.close()
        await pool.close()
    assert f"and the {counted} it could not store meanwhile" in caplog.text, caplog.text


@pytest.mark.parametrize(
    ("replication", "says"),
    [
        (Replication(0, 0, "", "off"), None),
        (Replication(2, 1, "s1", "on"), None),
        (Replication(1, 1, "s1", "remote_apply"), None),
        (Replication(1, 0, "", "on"), "none is synchronous"),
        (Replication(1, None, "", "on"), "none is synchronous"),
        (Replication(1, None, "s1", "on"), None),
        (Replication(1, 1, "s1", "local"), "synchronous_commit = local"),
        (Replication(1, 1, "s1", "remote_write"), "synchronous_commit = remote_write"),
    ],
)
def test_the_warning_says_what_can_happen_and_what_to_set(
    replication: Replication, says: str | None
) -> None:
    risk = replication.risk()
    if says is None:
        assert risk is None
        return
    assert risk is not None and says in risk
    assert "performed twice" in risk and "set " in risk
