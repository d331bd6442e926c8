-- Wakes an idle harvester (LISTEN ${channel}) as soon as a transaction that inserted records
-- commits; one notification per statement, and PostgreSQL folds duplicates within a transaction.
CREATE OR REPLACE FUNCTION ${notify_fn}() RETURNS trigger LANGUAGE plpgsql AS $fn$
BEGIN
  PERFORM pg_notify(${channel_literal}, '');
  RETURN NULL;
END
$fn$;
DROP TRIGGER IF EXISTS ${notify_trigger} ON ${table};
CREATE TRIGGER ${notify_trigger} AFTER INSERT ON ${table}
  FOR EACH STATEMENT EXECUTE FUNCTION ${notify_fn}();
