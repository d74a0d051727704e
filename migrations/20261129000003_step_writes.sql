-- The worker's two hot writes as single calls: one round trip each instead of
-- BEGIN / lock run / write / COMMIT (bench_queue measured ~14 round trips per
-- step before). Same lock order as everywhere (run row, then step row), same
-- fencing (lease token and state); false means the lease is lost.

CREATE FUNCTION durable.start_step(p_id uuid, p_token uuid, p_worker text, p_pid integer,
                                   p_sequence bigint, p_kind text, p_message text,
                                   p_fraction double precision, p_executor_at timestamptz)
RETURNS boolean LANGUAGE plpgsql AS $$
DECLARE
    att integer;
BEGIN
    PERFORM 1 FROM durable.workflow_runs
      WHERE id = (SELECT run_id FROM durable.step_runs WHERE id = p_id) FOR UPDATE;
    UPDATE durable.step_runs
       SET state = 'running', started_at = now(), executor_pid = p_pid,
           transition_reason = 'ACCEPTED', transition_by = p_worker
     WHERE id = p_id AND lease_token = p_token AND state = 'leased'
 RETURNING attempt INTO att;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    INSERT INTO durable.step_events (step_run_id, attempt, sequence, kind, message, fraction, checkpoint, executor_at)
    VALUES (p_id, att, p_sequence, p_kind, p_message, p_fraction, false, p_executor_at);
    RETURN true;
END $$;

-- Artifacts come as parallel arrays; p_derived is a JSON array (one entry per
-- artifact) of arrays of input-artifact ids. Returns the new artifact ids, or
-- NULL when the lease is lost (nothing is written then).
CREATE FUNCTION durable.complete_step(p_id uuid, p_token uuid, p_worker text, p_output jsonb,
                                      p_sequence bigint, p_names text[], p_sha256 text[],
                                      p_media_types text[], p_contents bytea[], p_derived jsonb)
RETURNS uuid[] LANGUAGE plpgsql AS $$
DECLARE
    rid uuid; att integer; ids uuid[] := '{}'; aid uuid; i integer;
BEGIN
    PERFORM 1 FROM durable.workflow_runs
      WHERE id = (SELECT run_id FROM durable.step_runs WHERE id = p_id) FOR UPDATE;
    SELECT run_id, attempt INTO rid, att FROM durable.step_runs
     WHERE id = p_id AND lease_token = p_token AND state = 'running' FOR UPDATE;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    FOR i IN 1 .. coalesce(cardinality(p_names), 0) LOOP
        aid := gen_random_uuid();
        INSERT INTO durable.artifact_blobs (sha256, size, content)
        VALUES (p_sha256[i], octet_length(p_contents[i]), p_contents[i])
        ON CONFLICT (sha256) DO NOTHING;
        INSERT INTO durable.artifacts (id, run_id, step_run_id, attempt, name, sha256, size, media_type)
        VALUES (aid, rid, p_id, att, p_names[i], p_sha256[i], octet_length(p_contents[i]), p_media_types[i]);
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
