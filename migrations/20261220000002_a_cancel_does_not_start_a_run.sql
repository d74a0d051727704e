-- A cancel no longer moves a run that never started to `running`
-- (cancellation audit):
--
-- * A run counted as started, for its move from pending to running, when a
--   step was merely leased. A lease makes no run decision of its own, but a
--   cancel does (cancel_run's, and the one of the statement that cancels the
--   pending steps), so cancelling a pending run whose step was leased but not
--   yet started recorded `pending -> running` ("cancel requested"), and
--   `cancel` answered "run is running" for a run in which nothing had run; a
--   frozen worker's lease kept it listed as running for a whole TTL. Now only
--   a running step (or one that failed an attempt and waits to retry, or an
--   ended one) makes a pending run `running`: the run goes `pending ->
--   cancelled` when its leased step is given up.
-- * A run closed by a cancel request named the last step that ended as its
--   reason ("step s succeeded" for a result kept within the grace, "step p2
--   cancelled" for a fan-out), as if that step had ended the run. Its hop to
--   cancelled now says "cancel requested". A run cancelled because one of
--   its steps was cancelled by name still names that step.
--
-- Otherwise run_state_from_counts is unchanged from 20261215000001,
-- record_run_hops from 20261216000004 (and aggregate_run_state below).

CREATE OR REPLACE FUNCTION durable.run_state_from_counts(p_id uuid, p_state text, p_total integer, p_succeeded integer, p_failed integer, p_cancelled integer, p_defs_waiting integer)
 RETURNS text
 LANGUAGE plpgsql
 STABLE
AS $function$
DECLARE
    started int := 0;
BEGIN
    IF p_state = 'pending' THEN
        started := p_succeeded + p_failed;
        -- (step_is_live: the probe walks the live steps' index)
        IF started = 0 AND (EXISTS (SELECT 1 FROM durable.step_runs s
                                     WHERE s.run_id = p_id AND durable.step_is_live(s.state)
                                       AND s.state = 'running')
                            OR EXISTS (SELECT 1 FROM durable.step_runs s
                                        WHERE s.run_id = p_id AND s.state = 'retryable_failed')) THEN
            started := 1;
        END IF;
    END IF;
    RETURN durable.aggregate_run_counts(
        p_state, p_total, p_total - p_succeeded - p_failed - p_cancelled,
        p_failed, p_cancelled, started, p_defs_waiting > 0);
END $function$;

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
                ELSE hop.reason END
      FROM unnest(p_ids, p_cur, p_next, p_why, p_why_start) AS x(id, cur, nxt, why, why_start)
     CROSS JOIN LATERAL (SELECT durable.run_passes_running(x.cur, x.nxt, x.why_start) AS via) v
     CROSS JOIN LATERAL (VALUES (1, x.cur, CASE WHEN v.via THEN 'running' ELSE x.nxt END,
                                 CASE WHEN x.cur = 'pending' THEN coalesce(x.why_start, x.why) ELSE x.why END),
                                (2, 'running', x.nxt, x.why)) AS hop(k, from_state, to_state, reason)
     WHERE x.nxt <> x.cur AND (hop.k = 1 OR v.via)
     ORDER BY x.id, hop.k;
END $$;

-- The array form's twin (state::aggregate_run is the Rust one), unchanged
-- from 20261202000001 but for the leased steps it counted as started.
CREATE OR REPLACE FUNCTION durable.aggregate_run_state(current_state text, step_states text[], waiting boolean)
RETURNS text LANGUAGE plpgsql IMMUTABLE AS $$
DECLARE
    total int; open_steps int; failed int; cancelled int; started int;
BEGIN
    SELECT count(*), count(*) FILTER (WHERE NOT durable.step_state_is_terminal(s)),
           count(*) FILTER (WHERE s = 'terminal_failed'), count(*) FILTER (WHERE s = 'cancelled'),
           count(*) FILTER (WHERE s NOT IN ('pending', 'leased', 'cancelled'))
      INTO total, open_steps, failed, cancelled, started
      FROM unnest(coalesce(step_states, '{}'::text[])) AS s;
    RETURN durable.aggregate_run_counts(current_state, total, open_steps, failed, cancelled, started, waiting);
END $$;
