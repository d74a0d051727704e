-- The durable step queue. Everything lives in the `durable` schema so the
-- runtime can share a database with its users' data.
--
-- Invariants the database enforces itself, whoever writes:
--   * a step or run changes state only along the seed design's transition tables
--     (step_transition_rules / run_transition_rules);
--   * a terminal step or run never changes again;
--   * every state change is recorded in `transitions` (from, to, when, by whom, why);
--   * the run's state is recomputed in the same transaction as each step's
--     terminal transition; dependents materialise when their last dependency succeeds;
--     the first terminal_failed step cancels the rest of its run.
-- Workers fence every write with their lease token (see supervisor/src/db).

CREATE SCHEMA IF NOT EXISTS durable;

-- ---------------------------------------------------------------------------
-- transition tables (mirrored by supervisor/src/state.rs; a test proves they agree)

CREATE TABLE durable.step_transition_rules (
    from_state text NOT NULL,
    to_state   text NOT NULL,
    PRIMARY KEY (from_state, to_state)
);
INSERT INTO durable.step_transition_rules (from_state, to_state) VALUES
    ('pending', 'leased'), ('pending', 'cancelled'),
    ('leased', 'running'), ('leased', 'retryable_failed'), ('leased', 'terminal_failed'), ('leased', 'cancelled'),
    ('running', 'succeeded'), ('running', 'retryable_failed'), ('running', 'terminal_failed'), ('running', 'cancelled'),
    ('retryable_failed', 'leased'), ('retryable_failed', 'cancelled');

CREATE TABLE durable.run_transition_rules (
    from_state text NOT NULL,
    to_state   text NOT NULL,
    PRIMARY KEY (from_state, to_state)
);
INSERT INTO durable.run_transition_rules (from_state, to_state) VALUES
    ('pending', 'running'), ('pending', 'cancelled'),
    ('running', 'succeeded'), ('running', 'failed'), ('running', 'cancelled');

CREATE FUNCTION durable.step_state_is_terminal(s text) RETURNS boolean
    LANGUAGE sql IMMUTABLE AS $$ SELECT s IN ('succeeded', 'terminal_failed', 'cancelled') $$;
CREATE FUNCTION durable.run_state_is_terminal(s text) RETURNS boolean
    LANGUAGE sql IMMUTABLE AS $$ SELECT s IN ('succeeded', 'failed', 'cancelled') $$;

-- ---------------------------------------------------------------------------
-- tables

CREATE TABLE durable.workers (
    id                uuid PRIMARY KEY,
    name              text NOT NULL,
    host              text NOT NULL,
    pid               integer NOT NULL,
    capabilities      jsonb NOT NULL DEFAULT '[]',
    started_at        timestamptz NOT NULL DEFAULT now(),
    last_heartbeat_at timestamptz NOT NULL DEFAULT now(),
    stopped_at        timestamptz
);

CREATE TABLE durable.workflow_runs (
    id               uuid PRIMARY KEY,
    name             text NOT NULL,
    idempotency_key  text UNIQUE,
    state            text NOT NULL DEFAULT 'pending'
                     CHECK (state IN ('pending', 'running', 'succeeded', 'failed', 'cancelled')),
    spec             jsonb NOT NULL,
    cancel_requested boolean NOT NULL DEFAULT false,
    created_at       timestamptz NOT NULL DEFAULT now(),
    updated_at       timestamptz NOT NULL DEFAULT now(),
    finished_at      timestamptz
);
CREATE INDEX workflow_runs_open ON durable.workflow_runs (created_at) WHERE state IN ('pending', 'running');

-- The normalised definition of every step of a run. A step_runs row exists
-- only once the step is ready (all dependencies succeeded).
CREATE TABLE durable.step_defs (
    run_id               uuid NOT NULL REFERENCES durable.workflow_runs (id) ON DELETE CASCADE,
    name                 text NOT NULL,
    position             integer NOT NULL,
    executor_kind        text NOT NULL,
    kind                 text NOT NULL,
    input                jsonb NOT NULL,
    depends_on           text[] NOT NULL,
    labels               jsonb NOT NULL,
    retry                jsonb NOT NULL,
    timeout_ms           bigint,
    heartbeat_timeout_ms bigint,
    deadline             timestamptz,
    secrets              text[] NOT NULL,
    PRIMARY KEY (run_id, name)
);

-- The queue rows.
CREATE TABLE durable.step_runs (
    id                   uuid PRIMARY KEY,
    run_id               uuid NOT NULL REFERENCES durable.workflow_runs (id) ON DELETE CASCADE,
    name                 text NOT NULL,
    position             integer NOT NULL,
    state                text NOT NULL DEFAULT 'pending'
                         CHECK (state IN ('pending', 'leased', 'running', 'retryable_failed',
                                          'succeeded', 'terminal_failed', 'cancelled')),
    executor_kind        text NOT NULL,
    kind                 text NOT NULL,
    labels               jsonb NOT NULL DEFAULT '{}',
    input                jsonb NOT NULL,
    -- stable across every attempt: side effects are keyed on it
    idempotency_key      text NOT NULL,
    -- attempts that executed (or are executing); a routing refusal gives its attempt back
    attempt              integer NOT NULL DEFAULT 0 CHECK (attempt >= 0),
    retry                jsonb NOT NULL,
    timeout_ms           bigint,
    heartbeat_timeout_ms bigint,
    deadline             timestamptz,
    secrets              text[] NOT NULL DEFAULT '{}',
    next_attempt_at      timestamptz NOT NULL DEFAULT now(),
    -- the lease: owner, fencing token, expiry on the database clock
    owner_worker_id      uuid,
    lease_token          uuid,
    lease_expires_at     timestamptz,
    leased_at            timestamptz,
    started_at           timestamptz,
    -- the process (and process group) of the running attempt, for operators
    executor_pid         integer,
    cancel_requested     boolean NOT NULL DEFAULT false,
    -- the last checkpoint reported, handed to the next attempt
    checkpoint           bytea,
    output               jsonb,
    error_code           text,
    error_message        text,
    error_retryable      boolean,
    error_details        jsonb,
    -- why and by whom the last state change happened (copied into transitions)
    transition_reason    text,
    transition_by        text,
    created_at           timestamptz NOT NULL DEFAULT now(),
    updated_at           timestamptz NOT NULL DEFAULT now(),
    finished_at          timestamptz,
    UNIQUE (run_id, name)
);
-- The lease scans only open rows: its cost does not grow with finished rows.
CREATE INDEX step_runs_queue ON durable.step_runs (next_attempt_at)
    WHERE state IN ('pending', 'retryable_failed');
CREATE INDEX step_runs_leases ON durable.step_runs (lease_expires_at)
    WHERE state IN ('leased', 'running');

CREATE TABLE durable.transitions (
    id          bigserial PRIMARY KEY,
    run_id      uuid NOT NULL REFERENCES durable.workflow_runs (id) ON DELETE CASCADE,
    step_run_id uuid REFERENCES durable.step_runs (id) ON DELETE CASCADE,
    from_state  text,
    to_state    text NOT NULL,
    attempt     integer,
    worker      text,
    reason      text,
    at          timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX transitions_run ON durable.transitions (run_id, id);
CREATE INDEX transitions_step ON durable.transitions (step_run_id, id);

CREATE TABLE durable.step_events (
    id           bigserial PRIMARY KEY,
    step_run_id  uuid NOT NULL REFERENCES durable.step_runs (id) ON DELETE CASCADE,
    attempt      integer NOT NULL,
    sequence     bigint NOT NULL,
    kind         text NOT NULL,
    message      text NOT NULL DEFAULT '',
    fraction     double precision,
    checkpoint   boolean NOT NULL DEFAULT false,
    executor_at  timestamptz,
    at           timestamptz NOT NULL DEFAULT clock_timestamp(),
    UNIQUE (step_run_id, attempt, sequence)
);

CREATE TABLE durable.artifact_blobs (
    sha256  text PRIMARY KEY,
    size    bigint NOT NULL,
    content bytea NOT NULL
);

CREATE TABLE durable.artifacts (
    id           uuid PRIMARY KEY,
    run_id       uuid NOT NULL REFERENCES durable.workflow_runs (id) ON DELETE CASCADE,
    step_run_id  uuid NOT NULL REFERENCES durable.step_runs (id) ON DELETE CASCADE,
    attempt      integer NOT NULL,
    name         text NOT NULL,
    sha256       text NOT NULL REFERENCES durable.artifact_blobs (sha256),
    size         bigint NOT NULL,
    media_type   text NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now(),
    UNIQUE (step_run_id, name)
);
CREATE TABLE durable.artifact_lineage (
    artifact_id     uuid NOT NULL REFERENCES durable.artifacts (id) ON DELETE CASCADE,
    derived_from_id uuid NOT NULL REFERENCES durable.artifacts (id) ON DELETE CASCADE,
    PRIMARY KEY (artifact_id, derived_from_id)
);

-- ---------------------------------------------------------------------------
-- transition guards

CREATE FUNCTION durable.guard_step_update() RETURNS trigger LANGUAGE plpgsql AS $$
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
        IF NOT EXISTS (SELECT 1 FROM durable.step_transition_rules r
                       WHERE r.from_state = OLD.state AND r.to_state = NEW.state) THEN
            RAISE EXCEPTION 'illegal step transition % -> % for step % (%)', OLD.state, NEW.state, OLD.name, OLD.id
                USING ERRCODE = 'P0D03';
        END IF;
        IF durable.step_state_is_terminal(NEW.state) THEN
            NEW.finished_at := now();
            NEW.lease_expires_at := NULL;
        END IF;
    END IF;
    NEW.updated_at := now();
    RETURN NEW;
END $$;

CREATE FUNCTION durable.guard_step_insert() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.state <> 'pending' THEN
        RAISE EXCEPTION 'a step is created pending, not % (step %)', NEW.state, NEW.name
            USING ERRCODE = 'P0D03';
    END IF;
    RETURN NEW;
END $$;

CREATE FUNCTION durable.guard_run_update() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF durable.run_state_is_terminal(OLD.state) THEN
        RAISE EXCEPTION 'run % is %: a terminal run never changes', OLD.id, OLD.state
            USING ERRCODE = 'P0D01';
    END IF;
    IF NEW.state IS DISTINCT FROM OLD.state THEN
        IF NOT EXISTS (SELECT 1 FROM durable.run_transition_rules r
                       WHERE r.from_state = OLD.state AND r.to_state = NEW.state) THEN
            RAISE EXCEPTION 'illegal run transition % -> % for run %', OLD.state, NEW.state, OLD.id
                USING ERRCODE = 'P0D03';
        END IF;
        IF durable.run_state_is_terminal(NEW.state) THEN
            NEW.finished_at := now();
        END IF;
    END IF;
    NEW.updated_at := now();
    RETURN NEW;
END $$;

CREATE FUNCTION durable.guard_run_insert() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.state <> 'pending' THEN
        RAISE EXCEPTION 'a run is created pending, not %', NEW.state USING ERRCODE = 'P0D03';
    END IF;
    RETURN NEW;
END $$;

CREATE TRIGGER step_runs_guard_update BEFORE UPDATE ON durable.step_runs
    FOR EACH ROW EXECUTE FUNCTION durable.guard_step_update();
CREATE TRIGGER step_runs_guard_insert BEFORE INSERT ON durable.step_runs
    FOR EACH ROW EXECUTE FUNCTION durable.guard_step_insert();
CREATE TRIGGER workflow_runs_guard_update BEFORE UPDATE ON durable.workflow_runs
    FOR EACH ROW EXECUTE FUNCTION durable.guard_run_update();
CREATE TRIGGER workflow_runs_guard_insert BEFORE INSERT ON durable.workflow_runs
    FOR EACH ROW EXECUTE FUNCTION durable.guard_run_insert();

-- ---------------------------------------------------------------------------
-- materialisation and run aggregation

-- Creates the step_runs row of a ready step definition.
CREATE FUNCTION durable.materialize_step(d durable.step_defs, run_key text) RETURNS uuid
LANGUAGE plpgsql AS $$
DECLARE
    sid uuid := gen_random_uuid();
BEGIN
    INSERT INTO durable.step_runs (id, run_id, name, position, executor_kind, kind, labels, input,
                                   idempotency_key, retry, timeout_ms, heartbeat_timeout_ms, deadline,
                                   secrets, transition_reason)
    VALUES (sid, d.run_id, d.name, d.position, d.executor_kind, d.kind, d.labels, d.input,
            run_key || '/' || d.name, d.retry, d.timeout_ms, d.heartbeat_timeout_ms, d.deadline,
            d.secrets, CASE WHEN cardinality(d.depends_on) = 0 THEN 'SUBMITTED' ELSE 'DEPENDENCIES_SUCCEEDED' END);
    RETURN sid;
END $$;

-- The run's state from its steps' states: the SQL twin of state::aggregate_run.
CREATE FUNCTION durable.aggregate_run_state(current_state text, step_states text[], waiting boolean)
RETURNS text LANGUAGE plpgsql IMMUTABLE AS $$
DECLARE
    open_steps int := 0; failed int := 0; cancelled int := 0; started int := 0; s text;
BEGIN
    IF durable.run_state_is_terminal(current_state) THEN
        RETURN current_state;
    END IF;
    FOREACH s IN ARRAY coalesce(step_states, '{}'::text[]) LOOP
        IF NOT durable.step_state_is_terminal(s) THEN open_steps := open_steps + 1; END IF;
        IF s = 'terminal_failed' THEN failed := failed + 1; END IF;
        IF s = 'cancelled' THEN cancelled := cancelled + 1; END IF;
        IF s <> 'pending' AND s <> 'cancelled' THEN started := started + 1; END IF;
    END LOOP;
    IF open_steps > 0 OR (waiting AND failed = 0 AND cancelled = 0) THEN
        IF current_state = 'pending' AND started > 0 THEN RETURN 'running'; END IF;
        RETURN current_state;
    END IF;
    IF failed > 0 THEN RETURN 'failed'; END IF;
    IF cancelled > 0 THEN RETURN 'cancelled'; END IF;
    IF coalesce(cardinality(step_states), 0) = 0 THEN RETURN current_state; END IF;
    RETURN 'succeeded';
END $$;

CREATE FUNCTION durable.recompute_run(rid uuid, why text) RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    cur text; next_state text; states text[]; waiting boolean;
BEGIN
    SELECT state INTO cur FROM durable.workflow_runs WHERE id = rid FOR UPDATE;
    IF cur IS NULL OR durable.run_state_is_terminal(cur) THEN
        RETURN cur;
    END IF;
    SELECT array_agg(state) INTO states FROM durable.step_runs WHERE run_id = rid;
    SELECT EXISTS (SELECT 1 FROM durable.step_defs d
                   WHERE d.run_id = rid
                     AND NOT EXISTS (SELECT 1 FROM durable.step_runs s WHERE s.run_id = rid AND s.name = d.name))
      INTO waiting;
    next_state := durable.aggregate_run_state(cur, states, waiting);
    IF next_state <> cur THEN
        -- failing or succeeding straight from pending is not in the table: go through running
        IF cur = 'pending' AND next_state IN ('succeeded', 'failed') THEN
            UPDATE durable.workflow_runs SET state = 'running' WHERE id = rid;
            INSERT INTO durable.transitions (run_id, from_state, to_state, reason) VALUES (rid, 'pending', 'running', why);
            cur := 'running';
        END IF;
        UPDATE durable.workflow_runs SET state = next_state WHERE id = rid;
        INSERT INTO durable.transitions (run_id, from_state, to_state, reason) VALUES (rid, cur, next_state, why);
    END IF;
    RETURN next_state;
END $$;

CREATE FUNCTION durable.on_step_transition() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    run_key text; run_cancel boolean; d durable.step_defs;
BEGIN
    INSERT INTO durable.transitions (run_id, step_run_id, from_state, to_state, attempt, worker, reason)
    VALUES (NEW.run_id, NEW.id, CASE WHEN TG_OP = 'UPDATE' THEN OLD.state END, NEW.state, NEW.attempt,
            NEW.transition_by, NEW.transition_reason);

    IF NEW.state IN ('pending', 'retryable_failed') THEN
        PERFORM pg_notify('durable_steps', NEW.executor_kind);
    END IF;

    IF NEW.state = 'succeeded' THEN
        SELECT coalesce(r.idempotency_key, r.id::text), r.cancel_requested INTO run_key, run_cancel
          FROM durable.workflow_runs r WHERE r.id = NEW.run_id;
        IF NOT run_cancel AND NOT EXISTS (SELECT 1 FROM durable.step_runs
                                          WHERE run_id = NEW.run_id AND state = 'terminal_failed') THEN
            FOR d IN
                SELECT * FROM durable.step_defs sd
                 WHERE sd.run_id = NEW.run_id
                   AND NEW.name = ANY (sd.depends_on)
                   AND NOT EXISTS (SELECT 1 FROM durable.step_runs s WHERE s.run_id = sd.run_id AND s.name = sd.name)
                   AND NOT EXISTS (SELECT 1 FROM unnest(sd.depends_on) AS dep(name)
                                    WHERE NOT EXISTS (SELECT 1 FROM durable.step_runs s2
                                                       WHERE s2.run_id = sd.run_id AND s2.name = dep.name
                                                         AND s2.state = 'succeeded'))
                 ORDER BY sd.position
            LOOP
                PERFORM durable.materialize_step(d, run_key);
            END LOOP;
        END IF;
    ELSIF NEW.state = 'terminal_failed' THEN
        -- the first failure ends the run: pending siblings are cancelled at once,
        -- leased and running ones get a durable cancel request
        UPDATE durable.step_runs SET state = 'cancelled', transition_reason = 'RUN_FAILED',
                                     transition_by = NULL, cancel_requested = true
         WHERE run_id = NEW.run_id AND id <> NEW.id AND state IN ('pending', 'retryable_failed');
        UPDATE durable.step_runs SET cancel_requested = true
         WHERE run_id = NEW.run_id AND id <> NEW.id AND state IN ('leased', 'running') AND NOT cancel_requested;
    END IF;

    -- Lock order everywhere: the run row first, then step rows. Workers'
    -- single-step writes lock the run before the step (db::lock_run_of_step);
    -- the multi-row lease never touches the run, so a run turns `running` when
    -- its first step starts running, not when it is leased.
    IF NEW.state = 'running' OR durable.step_state_is_terminal(NEW.state) THEN
        PERFORM durable.recompute_run(NEW.run_id, 'step ' || NEW.name || ' ' || NEW.state);
    END IF;
    RETURN NULL;
END $$;

CREATE TRIGGER step_runs_transition AFTER UPDATE OF state ON durable.step_runs
    FOR EACH ROW WHEN (OLD.state IS DISTINCT FROM NEW.state)
    EXECUTE FUNCTION durable.on_step_transition();
CREATE TRIGGER step_runs_created AFTER INSERT ON durable.step_runs
    FOR EACH ROW EXECUTE FUNCTION durable.on_step_transition();
