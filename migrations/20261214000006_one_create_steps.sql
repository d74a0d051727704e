-- durable.create_steps is again the one place that makes step rows from
-- definitions: 20261214000002 added a three-argument form (with the reason
-- recorded for the creation) as a copy of the two-argument one's INSERT. Now
-- the three-argument form holds the INSERT, a NULL reason meaning the usual
-- one (SUBMITTED for a root, DEPENDENCIES_SUCCEEDED for a dependent), and the
-- two-argument form calls it.
CREATE OR REPLACE FUNCTION durable.create_steps(p_defs durable.step_defs[], p_run_key text, p_reason text)
RETURNS SETOF uuid LANGUAGE sql AS $$
    INSERT INTO durable.step_runs (id, run_id, name, position, executor_kind, kind, labels, input,
                                   idempotency_key, retry, timeout_ms, heartbeat_timeout_ms, deadline,
                                   secrets, transition_reason)
    SELECT durable.time_ordered_uuid(), d.run_id, d.name, d.position, d.executor_kind, d.kind, d.labels,
           d.input,
           coalesce(p_run_key, (SELECT coalesce(w.idempotency_key, w.id::text)
                                  FROM durable.workflow_runs w WHERE w.id = d.run_id)) || '/' || d.name,
           d.retry, d.timeout_ms, d.heartbeat_timeout_ms, d.deadline,
           d.secrets,
           coalesce(p_reason,
                    CASE WHEN cardinality(d.depends_on) = 0 THEN 'SUBMITTED' ELSE 'DEPENDENCIES_SUCCEEDED' END)
      FROM unnest(p_defs) AS d
     ORDER BY d.position
    RETURNING id
$$;

CREATE OR REPLACE FUNCTION durable.create_steps(p_defs durable.step_defs[], p_run_key text DEFAULT NULL)
RETURNS SETOF uuid LANGUAGE sql AS $$
    SELECT durable.create_steps(p_defs, p_run_key, NULL::text)
$$;
