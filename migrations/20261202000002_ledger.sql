-- The ledger's batched writes (issue 7): one worker's starts, plain progress
-- events and plain completions, many leases per statement.
--
-- Each function takes parallel arrays, one element per intent, and returns a
-- row per intent: `ok`, `lost` (the fence did not hold: wrong token, or the
-- step moved on — that intent alone is LeaseLost), or `error` with the
-- SQLSTATE and message of what the database refused for that intent alone.
-- Every intent runs in its own subtransaction (a plpgsql EXCEPTION block), so
-- one refused row never takes the rest of the batch with it; the caller
-- decides per intent whether the error is transient (retry) or permanent.
--
-- Lock order: the caller passes the intents sorted by (run id, step id), and
-- each intent locks its run row (FOR NO KEY UPDATE) before its step row, as
-- every writer does. A batch therefore takes run locks in ascending id order;
-- a single-step writer takes one run lock; cascades stay inside their run:
-- no wait cycle is possible. The caller keeps batches small (a subtransaction
-- per intent; PostgreSQL keeps 64 of them in a backend's cache).

CREATE FUNCTION durable.start_steps(p_worker text, p_ids uuid[], p_tokens uuid[], p_pids integer[],
                                    p_sequences bigint[], p_kinds text[], p_messages text[],
                                    p_fractions double precision[], p_executor_at timestamptz[])
RETURNS TABLE (idx integer, status text, err_state text, err_message text)
LANGUAGE plpgsql AS $$
DECLARE
    i integer;
BEGIN
    FOR i IN 1 .. coalesce(cardinality(p_ids), 0) LOOP
        idx := i; err_state := NULL; err_message := NULL;
        BEGIN
            IF durable.start_step(p_ids[i], p_tokens[i], p_worker, p_pids[i], p_sequences[i], p_kinds[i],
                                  p_messages[i], p_fractions[i], p_executor_at[i]) THEN
                status := 'ok';
            ELSE
                status := 'lost';
            END IF;
        EXCEPTION WHEN OTHERS THEN
            status := 'error'; err_state := SQLSTATE; err_message := SQLERRM;
        END;
        RETURN NEXT;
    END LOOP;
END $$;

-- Completions without artifacts (the common case; a result with artifacts
-- carries its bytes and is written on its own).
CREATE FUNCTION durable.complete_steps(p_worker text, p_ids uuid[], p_tokens uuid[], p_outputs jsonb[],
                                       p_sequences bigint[])
RETURNS TABLE (idx integer, status text, err_state text, err_message text)
LANGUAGE plpgsql AS $$
DECLARE
    i integer;
BEGIN
    FOR i IN 1 .. coalesce(cardinality(p_ids), 0) LOOP
        idx := i; err_state := NULL; err_message := NULL;
        BEGIN
            IF durable.complete_step(p_ids[i], p_tokens[i], p_worker, p_outputs[i], p_sequences[i],
                                     '{}'::text[], '{}'::text[], '{}'::text[], '{}'::bytea[], '[]'::jsonb) IS NULL THEN
                status := 'lost';
            ELSE
                status := 'ok';
            END IF;
        EXCEPTION WHEN OTHERS THEN
            status := 'error'; err_state := SQLSTATE; err_message := SQLERRM;
        END;
        RETURN NEXT;
    END LOOP;
END $$;

-- Plain progress events (no checkpoint) of many leases: the fence only reads
-- the step row (no lock, no rewrite of it); a retried batch inserts nothing
-- twice. Events come as flat arrays, `p_event_lease[j]` naming the index of
-- their lease in `p_ids`.
CREATE FUNCTION durable.record_plain_events(p_ids uuid[], p_tokens uuid[], p_event_lease integer[],
                                            p_sequences bigint[], p_kinds text[], p_messages text[],
                                            p_fractions double precision[], p_executor_at timestamptz[])
RETURNS TABLE (idx integer, status text, err_state text, err_message text)
LANGUAGE sql AS $$
    WITH l AS (
        SELECT * FROM unnest(p_ids, p_tokens) WITH ORDINALITY AS l(id, token, n)
    ), f AS (
        SELECT l.n, s.id, s.attempt
          FROM l JOIN durable.step_runs s ON s.id = l.id AND s.lease_token = l.token
                                          AND s.state IN ('leased', 'running')
    ), ins AS (
        INSERT INTO durable.step_events (step_run_id, attempt, sequence, kind, message, fraction, checkpoint, executor_at)
        SELECT f.id, f.attempt, e.seq, e.kind, e.msg, e.frac, false, e.at
          FROM unnest(p_event_lease, p_sequences, p_kinds, p_messages, p_fractions, p_executor_at)
               AS e(n, seq, kind, msg, frac, at)
          JOIN f ON f.n = e.n
         ORDER BY f.id, e.seq
        ON CONFLICT DO NOTHING
    )
    SELECT l.n::integer, CASE WHEN f.id IS NULL THEN 'lost' ELSE 'ok' END, NULL::text, NULL::text
      FROM l LEFT JOIN f ON f.n = l.n
     ORDER BY l.n
$$;
