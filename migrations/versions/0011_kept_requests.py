"""The request behind a key, kept for as long as the key can turn `unknown`.

- `request`: what the gateway forwarded (method, path, query, the forwarded headers and the body;
  `service.evidence` encodes it), written by the claim's own insert, so a key pays for it once,
  in the statement it sends anyway. `complete` sets it to NULL (a completed key cannot turn
  `unknown`, and the new row version then carries no copy of it); `release` deletes the row;
  `mark_unknown` and a lease that runs out leave it. NULL when the route says
  `keep_request: never`.
- `request_sealed_with`: the key that sealed it (as `sealed_with` for answers), NULL in plaintext.
- `claimed_by`: the gateway instance that made the claim (host, pid, start time, as JSON);
  NULL once the key completes, like the request.
- `failure`: what that gateway saw when it marked the key `unknown` (a timeout or a broken
  connection, whether the status line came back and how many bytes of the answer), as JSON.

`oncegate_claim` (the claim on Citus) takes the batch's kept requests and the claimant too.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-04
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from alembic import op
from sqlalchemy import text

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

CLAIM_BEFORE_SIGNATURE = (
    "oncegate_claim(text, text[], bytea[], text[], bytea[], float8[], float8[])"
)
CLAIM_SIGNATURE = (
    "oncegate_claim(text, text[], bytea[], text[], bytea[], float8[], float8[], bytea[], text[],"
    " text)"
)

CLAIM = """
CREATE OR REPLACE FUNCTION oncegate_claim(
    anchor text, routes text[], scopes bytea[], keys text[], fingerprints bytea[],
    leases float8[], ttls float8[], requests bytea[], requests_sealed_with text[],
    claimant text
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
            (route, scope, key, fingerprint, state, fencing_token, lease_expires_at, expires_at,
             request, request_sealed_with, claimed_by)
        VALUES (routes[i], scopes[i], keys[i], fingerprints[i], 'in_progress', 1,
                now() + make_interval(secs => leases[i]), now() + make_interval(secs => ttls[i]),
                requests[i], requests_sealed_with[i], claimant)
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


def upgrade() -> None:
    citus = _has_citus()
    if citus:
        # Citus refuses a function command after a parallel DDL on the shards in one
        # transaction: the ALTER goes shard by shard instead.
        op.execute("SET LOCAL citus.multi_shard_modify_mode TO 'sequential'")
    op.execute(
        "ALTER TABLE oncegate_keys ADD COLUMN request bytea,"
        " ADD COLUMN request_sealed_with text, ADD COLUMN claimed_by text,"
        " ADD COLUMN failure jsonb"
    )
    op.execute(f"DROP FUNCTION {CLAIM_BEFORE_SIGNATURE}")
    op.execute(CLAIM)
    if citus:
        op.execute(
            f"SELECT create_distributed_function('{CLAIM_SIGNATURE}', 'anchor',"
            " colocate_with => 'oncegate_keys')"
        )


def downgrade() -> None:
    if _has_citus():
        op.execute("SET LOCAL citus.multi_shard_modify_mode TO 'sequential'")
    op.execute(f"DROP FUNCTION {CLAIM_SIGNATURE}")
    op.execute(_claim_of_0008())
    if _has_citus():
        op.execute(
            f"SELECT create_distributed_function('{CLAIM_BEFORE_SIGNATURE}', 'anchor',"
            " colocate_with => 'oncegate_keys')"
        )
    op.execute(
        "ALTER TABLE oncegate_keys DROP COLUMN request, DROP COLUMN request_sealed_with,"
        " DROP COLUMN claimed_by, DROP COLUMN failure"
    )


def _claim_of_0008() -> str:
    """The claim function as 0008 made it, read from that migration (one copy of its text)."""
    path = Path(__file__).with_name("0008_distributable.py")
    spec = importlib.util.spec_from_file_location("oncegate_migration_0008", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    claim: str = module.CLAIM
    return claim


def _has_citus() -> bool:
    return bool(
        op.get_bind()
        .execute(text("SELECT EXISTS (SELECT FROM pg_extension WHERE extname = 'citus')"))
        .scalar()
    )
