-- The hot path's statements keep their plans (issue 7).
--
-- A LANGUAGE sql function that cannot be inlined is parsed and planned again
-- on every call in PostgreSQL 15; record_plain_events (a CTE with an INSERT)
-- cost ~1 ms a call that way, two thirds of it planning. The same statement
-- in plpgsql keeps its plan for the session: same arguments, same answers,
-- same fence (only the step row is read: no lock, no rewrite of it).
CREATE OR REPLACE FUNCTION durable.record_plain_events(p_ids uuid[], p_tokens uuid[], p_event_lease integer[],
                                                       p_sequences bigint[], p_kinds text[], p_messages text[],
                                                       p_fractions double precision[], p_executor_at timestamptz[])
RETURNS TABLE (idx integer, status text, err_state text, err_message text)
LANGUAGE plpgsql AS $$
BEGIN
    RETURN QUERY
    WITH l AS (
        SELECT * FROM unnest(p_ids, p_tokens) WITH ORDINALITY AS l(id, token, n)
    ), f AS (
        SELECT l.n, s.id, s.attempt
          FROM l JOIN durable.step_runs s ON s.id = l.id AND s.lease_token = l.token
                                          AND s.state IN ('leased', 'running')
    ), ins AS (
        INSERT INTO durable.step_events (step_run_id, attempt, sequence, kind, message, fraction, checkpoint, executor_at)
        SELECT f.id, f.attempt, e.seq, e.kind, e.msg, e.frac, false, e.at
          FROM unnest(p_event_lease, p_sequences, p_kinds, p_messages, p_fractions, p_executor_at)
               AS e(n, seq, kind, msg, frac, at)
          JOIN f ON f.n = e.n
         ORDER BY f.id, e.seq
        ON CONFLICT DO NOTHING
    )
    SELECT l.n::integer, CASE WHEN f.id IS NULL THEN 'lost' ELSE 'ok' END, NULL::text, NULL::text
      FROM l LEFT JOIN f ON f.n = l.n
     ORDER BY l.n;
END $$;

-- Starts and completions of a batch as set-based statements: the run rows,
-- then the step rows, locked once for the batch in id order, one UPDATE and
-- one INSERT per table, so the step triggers (history, counters, cascades,
-- the run's state) run once per batch instead of once per intent. The answer
-- per intent is the same as the intent-by-intent form's: `ok`, or `lost` when
-- the fence (id, token, leased/running) did not hold. Should any row be
-- refused (a site's trigger, a constraint), the set statement fails as a
-- whole, its subtransaction is rolled back, and the batch is done intent by
-- intent as before, each intent with its own answer. A batch naming a step
-- twice also goes intent by intent (the first wins, as before), and so does a
-- batch of one intent (the same statements, without the set form's arrays).

-- The batch's lock and fence, shared by the set forms: its runs, then its
-- steps, locked in id order; of the steps, those whose lease (id, token,
-- leased/running) holds, as parallel arrays in step id order: the intent's
-- index in the batch, the step, its state and attempt (all NULL: none held).
CREATE FUNCTION durable.lock_batch(p_ids uuid[], p_tokens uuid[],
                                   OUT n integer[], OUT id uuid[], OUT state text[], OUT attempt integer[])
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM 1 FROM durable.workflow_runs w
      WHERE w.id IN (SELECT s.run_id FROM durable.step_runs s WHERE s.id = ANY (p_ids))
      ORDER BY w.id FOR NO KEY UPDATE;
    SELECT array_agg(x.n ORDER BY x.id), array_agg(x.id ORDER BY x.id),
           array_agg(x.state ORDER BY x.id), array_agg(x.attempt ORDER BY x.id)
      INTO n, id, state, attempt
      FROM (SELECT u.n::integer AS n, s.id, s.state, s.attempt
              FROM unnest(p_ids, p_tokens) WITH ORDINALITY AS u(id, token, n)
              JOIN durable.step_runs s ON s.id = u.id AND s.lease_token = u.token
                                      AND s.state IN ('leased', 'running')
             ORDER BY s.id
               FOR NO KEY UPDATE OF s) x;
END $$;

CREATE FUNCTION durable.start_steps_set(p_worker text, p_ids uuid[], p_tokens uuid[], p_pids integer[],
                                        p_sequences bigint[], p_kinds text[], p_messages text[],
                                        p_fractions double precision[], p_executor_at timestamptz[])
RETURNS integer[] LANGUAGE plpgsql AS $$
DECLARE
    fn integer[]; fid uuid[]; fstate text[]; fatt integer[];
BEGIN
    SELECT f.n, f.id, f.state, f.attempt INTO fn, fid, fstate, fatt
      FROM durable.lock_batch(p_ids, p_tokens) AS f;
    IF fn IS NULL THEN
        RETURN '{}';
    END IF;
    UPDATE durable.step_runs s
       SET state = 'running', started_at = now(), executor_pid = p_pids[f.n],
           transition_reason = 'ACCEPTED', transition_by = p_worker
      FROM unnest(fn, fid, fstate) AS f(n, id, state)
     WHERE s.id = f.id AND f.state = 'leased';
    -- a retried start whose first try committed: the event is already there
    INSERT INTO durable.step_events (step_run_id, attempt, sequence, kind, message, fraction, checkpoint, executor_at)
    SELECT f.id, f.attempt, p_sequences[f.n], p_kinds[f.n], p_messages[f.n], p_fractions[f.n], false,
           p_executor_at[f.n]
      FROM unnest(fn, fid, fatt) AS f(n, id, attempt)
     ORDER BY f.id
    ON CONFLICT DO NOTHING;
    RETURN fn;
END $$;

CREATE FUNCTION durable.complete_steps_set(p_worker text, p_ids uuid[], p_tokens uuid[], p_outputs jsonb[],
                                           p_sequences bigint[])
RETURNS integer[] LANGUAGE plpgsql AS $$
DECLARE
    fn integer[]; fid uuid[]; fstate text[]; fatt integer[];
BEGIN
    SELECT f.n, f.id, f.state, f.attempt INTO fn, fid, fstate, fatt
      FROM durable.lock_batch(p_ids, p_tokens) AS f;
    IF fn IS NULL THEN
        RETURN '{}';
    END IF;
    -- the start write never committed (the database was away); the lease is
    -- valid, so the result is kept: record the start first
    IF 'leased' = ANY (fstate) THEN
        UPDATE durable.step_runs s
           SET state = 'running', started_at = now(),
               transition_reason = 'ACCEPTED', transition_by = p_worker
          FROM unnest(fid, fstate) AS f(id, state)
         WHERE s.id = f.id AND f.state = 'leased';
    END IF;
    INSERT INTO durable.step_events (step_run_id, attempt, sequence, kind, message)
    SELECT f.id, f.attempt, p_sequences[f.n], 'succeeded', ''
      FROM unnest(fn, fid, fatt) AS f(n, id, attempt)
     WHERE p_sequences[f.n] IS NOT NULL
     ORDER BY f.id
    ON CONFLICT DO NOTHING;
    UPDATE durable.step_runs s
       SET state = 'succeeded', output = p_outputs[f.n], error_code = NULL, error_message = NULL,
           error_retryable = NULL, error_details = NULL,
           transition_reason = 'SUCCEEDED', transition_by = p_worker
      FROM unnest(fn, fid) AS f(n, id)
     WHERE s.id = f.id;
    RETURN fn;
END $$;

-- The batch entry points: the set form first, intent by intent if it is
-- refused (or names a step twice). The answers are collected before they are
-- returned, so nothing of a rolled-back try reaches the caller.
CREATE OR REPLACE FUNCTION durable.start_steps(p_worker text, p_ids uuid[], p_tokens uuid[], p_pids integer[],
                                               p_sequences bigint[], p_kinds text[], p_messages text[],
                                               p_fractions double precision[], p_executor_at timestamptz[])
RETURNS TABLE (idx integer, status text, err_state text, err_message text)
LANGUAGE plpgsql AS $$
DECLARE
    i integer; fenced integer[]; done boolean := false;
BEGIN
    -- one intent: the intent-by-intent form is the same statements without
    -- the set form's arrays (and without a second subtransaction)
    IF cardinality(p_ids) > 1
       AND (SELECT count(DISTINCT x) FROM unnest(p_ids) AS x) = cardinality(p_ids) THEN
        BEGIN
            fenced := durable.start_steps_set(p_worker, p_ids, p_tokens, p_pids, p_sequences, p_kinds,
                                              p_messages, p_fractions, p_executor_at);
            done := true;
        EXCEPTION WHEN OTHERS THEN
            done := false;
        END;
    END IF;
    FOR i IN 1 .. coalesce(cardinality(p_ids), 0) LOOP
        idx := i; err_state := NULL; err_message := NULL;
        IF done THEN
            status := CASE WHEN i = ANY (fenced) THEN 'ok' ELSE 'lost' END;
        ELSE
            BEGIN
                IF durable.start_step(p_ids[i], p_tokens[i], p_worker, p_pids[i], p_sequences[i], p_kinds[i],
                                      p_messages[i], p_fractions[i], p_executor_at[i]) THEN
                    status := 'ok';
                ELSE
                    status := 'lost';
                END IF;
            EXCEPTION WHEN OTHERS THEN
                status := 'error'; err_state := SQLSTATE; err_message := SQLERRM;
            END;
        END IF;
        RETURN NEXT;
    END LOOP;
END $$;

CREATE OR REPLACE FUNCTION durable.complete_steps(p_worker text, p_ids uuid[], p_tokens uuid[], p_outputs jsonb[],
                                                  p_sequences bigint[])
RETURNS TABLE (idx integer, status text, err_state text, err_message text)
LANGUAGE plpgsql AS $$
DECLARE
    i integer; fenced integer[]; done boolean := false;
BEGIN
    -- one intent: the intent-by-intent form is the same statements without
    -- the set form's arrays (and without a second subtransaction)
    IF cardinality(p_ids) > 1
       AND (SELECT count(DISTINCT x) FROM unnest(p_ids) AS x) = cardinality(p_ids) THEN
        BEGIN
            fenced := durable.complete_steps_set(p_worker, p_ids, p_tokens, p_outputs, p_sequences);
            done := true;
        EXCEPTION WHEN OTHERS THEN
            done := false;
        END;
    END IF;
    FOR i IN 1 .. coalesce(cardinality(p_ids), 0) LOOP
        idx := i; err_state := NULL; err_message := NULL;
        IF done THEN
            status := CASE WHEN i = ANY (fenced) THEN 'ok' ELSE 'lost' END;
        ELSE
            BEGIN
                IF durable.complete_step(p_ids[i], p_tokens[i], p_worker, p_outputs[i], p_sequences[i],
                                         '{}'::text[], '{}'::text[], '{}'::text[], '{}'::bytea[], '[]'::jsonb) IS NULL THEN
                    status := 'lost';
                ELSE
                    status := 'ok';
                END IF;
            EXCEPTION WHEN OTHERS THEN
                status := 'error'; err_state := SQLSTATE; err_message := SQLERRM;
            END;
        END IF;
        RETURN NEXT;
    END LOOP;
END $$;

-- A lease renewal (the heartbeat: lease_expires_at moves, nothing else does)
-- skips the per-row guard: the trigger's WHEN is evaluated without entering
-- plpgsql. Every other update still goes through it: a state change (the
-- transition table, prev_state, finished_at), an update of a row whose
-- prev_state is still set (the guard clears it), any update of a terminal
-- row or of an identity column (the guard refuses it), and any update that
-- leaves lease_expires_at alone (the guard keeps updated_at). A renewal
-- therefore no longer moves updated_at: that column says when the row last
-- changed, the lease expiry says when it was last renewed.
DROP TRIGGER step_runs_guard_update ON durable.step_runs;
CREATE TRIGGER step_runs_guard_update BEFORE UPDATE ON durable.step_runs
    FOR EACH ROW
    WHEN (OLD.state IS DISTINCT FROM NEW.state
          OR OLD.prev_state IS NOT NULL
          OR OLD.state IN ('succeeded', 'terminal_failed', 'cancelled')
          OR NEW.id IS DISTINCT FROM OLD.id OR NEW.run_id IS DISTINCT FROM OLD.run_id
          OR NEW.name IS DISTINCT FROM OLD.name
          OR NEW.idempotency_key IS DISTINCT FROM OLD.idempotency_key
          OR NEW.lease_expires_at IS NOT DISTINCT FROM OLD.lease_expires_at)
    EXECUTE FUNCTION durable.guard_step_update();

-- The step triggers, set-based: the run counters, the cascades and the runs'
-- own state are decided once per statement for all its runs (a ledger batch
-- carries many), not once per run or per row. What they decide is unchanged:
-- same counters, same cascades, same run transitions and history rows, the
-- same reasons. Runs are locked in id order before any of them is written
-- (every writer already holds its runs' locks: then it costs nothing). A
-- step that succeeds with no dependents costs no cascade statement at all.
CREATE OR REPLACE FUNCTION durable.on_step_transition() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    n_changed bigint; c record; d durable.step_defs; run_key text; run_cancel boolean; run_failed int;
    r_ids uuid[]; r_cur text[]; r_next text[]; r_why text[];
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
    -- changes again, so each step is counted once); one statement for all
    -- runs, locked in id order first
    WITH x AS (
        SELECT n.run_id,
               count(*) FILTER (WHERE n.state = 'succeeded')::int AS succeeded,
               count(*) FILTER (WHERE n.state = 'terminal_failed')::int AS failed,
               count(*) FILTER (WHERE n.state = 'cancelled')::int AS cancelled
          FROM new_rows n
         WHERE n.prev_state IS NOT NULL AND durable.step_state_is_terminal(n.state)
         GROUP BY n.run_id
    ), l AS (
        SELECT w.id FROM durable.workflow_runs w JOIN x ON x.run_id = w.id
         ORDER BY w.id FOR NO KEY UPDATE OF w
    )
    UPDATE durable.workflow_runs w
       SET steps_succeeded = w.steps_succeeded + x.succeeded, steps_failed = w.steps_failed + x.failed,
           steps_cancelled = w.steps_cancelled + x.cancelled
      FROM x
     WHERE w.id = x.run_id AND w.id IN (SELECT id FROM l);

    -- cascades, in id order: a success with dependents, a terminal failure
    FOR c IN
        SELECT n.id, n.run_id, n.name, n.state
          FROM new_rows n
         WHERE n.prev_state IS NOT NULL
           AND (n.state = 'terminal_failed'
                OR (n.state = 'succeeded'
                    AND EXISTS (SELECT 1 FROM durable.step_dependents e
                                 WHERE e.run_id = n.run_id AND e.dependency = n.name)))
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

    -- the runs, once per run and in one pass: after a terminal step, or a
    -- step that starts running while its run is still pending (a running run
    -- needs nothing); the decision is recompute_run's (run_state_from_counters)
    SELECT array_agg(x.id ORDER BY x.id), array_agg(x.cur ORDER BY x.id),
           array_agg(x.nxt ORDER BY x.id), array_agg(x.why ORDER BY x.id)
      INTO r_ids, r_cur, r_next, r_why
      FROM (SELECT w.id, w.state AS cur, durable.run_state_from_counters(w) AS nxt, c2.why
              FROM (SELECT DISTINCT ON (n.run_id) n.run_id, 'step ' || n.name || ' ' || n.state AS why
                      FROM new_rows n
                     WHERE n.prev_state IS NOT NULL
                       AND (durable.step_state_is_terminal(n.state)
                            OR (n.state = 'running' AND EXISTS (SELECT 1 FROM durable.workflow_runs w2
                                                                 WHERE w2.id = n.run_id AND w2.state = 'pending')))
                     ORDER BY n.run_id, n.id) c2
              JOIN durable.workflow_runs w ON w.id = c2.run_id
             WHERE NOT durable.run_state_is_terminal(w.state)
             ORDER BY w.id
               FOR NO KEY UPDATE OF w) x
     WHERE x.nxt <> x.cur;
    IF r_ids IS NULL THEN
        RETURN NULL;
    END IF;
    -- failing or succeeding straight from pending is not in the table: go through running
    IF 'pending' = ANY (r_cur) THEN
        UPDATE durable.workflow_runs w SET state = 'running'
          FROM unnest(r_ids, r_cur, r_next) AS x(id, cur, nxt)
         WHERE w.id = x.id AND x.cur = 'pending' AND x.nxt IN ('succeeded', 'failed');
        INSERT INTO durable.transitions (run_id, from_state, to_state, reason)
        SELECT x.id, 'pending', 'running', x.why
          FROM unnest(r_ids, r_cur, r_next, r_why) AS x(id, cur, nxt, why)
         WHERE x.cur = 'pending' AND x.nxt IN ('succeeded', 'failed')
         ORDER BY x.id;
    END IF;
    UPDATE durable.workflow_runs w SET state = x.nxt
      FROM unnest(r_ids, r_next) AS x(id, nxt)
     WHERE w.id = x.id;
    INSERT INTO durable.transitions (run_id, from_state, to_state, reason)
    SELECT x.id,
           CASE WHEN x.cur = 'pending' AND x.nxt IN ('succeeded', 'failed') THEN 'running' ELSE x.cur END,
           x.nxt, x.why
      FROM unnest(r_ids, r_cur, r_next, r_why) AS x(id, cur, nxt, why)
     ORDER BY x.id;
    RETURN NULL;
END $$;
