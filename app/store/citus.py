"""What Citus says about the key table, when the database is a Citus coordinator.

On plain PostgreSQL (no `citus` extension) every function here answers None and the store runs
as it always did.
"""

from __future__ import annotations

from dataclasses import dataclass

import asyncpg


@dataclass(frozen=True, slots=True)
class Distribution:
    """How `oncegate_keys` is spread: over how many workers, in how many shards, by what."""

    workers: int
    shards: int
    column: str

    def __str__(self) -> str:
        return (
            f"oncegate_keys is distributed by {self.column} over {self.workers} Citus"
            f" worker{'s' if self.workers != 1 else ''} in {self.shards} shards"
        )


async def has_citus(connection: asyncpg.Connection) -> bool:
    found: bool = await connection.fetchval(
        "SELECT EXISTS (SELECT FROM pg_extension WHERE extname = 'citus')"
    )
    return found


async def distribution(connection: asyncpg.Connection) -> Distribution | None:
    """None on plain PostgreSQL, or where the key table is not distributed."""
    if not await has_citus(connection):
        return None
    row = await connection.fetchrow(
        "SELECT distribution_column, shard_count,"
        "  (SELECT count(DISTINCT (nodename, nodeport)) FROM citus_shards"
        "   WHERE table_name = 'oncegate_keys'::regclass) AS workers"
        " FROM citus_tables WHERE table_name = 'oncegate_keys'::regclass"
    )
    if row is None:
        return None
    return Distribution(row["workers"], row["shard_count"], row["distribution_column"])


async def describe(url: str) -> Distribution | None:
    """`distribution` of the database at `url` (for `oncegate migrate`)."""
    connection = await asyncpg.connect(url)
    try:
        return await distribution(connection)
    finally:
        await connection.close()
