-- The functions of the oncegate schema as they are at head: the rules, readable without
-- replaying the migrations (migrations/versions/ is the history that got here; this file is
-- where it ended). tests/store/test_schema.py checks that loading this file gives the same
-- functions as running every migration. Change a function with a new migration, and change it
-- here in the same commit.
--
-- The tables: oncegate_keys (0001, 0003, 0004, 0006, 0007, 0008, 0010), oncegate_checkpoints
-- (0002), oncegate_ended_sessions (0009).


-- The state a key is in, said once (tests/store/test_state_rule.py holds it as a table and
-- runs it beside its Python twin, `store.memory.state_of`):
-- - in_progress: claimed, and its lease still runs: a gateway is forwarding it now. This comes
--   first: a request in flight is never reclaimed or purged, even past its TTL.
-- - expired: past its TTL: a request with this key is a new request.
-- - unknown: marked so (the answer was lost), or claimed with a lease that ran out (its gateway
--   died mid-flight).
-- - completed: its answer is stored.
-- `oncegate_key_is` is the rule as a condition at a given moment, without CASE, so a write's
-- WHERE may use it on Citus; `oncegate_key_state` names the state now from it.

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
$$;

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
$$;

-- `at` plus a number of seconds, IMMUTABLE (an interval of seconds alone does not depend on the
-- time zone), so an UPDATE on Citus may compute a lease's end from a column; written with
-- IMMUTABLE parts only (UTC wall time, plus the seconds, back from UTC), so PostgreSQL inlines
-- it: `timestamptz + interval` is STABLE, and a function calling it would run as a call per row.
CREATE OR REPLACE FUNCTION oncegate_after(at timestamptz, seconds float8) RETURNS timestamptz
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT timezone('UTC', timezone('UTC', at) + make_interval(secs => seconds)) $$;

-- The batched claim (the query `claim` calls it): each key of the batch in turn, in the
-- (scope, key) order the caller sends, is inserted or the row that holds it read; a row that a
-- concurrent claim inserted and released before it could be read comes back with id NULL.
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
$$;

-- The fence of a batch the store writes on a Citus worker's shards directly (0012; the reasons
-- are in that migration): Citus's own lock against a shard move, then, in a new snapshot, every
-- shard of the batch still placed on this node, or SQLSTATE OGM01 and nothing written.
CREATE OR REPLACE FUNCTION oncegate_fence(shards bigint[]) RETURNS boolean
LANGUAGE plpgsql
AS $$
BEGIN
    -- Sorted and distinct (the caller's duty): locks taken in one order.
    PERFORM lock_shard_metadata(5, shards);
    -- A new statement: a new snapshot, taken after the lock, so a move that committed while
    -- this waited is seen.
    IF (SELECT count(*) FROM pg_dist_placement
        WHERE shardid = ANY(shards)
          AND groupid = (SELECT groupid FROM pg_dist_local_group)) <> cardinality(shards) THEN
        RAISE EXCEPTION 'a shard of % is not on this node any more', shards
            USING ERRCODE = 'OGM01';
    END IF;
    RETURN true;
END
$$;
