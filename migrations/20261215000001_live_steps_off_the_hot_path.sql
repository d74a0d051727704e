-- The index of live steps (leased or running) is off the hot path.
--
-- Its predicate was `state IN ('leased', 'running')`, and every fenced
-- write of a worker names a step by id and token with that same condition
-- (`id = $1 AND lease_token = $2 AND state IN ('leased', 'running')`, and
-- the set forms' joins over arrays of them). Such a query implies the
-- predicate, so the planner could read the whole partial index instead of
-- probing the primary key: after an ANALYZE at a quiet moment the index
-- looks nearly empty (its statistics count the live rows, a few), and the
-- generic plans the runtime's sessions use then scan it on every call,
-- live entries and the dead ones every finished step leaves until vacuum
-- alike. Measured (bench_executors, persistent Go, c64, 40,000 one-step
-- runs): lock_batch read ~12,000 buffers a call for ~50 steps, and the
-- worker fell from ~4,200 to ~660 steps/s for the whole run.
--
-- The predicate is now a function call that no such query contains, so the
-- primary key is the only index a fenced write can use. The function is
-- PL/pgSQL on purpose: an SQL function would be inlined into the predicate
-- and be `state IN (...)` again. It is IMMUTABLE (an index predicate must
-- be) and must never change. The queries that want live steps by run, by
-- owner, or all of them (reclaim, the heartbeat's cancel check, retention,
-- a pending run's decision, dev's work count) say `durable.step_is_live(state)`.
CREATE FUNCTION durable.step_is_live(p_state text) RETURNS boolean
LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE AS $$
BEGIN
    RETURN p_state IN ('leased', 'running');
END $$;

DROP INDEX durable.step_runs_live;
CREATE INDEX step_runs_live ON durable.step_runs (run_id) WHERE durable.step_is_live(state);

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
        IF started = 0 AND (EXISTS (SELECT 1 FROM durable.step_runs s
                                     WHERE s.run_id = p_id AND durable.step_is_live(s.state))
                            OR EXISTS (SELECT 1 FROM durable.step_runs s
                                        WHERE s.run_id = p_id AND s.state = 'retryable_failed')) THEN
            started := 1;
        END IF;
    END IF;
    RETURN durable.aggregate_run_counts(
        p_state, p_total, p_total - p_succeeded - p_failed - p_cancelled,
        p_failed, p_cancelled, started, p_defs_waiting > 0);
END $function$;

CREATE OR REPLACE FUNCTION durable.retention_batch(p_before timestamp with time zone, p_max_runs integer, p_max_steps integer, OUT runs integer, OUT steps integer, OUT blobs integer, OUT workers integer, OUT more boolean)
 RETURNS record
 LANGUAGE plpgsql
 SET plan_cache_mode TO 'force_custom_plan'
AS $function$
DECLARE
    cand uuid[]; cand_steps integer[]; ids uuid[] := '{}'; n_steps integer := 0; i integer;
    partial_run uuid; sids uuid[]; shas text[] := '{}'; locked text[];
BEGIN
    runs := 0; steps := 0; blobs := 0; workers := 0; more := false;
    IF p_max_runs < 1 OR p_max_steps < 1 THEN
        RAISE EXCEPTION 'retention_batch: max_runs (%) and max_steps (%) must be at least 1', p_max_runs, p_max_steps
            USING ERRCODE = '22023';
    END IF;
    -- RETENTION_LOCK: one batch at a time, whoever runs it
    PERFORM pg_advisory_xact_lock(7254610300000002);

    SELECT array_agg(c.id ORDER BY c.finished_at), array_agg(c.steps_total ORDER BY c.finished_at)
      INTO cand, cand_steps
      FROM (SELECT r.id, r.finished_at, r.steps_total FROM durable.workflow_runs r
             WHERE r.finished_at < p_before AND r.state IN ('succeeded', 'failed', 'cancelled')
             ORDER BY r.finished_at
             LIMIT p_max_runs + 1
             FOR UPDATE SKIP LOCKED) c;
    FOR i IN 1 .. coalesce(cardinality(cand), 0) LOOP
        IF i > p_max_runs OR (i > 1 AND n_steps + cand_steps[i] > p_max_steps) THEN
            more := true;
            EXIT;
        END IF;
        IF cand_steps[i] > p_max_steps THEN
            -- the oldest run alone is larger than a batch: its steps go first,
            -- max_steps at a time
            partial_run := cand[i];
            EXIT;
        END IF;
        ids := ids || cand[i];
        n_steps := n_steps + cand_steps[i];
    END LOOP;

    IF partial_run IS NOT NULL THEN
        SELECT array_agg(id) INTO sids
          FROM (SELECT id FROM durable.step_runs WHERE run_id = partial_run LIMIT p_max_steps) s;
        IF coalesce(cardinality(sids), 0) > 0 THEN
            shas := durable.retention_delete_steps(sids);
            steps := cardinality(sids);
        END IF;
        IF coalesce(cardinality(sids), 0) < p_max_steps THEN
            ids := ARRAY[partial_run];   -- that was the rest: the run itself goes now
        ELSE
            more := true;
        END IF;
    END IF;

    IF cardinality(ids) > 0 THEN
        SELECT array_agg(id) INTO sids FROM durable.step_runs WHERE run_id = ANY (ids);
        IF sids IS NOT NULL THEN
            shas := shas || durable.retention_delete_steps(sids);
            steps := steps + cardinality(sids);
        END IF;
        -- what is left of the runs: run-level history, artifacts of steps
        -- deleted above (none), definitions and their edges, the runs
        DELETE FROM durable.transitions WHERE run_id = ANY (ids);
        DELETE FROM durable.step_dependents WHERE run_id = ANY (ids);
        DELETE FROM durable.step_defs WHERE run_id = ANY (ids);
        DELETE FROM durable.workflow_runs WHERE id = ANY (ids);
        GET DIAGNOSTICS runs = ROW_COUNT;
    END IF;

    IF cardinality(shas) > 0 THEN
        -- lock the candidates in sha256 order (waits for completions that
        -- hold a reference's foreign-key lock), then, in a new statement that
        -- sees what they committed, delete those no artifact references
        SELECT array_agg(b.sha256 ORDER BY b.sha256) INTO locked
          FROM (SELECT sha256 FROM durable.artifact_blobs
                 WHERE sha256 = ANY (shas) ORDER BY sha256 FOR UPDATE) b;
        IF locked IS NOT NULL THEN
            DELETE FROM durable.artifact_blobs b
             WHERE b.sha256 = ANY (locked)
               AND NOT EXISTS (SELECT 1 FROM durable.artifacts a WHERE a.sha256 = b.sha256);
            GET DIAGNOSTICS blobs = ROW_COUNT;
        END IF;
    END IF;

    DELETE FROM durable.workers w
     WHERE w.id IN (SELECT x.id FROM durable.workers x
                     WHERE x.stopped_at < p_before
                        OR (x.stopped_at IS NULL
                            AND x.last_heartbeat_at < least(p_before, now() - interval '1 day'))
                     LIMIT p_max_runs FOR UPDATE SKIP LOCKED)
       AND NOT EXISTS (SELECT 1 FROM durable.step_runs s
                        WHERE s.owner_worker_id = w.id AND durable.step_is_live(s.state));
    GET DIAGNOSTICS workers = ROW_COUNT;
END $function$;

CREATE OR REPLACE FUNCTION durable.renew_leases(p_worker uuid, p_ids uuid[], p_tokens uuid[], p_ttl_ms double precision, p_wait text)
 RETURNS TABLE(step_run_id uuid, outcome text)
 LANGUAGE plpgsql
AS $function$
DECLARE
    caller_timeout text := current_setting('lock_timeout');
    expires timestamptz := now() + make_interval(secs => p_ttl_ms / 1000.0);
    lost_ids uuid[];
    busy_ids uuid[] := '{}';
    cancel_ids uuid[];
    n_renewed bigint;
BEGIN
    UPDATE durable.workers SET last_heartbeat_at = now() WHERE id = p_worker;
    BEGIN
        PERFORM set_config('lock_timeout', p_wait, true);
        -- `s.id = ANY` walks the primary key for just these rows, and each
        -- is fenced by its own token: with the cached plan by a hash join
        -- with the (id, token) pairs. From 640 leases on (bench_heartbeat)
        -- a plan made for the call is cheaper: EXECUTE makes the arrays its
        -- constants, and `= ANY (tokens)` becomes one hash probe per row. A
        -- lease token is drawn at random for one lease of one step, so a row
        -- whose token is one of this worker's carries its own.
        IF cardinality(p_ids) < 640 THEN
            UPDATE durable.step_runs s SET lease_expires_at = expires
              FROM unnest(p_ids, p_tokens) AS h(id, token)
             WHERE s.id = ANY (p_ids) AND s.id = h.id AND s.lease_token = h.token
               AND s.state IN ('leased', 'running');
        ELSE
            EXECUTE $q$
                UPDATE durable.step_runs s SET lease_expires_at = $3
                 WHERE s.id = ANY ($1) AND s.lease_token = ANY ($2)
                   AND s.state IN ('leased', 'running')
            $q$ USING p_ids, p_tokens, expires;
        END IF;
        GET DIAGNOSTICS n_renewed = ROW_COUNT;
        -- the leases to tell about a cancel: the step's own flag, or its
        -- run's. Neither read names p_ids: by `id = ANY` a plan could walk
        -- every lease again (and test each against every token); these
        -- reach only this worker's live steps that are being cancelled
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
        IF n_renewed < cardinality(p_ids) THEN
            -- the rare case: name the leases that were not renewed
            SELECT array_agg(h.id) INTO lost_ids
              FROM unnest(p_ids, p_tokens) AS h(id, token)
             WHERE NOT EXISTS (SELECT 1 FROM durable.step_runs s
                                WHERE s.id = h.id AND s.lease_token = h.token
                                  AND s.state IN ('leased', 'running'));
        END IF;
    EXCEPTION WHEN lock_not_available THEN
        -- a writer held a row longer than p_wait: this subtransaction's
        -- renewals are undone, and the rows that are held are skipped
        WITH h AS (
            SELECT * FROM unnest(p_ids, p_tokens) AS h(id, token)
        ), locked AS (
            SELECT s.id FROM durable.step_runs s JOIN h ON h.id = s.id AND h.token = s.lease_token
             WHERE s.id = ANY (p_ids) AND s.state IN ('leased', 'running')
               FOR NO KEY UPDATE OF s SKIP LOCKED
        ), renewed AS (
            UPDATE durable.step_runs s SET lease_expires_at = expires
              FROM locked
             WHERE s.id = locked.id
         RETURNING s.id, s.run_id, s.cancel_requested
        ), cancelling AS MATERIALIZED (
            SELECT wr.id FROM durable.workflow_runs wr
             WHERE wr.cancel_requested AND wr.state IN ('pending', 'running')
        ), judged AS (
            SELECT h.id, r.id IS NOT NULL AS renewed,
                   r.id IS NULL AND EXISTS (SELECT 1 FROM durable.step_runs s
                                             WHERE s.id = h.id AND s.lease_token = h.token
                                               AND s.state IN ('leased', 'running')) AS busy,
                   coalesce(r.cancel_requested OR c.id IS NOT NULL, false) AS cancel
              FROM h
              LEFT JOIN renewed r ON r.id = h.id
              LEFT JOIN cancelling c ON c.id = r.run_id
        )
        SELECT array_agg(id) FILTER (WHERE NOT renewed AND NOT busy),
               coalesce(array_agg(id) FILTER (WHERE busy), '{}'),
               array_agg(id) FILTER (WHERE cancel)
          INTO lost_ids, busy_ids, cancel_ids
          FROM judged;
    END;
    PERFORM set_config('lock_timeout', caller_timeout, true);
    RETURN QUERY
        SELECT x, 'lost' FROM unnest(lost_ids) AS x
        UNION ALL SELECT x, 'busy' FROM unnest(busy_ids) AS x
        UNION ALL SELECT x, 'cancel_requested' FROM unnest(cancel_ids) AS x;
END $function$;
