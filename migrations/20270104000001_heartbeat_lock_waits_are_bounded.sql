-- A heartbeat behind a lock (another session's LOCK TABLE durable.step_runs,
-- or a long transaction a lock queues behind) was cut off by the worker's own
-- bound and logged as "the database did not answer within 5000 ms", with a
-- hint about reachability, while the server answered everything else
-- (database-chaos audit 96). The worker now passes a bound below its own
-- (`p_bound`): every lock the call waits for is waited for within it, and the
-- server answers `lock_not_available` ("canceling statement due to lock
-- timeout"), which the worker logs with what to look for. Without p_bound the
-- call waits as before.

DROP FUNCTION durable.renew_leases(uuid, uuid[], uuid[], double precision, text);

CREATE FUNCTION durable.renew_leases(p_worker uuid, p_ids uuid[], p_tokens uuid[], p_ttl_ms double precision, p_wait text,
                                     p_bound text DEFAULT NULL)
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
    -- every lock this call waits for, within p_bound: the server then says
    -- why (a lock), where the caller's own bound cut it off in silence
    IF p_bound IS NOT NULL THEN
        PERFORM set_config('lock_timeout', p_bound, true);
    END IF;
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
    PERFORM set_config('lock_timeout', coalesce(p_bound, caller_timeout), true);
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
    PERFORM set_config('lock_timeout', caller_timeout, true);
END $function$;

ALTER FUNCTION durable.renew_leases(uuid, uuid[], uuid[], double precision, text, text) SET enable_seqscan = off;
