-- A run that ends cancelled with no cancel of its own (a step was cancelled
-- by name while another still ran) names a cancelled step as its reason,
-- as a failed run names its failed step. It named the step that ended last
-- ("step s succeeded" on a run that ended cancelled: operator race audit).
-- Otherwise record_run_hops is unchanged from 20261220000002.
CREATE OR REPLACE FUNCTION durable.record_run_hops(p_ids uuid[], p_cur text[], p_next text[], p_why text[],
                                                   p_why_start text[])
RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO durable.transitions (run_id, from_state, to_state, reason)
    SELECT x.id, hop.from_state, hop.to_state,
           CASE WHEN hop.to_state = 'failed'
                THEN coalesce((SELECT 'step ' || s.name || ' terminal_failed' FROM durable.step_runs s
                                WHERE s.run_id = x.id AND s.state = 'terminal_failed'
                                ORDER BY s.finished_at, s.id LIMIT 1), hop.reason)
                WHEN hop.to_state = 'cancelled'
                     AND (SELECT w.cancel_requested FROM durable.workflow_runs w WHERE w.id = x.id)
                THEN 'cancel requested'
                WHEN hop.to_state = 'cancelled'
                THEN coalesce((SELECT 'step ' || s.name || ' cancelled' FROM durable.step_runs s
                                WHERE s.run_id = x.id AND s.state = 'cancelled'
                                ORDER BY s.finished_at, s.id LIMIT 1), hop.reason)
                ELSE hop.reason END
      FROM unnest(p_ids, p_cur, p_next, p_why, p_why_start) AS x(id, cur, nxt, why, why_start)
     CROSS JOIN LATERAL (SELECT durable.run_passes_running(x.cur, x.nxt, x.why_start) AS via) v
     CROSS JOIN LATERAL (VALUES (1, x.cur, CASE WHEN v.via THEN 'running' ELSE x.nxt END,
                                 CASE WHEN x.cur = 'pending' THEN coalesce(x.why_start, x.why) ELSE x.why END),
                                (2, 'running', x.nxt, x.why)) AS hop(k, from_state, to_state, reason)
     WHERE x.nxt <> x.cur AND (hop.k = 1 OR v.via)
     ORDER BY x.id, hop.k;
END $$;
