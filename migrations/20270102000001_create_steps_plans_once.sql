-- durable.create_steps (three arguments) in PL/pgSQL instead of SQL: the
-- same INSERT, now planned once per session. A SQL-language function that
-- writes is never inlined, and PostgreSQL 15 plans its statements again at
-- every call: pg_stat_statements (track_planning) showed the INSERT planned
-- at each of 105 submits, 0.22 ms of planning for each run submitted (and
-- for each batch of dependents made ready), on the path of submit →
-- accepted (issue 7 (e)). Its body and results are as in
-- 20261214000006_one_create_steps.sql.
CREATE OR REPLACE FUNCTION durable.create_steps(p_defs durable.step_defs[], p_run_key text, p_reason text)
RETURNS SETOF uuid LANGUAGE plpgsql AS $$
BEGIN
    RETURN QUERY
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
    RETURNING step_runs.id;
END $$;
