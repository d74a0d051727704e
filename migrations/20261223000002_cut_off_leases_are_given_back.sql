-- A lease call the worker gave up waiting for (its 10 s bound, with the
-- server stalled: a storage hang, a paused VM, SIGSTOP) may still run once
-- the server goes on: its steps were leased to a worker that never learned
-- of them, never ran, and were reclaimed a lease later as a *counted*
-- attempt (LEASE_EXPIRED), which failed runs on their last attempt (DB
-- fault audit). Each worker now has a lease epoch: its lease statement
-- leases nothing unless the epoch it names is the worker's current one
-- (read with a fresh snapshot, under a shared advisory lock of the worker),
-- and after a cut-off the worker moves its epoch on (under the exclusive
-- lock: a lease in flight commits first) and, in the same transaction,
-- gives back uncounted every step still leased to it that it does not hold.
-- A cut-off lease that runs later leases nothing.
ALTER TABLE durable.workers ADD COLUMN lease_epoch bigint NOT NULL DEFAULT 0;

-- Whether a lease by `p_worker` in `p_epoch` may take steps: not once the
-- worker moved its epoch on (an unregistered worker is not fenced).
-- VOLATILE: its query sees what committed before the lock was granted,
-- not the calling statement's older snapshot.
CREATE FUNCTION durable.lease_epoch_ok(p_worker uuid, p_epoch bigint) RETURNS boolean
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    PERFORM pg_advisory_xact_lock_shared(72546103, hashtext(p_worker::text));
    RETURN NOT EXISTS (SELECT 1 FROM durable.workers w
                        WHERE w.id = p_worker AND w.lease_epoch <> p_epoch);
END $$;

-- Moves the worker's epoch on and gives back the steps leased to it that it
-- does not hold (`p_held`) and whose lease has not expired (an expired one
-- may be an attempt the worker gave up on after sending its job: the
-- reclaim counts it, as before). Nothing of them ran: the attempt is given
-- back, as a refusal's (not counted as one); a step with a cancel request
-- ends cancelled (RUN_FAILED when its run failed, as the other writes say). Returns the new epoch and how many were given back.
CREATE FUNCTION durable.revoke_lost_leases(p_worker uuid, p_worker_name text, p_held uuid[],
                                           OUT epoch bigint, OUT given_back integer)
LANGUAGE plpgsql AS $$
DECLARE
    ids uuid[];
BEGIN
    PERFORM pg_advisory_xact_lock(72546103, hashtext(p_worker::text));
    UPDATE durable.workers SET lease_epoch = lease_epoch + 1
     WHERE id = p_worker RETURNING lease_epoch INTO epoch;
    -- a worker whose row is gone (the retention removes one silent for a
    -- day) is not fenced: its calls lease as an unregistered worker's
    epoch := coalesce(epoch, 0);
    SELECT array_agg(s.id ORDER BY s.id) INTO ids
      FROM durable.step_runs s
     WHERE s.owner_worker_id = p_worker AND s.state = 'leased' AND s.lease_expires_at > now()
       AND NOT (s.id = ANY (p_held));
    given_back := 0;
    IF ids IS NULL THEN
        RETURN;
    END IF;
    PERFORM durable.lock_runs_of(ids);
    UPDATE durable.step_runs s
       SET state = CASE WHEN c.cancel THEN 'cancelled' ELSE 'retryable_failed' END,
           attempt = s.attempt - 1,
           next_attempt_at = now(),
           error_code = CASE WHEN c.cancel THEN 'CANCELLED' ELSE 'LEASE_NOT_RECEIVED' END,
           error_message = 'the worker''s lease call was cut off before its answer came; the step never reached it and is given back uncounted',
           error_retryable = NOT c.cancel, error_details = NULL,
           owner_worker_id = CASE WHEN c.cancel THEN s.owner_worker_id END,
           lease_token = CASE WHEN c.cancel THEN s.lease_token END,
           transition_reason = CASE WHEN c.cancel AND c.run_failed THEN 'RUN_FAILED (LEASE_NOT_RECEIVED)'
                                    WHEN c.cancel THEN 'CANCEL_REQUESTED (LEASE_NOT_RECEIVED)'
                                    ELSE 'LEASE_NOT_RECEIVED' END,
           transition_by = p_worker_name
      FROM (SELECT s2.id, s2.cancel_requested OR r.cancel_requested AS cancel,
                   durable.run_failed_it(s2.run_id) AS run_failed
              FROM durable.step_runs s2 JOIN durable.workflow_runs r ON r.id = s2.run_id
             WHERE s2.id = ANY (ids)) c
     WHERE s.id = c.id AND s.owner_worker_id = p_worker AND s.state = 'leased';
    GET DIAGNOSTICS given_back = ROW_COUNT;
END $$;
