-- The agent library's checkpoint store (`app.store.checkpoints`), one named query each
-- (`-- name: NAME`). Kept apart from the gateway's queries.sql: another table, another user.

-- name: checkpoint_load
-- `updated_at` dates a pending action saved before it carried its own `saved_at` (the save that
-- set it was the row's last: a resumed run sends a pending action without saving it again).
SELECT run_id, task, next_step, outputs::text AS outputs, pending::text AS pending, updated_at
FROM oncegate_checkpoints
WHERE run_id = $1;

-- name: checkpoint_save
-- Insert, or replace the run's row, but only with a checkpoint of the same task that is not
-- behind the stored one: a process that wakes up late cannot rewind a run. Nothing returned
-- means refused. `updated_at` is the new row's default, now(): on Citus (the table distributed by
-- run_id) a DO UPDATE SET may not call now() itself, and the insert's default is computed once.
INSERT INTO oncegate_checkpoints (run_id, task, next_step, outputs, pending)
VALUES ($1, $2, $3, $4::jsonb, $5::jsonb)
ON CONFLICT (run_id) DO UPDATE
SET next_step = EXCLUDED.next_step,
    outputs = EXCLUDED.outputs,
    pending = EXCLUDED.pending,
    updated_at = EXCLUDED.updated_at
WHERE oncegate_checkpoints.task = EXCLUDED.task
  AND oncegate_checkpoints.next_step <= EXCLUDED.next_step
RETURNING run_id;

-- name: checkpoint_describe
-- Why a save was refused.
SELECT task, next_step FROM oncegate_checkpoints WHERE run_id = $1;

-- name: checkpoint_delete
DELETE FROM oncegate_checkpoints WHERE run_id = $1 RETURNING run_id;
