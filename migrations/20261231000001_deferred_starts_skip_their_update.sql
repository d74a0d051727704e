-- A start whose completion is in the same ledger call (write_sets) is
-- fenced and its events written here, and its state change is deferred to
-- that completion (leased -> running -> succeeded as one row version). Since
-- a start now waits for its completion before it is written (the ledger's
-- START_LINGER), nearly every start of a busy worker is deferred, and the
-- state UPDATE below ran over no row at all: its statement trigger
-- (on_step_transition) and executor still ran each time, ~0.15 ms per call
-- on a loaded host (pg_stat_statements). It now runs only when some start of
-- the call is not deferred. Otherwise the function is as in
-- 20261210000001_fused_start.sql.
CREATE OR REPLACE FUNCTION durable.start_steps_set(p_worker text, p_ids uuid[], p_tokens uuid[], p_pids integer[], p_sequences bigint[], p_kinds text[], p_messages text[], p_fractions double precision[], p_executor_at timestamp with time zone[], x_start integer[], x_sequences bigint[], x_kinds text[], x_messages text[], x_fractions double precision[], x_executor_at timestamp with time zone[], p_defer boolean[] DEFAULT NULL)
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
    -- (a NULL among p_defer is "not deferred", as below)
    IF p_defer IS NULL OR NOT coalesce(true = ALL (p_defer), false)
       OR cardinality(p_defer) < cardinality(p_ids) THEN
        UPDATE durable.step_runs s
           SET state = 'running', started_at = now(), executor_pid = p_pids[f.n],
               transition_reason = 'ACCEPTED', transition_by = p_worker
          FROM unnest(fn, fid, fstate) AS f(n, id, state)
         WHERE s.id = f.id AND f.state = 'leased' AND NOT coalesce(p_defer[f.n], false);
    END IF;
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
