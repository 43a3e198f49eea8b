"""The agent library's checkpoints: one row per agent run, its next step and earlier outputs.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-09
"""

from __future__ import annotations

from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # `outputs` holds one entry per finished step, so its length is always `next_step - 1`;
    # `pending` is the action of `next_step` whose parameters were computed and saved before it
    # was sent, so a resumed run sends exactly the same request (and the gateway replays it).
    op.execute(
        """
        CREATE TABLE oncegate_checkpoints (
            run_id text PRIMARY KEY CHECK (char_length(run_id) BETWEEN 1 AND 200),
            task text NOT NULL CHECK (char_length(task) BETWEEN 1 AND 200),
            next_step integer NOT NULL CHECK (next_step >= 1),
            outputs jsonb NOT NULL,
            pending jsonb,
            created_at timestamptz NOT NULL DEFAULT now(),
            updated_at timestamptz NOT NULL DEFAULT now(),
            CONSTRAINT oncegate_checkpoints_outputs_per_step CHECK (
                jsonb_typeof(outputs) = 'array'
                AND jsonb_array_length(outputs) = next_step - 1
            ),
            CONSTRAINT oncegate_checkpoints_pending_is_next_step CHECK (
                pending IS NULL OR (pending->>'step')::integer = next_step
            )
        )
        """
    )


def downgrade() -> None:
    op.execute("DROP TABLE oncegate_checkpoints")
