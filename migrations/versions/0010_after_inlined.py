"""`oncegate_after(at, seconds)` computed so PostgreSQL inlines it.

Migration 0008 wrote it as `at + make_interval(secs => seconds)`, declared IMMUTABLE (true for
an interval of seconds alone) so a write on Citus may compute a lease's end from a column. But
`timestamptz + interval` is STABLE in PostgreSQL's catalog (an interval of days or months
depends on the time zone), and PostgreSQL never inlines an IMMUTABLE SQL function whose body
calls a STABLE one: each call ran as a function call of its own, measured at 1.5-2.0 µs against
0.08 µs for the expression written out (a million rows, PostgreSQL 15). Now that every write
of queries.sql, on plain PostgreSQL too, computes its times with it, it is written with
IMMUTABLE parts only: the instant as UTC wall time, plus the seconds, back from UTC. The same
instant for every input: neither step depends on the session's time zone.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-04
"""

from __future__ import annotations

from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

INLINED = """
CREATE OR REPLACE FUNCTION oncegate_after(at timestamptz, seconds float8) RETURNS timestamptz
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT timezone('UTC', timezone('UTC', at) + make_interval(secs => seconds)) $$
"""

CALLED = """
CREATE OR REPLACE FUNCTION oncegate_after(at timestamptz, seconds float8) RETURNS timestamptz
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT at + make_interval(secs => seconds) $$
"""


def upgrade() -> None:
    op.execute(INLINED)


def downgrade() -> None:
    op.execute(CALLED)
