-- A step still waiting for its dependencies when its deadline passes fails
-- then (DAG audit): it was only found out once its dependencies had ended,
-- so a run whose upstream step ran for hours failed hours after a deadline
-- that had made it fail for sure. The deadline pass (Db::fail_overdue) now
-- also takes such definitions: each is created and, in the same
-- transaction, leased and failed DEADLINE_EXCEEDED, the legal way out of
-- pending, as an overdue pending step is; its run fails as for any terminal
-- failure (its running steps are asked to stop, its waiting ones cancelled).
-- No other transaction ever sees the step pending.

-- the deadline pass's probe: definitions with a deadline whose step may
-- still be waiting (deps_remaining reaches 0 when it is created)
CREATE INDEX step_defs_waiting_deadline ON durable.step_defs (deadline)
    WHERE deadline IS NOT NULL AND deps_remaining > 0;

-- Creates the step of definition p_name of run p_run if it still waits for
-- its dependencies, its deadline has passed and its run is open and not
-- being cancelled; the run row is locked first, waiting at most p_wait for
-- it (NULL, nothing created, when another transaction holds it longer).
-- Returns the new step's id, or NULL.
CREATE FUNCTION durable.create_overdue_waiting_step(p_run uuid, p_name text, p_wait text) RETURNS uuid
LANGUAGE plpgsql AS $$
DECLARE
    caller_timeout text := current_setting('lock_timeout');
    d durable.step_defs;
    new_id uuid;
BEGIN
    PERFORM set_config('lock_timeout', p_wait, true);
    BEGIN
        PERFORM 1 FROM durable.workflow_runs
         WHERE id = p_run AND state IN ('pending', 'running') AND NOT cancel_requested
           FOR NO KEY UPDATE;
        IF NOT FOUND THEN
            PERFORM set_config('lock_timeout', caller_timeout, true);
            RETURN NULL;
        END IF;
    EXCEPTION WHEN lock_not_available THEN
        PERFORM set_config('lock_timeout', caller_timeout, true);
        RETURN NULL;
    END;
    PERFORM set_config('lock_timeout', caller_timeout, true);
    SELECT * INTO d FROM durable.step_defs sd
     WHERE sd.run_id = p_run AND sd.name = p_name AND sd.deadline < now() AND sd.deps_remaining > 0
       AND NOT EXISTS (SELECT 1 FROM durable.step_runs s WHERE s.run_id = p_run AND s.name = p_name);
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    SELECT x INTO new_id FROM durable.create_steps(ARRAY[d], NULL, 'DEADLINE_EXCEEDED') AS x;
    RETURN new_id;
END $$;
