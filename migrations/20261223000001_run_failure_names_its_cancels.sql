-- Whether a step's cancel request came from its run's failure (a sibling
-- ended terminal_failed, which asks every open step of the run to stop)
-- rather than from anyone's cancel: the run was not asked to cancel and
-- counts a failed step. A failure write that ends a step cancelled names
-- the run's failure then (`RUN_FAILED (CODE)`), not `CANCEL_REQUESTED`,
-- as confirm_cancelled's message already did. One primary-key probe.
CREATE FUNCTION durable.run_failed_it(p_run uuid) RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT coalesce((SELECT NOT w.cancel_requested AND w.steps_failed > 0
                       FROM durable.workflow_runs w WHERE w.id = p_run), false)
$$;
