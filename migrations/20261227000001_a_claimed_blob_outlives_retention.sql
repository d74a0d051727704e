-- A blob that retention frees is kept when an upload of the same bytes
-- claimed it after the removed run committed its artifact (retention audit):
-- that upload skips writing the bytes again and references them at its
-- commit, and a pass between its claim and its commit deleted them, so the
-- commit failed for good (COMMIT_REJECTED: the blob is not stored) and a
-- succeeded step was recorded terminal_failed. The claim is the mark: a
-- blob's `claimed_at` is its upload's (before the commit that references it:
-- the artifact's `created_at`), and every later claim refreshes it. A blob
-- kept so and never referenced is the garbage pass's (nobody claimed for a
-- day). Otherwise unchanged from 20261224000003.

CREATE OR REPLACE FUNCTION durable.retention_batch(p_before timestamp with time zone, p_max_runs integer, p_max_steps integer, OUT runs integer, OUT steps integer, OUT blobs integer, OUT workers integer, OUT more boolean, OUT artifacts integer)
 RETURNS record
 LANGUAGE plpgsql
 SET plan_cache_mode TO 'force_custom_plan'
AS $function$
DECLARE
    cand uuid[]; cand_steps integer[]; ids uuid[] := '{}'; n_steps integer := 0; i integer;
    partial_run uuid; sids uuid[]; shas text[] := '{}'; locked text[];
    c_shas text[] := '{}'; c_last timestamptz[] := '{}';
BEGIN
    runs := 0; steps := 0; blobs := 0; workers := 0; more := false; artifacts := 0;
    IF p_max_runs < 1 OR p_max_steps < 1 THEN
        RAISE EXCEPTION 'retention_batch: max_runs (%) and max_steps (%) must be at least 1', p_max_runs, p_max_steps
            USING ERRCODE = '22023';
    END IF;
    -- RETENTION_LOCK: one batch at a time, whoever runs it
    PERFORM pg_advisory_xact_lock(7254610300000002);

    -- a run an earlier batch began is finished first, whatever this pass's
    -- cutoff (re-check audit: after an interrupted `gc --older-than 0s` it
    -- read as gone, its key refused, until it was older than the next
    -- pass's cutoff, 7 days by default)
    SELECT r.id INTO partial_run
      FROM durable.runs_being_removed m JOIN durable.workflow_runs r ON r.id = m.run_id
     ORDER BY m.since, m.run_id
     LIMIT 1
       FOR UPDATE OF r SKIP LOCKED;
    IF partial_run IS NULL THEN
    SELECT array_agg(c.id ORDER BY c.finished_at), array_agg(c.steps_total ORDER BY c.finished_at)
      INTO cand, cand_steps
      FROM (SELECT r.id, r.finished_at, r.steps_total FROM durable.workflow_runs r
             WHERE r.finished_at < p_before AND r.state IN ('succeeded', 'failed', 'cancelled')
             ORDER BY r.finished_at
             LIMIT p_max_runs + 1
             FOR UPDATE SKIP LOCKED) c;
    END IF;
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
            SELECT c_shas || coalesce(array_agg(x.sha256), '{}'), c_last || coalesce(array_agg(x.last), '{}')
              INTO c_shas, c_last
              FROM (SELECT a.sha256, max(a.created_at) AS last FROM durable.artifacts a
                     WHERE a.step_run_id = ANY (sids) GROUP BY a.sha256) x;
            shas := durable.retention_delete_steps(sids);
            steps := cardinality(sids);
        END IF;
        IF coalesce(cardinality(sids), 0) < p_max_steps THEN
            ids := ARRAY[partial_run];   -- that was the rest: the run itself goes now
            -- and the runs behind it wait for the next batch: more while
            -- another run is old enough or begun
            more := EXISTS (SELECT 1 FROM durable.workflow_runs r
                             WHERE r.id <> partial_run AND r.finished_at < p_before
                               AND r.state IN ('succeeded', 'failed', 'cancelled'))
                 OR EXISTS (SELECT 1 FROM durable.runs_being_removed m WHERE m.run_id <> partial_run);
        ELSE
            more := true;
            -- the rest of it goes in later batches: until then it is not read
            INSERT INTO durable.runs_being_removed (run_id) VALUES (partial_run)
                ON CONFLICT (run_id) DO NOTHING;
        END IF;
    END IF;

    IF cardinality(ids) > 0 THEN
        SELECT array_agg(id) INTO sids FROM durable.step_runs WHERE run_id = ANY (ids);
        IF sids IS NOT NULL THEN
            SELECT c_shas || coalesce(array_agg(x.sha256), '{}'), c_last || coalesce(array_agg(x.last), '{}')
              INTO c_shas, c_last
              FROM (SELECT a.sha256, max(a.created_at) AS last FROM durable.artifacts a
                     WHERE a.step_run_id = ANY (sids) GROUP BY a.sha256) x;
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

    -- one sha256 per artifact row deleted with its step
    artifacts := cardinality(shas);
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
               AND NOT EXISTS (SELECT 1 FROM durable.artifacts a WHERE a.sha256 = b.sha256)
               -- claimed since the last of the removed references to it
               -- committed: an upload of the same bytes reuses it and has
               -- not committed yet; it stays (the garbage pass takes it
               -- once nobody has claimed it for a day)
               AND b.claimed_at <= (SELECT max(c.last) FROM unnest(c_shas, c_last) AS c(sha, last)
                                     WHERE c.sha = b.sha256);
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
