-- enqueue
WITH enqueued AS (
    INSERT INTO "bench_unindexed_events" (event_id, "payload") VALUES ($1, $2) RETURNING id)
SELECT id FROM enqueued, (SELECT pg_notify('bench_unindexed_events', '') FROM enqueued LIMIT 1) AS notified;

-- enqueue_all
WITH enqueued AS (
    INSERT INTO "bench_unindexed_events" (event_id, "payload") SELECT * FROM unnest($1::text[], $2::text[]) RETURNING id)
SELECT pg_notify('bench_unindexed_events', '') FROM enqueued LIMIT 1;

-- enqueue_all_skipping
WITH enqueued AS (
    INSERT INTO "bench_unindexed_events" (event_id, "payload") SELECT * FROM unnest($1::text[], $2::text[]) RETURNING event_id)
SELECT event_id FROM enqueued, (SELECT pg_notify('bench_unindexed_events', '') FROM enqueued LIMIT 1) AS notified;

-- claim
WITH expired AS (
    SELECT id, ctid FROM "bench_unindexed_events"
    WHERE status = 'INPROGRESS' AND lease_until <= statement_timestamp()
    ORDER BY lease_until, id LIMIT 100 FOR UPDATE SKIP LOCKED
), ready AS (
    SELECT ctid FROM "bench_unindexed_events"
    WHERE status = 'READY' AND next_attempt_at <= statement_timestamp()
    ORDER BY next_attempt_at, id LIMIT 100 - (SELECT count(*) FROM expired) FOR UPDATE SKIP LOCKED
)
UPDATE "bench_unindexed_events" AS o SET
    status = CASE WHEN o.attempts >= 10 THEN 'DEAD' ELSE 'INPROGRESS' END,
    generation = CASE WHEN o.attempts >= 10 THEN o.generation ELSE o.generation + 1 END,
    attempts = CASE WHEN o.attempts >= 10 THEN o.attempts ELSE o.attempts + 1 END,
    lease_until = CASE WHEN o.attempts >= 10 THEN NULL ELSE statement_timestamp() + interval '30 seconds' END,
    last_error = CASE
        WHEN o.attempts < 10 THEN o.last_error
        WHEN o.status = 'INPROGRESS'
            THEN 'lease expired on claim ' || o.attempts || ' of 10: attempt budget exhausted'
        ELSE 'attempt budget exhausted: ' || o.attempts || ' claims made, the budget is now 10'
            || coalesce('; the last error: ' || o.last_error, '') END
WHERE o.ctid = ANY(ARRAY(SELECT ctid FROM expired UNION ALL SELECT ctid FROM ready))
RETURNING o.id, o.event_id, o.generation, o.attempts, o.lease_until, o.next_attempt_at, o.created_at, o.id = ANY(ARRAY(SELECT id FROM expired)) AS outbox_reclaimed, o."payload";

-- claim_from
WITH ready AS (
    SELECT ctid FROM "bench_unindexed_events"
    WHERE status = 'READY'
        AND next_attempt_at >= timestamptz 'epoch' + $1::bigint * interval '1 microsecond'
        AND next_attempt_at <= statement_timestamp()
    ORDER BY next_attempt_at, id LIMIT 100 FOR UPDATE SKIP LOCKED
)
UPDATE "bench_unindexed_events" AS o SET
    status = CASE WHEN o.attempts >= 10 THEN 'DEAD' ELSE 'INPROGRESS' END,
    generation = CASE WHEN o.attempts >= 10 THEN o.generation ELSE o.generation + 1 END,
    attempts = CASE WHEN o.attempts >= 10 THEN o.attempts ELSE o.attempts + 1 END,
    lease_until = CASE WHEN o.attempts >= 10 THEN NULL ELSE statement_timestamp() + interval '30 seconds' END,
    last_error = CASE
        WHEN o.attempts < 10 THEN o.last_error
        WHEN o.status = 'INPROGRESS'
            THEN 'lease expired on claim ' || o.attempts || ' of 10: attempt budget exhausted'
        ELSE 'attempt budget exhausted: ' || o.attempts || ' claims made, the budget is now 10'
            || coalesce('; the last error: ' || o.last_error, '') END
WHERE o.ctid = ANY(ARRAY(SELECT ctid FROM ready))
RETURNING o.id, o.event_id, o.generation, o.attempts, o.lease_until, o.next_attempt_at, o.created_at, false AS outbox_reclaimed, o."payload";

-- complete
UPDATE "bench_unindexed_events" SET status = 'SENT', lease_until = NULL, next_attempt_at = statement_timestamp() WHERE id = $1 AND status || '' = 'INPROGRESS' AND generation = $2 AND lease_until > clock_timestamp() RETURNING id;

-- retry
UPDATE "bench_unindexed_events" SET
    status = CASE WHEN attempts >= 10 THEN 'DEAD' ELSE 'READY' END,
    lease_until = NULL,
    next_attempt_at = statement_timestamp() + $3::interval,
    last_error = CASE WHEN attempts >= 10
        THEN 'attempt budget exhausted after ' || attempts || ' of 10 claims' || coalesce(': ' || $4::text, '')
        ELSE coalesce($4::text, last_error) END
WHERE id = $1 AND status || '' = 'INPROGRESS' AND generation = $2 AND lease_until > clock_timestamp()
RETURNING status;

-- renew
UPDATE "bench_unindexed_events" SET lease_until = statement_timestamp() + interval '30 seconds' WHERE id = $1 AND status || '' = 'INPROGRESS' AND generation = $2 AND lease_until > clock_timestamp() RETURNING lease_until;

-- fail
UPDATE "bench_unindexed_events" SET status = 'DEAD', lease_until = NULL, last_error = $3 WHERE id = $1 AND status || '' = 'INPROGRESS' AND generation = $2 AND lease_until > clock_timestamp() RETURNING id;

-- complete_batch
UPDATE "bench_unindexed_events" AS o SET status = 'SENT', lease_until = NULL, next_attempt_at = statement_timestamp()
FROM unnest($1::bigint[], $2::bigint[]) AS u(id, generation)
WHERE o.id = u.id AND o.status || '' = 'INPROGRESS' AND o.generation = u.generation AND o.lease_until > clock_timestamp()
RETURNING o.id;

-- record
UPDATE "bench_unindexed_events" AS o SET
    status = CASE u.outcome
        WHEN 'SENT' THEN 'SENT'
        WHEN 'RELEASE' THEN 'READY'
        WHEN 'RETRY' THEN CASE WHEN o.attempts >= 10 THEN 'DEAD' ELSE 'READY' END
        ELSE 'DEAD' END,
    lease_until = NULL,
    attempts = CASE u.outcome WHEN 'RELEASE' THEN o.attempts - 1 ELSE o.attempts END,
    next_attempt_at = CASE u.outcome
        WHEN 'RETRY' THEN statement_timestamp() + u.delay
        WHEN 'RELEASE' THEN statement_timestamp()
        WHEN 'SENT' THEN statement_timestamp()
        ELSE o.next_attempt_at END,
    last_error = CASE
        WHEN u.outcome = 'RETRY' AND o.attempts >= 10
            THEN 'attempt budget exhausted after ' || o.attempts || ' of 10 claims' || coalesce(': ' || u.error, '')
        WHEN u.outcome IN ('RETRY', 'DEAD', 'RELEASE') THEN coalesce(u.error, o.last_error)
        ELSE o.last_error END
FROM unnest($1::bigint[], $2::bigint[], $3::text[], $4::interval[], $5::text[])
    AS u(id, generation, outcome, delay, error)
WHERE o.id = u.id AND o.status || '' = 'INPROGRESS' AND o.generation = u.generation AND o.lease_until > clock_timestamp()
RETURNING o.id, o.status;

-- renew_batch
UPDATE "bench_unindexed_events" AS o SET lease_until = statement_timestamp() + interval '30 seconds'
FROM unnest($1::bigint[], $2::bigint[]) AS u(id, generation)
WHERE o.id = u.id AND o.status || '' = 'INPROGRESS' AND o.generation = u.generation AND o.lease_until > clock_timestamp()
RETURNING o.id, o.lease_until;

-- requeue_dead
UPDATE "bench_unindexed_events" SET status = 'READY', attempts = 0, next_attempt_at = statement_timestamp() WHERE status = 'DEAD' AND event_id = ANY($1::text[]) RETURNING event_id;

-- requeue_all_dead
WITH requeued AS (UPDATE "bench_unindexed_events" SET status = 'READY', attempts = 0, next_attempt_at = statement_timestamp() WHERE status = 'DEAD' RETURNING 1)
SELECT count(*) AS requeued FROM requeued;

-- discard_dead
DELETE FROM "bench_unindexed_events" WHERE status = 'DEAD' AND event_id = ANY($1::text[]) RETURNING event_id;

-- prune_sent
WITH doomed AS (
    SELECT id FROM "bench_unindexed_events"
    WHERE status = 'SENT' AND next_attempt_at < statement_timestamp() - $1::interval
    ORDER BY id LIMIT $2 FOR UPDATE SKIP LOCKED)
DELETE FROM "bench_unindexed_events" AS o USING doomed AS d WHERE o.id = d.id;

-- stats
SELECT s.*, w.oldest_waiting_age, w.oldest_waiting_error
FROM (SELECT
    count(*) FILTER (WHERE status = 'READY') AS ready,
    count(*) FILTER (WHERE status = 'INPROGRESS') AS in_progress,
    count(*) FILTER (WHERE status = 'SENT') AS sent,
    count(*) FILTER (WHERE status = 'DEAD') AS dead,
    count(*) FILTER (WHERE status = 'INPROGRESS' AND lease_until <= statement_timestamp()) AS expired_claims,
    min(id) FILTER (WHERE status IN ('READY', 'INPROGRESS')) AS first_waiting,
    0::bigint AS held_keys, NULL::interval AS oldest_held_age,
    count(*) FILTER (WHERE status = 'SENT' AND next_attempt_at > statement_timestamp() - interval '1 minute') AS sent_last_minute,
    count(*) FILTER (WHERE status = 'READY' AND next_attempt_at <= statement_timestamp()) AS due,
    0::bigint AS scheduled
    FROM "bench_unindexed_events") AS s
LEFT JOIN LATERAL (SELECT
    statement_timestamp() - greatest(created_at, statement_timestamp() - interval '31557600000 seconds') AS oldest_waiting_age,
    last_error AS oldest_waiting_error
    FROM "bench_unindexed_events" WHERE id = s.first_waiting) AS w ON true;
