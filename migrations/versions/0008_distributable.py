"""The key table can be spread over a Citus cluster, and is, on a database with Citus.

Citus splits a table into shards by one column (the distribution column) and every PRIMARY KEY
and UNIQUE constraint must include it, so one shard can enforce it alone. The key table is
distributed by `key`:

- `scope` would put each client on one shard: a tenant with most of the traffic would load one
  worker while the others idle. `key` spreads every client's keys over every shard (clients pick
  keys at random, UUIDs, or derive them from unique things; Citus hashes them anyway), and the
  unique constraint (scope, key) already includes it.
- A hash of both would spread even one key string used by many scopes, which nobody sends in
  bulk, and would need a column of its own, which the operator's look-up by key (`admin_find`)
  could not use to reach one shard.

So the primary key becomes (id, key): `id` first, so the lookups and pages by id that plain
PostgreSQL does (the key count, the operator's queue, rekey) still walk it; `key`, so Citus can
enforce it per shard. (scope, key) stays unique. On plain PostgreSQL nothing else changes.

Functions the request path needs on Citus, created everywhere so the schema is one:
- `oncegate_key_is(wanted, state, lease_expires_at, expires_at, at)`: the rule of a key's state
  as a condition, without CASE, so a write's WHERE may use it on Citus (which refuses a CASE
  around `now()` in an UPDATE); `oncegate_key_state` now reads its answer from it: one rule.
- `oncegate_after(at, seconds)`: `at` plus a number of seconds, IMMUTABLE (true: an interval of
  seconds alone does not depend on the time zone), so an UPDATE on Citus may compute a lease's
  end from a column.
- `oncegate_claim(...)`: the batched claim as one function call, which Citus runs on the worker
  that holds the batch's shard (a distributed function): one round trip to that worker instead
  of the INSERT ... SELECT that Citus would pull through the coordinator.

On a database where the `citus` extension is installed, this migration also distributes
`oncegate_keys` by `key` (shard count: the database's `citus.shard_count` where the operator set
one, else two per worker, oncegate's recommendation: store/citus.py),
distributes the functions (colocated with it, so `oncegate_claim` runs beside its rows), and
distributes the agent's `oncegate_checkpoints` by `run_id` in a colocation group of its own
(nothing joins it with the keys).

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-03
"""

from __future__ import annotations

from alembic import op
from sqlalchemy import text

# Shards of the key table per worker where the operator left `citus.shard_count` at Citus's
# default: oncegate's recommendation (store/citus.py's SHARDS_PER_WORKER, which warns above it;
# docs/operations.md, "Shard count"). Written here, not imported: a migration does what it did
# when it was written (tests/store/test_migrations.py holds the two equal).
SHARDS_PER_WORKER = 2

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

KEY_IS = """
CREATE OR REPLACE FUNCTION oncegate_key_is(
    wanted text, state text, lease_expires_at timestamptz, expires_at timestamptz, at timestamptz
) RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    -- in_progress: claimed and its lease runs (first: a request in flight is never reclaimed or
    -- purged, even past its TTL); expired: past its TTL; unknown: marked so, or claimed with a
    -- lease that ran out; completed: stored.
    SELECT ((state = 'in_progress' AND lease_expires_at > at) IS TRUE) = (wanted = 'in_progress')
       AND (wanted = 'in_progress' OR ((expires_at <= at) IS TRUE) = (wanted = 'expired'))
       AND (wanted IN ('in_progress', 'expired') OR state = wanted
            OR (wanted = 'unknown' AND state = 'in_progress'))
$$
"""

KEY_STATE = """
CREATE OR REPLACE FUNCTION oncegate_key_state(
    state text, lease_expires_at timestamptz, expires_at timestamptz
) RETURNS text
LANGUAGE sql STABLE PARALLEL SAFE
AS $$
    SELECT CASE
        WHEN oncegate_key_is('in_progress', state, lease_expires_at, expires_at, now())
            THEN 'in_progress'
        WHEN oncegate_key_is('expired', state, lease_expires_at, expires_at, now())
            THEN 'expired'
        WHEN oncegate_key_is('unknown', state, lease_expires_at, expires_at, now())
            THEN 'unknown'
        ELSE state
    END
$$
"""

KEY_STATE_BEFORE = """
CREATE OR REPLACE FUNCTION oncegate_key_state(
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

AFTER = """
CREATE OR REPLACE FUNCTION oncegate_after(at timestamptz, seconds float8) RETURNS timestamptz
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT at + make_interval(secs => seconds) $$
"""

# Each key of the batch in turn (the caller sends them in (scope, key) order, so two batches
# never deadlock): insert it, or read the row that holds it. Every statement names one key, so
# on Citus each reaches its shard alone, on the worker this function runs on. A row that a
# concurrent claim inserted and then released before it could be read comes back with id NULL:
# the caller reads it again (`get`), as after the plain statement.
CLAIM = """
CREATE OR REPLACE FUNCTION oncegate_claim(
    anchor text, routes text[], scopes bytea[], keys text[], fingerprints bytea[],
    leases float8[], ttls float8[]
) RETURNS TABLE (
    n integer, claimed boolean, id bigint, fencing_token bigint, fingerprint bytea, state text,
    response_status smallint, response_headers jsonb, response_body bytea,
    response_stored boolean, sealed_with text, sealed_headers bytea
)
LANGUAGE plpgsql
AS $$
BEGIN
    FOR i IN 1 .. coalesce(cardinality(keys), 0) LOOP
        n := i;
        INSERT INTO oncegate_keys AS k
            (route, scope, key, fingerprint, state, fencing_token, lease_expires_at, expires_at)
        VALUES (routes[i], scopes[i], keys[i], fingerprints[i], 'in_progress', 1,
                now() + make_interval(secs => leases[i]), now() + make_interval(secs => ttls[i]))
        ON CONFLICT ON CONSTRAINT oncegate_keys_scope_key DO NOTHING
        RETURNING k.id, k.fencing_token INTO id, fencing_token;
        claimed := FOUND;
        IF claimed THEN
            fingerprint := NULL; state := NULL; response_status := NULL;
            response_headers := NULL; response_body := NULL; response_stored := NULL;
            sealed_with := NULL; sealed_headers := NULL;
        ELSE
            id := NULL; fencing_token := NULL;
            SELECT held.id, held.fencing_token, held.fingerprint,
                   oncegate_key_state(held.state, held.lease_expires_at, held.expires_at),
                   held.response_status, held.response_headers, held.response_body,
                   held.response_stored, held.sealed_with, held.sealed_headers
            INTO id, fencing_token, fingerprint, state, response_status, response_headers,
                 response_body, response_stored, sealed_with, sealed_headers
            FROM oncegate_keys AS held
            WHERE held.key = keys[i] AND held.scope = scopes[i];
        END IF;
        RETURN NEXT;
    END LOOP;
END
$$
"""

CLAIM_SIGNATURE = "oncegate_claim(text, text[], bytea[], text[], bytea[], float8[], float8[])"
KEY_IS_SIGNATURE = "oncegate_key_is(text, text, timestamptz, timestamptz, timestamptz)"
KEY_STATE_SIGNATURE = "oncegate_key_state(text, timestamptz, timestamptz)"
AFTER_SIGNATURE = "oncegate_after(timestamptz, float8)"


def upgrade() -> None:
    primary_key = (
        op.get_bind()
        .execute(
            text(
                "SELECT pg_get_constraintdef(oid) FROM pg_constraint"
                " WHERE conrelid = 'oncegate_keys'::regclass AND contype = 'p'"
            )
        )
        .scalar()
    )
    if primary_key != "PRIMARY KEY (id, key)":
        op.execute(
            "ALTER TABLE oncegate_keys DROP CONSTRAINT oncegate_keys_pkey,"
            " ADD CONSTRAINT oncegate_keys_pkey PRIMARY KEY (id, key)"
        )
    op.execute(KEY_IS)
    op.execute(KEY_STATE)
    op.execute(AFTER)
    op.execute(CLAIM)
    if _has_citus():
        _distribute()


def _has_citus() -> bool:
    return bool(
        op.get_bind()
        .execute(text("SELECT EXISTS (SELECT FROM pg_extension WHERE extname = 'citus')"))
        .scalar()
    )


def _distribute() -> None:
    bind = op.get_bind()
    workers = bind.execute(
        text(
            "SELECT count(*) FROM pg_dist_node"
            " WHERE noderole = 'primary' AND isactive AND shouldhaveshards AND groupid <> 0"
        )
    ).scalar()
    if not workers:
        raise RuntimeError(
            "this database has the citus extension but no worker to put shards on: add the"
            " workers first (SELECT citus_add_node(host, port) on the coordinator), then migrate"
        )
    distributed = {
        row[0] for row in bind.execute(text("SELECT logicalrelid::text FROM pg_dist_partition"))
    }
    if "oncegate_keys" not in distributed:
        # The operator's `citus.shard_count` if they set one (ALTER DATABASE, ALTER SYSTEM, the
        # configuration file); left at Citus's default (32), the count oncegate recommends for
        # the workers there are (store/citus.py, SHARDS_PER_WORKER; docs/operations.md, "Shard
        # count").
        chosen = bind.execute(
            text("SELECT source = 'default' FROM pg_settings WHERE name = 'citus.shard_count'")
        ).scalar()
        count = f", shard_count => {SHARDS_PER_WORKER * workers:d}" if chosen else ""
        op.execute(f"SELECT create_distributed_table('oncegate_keys', 'key'{count})")
    if "oncegate_checkpoints" not in distributed:
        op.execute(
            "SELECT create_distributed_table('oncegate_checkpoints', 'run_id',"
            " colocate_with => 'none')"
        )
    # Propagated to every worker (a function made before the extension was not), and the claim
    # runs where the shard of its first argument lives.
    for signature in (KEY_IS_SIGNATURE, KEY_STATE_SIGNATURE, AFTER_SIGNATURE):
        op.execute(f"SELECT create_distributed_function('{signature}')")
    op.execute(
        f"SELECT create_distributed_function('{CLAIM_SIGNATURE}', 'anchor',"
        " colocate_with => 'oncegate_keys')"
    )


def downgrade() -> None:
    if _has_citus():
        # A primary key without `key` cannot exist on a distributed table, and Citus cannot
        # gather a table with an identity column back to the coordinator (undistribute_table).
        raise RuntimeError(
            "cannot downgrade below revision 0008 on Citus: the key table stays distributed"
        )
    op.execute(f"DROP FUNCTION {CLAIM_SIGNATURE}")
    op.execute(f"DROP FUNCTION {AFTER_SIGNATURE}")
    op.execute(KEY_STATE_BEFORE)
    op.execute(f"DROP FUNCTION {KEY_IS_SIGNATURE}")
    op.execute(
        "ALTER TABLE oncegate_keys DROP CONSTRAINT oncegate_keys_pkey,"
        " ADD CONSTRAINT oncegate_keys_pkey PRIMARY KEY (id)"
    )
