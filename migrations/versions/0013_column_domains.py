"""The key table's column checks as domains: `route`, `scope`, `fingerprint`, `state` and
`response_status` take a type of their own that carries the check they had.

PostgreSQL reads a table's CHECK constraints back from their stored text and compiles them for
each table a statement writes, at every statement; a domain's checks are compiled once per type
and kept for the session. A Citus worker's statement writes each of its shard tables, so it paid
that compilation once per shard table and statement, a cost that did not shrink with the
statement's size (docs/scaling.md, "What each lever gave"). The values allowed do not change,
and a value refused is refused as before, with SQLSTATE 23514 (check_violation), now naming the
domain's constraint.

`key` keeps its table CHECK: Citus refuses any ALTER of a distributed table's distribution
column. The five checks across columns stay table checks too.

Each column changes type without rewriting its table or its indexes: the domains are created
without their checks, the columns become of those types (binary coercible: a catalog change),
and only then do the domains get their checks, which PostgreSQL validates with one read of the
rows (on Citus, each worker reads its shards); the table checks they replace are dropped last.
All in the migration's one transaction, so no moment goes unchecked. On a Citus coordinator
every statement here is propagated to the workers and their shards (the domains become Citus
objects, so a worker added later gets them), over one connection per worker
(`citus.multi_shard_modify_mode` sequential: Citus runs no command on a domain after a parallel
one on a distributed table in the same transaction). The downgrade puts the table checks back
under their old names and drops the domains.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-05
"""

from __future__ import annotations

from alembic import op
from sqlalchemy import text

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None

# (domain, base type, its constraint, its check on VALUE)
DOMAINS = (
    ("oncegate_route", "text", "oncegate_route_length", "char_length(VALUE) BETWEEN 1 AND 64"),
    ("oncegate_sha256", "bytea", "oncegate_sha256_length", "octet_length(VALUE) = 32"),
    (
        "oncegate_state",
        "text",
        "oncegate_state_known",
        "VALUE IN ('in_progress', 'completed', 'unknown')",
    ),
    ("oncegate_status", "smallint", "oncegate_status_http", "VALUE BETWEEN 100 AND 599"),
)

# (column, its domain, its table check before: name and condition)
COLUMNS = (
    ("route", "oncegate_route", "char_length(route) BETWEEN 1 AND 64"),
    ("scope", "oncegate_sha256", "octet_length(scope) = 32"),
    ("fingerprint", "oncegate_sha256", "octet_length(fingerprint) = 32"),
    ("state", "oncegate_state", "state IN ('in_progress', 'completed', 'unknown')"),
    ("response_status", "oncegate_status", "response_status BETWEEN 100 AND 599"),
)
BASE = {domain: base for domain, base, _, _ in DOMAINS}


def _sequential_on_citus() -> None:
    has_citus = (
        op.get_bind()
        .execute(text("SELECT EXISTS (SELECT FROM pg_extension WHERE extname = 'citus')"))
        .scalar()
    )
    if has_citus:
        op.execute("SET LOCAL citus.multi_shard_modify_mode TO 'sequential'")


def upgrade() -> None:
    _sequential_on_citus()
    for domain, base, _, _ in DOMAINS:
        op.execute(f"CREATE DOMAIN {domain} AS {base}")
    for column, domain, _ in COLUMNS:
        op.execute(f"ALTER TABLE oncegate_keys ALTER COLUMN {column} TYPE {domain}")
    for domain, _, constraint, check in DOMAINS:
        op.execute(f"ALTER DOMAIN {domain} ADD CONSTRAINT {constraint} CHECK ({check})")
    for column, _, _ in COLUMNS:
        op.execute(f"ALTER TABLE oncegate_keys DROP CONSTRAINT oncegate_keys_{column}_check")


def downgrade() -> None:
    _sequential_on_citus()
    for column, domain, check in COLUMNS:
        op.execute(f"ALTER TABLE oncegate_keys ALTER COLUMN {column} TYPE {BASE[domain]}")
        op.execute(
            f"ALTER TABLE oncegate_keys ADD CONSTRAINT oncegate_keys_{column}_check CHECK ({check})"
        )
    for domain, _, _, _ in DOMAINS:
        op.execute(f"DROP DOMAIN {domain}")
