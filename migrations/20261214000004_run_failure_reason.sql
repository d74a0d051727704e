-- A run's hop to `failed` names the step that failed it.
--
-- The run's reason was the first step (by id) of the statement that made the
-- decision. A terminal failure cancels the run's open steps in a nested
-- statement, whose trigger decides the run: the reason then named a
-- sibling ("step echo succeeded", "step deadline cancelled") instead of the
-- step that failed. Found by an outside audit. Now the hop to `failed` names
-- the run's first terminal_failed step (by when it finished); every other
-- hop keeps the statement's reason. record_run_hops is otherwise unchanged
-- from 20261210000001_fused_start.
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
                ELSE hop.reason END
      FROM unnest(p_ids, p_cur, p_next, p_why, p_why_start) AS x(id, cur, nxt, why, why_start)
     CROSS JOIN LATERAL (SELECT x.cur = 'pending' AND x.nxt IN ('succeeded', 'failed') AS via) v
     CROSS JOIN LATERAL (VALUES (1, x.cur, CASE WHEN v.via THEN 'running' ELSE x.nxt END,
                                 CASE WHEN x.cur = 'pending' THEN coalesce(x.why_start, x.why) ELSE x.why END),
                                (2, 'running', x.nxt, x.why)) AS hop(k, from_state, to_state, reason)
     WHERE x.nxt <> x.cur AND (hop.k = 1 OR v.via)
     ORDER BY x.id, hop.k;
END $$;
