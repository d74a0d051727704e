-- A step given back uncounted (a lease call cut off before its answer
-- came) keeps its place in the queue: its due time is left as it was, so
-- it is leased before steps that became due after it (it went to the back,
-- behind newer work, at every give-back). A drain's release does the same
-- (`DbConn::release`).
CREATE OR REPLACE FUNCTION durable.revoke_lost_leases(p_worker uuid, p_worker_name text, p_held uuid[],
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
