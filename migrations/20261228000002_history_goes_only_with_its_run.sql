-- History and results go only with their whole run (deployment audit): the
-- worker's role, which needs DELETE for retention, deleted a finished run's
-- transitions and events (`DELETE FROM durable.transitions WHERE true`)
-- while the run stayed, and 20261224000005 had only refused UPDATE.
--
-- Now a row of durable.transitions, durable.step_events, durable.artifacts,
-- durable.step_runs, durable.step_defs or durable.step_dependents may be
-- deleted only when its run is gone (a DELETE of
-- the run, whose cascade takes them), or when the run is terminal and marked
-- in durable.runs_being_removed (retention marks each run whose steps it
-- deletes; the mark goes with the run). Anything else is refused (55000)
-- and the whole statement rolls back. So a role that may DELETE can remove
-- a finished run whole (retention's power; marking a run hands it to the
-- next retention pass, whatever its age) but never a part of a run's
-- history or results while the run stays, and never anything of an open run.
--
-- The mark itself is no privilege boundary (the tables are the worker's):
-- marking a finished run hands it to retention and makes every reader treat
-- it as gone at once (`status` exit 4, `runs` leaves it out), as deleting
-- its row would. What a role that may DELETE cannot do is change the
-- history of a run that readers still show. Only a finished run may be
-- marked: an open run's history is never removable (re-check audit).
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
-- a run's definitions and their edges too: deleting a waiting definition
-- of an open run left it running for ever (retention faults audit)
CREATE TRIGGER step_defs_removed_with_run AFTER DELETE ON durable.step_defs
    REFERENCING OLD TABLE AS old_rows
    FOR EACH STATEMENT EXECUTE FUNCTION durable.refuse_partial_removal();
CREATE TRIGGER step_dependents_removed_with_run AFTER DELETE ON durable.step_dependents
    REFERENCING OLD TABLE AS old_rows
    FOR EACH STATEMENT EXECUTE FUNCTION durable.refuse_partial_removal();

-- An artifact row is written once, by its step's commit: moved to another
-- run (UPDATE … SET run_id), an open run's result could be deleted as a
-- marked run's (retention faults audit). Like history, it is never changed.
CREATE TRIGGER artifacts_append_only BEFORE UPDATE ON durable.artifacts
    FOR EACH STATEMENT EXECUTE FUNCTION durable.refuse_history_update();

-- A mark goes only with its run: taken back, a run stripped while marked
-- (or half removed by an interrupted pass) read as whole again (retention
-- faults audit).
CREATE FUNCTION durable.refuse_unmarking() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    kept uuid;
BEGIN
    SELECT r.id INTO kept
      FROM old_rows m JOIN durable.workflow_runs r ON r.id = m.run_id
     LIMIT 1;
    IF kept IS NOT NULL THEN
        RAISE EXCEPTION 'run % is marked for removal: the mark goes only with the run (the next retention pass removes it)', kept
            USING ERRCODE = '55000';
    END IF;
    RETURN NULL;
END $$;

CREATE TRIGGER runs_being_removed_kept AFTER DELETE ON durable.runs_being_removed
    REFERENCING OLD TABLE AS old_rows
    FOR EACH STATEMENT EXECUTE FUNCTION durable.refuse_unmarking();
CREATE TRIGGER runs_being_removed_unchanged BEFORE UPDATE ON durable.runs_being_removed
    FOR EACH STATEMENT EXECUTE FUNCTION durable.refuse_history_update();

CREATE FUNCTION durable.refuse_marking_an_open_run() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    open_run uuid;
BEGIN
    SELECT r.id INTO open_run
      FROM new_rows m JOIN durable.workflow_runs r ON r.id = m.run_id
     WHERE NOT durable.run_state_is_terminal(r.state)
     LIMIT 1;
    IF open_run IS NOT NULL THEN
        RAISE EXCEPTION 'run % is not finished: retention removes only finished runs', open_run
            USING ERRCODE = '55000';
    END IF;
    RETURN NULL;
END $$;

CREATE TRIGGER runs_being_removed_finished AFTER INSERT ON durable.runs_being_removed
    REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION durable.refuse_marking_an_open_run();

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
