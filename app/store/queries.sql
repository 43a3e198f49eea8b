-- The key table's statements, one named query each (`-- name: NAME`), with named parameters
-- (`:scope`; queries.py numbers them for asyncpg). Not every statement of the store is here:
-- the agent's are in checkpoints.sql; Citus's catalog is read in citus.py; the claims and
-- completes a Citus worker runs on its own shard tables are built per batch, shard by shard, in
-- postgres/workers.py; the schema's revision is read in postgres/upkeep.py.
-- Each runs alone, autocommitted: one round trip, and no transaction is ever held open across
-- the upstream call. Times come from PostgreSQL's clock, so gateways on several machines agree.
--
-- One dialect: each statement is written once, in a form both plain PostgreSQL and a Citus
-- coordinator run (the key table distributed by `key`, migration 0008). Six operations must
-- differ, and have one shape per server, named `-- name: NAME [postgres]` and
-- `-- name: NAME [citus]`: the claim, the purge, the operator's delete and rekey, a page of the
-- key count and the estimate of the table's rows.
-- store/postgres/dialect.py chooses the server's shapes once; a statement the server has no
-- shape of is an error there, never another server's statement. What the shared form asks:
-- - a batched write by row finds its rows through `{rows_of_batch}`, shaped per server: on
--   Citus it names the keys it touches (`k.key = ANY(:keys)`): the store batches per shard, so a
--   batch's keys share one shard and Citus sends the statement there alone (router executor, no
--   two-phase commit); on plain PostgreSQL the join with the batch alone, so that the plan looks
--   each row up by its primary key (tests/store/test_plans.py reads the plans);
-- - a write tests a state with `oncegate_key_is(wanted, ..., now())` and computes a lease's
--   end with `oncegate_after(now(), seconds)`, both IMMUTABLE SQL functions PostgreSQL inlines:
--   Citus refuses a CASE around now(), or a STABLE function of a column, in a write, and
--   evaluates now() once, on the coordinator, sending the value;
-- - a settle returns `waited` and the store sends `notify` for the rows someone waits on, after
--   the settle committed: a pg_notify on a Citus worker would never reach the coordinator the
--   gateways LISTEN on (waiters also poll their row, so a lost notification costs time only).
--
-- What state a key is in is said once (migrations/schema.sql): in_progress (its lease runs),
-- expired (past its TTL: a new key), unknown (marked so, or its lease ran out), completed. A read
-- names it with `oncegate_key_state(state, lease_expires_at, expires_at)`, a write's condition
-- with `oncegate_key_is`, its rule as a test; only a writer's compare-and-set on its own fencing
-- token reads the stored `state` column, which says what the last writer did.
--
-- Fencing: a claim starts its row at token 1 and every take-over of the row adds one. Every
-- write names the row by its primary key, (id, key), and the token it holds, so a gateway that
-- lost a row can never touch it, nor a newer row for the same key (a new id). (Naming the key
-- also lets the planner use the primary key as unique: by id alone, a generic plan of a batch
-- could not, and read the whole table; and on Citus the key names the shard.) A per-row
-- counter rather than a sequence:
-- an insert evaluates its values even when it conflicts, and a sequence takes a transaction id
-- and a WAL flush every 32 values, so replays would wait for fsyncs (migration 0004).

-- The request path's writes are batched (store/batching.py): each statement carries the
-- operations of many requests as parallel arrays (`unnest`), and every row keeps its own result,
-- returned with its position (`n`) or its (id, token). One statement and one commit for all.
-- Rows are written in one order (by (scope, key) for claims, by id for the rest), so two batches
-- that touch the same rows wait for each other instead of deadlocking. The caller
-- (postgres/requests.py) sends each key, or each (id, token), once per batch and answers its
-- copies itself. Each operation has statements of its own: only a Citus worker's claims and
-- completes share one (postgres/workers.py), which saves a fence and a commit there.

-- fragment: claim_outcome
-- What a claim returns for each key it was sent (`wanted`: the batch, `n` its position;
-- `claimed`: the rows it inserted; `held`: the row that held the key), for `claim` below and
-- for the claim a Citus worker runs on its own shard tables (postgres/workers.py): written
-- once, so the two cannot differ.
wanted.n,
claimed.id IS NOT NULL AS claimed,
coalesce(claimed.id, held.id) AS id,
coalesce(claimed.fencing_token, held.fencing_token) AS fencing_token,
held.fingerprint,
oncegate_key_state(held.state, held.lease_expires_at, held.expires_at) AS state,
held.response_status, held.response_headers, held.response_body, held.response_stored,
held.sealed_with, held.sealed_headers;

-- name: claim [postgres]
-- Take new keys, or read the rows that already hold them: one round trip either way.
-- The unique constraint is the arbiter: of many concurrent claims, one inserts. The read runs on
-- the statement's snapshot, so a row committed by a concurrent claim after this statement began
-- is not seen; then neither branch returns a row (id is NULL) and the caller reads it with `get`.
-- Every decision that writes is a compare-and-set on the fencing token, so a read a moment old
-- is safe.
-- The kept requests (up to a route's `max_body` each) stay out of `wanted` and out of the sort:
-- each is taken from its array by position as its row is inserted, after the rows are put in
-- order (the subquery's OFFSET 0 keeps the planner from pulling the sort above it). Carried
-- through them, an 8.6 MiB request was copied into three temporary files past `work_mem` (26 MiB
-- written and read back per claim, the statement's time waiting on them on a busy machine).
WITH wanted AS (
    SELECT *
    FROM unnest(:routes::text[], :scopes::bytea[], :keys::text[], :fingerprints::bytea[],
                :leases::float8[], :ttls::float8[], :requests_sealed_with::text[])
         WITH ORDINALITY
         AS wanted(route, scope, key, fingerprint, lease, ttl, request_sealed_with, n)
),
claimed AS (
    INSERT INTO oncegate_keys
        (route, scope, key, fingerprint, state, fencing_token, lease_expires_at, expires_at,
         request, request_sealed_with, claimed_by)
    SELECT route, scope, key, fingerprint, 'in_progress', 1,
           oncegate_after(now(), lease), oncegate_after(now(), ttl),
           (:requests::bytea[])[n], request_sealed_with, :claimant
    FROM (SELECT * FROM wanted ORDER BY scope, key OFFSET 0) AS ordered
    ON CONFLICT (scope, key) DO NOTHING
    RETURNING id, fencing_token, scope, key
)
SELECT {claim_outcome}
FROM wanted
LEFT JOIN claimed ON claimed.scope = wanted.scope AND claimed.key = wanted.key
LEFT JOIN oncegate_keys AS held
       ON claimed.id IS NULL AND held.scope = wanted.scope AND held.key = wanted.key;

-- name: claim [citus]
-- The same, as a function Citus runs on the worker that holds the shard of `anchor` (one of
-- the batch's keys, which share its shard): one round trip, and the function's statements stay
-- on that worker. Citus would pull the INSERT ... SELECT above through the coordinator.
SELECT * FROM oncegate_claim(:anchor, :routes, :scopes, :keys, :fingerprints, :leases, :ttls,
                             :requests, :requests_sealed_with, :claimant);

-- name: get
SELECT id,
       fencing_token,
       fingerprint,
       oncegate_key_state(state, lease_expires_at, expires_at) AS state,
       response_status,
       response_headers,
       response_body,
       response_stored,
       sealed_with,
       sealed_headers
FROM oncegate_keys
WHERE scope = :scope AND key = :key;

-- fragment: rows_of_batch [postgres]
-- How a batched write by row (`given`: the batch) finds its rows. On plain PostgreSQL by the
-- join alone: each row of the batch looked up by the primary key (id, key), from an empty table
-- to a large one. A filter `k.id = ANY(:ids)` besides it (as on Citus) made the planner read the
-- batch's rows by that filter and then compare each with every row of the batch, once the table
-- was analysed: 128 completes cost 16,256 comparisons, a statement 5.7 ms of CPU instead of 1.5.
k.id = given.id AND k.key = given.key

-- fragment: rows_of_batch [citus]
-- On a Citus coordinator the keys also name the batch's shard (the key table is distributed by
-- `key`), so Citus routes the statement to it alone; and its ids the primary key's first column,
-- so that a worker's plan descends the index rather than reading it whole for `key`. The
-- coordinator plans each call with its values (`force_custom_plan`), so each plan knows the
-- batch's size.
k.key = ANY(:keys) AND k.id = ANY(:ids) AND k.id = given.id AND k.key = given.key

-- name: reclaim_expired
-- Take over expired rows as brand-new claims, each only if nobody changed it since it was read
-- (same fencing token). Returns the rows taken, with their new token.
UPDATE oncegate_keys AS k
SET route = given.route,
    fingerprint = given.fingerprint,
    state = 'in_progress',
    fencing_token = k.fencing_token + 1,
    lease_expires_at = oncegate_after(now(), given.lease),
    created_at = now(),
    completed_at = NULL,
    expires_at = oncegate_after(now(), given.ttl),
    response_status = NULL,
    response_headers = NULL,
    response_body = NULL,
    response_stored = false,
    sealed_with = NULL,
    sealed_headers = NULL,
    waited = false,
    request = given.request,
    request_sealed_with = given.request_sealed_with,
    claimed_by = given.claimant,
    failure = NULL
FROM unnest(:keys::text[], :ids::bigint[], :tokens::bigint[], :routes::text[],
            :fingerprints::bytea[], :leases::float8[], :ttls::float8[], :requests::bytea[],
            :requests_sealed_with::text[], :claimants::text[])
     AS given(key, id, token, route, fingerprint, lease, ttl, request, request_sealed_with,
              claimant)
WHERE {rows_of_batch}
  AND k.fencing_token = given.token
  AND oncegate_key_is('expired', k.state, k.lease_expires_at, k.expires_at, now())
RETURNING k.id, k.fencing_token;

-- name: take_over
-- `on_unknown: forward`: claim `unknown` rows again with a new fencing token, so the gateway
-- that lost one can no longer complete or release it.
UPDATE oncegate_keys AS k
SET state = 'in_progress',
    fencing_token = k.fencing_token + 1,
    lease_expires_at = oncegate_after(now(), given.lease),
    -- the key must not expire while the request it now guards is in flight
    expires_at = greatest(k.expires_at, oncegate_after(now(), given.lease + 1)),
    -- a new claim: who holds it now, and nothing seen yet (the kept request stays)
    claimed_by = given.claimant,
    failure = NULL
FROM unnest(:keys::text[], :ids::bigint[], :tokens::bigint[], :leases::float8[],
            :claimants::text[])
     AS given(key, id, token, lease, claimant)
WHERE {rows_of_batch}
  AND k.fencing_token = given.token
  AND oncegate_key_is('unknown', k.state, k.lease_expires_at, k.expires_at, now())
RETURNING k.id, k.fencing_token;

-- fragment: completed
-- What storing an answer writes into its row (`given`: the answer's columns), for `complete`
-- below and for the complete a Citus worker runs on its own shard tables (postgres/workers.py):
-- written once, so the two cannot differ.
state = 'completed',
response_status = given.status,
response_headers = given.headers::jsonb,
response_body = given.body,
response_stored = given.stored,
sealed_with = given.sealed_with,
sealed_headers = given.sealed_headers,
completed_at = now(),
lease_expires_at = NULL,
-- a completed key cannot turn `unknown`: its kept request goes (the new row version carries
-- no copy of it), and who claimed it
request = NULL,
request_sealed_with = NULL,
claimed_by = NULL

-- name: complete
-- The holder of the token stores its answer, even after its lease ran out (a late answer is
-- better than `unknown`); a take-over changed the token and refuses it. `waited`: someone waits
-- on the row (`mark_waited`), and the store sends `notify` for it.
UPDATE oncegate_keys AS k
SET {completed}
FROM unnest(:keys::text[], :ids::bigint[], :tokens::bigint[], :statuses::smallint[],
            :headers::text[], :bodies::bytea[], :stored::boolean[], :sealed_with::text[],
            :sealed_headers::bytea[])
     AS given(key, id, token, status, headers, body, stored, sealed_with, sealed_headers)
WHERE {rows_of_batch}
  AND k.fencing_token = given.token
  AND k.state IN ('in_progress', 'unknown')
RETURNING k.id, k.fencing_token, k.waited;

-- name: release
DELETE FROM oncegate_keys AS k
USING unnest(:keys::text[], :ids::bigint[], :tokens::bigint[]) AS given(key, id, token)
WHERE {rows_of_batch}
  AND k.fencing_token = given.token
  AND k.state = 'in_progress'
RETURNING k.id, k.fencing_token, k.waited;

-- name: mark_unknown
UPDATE oncegate_keys AS k
SET state = 'unknown',
    lease_expires_at = NULL,
    failure = given.failure::jsonb  -- what the gateway saw (service.evidence)
FROM unnest(:keys::text[], :ids::bigint[], :tokens::bigint[], :failures::text[])
     AS given(key, id, token, failure)
WHERE {rows_of_batch}
  AND k.fencing_token = given.token
  AND k.state = 'in_progress'
RETURNING k.id, k.fencing_token, k.waited;

-- name: notify
-- Wakes the requests waiting on settled rows (`Prefer: wait`), sent after the settle committed.
-- It reads no table, so on Citus it runs on the coordinator, where the gateways LISTEN.
SELECT pg_notify('oncegate_settled', id::text) FROM unnest(:ids::bigint[]) AS id;

-- name: mark_waited
-- `Prefer: wait`: ask for a notification when this in-flight key settles (migration 0006).
-- Nothing returned: it is not in flight any more (or not this claim), so there is nothing to
-- wait for.
UPDATE oncegate_keys
SET waited = true
WHERE key = :key
  AND id = :id
  AND fencing_token = :token
  AND oncegate_key_is('in_progress', state, lease_expires_at, expires_at, now())
RETURNING id;

-- name: renew
-- A forward whose answer is still being relayed keeps its claim: its lease runs again from now,
-- and the key cannot expire under it. Only the token's holder, and only while the lease runs:
-- a key that already turned `unknown` stays so (a retry may have been told).
UPDATE oncegate_keys
SET lease_expires_at = oncegate_after(now(), :lease::float8),
    expires_at = greatest(expires_at, oncegate_after(now(), :lease::float8 + 1))
WHERE key = :key
  AND id = :id
  AND fencing_token = :token
  AND oncegate_key_is('in_progress', state, lease_expires_at, expires_at, now())
RETURNING id;

-- name: purge [postgres]
-- One bounded batch of expired rows (`expires_at <= now()` first, so the index finds them).
-- Rows locked by a concurrent reclaim are skipped, and a row still in flight is never deleted,
-- whatever its TTL.
DELETE FROM oncegate_keys
WHERE ctid = ANY(ARRAY(
    SELECT ctid
    FROM oncegate_keys
    WHERE expires_at <= now()
      AND oncegate_key_state(state, lease_expires_at, expires_at) = 'expired'
    LIMIT :batch_size
    FOR UPDATE SKIP LOCKED
));

-- name: purge_candidates [citus]
-- On Citus the purge finds a batch on every shard, unlocked (no ctid subquery, no FOR UPDATE
-- across shards: Citus refuses both on a distributed table), then deletes it shard by shard
-- with `purge`.
SELECT key, id
FROM oncegate_keys
WHERE expires_at <= now()
  AND oncegate_key_state(state, lease_expires_at, expires_at) = 'expired'
LIMIT :batch_size;

-- name: purge [citus]
-- One shard's rows of the batch, checked again as they go: a row reclaimed since it was found is
-- a new key, and stays.
DELETE FROM oncegate_keys AS k
USING unnest(:keys::text[], :ids::bigint[]) AS doomed(key, id)
WHERE k.key = ANY(:keys)
  AND k.key = doomed.key AND k.id = doomed.id
  AND oncegate_key_is('expired', k.state, k.lease_expires_at, k.expires_at, now());

-- name: admin_find
-- An operator's look-up: one key in every scope, optionally on one route. Rare, so it may scan;
-- an index on `key` would cost every claim an extra index write.
SELECT id,
       route,
       scope,
       key,
       fingerprint,
       oncegate_key_state(state, lease_expires_at, expires_at) AS state,
       response_status,
       response_headers,
       response_body,
       response_stored,
       sealed_with,
       sealed_headers,
       fencing_token,
       created_at,
       completed_at,
       expires_at,
       request,
       request_sealed_with,
       claimed_by,
       failure::text
FROM oncegate_keys
WHERE key = :key AND (:route::text IS NULL OR route = :route)
ORDER BY id;

-- name: admin_by_id
-- One key by id, as admin_find shows it (the operator page, a re-send).
SELECT id,
       route,
       scope,
       key,
       fingerprint,
       oncegate_key_state(state, lease_expires_at, expires_at) AS state,
       response_status,
       response_headers,
       response_body,
       response_stored,
       sealed_with,
       sealed_headers,
       fencing_token,
       created_at,
       completed_at,
       expires_at,
       request,
       request_sealed_with,
       claimed_by,
       failure::text
FROM oncegate_keys
WHERE id = :id;

-- The operator's writes find a row by its id (`key_of`, which on Citus reads every shard), then
-- name it by its primary key, (id, key), as the request path does: on Citus, on its own shard.

-- name: key_of
SELECT key FROM oncegate_keys WHERE id = :id;

-- name: admin_delete [postgres]
-- Any key but one whose request is in flight right now: deleting that one would let the next
-- retry be forwarded while the first is still at the upstream. Returns the row's state either
-- way (deleted: NULL means no such key), in one statement.
WITH doomed AS (
    DELETE FROM oncegate_keys
    WHERE id = :id AND oncegate_key_state(state, lease_expires_at, expires_at) <> 'in_progress'
    RETURNING id
)
SELECT EXISTS (SELECT FROM doomed) AS deleted,
       EXISTS (SELECT FROM oncegate_keys WHERE id = :id) AS exists;

-- name: admin_delete [citus]
-- The same rule on the row's shard, found by `key_of` first (Citus runs no CTE that writes one
-- shard and reads every other); whether a row not deleted exists is read again after.
DELETE FROM oncegate_keys
WHERE key = :key AND id = :id
  AND NOT oncegate_key_is('in_progress', state, lease_expires_at, expires_at, now())
RETURNING id;

-- name: admin_resolve_completed
-- Settle an `unknown` key as completed with the answer an operator found out, with a new fencing
-- token so no late gateway overwrites it; only while the token is the one the answer was sealed
-- for (plus one).
UPDATE oncegate_keys
SET state = 'completed',
    fencing_token = fencing_token + 1,
    lease_expires_at = NULL,
    response_status = :status,
    response_headers = :headers::jsonb,
    response_body = :body,
    response_stored = :stored,
    sealed_with = :sealed_with,
    sealed_headers = :sealed_headers,
    completed_at = now(),
    request = NULL,
    request_sealed_with = NULL,
    claimed_by = NULL
WHERE key = :key AND id = :id AND fencing_token = :token
  AND oncegate_key_is('unknown', state, lease_expires_at, expires_at, now())
RETURNING id;

-- name: admin_resolve_released
DELETE FROM oncegate_keys
WHERE key = :key AND id = :id
  AND oncegate_key_is('unknown', state, lease_expires_at, expires_at, now())
RETURNING id;

-- name: admin_queue
-- What the gateway knows of keys: one key by id, or the operator's queue (the keys in one state,
-- oldest first, one page after the cursor (created_at, id)). The queue scans, like admin_find: an
-- index that could find the rare unknown rows would have to name `state`, and storing an answer
-- changes `state`, so every answer write would stop being a HOT update (migration 0003). The
-- cause is read from the stored `state`, which says what the last writer did: `unknown` written
-- by a gateway that lost the answer, or `in_progress` left by one that never came back.
SELECT id,
       route,
       key,
       state_now AS state,
       CASE WHEN state_now = 'unknown' THEN
           CASE state WHEN 'unknown' THEN 'answer_lost' ELSE 'lease_expired' END
       END AS cause,
       response_status,
       created_at,
       lease_expires_at,
       completed_at,
       expires_at
FROM (
    SELECT *, oncegate_key_state(state, lease_expires_at, expires_at) AS state_now
    FROM oncegate_keys
    WHERE :id::bigint IS NULL OR id = :id
) AS keys
WHERE (:state::text IS NULL OR state_now = :state)
  AND (:route::text IS NULL OR route = :route)
  AND (:since::timestamptz IS NULL OR created_at >= :since)
  AND (:after_time::timestamptz IS NULL OR (created_at, id) > (:after_time, :after_id::bigint))
ORDER BY created_at, id
LIMIT :limit;

-- fragment: counted_by_state
-- What one page of the sweep behind the gauge `oncegate_keys{state}` returns, from the page's
-- rows (`id`, `state_now`): written once for both shapes of `count_keys`.
max(id) AS last_id,
count(*) AS counted,
count(*) FILTER (WHERE state_now = 'in_progress') AS in_progress,
count(*) FILTER (WHERE state_now = 'completed') AS completed,
count(*) FILTER (WHERE state_now = 'unknown') AS unknown

-- name: count_keys [postgres]
-- One page of the sweep behind the gauge `oncegate_keys{state}`: the next :page_size rows by id,
-- found through the primary key, so each statement reads a bounded number of rows however large
-- the table is (service.count_keys pauses between pages); a page that did not fill is the last.
SELECT {counted_by_state}
FROM (
    SELECT id, oncegate_key_state(state, lease_expires_at, expires_at) AS state_now
    FROM oncegate_keys
    WHERE id > :after
    ORDER BY id
    LIMIT :page_size
) AS page;

-- name: count_keys [citus]
-- The same page on Citus, by a range of ids rather than a LIMIT: from the first id past :after,
-- the next :page_size ids (ids are unique, so at most :page_size rows; fewer where ids were
-- skipped, and a page that did not fill is not the last: the sweep ends at an empty one). Each
-- part is one Citus pushes down to every shard whole, each worker reading its own rows of the
-- range through its primary key and sending back one row of counts. The LIMIT above is not:
-- each shard sent the coordinator its first :page_size rows past :after, which the coordinator
-- sorted and cut to one page, so a sweep read and moved (shards x keys) rows: with 4 shards,
-- the coordinator's CPU for one sweep was 0.35 s at 10^5 keys and 3.8 s at 10^6; by ranges,
-- 0.05 and 0.4 s, the workers' about halved (docs/operations.md, section 6). Ids are unique but
-- not dense: each Citus node hands out its own range (a worker's from 2^48 times its group), and
-- released or purged keys leave gaps, so a page starts at the first id that exists.
WITH first AS (SELECT min(id) AS id FROM oncegate_keys WHERE id > :after)
SELECT {counted_by_state}
FROM (
    SELECT id, oncegate_key_state(state, lease_expires_at, expires_at) AS state_now
    FROM oncegate_keys
    WHERE id >= (SELECT id FROM first) AND id < (SELECT id FROM first) + :page_size
) AS page;

-- name: admin_scope
-- What an operator's answer is sealed for: the row's scope and the fencing token its resolution
-- will give it (this one plus one; the resolution checks this one is still the row's).
SELECT scope, fencing_token FROM oncegate_keys WHERE id = :id;

-- name: rekey_batch [postgres]
-- `oncegate rekey`: the next batch (by id, after the last one) of stored answers not sealed
-- under the newest key, locked until the caller has re-sealed them in the same transaction. It
-- waits for a row another writer holds rather than skip it: a skipped row would keep the old key.
-- A stored answer has its headers, plaintext or sealed (one too large to store whole has no body).
SELECT id, scope, fencing_token, response_headers, response_body, sealed_with, sealed_headers
FROM oncegate_keys
WHERE (response_headers IS NOT NULL OR sealed_headers IS NOT NULL)
  AND sealed_with IS DISTINCT FROM :newest AND id > :after
ORDER BY id
LIMIT :batch_size
FOR UPDATE;

-- name: rekey_rows [postgres]
-- The re-sealed answers of one batch, in one statement.
UPDATE oncegate_keys AS row
SET response_headers = NULL,
    response_body = resealed.body,
    sealed_with = :sealed_with,
    sealed_headers = resealed.headers
FROM unnest(:ids::bigint[], :tokens::bigint[], :bodies::bytea[], :headers::bytea[])
     AS resealed(id, token, body, headers)
WHERE row.id = resealed.id AND row.fencing_token = resealed.token;

-- name: rekey_batch [citus]
-- On Citus: the next batch, not locked (Citus takes no row lock over several shards);
-- `rekey_rows` writes each row back only if it still holds what was read.
SELECT id, key, scope, fencing_token, response_headers, response_body, sealed_with, sealed_headers
FROM oncegate_keys
WHERE (response_headers IS NOT NULL OR sealed_headers IS NOT NULL)
  AND sealed_with IS DISTINCT FROM :newest AND id > :after
ORDER BY id
LIMIT :batch_size;

-- name: rekey_rows [citus]
-- One shard's re-sealed answers, each a compare-and-set on (token, the key that sealed it): a
-- row settled again since it was read keeps what its new writer stored.
UPDATE oncegate_keys AS row
SET response_headers = NULL,
    response_body = resealed.body,
    sealed_with = :sealed_with,
    sealed_headers = resealed.headers
FROM unnest(:keys::text[], :ids::bigint[], :tokens::bigint[], :was::text[], :bodies::bytea[],
            :headers::bytea[])
     AS resealed(key, id, token, was, body, headers)
WHERE row.key = ANY(:keys)
  AND row.key = resealed.key AND row.id = resealed.id AND row.fencing_token = resealed.token
  AND (row.response_headers IS NOT NULL OR row.sealed_headers IS NOT NULL)
  AND row.sealed_with IS NOT DISTINCT FROM resealed.was;

-- name: rekey_remaining
-- What is still not under the newest key, in the whole table: stored answers, and requests kept
-- behind keys (their `request_sealed_with` names the key alone).
SELECT count(*) FROM oncegate_keys
WHERE ((response_headers IS NOT NULL OR sealed_headers IS NOT NULL)
       AND sealed_with IS DISTINCT FROM :newest)
   OR (request IS NOT NULL AND request_sealed_with IS DISTINCT FROM :newest_request);

-- name: held_keys
-- How many keys the store holds, expired ones not yet purged included: said once at start-up,
-- so an operator sees which store a gateway opened (an empty one where keys were expected is a
-- wrong data directory or URL). Counted exactly up to :cap, reading at most :cap rows (an
-- index-only walk that stops there), so a start costs the same on 10^8 keys as on 10^3;
-- beyond, `estimated_keys` says about how many. (A `count(*)` of the table read every row at
-- every `oncegate serve`: at 10^6 keys 107 ms, at 10^8 every row again, from disk where the
-- table is not cached; this, 0.2 ms.) `SELECT 1`: Citus refuses a subquery of no column.
SELECT count(*) AS keys FROM (SELECT 1 FROM oncegate_keys LIMIT :cap) AS held;

-- name: estimated_keys [postgres]
-- About how many rows the key table holds, from its statistics (`reltuples`, kept by VACUUM and
-- ANALYZE, autovacuum's included): no row read. -1 before the table's first VACUUM or ANALYZE.
SELECT reltuples::bigint AS keys FROM pg_class WHERE oid = 'oncegate_keys'::regclass;

-- name: estimated_keys [citus]
-- The same on Citus: the coordinator's table holds no rows, each shard's statistics are on its
-- worker. A shard whose worker does not answer counts for nothing here; one never analysed
-- makes the whole -1 (no statistics yet), as on plain PostgreSQL.
SELECT (CASE WHEN min(result::float8) < 0 THEN -1 ELSE sum(result::float8) END)::bigint AS keys
FROM run_command_on_shards(
    'oncegate_keys',
    $$SELECT reltuples FROM pg_class WHERE oid = '%s'::regclass$$
)
WHERE success;

-- name: answers_after_failover
-- After a failover (postgres/failover.py): of the rows whose answers this gateway stored just
-- before it, or could not store during it, those the new primary holds unanswered (still in
-- flight, or unknown: a retry is refused until an operator resolves it) and those it does not
-- hold at all (the claim was lost too: a retry is forwarded again).
SELECT count(*) FILTER (WHERE k.id IS NOT NULL AND k.state <> 'completed') AS unanswered,
       count(*) FILTER (WHERE k.id IS NULL) AS gone
FROM unnest(:ids::bigint[], :tokens::bigint[]) AS given(id, token)
LEFT JOIN oncegate_keys AS k ON k.id = given.id AND k.fencing_token = given.token;

-- name: replication
-- The primary's streaming standbys and how commits wait for them (store.Replication). A role
-- without pg_monitor (or pg_read_all_stats) sees the rows but not their state: `hidden` says so.
SELECT count(*) FILTER (WHERE state IS DISTINCT FROM 'startup') AS standbys,
       count(*) FILTER (WHERE sync_state IN ('sync', 'quorum')) AS synchronous,
       count(*) > 0 AND bool_and(state IS NULL) AS hidden,
       current_setting('synchronous_standby_names') AS synchronous_standby_names,
       current_setting('synchronous_commit') AS synchronous_commit
FROM pg_stat_replication;

-- name: end_session
-- A logout: the session is refused until its own expiry (migration 0009). Sessions already past
-- theirs are deleted on the way, so the table holds only live ones.
WITH expired AS (DELETE FROM oncegate_ended_sessions WHERE expires_at < now())
INSERT INTO oncegate_ended_sessions (session, expires_at)
VALUES (:session, :expires_at)
ON CONFLICT (session) DO NOTHING;

-- name: session_ended
SELECT EXISTS (SELECT FROM oncegate_ended_sessions WHERE session = :session) AS ended;

-- name: rekey_request_batch
-- `oncegate rekey`: the next batch (by id) of kept requests not sealed under the newest key.
-- Read without a lock: each is written back by a compare-and-set on its bytes (rekey_request).
SELECT id, key, scope, fingerprint, request, request_sealed_with
FROM oncegate_keys
WHERE request IS NOT NULL AND request_sealed_with IS DISTINCT FROM :newest AND id > :after
ORDER BY id
LIMIT :batch_size;

-- name: rekey_request
-- One kept request re-sealed, only if it is still the one read (a key that completed or was
-- claimed again meanwhile has another, or none). The key names the row's shard on Citus.
UPDATE oncegate_keys
SET request = :request, request_sealed_with = :sealed_with
WHERE key = :key AND id = :id AND request = :was;
