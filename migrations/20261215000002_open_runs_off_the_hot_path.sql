-- The index of open runs is off the hot path, as the index of live steps
-- is (20261215000001_live_steps_off_the_hot_path.sql), for the same reason.
--
-- Its predicate was `state IN ('pending', 'running')`, and a start locks
-- its run while that run is still pending (`w.id = x.run_id AND w.state =
-- 'pending' FOR NO KEY UPDATE`, in on_step_transition), which implies the
-- predicate: the planner could read the whole partial index instead of
-- probing the primary key. After an ANALYZE taken while few runs were open
-- (a queue that drained, its finished runs kept) the index looks nearly
-- empty, and a generic plan made then scanned every open run's entry, and
-- every finished run's dead one until vacuum, for each run a batch starts:
-- 300 open runs read for one (bounded_reads::
-- a_start_locks_its_own_run_whatever_the_open_runs_index_holds).
--
-- The predicate is now a PL/pgSQL function (never inlined, so never
-- `state IN (...)` again), IMMUTABLE, that must never change. Queries that
-- want the open runs say `durable.run_is_open(state)`.
CREATE FUNCTION durable.run_is_open(p_state text) RETURNS boolean
LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE AS $$
BEGIN
    RETURN p_state IN ('pending', 'running');
END $$;

DROP INDEX durable.workflow_runs_open;
CREATE INDEX workflow_runs_open ON durable.workflow_runs (created_at) WHERE durable.run_is_open(state);
