-- A submit whose idempotency key names a run that exists returned that run's
-- id and said nothing (workflow-semantics audit): a client that changed its
-- spec but kept the key got the old run, its new spec never run, and could
-- not tell. submit_run now records what it did in the transaction-local
-- setting durable.submit_outcome, which any caller may read in the same
-- transaction, with no grant beyond EXECUTE on submit_run:
--   'created'                       a new run was made from this spec;
--   'known, same spec'              the key named a run made from this very spec;
--   'known, other spec'             the key named a run made from another spec
--                                   (this one, valid, was not submitted).
-- The returned id is unchanged in every case. Otherwise unchanged from
-- 20261224000004.
CREATE OR REPLACE FUNCTION durable.submit_run(spec jsonb) RETURNS uuid LANGUAGE plpgsql AS $$
DECLARE
    new_id uuid := durable.time_ordered_uuid();
    existing uuid; existing_spec jsonb;
    run_name text; run_key text;
    steps jsonb; step jsonb; p text; i int; j int; n int;
    names text[] := '{}';
    step_name text; executor_kind text; kind text;
    deps text[]; dep jsonb; labels jsonb; retry jsonb; secrets text[]; refs text[];
    timeout_ms bigint; hb_ms bigint; deadline timestamptz;
    lv jsonb; lk text;
    cycle text[];
    -- the definitions, validated one by one and written in one statement
    n_roots int := 0;
    n_deps int := 0;
    def durable.step_defs; defs durable.step_defs[] := '{}';
BEGIN
    IF spec IS NULL OR jsonb_typeof(spec) <> 'object' THEN
        PERFORM durable.spec_error('spec', 'must be a JSON object');
    END IF;
    IF octet_length(spec::text) > 16 * 1024 * 1024 THEN
        PERFORM durable.spec_error('spec', 'is larger than 16 MiB as stored (' || octet_length(spec::text)
            || ' bytes of PostgreSQL''s JSON text, which puts a space after each : and ,)');
    END IF;
    PERFORM durable.check_keys(spec, 'spec', ARRAY['name', 'idempotency_key', 'steps']);
    run_name := durable.check_string(spec -> 'name', 'name', true, 200);
    run_key := durable.check_string(spec -> 'idempotency_key', 'idempotency_key', false, 200);
    IF btrim(run_key, E' \t\n\r') = '' THEN
        PERFORM durable.spec_error('idempotency_key', 'must not be empty or blank (omit it instead)');
    END IF;
    -- a step's key is `<run key or run id>/<step>`: a run key that is the id
    -- of a run submitted without a key would give both runs' steps one key
    -- (a side effect of one skipped as a duplicate of the other's)
    IF run_key ~* '^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$'
       AND EXISTS (SELECT 1 FROM durable.workflow_runs w
                    WHERE w.id = run_key::uuid AND w.idempotency_key IS NULL) THEN
        PERFORM durable.spec_error('idempotency_key', 'is the id of another run (' || run_key
            || '), which has no key of its own: their steps would share idempotency keys; choose another key');
    END IF;

    IF run_key IS NOT NULL THEN
        SELECT id, w.spec INTO existing, existing_spec FROM durable.workflow_runs w WHERE idempotency_key = run_key;
        IF existing IS NOT NULL THEN
            PERFORM durable.refuse_a_run_being_removed(existing, run_key);
            -- the very spec the run was made from is not judged again: a
            -- check tightened since (an upgrade) must not fail a client's
            -- retried submit of a run that exists
            IF existing_spec IS DISTINCT FROM spec THEN
                PERFORM durable.check_whole_spec(spec);
                PERFORM set_config('durable.submit_outcome', 'known, other spec', true);
            ELSE
                PERFORM set_config('durable.submit_outcome', 'known, same spec', true);
            END IF;
            RETURN existing;
        END IF;
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
            PERFORM durable.spec_error(p || '.name', 'may contain only ASCII letters, digits, ".", "_" and "-" and must start with a letter or digit');
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
        SELECT id, w.spec INTO existing, existing_spec FROM durable.workflow_runs w WHERE idempotency_key = run_key;
        PERFORM durable.refuse_a_run_being_removed(existing, run_key);
        IF existing_spec IS DISTINCT FROM spec THEN
            PERFORM durable.check_whole_spec(spec);
            PERFORM set_config('durable.submit_outcome', 'known, other spec', true);
        ELSE
            PERFORM set_config('durable.submit_outcome', 'known, same spec', true);
        END IF;
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
            PERFORM durable.spec_error(p || '.input', 'is larger than 1 MiB as stored ('
                || octet_length((step -> 'input')::text)
                || ' bytes of PostgreSQL''s JSON text, which puts a space after each : and ,); pass large data as an artifact');
        END IF;
        refs := durable.check_secret_keys(coalesce(step -> 'input', 'null'::jsonb), p || '.input', '{}'::text[]);

        deps := '{}';
        IF step ? 'depends_on' AND jsonb_typeof(step -> 'depends_on') <> 'null' THEN
            IF jsonb_typeof(step -> 'depends_on') <> 'array' THEN
                PERFORM durable.spec_error(p || '.depends_on', 'must be an array of step names');
            END IF;
            n_deps := n_deps + jsonb_array_length(step -> 'depends_on');
            IF n_deps > 20000 THEN
                PERFORM durable.spec_error(p || '.depends_on', 'the run has more than 20,000 dependencies (depends_on entries) in all; '
                    || 'split it into runs, or let a step depend on one that gathers many');
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
            IF btrim(lk, E' \t\r\n\f' || chr(11)) = '' THEN
                PERFORM durable.spec_error(p || '.labels', 'a label name must not be empty or blank');
            END IF;
            IF jsonb_typeof(lv) <> 'string' THEN
                PERFORM durable.spec_error(p || '.labels.' || lk, 'must be a string, got ' || jsonb_typeof(lv));
            END IF;
        END LOOP;

        retry := durable.check_retry(step -> 'retry', p || '.retry');

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
            -- the first name that is not one, in one pass
            SELECT e.ord - 1 INTO j
              FROM jsonb_array_elements(step -> 'secrets') WITH ORDINALITY AS e(v, ord)
             WHERE jsonb_typeof(e.v) <> 'string' OR (e.v #>> '{}') !~ '^[A-Za-z_][A-Za-z0-9_]{0,127}$'
             ORDER BY e.ord LIMIT 1;
            IF FOUND THEN
                PERFORM durable.spec_error(p || '.secrets[' || j || ']', 'must be a secret name like REPORT_API_TOKEN (letters, digits, _)');
            END IF;
            secrets := ARRAY(SELECT jsonb_array_elements_text(step -> 'secrets'));
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

    -- cycles: one of them, named step by step
    cycle := durable.dependency_cycle(new_id);
    IF cycle IS NOT NULL THEN
        SELECT position INTO i FROM durable.step_defs sd1 WHERE sd1.run_id = new_id AND name = cycle[1];
        PERFORM durable.spec_error('steps[' || i || '].depends_on',
            'dependency cycle: ' || array_to_string(ARRAY(SELECT '"' || x || '"' FROM unnest(cycle) x), ' → ')
            || ' (each depends on the next)');
    END IF;

    INSERT INTO durable.transitions (run_id, from_state, to_state, reason) VALUES (new_id, NULL, 'pending', 'SUBMITTED');
    -- the roots' steps, in one statement
    PERFORM durable.create_steps(ARRAY(SELECT rd FROM unnest(defs) AS rd WHERE cardinality(rd.depends_on) = 0),
                                 coalesce(run_key, new_id::text));
    PERFORM set_config('durable.submitting_run', '', true);
    PERFORM set_config('durable.submit_outcome', 'created', true);
    RETURN new_id;
END $$;
-- CREATE OR REPLACE resets what 20261218000002 set: the submitter still
-- needs EXECUTE only
ALTER FUNCTION durable.submit_run(jsonb) SECURITY DEFINER SET search_path = pg_catalog, pg_temp;
