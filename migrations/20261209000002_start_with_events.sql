-- A start and the plain events right behind it in one write (issue 7: the
-- hot path). An executor's RUNNING (the SDKs send it after ACCEPTED) reached
-- the ledger in the same flush as its start, and was written by a call of its
-- own (record_plain_events: its own fence read of the step and its own
-- INSERT) right after the start had locked and fenced that very row. Now a
-- ledger batch hands a start's following plain events (same lease, same
-- batch) to the start itself: they are inserted with its accepted event, in
-- the same INSERT, under the same fence, and answered with the start's
-- answer. Same rows, same order (by step, then sequence), same fence: a start
-- that is lost writes none of them. Events of a lease whose start is not in
-- the batch are written by record_plain_events, as before.
--
-- The new forms take six more arrays: for each extra event the index of its
-- start in the batch (x_start), and its fields. The old forms stay (a worker
-- of the previous version calls them during a rolling upgrade) and become
-- the new ones with no extra events (at the end of this file).

CREATE FUNCTION durable.start_step(p_id uuid, p_token uuid, p_worker text, p_pid integer,
                                   p_sequence bigint, p_kind text, p_message text,
                                   p_fraction double precision, p_executor_at timestamptz,
                                   x_sequences bigint[], x_kinds text[], x_messages text[],
                                   x_fractions double precision[], x_executor_at timestamptz[])
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
    -- a retried start whose first try committed: the events are already there
    INSERT INTO durable.step_events (step_run_id, attempt, sequence, kind, message, fraction, checkpoint, executor_at)
    SELECT p_id, att, e.seq, e.kind, e.msg, e.frac, false, e.at
      FROM (SELECT p_sequence AS seq, p_kind AS kind, p_message AS msg, p_fraction AS frac, p_executor_at AS at
            UNION ALL
            SELECT * FROM unnest(x_sequences, x_kinds, x_messages, x_fractions, x_executor_at)) e
     ORDER BY e.seq
    ON CONFLICT DO NOTHING;
    RETURN true;
END $$;

CREATE FUNCTION durable.start_steps_set(p_worker text, p_ids uuid[], p_tokens uuid[], p_pids integer[],
                                        p_sequences bigint[], p_kinds text[], p_messages text[],
                                        p_fractions double precision[], p_executor_at timestamptz[],
                                        x_start integer[], x_sequences bigint[], x_kinds text[],
                                        x_messages text[], x_fractions double precision[],
                                        x_executor_at timestamptz[])
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
    -- a retried start whose first try committed: the events are already there
    INSERT INTO durable.step_events (step_run_id, attempt, sequence, kind, message, fraction, checkpoint, executor_at)
    SELECT e.id, e.attempt, e.seq, e.kind, e.msg, e.frac, false, e.at
      FROM (SELECT f.id, f.attempt, p_sequences[f.n] AS seq, p_kinds[f.n] AS kind, p_messages[f.n] AS msg,
                   p_fractions[f.n] AS frac, p_executor_at[f.n] AS at
              FROM unnest(fn, fid, fatt) AS f(n, id, attempt)
            UNION ALL
            SELECT f.id, f.attempt, x.seq, x.kind, x.msg, x.frac, x.at
              FROM unnest(x_start, x_sequences, x_kinds, x_messages, x_fractions, x_executor_at)
                   AS x(n, seq, kind, msg, frac, at)
              JOIN unnest(fn, fid, fatt) AS f(n, id, attempt) ON f.n = x.n) e
     ORDER BY e.id, e.seq
    ON CONFLICT DO NOTHING;
    RETURN fn;
END $$;

CREATE FUNCTION durable.start_steps(p_worker text, p_ids uuid[], p_tokens uuid[], p_pids integer[],
                                    p_sequences bigint[], p_kinds text[], p_messages text[],
                                    p_fractions double precision[], p_executor_at timestamptz[],
                                    x_start integer[], x_sequences bigint[], x_kinds text[],
                                    x_messages text[], x_fractions double precision[],
                                    x_executor_at timestamptz[])
RETURNS TABLE (idx integer, status text, err_state text, err_message text)
LANGUAGE plpgsql AS $$
DECLARE
    i integer; fenced integer[]; done boolean := false;
    xs bigint[]; xk text[]; xm text[]; xf double precision[]; xa timestamptz[];
BEGIN
    -- as the form without extra events: the set form first, intent by
    -- intent if it is refused (or names a step twice) or for one intent
    IF cardinality(p_ids) > 1
       AND (SELECT count(DISTINCT x) FROM unnest(p_ids) AS x) = cardinality(p_ids) THEN
        BEGIN
            fenced := durable.start_steps_set(p_worker, p_ids, p_tokens, p_pids, p_sequences, p_kinds,
                                              p_messages, p_fractions, p_executor_at, x_start, x_sequences,
                                              x_kinds, x_messages, x_fractions, x_executor_at);
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
            SELECT coalesce(array_agg(x.seq ORDER BY x.o), '{}'), coalesce(array_agg(x.kind ORDER BY x.o), '{}'),
                   coalesce(array_agg(x.msg ORDER BY x.o), '{}'), coalesce(array_agg(x.frac ORDER BY x.o), '{}'),
                   coalesce(array_agg(x.at ORDER BY x.o), '{}')
              INTO xs, xk, xm, xf, xa
              FROM unnest(x_start, x_sequences, x_kinds, x_messages, x_fractions, x_executor_at)
                   WITH ORDINALITY AS x(n, seq, kind, msg, frac, at, o)
             WHERE x.n = i;
            BEGIN
                IF durable.start_step(p_ids[i], p_tokens[i], p_worker, p_pids[i], p_sequences[i], p_kinds[i],
                                      p_messages[i], p_fractions[i], p_executor_at[i],
                                      xs, xk, xm, xf, xa) THEN
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

CREATE FUNCTION durable.write_sets(
    p_worker text, p_lock_steps uuid[],
    s_ids uuid[], s_tokens uuid[], s_pids integer[], s_sequences bigint[], s_kinds text[],
    s_messages text[], s_fractions double precision[], s_executor_at timestamptz[],
    x_start integer[], x_sequences bigint[], x_kinds text[], x_messages text[],
    x_fractions double precision[], x_executor_at timestamptz[],
    e_ids uuid[], e_tokens uuid[], e_event_lease integer[], e_sequences bigint[], e_kinds text[],
    e_messages text[], e_fractions double precision[], e_executor_at timestamptz[],
    c_ids uuid[], c_tokens uuid[], c_outputs jsonb[], c_sequences bigint[])
RETURNS TABLE (part text, idx integer, status text, err_state text, err_message text)
LANGUAGE plpgsql AS $$
BEGIN
    IF cardinality(p_lock_steps) > 0 THEN
        PERFORM durable.lock_runs_of(p_lock_steps);
    END IF;
    IF cardinality(s_ids) > 0 THEN
        RETURN QUERY SELECT 'start', r.idx, r.status, r.err_state, r.err_message
          FROM durable.start_steps(p_worker, s_ids, s_tokens, s_pids, s_sequences, s_kinds, s_messages,
                                   s_fractions, s_executor_at, x_start, x_sequences, x_kinds, x_messages,
                                   x_fractions, x_executor_at) r;
    END IF;
    IF cardinality(e_ids) > 0 THEN
        RETURN QUERY SELECT 'event', r.idx, r.status, r.err_state, r.err_message
          FROM durable.record_plain_events(e_ids, e_tokens, e_event_lease, e_sequences, e_kinds,
                                           e_messages, e_fractions, e_executor_at) r;
    END IF;
    IF cardinality(c_ids) > 0 THEN
        RETURN QUERY SELECT 'complete', r.idx, r.status, r.err_state, r.err_message
          FROM durable.complete_steps(p_worker, c_ids, c_tokens, c_outputs, c_sequences) r;
    END IF;
END $$;

-- One implementation: the forms without extra events are the forms above
-- with none (the single start's caller, Db::start, and a worker of the
-- previous version use them).
CREATE OR REPLACE FUNCTION durable.start_step(p_id uuid, p_token uuid, p_worker text, p_pid integer,
                                              p_sequence bigint, p_kind text, p_message text,
                                              p_fraction double precision, p_executor_at timestamptz)
RETURNS boolean LANGUAGE sql AS $$
    SELECT durable.start_step(p_id, p_token, p_worker, p_pid, p_sequence, p_kind, p_message, p_fraction,
                              p_executor_at, '{}', '{}', '{}', '{}', '{}')
$$;

CREATE OR REPLACE FUNCTION durable.start_steps_set(p_worker text, p_ids uuid[], p_tokens uuid[], p_pids integer[],
                                                   p_sequences bigint[], p_kinds text[], p_messages text[],
                                                   p_fractions double precision[], p_executor_at timestamptz[])
RETURNS integer[] LANGUAGE sql AS $$
    SELECT durable.start_steps_set(p_worker, p_ids, p_tokens, p_pids, p_sequences, p_kinds, p_messages,
                                   p_fractions, p_executor_at, '{}', '{}', '{}', '{}', '{}', '{}')
$$;

CREATE OR REPLACE FUNCTION durable.start_steps(p_worker text, p_ids uuid[], p_tokens uuid[], p_pids integer[],
                                               p_sequences bigint[], p_kinds text[], p_messages text[],
                                               p_fractions double precision[], p_executor_at timestamptz[])
RETURNS TABLE (idx integer, status text, err_state text, err_message text)
LANGUAGE sql AS $$
    SELECT * FROM durable.start_steps(p_worker, p_ids, p_tokens, p_pids, p_sequences, p_kinds, p_messages,
                                      p_fractions, p_executor_at, '{}', '{}', '{}', '{}', '{}', '{}')
$$;

CREATE OR REPLACE FUNCTION durable.write_sets(
    p_worker text, p_lock_steps uuid[],
    s_ids uuid[], s_tokens uuid[], s_pids integer[], s_sequences bigint[], s_kinds text[],
    s_messages text[], s_fractions double precision[], s_executor_at timestamptz[],
    e_ids uuid[], e_tokens uuid[], e_event_lease integer[], e_sequences bigint[], e_kinds text[],
    e_messages text[], e_fractions double precision[], e_executor_at timestamptz[],
    c_ids uuid[], c_tokens uuid[], c_outputs jsonb[], c_sequences bigint[])
RETURNS TABLE (part text, idx integer, status text, err_state text, err_message text)
LANGUAGE sql AS $$
    SELECT * FROM durable.write_sets(p_worker, p_lock_steps, s_ids, s_tokens, s_pids, s_sequences, s_kinds,
                                     s_messages, s_fractions, s_executor_at, '{}', '{}', '{}', '{}', '{}', '{}',
                                     e_ids, e_tokens, e_event_lease, e_sequences, e_kinds, e_messages,
                                     e_fractions, e_executor_at, c_ids, c_tokens, c_outputs, c_sequences)
$$;
