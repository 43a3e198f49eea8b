"""One rule for the state a key is in: `oncegate_key_state(state, lease_expires_at, expires_at)`.

The stored `state` column says what the last writer did; what a key *is* now also depends on
the clock. This function says it once, and every query, the admin look-up and the tests read
states through it:

- `in_progress`: claimed, and its lease still runs: a gateway is forwarding it now. This comes
  first: a request in flight is never reclaimed or purged, even past its TTL.
- `expired`: past its TTL: a request with this key is a new request.
- `unknown`: marked so (the answer was lost), or claimed with a lease that ran out (its gateway
  died mid-flight).
- `completed`: its answer is stored.

A plain SQL function, STABLE: PostgreSQL inlines it into each query, so it costs what the
expression it replaces cost.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-03
"""

from __future__ import annotations

from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(
        """
        CREATE FUNCTION oncegate_key_state(
            state text, lease_expires_at timestamptz, expires_at timestamptz
        ) RETURNS text
        LANGUAGE sql STABLE PARALLEL SAFE
        AS $$
            SELECT CASE
                WHEN state = 'in_progress' AND lease_expires_at > now() THEN 'in_progress'
                WHEN expires_at <= now() THEN 'expired'
                WHEN state = 'in_progress' THEN 'unknown'
                ELSE state
            END
        $$
        """
    )


def downgrade() -> None:
    op.execute("DROP FUNCTION oncegate_key_state(text, timestamptz, timestamptz)")
