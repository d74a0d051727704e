-- Submitting and cancelling need EXECUTE on the two functions (and USAGE on
-- the schema), nothing more (roles and SQL audit).
--
-- Both ran with the caller's privileges, so a submitter needed SELECT,
-- INSERT and UPDATE on five of the runtime's tables: with those it could
-- rewrite anyone's queued steps directly (an input holding a password, a
-- step moved to another executor), around the one validator that submit_run
-- is. Now they run as the schema's owner, with a search_path that cannot be
-- hijacked (every name in them is schema-qualified), so a submitter role is:
--
--   GRANT USAGE ON SCHEMA durable TO submitter;
--   (EXECUTE on functions is PostgreSQL's default for PUBLIC; to restrict it:
--    REVOKE EXECUTE ON FUNCTION durable.submit_run(jsonb),
--      durable.cancel_run(uuid, text, text) FROM PUBLIC; then GRANT it.)
--
-- The schema's version, which `supervisor submit` and the other commands
-- check first, is readable by any role that may use the schema.
ALTER FUNCTION durable.submit_run(jsonb) SECURITY DEFINER SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION durable.cancel_run(uuid, text, text) SECURITY DEFINER SET search_path = pg_catalog, pg_temp;
GRANT SELECT ON durable._sqlx_migrations TO PUBLIC;
