-- A lease whose row a write holds is renewed by that write, and the
-- heartbeat learns how long it holds (volume audit: an executor sending
-- checkpoints back to back lost its own lease, LEASE_LOST, every attempt).
-- A checkpoint rewrites its step's row; written without pause, the row was
-- held by the ledger's batches at nearly every heartbeat, which skips a row
-- held past its 20 ms wait ("busy": neither renewed nor lost), so the
-- worker's lease clock ran out while the executor was plainly alive and the
-- database answering.
--
-- Now a checkpoint write, fenced by the lease token, also renews the lease
-- it proves alive (to its transaction's start + TTL, never shortening it,
-- and never an expired one: see DbConn::record_events), as a heartbeat
-- with details does in Temporal. And renew_leases answers a busy lease with
-- how long its last committed renewal still holds (valid_ms, read without
-- waiting for the row), and with a cancel request of its own or its run's
-- (a held lease heard of none: renewed by its checkpoints it could now be
-- held at every heartbeat): the worker moves that lease's clock to the
-- heartbeat's send time + valid_ms, which is never later than the
-- database's own expiry. A new OUT column changes the row type, which CREATE
-- OR REPLACE cannot do: the function is dropped and created again (EXECUTE
-- stays PUBLIC's); callers that name their columns read it as before.
DROP FUNCTION durable.renew_leases(uuid, uuid[], uuid[], double precision, text);

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
               AND s.state IN ('leased', 'running') AND s.lease_expires_at > now();
        ELSE
            EXECUTE $q$
                UPDATE durable.step_runs s SET lease_expires_at = $3
                 WHERE s.id = ANY ($1) AND s.lease_token = ANY ($2)
                   AND s.state IN ('leased', 'running') AND s.lease_expires_at > now()
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
                                  AND s.state IN ('leased', 'running')
                                  AND s.lease_expires_at > now());
        END IF;
    EXCEPTION WHEN lock_not_available THEN
        -- a writer held a row longer than p_wait: this subtransaction's
        -- renewals are undone, and the rows that are held are skipped
        WITH h AS (
            SELECT * FROM unnest(p_ids, p_tokens) AS h(id, token)
        ), locked AS (
            SELECT s.id FROM durable.step_runs s JOIN h ON h.id = s.id AND h.token = s.lease_token
             WHERE s.id = ANY (p_ids) AND s.state IN ('leased', 'running')
               AND s.lease_expires_at > now()
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
            -- a held row is read as last committed: its lease as the last
            -- renewal left it (a checkpoint write renews it too)
            -- (and a held lease hears of a cancel too: renewed by its own
            -- checkpoints, it could otherwise be held at every heartbeat and
            -- never hear of one)
            SELECT h.id, r.id IS NOT NULL AS renewed,
                   r.id IS NULL AND held.lease_expires_at IS NOT NULL AS busy,
                   extract(epoch FROM held.lease_expires_at - now()) * 1000.0 AS held_ms,
                   coalesce(CASE WHEN r.id IS NOT NULL THEN r.cancel_requested
                                 ELSE held.cancel_requested END
                            OR c.id IS NOT NULL, false) AS cancel
              FROM h
              LEFT JOIN renewed r ON r.id = h.id
              LEFT JOIN LATERAL (SELECT s.lease_expires_at, s.cancel_requested, s.run_id
                                   FROM durable.step_runs s
                                  WHERE s.id = h.id AND s.lease_token = h.token
                                    AND s.state IN ('leased', 'running')
                                    AND s.lease_expires_at > now()) held ON true
              LEFT JOIN cancelling c ON c.id = coalesce(r.run_id, held.run_id)
        )
        SELECT array_agg(id) FILTER (WHERE NOT renewed AND NOT busy),
               coalesce(array_agg(id ORDER BY id) FILTER (WHERE busy), '{}'),
               coalesce(array_agg(held_ms ORDER BY id) FILTER (WHERE busy), '{}'),
               array_agg(id) FILTER (WHERE cancel)
          INTO lost_ids, busy_ids, busy_ms, cancel_ids
          FROM judged;
    END;
    PERFORM set_config('lock_timeout', caller_timeout, true);
    RETURN QUERY
        SELECT x, 'lost', NULL::double precision FROM unnest(lost_ids) AS x
        UNION ALL SELECT b.x, 'busy', b.ms FROM unnest(busy_ids, busy_ms) AS b(x, ms)
        UNION ALL SELECT x, 'cancel_requested', NULL FROM unnest(cancel_ids) AS x;
END $function$;
