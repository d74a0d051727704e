-- The steps whose deadline can pass while they wait to be leased: a worker's
-- reclaim pass ends those whose deadline passed (Db::fail_overdue), whether
-- or not any worker can run them, so a step of a label or kind that no live
-- worker offers still fails DEADLINE_EXCEEDED by its deadline ("deadline
-- bounds the whole step, retries included", CONTRACT §3). Before, such a
-- step stayed pending forever: the deadline was checked only by the worker
-- that leased it. Steps without a deadline are not in the index.
CREATE INDEX step_runs_overdue ON durable.step_runs (deadline)
    WHERE state IN ('pending', 'retryable_failed') AND deadline IS NOT NULL;
