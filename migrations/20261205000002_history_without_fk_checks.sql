-- History without per-row foreign-key checks (issue 7: the hot path).
--
-- durable.transitions and durable.step_events are append-only logs written
-- by the runtime's own functions and triggers, each row for a step or run
-- that the same statement is writing (and so has locked): a row that refers
-- to nothing cannot be written by the runtime. Their foreign keys still
-- checked every row, one queued AFTER trigger and one KEY SHARE probe per
-- reference: inserting 1,000 transition rows took 101 ms with the two
-- checks and 22 ms without (PostgreSQL 15, this machine). Every step pays
-- for ~3 step transitions, ~2 run transitions and ~2 events: at 16
-- concurrent steps the checks' probes alone were 8% of the worker's
-- statement time (pg_stat_statements).
--
-- What the foreign keys also gave, ON DELETE CASCADE, stays: a deleted step
-- takes its events and transitions with it, a deleted run its run-level
-- transitions (and, through step_runs' own cascade, everything else), now
-- by statement triggers, one set-based DELETE per statement, by the same
-- `= ANY (ids)` index probes retention already uses. Retention deletes the
-- children itself first (20261203000002_retention.sql), so there the
-- triggers find nothing left; an operator's DELETE of a run still leaves no
-- orphan history. durable.artifacts keeps its foreign key (a completion
-- with artifacts is rare, and the blob garbage rules rely on its locks).

ALTER TABLE durable.transitions
    DROP CONSTRAINT transitions_run_id_fkey,
    DROP CONSTRAINT transitions_step_run_id_fkey;
ALTER TABLE durable.step_events
    DROP CONSTRAINT step_events_step_run_id_fkey;

CREATE FUNCTION durable.on_steps_deleted() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    ids uuid[];
BEGIN
    SELECT array_agg(o.id) INTO ids FROM old_rows o;
    IF ids IS NULL THEN
        RETURN NULL;
    END IF;
    DELETE FROM durable.step_events WHERE step_run_id = ANY (ids);
    DELETE FROM durable.transitions WHERE step_run_id = ANY (ids);
    RETURN NULL;
END $$;

CREATE TRIGGER step_runs_deleted AFTER DELETE ON durable.step_runs
    REFERENCING OLD TABLE AS old_rows
    FOR EACH STATEMENT EXECUTE FUNCTION durable.on_steps_deleted();

CREATE FUNCTION durable.on_runs_deleted() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    ids uuid[];
BEGIN
    SELECT array_agg(o.id) INTO ids FROM old_rows o;
    IF ids IS NULL THEN
        RETURN NULL;
    END IF;
    DELETE FROM durable.transitions WHERE run_id = ANY (ids);
    RETURN NULL;
END $$;

CREATE TRIGGER workflow_runs_deleted AFTER DELETE ON durable.workflow_runs
    REFERENCING OLD TABLE AS old_rows
    FOR EACH STATEMENT EXECUTE FUNCTION durable.on_runs_deleted();
