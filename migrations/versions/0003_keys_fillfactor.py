"""Leave room on each page of the key table, so storing an answer is a HOT update.

Every forward inserts a row (the claim) and updates it once (the answer). With full pages about
a fifth of those updates had to go to another page and add entries to both indexes; with 30%
free room nearly all stay on their page and touch no index (measured with pg_stat_user_tables:
HOT updates 80% -> 98%, PostgreSQL CPU per forward -10%; bench/HISTORY.md). Rows written
before this migration keep their pages until they are purged.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-02
"""

from __future__ import annotations

from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("ALTER TABLE oncegate_keys SET (fillfactor = 70)")


def downgrade() -> None:
    op.execute("ALTER TABLE oncegate_keys RESET (fillfactor)")
