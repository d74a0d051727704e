-- Artifact bytes nobody will ever reference (issue 8, items 2 and 9):
--
-- * An upload whose attempt never committed (a lost lease, a crashed worker,
--   a later artifact of the same result that failed its check) leaves a blob
--   no artifact references. `collect_blob_garbage` removes blobs that no
--   artifact references and that nobody claimed for `p_before` (a claim
--   refreshes `claimed_at`; an upload commits within its lease, far shorter
--   than the age the caller passes), and the staged chunks of uploads that
--   never became a blob. Blobs are locked in sha256 order (the order
--   completions insert them in) and the check is repeated under the lock.
-- * A removed blob of the directory store leaves a file on the shared
--   volume that SQL cannot delete: its sha256 is queued in
--   `artifact_files_removed` with the time of removal, and a process that
--   mounts the directory (a worker's retention pass, `supervisor gc
--   --artifact-dir`) deletes the file if it is still unreferenced and older
--   than its removal (a re-upload of the same bytes after the removal writes
--   a newer file, which is kept), then dequeues it.

-- each pass looks only at what is old enough, not at the whole store
CREATE INDEX artifact_blobs_claimed ON durable.artifact_blobs (claimed_at);
CREATE INDEX artifact_chunks_created ON durable.artifact_chunks (created_at);

CREATE TABLE durable.artifact_files_removed (
    sha256     text PRIMARY KEY,
    removed_at timestamptz NOT NULL DEFAULT now()
);

CREATE OR REPLACE FUNCTION durable.on_artifact_blobs_deleted() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM durable.artifact_chunks c
     USING old_rows o
     WHERE o.upload_id IS NOT NULL AND c.upload_id = o.upload_id;
    INSERT INTO durable.artifact_files_removed (sha256)
    SELECT o.sha256 FROM old_rows o WHERE o.store = 'directory'
    ON CONFLICT (sha256) DO UPDATE SET removed_at = now();
    RETURN NULL;
END $$;

CREATE FUNCTION durable.collect_blob_garbage(p_before timestamptz, p_limit integer,
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
             ORDER BY x.sha256
             LIMIT p_limit
             FOR UPDATE SKIP LOCKED) b;
    IF locked IS NOT NULL THEN
        DELETE FROM durable.artifact_blobs b
         WHERE b.sha256 = ANY (locked) AND b.claimed_at < p_before
           AND NOT EXISTS (SELECT 1 FROM durable.artifacts a WHERE a.sha256 = b.sha256);
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
