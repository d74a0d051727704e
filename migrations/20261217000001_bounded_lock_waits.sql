-- The ledger's batches wait a bounded time for a row lock.
--
-- A worker writes every outcome through one writer (its ledger). A batch
-- locks the runs of its steps first, in id order, and a run row held by
-- another transaction (an operator's open psql session, a long cancel) made
-- the batch wait the pool's lock_timeout (10 s), then fail, then be retried
-- with the same held run in it: every step of every other run of the worker
-- waited behind it (20 echo runs took 17.6 s instead of 0.35 s). With this
-- form the batch gives up on a held row after p_lock_wait (lock_not_available,
-- 55P03); the worker then finds which steps' rows are held (their writes wait
-- aside, in order, until the rows are free) and writes the rest at once.
--
-- set_config(..., true) lasts until the end of the transaction: on its own
-- the statement is its transaction; inside the ledger's transaction it also
-- bounds the writes that follow in it.
CREATE FUNCTION durable.write_sets_bounded(p_lock_wait text, p_worker text, p_lock_steps uuid[], s_ids uuid[], s_tokens uuid[], s_pids integer[], s_sequences bigint[], s_kinds text[], s_messages text[], s_fractions double precision[], s_executor_at timestamp with time zone[], x_start integer[], x_sequences bigint[], x_kinds text[], x_messages text[], x_fractions double precision[], x_executor_at timestamp with time zone[], e_ids uuid[], e_tokens uuid[], e_event_lease integer[], e_sequences bigint[], e_kinds text[], e_messages text[], e_fractions double precision[], e_executor_at timestamp with time zone[], c_ids uuid[], c_tokens uuid[], c_outputs jsonb[], c_sequences bigint[])
RETURNS TABLE(part text, idx integer, status text, err_state text, err_message text)
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM set_config('lock_timeout', p_lock_wait, true);
    RETURN QUERY
        SELECT * FROM durable.write_sets(p_worker, p_lock_steps, s_ids, s_tokens, s_pids, s_sequences, s_kinds,
                                         s_messages, s_fractions, s_executor_at, x_start, x_sequences, x_kinds,
                                         x_messages, x_fractions, x_executor_at, e_ids, e_tokens, e_event_lease,
                                         e_sequences, e_kinds, e_messages, e_fractions, e_executor_at, c_ids,
                                         c_tokens, c_outputs, c_sequences);
END $$;

-- The steps of a ledger batch that failed on a held row whose run row or own
-- row another transaction holds right now (SKIP LOCKED: this never waits;
-- the row locks it takes end with the statement).
CREATE FUNCTION durable.held_steps(p_steps uuid[]) RETURNS TABLE(step_run_id uuid, run_id uuid)
LANGUAGE sql AS $$
    SELECT s.id, s.run_id FROM durable.step_runs s
     WHERE s.id = ANY (p_steps)
       AND (NOT EXISTS (SELECT 1 FROM durable.workflow_runs w WHERE w.id = s.run_id
                          FOR NO KEY UPDATE SKIP LOCKED)
            OR NOT EXISTS (SELECT 1 FROM durable.step_runs t WHERE t.id = s.id
                             FOR NO KEY UPDATE SKIP LOCKED))
$$;
