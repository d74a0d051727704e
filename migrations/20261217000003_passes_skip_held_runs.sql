-- The reclaim and the deadline pass skip a run whose row another transaction
-- holds, instead of waiting for it.
--
-- Both take their candidates in expiry (deadline) order and lock each one's
-- run row first, as every step write does. A run row held by another
-- transaction (an operator's open session, a program's own transaction
-- around durable.cancel_run) made the pass wait the connection's 10 s lock
-- timeout and fail, and the next pass began with the same candidate: no
-- expired lease and no overdue step of any other run was handled for as long
-- as the row was held (a crashed worker's steps stayed `running` past their
-- lease, deadlines passed unenforced). This takes a step's run lock waiting
-- at most p_wait, and says whether it got it; the caller's lock_timeout is
-- restored either way.
CREATE FUNCTION durable.lock_run_of_step(p_step uuid, p_wait text) RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    caller_timeout text := current_setting('lock_timeout');
BEGIN
    PERFORM set_config('lock_timeout', p_wait, true);
    BEGIN
        PERFORM 1 FROM durable.workflow_runs
         WHERE id = (SELECT run_id FROM durable.step_runs WHERE id = p_step)
           FOR NO KEY UPDATE;
    EXCEPTION WHEN lock_not_available THEN
        PERFORM set_config('lock_timeout', caller_timeout, true);
        RETURN false;
    END;
    PERFORM set_config('lock_timeout', caller_timeout, true);
    RETURN true;
END $$;
