-- Event ids are fresh UUIDv7s, unique by construction: no unique index on them.
-- (It took an entry per row version: a fifth of an event's WAL.)
DO $$ BEGIN
    EXECUTE (SELECT format('ALTER TABLE %s DROP CONSTRAINT %I', c.conrelid::regclass, c.conname)
        FROM pg_constraint c JOIN pg_attribute a ON a.attrelid = c.conrelid
        WHERE c.conrelid = '"pulse_events"'::regclass AND c.contype = 'u'
            AND a.attname = 'event_id' AND c.conkey = ARRAY[a.attnum]);
END $$;
