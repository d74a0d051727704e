-- Guarantees under races (issue 6).
--
-- * Lock order, including the foreign-key locks: run rows are locked
--   FOR NO KEY UPDATE (never FOR UPDATE), which does not conflict with the
--   FOR KEY SHARE every foreign-key check on transitions / step_runs /
--   artifacts takes; step rows likewise. Multi-row sets of step rows are
--   locked in id order. Writers of one step lock its run first, then the step,
--   then (cascades) its siblings in id order. The lease and the heartbeat skip
--   rows that are locked (SKIP LOCKED) and never lock a run, so they can never
--   be part of a wait cycle.
-- * The run's cancel request is the truth: a step of a cancel-requested run is
--   never leased, the heartbeat reports it as cancel-requested, and a run-level
--   cancel closes the steps that will now never exist (waiting definitions are
--   materialised and cancelled at once).
-- * A valid lease's outcome commits even if the start write was lost
--   (complete_step accepts `leased` and records the start first).
-- * Refusals are counted (`refusals`) and capped by the worker; a step
--   released by a draining worker does not count the attempt
--   (`uncounted_attempts`, subtracted by the retry decision).
-- * The lease walks only the ready steps of the routes it asks for, in queue
--   order (`step_runs_route`), and a step that starts running recomputes its
--   run only while the run is still `pending`.

ALTER TABLE durable.step_runs
    ADD COLUMN refusals integer NOT NULL DEFAULT 0 CHECK (refusals >= 0),
    ADD COLUMN uncounted_attempts integer NOT NULL DEFAULT 0 CHECK (uncounted_attempts >= 0);

-- The lease used to find every ready step (a bitmap scan of the whole queue
-- index), check each one's run for a cancel request and sort them all before
-- taking `limit`: O(backlog) per lease (measured: 2,000 ready steps, 10 ms and
-- 6,000 buffer hits per lease). With this index the lease is one ordered
-- index scan per route that stops after `limit` rows. The queue-order index
-- it replaces goes: the planner preferred it and filtered by kind, walking
-- over every older ready step of other kinds.
CREATE INDEX step_runs_route ON durable.step_runs (executor_kind, kind, next_attempt_at)
    WHERE state IN ('pending', 'retryable_failed');
DROP INDEX durable.step_runs_queue;

-- ---------------------------------------------------------------------------
-- run recompute: FOR NO KEY UPDATE

CREATE OR REPLACE FUNCTION durable.recompute_run(rid uuid, why text) RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    cur text; next_state text; states text[]; waiting boolean;
BEGIN
    SELECT state INTO cur FROM durable.workflow_runs WHERE id = rid FOR NO KEY UPDATE;
    IF cur IS NULL OR durable.run_state_is_terminal(cur) THEN
        RETURN cur;
    END IF;
    SELECT array_agg(state) INTO states FROM durable.step_runs WHERE run_id = rid;
    SELECT EXISTS (SELECT 1 FROM durable.step_defs d
                   WHERE d.run_id = rid
                     AND NOT EXISTS (SELECT 1 FROM durable.step_runs s WHERE s.run_id = rid AND s.name = d.name))
      INTO waiting;
    next_state := durable.aggregate_run_state(cur, states, waiting);
    IF next_state <> cur THEN
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
-- the transition trigger: cascades lock siblings in id order

CREATE OR REPLACE FUNCTION durable.on_step_transition() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    run_key text; run_cancel boolean; d durable.step_defs;
BEGIN
    INSERT INTO durable.transitions (run_id, step_run_id, from_state, to_state, attempt, worker, reason)
    VALUES (NEW.run_id, NEW.id, CASE WHEN TG_OP = 'UPDATE' THEN OLD.state END, NEW.state, NEW.attempt,
            NEW.transition_by, NEW.transition_reason);

    IF NEW.state IN ('pending', 'retryable_failed') THEN
        PERFORM pg_notify('durable_steps', NEW.executor_kind);
    END IF;

    IF NEW.state = 'succeeded' THEN
        SELECT coalesce(r.idempotency_key, r.id::text), r.cancel_requested INTO run_key, run_cancel
          FROM durable.workflow_runs r WHERE r.id = NEW.run_id;
        IF NOT run_cancel AND NOT EXISTS (SELECT 1 FROM durable.step_runs
                                          WHERE run_id = NEW.run_id AND state = 'terminal_failed') THEN
            FOR d IN
                SELECT * FROM durable.step_defs sd
                 WHERE sd.run_id = NEW.run_id
                   AND NEW.name = ANY (sd.depends_on)
                   AND NOT EXISTS (SELECT 1 FROM durable.step_runs s WHERE s.run_id = sd.run_id AND s.name = sd.name)
                   AND NOT EXISTS (SELECT 1 FROM unnest(sd.depends_on) AS dep(name)
                                    WHERE NOT EXISTS (SELECT 1 FROM durable.step_runs s2
                                                       WHERE s2.run_id = sd.run_id AND s2.name = dep.name
                                                         AND s2.state = 'succeeded'))
                 ORDER BY sd.position
            LOOP
                PERFORM durable.materialize_step(d, run_key);
            END LOOP;
        END IF;
    ELSIF NEW.state = 'terminal_failed' THEN
        -- the first failure ends the run: open siblings are locked in id order,
        -- pending ones cancelled at once, leased and running ones get a durable
        -- cancel request
        WITH sib AS (
            SELECT id FROM durable.step_runs
             WHERE run_id = NEW.run_id AND id <> NEW.id
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

    -- a step that starts running can only move a `pending` run (to running):
    -- a run already running needs no recompute (no scan of its steps)
    IF (NEW.state = 'running' AND EXISTS (SELECT 1 FROM durable.workflow_runs
                                           WHERE id = NEW.run_id AND state = 'pending'))
       OR durable.step_state_is_terminal(NEW.state) THEN
        PERFORM durable.recompute_run(NEW.run_id, 'step ' || NEW.name || ' ' || NEW.state);
    END IF;
    RETURN NULL;
END $$;

-- ---------------------------------------------------------------------------
-- cancel: one statement over the open steps, and the steps that will never exist

CREATE OR REPLACE FUNCTION durable.cancel_run(rid uuid, step_name text DEFAULT NULL, reason text DEFAULT 'CANCEL_REQUESTED')
RETURNS text LANGUAGE plpgsql AS $$
DECLARE
    cur text; run_key text; d durable.step_defs;
BEGIN
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
        FOR d IN
            SELECT * FROM durable.step_defs sd
             WHERE sd.run_id = rid
               AND NOT EXISTS (SELECT 1 FROM durable.step_runs s WHERE s.run_id = rid AND s.name = sd.name)
             ORDER BY sd.position
        LOOP
            PERFORM durable.materialize_step(d, run_key);
        END LOOP;
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
            PERFORM durable.materialize_step(d, run_key);
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

-- ---------------------------------------------------------------------------
-- the worker's hot writes: FOR NO KEY UPDATE; completion of a step whose
-- start write was lost

CREATE OR REPLACE FUNCTION durable.start_step(p_id uuid, p_token uuid, p_worker text, p_pid integer,
                                              p_sequence bigint, p_kind text, p_message text,
                                              p_fraction double precision, p_executor_at timestamptz)
RETURNS boolean LANGUAGE plpgsql AS $$
DECLARE
    att integer; st text;
BEGIN
    PERFORM 1 FROM durable.workflow_runs
      WHERE id = (SELECT run_id FROM durable.step_runs WHERE id = p_id) FOR NO KEY UPDATE;
    SELECT state, attempt INTO st, att FROM durable.step_runs
     WHERE id = p_id AND lease_token = p_token AND state IN ('leased', 'running') FOR NO KEY UPDATE;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    IF st = 'leased' THEN
        UPDATE durable.step_runs
           SET state = 'running', started_at = now(), executor_pid = p_pid,
               transition_reason = 'ACCEPTED', transition_by = p_worker
         WHERE id = p_id;
    END IF;
    -- a retried start whose first try committed: the event is already there
    INSERT INTO durable.step_events (step_run_id, attempt, sequence, kind, message, fraction, checkpoint, executor_at)
    VALUES (p_id, att, p_sequence, p_kind, p_message, p_fraction, false, p_executor_at)
    ON CONFLICT DO NOTHING;
    RETURN true;
END $$;

CREATE OR REPLACE FUNCTION durable.complete_step(p_id uuid, p_token uuid, p_worker text, p_output jsonb,
                                                 p_sequence bigint, p_names text[], p_sha256 text[],
                                                 p_media_types text[], p_contents bytea[], p_derived jsonb)
RETURNS uuid[] LANGUAGE plpgsql AS $$
DECLARE
    rid uuid; att integer; st text; ids uuid[] := '{}'; aid uuid; i integer;
BEGIN
    PERFORM 1 FROM durable.workflow_runs
      WHERE id = (SELECT run_id FROM durable.step_runs WHERE id = p_id) FOR NO KEY UPDATE;
    SELECT run_id, attempt, state INTO rid, att, st FROM durable.step_runs
     WHERE id = p_id AND lease_token = p_token AND state IN ('leased', 'running') FOR NO KEY UPDATE;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    IF st = 'leased' THEN
        -- the start write never committed (the database was away); the lease
        -- is valid, so the result is kept: record the start first
        UPDATE durable.step_runs
           SET state = 'running', started_at = now(),
               transition_reason = 'ACCEPTED', transition_by = p_worker
         WHERE id = p_id;
    END IF;
    -- blobs in sha256 order: two completions sharing contents never wait on
    -- each other's unique-index entries in opposite orders
    INSERT INTO durable.artifact_blobs (sha256, size, content)
    SELECT x.sha, octet_length(x.content), x.content
      FROM unnest(p_sha256, p_contents) AS x(sha, content)
     ORDER BY x.sha
    ON CONFLICT (sha256) DO NOTHING;
    FOR i IN 1 .. coalesce(cardinality(p_names), 0) LOOP
        aid := gen_random_uuid();
        INSERT INTO durable.artifacts (id, run_id, step_run_id, attempt, name, sha256, size, media_type)
        VALUES (aid, rid, p_id, att, p_names[i], p_sha256[i], octet_length(p_contents[i]), p_media_types[i]);
        INSERT INTO durable.artifact_lineage (artifact_id, derived_from_id)
        SELECT aid, d::uuid FROM jsonb_array_elements_text(coalesce(p_derived -> (i - 1), '[]')) AS d
        ON CONFLICT DO NOTHING;
        ids := ids || aid;
    END LOOP;
    IF p_sequence IS NOT NULL THEN
        INSERT INTO durable.step_events (step_run_id, attempt, sequence, kind, message)
        VALUES (p_id, att, p_sequence, 'succeeded', '') ON CONFLICT DO NOTHING;
    END IF;
    UPDATE durable.step_runs
       SET state = 'succeeded', output = p_output, error_code = NULL, error_message = NULL,
           error_retryable = NULL, error_details = NULL,
           transition_reason = 'SUCCEEDED', transition_by = p_worker
     WHERE id = p_id AND lease_token = p_token;
    RETURN ids;
END $$;
