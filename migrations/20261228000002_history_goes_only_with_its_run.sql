-- History and results go only with their whole run (deployment audit): the
-- worker's role, which needs DELETE for retention, deleted a finished run's
-- transitions and events (`DELETE FROM durable.transitions WHERE true`)
-- while the run stayed, and 20261224000005 had only refused UPDATE.
--
-- Now a row of durable.transitions, durable.step_events, durable.artifacts
-- or durable.step_runs may be deleted only when its run is gone (a DELETE of
-- the run, whose cascade takes them), or when the run is terminal and marked
-- in durable.runs_being_removed (retention marks each run whose steps it
-- deletes; the mark goes with the run). Anything else is refused (55000)
-- and the whole statement rolls back. So a role that may DELETE can remove
-- a finished run whole (retention's power; marking a run hands it to the
-- next retention pass, whatever its age) but never a part of a run's
-- history or results while the run stays, and never anything of an open run.
--
-- The check is one statement trigger per table over the deleted rows, set
-- based: nothing on the hot path (the runtime deletes nothing but through
-- retention).

CREATE FUNCTION durable.refuse_partial_removal() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    bad uuid;
BEGIN
    IF TG_TABLE_NAME = 'step_events' THEN
        -- an event names its step; a step already gone went with its run
        SELECT s.run_id INTO bad
          FROM (SELECT DISTINCT o.step_run_id FROM old_rows o) o
          JOIN durable.step_runs s ON s.id = o.step_run_id
          JOIN durable.workflow_runs r ON r.id = s.run_id
         WHERE NOT (durable.run_state_is_terminal(r.state)
                    AND EXISTS (SELECT 1 FROM durable.runs_being_removed m WHERE m.run_id = r.id))
         LIMIT 1;
    ELSE
        SELECT r.id INTO bad
          FROM (SELECT DISTINCT o.run_id FROM old_rows o) o
          JOIN durable.workflow_runs r ON r.id = o.run_id
         WHERE NOT (durable.run_state_is_terminal(r.state)
                    AND EXISTS (SELECT 1 FROM durable.runs_being_removed m WHERE m.run_id = r.id))
         LIMIT 1;
    END IF;
    IF bad IS NOT NULL THEN
        RAISE EXCEPTION 'rows of durable.% of run % are removed only with the whole run, by retention (`supervisor gc`), once it finished: history and results are never deleted while their run stays', TG_TABLE_NAME, bad
            USING ERRCODE = '55000';
    END IF;
    RETURN NULL;
END $$;

CREATE TRIGGER transitions_removed_with_run AFTER DELETE ON durable.transitions
    REFERENCING OLD TABLE AS old_rows
    FOR EACH STATEMENT EXECUTE FUNCTION durable.refuse_partial_removal();
CREATE TRIGGER step_events_removed_with_run AFTER DELETE ON durable.step_events
    REFERENCING OLD TABLE AS old_rows
    FOR EACH STATEMENT EXECUTE FUNCTION durable.refuse_partial_removal();
CREATE TRIGGER artifacts_removed_with_run AFTER DELETE ON durable.artifacts
    REFERENCING OLD TABLE AS old_rows
    FOR EACH STATEMENT EXECUTE FUNCTION durable.refuse_partial_removal();
CREATE TRIGGER step_runs_removed_with_run AFTER DELETE ON durable.step_runs
    REFERENCING OLD TABLE AS old_rows
    FOR EACH STATEMENT EXECUTE FUNCTION durable.refuse_partial_removal();

-- Retention marks the runs whose steps it deletes, first. Otherwise
-- unchanged from 20261203000002.
CREATE OR REPLACE FUNCTION durable.retention_delete_steps(sids uuid[]) RETURNS text[]
LANGUAGE plpgsql AS $$
DECLARE
    shas text[];
BEGIN
    INSERT INTO durable.runs_being_removed (run_id)
    SELECT DISTINCT s.run_id FROM durable.step_runs s WHERE s.id = ANY (sids)
        ON CONFLICT (run_id) DO NOTHING;
    DELETE FROM durable.step_events WHERE step_run_id = ANY (sids);
    WITH a AS (DELETE FROM durable.artifacts WHERE step_run_id = ANY (sids) RETURNING sha256)
    SELECT array_agg(sha256) INTO shas FROM a;
    DELETE FROM durable.transitions WHERE step_run_id = ANY (sids);
    DELETE FROM durable.step_runs WHERE id = ANY (sids);
    RETURN coalesce(shas, '{}');
END $$;
