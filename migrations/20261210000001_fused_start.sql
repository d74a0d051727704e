-- A start and the completion of the same lease in one flush: one write of
-- the step and one of its run.
--
-- The ledger hands a success right behind its start (a no-op job ends
-- before its start's flush is sent), so most flushes of a busy persistent
-- pool carry both of a lease's writes. They were two UPDATEs of the step
-- (leased -> running, running -> succeeded: two row versions of a wide row,
-- each with its index entries, its guard and its share of the transition
-- trigger) and, for a one-step run, two of the run (pending -> running at
-- the start; counters and the final state at the end, itself preceded by a
-- second `running` write when the run was still pending).
--
-- Now such a pair is one UPDATE of the step from leased straight to its
-- terminal state *through* running, and one UPDATE of the run from pending
-- straight to its terminal state through running. `via_state` names the
-- state passed through. The database still refuses every illegal
-- transition: the guards check both hops against the transition tables,
-- and the history still has one row per hop, in order (leased -> running,
-- reason ACCEPTED, then running -> succeeded). A fused write only ever ends
-- in a terminal state, and a terminal row never changes again, so a
-- `via_state` is never carried into a later write (CHECKed).

ALTER TABLE durable.step_runs ADD COLUMN via_state text;
ALTER TABLE durable.step_runs ADD CONSTRAINT step_runs_via_state_check
    CHECK (via_state IS NULL OR (via_state = 'running' AND state IN ('succeeded', 'terminal_failed', 'cancelled')));
COMMENT ON COLUMN durable.step_runs.via_state IS
    'internal: the state the last transition passed through (a start and its completion written as one), else NULL';

ALTER TABLE durable.workflow_runs ADD COLUMN via_state text;
ALTER TABLE durable.workflow_runs ADD CONSTRAINT workflow_runs_via_state_check
    CHECK (via_state IS NULL OR (via_state = 'running' AND state IN ('succeeded', 'failed', 'cancelled')));
COMMENT ON COLUMN durable.workflow_runs.via_state IS
    'internal: the state the last transition passed through (pending -> running -> final in one write), else NULL';

CREATE OR REPLACE FUNCTION durable.guard_step_update()
RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF durable.step_state_is_terminal(OLD.state) THEN
        RAISE EXCEPTION 'step % (%) is %: a terminal step never changes', OLD.name, OLD.id, OLD.state
            USING ERRCODE = 'P0D01';
    END IF;
    IF NEW.id <> OLD.id OR NEW.run_id <> OLD.run_id OR NEW.name <> OLD.name
       OR NEW.idempotency_key <> OLD.idempotency_key THEN
        RAISE EXCEPTION 'step % (%): identity columns never change', OLD.name, OLD.id
            USING ERRCODE = 'P0D02';
    END IF;
    IF NEW.state IS DISTINCT FROM OLD.state THEN
        -- a writer that did not say why must not inherit the previous reason
        IF NEW.transition_reason IS NOT DISTINCT FROM OLD.transition_reason
           AND NEW.transition_by IS NOT DISTINCT FROM OLD.transition_by THEN
            NEW.transition_reason := NULL;
            NEW.transition_by := NULL;
        END IF;
        IF NEW.via_state IS NOT NULL THEN
            -- two transitions in one write: each hop must be legal
            IF NOT EXISTS (SELECT 1 FROM durable.step_transition_rules r
                           WHERE r.from_state = OLD.state AND r.to_state = NEW.via_state)
               OR NOT EXISTS (SELECT 1 FROM durable.step_transition_rules r
                              WHERE r.from_state = NEW.via_state AND r.to_state = NEW.state) THEN
                RAISE EXCEPTION 'illegal step transition % -> % -> % for step % (%)', OLD.state, NEW.via_state,
                    NEW.state, OLD.name, OLD.id
                    USING ERRCODE = 'P0D03';
            END IF;
        ELSIF NOT EXISTS (SELECT 1 FROM durable.step_transition_rules r
                          WHERE r.from_state = OLD.state AND r.to_state = NEW.state) THEN
            RAISE EXCEPTION 'illegal step transition % -> % for step % (%)', OLD.state, NEW.state, OLD.name, OLD.id
                USING ERRCODE = 'P0D03';
        END IF;
        IF durable.step_state_is_terminal(NEW.state) THEN
            NEW.finished_at := now();
            NEW.lease_expires_at := NULL;
        END IF;
        NEW.prev_state := OLD.state;
    ELSE
        NEW.prev_state := NULL;
        NEW.via_state := NULL;
    END IF;
    NEW.updated_at := now();
    RETURN NEW;
END $$;

CREATE OR REPLACE FUNCTION durable.guard_run_update()
RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF durable.run_state_is_terminal(OLD.state) THEN
        RAISE EXCEPTION 'run % is %: a terminal run never changes', OLD.id, OLD.state
            USING ERRCODE = 'P0D01';
    END IF;
    IF NEW.state IS DISTINCT FROM OLD.state THEN
        IF NEW.via_state IS NOT NULL THEN
            -- two transitions in one write: each hop must be legal
            IF NOT EXISTS (SELECT 1 FROM durable.run_transition_rules r
                           WHERE r.from_state = OLD.state AND r.to_state = NEW.via_state)
               OR NOT EXISTS (SELECT 1 FROM durable.run_transition_rules r
                              WHERE r.from_state = NEW.via_state AND r.to_state = NEW.state) THEN
                RAISE EXCEPTION 'illegal run transition % -> % -> % for run %', OLD.state, NEW.via_state,
                    NEW.state, OLD.id
                    USING ERRCODE = 'P0D03';
            END IF;
        ELSIF NOT EXISTS (SELECT 1 FROM durable.run_transition_rules r
                          WHERE r.from_state = OLD.state AND r.to_state = NEW.state) THEN
            RAISE EXCEPTION 'illegal run transition % -> % for run %', OLD.state, NEW.state, OLD.id
                USING ERRCODE = 'P0D03';
        END IF;
        IF durable.run_state_is_terminal(NEW.state) THEN
            NEW.finished_at := now();
        END IF;
    ELSE
        NEW.via_state := NULL;
    END IF;
    NEW.updated_at := now();
    RETURN NEW;
END $$;

-- The history of the runs one statement moved: per run one row, or two when
-- it went from pending to its final state through running (the first hop's
-- reason is the step that started, when one did in this write). Runs whose
-- state did not change are skipped. (PL/pgSQL, not SQL: its plan is kept
-- for the session, a SQL function's statement is planned at every call.)
CREATE FUNCTION durable.record_run_hops(p_ids uuid[], p_cur text[], p_next text[], p_why text[],
                                        p_why_start text[])
RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO durable.transitions (run_id, from_state, to_state, reason)
    SELECT x.id, hop.from_state, hop.to_state, hop.reason
      FROM unnest(p_ids, p_cur, p_next, p_why, p_why_start) AS x(id, cur, nxt, why, why_start)
     CROSS JOIN LATERAL (SELECT x.cur = 'pending' AND x.nxt IN ('succeeded', 'failed') AS via) v
     CROSS JOIN LATERAL (VALUES (1, x.cur, CASE WHEN v.via THEN 'running' ELSE x.nxt END,
                                 CASE WHEN x.cur = 'pending' THEN coalesce(x.why_start, x.why) ELSE x.why END),
                                (2, 'running', x.nxt, x.why)) AS hop(k, from_state, to_state, reason)
     WHERE x.nxt <> x.cur AND (hop.k = 1 OR v.via)
     ORDER BY x.id, hop.k;
END $$;

-- The transition trigger: a fused row is two history rows (the first hop's
-- reason is the start's, ACCEPTED), and a pending run that a statement
-- finishes is one write through running.
CREATE OR REPLACE FUNCTION durable.on_step_transition()
RETURNS trigger
LANGUAGE plpgsql
AS $$
DECLARE
    n_changed bigint; c record; d durable.step_defs; run_key text; run_cancel boolean; run_failed int;
    f_wake boolean; f_terminal boolean; f_cascade boolean; f_running boolean;
    r_ids uuid[]; r_cur text[]; r_next text[]; r_why text[]; c_ids uuid[]; c_why text[];
    d_s integer[]; d_f integer[]; d_c integer[]; has_cascade boolean := false;
    r_why_start text[]; c_why_start text[];
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
           coalesce(bool_or(n.state IN ('succeeded', 'terminal_failed')), false),
           coalesce(bool_or(n.state = 'running'), false)
      INTO n_changed, f_wake, f_terminal, f_cascade, f_running
      FROM new_rows n
     WHERE n.prev_state IS NOT NULL;
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
         WHERE w.id = x.id;
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
                    OR (n.state = 'succeeded'
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
               via_state = CASE WHEN x.cur = 'pending' AND x.nxt IN ('succeeded', 'failed') THEN 'running' END
          FROM unnest(r_ids, r_cur, r_next, d_s, d_f, d_c) AS x(id, cur, nxt, ds, df, dc)
         WHERE w.id = x.id;
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
           via_state = CASE WHEN x.cur = 'pending' AND x.nxt IN ('succeeded', 'failed') THEN 'running' END
      FROM unnest(r_ids, r_cur, r_next) AS x(id, cur, nxt)
     WHERE w.id = x.id;
    PERFORM durable.record_run_hops(r_ids, r_cur, r_next, r_why, r_why_start);
    RETURN NULL;
END $$

;

-- The ledger's forms: a start's state change may be deferred to the
-- completion of the same lease in the same call (write_sets).
DROP FUNCTION durable.start_steps_set(text, uuid[], uuid[], integer[], bigint[], text[], text[], double precision[],
                                      timestamptz[], integer[], bigint[], text[], text[], double precision[], timestamptz[]);
DROP FUNCTION durable.start_steps(text, uuid[], uuid[], integer[], bigint[], text[], text[], double precision[],
                                  timestamptz[], integer[], bigint[], text[], text[], double precision[], timestamptz[]);
DROP FUNCTION durable.complete_steps_set(text, uuid[], uuid[], jsonb[], bigint[]);
DROP FUNCTION durable.complete_steps(text, uuid[], uuid[], jsonb[], bigint[]);

CREATE FUNCTION durable.start_steps_set(p_worker text, p_ids uuid[], p_tokens uuid[], p_pids integer[], p_sequences bigint[], p_kinds text[], p_messages text[], p_fractions double precision[], p_executor_at timestamp with time zone[], x_start integer[], x_sequences bigint[], x_kinds text[], x_messages text[], x_fractions double precision[], x_executor_at timestamp with time zone[], p_defer boolean[] DEFAULT NULL)
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
    UPDATE durable.step_runs s
       SET state = 'running', started_at = now(), executor_pid = p_pids[f.n],
           transition_reason = 'ACCEPTED', transition_by = p_worker
      FROM unnest(fn, fid, fstate) AS f(n, id, state)
     WHERE s.id = f.id AND f.state = 'leased' AND NOT coalesce(p_defer[f.n], false);
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

CREATE FUNCTION durable.start_steps(p_worker text, p_ids uuid[], p_tokens uuid[], p_pids integer[], p_sequences bigint[], p_kinds text[], p_messages text[], p_fractions double precision[], p_executor_at timestamp with time zone[], x_start integer[], x_sequences bigint[], x_kinds text[], x_messages text[], x_fractions double precision[], x_executor_at timestamp with time zone[], p_defer boolean[] DEFAULT NULL)
RETURNS TABLE(idx integer, status text, err_state text, err_message text)
LANGUAGE plpgsql AS $$
DECLARE
    i integer; fenced integer[]; done boolean := false;
    xs bigint[]; xk text[]; xm text[]; xf double precision[]; xa timestamptz[];
BEGIN
    -- as the form without extra events: the set form first, intent by
    -- intent if it is refused (or names a step twice) or for one intent
    -- whose state change is not deferred (p_defer: write_sets, whose
    -- completion of the same lease writes it); intent by intent, a start
    -- is always written whole
    IF (cardinality(p_ids) > 1 OR true = ANY (p_defer))
       AND (SELECT count(DISTINCT x) FROM unnest(p_ids) AS x) = cardinality(p_ids) THEN
        BEGIN
            fenced := durable.start_steps_set(p_worker, p_ids, p_tokens, p_pids, p_sequences, p_kinds,
                                              p_messages, p_fractions, p_executor_at, x_start, x_sequences,
                                              x_kinds, x_messages, x_fractions, x_executor_at, p_defer);
            done := true;
        EXCEPTION WHEN OTHERS THEN
            done := false;
        END;
    END IF;
    FOR i IN 1 .. coalesce(cardinality(p_ids), 0) LOOP
        idx := i; err_state := NULL; err_message := NULL;
        IF done THEN
            status := CASE WHEN i = ANY (fenced) THEN 'ok' ELSE 'lost' END;
        ELSE
            SELECT coalesce(array_agg(x.seq ORDER BY x.o), '{}'), coalesce(array_agg(x.kind ORDER BY x.o), '{}'),
                   coalesce(array_agg(x.msg ORDER BY x.o), '{}'), coalesce(array_agg(x.frac ORDER BY x.o), '{}'),
                   coalesce(array_agg(x.at ORDER BY x.o), '{}')
              INTO xs, xk, xm, xf, xa
              FROM unnest(x_start, x_sequences, x_kinds, x_messages, x_fractions, x_executor_at)
                   WITH ORDINALITY AS x(n, seq, kind, msg, frac, at, o)
             WHERE x.n = i;
            BEGIN
                IF durable.start_step(p_ids[i], p_tokens[i], p_worker, p_pids[i], p_sequences[i], p_kinds[i],
                                      p_messages[i], p_fractions[i], p_executor_at[i],
                                      xs, xk, xm, xf, xa) THEN
                    status := 'ok';
                ELSE
                    status := 'lost';
                END IF;
            EXCEPTION WHEN OTHERS THEN
                status := 'error'; err_state := SQLSTATE; err_message := SQLERRM;
            END;
        END IF;
        RETURN NEXT;
    END LOOP;
END $$;

CREATE FUNCTION durable.complete_steps_set(p_worker text, p_ids uuid[], p_tokens uuid[], p_outputs jsonb[], p_sequences bigint[], p_pids integer[] DEFAULT NULL)
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
     WHERE s.id = f.id;
    RETURN fn;
END $$;

CREATE FUNCTION durable.complete_steps(p_worker text, p_ids uuid[], p_tokens uuid[], p_outputs jsonb[], p_sequences bigint[], p_pids integer[] DEFAULT NULL)
RETURNS TABLE(idx integer, status text, err_state text, err_message text)
LANGUAGE plpgsql AS $$
DECLARE
    i integer; fenced integer[]; done boolean := false;
BEGIN
    -- one intent: the intent-by-intent form is the same statements without
    -- the set form's arrays (and without a second subtransaction), except
    -- for a completion whose start is in the same call (p_pids given):
    -- the set form writes both as one
    IF (cardinality(p_ids) > 1 OR p_pids IS NOT NULL)
       AND (SELECT count(DISTINCT x) FROM unnest(p_ids) AS x) = cardinality(p_ids) THEN
        BEGIN
            fenced := durable.complete_steps_set(p_worker, p_ids, p_tokens, p_outputs, p_sequences, p_pids);
            done := true;
        EXCEPTION WHEN OTHERS THEN
            done := false;
        END;
    END IF;
    FOR i IN 1 .. coalesce(cardinality(p_ids), 0) LOOP
        idx := i; err_state := NULL; err_message := NULL;
        IF done THEN
            status := CASE WHEN i = ANY (fenced) THEN 'ok' ELSE 'lost' END;
        ELSE
            BEGIN
                IF durable.complete_step(p_ids[i], p_tokens[i], p_worker, p_outputs[i], p_sequences[i],
                                         '{}'::text[], '{}'::text[], '{}'::text[], '{}'::bytea[], '[]'::jsonb) IS NULL THEN
                    status := 'lost';
                ELSE
                    status := 'ok';
                END IF;
            EXCEPTION WHEN OTHERS THEN
                status := 'error'; err_state := SQLSTATE; err_message := SQLERRM;
            END;
        END IF;
        RETURN NEXT;
    END LOOP;
END $$;

CREATE OR REPLACE FUNCTION durable.write_sets(p_worker text, p_lock_steps uuid[], s_ids uuid[], s_tokens uuid[], s_pids integer[], s_sequences bigint[], s_kinds text[], s_messages text[], s_fractions double precision[], s_executor_at timestamp with time zone[], x_start integer[], x_sequences bigint[], x_kinds text[], x_messages text[], x_fractions double precision[], x_executor_at timestamp with time zone[], e_ids uuid[], e_tokens uuid[], e_event_lease integer[], e_sequences bigint[], e_kinds text[], e_messages text[], e_fractions double precision[], e_executor_at timestamp with time zone[], c_ids uuid[], c_tokens uuid[], c_outputs jsonb[], c_sequences bigint[])
RETURNS TABLE(part text, idx integer, status text, err_state text, err_message text)
LANGUAGE plpgsql AS $$
DECLARE
    c_start integer[]; s_defer boolean[]; c_pids integer[]; fix integer[] := '{}'; rc record;
BEGIN
    IF cardinality(p_lock_steps) > 0 THEN
        PERFORM durable.lock_runs_of(p_lock_steps);
    END IF;
    -- A lease whose start and completion are both in this call: the start
    -- is fenced and its events written as before, but its state change is
    -- deferred to the completion, which writes leased -> running ->
    -- succeeded as one row version (c_start[j]: the start of completion j).
    IF cardinality(s_ids) > 0 AND cardinality(c_ids) > 0 THEN
        SELECT array_agg(m.i ORDER BY c.j) INTO c_start
          FROM unnest(c_ids, c_tokens) WITH ORDINALITY AS c(id, token, j)
          LEFT JOIN (SELECT s.id, s.token, min(s.i)::integer AS i
                       FROM unnest(s_ids, s_tokens) WITH ORDINALITY AS s(id, token, i)
                      GROUP BY s.id, s.token) m ON m.id = c.id AND m.token = c.token;
        IF EXISTS (SELECT 1 FROM unnest(c_start) AS x WHERE x IS NOT NULL) THEN
            SELECT array_agg(s.i = ANY (c_start) ORDER BY s.i) INTO s_defer
              FROM generate_subscripts(s_ids, 1) AS s(i);
            SELECT array_agg(s_pids[u.i] ORDER BY u.j) INTO c_pids
              FROM unnest(c_start) WITH ORDINALITY AS u(i, j);
        ELSE
            c_start := NULL;
        END IF;
    END IF;
    IF cardinality(s_ids) > 0 THEN
        RETURN QUERY SELECT 'start', r.idx, r.status, r.err_state, r.err_message
          FROM durable.start_steps(p_worker, s_ids, s_tokens, s_pids, s_sequences, s_kinds, s_messages,
                                   s_fractions, s_executor_at, x_start, x_sequences, x_kinds, x_messages,
                                   x_fractions, x_executor_at, s_defer) r;
    END IF;
    IF cardinality(e_ids) > 0 THEN
        RETURN QUERY SELECT 'event', r.idx, r.status, r.err_state, r.err_message
          FROM durable.record_plain_events(e_ids, e_tokens, e_event_lease, e_sequences, e_kinds,
                                           e_messages, e_fractions, e_executor_at) r;
    END IF;
    IF cardinality(c_ids) > 0 THEN
        FOR rc IN SELECT * FROM durable.complete_steps(p_worker, c_ids, c_tokens, c_outputs, c_sequences, c_pids) LOOP
            part := 'complete'; idx := rc.idx; status := rc.status;
            err_state := rc.err_state; err_message := rc.err_message;
            RETURN NEXT;
            IF c_start[rc.idx] IS NOT NULL AND rc.status <> 'ok' THEN
                fix := fix || c_start[rc.idx];
            END IF;
        END LOOP;
        -- a deferred start whose completion was not written (refused, or
        -- lost): the start itself still is, as it was answered
        IF cardinality(fix) > 0 THEN
            UPDATE durable.step_runs s
               SET state = 'running', started_at = now(), executor_pid = s_pids[f.i],
                   transition_reason = 'ACCEPTED', transition_by = p_worker
              FROM unnest(fix) AS f(i)
             WHERE s.id = s_ids[f.i] AND s.lease_token = s_tokens[f.i] AND s.state = 'leased';
        END IF;
    END IF;
END $$;
