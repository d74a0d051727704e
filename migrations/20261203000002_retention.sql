-- Retention (issue 8, item 9): finished runs older than an age are removed,
-- with their steps, events, transitions, artifacts and the artifact bytes no
-- other artifact references, in small batches of short transactions.
--
-- Why row deletes in batches, not time partitions (as Hatchet does): every
-- table here hangs off a run by foreign keys with ON DELETE CASCADE, and the
-- hot queue rows (step_runs) of a run stay live for as long as the run does,
-- which has no bound (a run can wait days on a retry or a dependency). A
-- partition by creation time could only be dropped once every run in it has
-- finished, so one long run would pin a whole partition, and partitioning
-- step_runs would turn its uuid primary key and every foreign key into
-- composite ones (PostgreSQL needs the partition key in every unique
-- constraint) and give the lease a scan per partition. Batches of old
-- finished runs touch only rows nobody else writes (a terminal run and its
-- terminal steps never change again: the guards refuse it), so they lock
-- nothing the queue needs; space is reclaimed by VACUUM (the retention pass
-- runs one after it removed anything, see supervisor/src/db/retention.rs).
--
-- * durable.retention_batch(before, max_runs, max_steps) removes at most
--   max_runs runs finished before `before`, oldest first, whose steps
--   together are at most max_steps (a run with more steps than that is
--   removed over several batches: max_steps of its steps each time, then the
--   run itself). Children first, set-based; the ON DELETE CASCADE foreign
--   keys then find nothing left. Deletes fire none of the step or run
--   triggers (they are UPDATE and INSERT triggers): the counters and the
--   dependency edges of other runs are untouched, and the guards, which refuse
--   updates of terminal rows, do not refuse deletes.
-- * One batch at a time across every worker and `supervisor gc`: each takes
--   the transaction-scoped advisory lock RETENTION_LOCK first (before any row
--   lock, and no other transaction takes it, so it cannot be part of a wait
--   cycle); concurrent passes interleave their batches harmlessly. Runs are
--   picked FOR UPDATE SKIP LOCKED: a late, lease-lost write that briefly
--   locks a finished run is skipped, not waited on.
-- * Artifact bytes. durable.artifact_blobs rows are shared by sha256 and
--   inserted by completions with ON CONFLICT DO NOTHING, which takes no lock
--   on an existing row. A blob whose last reference goes is deleted in two
--   statements: first every such blob is locked FOR UPDATE in sha256 order
--   (the order blobs are inserted in), which waits for any completion that
--   already holds the FOR KEY SHARE lock of its artifact's foreign key; then
--   a new statement (a new snapshot: it sees what those completions
--   committed) deletes only the blobs that no artifact references now. The
--   remaining window — a completion whose insert found the blob, before its
--   artifact row locks it — is closed by artifacts_blob_present below: the
--   artifact insert locks its blob FOR KEY SHARE itself and, when retention
--   deleted it in between, fails with 40001 (serialization_failure), which
--   the worker retries like any transient error (the retry inserts the bytes
--   again) instead of a permanent foreign-key violation.
-- * Worker rows (durable.workers) stopped before `before`, or never stopped
--   but silent (no heartbeat) for a day and since before `before` (killed),
--   and holding no live lease, go too, at most max_runs per batch. A live
--   worker heartbeats every heartbeat_interval_ms, at most half a day.
--
-- Indexes: the finished runs by finish time (the batch's scan), artifacts by
-- run and by sha256 (the delete and the reference check), lineage by its
-- source (the cascade from an artifact). The run index is partial on
-- finished_at IS NOT NULL, so the run counters' updates stay HOT.

CREATE INDEX workflow_runs_finished ON durable.workflow_runs (finished_at)
    WHERE finished_at IS NOT NULL;
CREATE INDEX artifacts_run ON durable.artifacts (run_id);
CREATE INDEX artifacts_sha256 ON durable.artifacts (sha256);
CREATE INDEX artifact_lineage_source ON durable.artifact_lineage (derived_from_id);

CREATE FUNCTION durable.artifact_blob_present() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM 1 FROM durable.artifact_blobs WHERE sha256 = NEW.sha256 FOR KEY SHARE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'artifact blob % is gone (removed by retention while this write was in flight); retry the write', NEW.sha256
            USING ERRCODE = '40001';
    END IF;
    RETURN NEW;
END $$;

CREATE TRIGGER artifacts_blob_present BEFORE INSERT ON durable.artifacts
    FOR EACH ROW EXECUTE FUNCTION durable.artifact_blob_present();

-- The steps `sids` with their events, artifacts and history; returns the
-- sha256 of the artifacts removed.
CREATE FUNCTION durable.retention_delete_steps(sids uuid[]) RETURNS text[]
LANGUAGE plpgsql AS $$
DECLARE
    shas text[];
BEGIN
    DELETE FROM durable.step_events WHERE step_run_id = ANY (sids);
    WITH a AS (DELETE FROM durable.artifacts WHERE step_run_id = ANY (sids) RETURNING sha256)
    SELECT array_agg(sha256) INTO shas FROM a;
    DELETE FROM durable.transitions WHERE step_run_id = ANY (sids);
    DELETE FROM durable.step_runs WHERE id = ANY (sids);
    RETURN coalesce(shas, '{}');
END $$;

CREATE FUNCTION durable.retention_batch(p_before timestamptz, p_max_runs integer, p_max_steps integer,
                                        OUT runs integer, OUT steps integer, OUT blobs integer,
                                        OUT workers integer, OUT more boolean)
LANGUAGE plpgsql AS $$
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
                        WHERE s.owner_worker_id = w.id AND s.state IN ('leased', 'running'));
    GET DIAGNOSTICS workers = ROW_COUNT;
END $$;
