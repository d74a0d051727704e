-- `runs` lists the newest runs first (ORDER BY created_at DESC, id DESC):
-- with no index on created_at but the partial one of open runs, every call
-- read the whole table and sorted it (180-400 ms at 500,000 runs, growing
-- with the history retention keeps; audit of the operator's tools). A
-- backward scan of this index reads the page and stops. It costs a submit
-- one index entry; a run's later updates leave created_at alone, so they
-- stay HOT-eligible.
CREATE INDEX workflow_runs_created ON durable.workflow_runs (created_at, id);
