"""`oncegate_ended_sessions`: the operator page's sessions ended by a logout.

A session cookie is an expiry signed under the admin token (app/http/ui.py), checked without the
database; a logout must still end it for real, on every gateway and worker and after a restart,
so the session (a SHA-256 digest of its cookie) is written here until its own expiry. The page
refuses a cookie found here. Rows past their expiry mean nothing and are deleted by the next
logout. The table stays tiny (sessions last 8 hours), and on Citus it is a table of the
coordinator alone: nothing joins it with the keys.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-03
"""

from __future__ import annotations

from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(
        "CREATE TABLE oncegate_ended_sessions ("
        " session bytea PRIMARY KEY CHECK (length(session) = 32),"
        " expires_at timestamptz NOT NULL)"
    )


def downgrade() -> None:
    op.execute("DROP TABLE oncegate_ended_sessions")
