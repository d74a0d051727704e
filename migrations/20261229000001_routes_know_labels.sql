-- The routing index now holds the step's labels before its place in the
-- queue. A worker leases a step whose labels its executor offers, all of
-- them (`route.labels @> step.labels`); the lease read the ready steps of
-- a kind in queue order and filtered them by labels, so steps whose labels
-- no live worker offers (a typo in a spec, a pool not started yet) lay in
-- front of every other step of their kind for ever, and every lease call
-- read through all of them (audit: 50,000 such steps, 58 ms and 4,600
-- buffers per lease against 0.3 ms and 29; an idle worker spent ~35 ms of
-- the database's time every poll). The lease now probes one index range
-- per label set its route offers (each subset of the route's labels, in
-- queue order, `LIMIT` rows each), so what it reads no longer depends on
-- steps it cannot take. Steps without labels (`{}`) are one range, as
-- before. The old index goes: every ready step is in one routing index, as
-- before, so a write costs what it did.
CREATE INDEX step_runs_route_labels ON durable.step_runs (executor_kind, kind, labels, next_attempt_at)
    WHERE state IN ('pending', 'retryable_failed');
DROP INDEX durable.step_runs_route;
