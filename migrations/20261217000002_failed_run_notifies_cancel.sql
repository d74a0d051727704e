-- A run that fails tells its live steps' workers at once.
--
-- The first terminal failure of a run gives its leased and running siblings
-- a durable cancel request (the step transition trigger), but sent no
-- notification: their workers learned of it at their next heartbeat, so
-- siblings kept running (and doing side effects) for up to
-- heartbeat_interval_ms (9.8 s with a 10 s heartbeat), while `cancel`
-- reached them in ~35 ms through `durable_cancel`. Any step whose cancel
-- request is set while it is live now notifies that channel (its payload is
-- the run, as cancel_run's). Only an UPDATE that sets cancel_requested
-- considers the trigger at all (the hot paths do not), and the WHEN clause
-- is evaluated without calling the function; NOTIFY folds the same payload
-- within a transaction to one.
CREATE FUNCTION durable.notify_cancel_requested() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('durable_cancel', NEW.run_id::text);
    RETURN NULL;
END $$;

CREATE TRIGGER step_cancel_requested_notifies
    AFTER UPDATE OF cancel_requested ON durable.step_runs
    FOR EACH ROW
    WHEN (NEW.cancel_requested AND NOT OLD.cancel_requested AND NEW.state IN ('leased', 'running'))
    EXECUTE FUNCTION durable.notify_cancel_requested();
