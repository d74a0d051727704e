-- Bookkeeping cost per transition (issue 7 item 2). Run by
-- scripts/bench-bookkeeping against a scratch database with the migrations
-- applied; prints one table. Every measured call is its own transaction
-- (a procedure COMMITs between calls), timed on the server without the
-- round trip, so the numbers are the database's own work per call.
\set ON_ERROR_STOP on
SET client_min_messages = warning;
CREATE SCHEMA bench;
CREATE TABLE bench.timing (scenario text, op text, ms float8);
CREATE TABLE bench.hot (scenario text, upd bigint, hot bigint, ms float8);

-- a spec of n steps: 'parallel' (independent) or 'chain' (each depends on the previous)
CREATE FUNCTION bench.spec(shape text, n int) RETURNS jsonb LANGUAGE sql AS $$
    SELECT jsonb_build_object('name', 'bench', 'steps', jsonb_agg(
        jsonb_build_object('name', 's' || i, 'executor_kind', 'go', 'kind', 'bench')
        || CASE WHEN shape = 'chain' AND i > 1 THEN jsonb_build_object('depends_on', jsonb_build_array('s' || (i - 1)))
                ELSE '{}'::jsonb END ORDER BY i))
      FROM generate_series(1, n) i
$$;

-- submits `runs` runs of the shape, then drives `measured` steps (in run
-- order) through lease → start_step → complete_step, timing the last two, and
-- times `durable.recompute_run` on the (still open) last run
CREATE PROCEDURE bench.walk(scenario text, shape text, n int, runs int, measured int)
LANGUAGE plpgsql AS $$
DECLARE
    rids uuid[] := '{}'; rid uuid; sid uuid; tok uuid; t0 timestamptz; i int; k int := 0;
BEGIN
    FOR i IN 1 .. runs LOOP
        rids := rids || durable.submit_run(bench.spec(shape, n));
        COMMIT;
    END LOOP;
    FOREACH rid IN ARRAY rids LOOP
        FOR i IN 1 .. least(n, measured - k) LOOP
            UPDATE durable.step_runs
               SET state = 'leased', lease_token = gen_random_uuid(), lease_expires_at = now() + interval '1 minute',
                   leased_at = now(), attempt = attempt + 1, transition_reason = 'LEASED', transition_by = 'bench'
             WHERE id = (SELECT id FROM durable.step_runs WHERE run_id = rid AND state = 'pending'
                          ORDER BY position LIMIT 1)
         RETURNING id, lease_token INTO sid, tok;
            COMMIT;
            t0 := clock_timestamp();
            PERFORM durable.start_step(sid, tok, 'bench', 1, 1, 'accepted', '', NULL, NULL);
            INSERT INTO bench.timing VALUES (scenario, 'start_step', extract(epoch FROM clock_timestamp() - t0) * 1000);
            COMMIT;
            t0 := clock_timestamp();
            PERFORM durable.complete_step(sid, tok, 'bench', '{}'::jsonb, 2, '{}', '{}', '{}', '{}', '[]'::jsonb);
            INSERT INTO bench.timing VALUES (scenario, 'complete_step', extract(epoch FROM clock_timestamp() - t0) * 1000);
            COMMIT;
            k := k + 1;
        END LOOP;
        EXIT WHEN k >= measured;
    END LOOP;
    FOR i IN 1 .. 50 LOOP
        t0 := clock_timestamp();
        PERFORM durable.recompute_run(rid, 'bench');
        INSERT INTO bench.timing VALUES (scenario, 'recompute_run', extract(epoch FROM clock_timestamp() - t0) * 1000);
        COMMIT;
    END LOOP;
END $$;

-- n live leases (10 runs of n/10 steps), then `beats` heartbeats (the exact
-- statement of Db::heartbeat), each its own transaction; counts updates and
-- HOT updates of step_runs per heartbeat (pg_stat_xact_user_tables)
CREATE PROCEDURE bench.heartbeats(n int, beats int)
LANGUAGE plpgsql AS $$
DECLARE
    wid uuid := gen_random_uuid(); cnt bigint; rids uuid[] := '{}'; ids uuid[]; toks uuid[]; t0 timestamptz; i int; u0 bigint; h0 bigint; u1 bigint; h1 bigint;
BEGIN
    INSERT INTO durable.workers (id, name, host, pid) VALUES (wid, 'bench', 'bench', 1);
    FOR i IN 1 .. 10 LOOP
        rids := rids || durable.submit_run(bench.spec('parallel', n / 10));
    END LOOP;
    COMMIT;
    UPDATE durable.step_runs
       SET state = 'leased', owner_worker_id = wid, lease_token = gen_random_uuid(),
           lease_expires_at = now() + interval '1 minute', leased_at = now(), attempt = attempt + 1,
           transition_reason = 'LEASED', transition_by = 'bench'
     WHERE state = 'pending' AND run_id = ANY (rids);
    COMMIT;
    SELECT array_agg(id ORDER BY id), array_agg(lease_token ORDER BY id) INTO ids, toks
      FROM durable.step_runs WHERE owner_worker_id = wid;
    COMMIT;
    FOR i IN 1 .. beats LOOP
        SELECT coalesce(n_tup_upd, 0), coalesce(n_tup_hot_upd, 0) INTO u0, h0
          FROM pg_stat_xact_user_tables WHERE schemaname = 'durable' AND relname = 'step_runs';
        t0 := clock_timestamp();
        WITH w AS (
                 UPDATE durable.workers SET last_heartbeat_at = now() WHERE id = wid
             ), h AS (
                 SELECT * FROM unnest(ids, toks) AS h(id, token)
             ), locked AS (
                 SELECT s.id FROM durable.step_runs s JOIN h ON h.id = s.id AND h.token = s.lease_token
                  WHERE s.state IN ('leased', 'running')
                  ORDER BY s.id
                  FOR NO KEY UPDATE OF s SKIP LOCKED
             ), renewed AS (
                 UPDATE durable.step_runs s
                    SET lease_expires_at = now() + make_interval(secs => 30000::double precision / 1000.0)
                   FROM locked
                  WHERE s.id = locked.id
              RETURNING s.id, s.run_id, s.cancel_requested
             )
             SELECT count(*) INTO cnt FROM (SELECT h.id,
                    r.id IS NOT NULL AS renewed,
                    coalesce(r.cancel_requested OR wr.cancel_requested, false) AS cancel_requested,
                    (r.id IS NULL AND EXISTS (SELECT 1 FROM durable.step_runs s
                                               WHERE s.id = h.id AND s.lease_token = h.token
                                                 AND s.state IN ('leased', 'running'))) AS busy
               FROM h
               LEFT JOIN renewed r ON r.id = h.id
               LEFT JOIN durable.workflow_runs wr ON wr.id = r.run_id) q;
        SELECT n_tup_upd, n_tup_hot_upd INTO u1, h1
          FROM pg_stat_xact_user_tables WHERE schemaname = 'durable' AND relname = 'step_runs';
        INSERT INTO bench.hot VALUES ('heartbeat ' || n || ' leases', u1 - u0, h1 - h0,
                                      extract(epoch FROM clock_timestamp() - t0) * 1000);
        COMMIT;
    END LOOP;
END $$;

\if :{?measured}
\else
\set measured 100
\endif
CALL bench.walk('1 step (x' || :measured || ' runs)', 'parallel', 1, :measured, :measured);
CALL bench.walk('1000 parallel', 'parallel', 1000, 1, :measured);
CALL bench.walk('chain of 1000', 'chain', 1000, 1, :measured);
CALL bench.heartbeats(1000, 30);

\pset footer off
SELECT scenario, op, count(*) AS calls, round(avg(ms)::numeric, 3) AS avg_ms,
       round((percentile_cont(0.5) WITHIN GROUP (ORDER BY ms))::numeric, 3) AS p50_ms,
       round(max(ms)::numeric, 3) AS max_ms
  FROM bench.timing GROUP BY scenario, op ORDER BY op, min(ctid::text);
SELECT scenario, count(*) AS beats, sum(upd) AS updates, sum(hot) AS hot_updates,
       round(100.0 * sum(hot) / nullif(sum(upd), 0), 1) AS hot_pct,
       round(avg(ms)::numeric, 3) AS avg_ms,
       round((percentile_cont(0.5) WITHIN GROUP (ORDER BY ms))::numeric, 3) AS p50_ms
  FROM bench.hot GROUP BY scenario;
