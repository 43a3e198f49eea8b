"""`waited`: whether a request is waiting for this key to settle (`Prefer: wait`).

A settle (complete, release, mark unknown) sends `NOTIFY oncegate_settled, '<id>'` only for a row
whose `waited` is set, so a forward nobody waits on pays nothing for the feature: NOTIFY takes a
lock that serializes the commits of notifying transactions. Adding a column with a constant
default rewrites nothing.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-03
"""

from __future__ import annotations

from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("ALTER TABLE oncegate_keys ADD COLUMN waited boolean NOT NULL DEFAULT false")


def downgrade() -> None:
    op.execute("ALTER TABLE oncegate_keys DROP COLUMN waited")
