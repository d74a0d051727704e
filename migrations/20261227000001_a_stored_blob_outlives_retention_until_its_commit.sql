-- Retention could lose the bytes of an artifact an attempt had stored (or
-- claimed: an upload of bytes already stored only claims the blob) but not
-- yet committed: a pass that removed another run referencing the same bytes
-- deleted the blob in between, and the commit failed for good
-- (COMMIT_REJECTED: the blob is not stored), a succeeded step recorded
-- terminal_failed (retention audit; faults audit for an earlier upload whose
-- commit waited while a later claimer committed and was removed).
--
-- An attempt now pins the bytes of each artifact it stores, before it
-- uploads or claims them, and the pin holds while its lease is live:
-- retention and the garbage pass leave a pinned blob alone. A pin needs no
-- release: the step's commit ends its lease (the pin is then dead), and it
-- goes with the step's row. A blob claimed since the last of its removed
-- references committed (`claimed_at` later than those artifacts'
-- `created_at`) is kept too, for a claimer of an older worker that pins
-- nothing; one never referenced goes with the day-old garbage.
-- Otherwise unchanged from 20261224000003 (retention_batch) and
-- 20261203000005 (collect_blob_garbage).

CREATE TABLE durable.blob_pins (
    sha256      text NOT NULL,
    step_run_id uuid NOT NULL REFERENCES durable.step_runs (id) ON DELETE CASCADE,
    lease_token uuid NOT NULL,
    PRIMARY KEY (sha256, step_run_id, lease_token)
);
CREATE INDEX blob_pins_step ON durable.blob_pins (step_run_id);

-- whether an attempt that still holds its lease pinned these bytes
CREATE FUNCTION durable.blob_is_pinned(p_sha text) RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT EXISTS (SELECT 1 FROM durable.blob_pins p
                     JOIN durable.step_runs s ON s.id = p.step_run_id AND s.lease_token = p.lease_token
                    WHERE p.sha256 = p_sha AND s.state IN ('leased', 'running'))
$$;

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
                                     WHERE c.sha = b.sha256)
               AND NOT durable.blob_is_pinned(b.sha256);
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

CREATE OR REPLACE FUNCTION durable.collect_blob_garbage(p_before timestamptz, p_limit integer,
                                             OUT blobs integer, OUT chunks integer)
LANGUAGE plpgsql AS $$
DECLARE
    locked text[];
BEGIN
    blobs := 0; chunks := 0;
    -- the retention lock: one remover at a time
    PERFORM pg_advisory_xact_lock(7254610300000002);
    SELECT array_agg(b.sha256 ORDER BY b.sha256) INTO locked
      FROM (SELECT x.sha256 FROM durable.artifact_blobs x
             WHERE x.claimed_at < p_before
               AND NOT EXISTS (SELECT 1 FROM durable.artifacts a WHERE a.sha256 = x.sha256)
               AND NOT durable.blob_is_pinned(x.sha256)
             ORDER BY x.sha256
             LIMIT p_limit
             FOR UPDATE SKIP LOCKED) b;
    IF locked IS NOT NULL THEN
        DELETE FROM durable.artifact_blobs b
         WHERE b.sha256 = ANY (locked) AND b.claimed_at < p_before
           AND NOT EXISTS (SELECT 1 FROM durable.artifacts a WHERE a.sha256 = b.sha256)
           AND NOT durable.blob_is_pinned(b.sha256);
        GET DIAGNOSTICS blobs = ROW_COUNT;
    END IF;
    DELETE FROM durable.artifact_chunks c
     WHERE (c.upload_id, c.n) IN (
           SELECT s.upload_id, s.n FROM durable.artifact_chunks s
            WHERE s.created_at < p_before
              AND NOT EXISTS (SELECT 1 FROM durable.artifact_blobs b WHERE b.upload_id = s.upload_id)
            LIMIT p_limit * 16);
    GET DIAGNOSTICS chunks = ROW_COUNT;
END $$;
