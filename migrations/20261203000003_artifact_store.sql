-- Streamed artifacts (issue 8, item 2): a content-addressed blob store whose
-- bytes never travel in one value or one message.
--
-- A blob row (`durable.artifact_blobs`, one per sha256) now says where its
-- bytes are (`store`):
--   inline     in `content`, one bytea: every row written before this
--              migration (and by older workers through complete_step), and
--              a blob that fits in one chunk;
--   chunks     in `durable.artifact_chunks`, rows (upload_id, n) of at most
--              the worker's `artifact_chunk_bytes` (1 MiB by default), n from
--              0, `chunks` of them; `upload_id` names the upload that wrote
--              them;
--   directory  in a shared directory, the file <artifact_dir>/<sha[0..2]>/<sha>
--              (the row carries no path: hosts mount the volume where they like).
--
-- The worker uploads before it commits, outside any long transaction: each
-- chunk is one autocommit INSERT under a fresh upload id, hashed and counted
-- as it is read from the output file. Only when size and sha256 match the
-- executor's manifest is the blob row inserted, which makes the chunks part
-- of a blob ("promotes" them); on a mismatch, an error, or when another
-- upload of the same bytes recorded the blob first, the upload's chunks are
-- deleted. A blob that already exists is claimed (`claimed_at = now()`) and
-- not uploaded again; the file is still hashed, so a manifest cannot name
-- bytes it does not have.
--
-- The commit (`complete_step_stored`) then references stored blobs by sha256
-- and size; it carries no bytes. `complete_step` (bytes in the call) stays
-- for older workers.
--
-- Garbage, and how it is collected (the retention job's rule): uploads whose
-- attempt never committed (a lost lease, a crashed worker, a later artifact of
-- the same result refused) leave content-addressed garbage that no reader can
-- reach:
--   * a blob row that no `durable.artifacts` row references and whose
--     `claimed_at` is older than a day (far longer than any lease can stay
--     valid between a claim and its commit) is removable, with its chunks
--     (`upload_id`) or its file;
--   * chunks whose `upload_id` is no blob row's and whose `created_at` is older
--     than a day are a crashed upload's: removable;
--   * in a directory store, files `.<sha>.<random>.part` older than a day, and
--     files <sha> with no blob row older than a day, are removable.
-- A commit's foreign key on `artifacts.sha256` takes FOR KEY SHARE on the
-- blob row, so a blob deleted under a commit fails that commit (never a
-- dangling artifact); claiming refreshes `claimed_at`, so a blob being reused
-- is not old.

ALTER TABLE durable.artifact_blobs
    ALTER COLUMN content DROP NOT NULL,
    ADD COLUMN store text NOT NULL DEFAULT 'inline',
    ADD COLUMN upload_id uuid,
    ADD COLUMN chunks integer,
    ADD COLUMN created_at timestamptz NOT NULL DEFAULT now(),
    ADD COLUMN claimed_at timestamptz NOT NULL DEFAULT now(),
    ADD CONSTRAINT artifact_blobs_store_shape CHECK (
        (store = 'inline' AND content IS NOT NULL AND upload_id IS NULL)
        OR (store = 'chunks' AND content IS NULL AND upload_id IS NOT NULL AND chunks >= 0)
        OR (store = 'directory' AND content IS NULL AND upload_id IS NULL));

CREATE UNIQUE INDEX artifact_blobs_upload ON durable.artifact_blobs (upload_id)
    WHERE upload_id IS NOT NULL;

CREATE TABLE durable.artifact_chunks (
    upload_id  uuid NOT NULL,
    n          integer NOT NULL CHECK (n >= 0),
    data       bytea NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (upload_id, n)
);
-- stored out of line uncompressed: artifacts are mostly compressed already,
-- and pglz on a GiB costs seconds of CPU for nothing
ALTER TABLE durable.artifact_chunks ALTER COLUMN data SET STORAGE EXTERNAL;

-- A success whose artifacts' blobs are already stored: the same as
-- complete_step, but each artifact is (name, sha256, size, media type,
-- derived_from) and its blob must exist with that size. Fenced; NULL when the
-- lease does not hold. The run row, then the step row, as every writer; the
-- blob rows are only key-share locked by the foreign keys.
CREATE FUNCTION durable.complete_step_stored(p_id uuid, p_token uuid, p_worker text, p_output jsonb,
                                             p_sequence bigint, p_names text[], p_sha256 text[],
                                             p_sizes bigint[], p_media_types text[], p_derived jsonb)
RETURNS uuid[] LANGUAGE plpgsql AS $$
DECLARE
    rid uuid; att integer; st text; ids uuid[] := '{}'; aid uuid; i integer; stored bigint;
BEGIN
    PERFORM 1 FROM durable.workflow_runs
      WHERE id = (SELECT run_id FROM durable.step_runs WHERE id = p_id) FOR NO KEY UPDATE;
    SELECT run_id, attempt, state INTO rid, att, st FROM durable.step_runs
     WHERE id = p_id AND lease_token = p_token AND state IN ('leased', 'running') FOR NO KEY UPDATE;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    IF st = 'leased' THEN
        UPDATE durable.step_runs
           SET state = 'running', started_at = now(),
               transition_reason = 'ACCEPTED', transition_by = p_worker
         WHERE id = p_id;
    END IF;
    FOR i IN 1 .. coalesce(cardinality(p_names), 0) LOOP
        SELECT size INTO stored FROM durable.artifact_blobs WHERE sha256 = p_sha256[i] FOR KEY SHARE;
        IF NOT FOUND THEN
            RAISE EXCEPTION 'artifact %: its blob % is not stored (upload it before the commit)',
                p_names[i], p_sha256[i] USING ERRCODE = 'foreign_key_violation';
        END IF;
        IF stored <> p_sizes[i] THEN
            RAISE EXCEPTION 'artifact %: its blob % has % bytes, the artifact says %',
                p_names[i], p_sha256[i], stored, p_sizes[i] USING ERRCODE = 'data_exception';
        END IF;
        aid := gen_random_uuid();
        INSERT INTO durable.artifacts (id, run_id, step_run_id, attempt, name, sha256, size, media_type)
        VALUES (aid, rid, p_id, att, p_names[i], p_sha256[i], p_sizes[i], p_media_types[i]);
        INSERT INTO durable.artifact_lineage (artifact_id, derived_from_id)
        SELECT aid, d::uuid FROM jsonb_array_elements_text(coalesce(p_derived -> (i - 1), '[]')) AS d
        ON CONFLICT DO NOTHING;
        ids := ids || aid;
    END LOOP;
    IF p_sequence IS NOT NULL THEN
        INSERT INTO durable.step_events (step_run_id, attempt, sequence, kind, message)
        VALUES (p_id, att, p_sequence, 'succeeded', '') ON CONFLICT DO NOTHING;
    END IF;
    UPDATE durable.step_runs
       SET state = 'succeeded', output = p_output, error_code = NULL, error_message = NULL,
           error_retryable = NULL, error_details = NULL,
           transition_reason = 'SUCCEEDED', transition_by = p_worker
     WHERE id = p_id AND lease_token = p_token;
    RETURN ids;
END $$;
