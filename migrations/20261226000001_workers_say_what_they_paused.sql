-- What a worker has paused, for `status` to tell (routing audit, left open
-- since: a step whose every offering worker had its executor's spawn
-- breaker open, or its work_dir full, read "due since …: waiting for a
-- worker to lease it", and nothing said why none did). A worker writes the
-- executors it leases nothing for now (by their config name, "*" for the
-- whole worker: its work_dir) with why and since when; `{}` when none.
-- Older workers never write it: they read as pausing nothing.
ALTER TABLE durable.workers ADD COLUMN paused jsonb NOT NULL DEFAULT '{}'::jsonb;
COMMENT ON COLUMN durable.workers.paused IS
    'executor name (or "*": the whole worker) -> {"why": text, "since": timestamptz}: what this worker leases nothing for now';
