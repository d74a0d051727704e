-- The ending event takes the attempt's next sequence. A sequence at bigint's
-- limit (an executor may send any uint64; workers before the wire's bound of
-- 2^53 - 1 stored it, or its wrap-around) made `last.sequence + 1` overflow:
-- the ending event failed, and with it the reclaim batch that held that step,
-- every second and for every worker, so no expired lease was reclaimed again.
-- At the limit the next sequence saturates and the insert is skipped (the
-- unique index and ON CONFLICT), instead of failing its caller.
CREATE OR REPLACE FUNCTION durable.record_ending_event(p_step uuid, p_attempt integer, p_kind text, p_message text)
RETURNS void LANGUAGE sql SET enable_seqscan = off AS $$
    INSERT INTO durable.step_events (step_run_id, attempt, sequence, kind, message)
    SELECT p_step, p_attempt,
           CASE WHEN last.sequence < 9223372036854775807 THEN last.sequence + 1 ELSE last.sequence END,
           p_kind, p_message
      FROM (SELECT e.sequence FROM durable.step_events e
             WHERE e.step_run_id = p_step AND e.attempt = p_attempt
             ORDER BY e.sequence DESC
             LIMIT 1) last
    ON CONFLICT DO NOTHING
$$;
