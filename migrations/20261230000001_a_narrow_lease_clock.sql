-- The lease clock: a live lease's expiry lives in a narrow table of its own.
--
-- A heartbeat renews every lease its worker holds in one statement. On
-- `step_runs` that statement rewrote each whole 400-byte row (heap tuple,
-- check constraints, the HOT test over seven indexes, the transition
-- trigger's capture): 6-8 ms for 1,000 leases on two shared cores, against
-- ~2 ms for the same renewal of (id, token, expiry) rows (issue 7 (g)).
--
-- The rule: a live step's lease expires at its `lease_clock` row's
-- `expires_at` when a row with the step's current token is there, else at
-- `step_runs.lease_expires_at` (which the lease sets; `durable.lease_expiry`
-- reads the rule). A lease gets its row at its first renewal (heartbeat or
-- checkpoint), so a step shorter than a heartbeat interval never writes one.
-- The row goes when its step leaves `leased`/`running` (the transition
-- trigger), when the step's token or expiry is set on the row by hand (then
-- the row's own value counts again), and with the step.
CREATE TABLE durable.lease_clock (
    step_run_id uuid PRIMARY KEY REFERENCES durable.step_runs (id) ON DELETE CASCADE,
    lease_token uuid NOT NULL,
    expires_at  timestamptz NOT NULL
) WITH (fillfactor = 50, autovacuum_vacuum_scale_factor = 0.02);

COMMENT ON TABLE durable.lease_clock IS
    'internal: the renewed expiry of a live lease (heartbeats and checkpoints write here, not to step_runs); see durable.lease_expiry';

-- leases live while this migrates keep their expiry
INSERT INTO durable.lease_clock (step_run_id, lease_token, expires_at)
SELECT s.id, s.lease_token, s.lease_expires_at
  FROM durable.step_runs s
 WHERE s.state IN ('leased', 'running') AND s.lease_token IS NOT NULL AND s.lease_expires_at IS NOT NULL;

-- When a live step's lease expires (NULL: the step holds no lease).
CREATE FUNCTION durable.lease_expiry(p_step uuid) RETURNS timestamptz
 LANGUAGE sql STABLE
AS $$
    SELECT CASE WHEN s.state IN ('leased', 'running') THEN
                coalesce((SELECT c.expires_at FROM durable.lease_clock c
                           WHERE c.step_run_id = s.id AND c.lease_token = s.lease_token),
                         s.lease_expires_at)
           END
      FROM durable.step_runs s WHERE s.id = p_step
$$;

-- An expiry or a token set on the step row by hand (a test, an operator, a
-- repair) is the lease's again: the clock's row goes. No runtime write
-- matches: a lease changes the token with the state, a terminal write clears
-- the expiry, and renewals write the clock.
CREATE FUNCTION durable.lease_set_on_the_row() RETURNS trigger
 LANGUAGE plpgsql
AS $$
BEGIN
    DELETE FROM durable.lease_clock WHERE step_run_id = NEW.id;
    RETURN NULL;
END $$;

CREATE TRIGGER step_runs_lease_set_on_the_row
    AFTER UPDATE OF lease_expires_at, lease_token ON durable.step_runs
    FOR EACH ROW
    WHEN ((NEW.lease_expires_at IS NOT NULL AND NEW.lease_expires_at IS DISTINCT FROM OLD.lease_expires_at
           AND NEW.lease_token IS NOT DISTINCT FROM OLD.lease_token)
          OR (NEW.lease_token IS DISTINCT FROM OLD.lease_token AND NEW.state IS NOT DISTINCT FROM OLD.state))
    EXECUTE FUNCTION durable.lease_set_on_the_row();

DROP FUNCTION durable.renew_leases(uuid, uuid[], uuid[], double precision, text);

-- One statement per heartbeat: renews the worker's leases on the clock,
-- reports which were cancel-requested (the step's flag or its run's), which
-- are lost and which are busy (a writer holds the clock's row: a checkpoint
-- renewing it, or a terminal write removing it), and stamps the worker.
CREATE FUNCTION durable.renew_leases(p_worker uuid, p_ids uuid[], p_tokens uuid[], p_ttl_ms double precision, p_wait text)
 RETURNS TABLE(step_run_id uuid, outcome text, valid_ms double precision)
 LANGUAGE plpgsql
AS $function$
DECLARE
    caller_timeout text := current_setting('lock_timeout');
    expires timestamptz := now() + make_interval(secs => p_ttl_ms / 1000.0);
    lost_ids uuid[];
    busy_ids uuid[] := '{}';
    busy_ms double precision[] := '{}';
    cancel_ids uuid[];
    n_renewed bigint;
    held boolean := false;
BEGIN
    UPDATE durable.workers SET last_heartbeat_at = now() WHERE id = p_worker;
    BEGIN
        PERFORM set_config('lock_timeout', p_wait, true);
        -- each clock row is fenced by its own token; an expired lease is
        -- never renewed (the reclaim may be moving it on). `= ANY` walks
        -- the primary key for just these rows (as a join alone the planner
        -- may scan every worker's leases). From 640 leases reading the clock
        -- whole and hashing them is cheaper than as many probes: that
        -- statement is planned (at its first call, and again after an
        -- ANALYZE) with sequential scans allowed
        IF cardinality(p_ids) < 640 THEN
            UPDATE durable.lease_clock c SET expires_at = expires
              FROM unnest(p_ids, p_tokens) AS h(id, token)
             WHERE c.step_run_id = ANY (p_ids) AND c.step_run_id = h.id AND c.lease_token = h.token
               AND c.expires_at > now();
            GET DIAGNOSTICS n_renewed = ROW_COUNT;
        ELSE
            PERFORM set_config('enable_seqscan', 'on', true);
            UPDATE durable.lease_clock c SET expires_at = expires
              FROM unnest(p_ids, p_tokens) AS h(id, token)
             WHERE c.step_run_id = h.id AND c.lease_token = h.token AND c.expires_at > now();
            GET DIAGNOSTICS n_renewed = ROW_COUNT;
            PERFORM set_config('enable_seqscan', 'off', true);
        END IF;
    EXCEPTION WHEN lock_not_available THEN
        -- a writer held a clock row longer than p_wait: the renewals are
        -- undone and done again, skipping the rows that are held
        held := true;
    END;
    PERFORM set_config('lock_timeout', caller_timeout, true);
    IF held THEN
        UPDATE durable.lease_clock c SET expires_at = expires
          FROM (SELECT c2.step_run_id FROM durable.lease_clock c2
                  JOIN unnest(p_ids, p_tokens) AS h(id, token)
                    ON c2.step_run_id = h.id AND c2.lease_token = h.token
                 WHERE c2.step_run_id = ANY (p_ids) AND c2.expires_at > now()
                 ORDER BY c2.step_run_id
                   FOR UPDATE OF c2 SKIP LOCKED) l
         WHERE c.step_run_id = l.step_run_id;
        GET DIAGNOSTICS n_renewed = ROW_COUNT;
    END IF;
    IF n_renewed < cardinality(p_ids) THEN
        -- the leases not renewed above: first renewals (no clock row yet),
        -- held rows, lost leases. A first renewal is fenced by the step row
        -- as last committed (live, this token, not expired) and skips a row
        -- a writer holds (its write may end the lease: the next heartbeat
        -- sees how); the rest are busy (held, still valid) or lost.
        WITH h AS (
            SELECT * FROM unnest(p_ids, p_tokens) AS h(id, token)
        ), missing AS (
            SELECT h.id, h.token FROM h
             WHERE NOT EXISTS (SELECT 1 FROM durable.lease_clock c
                                WHERE c.step_run_id = h.id AND c.lease_token = h.token
                                  AND c.expires_at = expires)
        ), first AS (
            INSERT INTO durable.lease_clock (step_run_id, lease_token, expires_at)
            SELECT s.id, s.lease_token, expires
              FROM durable.step_runs s JOIN missing m ON m.id = s.id AND m.token = s.lease_token
             WHERE s.id = ANY (p_ids) AND s.state IN ('leased', 'running') AND s.lease_expires_at > now()
             ORDER BY s.id
               FOR SHARE OF s SKIP LOCKED
            -- (a row already there, of an expired lease or held by a
            -- writer, is left as it is)
            ON CONFLICT DO NOTHING
            RETURNING lease_clock.step_run_id
        ), judged AS (
            -- a lease neither renewed nor given its first row: busy while
            -- its last committed expiry holds, else lost
            SELECT m.id, held_lease.expiry
              FROM missing m
              LEFT JOIN LATERAL (
                    SELECT coalesce((SELECT c.expires_at FROM durable.lease_clock c
                                      WHERE c.step_run_id = s.id AND c.lease_token = s.lease_token),
                                    s.lease_expires_at) AS expiry
                      FROM durable.step_runs s
                     WHERE s.id = m.id AND s.lease_token = m.token
                       AND s.state IN ('leased', 'running')) held_lease ON true
             WHERE NOT EXISTS (SELECT 1 FROM first f WHERE f.step_run_id = m.id)
        )
        SELECT array_agg(j.id) FILTER (WHERE j.expiry IS NULL OR j.expiry <= now()),
               coalesce(array_agg(j.id ORDER BY j.id) FILTER (WHERE j.expiry > now()), '{}'),
               coalesce(array_agg(extract(epoch FROM j.expiry - now()) * 1000.0 ORDER BY j.id)
                          FILTER (WHERE j.expiry > now()), '{}')
          INTO lost_ids, busy_ids, busy_ms
          FROM judged j;
    END IF;
    -- the leases to tell about a cancel: the step's own flag, or its run's.
    -- Neither read names p_ids: by `id = ANY` a plan could walk every lease
    -- again (and test each against every token); these reach only this
    -- worker's live steps that are being cancelled
    SELECT array_agg(x.id) INTO cancel_ids
      FROM (SELECT s.id, s.lease_token FROM durable.step_runs s
             WHERE s.owner_worker_id = p_worker AND s.cancel_requested
               AND s.state IN ('leased', 'running')
            UNION
            SELECT s.id, s.lease_token FROM durable.workflow_runs wr
              JOIN durable.step_runs s ON s.run_id = wr.id
             WHERE wr.cancel_requested AND wr.state IN ('pending', 'running')
               AND s.owner_worker_id = p_worker AND durable.step_is_live(s.state)) x
     WHERE x.lease_token = ANY (p_tokens);
    RETURN QUERY
        SELECT x, 'lost', NULL::double precision FROM unnest(lost_ids) AS x
        UNION ALL SELECT b.x, 'busy', b.ms FROM unnest(busy_ids, busy_ms) AS b(x, ms)
        UNION ALL SELECT x, 'cancel_requested', NULL FROM unnest(cancel_ids) AS x;
END $function$;

-- The clock holds every worker's renewed leases and is small next to the
-- queue: the planner would read a small one whole (a sequential scan of a few
-- pages) rather than probe its key, and keep that plan while the table grows
-- between two ANALYZEs. A heartbeat reads its own leases by key (but for the
-- renewal of 640 or more, planned for the call, above).
ALTER FUNCTION durable.renew_leases(uuid, uuid[], uuid[], double precision, text) SET enable_seqscan = off;

-- The clock rows of leases that ended, read by key: the clock is small next
-- to the queue, and the planner would read a small one whole (every
-- worker's leases) for each batch of completions.
CREATE FUNCTION durable.end_lease_clocks(p_ids uuid[]) RETURNS void
 LANGUAGE plpgsql
 SET enable_seqscan = off
AS $$
BEGIN
    DELETE FROM durable.lease_clock WHERE step_run_id = ANY (p_ids);
END $$;

-- the step transition trigger also ends a lease's clock row
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
     WHERE w.id = x.id;
    PERFORM durable.record_run_hops(r_ids, r_cur, r_next, r_why, r_why_start);
    RETURN NULL;
END $function$;

-- The reclaim's lock of a lease's clock row, once it holds the step row: a
-- renewal in flight commits first (and keeps the lease: 'renewed'); a row
-- held past p_wait (never by the runtime's own writes, which lock the step
-- row first) leaves the step for a later pass ('held'), so one held row
-- cannot stop every other reclaim. 'expired' or 'absent' (the step row's
-- own expiry counts) lets the reclaim go on.
CREATE FUNCTION durable.lock_lease_clock(p_step uuid, p_token uuid, p_wait text)
 RETURNS text
 LANGUAGE plpgsql
AS $function$
DECLARE
    caller_timeout text := current_setting('lock_timeout');
    expiry timestamptz;
BEGIN
    PERFORM set_config('lock_timeout', p_wait, true);
    BEGIN
        SELECT c.expires_at INTO expiry FROM durable.lease_clock c
         WHERE c.step_run_id = p_step AND c.lease_token = p_token
           FOR UPDATE;
    EXCEPTION WHEN lock_not_available THEN
        PERFORM set_config('lock_timeout', caller_timeout, true);
        RETURN 'held';
    END;
    PERFORM set_config('lock_timeout', caller_timeout, true);
    RETURN CASE WHEN expiry IS NULL THEN 'absent'
                WHEN expiry >= now() THEN 'renewed'
                ELSE 'expired' END;
END $function$;

-- revoke_lost_leases reads a lease's expiry by the clock's rule
CREATE OR REPLACE FUNCTION durable.revoke_lost_leases(p_worker uuid, p_worker_name text, p_held uuid[], OUT epoch bigint, OUT given_back integer)
 RETURNS record
 LANGUAGE plpgsql
AS $function$
DECLARE
    ids uuid[];
BEGIN
    PERFORM pg_advisory_xact_lock(72546103, hashtext(p_worker::text));
    UPDATE durable.workers SET lease_epoch = lease_epoch + 1
     WHERE id = p_worker RETURNING lease_epoch INTO epoch;
    -- a worker whose row is gone (the retention removes one silent for a
    -- day) is not fenced: its calls lease as an unregistered worker's
    epoch := coalesce(epoch, 0);
    SELECT array_agg(s.id ORDER BY s.id) INTO ids
      FROM durable.step_runs s
     WHERE s.owner_worker_id = p_worker AND s.state = 'leased'
       AND coalesce((SELECT c.expires_at FROM durable.lease_clock c
                      WHERE c.step_run_id = s.id AND c.lease_token = s.lease_token),
                    s.lease_expires_at) > now()
       AND NOT (s.id = ANY (p_held));
    given_back := 0;
    IF ids IS NULL THEN
        RETURN;
    END IF;
    PERFORM durable.lock_runs_of(ids);
    UPDATE durable.step_runs s
       SET state = CASE WHEN c.cancel THEN 'cancelled' ELSE 'retryable_failed' END,
           attempt = s.attempt - 1,
           error_code = CASE WHEN c.cancel THEN 'CANCELLED' ELSE 'LEASE_NOT_RECEIVED' END,
           error_message = 'the worker''s lease call was cut off before its answer came; the step never reached it and is given back uncounted',
           error_retryable = NOT c.cancel, error_details = NULL,
           owner_worker_id = CASE WHEN c.cancel THEN s.owner_worker_id END,
           lease_token = CASE WHEN c.cancel THEN s.lease_token END,
           transition_reason = CASE WHEN c.cancel AND c.run_failed THEN 'RUN_FAILED (LEASE_NOT_RECEIVED)'
                                    WHEN c.cancel THEN 'CANCEL_REQUESTED (LEASE_NOT_RECEIVED)'
                                    ELSE 'LEASE_NOT_RECEIVED' END,
           transition_by = p_worker_name
      FROM (SELECT s2.id, s2.cancel_requested OR r.cancel_requested AS cancel,
                   durable.run_failed_it(s2.run_id) AS run_failed
              FROM durable.step_runs s2 JOIN durable.workflow_runs r ON r.id = s2.run_id
             WHERE s2.id = ANY (ids)) c
     WHERE s.id = c.id AND s.owner_worker_id = p_worker AND s.state = 'leased';
    GET DIAGNOSTICS given_back = ROW_COUNT;
END $function$;

-- the step guard refuses an expired-lease reclaim of a lease the clock
-- still holds (a worker older than the clock judges by the step row alone)
CREATE OR REPLACE FUNCTION durable.guard_step_update()
 RETURNS trigger
 LANGUAGE plpgsql
AS $function$
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
            IF NOT (durable.step_hop_is_legal(OLD.state, NEW.via_state)
                    AND durable.step_hop_is_legal(NEW.via_state, NEW.state)) THEN
                RAISE EXCEPTION 'illegal step transition % -> % -> % for step % (%)', OLD.state, NEW.via_state,
                    NEW.state, OLD.name, OLD.id
                    USING ERRCODE = 'P0D03';
            END IF;
        ELSIF NOT durable.step_hop_is_legal(OLD.state, NEW.state) THEN
            RAISE EXCEPTION 'illegal step transition % -> % for step % (%)', OLD.state, NEW.state, OLD.name, OLD.id
                USING ERRCODE = 'P0D03';
        END IF;
        -- a reclaim of a lease the lease clock still holds: a worker older
        -- than the clock reads the step row's expiry alone, which renewals
        -- no longer move (migrations are additive, and older workers run on
        -- a newer schema); its reclaim of a live lease is refused
        IF OLD.state IN ('leased', 'running') AND NEW.state NOT IN ('leased', 'running')
           AND (NEW.error_code = 'LEASE_EXPIRED' OR NEW.transition_reason LIKE '%LEASE_EXPIRED%')
           AND EXISTS (SELECT 1 FROM durable.lease_clock c
                        WHERE c.step_run_id = OLD.id AND c.lease_token = OLD.lease_token
                          AND c.expires_at > now()) THEN
            RAISE EXCEPTION 'step % (%): its lease is renewed on durable.lease_clock and has not expired: a reclaim that read only step_runs.lease_expires_at (a worker older than schema 20261230000001) is refused (P0D06); upgrade that worker: this lease is healthy', OLD.name, OLD.id
                USING ERRCODE = 'P0D06';
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
END $function$;
