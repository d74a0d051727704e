-- A chunked blob's chunks go with its row, whoever deletes it (retention
-- included): before this, removing a `chunks` blob left its chunk rows behind
-- for good (they are keyed by upload id, without a foreign key, so that an
-- upload can write them before its blob row exists).

CREATE FUNCTION durable.on_artifact_blobs_deleted() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM durable.artifact_chunks c
     USING old_rows o
     WHERE o.upload_id IS NOT NULL AND c.upload_id = o.upload_id;
    RETURN NULL;
END $$;

CREATE TRIGGER artifact_blobs_deleted AFTER DELETE ON durable.artifact_blobs
    REFERENCING OLD TABLE AS old_rows
    FOR EACH STATEMENT EXECUTE FUNCTION durable.on_artifact_blobs_deleted();
