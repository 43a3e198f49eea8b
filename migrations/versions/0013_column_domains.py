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
without their checks, the columns become of those types (binary coercible: a catalog change) in
one ALTER TABLE that also drops the five column checks, and only then do the domains get their
checks. That reads the key table five times, all under the ACCESS EXCLUSIVE lock the ALTER TABLE
takes: once for the ALTER TABLE (PostgreSQL validates again every table check that names a
retyped column, here the checks across columns), once per domain's constraint (validated column
by column of the table; NOT VALID then VALIDATE would read as often, under the same SHARE lock
on PostgreSQL 15). All in the migration's one transaction, so no moment goes unchecked. On a
Citus coordinator every statement here is propagated to the workers and their shards (the
domains become Citus objects, so a worker added later gets them), over one connection per worker
(`citus.multi_shard_modify_mode` sequential: Citus runs no command on a domain after a parallel
one on a distributed table in the same transaction), each worker reading its shards. The
downgrade puts the table checks back under their old names in one ALTER TABLE (one read; on
Citus, which takes no ADD CONSTRAINT beside other subcommands, one more per check) and drops the
domains. On Citus the checks it adds come to each shard named after it
(`..._check_102008`), where a shard table is made with the names as they are: the downgrade
renames them on every shard after its transaction, as a fresh 0012 cluster names them.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-05
"""

from __future__ import annotations

import logging

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


def _sequential_on_citus() -> bool:
    """Whether this database has Citus (its statements then go to the shards one at a time)."""
    has_citus = (
        op.get_bind()
        .execute(text("SELECT EXISTS (SELECT FROM pg_extension WHERE extname = 'citus')"))
        .scalar()
    )
    if has_citus:
        op.execute("SET LOCAL citus.multi_shard_modify_mode TO 'sequential'")
    return bool(has_citus)


def upgrade() -> None:
    _sequential_on_citus()
    for domain, base, _, _ in DOMAINS:
        op.execute(f"CREATE DOMAIN {domain} AS {base}")
    # One ALTER TABLE, one read: PostgreSQL re-creates and re-validates every table check that
    # names a retyped column, once per ALTER TABLE statement (five statements read the table
    # five times). The column checks are dropped in it, so only the checks across columns are
    # validated again.
    op.execute(
        "ALTER TABLE oncegate_keys "
        + ", ".join(
            [f"DROP CONSTRAINT oncegate_keys_{column}_check" for column, _, _ in COLUMNS]
            + [f"ALTER COLUMN {column} TYPE {domain}" for column, domain, _ in COLUMNS]
        )
    )
    # One read each: PostgreSQL validates a domain's constraint column by column of a table at
    # ADD CONSTRAINT, and at VALIDATE CONSTRAINT after a NOT VALID (under a SHARE lock either
    # way on PostgreSQL 15): a NOT VALID then VALIDATE would read as often.
    for domain, _, constraint, check in DOMAINS:
        op.execute(f"ALTER DOMAIN {domain} ADD CONSTRAINT {constraint} CHECK ({check})")


# On every shard, a column check Citus added under the shard's name (`..._check_102008`; no
# other constraint of the table ends so) takes the name a shard table is created with
# (`..._check`). `run_command_on_shards` puts the shard table's name in place of %s (format():
# %% is a percent sign).
_SHARD_NAMES = (
    "SELECT shardid, result FROM run_command_on_shards('oncegate_keys', $cmd$"
    " DO $do$ DECLARE shard regclass := '%s'; found record; BEGIN"
    "  FOR found IN SELECT conname FROM pg_constraint WHERE conrelid = shard"
    "   AND conname ~ '^oncegate_keys_[a-z_]+_check_[0-9]+$'"
    "  LOOP EXECUTE format('ALTER TABLE %%s RENAME CONSTRAINT %%I TO %%I', shard, found.conname,"
    "   regexp_replace(found.conname, '_[0-9]+$', ''));"
    "  END LOOP; END $do$ $cmd$) WHERE NOT success"
)


def downgrade() -> None:
    on_citus = _sequential_on_citus()
    retypes = [f"ALTER COLUMN {column} TYPE {BASE[domain]}" for column, domain, _ in COLUMNS]
    checks = [
        f"ADD CONSTRAINT oncegate_keys_{column}_check CHECK ({check})"
        for column, _, check in COLUMNS
    ]
    if not on_citus:
        # One ALTER TABLE, one read: the checks it adds and those it re-creates, validated
        # together.
        op.execute("ALTER TABLE oncegate_keys " + ", ".join(retypes + checks))
    else:
        # Citus takes no ADD CONSTRAINT beside other subcommands: one read per check more.
        op.execute("ALTER TABLE oncegate_keys " + ", ".join(retypes))
        for check in checks:
            op.execute(f"ALTER TABLE oncegate_keys {check}")
    for domain, _, _, _ in DOMAINS:
        op.execute(f"DROP DOMAIN {domain}")
    if on_citus:
        # Citus sends a command of run_command_on_shards over connections of its own, outside
        # this transaction, which holds the shards' locks: the names go after its commit.
        with op.get_context().autocommit_block():
            failed = op.get_bind().execute(text(_SHARD_NAMES)).fetchall()
        if failed:
            # Told, not raised: the schema is 0012's but for these names, and a failure now
            # (after the commit) would leave the version table at 0013.
            logging.getLogger("oncegate.store.citus").warning(
                "the downgrade to 0012 left these shards' column checks named after the shard"
                " (%s): rename them to oncegate_keys_<column>_check on the worker",
                "; ".join(f"shard {row.shardid}: {row.result}" for row in failed),
            )
