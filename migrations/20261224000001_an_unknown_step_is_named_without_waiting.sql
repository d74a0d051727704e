-- `cancel RUN --step NOSUCH` waited for the run's row lock before it looked
-- for the step (a worker's write, a pass, a long transaction holding the
-- run): up to the bound of the wait, then a lock-timeout error instead of
-- "no step named" and exit 4. A run's step definitions are written once, at
-- submit, so the step is looked for first, without the lock (and the run's
-- existence with it, so an unknown run still reads "unknown run"). Otherwise
-- unchanged from 20261220000003.
CREATE OR REPLACE FUNCTION durable.cancel_run(rid uuid, step_name text DEFAULT NULL, reason text DEFAULT 'CANCEL_REQUESTED')
RETURNS text LANGUAGE plpgsql AS $$
DECLARE
    cur text; run_key text; d durable.step_defs;
BEGIN
    -- the reason is written into the history and the steps' rows by a
    -- function that runs as the schema's owner: one bounded line
    reason := coalesce(reason, 'CANCEL_REQUESTED');
    IF length(reason) > 200 OR btrim(reason, E' \t\r\n\f' || chr(11)) = ''
       OR reason ~ '[[:cntrl:]\u2028\u2029\u200e\u200f\u202a-\u202e\u2066-\u2069\u061c]' THEN
        RAISE EXCEPTION 'cancel reason %: give a line of at most 200 characters without control characters or line separators, like MAINTENANCE or "user requested" (default CANCEL_REQUESTED)',
            CASE WHEN length(reason) > 60
                 THEN to_json(left(reason, 40) || '…')::text || ' (' || length(reason) || ' characters)'
                 ELSE to_json(reason)::text END
            USING ERRCODE = '22023';
    END IF;
    -- a step the run does not have is an error whatever the run's state,
    -- told without waiting for the run's lock (definitions never change)
    IF step_name IS NOT NULL
       AND NOT EXISTS (SELECT 1 FROM durable.step_defs WHERE run_id = rid AND name = step_name) THEN
        IF NOT EXISTS (SELECT 1 FROM durable.workflow_runs WHERE id = rid) THEN
            RAISE EXCEPTION 'unknown run %', rid USING ERRCODE = 'P0D04';
        END IF;
        RAISE EXCEPTION 'run % has no step named "%"', rid, step_name USING ERRCODE = 'P0D04';
    END IF;
    SELECT state, coalesce(idempotency_key, id::text) INTO cur, run_key
      FROM durable.workflow_runs WHERE id = rid FOR NO KEY UPDATE;
    IF cur IS NULL THEN
        RAISE EXCEPTION 'unknown run %', rid USING ERRCODE = 'P0D04';
    END IF;
    IF durable.run_state_is_terminal(cur) THEN
        RETURN cur;
    END IF;
    IF step_name IS NULL THEN
        -- the run's flag first: from its commit on, no step of this run is
        -- leased and the heartbeat reports every lease of it as cancelled
        UPDATE durable.workflow_runs SET cancel_requested = true WHERE id = rid AND NOT cancel_requested;
        -- steps not created yet will now never run: create them cancelled
        -- (in one statement)
        PERFORM durable.create_steps(
            ARRAY(SELECT sd FROM durable.step_defs sd
                   WHERE sd.run_id = rid
                     AND NOT EXISTS (SELECT 1 FROM durable.step_runs s WHERE s.run_id = rid AND s.name = sd.name)
                   ORDER BY sd.position),
            run_key, 'DEPENDENCY_NOT_SUCCEEDED');
        -- one statement over every open step, locked in id order: a step that
        -- is leased between the lock and the write is re-checked on its new
        -- version and flagged instead of cancelled, never missed
        WITH open_steps AS (
            SELECT id FROM durable.step_runs
             WHERE run_id = rid AND state IN ('pending', 'retryable_failed', 'leased', 'running')
             ORDER BY id FOR NO KEY UPDATE
        )
        UPDATE durable.step_runs s
           SET state = CASE WHEN s.state IN ('pending', 'retryable_failed') THEN 'cancelled' ELSE s.state END,
               transition_reason = CASE WHEN s.state IN ('pending', 'retryable_failed') THEN reason ELSE s.transition_reason END,
               transition_by = CASE WHEN s.state IN ('pending', 'retryable_failed') THEN NULL ELSE s.transition_by END,
               cancel_requested = true
          FROM open_steps o WHERE s.id = o.id;
    ELSE
        IF NOT EXISTS (SELECT 1 FROM durable.step_defs WHERE run_id = rid AND name = step_name) THEN
            RAISE EXCEPTION 'run % has no step named "%"', rid, step_name USING ERRCODE = 'P0D04';
        END IF;
        IF NOT EXISTS (SELECT 1 FROM durable.step_runs WHERE run_id = rid AND name = step_name) THEN
            SELECT * INTO d FROM durable.step_defs WHERE run_id = rid AND name = step_name;
            PERFORM durable.create_steps(ARRAY[d], run_key, 'DEPENDENCY_NOT_SUCCEEDED');
        END IF;
        UPDATE durable.step_runs s
           SET state = CASE WHEN s.state IN ('pending', 'retryable_failed') THEN 'cancelled' ELSE s.state END,
               transition_reason = CASE WHEN s.state IN ('pending', 'retryable_failed') THEN reason ELSE s.transition_reason END,
               transition_by = CASE WHEN s.state IN ('pending', 'retryable_failed') THEN NULL ELSE s.transition_by END,
               cancel_requested = true
         WHERE s.run_id = rid AND s.name = step_name
           AND s.state IN ('pending', 'retryable_failed', 'leased', 'running');
    END IF;
    PERFORM pg_notify('durable_cancel', rid::text);
    RETURN durable.recompute_run(rid, 'cancel requested');
END $$;

-- CREATE OR REPLACE resets what 20261218000002 set
ALTER FUNCTION durable.cancel_run(uuid, text, text) SECURITY DEFINER SET search_path = pg_catalog, pg_temp;
