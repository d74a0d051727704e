-- The step guard is skipped for an update that renews a lease and changes
-- no state (the heartbeat's, a checkpoint write's). A hand-written update
-- that also set prev_state or via_state slipped past it, and the transition
-- trigger recorded the hop it named (`succeeded -> pending`) in the history
-- (throughput-core audit). The guard now also runs when either changes;
-- the runtime's renewals leave both as they are, so they still skip it.
DROP TRIGGER step_runs_guard_update ON durable.step_runs;
CREATE TRIGGER step_runs_guard_update BEFORE UPDATE ON durable.step_runs
    FOR EACH ROW
    WHEN (OLD.state IS DISTINCT FROM NEW.state
          OR OLD.prev_state IS NOT NULL
          OR NEW.prev_state IS DISTINCT FROM OLD.prev_state
          OR NEW.via_state IS DISTINCT FROM OLD.via_state
          OR OLD.state IN ('succeeded', 'terminal_failed', 'cancelled')
          OR NEW.id IS DISTINCT FROM OLD.id OR NEW.run_id IS DISTINCT FROM OLD.run_id
          OR NEW.name IS DISTINCT FROM OLD.name
          OR NEW.idempotency_key IS DISTINCT FROM OLD.idempotency_key
          OR NEW.lease_expires_at IS NOT DISTINCT FROM OLD.lease_expires_at)
    EXECUTE FUNCTION durable.guard_step_update();
