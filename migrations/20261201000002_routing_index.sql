-- Issue 7, first cut of the bookkeeping: the lease walks only the ready steps
-- of the routes it asks for, in queue order, and a step that starts running
-- recomputes its run only while the run is still `pending`.
--
-- The lease used to find every ready step (a bitmap scan of the whole queue
-- index), check each one's run for a cancel request and sort them all before
-- taking `limit`: O(backlog) per lease (measured: 2,000 ready steps, 10 ms and
-- 6,000 buffer hits per lease). With this index the lease is one ordered
-- index scan per route that stops after `limit` rows.
CREATE INDEX step_runs_route ON durable.step_runs (executor_kind, kind, next_attempt_at)
    WHERE state IN ('pending', 'retryable_failed');
-- the queue-order index it replaces: the planner preferred it and filtered
-- by kind, walking over every older ready step of other kinds
DROP INDEX durable.step_runs_queue;

CREATE OR REPLACE FUNCTION durable.on_step_transition() RETURNS trigger LANGUAGE plpgsql AS $$
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
        WITH sib AS (
            SELECT id FROM durable.step_runs
             WHERE run_id = NEW.run_id AND id <> NEW.id
               AND state IN ('pending', 'retryable_failed', 'leased', 'running')
             ORDER BY id FOR NO KEY UPDATE
        )
        UPDATE durable.step_runs s
           SET state = CASE WHEN s.state IN ('pending', 'retryable_failed') THEN 'cancelled' ELSE s.state END,
               transition_reason = CASE WHEN s.state IN ('pending', 'retryable_failed') THEN 'RUN_FAILED' ELSE s.transition_reason END,
               transition_by = CASE WHEN s.state IN ('pending', 'retryable_failed') THEN NULL ELSE s.transition_by END,
               cancel_requested = true
          FROM sib WHERE s.id = sib.id;
    END IF;

    -- a step that starts running can only move a `pending` run (to running):
    -- a run already running needs no recompute (no scan of its steps)
    IF (NEW.state = 'running' AND EXISTS (SELECT 1 FROM durable.workflow_runs
                                           WHERE id = NEW.run_id AND state = 'pending'))
       OR durable.step_state_is_terminal(NEW.state) THEN
        PERFORM durable.recompute_run(NEW.run_id, 'step ' || NEW.name || ' ' || NEW.state);
    END IF;
    RETURN NULL;
END $$;
