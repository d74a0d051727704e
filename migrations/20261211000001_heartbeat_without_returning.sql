-- The heartbeat's renewal returns nothing; the leases it must tell about a
-- cancel are found through two partial indexes instead.
--
-- Before, the fenced UPDATE returned every renewed row (id, run, the step's
-- cancel flag) into a CTE, which was counted and joined with the runs being
-- cancelled. Measured at 1,000 live leases (pgbench, 300 calls a figure,
-- the same two cores, fsync off), the whole function cost 5.16-5.20 ms
-- against 4.2 ms for the bare UPDATE of the same rows: the returned rows'
-- tuplestore, the count and the join were ~0.6 ms of it, and the limit of
-- issue 7 (g) is 5 ms.
--
-- Now the UPDATE returns nothing and its ROW_COUNT is the number renewed. The
-- leases to tell are this worker's live steps whose own cancel flag is set
-- (a new partial index, by owner: usually empty) and its live steps of runs
-- being cancelled (workflow_runs_cancelling, then step_runs_live by run):
-- both are read in proportion to the cancels in flight, not to the leases.
-- Measured the same way, three alternations: 4.79-4.82 ms, with the bare
-- UPDATE at 4.37-4.61 ms and the old statement alone at 5.33-5.37 ms (the
-- host was slower than for the first figures). Only the rows that
-- cancel_run flags (or a lease's owner change, which changes its state
-- too) leave HOT updates for the new index; the renewal itself stays a HOT
-- update.
--
-- The read runs after the renewal, in the same call: a step whose
-- cancel is requested between them is told one beat early, one whose lease
-- ended between them is not told (its attempt is over).
CREATE INDEX step_runs_cancelling_live ON durable.step_runs (owner_worker_id)
    WHERE cancel_requested AND state IN ('leased', 'running');

CREATE OR REPLACE FUNCTION durable.renew_leases(p_worker uuid, p_ids uuid[], p_tokens uuid[],
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
                   AND s.owner_worker_id = p_worker AND s.state IN ('leased', 'running')) x
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
END $$;
