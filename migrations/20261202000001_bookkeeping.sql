-- Bookkeeping in O(1) per transition (issue 7, item 2).
--
-- Before: every terminal step transition recomputed its run by array_agg over
-- all the run's steps plus an anti-join of all its definitions against its
-- steps (measured: 300 ms per completion in a run of 1,000 parallel steps),
-- found ready dependents by scanning every definition of the run, and the
-- history row, the cascades and the recompute ran once per row.
--
-- * Run counters. `workflow_runs` carries steps_total, steps_succeeded,
--   steps_failed (terminal_failed), steps_cancelled and defs_waiting (step
--   definitions without a step row yet). They change only when a step row is
--   created (total +1, waiting −1), when a step turns terminal (+1 on its
--   class) and when definitions are inserted (waiting +n): all counted in the
--   same statement's trigger. open = total − succeeded − failed − cancelled.
--   The classes are chosen so that the lease (pending → leased,
--   retryable_failed → leased) and the start (leased → running) change no
--   counter: the lease, which locks many step rows of many runs with SKIP
--   LOCKED, still never touches a run row (no wait cycle, no serialised
--   leases), and the start writes no run row either.
-- * `started` (a step neither pending nor cancelled) is the one input of the
--   aggregation that the lease changes. It matters only while the run is
--   `pending` (aggregate_run_counts uses it for pending → running alone), so
--   it is not counted: recompute_run derives it then, from the counters
--   (succeeded + failed > 0) or one probe of the partial indexes
--   step_runs_live / step_runs_retrying for a leased, running or
--   retryable_failed step of the run — O(log n), and only until the run
--   turns running.
-- * One decision function. durable.aggregate_run_counts decides from counts;
--   durable.aggregate_run_state (the array form S01 and state::aggregate_run
--   pin) counts its array and calls it, so the two cannot drift.
--   durable.run_state_from_counters(run) is what recompute_run decides; the
--   bookkeeping test compares it with aggregate_run_state over a full recount
--   after every operation of random runs.
-- * Dependencies. `step_defs.deps_remaining` (dependencies not yet
--   succeeded) and the reverse edges `step_dependents` (dependency →
--   dependent). A step that succeeds decrements exactly its dependents; one
--   reaching 0 is materialised unless the run is cancel-requested or has a
--   terminal failure (steps_failed), as before. No scan of all definitions.
--   Definitions are only written under their run's row lock (the counter
--   update of the succeeding step takes it first).
-- * History once per statement. `durable.transitions` rows for step changes
--   are written by statement-level AFTER triggers with transition tables (one
--   INSERT … SELECT for a lease of 16 rows, none for a heartbeat or a flag
--   update; the guard marks the changed rows with `prev_state`, so the new
--   rows alone are scanned, never joined), then the cascades run for the rows that need them — in id
--   order, dependents of a success, siblings of a terminal failure — then
--   the run counters' recompute, once per run. History keeps its order: the
--   step's own row, then rows of the steps it created or cancelled, then the
--   run's.
-- * Heartbeat: the renewal changes only lease_expires_at (and updated_at),
--   and no index covers either any more, so with free space on the page it is
--   a HOT update (no index entries, no new index tuples to vacuum).
--   step_runs_leases (lease_expires_at) is replaced by step_runs_live
--   (run_id) WHERE state IN ('leased', 'running'): reclaim walks only the
--   live leases (not the table) and checks their expiry; fillfactor 80
--   leaves room on each page for the renewals.
-- * Events: a plain progress event only inserts into step_events (the fence
--   reads the step row); only a checkpoint updates the step row. Unchanged,
--   and pinned by the bookkeeping test.
--
-- Lock order (20261201000001) is unchanged: the run row FOR NO KEY UPDATE
-- first, then the step, then siblings in id order; definitions of a run only
-- under its run's lock; the lease and the heartbeat never lock a run.

-- ---------------------------------------------------------------------------
-- counters and dependency edges

ALTER TABLE durable.workflow_runs
    ADD COLUMN steps_total     integer NOT NULL DEFAULT 0 CHECK (steps_total >= 0),
    ADD COLUMN steps_succeeded integer NOT NULL DEFAULT 0 CHECK (steps_succeeded >= 0),
    ADD COLUMN steps_failed    integer NOT NULL DEFAULT 0 CHECK (steps_failed >= 0),
    ADD COLUMN steps_cancelled integer NOT NULL DEFAULT 0 CHECK (steps_cancelled >= 0),
    ADD COLUMN defs_waiting    integer NOT NULL DEFAULT 0 CHECK (defs_waiting >= 0);

ALTER TABLE durable.step_defs
    ADD COLUMN deps_remaining integer NOT NULL DEFAULT 0 CHECK (deps_remaining >= 0);

CREATE TABLE durable.step_dependents (
    run_id     uuid NOT NULL,
    dependency text NOT NULL,
    dependent  text NOT NULL,
    PRIMARY KEY (run_id, dependency, dependent),
    FOREIGN KEY (run_id, dependent) REFERENCES durable.step_defs (run_id, name) ON DELETE CASCADE
);

-- backfill (terminal runs too, so the counters are exact everywhere; the
-- guard refuses any write to a terminal run, so it is off for this statement)
ALTER TABLE durable.workflow_runs DISABLE TRIGGER workflow_runs_guard_update;
UPDATE durable.workflow_runs w
   SET steps_total = c.total, steps_succeeded = c.succeeded, steps_failed = c.failed,
       steps_cancelled = c.cancelled, defs_waiting = c.waiting
  FROM (SELECT r.id,
               (SELECT count(*) FROM durable.step_runs s WHERE s.run_id = r.id) AS total,
               (SELECT count(*) FROM durable.step_runs s WHERE s.run_id = r.id AND s.state = 'succeeded') AS succeeded,
               (SELECT count(*) FROM durable.step_runs s WHERE s.run_id = r.id AND s.state = 'terminal_failed') AS failed,
               (SELECT count(*) FROM durable.step_runs s WHERE s.run_id = r.id AND s.state = 'cancelled') AS cancelled,
               (SELECT count(*) FROM durable.step_defs d WHERE d.run_id = r.id
                   AND NOT EXISTS (SELECT 1 FROM durable.step_runs s WHERE s.run_id = d.run_id AND s.name = d.name)) AS waiting
          FROM durable.workflow_runs r) c
 WHERE w.id = c.id;
ALTER TABLE durable.workflow_runs ENABLE TRIGGER workflow_runs_guard_update;

INSERT INTO durable.step_dependents (run_id, dependency, dependent)
SELECT d.run_id, dep, d.name FROM durable.step_defs d, unnest(d.depends_on) AS dep;

UPDATE durable.step_defs d
   SET deps_remaining = (SELECT count(*) FROM unnest(d.depends_on) AS dep(name)
                          WHERE NOT EXISTS (SELECT 1 FROM durable.step_runs s
                                             WHERE s.run_id = d.run_id AND s.name = dep.name
                                               AND s.state = 'succeeded'))
 WHERE cardinality(d.depends_on) > 0;

-- ---------------------------------------------------------------------------
-- indexes and storage: the heartbeat's renewal is HOT

DROP INDEX durable.step_runs_leases;
CREATE INDEX step_runs_live ON durable.step_runs (run_id) WHERE state IN ('leased', 'running');
CREATE INDEX step_runs_retrying ON durable.step_runs (run_id) WHERE state = 'retryable_failed';
ALTER TABLE durable.step_runs SET (fillfactor = 80);
ALTER TABLE durable.workflow_runs SET (fillfactor = 80);

-- ---------------------------------------------------------------------------
-- definitions: their dependency counter and edges, the run's waiting count

CREATE FUNCTION durable.before_step_def_insert() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    -- a definition is inserted before any step of its run exists (submit_run)
    NEW.deps_remaining := cardinality(NEW.depends_on);
    RETURN NEW;
END $$;

CREATE FUNCTION durable.on_step_defs_inserted() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    c record;
BEGIN
    INSERT INTO durable.step_dependents (run_id, dependency, dependent)
    SELECT n.run_id, dep, n.name FROM new_defs n, unnest(n.depends_on) AS dep;
    FOR c IN SELECT run_id, count(*)::int AS n FROM new_defs GROUP BY run_id ORDER BY run_id LOOP
        UPDATE durable.workflow_runs SET defs_waiting = defs_waiting + c.n WHERE id = c.run_id;
    END LOOP;
    RETURN NULL;
END $$;

CREATE TRIGGER step_defs_before_insert BEFORE INSERT ON durable.step_defs
    FOR EACH ROW EXECUTE FUNCTION durable.before_step_def_insert();
CREATE TRIGGER step_defs_inserted AFTER INSERT ON durable.step_defs
    REFERENCING NEW TABLE AS new_defs
    FOR EACH STATEMENT EXECUTE FUNCTION durable.on_step_defs_inserted();

-- ---------------------------------------------------------------------------
-- run aggregation: one decision, from counts

-- The SQL twin of state::aggregate_run, from counts. `started` is read only
-- when the run is pending (and only whether it is > 0).
CREATE FUNCTION durable.aggregate_run_counts(current_state text, total integer, open_steps integer,
                                             failed integer, cancelled integer, started integer,
                                             waiting boolean)
RETURNS text LANGUAGE plpgsql IMMUTABLE AS $$
BEGIN
    IF durable.run_state_is_terminal(current_state) THEN
        RETURN current_state;
    END IF;
    IF open_steps > 0 OR (waiting AND failed = 0 AND cancelled = 0) THEN
        IF current_state = 'pending' AND started > 0 THEN RETURN 'running'; END IF;
        RETURN current_state;
    END IF;
    IF failed > 0 THEN RETURN 'failed'; END IF;
    IF cancelled > 0 THEN RETURN 'cancelled'; END IF;
    IF total = 0 THEN RETURN current_state; END IF;
    RETURN 'succeeded';
END $$;

-- The array form (kept: S01 and tools call it) counts and asks the same decision.
CREATE OR REPLACE FUNCTION durable.aggregate_run_state(current_state text, step_states text[], waiting boolean)
RETURNS text LANGUAGE plpgsql IMMUTABLE AS $$
DECLARE
    total int; open_steps int; failed int; cancelled int; started int;
BEGIN
    SELECT count(*), count(*) FILTER (WHERE NOT durable.step_state_is_terminal(s)),
           count(*) FILTER (WHERE s = 'terminal_failed'), count(*) FILTER (WHERE s = 'cancelled'),
           count(*) FILTER (WHERE s <> 'pending' AND s <> 'cancelled')
      INTO total, open_steps, failed, cancelled, started
      FROM unnest(coalesce(step_states, '{}'::text[])) AS s;
    RETURN durable.aggregate_run_counts(current_state, total, open_steps, failed, cancelled, started, waiting);
END $$;

-- What recompute_run decides for a run row: its counters, and while it is
-- pending whether any step has started (two index probes at most).
CREATE FUNCTION durable.run_state_from_counters(r durable.workflow_runs) RETURNS text
LANGUAGE plpgsql STABLE AS $$
DECLARE
    started int := 0;
BEGIN
    IF r.state = 'pending' THEN
        started := r.steps_succeeded + r.steps_failed;
        IF started = 0 AND (EXISTS (SELECT 1 FROM durable.step_runs s
                                     WHERE s.run_id = r.id AND s.state IN ('leased', 'running'))
                            OR EXISTS (SELECT 1 FROM durable.step_runs s
                                        WHERE s.run_id = r.id AND s.state = 'retryable_failed')) THEN
            started := 1;
        END IF;
    END IF;
    RETURN durable.aggregate_run_counts(
        r.state, r.steps_total, r.steps_total - r.steps_succeeded - r.steps_failed - r.steps_cancelled,
        r.steps_failed, r.steps_cancelled, started, r.defs_waiting > 0);
END $$;

CREATE OR REPLACE FUNCTION durable.recompute_run(rid uuid, why text) RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    r durable.workflow_runs; cur text; next_state text;
BEGIN
    SELECT * INTO r FROM durable.workflow_runs WHERE id = rid FOR NO KEY UPDATE;
    cur := r.state;
    IF cur IS NULL OR durable.run_state_is_terminal(cur) THEN
        RETURN cur;
    END IF;
    next_state := durable.run_state_from_counters(r);
    IF next_state <> cur THEN
        -- failing or succeeding straight from pending is not in the table: go through running
        IF cur = 'pending' AND next_state IN ('succeeded', 'failed') THEN
            UPDATE durable.workflow_runs SET state = 'running' WHERE id = rid;
            INSERT INTO durable.transitions (run_id, from_state, to_state, reason) VALUES (rid, 'pending', 'running', why);
            cur := 'running';
        END IF;
        UPDATE durable.workflow_runs SET state = next_state WHERE id = rid;
        INSERT INTO durable.transitions (run_id, from_state, to_state, reason) VALUES (rid, cur, next_state, why);
    END IF;
    RETURN next_state;
END $$;

-- ---------------------------------------------------------------------------
-- the step triggers: once per statement

-- The guard also marks, on the row itself, the state an update changed it
-- from (`prev_state`, NULL when the update left the state alone), so the
-- statement triggers find the changed rows by a scan of the new rows: no join
-- of the old and new transition tables, whose cached plan (made for the first
-- statement's row count) could turn a 1,000-row heartbeat into a nested loop.
ALTER TABLE durable.step_runs ADD COLUMN prev_state text;

CREATE OR REPLACE FUNCTION durable.guard_step_update() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF durable.step_state_is_terminal(OLD.state) THEN
        RAISE EXCEPTION 'step % (%) is %: a terminal step never changes', OLD.name, OLD.id, OLD.state
            USING ERRCODE = 'P0D01';
    END IF;
    IF NEW.id <> OLD.id OR NEW.run_id <> OLD.run_id OR NEW.name <> OLD.name
       OR NEW.idempotency_key <> OLD.idempotency_key THEN
        RAISE EXCEPTION 'step % (%): identity columns never change', OLD.name, OLD.id
            USING ERRCODE = 'P0D02';
    END IF;
    IF NEW.state IS DISTINCT FROM OLD.state THEN
        -- a writer that did not say why must not inherit the previous reason
        IF NEW.transition_reason IS NOT DISTINCT FROM OLD.transition_reason
           AND NEW.transition_by IS NOT DISTINCT FROM OLD.transition_by THEN
            NEW.transition_reason := NULL;
            NEW.transition_by := NULL;
        END IF;
        IF NOT EXISTS (SELECT 1 FROM durable.step_transition_rules r
                       WHERE r.from_state = OLD.state AND r.to_state = NEW.state) THEN
            RAISE EXCEPTION 'illegal step transition % -> % for step % (%)', OLD.state, NEW.state, OLD.name, OLD.id
                USING ERRCODE = 'P0D03';
        END IF;
        IF durable.step_state_is_terminal(NEW.state) THEN
            NEW.finished_at := now();
            NEW.lease_expires_at := NULL;
        END IF;
        NEW.prev_state := OLD.state;
    ELSE
        NEW.prev_state := NULL;
    END IF;
    NEW.updated_at := now();
    RETURN NEW;
END $$;

CREATE OR REPLACE FUNCTION durable.on_step_transition() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    n_changed bigint; c record; d durable.step_defs; run_key text; run_cancel boolean; run_failed int;
BEGIN
    IF TG_OP = 'INSERT' THEN
        -- history, wake-ups, and the run's counters: one row more, one definition less waiting
        INSERT INTO durable.transitions (run_id, step_run_id, from_state, to_state, attempt, worker, reason)
        SELECT n.run_id, n.id, NULL, n.state, n.attempt, n.transition_by, n.transition_reason
          FROM new_rows n ORDER BY n.run_id, n.position;
        PERFORM pg_notify('durable_steps', k.executor_kind)
           FROM (SELECT DISTINCT executor_kind FROM new_rows) k;
        FOR c IN SELECT run_id, count(*)::int AS n FROM new_rows GROUP BY run_id ORDER BY run_id LOOP
            UPDATE durable.workflow_runs
               SET steps_total = steps_total + c.n, defs_waiting = greatest(defs_waiting - c.n, 0)
             WHERE id = c.run_id;
        END LOOP;
        RETURN NULL;
    END IF;

    -- UPDATE: only rows whose state changed count (a heartbeat, a flag or a
    -- checkpoint changes none and ends here)
    INSERT INTO durable.transitions (run_id, step_run_id, from_state, to_state, attempt, worker, reason)
    SELECT n.run_id, n.id, n.prev_state, n.state, n.attempt, n.transition_by, n.transition_reason
      FROM new_rows n
     WHERE n.prev_state IS NOT NULL
     ORDER BY n.id;
    GET DIAGNOSTICS n_changed = ROW_COUNT;
    IF n_changed = 0 THEN
        RETURN NULL;
    END IF;

    PERFORM pg_notify('durable_steps', k.executor_kind)
       FROM (SELECT DISTINCT n.executor_kind FROM new_rows n
              WHERE n.prev_state IS NOT NULL AND n.state IN ('pending', 'retryable_failed')) k;

    -- counters: only terminal transitions change one (a terminal row never
    -- changes again, so each step is counted once); runs locked in id order
    FOR c IN
        SELECT n.run_id,
               count(*) FILTER (WHERE n.state = 'succeeded')::int AS succeeded,
               count(*) FILTER (WHERE n.state = 'terminal_failed')::int AS failed,
               count(*) FILTER (WHERE n.state = 'cancelled')::int AS cancelled
          FROM new_rows n
         WHERE n.prev_state IS NOT NULL AND durable.step_state_is_terminal(n.state)
         GROUP BY n.run_id ORDER BY n.run_id
    LOOP
        UPDATE durable.workflow_runs
           SET steps_succeeded = steps_succeeded + c.succeeded, steps_failed = steps_failed + c.failed,
               steps_cancelled = steps_cancelled + c.cancelled
         WHERE id = c.run_id;
    END LOOP;

    -- cascades, in id order
    FOR c IN
        SELECT n.id, n.run_id, n.name, n.state
          FROM new_rows n
         WHERE n.prev_state IS NOT NULL AND n.state IN ('succeeded', 'terminal_failed')
         ORDER BY n.id
    LOOP
        IF c.state = 'succeeded' THEN
            -- this step's dependents have one dependency fewer to wait for;
            -- the definitions are written under the run's lock (taken above)
            SELECT coalesce(r.idempotency_key, r.id::text), r.cancel_requested, r.steps_failed
              INTO run_key, run_cancel, run_failed
              FROM durable.workflow_runs r WHERE r.id = c.run_id;
            FOR d IN
                WITH ready AS (
                    UPDATE durable.step_defs sd SET deps_remaining = sd.deps_remaining - 1
                      FROM durable.step_dependents e
                     WHERE e.run_id = c.run_id AND e.dependency = c.name
                       AND sd.run_id = e.run_id AND sd.name = e.dependent
                 RETURNING sd.*
                )
                SELECT * FROM ready WHERE deps_remaining = 0 ORDER BY position
            LOOP
                -- as before: no new step once the run failed or a cancel was
                -- requested; a definition cancel_run already created stays as is
                IF NOT run_cancel AND run_failed = 0
                   AND NOT EXISTS (SELECT 1 FROM durable.step_runs s WHERE s.run_id = d.run_id AND s.name = d.name) THEN
                    PERFORM durable.materialize_step(d, run_key);
                END IF;
            END LOOP;
        ELSE
            -- the first failure ends the run: open siblings are locked in id order,
            -- pending ones cancelled at once, leased and running ones get a durable
            -- cancel request
            WITH sib AS (
                SELECT id FROM durable.step_runs
                 WHERE run_id = c.run_id AND id <> c.id
                   AND state IN ('pending', 'retryable_failed', 'leased', 'running')
                 ORDER BY id FOR NO KEY UPDATE
            )
            UPDATE durable.step_runs s
               SET state = CASE WHEN s.state IN ('pending', 'retryable_failed') THEN 'cancelled' ELSE s.state END,
                   transition_reason = CASE WHEN s.state IN ('pending', 'retryable_failed') THEN 'RUN_FAILED' ELSE s.transition_reason END,
                   transition_by = CASE WHEN s.state IN ('pending', 'retryable_failed') THEN NULL ELSE s.transition_by END,
                   cancel_requested = true
              FROM sib WHERE s.id = sib.id;
        END IF;
    END LOOP;

    -- the run, once per run: after a terminal step, or a step that starts
    -- running while its run is still pending (a running run needs nothing)
    FOR c IN
        SELECT DISTINCT ON (n.run_id) n.run_id, n.name, n.state
          FROM new_rows n
         WHERE n.prev_state IS NOT NULL
           AND (durable.step_state_is_terminal(n.state)
                OR (n.state = 'running' AND EXISTS (SELECT 1 FROM durable.workflow_runs w
                                                     WHERE w.id = n.run_id AND w.state = 'pending')))
         ORDER BY n.run_id, n.id
    LOOP
        PERFORM durable.recompute_run(c.run_id, 'step ' || c.name || ' ' || c.state);
    END LOOP;
    RETURN NULL;
END $$;

DROP TRIGGER step_runs_transition ON durable.step_runs;
DROP TRIGGER step_runs_created ON durable.step_runs;
CREATE TRIGGER step_runs_transition AFTER UPDATE ON durable.step_runs
    REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION durable.on_step_transition();
CREATE TRIGGER step_runs_created AFTER INSERT ON durable.step_runs
    REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION durable.on_step_transition();
