-- An artifact's inputs in the order the executor listed them.
--
-- `derived_from` is the order of the artifact's inputs (the demo executors
-- concatenate their bytes in that order), but artifact_lineage kept no
-- order, and `artifact lineage` listed the inputs by their creation time: a
-- join of `left` and `right` whose bytes are L…R showed `right` first when
-- `right` was made earlier. The rows of one INSERT … SELECT FROM
-- jsonb_array_elements_text take this sequence in the array's order. Rows
-- written before this have no position and keep the old order (creation
-- time, name); no table rewrite.
CREATE SEQUENCE durable.artifact_lineage_position;
ALTER TABLE durable.artifact_lineage ADD COLUMN position bigint;
ALTER TABLE durable.artifact_lineage
    ALTER COLUMN position SET DEFAULT nextval('durable.artifact_lineage_position');
