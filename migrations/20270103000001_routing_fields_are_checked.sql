-- A step's routing fields (executor_kind, kind, labels) are what a worker's
-- routes are matched against, byte for byte, and what the routing index
-- holds (step_runs_route_labels: executor_kind, kind, labels,
-- next_attempt_at). Outside audit 91 found two ways a submit went wrong:
--   * labels larger than an index row may be (2,704 bytes after
--     compression: 3,000 random letters, or 1,000 small labels) were
--     refused by the index with a raw database error and exit 1, which
--     README says to retry, and no retry can succeed;
--   * a control character or surrounding whitespace in executor_kind, kind
--     or a label's name ("go ", "demo.\techo", "a\nb") was accepted, and the
--     step waited for ever: no executor's hello offers such a name.
-- Both are refused now as every other spec error is (SQLSTATE 22023, the
-- field's path, what to change: exit 2), before anything is written: the
-- definitions are inserted in the submit's statement, and the refusal rolls
-- it back whole. A check per definition row, fired only when a row needs
-- one (the trigger's WHEN is evaluated without a function call): steps
-- with no labels and plain names pay a comparison or two.

CREATE FUNCTION durable.check_routing_fields() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    p text := 'steps[' || NEW.position || ']';
    bad constant text := '[\u0001-\u001f\u007f-\u009f]';
    -- Unicode's White_Space, whatever the database's locale ([[:space:]]
    -- is the locale's: a C-locale database took U+3000 for a letter, a92)
    edge constant text := '^[\t\n\u000b\f\r \u0085\u00a0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]|[\t\n\u000b\f\r \u0085\u00a0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]$';
    k text; v jsonb;
BEGIN
    IF NEW.executor_kind ~ bad OR NEW.executor_kind ~ edge THEN
        PERFORM durable.spec_error(p || '.executor_kind',
            'must not contain control characters nor begin or end with whitespace: it is matched as it is against the executor_kind an executor''s hello names');
    END IF;
    IF NEW.kind ~ bad OR NEW.kind ~ edge THEN
        PERFORM durable.spec_error(p || '.kind',
            'must not contain control characters nor begin or end with whitespace: it is matched as it is against the kinds an executor''s hello offers');
    END IF;
    IF octet_length(NEW.labels::text) > 1024 THEN
        PERFORM durable.spec_error(p || '.labels',
            'is larger than 1 KiB as stored (' || octet_length(NEW.labels::text)
            || ' bytes of JSON): labels say what a step needs of a worker (a few short names and values); pass data in input');
    END IF;
    FOR k, v IN SELECT * FROM jsonb_each(NEW.labels) LOOP
        IF k ~ bad OR k ~ edge THEN
            PERFORM durable.spec_error(p || '.labels',
                'a label name must not contain control characters nor begin or end with whitespace: '
                || to_jsonb(k)::text);
        END IF;
        IF (v #>> '{}') ~ bad THEN
            PERFORM durable.spec_error(p || '.labels.' || k, 'must not contain control characters');
        END IF;
    END LOOP;
    RETURN NEW;
END $$;

CREATE TRIGGER step_defs_routing_checked BEFORE INSERT ON durable.step_defs
    FOR EACH ROW
    WHEN (NEW.labels <> '{}'::jsonb
          OR NEW.executor_kind ~ '[\u0001-\u001f\u007f-\u009f]|^[\t\n\u000b\f\r \u0085\u00a0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]|[\t\n\u000b\f\r \u0085\u00a0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]$'
          OR NEW.kind ~ '[\u0001-\u001f\u007f-\u009f]|^[\t\n\u000b\f\r \u0085\u00a0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]|[\t\n\u000b\f\r \u0085\u00a0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]$')
    EXECUTE FUNCTION durable.check_routing_fields();
