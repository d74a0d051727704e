-- Spec validation: the edge cases a user meets, each refused with the path
-- of the field (SQLSTATE 22023, exit 2 from `supervisor submit`) or
-- accepted when it is what the contract allows. Found by checking the
-- contract from outside (CLI and SQL):
--
-- * A key that looks like a secret is recognised in every spelling: the
--   contract says "any case, any position", and `apiKey`, `api-key`,
--   `x-api-key`, `privateKey` and `private-key` are the usual JSON ones.
--   Before, only the underscore forms (`api_key`, `private_key`) were, so a
--   spec could carry `{"apiKey": "sk-..."}` in clear. The key is compared
--   with its separators removed and lowered.
-- * A whole number written as a float (`1000.0`, or `1e3` after a client's
--   JSON library re-encoded it) is an integer: before, check_int cast its
--   text to bigint and the submit failed with a raw database error (exit 1,
--   no field named).
-- * Input nested deeper than 128 levels is refused with its path; before,
--   check_secret_keys recursed until PostgreSQL's stack depth limit (a raw
--   error, not a spec error).
-- * A required string that is only blanks (`"kind": "   "`) is refused: no
--   executor can ever offer it, so the step would wait forever.
-- * An empty or blank label name is refused for the same reason.
-- * A deadline may use the lowercase `t` and `z` RFC 3339 allows; an hour of
--   24 or a minute or second of 60 is refused (PostgreSQL would read
--   `24:00:00` as the next midnight).
-- submit_run is otherwise unchanged from 20261212000001_submit_in_one_pass.

CREATE OR REPLACE FUNCTION durable.check_int(v jsonb, path text, lo numeric, hi numeric) RETURNS bigint LANGUAGE plpgsql AS $$
BEGIN
    IF v IS NULL OR jsonb_typeof(v) = 'null' THEN RETURN NULL; END IF;
    IF NOT durable.is_integer(v) THEN
        PERFORM durable.spec_error(path, 'must be an integer, got ' || v::text);
    END IF;
    IF (v::text)::numeric < lo OR (v::text)::numeric > hi THEN
        PERFORM durable.spec_error(path, 'must be between ' || lo || ' and ' || hi || ', got ' || v::text);
    END IF;
    -- through numeric: 1000.0 is the integer 1000
    RETURN (v::text)::numeric::bigint;
END $$;

CREATE OR REPLACE FUNCTION durable.check_string(v jsonb, path text, required boolean, max_len int) RETURNS text LANGUAGE plpgsql AS $$
BEGIN
    IF v IS NULL OR jsonb_typeof(v) = 'null' THEN
        IF required THEN PERFORM durable.spec_error(path, 'is required'); END IF;
        RETURN NULL;
    END IF;
    IF jsonb_typeof(v) <> 'string' THEN
        PERFORM durable.spec_error(path, 'must be a string, got ' || jsonb_typeof(v));
    END IF;
    IF required AND length(v #>> '{}') = 0 THEN
        PERFORM durable.spec_error(path, 'must not be empty');
    END IF;
    IF required AND btrim(v #>> '{}', E' \t\r\n\f' || chr(11)) = '' THEN
        PERFORM durable.spec_error(path, 'must not be blank');
    END IF;
    IF length(v #>> '{}') > max_len THEN
        PERFORM durable.spec_error(path, 'is longer than ' || max_len || ' characters');
    END IF;
    RETURN v #>> '{}';
END $$;

-- Whether an input key names a credential: password, secret, token, api key
-- or private key, in any case and any position, with or without separators
-- (`_`, `-`, `.`, blanks) or camelCase between the words.
CREATE OR REPLACE FUNCTION durable.is_secret_key(k text) RETURNS boolean LANGUAGE sql IMMUTABLE AS $$
    SELECT lower(regexp_replace(k, '[^[:alnum:]]', '', 'g')) ~ '(password|secret|token|apikey|privatekey)'
$$;

-- Finds keys that look like secrets in an input value, at most 128 levels
-- deep. Such a key is allowed only when its value is a reference
-- {"$secret": "NAME"}; the names of all references are collected into refs.
CREATE OR REPLACE FUNCTION durable.check_secret_keys(v jsonb, path text, depth int, INOUT refs text[]) LANGUAGE plpgsql AS $$
DECLARE k text; child jsonb; i int;
BEGIN
    IF jsonb_typeof(v) NOT IN ('object', 'array') THEN
        RETURN;
    END IF;
    IF depth >= 128 THEN
        PERFORM durable.spec_error(path, 'is nested more than 128 levels deep');
    END IF;
    IF jsonb_typeof(v) = 'object' THEN
        IF (SELECT count(*) FROM jsonb_object_keys(v)) = 1 AND v ? '$secret' THEN
            IF jsonb_typeof(v -> '$secret') <> 'string'
               OR (v ->> '$secret') !~ '^[A-Za-z_][A-Za-z0-9_]{0,127}$' THEN
                PERFORM durable.spec_error(path || '."$secret"', 'must be a secret name like REPORT_API_TOKEN');
            END IF;
            refs := array_append(refs, v ->> '$secret');
            RETURN;
        END IF;
        FOR k, child IN SELECT * FROM jsonb_each(v) LOOP
            IF durable.is_secret_key(k) THEN
                IF NOT (jsonb_typeof(child) = 'object' AND (SELECT count(*) FROM jsonb_object_keys(child)) = 1
                        AND child ? '$secret') THEN
                    PERFORM durable.spec_error(path || '.' || k,
                        'looks like a secret; never put secret values in a spec: pass {"$secret": "NAME"} and let the worker resolve NAME');
                END IF;
            END IF;
            refs := durable.check_secret_keys(child, path || '.' || k, depth + 1, refs);
        END LOOP;
    ELSE
        FOR i IN 0 .. jsonb_array_length(v) - 1 LOOP
            refs := durable.check_secret_keys(v -> i, path || '[' || i || ']', depth + 1, refs);
        END LOOP;
    END IF;
END $$;

CREATE OR REPLACE FUNCTION durable.check_secret_keys(v jsonb, path text, INOUT refs text[]) LANGUAGE sql AS $$
    SELECT durable.check_secret_keys(v, path, 0, refs)
$$;

CREATE OR REPLACE FUNCTION durable.submit_run(spec jsonb) RETURNS uuid LANGUAGE plpgsql AS $$
DECLARE
    new_id uuid := durable.time_ordered_uuid();
    existing uuid;
    run_name text; run_key text;
    steps jsonb; step jsonb; p text; i int; j int; n int;
    names text[] := '{}';
    step_name text; executor_kind text; kind text;
    deps text[]; dep jsonb; labels jsonb; retry jsonb; r jsonb; secrets text[]; refs text[];
    timeout_ms bigint; hb_ms bigint; deadline timestamptz;
    max_attempts bigint; initial_ms bigint; coef numeric; max_ms bigint; codes jsonb;
    lv jsonb; lk text;
    -- cycle check (Kahn)
    remaining text[]; progressed boolean; d record;
    -- the definitions, validated one by one and written in one statement
    n_roots int := 0;
    def durable.step_defs; defs durable.step_defs[] := '{}';
BEGIN
    IF spec IS NULL OR jsonb_typeof(spec) <> 'object' THEN
        PERFORM durable.spec_error('spec', 'must be a JSON object');
    END IF;
    IF octet_length(spec::text) > 16 * 1024 * 1024 THEN
        PERFORM durable.spec_error('spec', 'is larger than 16 MiB');
    END IF;
    PERFORM durable.check_keys(spec, 'spec', ARRAY['name', 'idempotency_key', 'steps']);
    run_name := durable.check_string(spec -> 'name', 'name', true, 200);
    run_key := durable.check_string(spec -> 'idempotency_key', 'idempotency_key', false, 200);
    IF run_key = '' THEN PERFORM durable.spec_error('idempotency_key', 'must not be empty (omit it instead)'); END IF;

    IF run_key IS NOT NULL THEN
        SELECT id INTO existing FROM durable.workflow_runs WHERE idempotency_key = run_key;
        IF existing IS NOT NULL THEN RETURN existing; END IF;
    END IF;

    steps := spec -> 'steps';
    IF steps IS NULL OR jsonb_typeof(steps) = 'null' THEN PERFORM durable.spec_error('steps', 'is required'); END IF;
    IF jsonb_typeof(steps) <> 'array' THEN PERFORM durable.spec_error('steps', 'must be an array, got ' || jsonb_typeof(steps)); END IF;
    n := jsonb_array_length(steps);
    IF n = 0 THEN PERFORM durable.spec_error('steps', 'must contain at least one step'); END IF;
    IF n > 1000 THEN PERFORM durable.spec_error('steps', 'has ' || n || ' steps; at most 1000 are allowed'); END IF;

    -- names first, so depends_on can be checked in any order
    FOR i IN 0 .. n - 1 LOOP
        step := steps -> i; p := 'steps[' || i || ']';
        IF jsonb_typeof(step) <> 'object' THEN PERFORM durable.spec_error(p, 'must be an object, got ' || jsonb_typeof(step)); END IF;
        step_name := durable.check_string(step -> 'name', p || '.name', true, 128);
        IF step_name !~ '^[A-Za-z0-9][A-Za-z0-9._-]*$' THEN
            PERFORM durable.spec_error(p || '.name', 'may contain only letters, digits, ".", "_" and "-" and must start with a letter or digit');
        END IF;
        IF step_name = ANY (names) THEN PERFORM durable.spec_error(p || '.name', 'duplicate step name "' || step_name || '"'); END IF;
        names := array_append(names, step_name);
        -- a root: no dependencies (a malformed depends_on is refused below)
        IF jsonb_typeof(step -> 'depends_on') IS DISTINCT FROM 'array'
           OR jsonb_array_length(step -> 'depends_on') = 0 THEN
            n_roots := n_roots + 1;
        END IF;
    END LOOP;

    -- Validation errors raise and roll back everything written below.
    -- The run is written once, with the counters its steps will give it: the
    -- roots are its steps, the others are waiting definitions. The statement
    -- triggers of step_defs and step_runs leave this run's counters alone
    -- while durable.submitting_run names it (until the end of this call).
    INSERT INTO durable.workflow_runs (id, name, idempotency_key, spec, steps_total, defs_waiting)
    VALUES (new_id, run_name, run_key, spec, n_roots, n - n_roots)
    ON CONFLICT (idempotency_key) DO NOTHING;
    IF NOT FOUND THEN
        -- a concurrent submit with the same key won the race
        SELECT id INTO existing FROM durable.workflow_runs WHERE idempotency_key = run_key;
        RETURN existing;
    END IF;
    PERFORM set_config('durable.submitting_run', new_id::text, true);

    FOR i IN 0 .. n - 1 LOOP
        step := steps -> i; p := 'steps[' || i || ']';
        PERFORM durable.check_keys(step, p, ARRAY['name', 'executor_kind', 'kind', 'input', 'depends_on', 'labels',
            'retry', 'timeout_ms', 'heartbeat_timeout_ms', 'deadline', 'secrets']);
        step_name := names[i + 1];
        executor_kind := durable.check_string(step -> 'executor_kind', p || '.executor_kind', true, 100);
        kind := durable.check_string(step -> 'kind', p || '.kind', true, 200);

        IF step ? 'input' AND octet_length((step -> 'input')::text) > 1024 * 1024 THEN
            PERFORM durable.spec_error(p || '.input', 'is larger than 1 MiB; pass large data as an artifact');
        END IF;
        refs := durable.check_secret_keys(coalesce(step -> 'input', 'null'::jsonb), p || '.input', '{}'::text[]);

        deps := '{}';
        IF step ? 'depends_on' AND jsonb_typeof(step -> 'depends_on') <> 'null' THEN
            IF jsonb_typeof(step -> 'depends_on') <> 'array' THEN
                PERFORM durable.spec_error(p || '.depends_on', 'must be an array of step names');
            END IF;
            FOR j IN 0 .. jsonb_array_length(step -> 'depends_on') - 1 LOOP
                dep := step -> 'depends_on' -> j;
                IF jsonb_typeof(dep) <> 'string' THEN
                    PERFORM durable.spec_error(p || '.depends_on[' || j || ']', 'must be a step name (string)');
                END IF;
                IF NOT (dep #>> '{}') = ANY (names) THEN
                    PERFORM durable.spec_error(p || '.depends_on[' || j || ']', 'unknown step "' || (dep #>> '{}') || '"');
                END IF;
                IF (dep #>> '{}') = step_name THEN
                    PERFORM durable.spec_error(p || '.depends_on[' || j || ']', 'a step cannot depend on itself');
                END IF;
                IF (dep #>> '{}') = ANY (deps) THEN
                    PERFORM durable.spec_error(p || '.depends_on[' || j || ']', 'duplicate dependency "' || (dep #>> '{}') || '"');
                END IF;
                deps := array_append(deps, dep #>> '{}');
            END LOOP;
        END IF;

        labels := coalesce(step -> 'labels', '{}'::jsonb);
        IF jsonb_typeof(labels) = 'null' THEN labels := '{}'::jsonb; END IF;
        IF jsonb_typeof(labels) <> 'object' THEN
            PERFORM durable.spec_error(p || '.labels', 'must be an object of string values');
        END IF;
        FOR lk, lv IN SELECT * FROM jsonb_each(labels) LOOP
            IF btrim(lk) = '' THEN
                PERFORM durable.spec_error(p || '.labels', 'a label name must not be empty or blank');
            END IF;
            IF jsonb_typeof(lv) <> 'string' THEN
                PERFORM durable.spec_error(p || '.labels.' || lk, 'must be a string, got ' || jsonb_typeof(lv));
            END IF;
        END LOOP;

        r := coalesce(step -> 'retry', '{}'::jsonb);
        IF jsonb_typeof(r) = 'null' THEN r := '{}'::jsonb; END IF;
        IF jsonb_typeof(r) <> 'object' THEN PERFORM durable.spec_error(p || '.retry', 'must be an object'); END IF;
        PERFORM durable.check_keys(r, p || '.retry', ARRAY['max_attempts', 'initial_interval_ms', 'backoff_coefficient',
            'max_interval_ms', 'non_retryable_codes']);
        max_attempts := coalesce(durable.check_int(r -> 'max_attempts', p || '.retry.max_attempts', 1, 1000), 3);
        initial_ms := coalesce(durable.check_int(r -> 'initial_interval_ms', p || '.retry.initial_interval_ms', 0, 86400000), 1000);
        IF r ? 'backoff_coefficient' AND jsonb_typeof(r -> 'backoff_coefficient') <> 'null' THEN
            IF jsonb_typeof(r -> 'backoff_coefficient') <> 'number' THEN
                PERFORM durable.spec_error(p || '.retry.backoff_coefficient', 'must be a number');
            END IF;
            coef := (r ->> 'backoff_coefficient')::numeric;
            IF coef < 1 OR coef > 100 THEN
                PERFORM durable.spec_error(p || '.retry.backoff_coefficient', 'must be between 1 and 100, got ' || coef);
            END IF;
        ELSE
            coef := 2.0;
        END IF;
        max_ms := coalesce(durable.check_int(r -> 'max_interval_ms', p || '.retry.max_interval_ms', 0, 604800000),
                           greatest(60000, initial_ms));
        IF max_ms < initial_ms THEN
            PERFORM durable.spec_error(p || '.retry.max_interval_ms', 'must be at least initial_interval_ms (' || initial_ms || ')');
        END IF;
        codes := coalesce(r -> 'non_retryable_codes', '[]'::jsonb);
        IF jsonb_typeof(codes) = 'null' THEN codes := '[]'::jsonb; END IF;
        IF jsonb_typeof(codes) <> 'array' OR EXISTS (SELECT 1 FROM jsonb_array_elements(codes) c WHERE jsonb_typeof(c) <> 'string') THEN
            PERFORM durable.spec_error(p || '.retry.non_retryable_codes', 'must be an array of error codes (strings)');
        END IF;
        retry := jsonb_build_object('max_attempts', max_attempts, 'initial_interval_ms', initial_ms,
                                    'backoff_coefficient', coef, 'max_interval_ms', max_ms,
                                    'non_retryable_codes', codes);

        timeout_ms := durable.check_int(step -> 'timeout_ms', p || '.timeout_ms', 1, 31536000000);
        hb_ms := durable.check_int(step -> 'heartbeat_timeout_ms', p || '.heartbeat_timeout_ms', 1, 86400000);
        deadline := NULL;
        IF step ? 'deadline' AND jsonb_typeof(step -> 'deadline') <> 'null' THEN
            IF jsonb_typeof(step -> 'deadline') <> 'string'
               OR (step ->> 'deadline') !~ '^\d{4}-\d{2}-\d{2}[Tt ]([01]\d|2[0-3]):[0-5]\d(:[0-5]\d(\.\d+)?)?([Zz]|[+-]\d{2}(:?\d{2})?)$' THEN
                PERFORM durable.spec_error(p || '.deadline', 'must be an RFC 3339 timestamp with a time zone, like 2026-12-01T00:00:00Z');
            END IF;
            BEGIN
                deadline := (step ->> 'deadline')::timestamptz;
            EXCEPTION WHEN OTHERS THEN
                PERFORM durable.spec_error(p || '.deadline', 'is not a valid timestamp: ' || (step ->> 'deadline'));
            END;
        END IF;

        secrets := '{}';
        IF step ? 'secrets' AND jsonb_typeof(step -> 'secrets') <> 'null' THEN
            IF jsonb_typeof(step -> 'secrets') <> 'array' THEN
                PERFORM durable.spec_error(p || '.secrets', 'must be an array of secret names');
            END IF;
            FOR j IN 0 .. jsonb_array_length(step -> 'secrets') - 1 LOOP
                IF jsonb_typeof(step -> 'secrets' -> j) <> 'string'
                   OR (step -> 'secrets' ->> j) !~ '^[A-Za-z_][A-Za-z0-9_]{0,127}$' THEN
                    PERFORM durable.spec_error(p || '.secrets[' || j || ']', 'must be a secret name like REPORT_API_TOKEN (letters, digits, _)');
                END IF;
                IF NOT (step -> 'secrets' ->> j) = ANY (secrets) THEN
                    secrets := array_append(secrets, step -> 'secrets' ->> j);
                END IF;
            END LOOP;
        END IF;
        -- every {"$secret": NAME} reference is resolved by the worker too
        SELECT coalesce(array_agg(DISTINCT x ORDER BY x), '{}') INTO secrets FROM unnest(secrets || refs) AS x;

        def.run_id := new_id; def.name := step_name; def.position := i;
        def.executor_kind := executor_kind; def.kind := kind;
        def.input := coalesce(step -> 'input', 'null'::jsonb); def.depends_on := deps;
        def.labels := labels; def.retry := retry; def.timeout_ms := timeout_ms;
        def.heartbeat_timeout_ms := hb_ms; def.deadline := deadline; def.secrets := secrets;
        def.deps_remaining := cardinality(deps);
        defs := array_append(defs, def);
    END LOOP;

    -- the definitions, in one statement
    INSERT INTO durable.step_defs SELECT * FROM unnest(defs);

    -- cycles: repeatedly remove steps whose dependencies are all removed
    remaining := names;
    LOOP
        progressed := false;
        FOR d IN SELECT name, depends_on FROM durable.step_defs sd0 WHERE sd0.run_id = new_id AND name = ANY (remaining) ORDER BY position LOOP
            IF NOT (d.depends_on && remaining) THEN
                remaining := array_remove(remaining, d.name);
                progressed := true;
            END IF;
        END LOOP;
        EXIT WHEN NOT progressed OR cardinality(remaining) = 0;
    END LOOP;
    IF cardinality(remaining) > 0 THEN
        SELECT position INTO i FROM durable.step_defs sd1 WHERE sd1.run_id = new_id AND name = remaining[1];
        PERFORM durable.spec_error('steps[' || i || '].depends_on',
            'dependency cycle among steps ' || array_to_string(ARRAY(SELECT '"' || x || '"' FROM unnest(remaining) x), ', '));
    END IF;

    INSERT INTO durable.transitions (run_id, from_state, to_state, reason) VALUES (new_id, NULL, 'pending', 'SUBMITTED');
    -- the roots' steps, in one statement
    PERFORM durable.create_steps(ARRAY(SELECT rd FROM unnest(defs) AS rd WHERE cardinality(rd.depends_on) = 0),
                                 coalesce(run_key, new_id::text));
    PERFORM set_config('durable.submitting_run', '', true);
    RETURN new_id;
END $$;

-- cancel_run: a step name the run does not have is refused (P0D04, exit 4
-- from `supervisor cancel`) on a terminal run too; before, a finished run
-- answered with its state, as if the step had been found. Otherwise
-- unchanged from 20261212000003_cancel_in_one_statement.
CREATE OR REPLACE FUNCTION durable.cancel_run(rid uuid, step_name text DEFAULT NULL, reason text DEFAULT 'CANCEL_REQUESTED')
RETURNS text LANGUAGE plpgsql AS $$
DECLARE
    cur text; run_key text; d durable.step_defs;
BEGIN
    SELECT state, coalesce(idempotency_key, id::text) INTO cur, run_key
      FROM durable.workflow_runs WHERE id = rid FOR NO KEY UPDATE;
    IF cur IS NULL THEN
        RAISE EXCEPTION 'unknown run %', rid USING ERRCODE = 'P0D04';
    END IF;
    -- a step the run does not have is an error whatever the run's state
    IF step_name IS NOT NULL
       AND NOT EXISTS (SELECT 1 FROM durable.step_defs WHERE run_id = rid AND name = step_name) THEN
        RAISE EXCEPTION 'run % has no step named "%"', rid, step_name USING ERRCODE = 'P0D04';
    END IF;
    IF durable.run_state_is_terminal(cur) THEN
        RETURN cur;
    END IF;
    IF step_name IS NULL THEN
        -- the run's flag first: from its commit on, no step of this run is
        -- leased and the heartbeat reports every lease of it as cancelled
        UPDATE durable.workflow_runs SET cancel_requested = true WHERE id = rid AND NOT cancel_requested;
        -- steps not created yet will now never run: create them cancelled
        -- (in one statement)
        PERFORM durable.create_steps(
            ARRAY(SELECT sd FROM durable.step_defs sd
                   WHERE sd.run_id = rid
                     AND NOT EXISTS (SELECT 1 FROM durable.step_runs s WHERE s.run_id = rid AND s.name = sd.name)
                   ORDER BY sd.position),
            run_key);
        -- one statement over every open step, locked in id order: a step that
        -- is leased between the lock and the write is re-checked on its new
        -- version and flagged instead of cancelled, never missed
        WITH open_steps AS (
            SELECT id FROM durable.step_runs
             WHERE run_id = rid AND state IN ('pending', 'retryable_failed', 'leased', 'running')
             ORDER BY id FOR NO KEY UPDATE
        )
        UPDATE durable.step_runs s
           SET state = CASE WHEN s.state IN ('pending', 'retryable_failed') THEN 'cancelled' ELSE s.state END,
               transition_reason = CASE WHEN s.state IN ('pending', 'retryable_failed') THEN reason ELSE s.transition_reason END,
               transition_by = CASE WHEN s.state IN ('pending', 'retryable_failed') THEN NULL ELSE s.transition_by END,
               cancel_requested = true
          FROM open_steps o WHERE s.id = o.id;
    ELSE
        IF NOT EXISTS (SELECT 1 FROM durable.step_defs WHERE run_id = rid AND name = step_name) THEN
            RAISE EXCEPTION 'run % has no step named "%"', rid, step_name USING ERRCODE = 'P0D04';
        END IF;
        IF NOT EXISTS (SELECT 1 FROM durable.step_runs WHERE run_id = rid AND name = step_name) THEN
            SELECT * INTO d FROM durable.step_defs WHERE run_id = rid AND name = step_name;
            PERFORM durable.materialize_step(d, run_key);
        END IF;
        UPDATE durable.step_runs s
           SET state = CASE WHEN s.state IN ('pending', 'retryable_failed') THEN 'cancelled' ELSE s.state END,
               transition_reason = CASE WHEN s.state IN ('pending', 'retryable_failed') THEN reason ELSE s.transition_reason END,
               transition_by = CASE WHEN s.state IN ('pending', 'retryable_failed') THEN NULL ELSE s.transition_by END,
               cancel_requested = true
         WHERE s.run_id = rid AND s.name = step_name
           AND s.state IN ('pending', 'retryable_failed', 'leased', 'running');
    END IF;
    PERFORM pg_notify('durable_cancel', rid::text);
    RETURN durable.recompute_run(rid, 'cancel requested');
END $$;

