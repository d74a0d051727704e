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
-- twice also goes intent by intent (the first wins, as before).

CREATE FUNCTION durable.start_steps_set(p_worker text, p_ids uuid[], p_tokens uuid[], p_pids integer[],
                                        p_sequences bigint[], p_kinds text[], p_messages text[],
                                        p_fractions double precision[], p_executor_at timestamptz[])
RETURNS integer[] LANGUAGE plpgsql AS $$
DECLARE
    fn integer[]; fid uuid[]; fstate text[]; fatt integer[];
BEGIN
    PERFORM 1 FROM durable.workflow_runs
      WHERE id IN (SELECT s.run_id FROM durable.step_runs s WHERE s.id = ANY (p_ids))
      ORDER BY id FOR NO KEY UPDATE;
    SELECT array_agg(x.n ORDER BY x.id), array_agg(x.id ORDER BY x.id),
           array_agg(x.state ORDER BY x.id), array_agg(x.attempt ORDER BY x.id)
      INTO fn, fid, fstate, fatt
      FROM (SELECT u.n::integer AS n, s.id, s.state, s.attempt
              FROM unnest(p_ids, p_tokens) WITH ORDINALITY AS u(id, token, n)
              JOIN durable.step_runs s ON s.id = u.id AND s.lease_token = u.token
                                      AND s.state IN ('leased', 'running')
             ORDER BY s.id
               FOR NO KEY UPDATE OF s) x;
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
    PERFORM 1 FROM durable.workflow_runs
      WHERE id IN (SELECT s.run_id FROM durable.step_runs s WHERE s.id = ANY (p_ids))
      ORDER BY id FOR NO KEY UPDATE;
    SELECT array_agg(x.n ORDER BY x.id), array_agg(x.id ORDER BY x.id),
           array_agg(x.state ORDER BY x.id), array_agg(x.attempt ORDER BY x.id)
      INTO fn, fid, fstate, fatt
      FROM (SELECT u.n::integer AS n, s.id, s.state, s.attempt
              FROM unnest(p_ids, p_tokens) WITH ORDINALITY AS u(id, token, n)
              JOIN durable.step_runs s ON s.id = u.id AND s.lease_token = u.token
                                      AND s.state IN ('leased', 'running')
             ORDER BY s.id
               FOR NO KEY UPDATE OF s) x;
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
    IF (SELECT count(DISTINCT x) FROM unnest(p_ids) AS x) = coalesce(cardinality(p_ids), 0) THEN
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
    IF (SELECT count(DISTINCT x) FROM unnest(p_ids) AS x) = coalesce(cardinality(p_ids), 0) THEN
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
