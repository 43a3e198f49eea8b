"""Sealed answers (`ONCEGATE_ENCRYPTION_KEYS`): the key's name and the sealed headers.

A sealed row keeps its status in the clear, its body sealed in `response_body`, its headers
sealed in `sealed_headers` (and `response_headers` NULL), and the name of the key that sealed
them in `sealed_with`. A row with `sealed_with` NULL is stored as before. `store: status_only`
stores an empty body, so a stored answer still always has one.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-03
"""

from __future__ import annotations

from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("ALTER TABLE oncegate_keys ADD COLUMN sealed_with text")
    op.execute("ALTER TABLE oncegate_keys ADD COLUMN sealed_headers bytea")
    op.execute("ALTER TABLE oncegate_keys DROP CONSTRAINT oncegate_keys_stored_has_body")
    op.execute(
        """
        ALTER TABLE oncegate_keys ADD CONSTRAINT oncegate_keys_stored_has_body
            CHECK (NOT response_stored OR (response_body IS NOT NULL AND
                   (response_headers IS NOT NULL OR sealed_headers IS NOT NULL)))
        """
    )
    op.execute(
        """
        ALTER TABLE oncegate_keys ADD CONSTRAINT oncegate_keys_sealed_whole
            CHECK ((sealed_with IS NULL) = (sealed_headers IS NULL))
        """
    )


def downgrade() -> None:
    op.execute("ALTER TABLE oncegate_keys DROP CONSTRAINT oncegate_keys_sealed_whole")
    op.execute("ALTER TABLE oncegate_keys DROP CONSTRAINT oncegate_keys_stored_has_body")
    op.execute(
        """
        ALTER TABLE oncegate_keys ADD CONSTRAINT oncegate_keys_stored_has_body
            CHECK (NOT response_stored OR (response_body IS NOT NULL
                                           AND response_headers IS NOT NULL))
        """
    )
    op.execute("ALTER TABLE oncegate_keys DROP COLUMN sealed_headers")
    op.execute("ALTER TABLE oncegate_keys DROP COLUMN sealed_with")
