-- A worker is live while its last heartbeat is within three of its own
-- heartbeat intervals (and at least 30 s). `status` judged liveness by a
-- fixed 30 s: a worker beating every 50 s (valid with a long lease TTL) was
-- named "no live worker offers" half the time while it ran the step.
-- NULL for a worker registered by an older binary (the 30 s rule).
ALTER TABLE durable.workers ADD COLUMN heartbeat_interval_ms integer
    CHECK (heartbeat_interval_ms IS NULL OR heartbeat_interval_ms > 0);
