"""The store's side of a failover, without one: which host a connection reached (asyncpg keeps it
in a private attribute: this fails loudly if that moves), and what the start-up warning says for
each shape of replication (`store.Replication.risk`)."""

from __future__ import annotations

import asyncpg
import pytest

from oncegate.store import Replication
from oncegate.store.postgres import PostgresStore
from oncegate.store.postgres.connections import reached
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
        replication = await store.replication()
    finally:
        await store.close()
    assert replication.standbys == 0 and replication.risk() is None


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
