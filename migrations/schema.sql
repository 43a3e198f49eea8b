-- The oncegate schema as it is at head: every table, constraint, index and function, readable
-- without replaying the migrations (migrations/versions/ is the history that got here; this
-- file is where it ended; each part names the migrations that shaped it, whose docstrings say
-- why). tests/store/test_schema.py builds one database from this file and one by running every
-- migration, and compares their catalogs: tables and columns, constraints, indexes, sequences,
-- storage options and functions. Change the schema with a new migration, and change it here in
-- the same commit.
--
-- On a database with the `citus` extension, migration 0008 also distributes `oncegate_keys` by
-- `key` and `oncegate_checkpoints` by `run_id`, and the functions beside them; this file is the
-- schema a plain PostgreSQL holds, which is the same on each Citus node.


-- The key table's column checks, as types of their own (0013): PostgreSQL compiles a domain's
-- checks once per session, a table's for each table a statement writes (each shard table of a
-- Citus worker's statement). `key` keeps a table check: Citus alters no distribution column.
CREATE DOMAIN oncegate_route AS text
    CONSTRAINT oncegate_route_length CHECK (char_length(VALUE) BETWEEN 1 AND 64);
-- A SHA-256: a scope (of the client's credentials) and a request's fingerprint.
CREATE DOMAIN oncegate_sha256 AS bytea
    CONSTRAINT oncegate_sha256_length CHECK (octet_length(VALUE) = 32);
-- What was last written; what a key is now is `oncegate_key_state` below.
CREATE DOMAIN oncegate_state AS text
    CONSTRAINT oncegate_state_known CHECK (VALUE IN ('in_progress', 'completed', 'unknown'));
CREATE DOMAIN oncegate_status AS smallint
    CONSTRAINT oncegate_status_http CHECK (VALUE BETWEEN 100 AND 599);

-- One row per (scope, key): its state, lease, fencing token and stored answer (0001); the
-- request behind it while it can turn `unknown` (0011).
CREATE TABLE oncegate_keys (
    -- Handed out 1,000 at a time per session, so the sequence is WAL-logged once per 1,000
    -- claims (0004); ids are unique, with gaps.
    id bigint GENERATED ALWAYS AS IDENTITY (CACHE 1000),
    route oncegate_route NOT NULL,
    scope oncegate_sha256 NOT NULL,
    key text NOT NULL CHECK (char_length(key) BETWEEN 1 AND 255),
    fingerprint oncegate_sha256 NOT NULL,
    -- What was last written; what a key is now is `oncegate_key_state` below.
    state oncegate_state NOT NULL,
    -- Per row: a claim starts at 1, each take-over and operator's resolution adds one (0004).
    fencing_token bigint NOT NULL,
    lease_expires_at timestamptz,
    -- The stored answer (0001, 0007): its status in the clear; its headers in
    -- `response_headers`, or sealed in `sealed_headers` under the key named in `sealed_with`;
    -- its body (sealed or not) in `response_body`. `response_stored` false: too large to store
    -- whole, its status and headers only (an earlier release's such answer: its status alone).
    response_status oncegate_status,
    response_headers jsonb,
    response_body bytea,
    response_stored boolean NOT NULL DEFAULT false,
    created_at timestamptz NOT NULL DEFAULT now(),
    completed_at timestamptz,
    expires_at timestamptz NOT NULL,
    -- A request waits for this key to settle (`Prefer: wait`): only then does a settle NOTIFY
    -- (0006).
    waited boolean NOT NULL DEFAULT false,
    sealed_with text,
    sealed_headers bytea,
    -- The request behind the key, sealed under `request_sealed_with` or in plaintext; who
    -- claimed it; what its gateway saw when it turned `unknown` (0011).
    request bytea,
    request_sealed_with text,
    claimed_by text,
    failure jsonb,
    -- (id, key): Citus enforces a primary key per shard, so it must hold the distribution
    -- column, `key`; `id` first, so lookups and pages by id still walk it (0008).
    CONSTRAINT oncegate_keys_pkey PRIMARY KEY (id, key),
    CONSTRAINT oncegate_keys_scope_key UNIQUE (scope, key),
    CONSTRAINT oncegate_keys_in_progress_has_lease
        CHECK (state <> 'in_progress' OR lease_expires_at IS NOT NULL),
    CONSTRAINT oncegate_keys_completed_has_status
        CHECK (state <> 'completed' OR response_status IS NOT NULL),
    CONSTRAINT oncegate_keys_stored_has_body
        CHECK (NOT response_stored OR (response_body IS NOT NULL AND
               (response_headers IS NOT NULL OR sealed_headers IS NOT NULL))),
    CONSTRAINT oncegate_keys_expires_after_created CHECK (expires_at > created_at),
    CONSTRAINT oncegate_keys_sealed_whole
        CHECK ((sealed_with IS NULL) = (sealed_headers IS NULL))
)
-- Room on each page, so storing an answer is a HOT update that touches no index (0003).
WITH (fillfactor = 70);

-- The purger walks expired rows oldest first in bounded batches (0001).
CREATE INDEX oncegate_keys_expires_at ON oncegate_keys (expires_at);

-- The agent library's checkpoints: one row per agent run (0002). `outputs` holds one entry per
-- finished step; `pending` is the action of `next_step` whose parameters were saved before it
-- was sent, so a resumed run sends the same request and the gateway replays it.
CREATE TABLE oncegate_checkpoints (
    run_id text PRIMARY KEY CHECK (char_length(run_id) BETWEEN 1 AND 200),
    task text NOT NULL CHECK (char_length(task) BETWEEN 1 AND 200),
    next_step integer NOT NULL CHECK (next_step >= 1),
    outputs jsonb NOT NULL,
    pending jsonb,
    created_at timestamptz NOT NULL DEFAULT now(),
    updated_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT oncegate_checkpoints_outputs_per_step CHECK (
        jsonb_typeof(outputs) = 'array' AND jsonb_array_length(outputs) = next_step - 1
    ),
    CONSTRAINT oncegate_checkpoints_pending_is_next_step CHECK (
        pending IS NULL OR (pending->>'step')::integer = next_step
    )
);

-- The operator page's sessions ended by a logout, each (a SHA-256 of its cookie) until its own
-- expiry (0009).
CREATE TABLE oncegate_ended_sessions (
    session bytea PRIMARY KEY CHECK (length(session) = 32),
    expires_at timestamptz NOT NULL
);


-- The state a key is in, said once (tests/store/test_state_rule.py holds it as a table and
-- runs it beside its Python twin, `store.memory.key_state`):
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
