"""`oncegate_fence(shards)`: what a Citus worker checks before the store writes its shards
directly (store/postgres/workers.py), so a write never lands on a placement that is being, or
has been, moved away.

Citus blocks writes to a shard it moves or splits by taking its shard's metadata lock in
ExclusiveLock mode, on the coordinator and on every node with metadata, in the transaction that
then switches the placement (`BlockWritesToShardList`, before the last catch-up of a logical
move, before the copy of a blocking one or a split); a write Citus plans itself takes the same
lock in ShareLock mode first. The fence takes it the same way (`lock_shard_metadata(5, ...)`:
5 is ShareLock), so a move waits for the batch in flight and the batch waits for the move; then,
in a new snapshot, it checks that every shard of the batch still has its placement on this node
(`pg_dist_placement` of the node's own group, which the move changes on every node in the same
transaction). If one has not (moved, split, or a map read before either), it raises SQLSTATE
OGM01 and nothing is written: the gateway reads the shards again and sends the batch where they
are now. Plain PostgreSQL has the function too (one schema for both) and never calls it.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-04
"""

from __future__ import annotations

from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None

FENCE = """
CREATE OR REPLACE FUNCTION oncegate_fence(shards bigint[]) RETURNS boolean
LANGUAGE plpgsql
AS $$
BEGIN
    -- Sorted and distinct (the caller's duty): locks taken in one order.
    PERFORM lock_shard_metadata(5, shards);
    -- A new statement: a new snapshot, taken after the lock, so a move that committed while
    -- this waited is seen.
    IF (SELECT count(*) FROM pg_dist_placement
        WHERE shardid = ANY(shards)
          AND groupid = (SELECT groupid FROM pg_dist_local_group)) <> cardinality(shards) THEN
        RAISE EXCEPTION 'a shard of % is not on this node any more', shards
            USING ERRCODE = 'OGM01';
    END IF;
    RETURN true;
END
$$
"""


def upgrade() -> None:
    op.execute(FENCE)


def downgrade() -> None:
    op.execute("DROP FUNCTION oncegate_fence(bigint[])")
