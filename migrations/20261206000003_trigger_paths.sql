-- The step trigger's paths (issue 7: the hot path). Every statement of the
-- trigger ran on every state change, each a full executor start and end
-- (15-20 % of a step write's database time in perf): a lease ran the wake-up
-- query, the counters, the cascade scan and the runs' pre-check, all finding
-- nothing to do. The history insert now also says what the changes call for,
-- and each of those statements runs only when a changed row needs it:
--
--   wake-up         a step back to pending / retryable_failed
--   counters        a terminal step
--   cascades        a success (with dependents) or a terminal failure
--   runs' decision  a terminal step, or a step that starts running
--
-- A lease is now the history insert alone; a start the insert and the runs'
-- decision. What each path does is unchanged, and so is their order.
CREATE OR REPLACE FUNCTION durable.on_step_transition() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    n_changed bigint; c record; d durable.step_defs; run_key text; run_cancel boolean; run_failed int;
    f_wake boolean; f_terminal boolean; f_cascade boolean; f_running boolean;
    r_ids uuid[]; r_cur text[]; r_next text[]; r_why text[]; c_ids uuid[]; c_why text[];
BEGIN
    IF TG_OP = 'INSERT' THEN
        -- history, wake-ups, and the run's counters: one row more, one definition less waiting
        INSERT INTO durable.transitions (run_id, step_run_id, from_state, to_state, attempt, worker, reason)
        SELECT n.run_id, n.id, NULL, n.state, n.attempt, n.transition_by, n.transition_reason
          FROM new_rows n ORDER BY n.run_id, n.position;
        PERFORM pg_notify('durable_steps', k.executor_kind)
           FROM (SELECT DISTINCT executor_kind FROM new_rows) k;
        FOR c IN SELECT run_id, count(*)::int AS n FROM new_rows GROUP BY run_id ORDER BY run_id LOOP
            UPDATE durable.workflow_runs
               SET steps_total = steps_total + c.n, defs_waiting = greatest(defs_waiting - c.n, 0)
             WHERE id = c.run_id;
        END LOOP;
        RETURN NULL;
    END IF;

    -- UPDATE: only rows whose state changed count (a heartbeat, a flag or a
    -- checkpoint changes none and ends here). The history rows are written
    -- and, in the same statement, what the changes call for: a wake-up, the
    -- counters, the cascades, the runs' decision. Each of those is a
    -- statement of its own, run only when some row needs it: a lease needs
    -- none, a start only the runs' decision, a completion no wake-up.
    WITH h AS (
        INSERT INTO durable.transitions (run_id, step_run_id, from_state, to_state, attempt, worker, reason)
        SELECT n.run_id, n.id, n.prev_state, n.state, n.attempt, n.transition_by, n.transition_reason
          FROM new_rows n
         WHERE n.prev_state IS NOT NULL
         ORDER BY n.id
        RETURNING to_state
    )
    SELECT count(*),
           coalesce(bool_or(h.to_state IN ('pending', 'retryable_failed')), false),
           coalesce(bool_or(durable.step_state_is_terminal(h.to_state)), false),
           coalesce(bool_or(h.to_state IN ('succeeded', 'terminal_failed')), false),
           coalesce(bool_or(h.to_state = 'running'), false)
      INTO n_changed, f_wake, f_terminal, f_cascade, f_running
      FROM h;
    IF n_changed = 0 THEN
        RETURN NULL;
    END IF;

    IF f_wake THEN
        PERFORM pg_notify('durable_steps', k.executor_kind)
           FROM (SELECT DISTINCT n.executor_kind FROM new_rows n
                  WHERE n.prev_state IS NOT NULL AND n.state IN ('pending', 'retryable_failed')) k;
    END IF;
    IF NOT (f_terminal OR f_running) THEN
        RETURN NULL;
    END IF;

    -- counters: only terminal transitions change one (a terminal row never
    -- changes again, so each step is counted once); one statement for all
    -- runs, locked in id order first
    IF f_terminal THEN
        WITH x AS (
            SELECT n.run_id,
                   count(*) FILTER (WHERE n.state = 'succeeded')::int AS succeeded,
                   count(*) FILTER (WHERE n.state = 'terminal_failed')::int AS failed,
                   count(*) FILTER (WHERE n.state = 'cancelled')::int AS cancelled
              FROM new_rows n
             WHERE n.prev_state IS NOT NULL AND durable.step_state_is_terminal(n.state)
             GROUP BY n.run_id
        ), l AS (
            SELECT w.id, x.succeeded, x.failed, x.cancelled
              FROM (SELECT * FROM x ORDER BY x.run_id OFFSET 0) x
              CROSS JOIN LATERAL (SELECT w.id FROM durable.workflow_runs w
                                   WHERE w.id = x.run_id FOR NO KEY UPDATE) w
        )
        UPDATE durable.workflow_runs w
           SET steps_succeeded = w.steps_succeeded + l.succeeded, steps_failed = w.steps_failed + l.failed,
               steps_cancelled = w.steps_cancelled + l.cancelled
          FROM l
         WHERE w.id = l.id;
    END IF;

    -- cascades, in id order: a success with dependents (a probe per row),
    -- a terminal failure
    IF f_cascade THEN
        FOR c IN
            SELECT n.id, n.run_id, n.name, n.state
              FROM new_rows n
             WHERE n.prev_state IS NOT NULL
               AND (n.state = 'terminal_failed'
                    OR (n.state = 'succeeded'
                        AND coalesce((SELECT true FROM durable.step_dependents e
                                       WHERE e.run_id = n.run_id AND e.dependency = n.name
                                       LIMIT 1), false)))
             ORDER BY n.id
        LOOP
            IF c.state = 'succeeded' THEN
                -- this step's dependents have one dependency fewer to wait for;
                -- the definitions are written under the run's lock (taken above)
                SELECT coalesce(r.idempotency_key, r.id::text), r.cancel_requested, r.steps_failed
                  INTO run_key, run_cancel, run_failed
                  FROM durable.workflow_runs r WHERE r.id = c.run_id;
                FOR d IN
                    WITH ready AS (
                        UPDATE durable.step_defs sd SET deps_remaining = sd.deps_remaining - 1
                          FROM durable.step_dependents e
                         WHERE e.run_id = c.run_id AND e.dependency = c.name
                           AND sd.run_id = e.run_id AND sd.name = e.dependent
                     RETURNING sd.*
                    )
                    SELECT * FROM ready WHERE deps_remaining = 0 ORDER BY position
                LOOP
                    -- as before: no new step once the run failed or a cancel was
                    -- requested; a definition cancel_run already created stays as is
                    IF NOT run_cancel AND run_failed = 0
                       AND NOT EXISTS (SELECT 1 FROM durable.step_runs s WHERE s.run_id = d.run_id AND s.name = d.name) THEN
                        PERFORM durable.materialize_step(d, run_key);
                    END IF;
                END LOOP;
            ELSE
                -- the first failure ends the run: open siblings are locked in id order,
                -- pending ones cancelled at once, leased and running ones get a durable
                -- cancel request
                WITH sib AS (
                    SELECT id FROM durable.step_runs
                     WHERE run_id = c.run_id AND id <> c.id
                       AND state IN ('pending', 'retryable_failed', 'leased', 'running')
                     ORDER BY id FOR NO KEY UPDATE
                )
                UPDATE durable.step_runs s
                   SET state = CASE WHEN s.state IN ('pending', 'retryable_failed') THEN 'cancelled' ELSE s.state END,
                       transition_reason = CASE WHEN s.state IN ('pending', 'retryable_failed') THEN 'RUN_FAILED' ELSE s.transition_reason END,
                       transition_by = CASE WHEN s.state IN ('pending', 'retryable_failed') THEN NULL ELSE s.transition_by END,
                       cancel_requested = true
                  FROM sib WHERE s.id = sib.id;
            END IF;
        END LOOP;
    END IF;

    -- the runs, once per run and in one pass: after a terminal step, or a
    -- step that starts running while its run is still pending (a running run
    -- needs nothing); the decision is recompute_run's (run_state_from_counters).
    -- Every read here is a primary-key probe per changed row: first the runs
    -- this statement may move (the pending check a scalar subquery, never a
    -- hashed scan of every open run), then each of them locked in id order,
    -- and only then decided. Before, the decision sat in the WHERE of a join,
    -- where the planner could push it down to a sequential scan of every run
    -- and evaluate it (two probes of step_runs each) on all of them: O(open
    -- runs) per start, a second per batch at 1,500 open runs.
    SELECT array_agg(c2.run_id ORDER BY c2.run_id), array_agg(c2.why ORDER BY c2.run_id)
      INTO c_ids, c_why
      FROM (SELECT DISTINCT ON (n.run_id) n.run_id, 'step ' || n.name || ' ' || n.state AS why
              FROM new_rows n
             WHERE n.prev_state IS NOT NULL
               AND (durable.step_state_is_terminal(n.state)
                    OR (n.state = 'running'
                        AND (SELECT w2.state FROM durable.workflow_runs w2 WHERE w2.id = n.run_id) = 'pending'))
             ORDER BY n.run_id, n.id) c2;
    IF c_ids IS NULL THEN
        RETURN NULL;
    END IF;
    SELECT array_agg(x.id ORDER BY x.id), array_agg(x.cur ORDER BY x.id),
           array_agg(x.nxt ORDER BY x.id), array_agg(x.why ORDER BY x.id)
      INTO r_ids, r_cur, r_next, r_why
      FROM (SELECT lk.id, lk.cur, durable.run_state_from_counters(lk.w) AS nxt, lk.why
              FROM (SELECT w.id, w.state AS cur, w.w, cand.why
                      FROM unnest(c_ids, c_why) AS cand(id, why)
                      CROSS JOIN LATERAL (SELECT w.id, w.state, w AS w FROM durable.workflow_runs w
                                           WHERE w.id = cand.id FOR NO KEY UPDATE) w
                     WHERE NOT durable.run_state_is_terminal(w.state)
                    OFFSET 0) lk
            OFFSET 0) x
     WHERE x.nxt <> x.cur;
    IF r_ids IS NULL THEN
        RETURN NULL;
    END IF;
    -- failing or succeeding straight from pending is not in the table: go through running
    IF 'pending' = ANY (r_cur) THEN
        UPDATE durable.workflow_runs w SET state = 'running'
          FROM unnest(r_ids, r_cur, r_next) AS x(id, cur, nxt)
         WHERE w.id = x.id AND x.cur = 'pending' AND x.nxt IN ('succeeded', 'failed');
        INSERT INTO durable.transitions (run_id, from_state, to_state, reason)
        SELECT x.id, 'pending', 'running', x.why
          FROM unnest(r_ids, r_cur, r_next, r_why) AS x(id, cur, nxt, why)
         WHERE x.cur = 'pending' AND x.nxt IN ('succeeded', 'failed')
         ORDER BY x.id;
    END IF;
    UPDATE durable.workflow_runs w SET state = x.nxt
      FROM unnest(r_ids, r_next) AS x(id, nxt)
     WHERE w.id = x.id;
    INSERT INTO durable.transitions (run_id, from_state, to_state, reason)
    SELECT x.id,
           CASE WHEN x.cur = 'pending' AND x.nxt IN ('succeeded', 'failed') THEN 'running' ELSE x.cur END,
           x.nxt, x.why
      FROM unnest(r_ids, r_cur, r_next, r_why) AS x(id, cur, nxt, why)
     ORDER BY x.id;
    RETURN NULL;
END $$;
