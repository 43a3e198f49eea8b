"""Replays write nothing: fencing tokens count per row, and row ids come from a cached sequence.

An `INSERT ... ON CONFLICT DO NOTHING` evaluates its VALUES, defaults included, before it finds
the conflict: every replay drew a value from the fencing-token sequence and from the id's
identity sequence. PostgreSQL WAL-logs a sequence every 32 values and takes a transaction id to
do it, so about one replay in 16 committed a transaction and waited for a WAL flush (measured
with pg_waldump during a replay-only load: one Sequence/LOG and one COMMIT per ~16 replays; the
replay path's p99 at 64 connections was ten times its p50).

- The fencing token is now per row (a claim starts at 1, each take-over adds one;
  app/store/queries.sql): the global sequence goes. Writes name the row's id and its token, so
  the two numberings never meet.
- The id's identity sequence hands out values 1,000 at a time per session, so it is logged once
  per 1,000 claims instead of once per 32. Ids stay unique; they just have gaps.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-02
"""

from __future__ import annotations

from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("DROP SEQUENCE oncegate_fencing_token")
    op.execute("ALTER TABLE oncegate_keys ALTER COLUMN id SET CACHE 1000")


def downgrade() -> None:
    op.execute("ALTER TABLE oncegate_keys ALTER COLUMN id SET CACHE 1")
    op.execute("CREATE SEQUENCE oncegate_fencing_token AS bigint")
