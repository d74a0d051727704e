-- The guards judge a transition without a query, and a ledger batch locks
-- its runs once.
--
-- Every UPDATE of a step or a run goes through a row guard (a BEFORE ROW
-- trigger in PL/pgSQL). To judge a state change it read the transition
-- table (`EXISTS (SELECT 1 FROM durable.step_transition_rules ...)`): a
-- query through the executor per row, two per row for a write through a
-- state (a start and its completion written as one). A ledger flush of 50
-- no-op completions of one-step runs is 100 such row writes (the steps and
-- their runs), 200 queries. Now the rules are a generated IMMUTABLE SQL
-- function per table, `(from, to) IN (<the table's pairs>)`, which the
-- planner inlines into the guard's expression: no query, no table read.
-- The tables stay the one source of the rules (the chaos test compares them
-- with supervisor::state): a statement trigger on each regenerates the
-- functions whenever its rows change, so what the guards allow follows the
-- tables as before.
--
-- A batch with starts and completions locked its runs three times: once up
-- front for the whole batch (write_sets, in id order), then again in each
-- set form's lock_batch (the same runs, already held: the probes, the sort
-- and the lock checks for nothing). write_sets now tells lock_batch, by
-- the transaction-local setting `durable.batch_runs_locked`, that the runs
-- are held, once it has locked the runs of every step the batch names, and
-- clears it before it returns; any other caller locks as before.
--
-- Measured with pgbench on one connection (submit 50 one-step runs, lease
-- them, then one write_sets of their 50 starts and completions, timed
-- alone; a fresh database per variant, 4 x 25 batches each, alternated):
-- write_sets ~6.8-6.9 ms before, ~6.3 ms with the guards alone, ~6.15 ms
-- with both. Through the whole worker (bench_executors, persistent Go,
-- concurrency 64, 4,096 one-step runs, three alternations against the
-- previous head): the worker's database CPU per step 0.17-0.18 -> 0.15-0.16
-- ms; steps/s 4,817-4,950 -> 4,836-5,076, within the noise (the machine is
-- 87% busy, and the Go child and the worker take the rest).

-- Writes durable.step_hop_is_legal(from, to) and durable.run_hop_is_legal(from,
-- to) from the rules tables: a SQL function whose body is one expression
-- without a FROM is inlined where it is called. An empty table allows
-- nothing, nor does a NULL state.
CREATE FUNCTION durable.regenerate_transition_checks() RETURNS void LANGUAGE plpgsql AS $g$
DECLARE steps text; runs text;
BEGIN
    SELECT coalesce(string_agg(format('(%L, %L)', from_state, to_state), ', ' ORDER BY from_state, to_state), '')
      INTO steps FROM durable.step_transition_rules;
    SELECT coalesce(string_agg(format('(%L, %L)', from_state, to_state), ', ' ORDER BY from_state, to_state), '')
      INTO runs FROM durable.run_transition_rules;
    EXECUTE format($f$CREATE OR REPLACE FUNCTION durable.step_hop_is_legal(f text, t text) RETURNS boolean
        LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $b$ SELECT coalesce((f, t) IN (%s), false) $b$$f$,
        CASE WHEN steps = '' THEN '(NULL, NULL)' ELSE steps END);
    EXECUTE format($f$CREATE OR REPLACE FUNCTION durable.run_hop_is_legal(f text, t text) RETURNS boolean
        LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $b$ SELECT coalesce((f, t) IN (%s), false) $b$$f$,
        CASE WHEN runs = '' THEN '(NULL, NULL)' ELSE runs END);
END $g$;
SELECT durable.regenerate_transition_checks();

CREATE FUNCTION durable.on_transition_rules_changed()
RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM durable.regenerate_transition_checks();
    RETURN NULL;
END $$;

CREATE TRIGGER step_transition_rules_changed
    AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON durable.step_transition_rules
    FOR EACH STATEMENT EXECUTE FUNCTION durable.on_transition_rules_changed();
CREATE TRIGGER run_transition_rules_changed
    AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON durable.run_transition_rules
    FOR EACH STATEMENT EXECUTE FUNCTION durable.on_transition_rules_changed();

-- The guards as in 20261210000001_fused_start, each rule check an inlined
-- expression instead of a query.
CREATE OR REPLACE FUNCTION durable.guard_step_update()
RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF durable.step_state_is_terminal(OLD.state) THEN
        RAISE EXCEPTION 'step % (%) is %: a terminal step never changes', OLD.name, OLD.id, OLD.state
            USING ERRCODE = 'P0D01';
    END IF;
    IF NEW.id <> OLD.id OR NEW.run_id <> OLD.run_id OR NEW.name <> OLD.name
       OR NEW.idempotency_key <> OLD.idempotency_key THEN
        RAISE EXCEPTION 'step % (%): identity columns never change', OLD.name, OLD.id
            USING ERRCODE = 'P0D02';
    END IF;
    IF NEW.state IS DISTINCT FROM OLD.state THEN
        -- a writer that did not say why must not inherit the previous reason
        IF NEW.transition_reason IS NOT DISTINCT FROM OLD.transition_reason
           AND NEW.transition_by IS NOT DISTINCT FROM OLD.transition_by THEN
            NEW.transition_reason := NULL;
            NEW.transition_by := NULL;
        END IF;
        IF NEW.via_state IS NOT NULL THEN
            -- two transitions in one write: each hop must be legal
            IF NOT (durable.step_hop_is_legal(OLD.state, NEW.via_state)
                    AND durable.step_hop_is_legal(NEW.via_state, NEW.state)) THEN
                RAISE EXCEPTION 'illegal step transition % -> % -> % for step % (%)', OLD.state, NEW.via_state,
                    NEW.state, OLD.name, OLD.id
                    USING ERRCODE = 'P0D03';
            END IF;
        ELSIF NOT durable.step_hop_is_legal(OLD.state, NEW.state) THEN
            RAISE EXCEPTION 'illegal step transition % -> % for step % (%)', OLD.state, NEW.state, OLD.name, OLD.id
                USING ERRCODE = 'P0D03';
        END IF;
        IF durable.step_state_is_terminal(NEW.state) THEN
            NEW.finished_at := now();
            NEW.lease_expires_at := NULL;
        END IF;
        NEW.prev_state := OLD.state;
    ELSE
        NEW.prev_state := NULL;
        NEW.via_state := NULL;
    END IF;
    NEW.updated_at := now();
    RETURN NEW;
END $$;

CREATE OR REPLACE FUNCTION durable.guard_run_update()
RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF durable.run_state_is_terminal(OLD.state) THEN
        RAISE EXCEPTION 'run % is %: a terminal run never changes', OLD.id, OLD.state
            USING ERRCODE = 'P0D01';
    END IF;
    IF NEW.state IS DISTINCT FROM OLD.state THEN
        IF NEW.via_state IS NOT NULL THEN
            -- two transitions in one write: each hop must be legal
            IF NOT (durable.run_hop_is_legal(OLD.state, NEW.via_state)
                    AND durable.run_hop_is_legal(NEW.via_state, NEW.state)) THEN
                RAISE EXCEPTION 'illegal run transition % -> % -> % for run %', OLD.state, NEW.via_state,
                    NEW.state, OLD.id
                    USING ERRCODE = 'P0D03';
            END IF;
        ELSIF NOT durable.run_hop_is_legal(OLD.state, NEW.state) THEN
            RAISE EXCEPTION 'illegal run transition % -> % for run %', OLD.state, NEW.state, OLD.id
                USING ERRCODE = 'P0D03';
        END IF;
        IF durable.run_state_is_terminal(NEW.state) THEN
            NEW.finished_at := now();
        END IF;
    ELSE
        NEW.via_state := NULL;
    END IF;
    NEW.updated_at := now();
    RETURN NEW;
END $$;

-- The batch's runs, locked once: lock_batch as in 20261205000001_bounded_reads
-- but for the setting.
CREATE OR REPLACE FUNCTION durable.lock_batch(p_ids uuid[], p_tokens uuid[],
                                              OUT n integer[], OUT id uuid[], OUT state text[], OUT attempt integer[])
LANGUAGE plpgsql AS $$
BEGIN
    -- inside write_sets, once it has locked the runs of all its steps, the
    -- runs are held already; any other caller locks them here
    IF current_setting('durable.batch_runs_locked', true) IS DISTINCT FROM 'on' THEN
        PERFORM durable.lock_runs_of(p_ids);
    END IF;
    SELECT array_agg(x.n ORDER BY x.id), array_agg(x.id ORDER BY x.id),
           array_agg(x.state ORDER BY x.id), array_agg(x.attempt ORDER BY x.id)
      INTO n, id, state, attempt
      FROM (SELECT u.n::integer AS n, s.id, s.state, s.attempt
              FROM (SELECT * FROM unnest(p_ids, p_tokens) WITH ORDINALITY AS u(id, token, n)
                     ORDER BY u.id) u
             CROSS JOIN LATERAL (SELECT s.id, s.state, s.attempt FROM durable.step_runs s
                                  WHERE s.id = u.id AND s.lease_token = u.token
                                    AND s.state IN ('leased', 'running')
                                  FOR NO KEY UPDATE) s) x;
END $$;

CREATE OR REPLACE FUNCTION durable.write_sets(p_worker text, p_lock_steps uuid[], s_ids uuid[], s_tokens uuid[], s_pids integer[], s_sequences bigint[], s_kinds text[], s_messages text[], s_fractions double precision[], s_executor_at timestamp with time zone[], x_start integer[], x_sequences bigint[], x_kinds text[], x_messages text[], x_fractions double precision[], x_executor_at timestamp with time zone[], e_ids uuid[], e_tokens uuid[], e_event_lease integer[], e_sequences bigint[], e_kinds text[], e_messages text[], e_fractions double precision[], e_executor_at timestamp with time zone[], c_ids uuid[], c_tokens uuid[], c_outputs jsonb[], c_sequences bigint[])
RETURNS TABLE(part text, idx integer, status text, err_state text, err_message text)
LANGUAGE plpgsql AS $$
DECLARE
    c_start integer[]; s_defer boolean[]; c_pids integer[]; fix integer[] := '{}'; rc record;
BEGIN
    IF cardinality(p_lock_steps) > 0 THEN
        PERFORM durable.lock_runs_of(p_lock_steps);
        -- every run of the set part is locked now (the caller names all
        -- its steps): the set forms' lock_batch need not lock them again
        IF coalesce(s_ids, '{}') || coalesce(c_ids, '{}') <@ p_lock_steps THEN
            PERFORM set_config('durable.batch_runs_locked', 'on', true);
        END IF;
    END IF;
    -- A lease whose start and completion are both in this call: the start
    -- is fenced and its events written as before, but its state change is
    -- deferred to the completion, which writes leased -> running ->
    -- succeeded as one row version (c_start[j]: the start of completion j).
    IF cardinality(s_ids) > 0 AND cardinality(c_ids) > 0 THEN
        SELECT array_agg(m.i ORDER BY c.j) INTO c_start
          FROM unnest(c_ids, c_tokens) WITH ORDINALITY AS c(id, token, j)
          LEFT JOIN (SELECT s.id, s.token, min(s.i)::integer AS i
                       FROM unnest(s_ids, s_tokens) WITH ORDINALITY AS s(id, token, i)
                      GROUP BY s.id, s.token) m ON m.id = c.id AND m.token = c.token;
        IF EXISTS (SELECT 1 FROM unnest(c_start) AS x WHERE x IS NOT NULL) THEN
            SELECT array_agg(s.i = ANY (c_start) ORDER BY s.i) INTO s_defer
              FROM generate_subscripts(s_ids, 1) AS s(i);
            SELECT array_agg(s_pids[u.i] ORDER BY u.j) INTO c_pids
              FROM unnest(c_start) WITH ORDINALITY AS u(i, j);
        ELSE
            c_start := NULL;
        END IF;
    END IF;
    IF cardinality(s_ids) > 0 THEN
        RETURN QUERY SELECT 'start', r.idx, r.status, r.err_state, r.err_message
          FROM durable.start_steps(p_worker, s_ids, s_tokens, s_pids, s_sequences, s_kinds, s_messages,
                                   s_fractions, s_executor_at, x_start, x_sequences, x_kinds, x_messages,
                                   x_fractions, x_executor_at, s_defer) r;
    END IF;
    IF cardinality(e_ids) > 0 THEN
        RETURN QUERY SELECT 'event', r.idx, r.status, r.err_state, r.err_message
          FROM durable.record_plain_events(e_ids, e_tokens, e_event_lease, e_sequences, e_kinds,
                                           e_messages, e_fractions, e_executor_at) r;
    END IF;
    IF cardinality(c_ids) > 0 THEN
        FOR rc IN SELECT * FROM durable.complete_steps(p_worker, c_ids, c_tokens, c_outputs, c_sequences, c_pids) LOOP
            part := 'complete'; idx := rc.idx; status := rc.status;
            err_state := rc.err_state; err_message := rc.err_message;
            RETURN NEXT;
            IF c_start[rc.idx] IS NOT NULL AND rc.status <> 'ok' THEN
                fix := fix || c_start[rc.idx];
            END IF;
        END LOOP;
        -- a deferred start whose completion was not written (refused, or
        -- lost): the start itself still is, as it was answered
        IF cardinality(fix) > 0 THEN
            UPDATE durable.step_runs s
               SET state = 'running', started_at = now(), executor_pid = s_pids[f.i],
                   transition_reason = 'ACCEPTED', transition_by = p_worker
              FROM unnest(fix) AS f(i)
             WHERE s.id = s_ids[f.i] AND s.lease_token = s_tokens[f.i] AND s.state = 'leased';
        END IF;
    END IF;
    -- (an error rolls the setting back with the statement's savepoint or
    -- transaction; here it is cleared for the statements that follow)
    PERFORM set_config('durable.batch_runs_locked', '', true);
END $$;
