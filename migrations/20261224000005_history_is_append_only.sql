-- A step's and a run's history (durable.transitions) and a step's events
-- (durable.step_events) are append-only: no UPDATE (security audit: the
-- worker's role, which needs INSERT and DELETE on them, rewrote a finished
-- run's history with `UPDATE durable.transitions SET reason = 'forged'`;
-- the step rows themselves refuse such a change). Nothing of the runtime
-- updates either table; retention deletes whole runs' rows.
CREATE FUNCTION durable.refuse_history_update() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION '% is append-only: history is never changed, only removed with its run by retention', TG_TABLE_NAME
        USING ERRCODE = '55000';
END $$;

CREATE TRIGGER transitions_append_only BEFORE UPDATE ON durable.transitions
    FOR EACH STATEMENT EXECUTE FUNCTION durable.refuse_history_update();
CREATE TRIGGER step_events_append_only BEFORE UPDATE ON durable.step_events
    FOR EACH STATEMENT EXECUTE FUNCTION durable.refuse_history_update();
