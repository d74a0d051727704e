-- The ledger's fenced completions and the runs' bookkeeping after a step
-- transition update the rows they name by key: each joined its arrays
-- (~10 rows to the planner) to step_runs or workflow_runs, and with a few
-- hundred rows in the table the planner hashed a scan of all of it for the
-- join instead of probing the keys, and kept that generic plan (the
-- runtime's sessions plan once) until the next ANALYZE: every flush read
-- every step and every run, dead versions included (a batch of 2
-- completions read 404 step rows among 400 runs; tests/tests/bounded_reads.rs).
-- Each such UPDATE now also says which keys it updates (`id = ANY (...)`),
-- which the planner answers with probes of the primary key (for
-- workflow_runs see the end of this file). The functions are otherwise as they were (their latest
-- definitions: on_step_transition in 20261230000001, complete_steps_set in
-- 20261210000001, complete_fused_set in 20261231000002).

CREATE OR REPLACE FUNCTION durable.complete_steps_set(p_worker text, p_ids uuid[], p_tokens uuid[], p_outputs jsonb[], p_sequences bigint[], p_pids integer[] DEFAULT NULL::integer[])
 RETURNS integer[]
 LANGUAGE plpgsql
AS $function$
DECLARE
    fn integer[]; fid uuid[]; fstate text[]; fatt integer[];
BEGIN
    SELECT f.n, f.id, f.state, f.attempt INTO fn, fid, fstate, fatt
      FROM durable.lock_batch(p_ids, p_tokens) AS f;
    IF fn IS NULL THEN
        RETURN '{}';
    END IF;
    INSERT INTO durable.step_events (step_run_id, attempt, sequence, kind, message)
    SELECT f.id, f.attempt, p_sequences[f.n], 'succeeded', ''
      FROM unnest(fn, fid, fatt) AS f(n, id, attempt)
     WHERE p_sequences[f.n] IS NOT NULL
     ORDER BY f.id
    ON CONFLICT DO NOTHING;
    -- a lease still leased: its start is in the same call (write_sets
    -- deferred its state change, p_pids[n] is its executor) or never
    -- committed (the database was away). The lease is valid, so the result
    -- is kept, and the step goes through running in this one write.
    UPDATE durable.step_runs s
       SET state = 'succeeded', output = p_outputs[f.n], error_code = NULL, error_message = NULL,
           error_retryable = NULL, error_details = NULL,
           via_state = CASE WHEN f.state = 'leased' THEN 'running' END,
           started_at = CASE WHEN f.state = 'leased' THEN now() ELSE s.started_at END,
           executor_pid = CASE WHEN f.state = 'leased' THEN coalesce(p_pids[f.n], s.executor_pid)
                               ELSE s.executor_pid END,
           transition_reason = 'SUCCEEDED', transition_by = p_worker
      FROM unnest(fn, fid, fstate) AS f(n, id, state)
     WHERE s.id = f.id AND s.id = ANY (fid);
    RETURN fn;
END $function$

;

CREATE OR REPLACE FUNCTION durable.complete_fused_set(p_worker text, p_ids uuid[], p_tokens uuid[], p_outputs jsonb[], p_sequences bigint[], p_pids integer[], p_start integer[], s_sequences bigint[], s_kinds text[], s_messages text[], s_fractions double precision[], s_executor_at timestamp with time zone[], x_start integer[], x_sequences bigint[], x_kinds text[], x_messages text[], x_fractions double precision[], x_executor_at timestamp with time zone[])
 RETURNS integer[]
 LANGUAGE plpgsql
AS $function$
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
     WHERE s.id = f.id AND s.id = ANY (fid);
    RETURN fn;
END $function$

;

CREATE OR REPLACE FUNCTION durable.on_step_transition()
 RETURNS trigger
 LANGUAGE plpgsql
AS $function$
DECLARE
    ended_leases uuid[];
    n_changed bigint; c record; ready_defs durable.step_defs[];
    dep_runs uuid[]; dep_names text[]; dep_counts integer[];
    f_wake boolean; f_terminal boolean; f_cascade boolean; f_running boolean;
    r_ids uuid[]; r_cur text[]; r_next text[]; r_why text[]; c_ids uuid[]; c_why text[];
    d_s integer[]; d_f integer[]; d_c integer[]; has_cascade boolean := false;
    r_why_start text[]; c_why_start text[]; never_defs durable.step_defs[];
BEGIN
    -- UPDATE: only rows whose state changed count (a heartbeat, a flag or a
    -- checkpoint changes none and ends here). The history rows are written
    -- and, in the same statement, what the changes call for: a wake-up, the
    -- counters, the cascades, the runs' decision. Each of those is a
    -- statement of its own, run only when some row needs it: a lease needs
    -- none, a start only the runs' decision, a completion no wake-up.
    -- A fused row (via_state set: a start and its completion in one write)
    -- is two history rows, its start's first (the reason a start writes,
    -- ACCEPTED). What the statement calls for is judged on where each row
    -- ended: a fused row is a terminal row, not a start.
    WITH h AS (
        INSERT INTO durable.transitions (run_id, step_run_id, from_state, to_state, attempt, worker, reason)
        SELECT n.run_id, n.id, hop.from_state, hop.to_state, n.attempt, n.transition_by, hop.reason
          FROM new_rows n
         CROSS JOIN LATERAL (VALUES (1, n.prev_state, coalesce(n.via_state, n.state),
                                     CASE WHEN n.via_state IS NULL THEN n.transition_reason ELSE 'ACCEPTED' END),
                                    (2, n.via_state, n.state, n.transition_reason))
                            AS hop(k, from_state, to_state, reason)
         WHERE n.prev_state IS NOT NULL AND (hop.k = 1 OR n.via_state IS NOT NULL)
         ORDER BY n.id, hop.k
        RETURNING 1
    )
    SELECT (SELECT count(*) FROM h),
           coalesce(bool_or(n.state IN ('pending', 'retryable_failed')), false),
           coalesce(bool_or(durable.step_state_is_terminal(n.state)), false),
           coalesce(bool_or(n.state IN ('succeeded', 'terminal_failed', 'cancelled')), false),
           coalesce(bool_or(n.state = 'running'), false)
      INTO n_changed, f_wake, f_terminal, f_cascade, f_running
      FROM new_rows n
     WHERE n.prev_state IS NOT NULL;
    IF n_changed = 0 THEN
        RETURN NULL;
    END IF;

    -- a lease ends with its step's move out of leased/running: its clock
    -- row goes (a probe per such row; a step shorter than a heartbeat
    -- interval never had one)
    IF f_wake OR f_terminal THEN
        ended_leases := ARRAY(SELECT n.id FROM new_rows n
                               WHERE n.prev_state IN ('leased', 'running')
                                 AND n.state NOT IN ('leased', 'running'));
        IF cardinality(ended_leases) > 0 THEN
            PERFORM durable.end_lease_clocks(ended_leases);
        END IF;
    END IF;
    IF f_wake THEN
        PERFORM pg_notify('durable_steps', k.executor_kind)
           FROM (SELECT DISTINCT n.executor_kind FROM new_rows n
                  WHERE n.prev_state IS NOT NULL AND n.state IN ('pending', 'retryable_failed')) k;
    END IF;
    IF NOT (f_terminal OR f_running) THEN
        RETURN NULL;
    END IF;

    -- A start alone (no terminal row in the statement): the runs still
    -- pending go running, and no other run changes. A running step is an
    -- open step its run counts, so the counters' decision is 'running' for
    -- a pending run and "as it is" for every other: nothing to compute, one
    -- locking probe per pending run, in id order.
    IF f_running AND NOT f_terminal THEN
        SELECT array_agg(x.run_id ORDER BY x.run_id), array_agg(x.why ORDER BY x.run_id)
          INTO r_ids, r_why
          FROM (SELECT c2.run_id, c2.why
                  FROM (SELECT DISTINCT ON (n.run_id) n.run_id, 'step ' || n.name || ' ' || n.state AS why
                          FROM new_rows n
                         WHERE n.prev_state IS NOT NULL AND n.state = 'running'
                           AND (SELECT w2.state FROM durable.workflow_runs w2 WHERE w2.id = n.run_id) = 'pending'
                         ORDER BY n.run_id, n.id) c2
                 ORDER BY c2.run_id
                OFFSET 0) x
         CROSS JOIN LATERAL (SELECT w.id FROM durable.workflow_runs w
                              WHERE w.id = x.run_id AND w.state = 'pending' FOR NO KEY UPDATE) w;
        IF r_ids IS NULL THEN
            RETURN NULL;
        END IF;
        UPDATE durable.workflow_runs w SET state = 'running'
          FROM unnest(r_ids) AS x(id)
         WHERE w.id = x.id AND w.id = ANY (r_ids);
        INSERT INTO durable.transitions (run_id, from_state, to_state, reason)
        SELECT x.id, 'pending', 'running', x.why
          FROM unnest(r_ids, r_why) AS x(id, why)
         ORDER BY x.id;
        RETURN NULL;
    END IF;

    -- Terminal steps that cascade to nothing (no dependents, no failure: a
    -- leaf's success, a cancellation): the counters and the decision in one
    -- write of each run. The runs are locked in id order, the decision is
    -- made on the counters as they will be, and one UPDATE writes both.
    -- Before, the counters and the state were two writes of the run (two
    -- row versions) and two statements more. A statement with a cascade,
    -- or with starts as well, takes the general path below.
    IF f_cascade THEN
        has_cascade := EXISTS (
            SELECT 1 FROM new_rows n
             WHERE n.prev_state IS NOT NULL
               AND (n.state = 'terminal_failed'
                    OR (n.state IN ('succeeded', 'cancelled')
                        -- a probe per row (as a semi-join the planner may
                        -- hash a scan of every run's dependents)
                        AND coalesce((SELECT true FROM durable.step_dependents e
                                       WHERE e.run_id = n.run_id AND e.dependency = n.name
                                       LIMIT 1), false))));
    END IF;
    IF NOT has_cascade AND NOT f_running THEN
        SELECT array_agg(y.id ORDER BY y.id), array_agg(y.cur ORDER BY y.id), array_agg(y.nxt ORDER BY y.id),
               array_agg(y.why ORDER BY y.id), array_agg(y.ds ORDER BY y.id), array_agg(y.df ORDER BY y.id),
               array_agg(y.dc ORDER BY y.id), array_agg(y.why_start ORDER BY y.id)
          INTO r_ids, r_cur, r_next, r_why, d_s, d_f, d_c, r_why_start
          FROM (SELECT lk.id, lk.cur, lk.why, lk.ds, lk.df, lk.dc, lk.why_start,
                       CASE WHEN durable.run_state_is_terminal(lk.cur) THEN lk.cur
                            ELSE durable.run_state_from_counts(lk.id, lk.cur, lk.total, lk.succ + lk.ds,
                                                               lk.failed + lk.df, lk.canc + lk.dc, lk.waiting)
                       END AS nxt
                  FROM (SELECT w.id, w.state AS cur, w.steps_total AS total, w.steps_succeeded AS succ,
                               w.steps_failed AS failed, w.steps_cancelled AS canc, w.defs_waiting AS waiting,
                               x.why, x.ds, x.df, x.dc, x.why_start
                          FROM (SELECT n.run_id,
                                       count(*) FILTER (WHERE n.state = 'succeeded')::int AS ds,
                                       count(*) FILTER (WHERE n.state = 'terminal_failed')::int AS df,
                                       count(*) FILTER (WHERE n.state = 'cancelled')::int AS dc,
                                       (array_agg('step ' || n.name || ' ' || n.state ORDER BY n.id))[1] AS why,
                                       (array_agg('step ' || n.name || ' running' ORDER BY n.id)
                                          FILTER (WHERE n.via_state = 'running'))[1] AS why_start
                                  FROM new_rows n
                                 WHERE n.prev_state IS NOT NULL AND durable.step_state_is_terminal(n.state)
                                 GROUP BY n.run_id
                                 ORDER BY n.run_id
                                OFFSET 0) x
                         CROSS JOIN LATERAL (SELECT w.id, w.state, w.steps_total, w.steps_succeeded,
                                                    w.steps_failed, w.steps_cancelled, w.defs_waiting
                                               FROM durable.workflow_runs w
                                              WHERE w.id = x.run_id FOR NO KEY UPDATE) w
                        OFFSET 0) lk
                OFFSET 0) y;
        IF r_ids IS NULL THEN
            RETURN NULL;
        END IF;
        -- failing or succeeding straight from pending is not in the table:
        -- such a run goes through running, in the same write
        UPDATE durable.workflow_runs w
           SET steps_succeeded = w.steps_succeeded + x.ds, steps_failed = w.steps_failed + x.df,
               steps_cancelled = w.steps_cancelled + x.dc, state = x.nxt,
               via_state = CASE WHEN durable.run_passes_running(x.cur, x.nxt, x.why_start) THEN 'running' END
          FROM unnest(r_ids, r_cur, r_next, d_s, d_f, d_c, r_why_start) AS x(id, cur, nxt, ds, df, dc, why_start)
         WHERE w.id = x.id AND w.id = ANY (r_ids);
        PERFORM durable.record_run_hops(r_ids, r_cur, r_next, r_why, r_why_start);
        RETURN NULL;
    END IF;

    -- The general path: counters, cascades, then the runs' decision.
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

    -- cascades: the successes' dependents, then the terminal failures
    IF f_cascade THEN
        -- the successes' dependents have as many dependencies fewer to wait
        -- for as their dependencies that succeeded in this statement (a probe
        -- of the reverse edges per row: as a join the planner may hash a scan
        -- of every run's); all in one UPDATE, under the runs' locks (taken
        -- above), in (run, name) order
        SELECT array_agg(x.run_id ORDER BY x.run_id, x.dependent),
               array_agg(x.dependent ORDER BY x.run_id, x.dependent),
               array_agg(x.k ORDER BY x.run_id, x.dependent)
          INTO dep_runs, dep_names, dep_counts
          FROM (SELECT n.run_id, e.dependent, count(*)::int AS k
                  FROM new_rows n
                 CROSS JOIN LATERAL (SELECT e.dependent FROM durable.step_dependents e
                                      WHERE e.run_id = n.run_id AND e.dependency = n.name) e
                 WHERE n.prev_state IS NOT NULL AND n.state = 'succeeded'
                 GROUP BY n.run_id, e.dependent) x;
        IF dep_runs IS NOT NULL THEN
            -- those that reach 0 are created in one INSERT (their insert
            -- trigger counts them on their runs); as before, no new step in a
            -- run that failed (its counters above count this statement's
            -- failures) or whose cancel was requested, and a definition
            -- cancel_run already created stays as it is
            WITH ready AS (
                UPDATE durable.step_defs sd SET deps_remaining = sd.deps_remaining - x.k
                  FROM unnest(dep_runs, dep_names, dep_counts) AS x(run_id, name, k)
                 WHERE sd.run_id = x.run_id AND sd.name = x.name
             RETURNING sd
            )
            SELECT array_agg(r.sd ORDER BY (r.sd).run_id, (r.sd).position) INTO ready_defs
              FROM ready r
             WHERE (r.sd).deps_remaining = 0
               AND (SELECT NOT w.cancel_requested AND w.steps_failed = 0
                      FROM durable.workflow_runs w WHERE w.id = (r.sd).run_id)
               AND NOT EXISTS (SELECT 1 FROM durable.step_runs s
                                WHERE s.run_id = (r.sd).run_id AND s.name = (r.sd).name);
            IF ready_defs IS NOT NULL THEN
                PERFORM durable.create_steps(ready_defs);
            END IF;
        END IF;
        -- a cancelled step's dependents, and theirs, can never run: the
        -- definitions still waiting are created and cancelled at once, so
        -- that the run lists every step with its state (as cancel_run does
        -- for a whole run); runs in id order
        FOR c IN
            SELECT n.run_id, array_agg(n.name) AS names FROM new_rows n
             WHERE n.prev_state IS NOT NULL AND n.state = 'cancelled'
             GROUP BY n.run_id
             ORDER BY n.run_id
        LOOP
            WITH RECURSIVE dead(name) AS (
                SELECT e.dependent FROM durable.step_dependents e
                 WHERE e.run_id = c.run_id AND e.dependency = ANY (c.names)
                UNION
                SELECT e.dependent FROM dead
                  JOIN durable.step_dependents e ON e.run_id = c.run_id AND e.dependency = dead.name
            )
            SELECT array_agg(sd ORDER BY sd.position) INTO never_defs
              FROM durable.step_defs sd
             WHERE sd.run_id = c.run_id AND sd.name IN (SELECT dead.name FROM dead)
               AND NOT EXISTS (SELECT 1 FROM durable.step_runs s
                                WHERE s.run_id = c.run_id AND s.name = sd.name);
            IF never_defs IS NOT NULL THEN
                PERFORM durable.create_steps(never_defs, NULL, 'DEPENDENCY_NOT_SUCCEEDED');
                UPDATE durable.step_runs s
                   SET state = 'cancelled', transition_reason = 'DEPENDENCY_CANCELLED', transition_by = NULL
                 WHERE s.run_id = c.run_id
                   AND s.name = ANY (ARRAY(SELECT (d).name FROM unnest(never_defs) AS d))
                   AND s.state = 'pending';
            END IF;
        END LOOP;
        -- the first failure ends the run: the definitions still waiting are
        -- created (they will never run), then open siblings are locked in id
        -- order, pending ones cancelled at once, leased and running ones get
        -- a durable cancel request (failures in id order)
        FOR c IN
            SELECT n.id, n.run_id FROM new_rows n
             WHERE n.prev_state IS NOT NULL AND n.state = 'terminal_failed'
             ORDER BY n.id
        LOOP
            SELECT array_agg(sd ORDER BY sd.position) INTO never_defs
              FROM durable.step_defs sd
             WHERE sd.run_id = c.run_id
               AND NOT EXISTS (SELECT 1 FROM durable.step_runs s
                                WHERE s.run_id = c.run_id AND s.name = sd.name);
            IF never_defs IS NOT NULL THEN
                PERFORM durable.create_steps(never_defs, NULL, 'DEPENDENCY_NOT_SUCCEEDED');
            END IF;
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
    SELECT array_agg(c2.run_id ORDER BY c2.run_id), array_agg(c2.why ORDER BY c2.run_id),
           array_agg(c2.why_start ORDER BY c2.run_id)
      INTO c_ids, c_why, c_why_start
      FROM (SELECT n.run_id, (array_agg('step ' || n.name || ' ' || n.state ORDER BY n.id))[1] AS why,
                   (array_agg('step ' || n.name || ' running' ORDER BY n.id)
                      FILTER (WHERE n.via_state = 'running'))[1] AS why_start
              FROM new_rows n
             WHERE n.prev_state IS NOT NULL
               AND (durable.step_state_is_terminal(n.state)
                    OR (n.state = 'running'
                        AND (SELECT w2.state FROM durable.workflow_runs w2 WHERE w2.id = n.run_id) = 'pending'))
             GROUP BY n.run_id) c2;
    IF c_ids IS NULL THEN
        RETURN NULL;
    END IF;
    SELECT array_agg(x.id ORDER BY x.id), array_agg(x.cur ORDER BY x.id),
           array_agg(x.nxt ORDER BY x.id), array_agg(x.why ORDER BY x.id), array_agg(x.why_start ORDER BY x.id)
      INTO r_ids, r_cur, r_next, r_why, r_why_start
      FROM (SELECT lk.id, lk.cur, durable.run_state_from_counters(lk.w) AS nxt, lk.why, lk.why_start
              FROM (SELECT w.id, w.state AS cur, w.w, cand.why, cand.why_start
                      FROM unnest(c_ids, c_why, c_why_start) AS cand(id, why, why_start)
                      CROSS JOIN LATERAL (SELECT w.id, w.state, w AS w FROM durable.workflow_runs w
                                           WHERE w.id = cand.id FOR NO KEY UPDATE) w
                     WHERE NOT durable.run_state_is_terminal(w.state)
                    OFFSET 0) lk
            OFFSET 0) x
     WHERE x.nxt <> x.cur;
    IF r_ids IS NULL THEN
        RETURN NULL;
    END IF;
    -- failing or succeeding straight from pending is not in the table:
    -- such a run goes through running, in the same write
    UPDATE durable.workflow_runs w
       SET state = x.nxt,
           via_state = CASE WHEN durable.run_passes_running(x.cur, x.nxt, x.why_start) THEN 'running' END
      FROM unnest(r_ids, r_cur, r_next, r_why_start) AS x(id, cur, nxt, why_start)
     WHERE w.id = x.id AND w.id = ANY (r_ids);
    PERFORM durable.record_run_hops(r_ids, r_cur, r_next, r_why, r_why_start);
    RETURN NULL;
END $function$

;

-- workflow_runs rows are narrow: with a few hundred runs the planner still
-- prefers a scan of its few pages, filtered by the keys, to probing them
-- (the scan alone 0.15-0.25 ms in a statement of 2 runs, auto_explain). The bookkeeping
-- names its runs by key in every statement; it is planned with sequential
-- scans off, as end_lease_clocks and renew_leases are. A statement with no
-- key to probe would still scan.
ALTER FUNCTION durable.on_step_transition() SET enable_seqscan = off;
