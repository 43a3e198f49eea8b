"""The key table: one row per (scope, key), its state, lease, fencing token and stored answer.

Revision ID: 0001
Revises:
Create Date: 2026-12-02
"""

from __future__ import annotations

from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Fencing tokens come from one sequence, so every claim or take-over gets a number no earlier
    # owner of the key ever held.
    op.execute("CREATE SEQUENCE oncegate_fencing_token AS bigint")
    op.execute(
        """
        CREATE TABLE oncegate_keys (
            id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
            route text NOT NULL CHECK (char_length(route) BETWEEN 1 AND 64),
            scope bytea NOT NULL CHECK (octet_length(scope) = 32),
            key text NOT NULL CHECK (char_length(key) BETWEEN 1 AND 255),
            fingerprint bytea NOT NULL CHECK (octet_length(fingerprint) = 32),
            state text NOT NULL CHECK (state IN ('in_progress', 'completed', 'unknown')),
            fencing_token bigint NOT NULL,
            lease_expires_at timestamptz,
            response_status smallint CHECK (response_status BETWEEN 100 AND 599),
            response_headers jsonb,
            response_body bytea,
            response_stored boolean NOT NULL DEFAULT false,
            created_at timestamptz NOT NULL DEFAULT now(),
            completed_at timestamptz,
            expires_at timestamptz NOT NULL,
            CONSTRAINT oncegate_keys_scope_key UNIQUE (scope, key),
            CONSTRAINT oncegate_keys_in_progress_has_lease
                CHECK (state <> 'in_progress' OR lease_expires_at IS NOT NULL),
            CONSTRAINT oncegate_keys_completed_has_status
                CHECK (state <> 'completed' OR response_status IS NOT NULL),
            CONSTRAINT oncegate_keys_stored_has_body
                CHECK (NOT response_stored OR (response_body IS NOT NULL
                                               AND response_headers IS NOT NULL)),
            CONSTRAINT oncegate_keys_expires_after_created CHECK (expires_at > created_at)
        )
        """
    )
    # The purger walks expired rows oldest first in bounded batches.
    op.execute("CREATE INDEX oncegate_keys_expires_at ON oncegate_keys (expires_at)")


def downgrade() -> None:
    op.execute("DROP TABLE oncegate_keys")
    op.execute("DROP SEQUENCE oncegate_fencing_token")
