-- A flush whose every start is fused with its completion writes the starts'
-- events with the completions: one fence, one INSERT, one UPDATE.
--
-- Since a start waits for its completion (the ledger's START_LINGER), nearly
-- every start of a busy worker is fused, and `write_sets` still wrote such a
-- flush in two passes: `start_steps` (its duplicate check, a subtransaction,
-- `start_steps_set`: a fence of the batch's rows and an INSERT of the
-- starts' events) and then `complete_steps` (the same again for the
-- completions: a duplicate check, a subtransaction, a second fence of the
-- same rows, an INSERT of the completion events, the UPDATE). What a write
-- costs the database is mostly per statement, not per row (ARCHITECTURE,
-- "What a write costs"): at 4 concurrent one-shot Go steps the first pass
-- alone was ~0.54 ms of a ~3.7 ms flush of ~2.6 steps (pg_stat_statements).
--
-- Now, when every start of the call is fused with a completion of the same
-- call, no lease is named twice and the call has no plain events (those of
-- a lease are numbered between its start's and its completion's, and would
-- otherwise follow both in id order), `complete_fused_set` fences the
-- completions once (a fused start's fence is its completion's: the same row,
-- the same token), inserts the starts' events, the events queued behind them
-- and the completion events in one INSERT (each step's in sequence order),
-- and writes every step as before (leased -> running -> succeeded as one row
-- version). A start is answered as its completion's fence answers: written
-- with it, or lost with it. If anything in that pass fails (a refused
-- completion, a site rule), its subtransaction is rolled back and the call is
-- written the way it was before, in two passes and intent by intent where
-- need be, so every refusal is still the refused intent's alone and a
-- refused completion's start is still written on its own. Any other call
-- takes the two passes as before.
CREATE FUNCTION durable.complete_fused_set(p_worker text, p_ids uuid[], p_tokens uuid[], p_outputs jsonb[], p_sequences bigint[], p_pids integer[], p_start integer[], s_sequences bigint[], s_kinds text[], s_messages text[], s_fractions double precision[], s_executor_at timestamp with time zone[], x_start integer[], x_sequences bigint[], x_kinds text[], x_messages text[], x_fractions double precision[], x_executor_at timestamp with time zone[])
RETURNS integer[]
LANGUAGE plpgsql AS $$
DECLARE
    fn integer[]; fid uuid[]; fstate text[]; fatt integer[];
BEGIN
    SELECT f.n, f.id, f.state, f.attempt INTO fn, fid, fstate, fatt
      FROM durable.lock_batch(p_ids, p_tokens) AS f;
    IF fn IS NULL THEN
        RETURN '{}';
    END IF;
    -- p_start[n]: the start (an index of s_*) of completion n, or NULL; a
    -- retried start whose first try committed has its events already
    INSERT INTO durable.step_events (step_run_id, attempt, sequence, kind, message, fraction, checkpoint, executor_at)
    SELECT e.id, e.attempt, e.seq, e.kind, e.msg, e.frac, false, e.at
      FROM (SELECT f.id, f.attempt, s_sequences[p_start[f.n]] AS seq, s_kinds[p_start[f.n]] AS kind,
                   s_messages[p_start[f.n]] AS msg, s_fractions[p_start[f.n]] AS frac,
                   s_executor_at[p_start[f.n]] AS at
              FROM unnest(fn, fid, fatt) AS f(n, id, attempt)
             WHERE p_start[f.n] IS NOT NULL
            UNION ALL
            SELECT f.id, f.attempt, x.seq, x.kind, x.msg, x.frac, x.at
              FROM unnest(x_start, x_sequences, x_kinds, x_messages, x_fractions, x_executor_at)
                   AS x(n, seq, kind, msg, frac, at)
              JOIN unnest(fn, fid, fatt) AS f(n, id, attempt) ON p_start[f.n] = x.n
            UNION ALL
            SELECT f.id, f.attempt, p_sequences[f.n], 'succeeded', '', NULL, NULL
              FROM unnest(fn, fid, fatt) AS f(n, id, attempt)
             WHERE p_sequences[f.n] IS NOT NULL) e
     ORDER BY e.id, e.seq
    ON CONFLICT DO NOTHING;
    -- as complete_steps_set (20261210000001_fused_start.sql)
    UPDATE durable.step_runs s
       SET state = 'succeeded', output = p_outputs[f.n], error_code = NULL, error_message = NULL,
           error_retryable = NULL, error_details = NULL,
           via_state = CASE WHEN f.state = 'leased' THEN 'running' END,
           started_at = CASE WHEN f.state = 'leased' THEN now() ELSE s.started_at END,
           executor_pid = CASE WHEN f.state = 'leased' THEN coalesce(p_pids[f.n], s.executor_pid)
                               ELSE s.executor_pid END,
           transition_reason = 'SUCCEEDED', transition_by = p_worker
      FROM unnest(fn, fid, fstate) AS f(n, id, state)
     WHERE s.id = f.id;
    RETURN fn;
END $$;

-- As in 20261213000001_guards_without_queries.sql, with the one-pass form
-- for a call whose every start is fused (above) tried first.
CREATE OR REPLACE FUNCTION durable.write_sets(p_worker text, p_lock_steps uuid[], s_ids uuid[], s_tokens uuid[], s_pids integer[], s_sequences bigint[], s_kinds text[], s_messages text[], s_fractions double precision[], s_executor_at timestamp with time zone[], x_start integer[], x_sequences bigint[], x_kinds text[], x_messages text[], x_fractions double precision[], x_executor_at timestamp with time zone[], e_ids uuid[], e_tokens uuid[], e_event_lease integer[], e_sequences bigint[], e_kinds text[], e_messages text[], e_fractions double precision[], e_executor_at timestamp with time zone[], c_ids uuid[], c_tokens uuid[], c_outputs jsonb[], c_sequences bigint[])
RETURNS TABLE(part text, idx integer, status text, err_state text, err_message text)
LANGUAGE plpgsql AS $$
DECLARE
    c_start integer[]; s_defer boolean[]; c_pids integer[]; fix integer[] := '{}'; rc record;
    fenced integer[]; one_pass boolean := false;
BEGIN
    IF cardinality(p_lock_steps) > 0 THEN
        PERFORM durable.lock_runs_of(p_lock_steps);
        -- every run of the set part is locked now (the caller names all
        -- its steps): the set forms' lock_batch need not lock them again
        IF coalesce(s_ids, '{}') || coalesce(c_ids, '{}') <@ p_lock_steps THEN
            PERFORM set_config('durable.batch_runs_locked', 'on', true);
        END IF;
    END IF;
    -- A lease whose start and completion are both in this call: the start
    -- is fenced and its events written as before, but its state change is
    -- deferred to the completion, which writes leased -> running ->
    -- succeeded as one row version (c_start[j]: the start of completion j).
    IF cardinality(s_ids) > 0 AND cardinality(c_ids) > 0 THEN
        SELECT array_agg(m.i ORDER BY c.j) INTO c_start
          FROM unnest(c_ids, c_tokens) WITH ORDINALITY AS c(id, token, j)
          LEFT JOIN (SELECT s.id, s.token, min(s.i)::integer AS i
                       FROM unnest(s_ids, s_tokens) WITH ORDINALITY AS s(id, token, i)
                      GROUP BY s.id, s.token) m ON m.id = c.id AND m.token = c.token;
        IF EXISTS (SELECT 1 FROM unnest(c_start) AS x WHERE x IS NOT NULL) THEN
            SELECT array_agg(s.i = ANY (c_start) ORDER BY s.i) INTO s_defer
              FROM generate_subscripts(s_ids, 1) AS s(i);
            SELECT array_agg(s_pids[u.i] ORDER BY u.j) INTO c_pids
              FROM unnest(c_start) WITH ORDINALITY AS u(i, j);
        ELSE
            c_start := NULL;
        END IF;
    END IF;
    -- every start fused, no lease named twice, no plain events: one pass
    -- (complete_fused_set); if it fails, the two passes below
    IF c_start IS NOT NULL AND true = ALL (s_defer)
       AND coalesce(cardinality(e_ids), 0) = 0
       AND (SELECT count(DISTINCT x) FROM unnest(c_ids) AS x) = cardinality(c_ids) THEN
        BEGIN
            fenced := durable.complete_fused_set(p_worker, c_ids, c_tokens, c_outputs, c_sequences, c_pids,
                                                 c_start, s_sequences, s_kinds, s_messages, s_fractions,
                                                 s_executor_at, x_start, x_sequences, x_kinds, x_messages,
                                                 x_fractions, x_executor_at);
            one_pass := true;
        EXCEPTION WHEN OTHERS THEN
            one_pass := false;
        END;
    END IF;
    IF one_pass THEN
        -- a start is answered as its completion's fence is
        RETURN QUERY SELECT 'start', u.i, CASE WHEN u.j::integer = ANY (fenced) THEN 'ok' ELSE 'lost' END,
                            NULL::text, NULL::text
          FROM unnest(c_start) WITH ORDINALITY AS u(i, j)
         WHERE u.i IS NOT NULL
         ORDER BY u.i;
        RETURN QUERY SELECT 'complete', j, CASE WHEN j = ANY (fenced) THEN 'ok' ELSE 'lost' END,
                            NULL::text, NULL::text
          FROM generate_subscripts(c_ids, 1) AS j
         ORDER BY j;
        PERFORM set_config('durable.batch_runs_locked', '', true);
        RETURN;
    END IF;
    IF cardinality(s_ids) > 0 THEN
        RETURN QUERY SELECT 'start', r.idx, r.status, r.err_state, r.err_message
          FROM durable.start_steps(p_worker, s_ids, s_tokens, s_pids, s_sequences, s_kinds, s_messages,
                                   s_fractions, s_executor_at, x_start, x_sequences, x_kinds, x_messages,
                                   x_fractions, x_executor_at, s_defer) r;
    END IF;
    IF cardinality(e_ids) > 0 THEN
        RETURN QUERY SELECT 'event', r.idx, r.status, r.err_state, r.err_message
          FROM durable.record_plain_events(e_ids, e_tokens, e_event_lease, e_sequences, e_kinds,
                                           e_messages, e_fractions, e_executor_at) r;
    END IF;
    IF cardinality(c_ids) > 0 THEN
        FOR rc IN SELECT * FROM durable.complete_steps(p_worker, c_ids, c_tokens, c_outputs, c_sequences, c_pids) LOOP
            part := 'complete'; idx := rc.idx; status := rc.status;
            err_state := rc.err_state; err_message := rc.err_message;
            RETURN NEXT;
            IF c_start[rc.idx] IS NOT NULL AND rc.status <> 'ok' THEN
                fix := fix || c_start[rc.idx];
            END IF;
        END LOOP;
        -- a deferred start whose completion was not written (refused, or
        -- lost): the start itself still is, as it was answered
        IF cardinality(fix) > 0 THEN
            UPDATE durable.step_runs s
               SET state = 'running', started_at = now(), executor_pid = s_pids[f.i],
                   transition_reason = 'ACCEPTED', transition_by = p_worker
              FROM unnest(fix) AS f(i)
             WHERE s.id = s_ids[f.i] AND s.lease_token = s_tokens[f.i] AND s.state = 'leased';
        END IF;
    END IF;
    -- (an error rolls the setting back with the statement's savepoint or
    -- transaction; here it is cleared for the statements that follow)
    PERFORM set_config('durable.batch_runs_locked', '', true);
END $$;
