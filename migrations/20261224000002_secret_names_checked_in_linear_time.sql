-- A spec's secret names are checked in time linear in their number (scale
-- audit): `secrets` were deduplicated by a probe of the names kept so far
-- per name, and every {"$secret": NAME} reference of an input was appended
-- to an array threaded through each recursive call of check_secret_keys
-- (copied at every call): 20,000 names took 6.3 s, 20,000 references 3.2 s,
-- 40,000 references 14 s, and a 16 MiB spec (any role with EXECUTE on
-- submit_run) could hold a backend for hours. The input's shape is checked
-- by the recursion alone, and its references are gathered by one walk of its
-- values (here); the names are checked by one pass and deduplicated by one
-- DISTINCT in submit_run (20261224000004, which replaces it for another fix
-- too). Otherwise unchanged from 20261214000001 (the input's check).

-- the input's check, without the references: a walk of its own
CREATE FUNCTION durable.check_secret_shapes(v jsonb, path text, depth int) RETURNS void LANGUAGE plpgsql AS $$
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
            PERFORM durable.check_secret_shapes(child, path || '.' || k, depth + 1);
        END LOOP;
    ELSE
        FOR i IN 0 .. jsonb_array_length(v) - 1 LOOP
            PERFORM durable.check_secret_shapes(v -> i, path || '[' || i || ']', depth + 1);
        END LOOP;
    END IF;
END $$;

-- checks the input and adds its references to refs (the shape checked
-- first: a reference is an object of the one key "$secret" with a name)
CREATE OR REPLACE FUNCTION durable.check_secret_keys(v jsonb, path text, INOUT refs text[]) LANGUAGE plpgsql AS $$
BEGIN
    PERFORM durable.check_secret_shapes(v, path, 0);
    IF jsonb_typeof(v) IN ('object', 'array') THEN
        -- every value of the input, by one walk (jsonpath's `$.**` and a
        -- loop of `v -> i` over a stored value are quadratic in an array's
        -- length)
        refs := refs || ARRAY(
            WITH RECURSIVE t(x) AS (
                SELECT v
                UNION ALL
                SELECT c.value FROM t CROSS JOIN LATERAL (
                    SELECT e.value FROM jsonb_each(CASE WHEN jsonb_typeof(t.x) = 'object' THEN t.x END) AS e
                    UNION ALL
                    SELECT a.value FROM jsonb_array_elements(CASE WHEN jsonb_typeof(t.x) = 'array' THEN t.x END) AS a
                ) AS c
                 WHERE jsonb_typeof(t.x) IN ('object', 'array')
            )
            SELECT x ->> '$secret' FROM t
             WHERE jsonb_typeof(x) = 'object' AND x ? '$secret'
               AND (SELECT count(*) FROM jsonb_object_keys(x)) = 1);
    END IF;
END $$;
DROP FUNCTION durable.check_secret_keys(jsonb, text, int, text[]);
