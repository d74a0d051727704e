-- The terminal event the supervisor writes for an attempt it ended (a
-- cancel, a timeout, a deadline, a silent executor, an expired lease) takes
-- the attempt's next sequence. Reading the attempt's last sequence must cost
-- one probe of the (step_run_id, attempt, sequence) index whatever the
-- table's statistics say: with statistics taken when step_events was small,
-- the planner scanned the whole table for it (bounded_reads). A function
-- with its own `SET enable_seqscan = off` is planned on its own, with the
-- setting for its statement only.
CREATE FUNCTION durable.record_ending_event(p_step uuid, p_attempt integer, p_kind text, p_message text)
RETURNS void LANGUAGE sql SET enable_seqscan = off AS $$
    INSERT INTO durable.step_events (step_run_id, attempt, sequence, kind, message)
    SELECT p_step, p_attempt, last.sequence + 1, p_kind, p_message
      FROM (SELECT e.sequence FROM durable.step_events e
             WHERE e.step_run_id = p_step AND e.attempt = p_attempt
             ORDER BY e.sequence DESC
             LIMIT 1) last
    ON CONFLICT DO NOTHING
$$;
