-- The heartbeat in one server call that, in the common case, touches each
-- leased row once.
--
-- Before, every renewal first locked its rows with SKIP LOCKED (so that the
-- heartbeat, which locks many rows, never waits on a step writer and can
-- never close a wait cycle with one), then updated them in a second pass, and
-- probed every lease's run for a cancel request. At 1,000 leases that was
-- 3.0 ms of lock pass, 5.3 ms of updates and 1.6 ms of run probes.
--
-- Now:
-- * The fast path is one fenced UPDATE under a short lock_timeout. A row a
--   writer holds is waited on for at most that long (a writer's batch
--   commits within milliseconds, and its row is then renewed or found
--   ended). Should the wait outlast it, the fast path's work is rolled back
--   (it ran in its own subtransaction) and the old SKIP LOCKED path runs, so
--   a held row is still reported busy and the rest renewed. A wait cycle
--   with a writer lasts at most lock_timeout: far below deadlock_timeout, so
--   the writer never fails, the heartbeat is the one that gives way.
-- * A run's cancel request is found through a partial index of the runs that
--   are cancelling and not finished (usually none), not by one probe per
--   lease. The run's flag stays the truth: a step leased while its run was
--   being cancelled (so the step's own flag was never set) is still told.
-- * The caller's lock_timeout is restored before the function returns, so
--   it can run inside a caller's transaction.
CREATE INDEX workflow_runs_cancelling ON durable.workflow_runs (id)
    WHERE cancel_requested AND state IN ('pending', 'running');

-- It returns one row per lease that was not simply renewed: 'lost' (this
-- worker no longer holds it), 'busy' (held, but locked by a write in
-- flight: not renewed this time) or 'cancel_requested' (renewed, and its
-- step or run has a cancel request). Every other lease was renewed.
CREATE FUNCTION durable.renew_leases(p_worker uuid, p_ids uuid[], p_tokens uuid[],
                                     p_ttl_ms double precision, p_wait text)
RETURNS TABLE (step_run_id uuid, outcome text)
LANGUAGE plpgsql AS $$
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
            WITH renewed AS (
                UPDATE durable.step_runs s SET lease_expires_at = expires
                  FROM unnest(p_ids, p_tokens) AS h(id, token)
                 WHERE s.id = ANY (p_ids) AND s.id = h.id AND s.lease_token = h.token
                   AND s.state IN ('leased', 'running')
             RETURNING s.id, s.run_id, s.cancel_requested
            ), cancelling AS MATERIALIZED (
                SELECT wr.id FROM durable.workflow_runs wr
                 WHERE wr.cancel_requested AND wr.state IN ('pending', 'running')
            )
            SELECT count(*), array_agg(r.id) FILTER (WHERE r.cancel_requested OR c.id IS NOT NULL)
              INTO n_renewed, cancel_ids
              FROM renewed r
              LEFT JOIN cancelling c ON c.id = r.run_id;
        ELSE
            EXECUTE $q$
                WITH renewed AS (
                    UPDATE durable.step_runs s SET lease_expires_at = $3
                     WHERE s.id = ANY ($1) AND s.lease_token = ANY ($2)
                       AND s.state IN ('leased', 'running')
                 RETURNING s.id, s.run_id, s.cancel_requested
                ), cancelling AS MATERIALIZED (
                    SELECT wr.id FROM durable.workflow_runs wr
                     WHERE wr.cancel_requested AND wr.state IN ('pending', 'running')
                )
                SELECT count(*), array_agg(r.id) FILTER (WHERE r.cancel_requested OR c.id IS NOT NULL)
                  FROM renewed r
                  LEFT JOIN cancelling c ON c.id = r.run_id
            $q$ INTO n_renewed, cancel_ids USING p_ids, p_tokens, expires;
        END IF;
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
END $$;
