-- Plans (issue 7: the hot path). The runtime's connections plan every
-- statement once, generically (plan_cache_mode = force_generic_plan, set by
-- Db::connect): its hot statements are key probes whose best plan does not
-- depend on the parameters' values, and re-planning them with the values on
-- every call was a large part of their cost (the lease: 0.86 ms of planning
-- per call on top of 2.1 ms of execution at 16 concurrent steps; the step
-- trigger's run decision 0.2-0.4 ms per call).
--
-- Retention and the blob garbage collector are the exception: each picks
-- its batch with `ORDER BY … LIMIT` over every finished run or unclaimed
-- blob, where the cutoff and the batch size decide between an index scan and
-- a sequential one. A generic plan knows neither (it assumes a third of the
-- rows before the cutoff and a tenth of them taken), so these two keep
-- PostgreSQL's custom plans, planned with their values, whoever calls them.
-- They run once per retention tick, so the planning costs nothing that
-- matters.
ALTER FUNCTION durable.retention_batch(timestamptz, integer, integer)
    SET plan_cache_mode = force_custom_plan;
ALTER FUNCTION durable.collect_blob_garbage(timestamptz, integer)
    SET plan_cache_mode = force_custom_plan;
