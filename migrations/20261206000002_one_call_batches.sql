-- A ledger batch's set part in one statement (issue 7: the hot path). A
-- batch was BEGIN, the run lock, start_steps, record_plain_events,
-- complete_steps and COMMIT: up to six round trips, each a full protocol
-- cycle on both sides, for what is one transaction. Now it is one call, in
-- autocommit on a bare connection (in a savepoint inside a caller's
-- transaction, as before). What it does is unchanged: the runs of
-- p_lock_steps locked first, in id order (a mixed batch's up-front lock;
-- empty: none), then the starts, the plain events and the completions, each
-- by its own entry point, each row answered with its part and its index.
CREATE FUNCTION durable.write_sets(
    p_worker text, p_lock_steps uuid[],
    s_ids uuid[], s_tokens uuid[], s_pids integer[], s_sequences bigint[], s_kinds text[],
    s_messages text[], s_fractions double precision[], s_executor_at timestamptz[],
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
                                   s_fractions, s_executor_at) r;
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
