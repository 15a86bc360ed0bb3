-- enqueue
WITH enqueued AS (
    INSERT INTO "lenient_order_events" (event_id, "order_id") VALUES ($1, $2)
    ON CONFLICT (event_id) DO NOTHING RETURNING id)
SELECT id FROM enqueued, (SELECT pg_notify('lenient_order_events', '') FROM enqueued LIMIT 1) AS notified;

-- enqueue_all
WITH enqueued AS (
    INSERT INTO "lenient_order_events" (event_id, "order_id") SELECT * FROM unnest($1::text[], $2::uuid[]) RETURNING id)
SELECT pg_notify('lenient_order_events', '') FROM enqueued LIMIT 1;

-- enqueue_all_skipping
WITH enqueued AS (
    INSERT INTO "lenient_order_events" (event_id, "order_id") SELECT * FROM unnest($1::text[], $2::uuid[])
    ON CONFLICT (event_id) DO NOTHING RETURNING event_id)
SELECT event_id FROM enqueued, (SELECT pg_notify('lenient_order_events', '') FROM enqueued LIMIT 1) AS notified;

-- claim
WITH expired AS (
    SELECT id, ctid, "order_id", attempts FROM "lenient_order_events" AS c
    WHERE status = 'INPROGRESS' AND lease_until <= statement_timestamp()
        AND (SELECT p.id FROM "lenient_order_events" AS p
            WHERE (p."order_id", p.id) < (c."order_id", c.id) AND (p."order_id", p.id) >= (c."order_id", -9223372036854775808) AND p.status <> 'SENT' AND p.status <> 'DEAD'
            ORDER BY p."order_id" DESC, p.id DESC LIMIT 1) IS NULL
    ORDER BY lease_until, id LIMIT 100 FOR UPDATE SKIP LOCKED
), ready AS (
    SELECT ctid, next_attempt_at, id, "order_id", attempts FROM "lenient_order_events" AS c
    WHERE status = 'READY' AND next_attempt_at <= statement_timestamp()
        AND (SELECT p.id FROM "lenient_order_events" AS p
            WHERE (p."order_id", p.id) < (c."order_id", c.id) AND (p."order_id", p.id) >= (c."order_id", -9223372036854775808) AND p.status <> 'SENT' AND p.status <> 'DEAD'
            ORDER BY p."order_id" DESC, p.id DESC LIMIT 1) IS NULL
    ORDER BY next_attempt_at, id LIMIT 100 - (SELECT count(*) FROM expired) FOR UPDATE SKIP LOCKED
), continued AS (
    SELECT id, ctid, "order_id", attempts, status = 'INPROGRESS' AS expired FROM "lenient_order_events"
    WHERE ctid = ANY(ARRAY(
        SELECT n.ctid FROM unnest($1::bigint[], $2::bigint[]) AS tail(id, generation)
        JOIN "lenient_order_events" AS p ON p.id = tail.id AND p.generation = tail.generation
            AND (p.status || '' = 'INPROGRESS' AND p.lease_until > statement_timestamp()
                OR p.status || '' = 'SENT')
        CROSS JOIN LATERAL (
            SELECT n.ctid, n.id, n.status, n.attempts, n.next_attempt_at, n.lease_until FROM "lenient_order_events" AS n
            WHERE (n."order_id", n.id) > (p."order_id", p.id)
                AND (n."order_id", n.id) <= (p."order_id", 9223372036854775807) AND n.status <> 'SENT' AND n.status <> 'DEAD'
            ORDER BY n."order_id", n.id LIMIT 1) AS n
        WHERE n.attempts < 1 AND (
                n.status = 'READY' AND (n.next_attempt_at <= statement_timestamp() OR n.attempts = 0)
                OR n.status = 'INPROGRESS' AND n.lease_until <= statement_timestamp())
        ORDER BY p.id LIMIT 100 - (SELECT count(*) FROM expired) - (SELECT count(*) FROM ready)))
    FOR UPDATE SKIP LOCKED
), run_candidates AS (
    SELECT ctid, id, head, expired FROM (
        SELECT q.ctid, q.id, h.id AS head, q.status = 'INPROGRESS' AS expired,
            row_number() OVER (PARTITION BY h.id ORDER BY q.id) AS depth,
            bool_and(q.attempts < 1 AND (
                q.status = 'READY' AND (q.next_attempt_at <= statement_timestamp() OR q.attempts = 0)
                OR q.status = 'INPROGRESS' AND q.lease_until <= statement_timestamp())) OVER (PARTITION BY h.id ORDER BY q.id) AS in_run
        FROM (SELECT * FROM expired UNION ALL SELECT id, ctid, "order_id", attempts FROM ready UNION ALL SELECT id, ctid, "order_id", attempts FROM continued) AS h CROSS JOIN LATERAL (
            SELECT q.ctid, q.id, q.status, q.attempts, q.next_attempt_at, q.lease_until FROM "lenient_order_events" AS q
            WHERE (q."order_id", q.id) > (h."order_id", h.id)
                AND (q."order_id", q.id) <= (h."order_id", 9223372036854775807) AND q.status <> 'SENT' AND q.status <> 'DEAD'
            ORDER BY q."order_id", q.id LIMIT least(100 - (SELECT count(*) FROM expired) - (SELECT count(*) FROM ready) - (SELECT count(*) FROM continued), $3::bigint - 1)) AS q
        WHERE h.attempts < 1) AS q
    WHERE in_run AND depth < $3::bigint
    ORDER BY depth, id LIMIT 100 - (SELECT count(*) FROM expired) - (SELECT count(*) FROM ready) - (SELECT count(*) FROM continued)
), run_locked AS (
    SELECT ctid FROM "lenient_order_events" WHERE ctid = ANY(ARRAY(SELECT ctid FROM run_candidates))
    FOR UPDATE SKIP LOCKED
), run_members AS (
    SELECT c.ctid, c.id, c.expired FROM run_candidates AS c
    WHERE NOT EXISTS (SELECT FROM run_candidates AS m
        WHERE m.head = c.head AND m.id <= c.id
            AND m.ctid <> ALL(ARRAY(SELECT ctid FROM run_locked)))
), reach AS (
    SELECT at, id FROM (
        SELECT next_attempt_at AS at, id, 0 AS last FROM ready
        WHERE (SELECT count(*) FROM ready) = 100 - (SELECT count(*) FROM expired)
        UNION ALL SELECT timestamptz 'infinity', 0, 1
        WHERE (SELECT count(*) FROM expired) < 100) AS walked
    ORDER BY last, at DESC, id DESC LIMIT 1
), parked AS (
    UPDATE "lenient_order_events" AS w
    SET next_attempt_at = statement_timestamp() + greatest(interval '30 seconds', statement_timestamp() - w.created_at)
    WHERE w.ctid = ANY(ARRAY(SELECT ctid FROM (
        SELECT c.ctid, pg_notify('lenient_order_events', '') FROM "lenient_order_events" AS c
        WHERE c.status = 'READY' AND c.next_attempt_at <= statement_timestamp()
            AND (c.next_attempt_at, c.id) <= ((SELECT at FROM reach), (SELECT id FROM reach))
            AND c.ctid <> ALL(ARRAY(SELECT ctid FROM ready UNION ALL SELECT ctid FROM continued UNION ALL SELECT ctid FROM run_members))
            AND (c.next_attempt_at > statement_timestamp() - interval '500000 microseconds'
                OR c."order_id" <> ALL(ARRAY(SELECT "order_id" FROM expired UNION ALL SELECT "order_id" FROM ready UNION ALL SELECT "order_id" FROM continued)))
            AND EXISTS (SELECT FROM "lenient_order_events" AS p
                WHERE (p."order_id", p.id) < (c."order_id", c.id) AND (p."order_id", p.id) >= (c."order_id", -9223372036854775808) AND p.status <> 'SENT' AND p.status IN ('READY')
                    AND p.ctid <> ALL(ARRAY(SELECT ctid FROM ready UNION ALL SELECT ctid FROM continued UNION ALL SELECT ctid FROM run_members))
                ORDER BY p."order_id" DESC, p.id DESC LIMIT 1 FOR SHARE SKIP LOCKED)
        ORDER BY c.next_attempt_at, c.id FOR UPDATE OF c SKIP LOCKED) AS waiting))),
done AS (
UPDATE "lenient_order_events" AS o SET
    status = CASE WHEN o.attempts >= 1 THEN 'DEAD' ELSE 'INPROGRESS' END,
    generation = CASE WHEN o.attempts >= 1 THEN o.generation ELSE o.generation + 1 END,
    attempts = CASE WHEN o.attempts >= 1 THEN o.attempts ELSE o.attempts + 1 END,
    lease_until = CASE WHEN o.attempts >= 1 THEN NULL ELSE statement_timestamp() + interval '30 seconds' END,
    last_error = CASE
        WHEN o.attempts < 1 THEN o.last_error
        WHEN o.status = 'INPROGRESS'
            THEN 'lease expired on claim ' || o.attempts || ' of 1: attempt budget exhausted'
        ELSE 'attempt budget exhausted: ' || o.attempts || ' claims made, the budget is now 1'
            || coalesce('; the last error: ' || o.last_error, '') END
WHERE o.ctid = ANY(ARRAY(SELECT ctid FROM expired UNION ALL SELECT ctid FROM ready UNION ALL SELECT ctid FROM continued UNION ALL SELECT ctid FROM run_members))
RETURNING o.id, o.event_id, o.generation, o.attempts, o.lease_until, o.next_attempt_at, o.created_at, o.id = ANY(ARRAY(SELECT id FROM expired UNION ALL SELECT id FROM continued WHERE expired UNION ALL SELECT id FROM run_members WHERE expired)) AS outbox_reclaimed, o."order_id", o."order_id"::text AS outbox_key, (SELECT least(at, statement_timestamp()) FROM reach) AS outbox_reach),
next AS (
    SELECT q.id FROM (SELECT DISTINCT ON (f."order_id") * FROM done AS f WHERE f.lease_until IS NULL ORDER BY f."order_id", f.id DESC) AS f CROSS JOIN LATERAL (
        SELECT q.id, q.status, q.next_attempt_at FROM "lenient_order_events" AS q
        WHERE (q."order_id", q.id) > (f."order_id", f.id)
            AND (q."order_id", q.id) <= (f."order_id", 9223372036854775807) AND q.status <> 'SENT' AND q.status <> 'DEAD'
        ORDER BY q."order_id", q.id LIMIT 1) AS q
    WHERE f.lease_until IS NULL AND q.status = 'READY' AND q.next_attempt_at > statement_timestamp()
), woken AS (
    UPDATE "lenient_order_events" AS w SET next_attempt_at = statement_timestamp()
    WHERE w.id = ANY(ARRAY(SELECT id FROM next))
        AND w.status || '' = 'READY' AND w.next_attempt_at > statement_timestamp())
SELECT * FROM done;

-- claim (one event per key)
WITH expired AS (
    SELECT id, ctid, "order_id", attempts FROM "lenient_order_events" AS c
    WHERE status = 'INPROGRESS' AND lease_until <= statement_timestamp()
        AND (SELECT p.id FROM "lenient_order_events" AS p
            WHERE (p."order_id", p.id) < (c."order_id", c.id) AND (p."order_id", p.id) >= (c."order_id", -9223372036854775808) AND p.status <> 'SENT' AND p.status <> 'DEAD'
            ORDER BY p."order_id" DESC, p.id DESC LIMIT 1) IS NULL
    ORDER BY lease_until, id LIMIT 100 FOR UPDATE SKIP LOCKED
), ready AS (
    SELECT ctid, next_attempt_at, id, "order_id", attempts FROM "lenient_order_events" AS c
    WHERE status = 'READY' AND next_attempt_at <= statement_timestamp()
        AND (SELECT p.id FROM "lenient_order_events" AS p
            WHERE (p."order_id", p.id) < (c."order_id", c.id) AND (p."order_id", p.id) >= (c."order_id", -9223372036854775808) AND p.status <> 'SENT' AND p.status <> 'DEAD'
            ORDER BY p."order_id" DESC, p.id DESC LIMIT 1) IS NULL
    ORDER BY next_attempt_at, id LIMIT 100 - (SELECT count(*) FROM expired) FOR UPDATE SKIP LOCKED
), reach AS (
    SELECT at, id FROM (
        SELECT next_attempt_at AS at, id, 0 AS last FROM ready
        WHERE (SELECT count(*) FROM ready) = 100 - (SELECT count(*) FROM expired)
        UNION ALL SELECT timestamptz 'infinity', 0, 1
        WHERE (SELECT count(*) FROM expired) < 100) AS walked
    ORDER BY last, at DESC, id DESC LIMIT 1
), parked AS (
    UPDATE "lenient_order_events" AS w
    SET next_attempt_at = statement_timestamp() + greatest(interval '30 seconds', statement_timestamp() - w.created_at)
    WHERE w.ctid = ANY(ARRAY(SELECT ctid FROM (
        SELECT c.ctid, pg_notify('lenient_order_events', '') FROM "lenient_order_events" AS c
        WHERE c.status = 'READY' AND c.next_attempt_at <= statement_timestamp()
            AND (c.next_attempt_at, c.id) <= ((SELECT at FROM reach), (SELECT id FROM reach))
            AND c.ctid <> ALL(ARRAY(SELECT ctid FROM ready))
            AND EXISTS (SELECT FROM "lenient_order_events" AS p
                WHERE (p."order_id", p.id) < (c."order_id", c.id) AND (p."order_id", p.id) >= (c."order_id", -9223372036854775808) AND p.status <> 'SENT' AND p.status IN ('READY')
                    AND p.ctid <> ALL(ARRAY(SELECT ctid FROM ready))
                ORDER BY p."order_id" DESC, p.id DESC LIMIT 1 FOR SHARE SKIP LOCKED)
        ORDER BY c.next_attempt_at, c.id FOR UPDATE OF c SKIP LOCKED) AS waiting))),
done AS (
UPDATE "lenient_order_events" AS o SET
    status = CASE WHEN o.attempts >= 1 THEN 'DEAD' ELSE 'INPROGRESS' END,
    generation = CASE WHEN o.attempts >= 1 THEN o.generation ELSE o.generation + 1 END,
    attempts = CASE WHEN o.attempts >= 1 THEN o.attempts ELSE o.attempts + 1 END,
    lease_until = CASE WHEN o.attempts >= 1 THEN NULL ELSE statement_timestamp() + interval '30 seconds' END,
    last_error = CASE
        WHEN o.attempts < 1 THEN o.last_error
        WHEN o.status = 'INPROGRESS'
            THEN 'lease expired on claim ' || o.attempts || ' of 1: attempt budget exhausted'
        ELSE 'attempt budget exhausted: ' || o.attempts || ' claims made, the budget is now 1'
            || coalesce('; the last error: ' || o.last_error, '') END
WHERE o.ctid = ANY(ARRAY(SELECT ctid FROM expired UNION ALL SELECT ctid FROM ready))
RETURNING o.id, o.event_id, o.generation, o.attempts, o.lease_until, o.next_attempt_at, o.created_at, o.id = ANY(ARRAY(SELECT id FROM expired)) AS outbox_reclaimed, o."order_id", o."order_id"::text AS outbox_key),
next AS (
    SELECT q.id FROM (SELECT DISTINCT ON (f."order_id") * FROM done AS f WHERE f.lease_until IS NULL ORDER BY f."order_id", f.id DESC) AS f CROSS JOIN LATERAL (
        SELECT q.id, q.status, q.next_attempt_at FROM "lenient_order_events" AS q
        WHERE (q."order_id", q.id) > (f."order_id", f.id)
            AND (q."order_id", q.id) <= (f."order_id", 9223372036854775807) AND q.status <> 'SENT' AND q.status <> 'DEAD'
        ORDER BY q."order_id", q.id LIMIT 1) AS q
    WHERE f.lease_until IS NULL AND q.status = 'READY' AND q.next_attempt_at > statement_timestamp()
), woken AS (
    UPDATE "lenient_order_events" AS w SET next_attempt_at = statement_timestamp()
    WHERE w.id = ANY(ARRAY(SELECT id FROM next))
        AND w.status || '' = 'READY' AND w.next_attempt_at > statement_timestamp())
SELECT * FROM done;

-- claim_from
WITH ready AS (
    SELECT id, ctid, "order_id", attempts, next_attempt_at FROM "lenient_order_events" AS c
    WHERE status = 'READY'
        AND next_attempt_at >= timestamptz 'epoch' + $1::bigint * interval '1 microsecond'
        AND next_attempt_at <= statement_timestamp()
        AND (SELECT p.id FROM "lenient_order_events" AS p
            WHERE (p."order_id", p.id) < (c."order_id", c.id) AND (p."order_id", p.id) >= (c."order_id", -9223372036854775808) AND p.status <> 'SENT' AND p.status <> 'DEAD'
            ORDER BY p."order_id" DESC, p.id DESC LIMIT 1) IS NULL
    ORDER BY next_attempt_at, id LIMIT 100 FOR UPDATE SKIP LOCKED
), continued AS (
    SELECT id, ctid, "order_id", attempts, status = 'INPROGRESS' AS expired FROM "lenient_order_events"
    WHERE ctid = ANY(ARRAY(
        SELECT n.ctid FROM unnest($2::bigint[], $3::bigint[]) AS tail(id, generation)
        JOIN "lenient_order_events" AS p ON p.id = tail.id AND p.generation = tail.generation
            AND (p.status || '' = 'INPROGRESS' AND p.lease_until > statement_timestamp()
                OR p.status || '' = 'SENT')
        CROSS JOIN LATERAL (
            SELECT n.ctid, n.id, n.status, n.attempts, n.next_attempt_at, n.lease_until FROM "lenient_order_events" AS n
            WHERE (n."order_id", n.id) > (p."order_id", p.id)
                AND (n."order_id", n.id) <= (p."order_id", 9223372036854775807) AND n.status <> 'SENT' AND n.status <> 'DEAD'
            ORDER BY n."order_id", n.id LIMIT 1) AS n
        WHERE n.attempts < 1 AND (
                n.status = 'READY' AND (n.next_attempt_at <= statement_timestamp() OR n.attempts = 0)
                OR n.status = 'INPROGRESS' AND n.lease_until <= statement_timestamp())
        ORDER BY p.id LIMIT 100 - (SELECT count(*) FROM ready)))
    FOR UPDATE SKIP LOCKED
), run_candidates AS (
    SELECT ctid, id, head, expired FROM (
        SELECT q.ctid, q.id, h.id AS head, q.status = 'INPROGRESS' AS expired,
            row_number() OVER (PARTITION BY h.id ORDER BY q.id) AS depth,
            bool_and(q.attempts < 1 AND (
                q.status = 'READY' AND (q.next_attempt_at <= statement_timestamp() OR q.attempts = 0)
                OR q.status = 'INPROGRESS' AND q.lease_until <= statement_timestamp())) OVER (PARTITION BY h.id ORDER BY q.id) AS in_run
        FROM (SELECT id, ctid, "order_id", attempts FROM ready UNION ALL SELECT id, ctid, "order_id", attempts FROM continued) AS h CROSS JOIN LATERAL (
            SELECT q.ctid, q.id, q.status, q.attempts, q.next_attempt_at, q.lease_until FROM "lenient_order_events" AS q
            WHERE (q."order_id", q.id) > (h."order_id", h.id)
                AND (q."order_id", q.id) <= (h."order_id", 9223372036854775807) AND q.status <> 'SENT' AND q.status <> 'DEAD'
            ORDER BY q."order_id", q.id LIMIT least(100 - (SELECT count(*) FROM ready) - (SELECT count(*) FROM continued), $4::bigint - 1)) AS q
        WHERE h.attempts < 1) AS q
    WHERE in_run AND depth < $4::bigint
    ORDER BY depth, id LIMIT 100 - (SELECT count(*) FROM ready) - (SELECT count(*) FROM continued)
), run_locked AS (
    SELECT ctid FROM "lenient_order_events" WHERE ctid = ANY(ARRAY(SELECT ctid FROM run_candidates))
    FOR UPDATE SKIP LOCKED
), run_members AS (
    SELECT c.ctid, c.id, c.expired FROM run_candidates AS c
    WHERE NOT EXISTS (SELECT FROM run_candidates AS m
        WHERE m.head = c.head AND m.id <= c.id
            AND m.ctid <> ALL(ARRAY(SELECT ctid FROM run_locked)))
),
done AS (
UPDATE "lenient_order_events" AS o SET
    status = CASE WHEN o.attempts >= 1 THEN 'DEAD' ELSE 'INPROGRESS' END,
    generation = CASE WHEN o.attempts >= 1 THEN o.generation ELSE o.generation + 1 END,
    attempts = CASE WHEN o.attempts >= 1 THEN o.attempts ELSE o.attempts + 1 END,
    lease_until = CASE WHEN o.attempts >= 1 THEN NULL ELSE statement_timestamp() + interval '30 seconds' END,
    last_error = CASE
        WHEN o.attempts < 1 THEN o.last_error
        WHEN o.status = 'INPROGRESS'
            THEN 'lease expired on claim ' || o.attempts || ' of 1: attempt budget exhausted'
        ELSE 'attempt budget exhausted: ' || o.attempts || ' claims made, the budget is now 1'
            || coalesce('; the last error: ' || o.last_error, '') END
WHERE o.ctid = ANY(ARRAY(SELECT ctid FROM ready UNION ALL SELECT ctid FROM continued UNION ALL SELECT ctid FROM run_members))
RETURNING o.id, o.event_id, o.generation, o.attempts, o.lease_until, o.next_attempt_at, o.created_at, o.id = ANY(ARRAY(SELECT id FROM continued WHERE expired UNION ALL SELECT id FROM run_members WHERE expired)) AS outbox_reclaimed, o."order_id", o."order_id"::text AS outbox_key, (SELECT CASE WHEN count(*) < 100 THEN statement_timestamp() ELSE max(next_attempt_at) END FROM ready) AS outbox_reach),
next AS (
    SELECT q.id FROM (SELECT DISTINCT ON (f."order_id") * FROM done AS f WHERE f.lease_until IS NULL ORDER BY f."order_id", f.id DESC) AS f CROSS JOIN LATERAL (
        SELECT q.id, q.status, q.next_attempt_at FROM "lenient_order_events" AS q
        WHERE (q."order_id", q.id) > (f."order_id", f.id)
            AND (q."order_id", q.id) <= (f."order_id", 9223372036854775807) AND q.status <> 'SENT' AND q.status <> 'DEAD'
        ORDER BY q."order_id", q.id LIMIT 1) AS q
    WHERE f.lease_until IS NULL AND q.status = 'READY' AND q.next_attempt_at > statement_timestamp()
), woken AS (
    UPDATE "lenient_order_events" AS w SET next_attempt_at = statement_timestamp()
    WHERE w.id = ANY(ARRAY(SELECT id FROM next))
        AND w.status || '' = 'READY' AND w.next_attempt_at > statement_timestamp())
SELECT * FROM done;

-- complete
WITH done AS (
UPDATE "lenient_order_events" SET status = 'SENT', lease_until = NULL, next_attempt_at = statement_timestamp() WHERE id = $1 AND status || '' = 'INPROGRESS' AND generation = $2 AND lease_until > clock_timestamp()
    RETURNING id, id AS outbox_id, "order_id" AS outbox_key),
next AS (
    SELECT q.id FROM (SELECT DISTINCT ON (f.outbox_key) * FROM done AS f WHERE true ORDER BY f.outbox_key, f.outbox_id DESC) AS f CROSS JOIN LATERAL (
        SELECT q.id, q.status, q.next_attempt_at FROM "lenient_order_events" AS q
        WHERE (q."order_id", q.id) > (f.outbox_key, f.outbox_id)
            AND (q."order_id", q.id) <= (f.outbox_key, 9223372036854775807) AND q.status <> 'SENT' AND q.status <> 'DEAD'
        ORDER BY q."order_id", q.id LIMIT 1) AS q
    WHERE true AND q.status = 'READY' AND q.next_attempt_at > statement_timestamp()
), woken AS (
    UPDATE "lenient_order_events" AS w SET next_attempt_at = statement_timestamp()
    WHERE w.id = ANY(ARRAY(SELECT id FROM next))
        AND w.status || '' = 'READY' AND w.next_attempt_at > statement_timestamp())
SELECT id FROM done;

-- retry
WITH done AS (
UPDATE "lenient_order_events" SET
    status = CASE WHEN attempts >= 1 THEN 'DEAD' ELSE 'READY' END,
    lease_until = NULL,
    next_attempt_at = statement_timestamp() + $3::interval,
    last_error = CASE WHEN attempts >= 1
        THEN 'attempt budget exhausted after ' || attempts || ' of 1 claims' || coalesce(': ' || $4::text, '')
        ELSE coalesce($4::text, last_error) END
WHERE id = $1 AND status || '' = 'INPROGRESS' AND generation = $2 AND lease_until > clock_timestamp()
    RETURNING status, id AS outbox_id, "order_id" AS outbox_key),
next AS (
    SELECT q.id FROM (SELECT DISTINCT ON (f.outbox_key) * FROM done AS f WHERE f.status = 'DEAD' ORDER BY f.outbox_key, f.outbox_id DESC) AS f CROSS JOIN LATERAL (
        SELECT q.id, q.status, q.next_attempt_at FROM "lenient_order_events" AS q
        WHERE (q."order_id", q.id) > (f.outbox_key, f.outbox_id)
            AND (q."order_id", q.id) <= (f.outbox_key, 9223372036854775807) AND q.status <> 'SENT' AND q.status <> 'DEAD'
        ORDER BY q."order_id", q.id LIMIT 1) AS q
    WHERE f.status = 'DEAD' AND q.status = 'READY' AND q.next_attempt_at > statement_timestamp()
), woken AS (
    UPDATE "lenient_order_events" AS w SET next_attempt_at = statement_timestamp()
    WHERE w.id = ANY(ARRAY(SELECT id FROM next))
        AND w.status || '' = 'READY' AND w.next_attempt_at > statement_timestamp())
SELECT status FROM done;

-- renew
UPDATE "lenient_order_events" SET lease_until = statement_timestamp() + interval '30 seconds' WHERE id = $1 AND status || '' = 'INPROGRESS' AND generation = $2 AND lease_until > clock_timestamp() RETURNING lease_until;

-- fail
WITH done AS (
UPDATE "lenient_order_events" SET status = 'DEAD', lease_until = NULL, last_error = $3 WHERE id = $1 AND status || '' = 'INPROGRESS' AND generation = $2 AND lease_until > clock_timestamp()
    RETURNING id, id AS outbox_id, "order_id" AS outbox_key),
next AS (
    SELECT q.id FROM (SELECT DISTINCT ON (f.outbox_key) * FROM done AS f WHERE true ORDER BY f.outbox_key, f.outbox_id DESC) AS f CROSS JOIN LATERAL (
        SELECT q.id, q.status, q.next_attempt_at FROM "lenient_order_events" AS q
        WHERE (q."order_id", q.id) > (f.outbox_key, f.outbox_id)
            AND (q."order_id", q.id) <= (f.outbox_key, 9223372036854775807) AND q.status <> 'SENT' AND q.status <> 'DEAD'
        ORDER BY q."order_id", q.id LIMIT 1) AS q
    WHERE true AND q.status = 'READY' AND q.next_attempt_at > statement_timestamp()
), woken AS (
    UPDATE "lenient_order_events" AS w SET next_attempt_at = statement_timestamp()
    WHERE w.id = ANY(ARRAY(SELECT id FROM next))
        AND w.status || '' = 'READY' AND w.next_attempt_at > statement_timestamp())
SELECT id FROM done;

-- complete_batch
WITH done AS (
UPDATE "lenient_order_events" AS o SET status = 'SENT', lease_until = NULL, next_attempt_at = statement_timestamp()
FROM unnest($1::bigint[], $2::bigint[]) AS u(id, generation)
WHERE o.id = u.id AND o.status || '' = 'INPROGRESS' AND o.generation = u.generation AND o.lease_until > clock_timestamp()
    RETURNING o.id, o.id AS outbox_id, o."order_id" AS outbox_key),
next AS (
    SELECT q.id FROM (SELECT DISTINCT ON (f.outbox_key) * FROM done AS f WHERE true ORDER BY f.outbox_key, f.outbox_id DESC) AS f CROSS JOIN LATERAL (
        SELECT q.id, q.status, q.next_attempt_at FROM "lenient_order_events" AS q
        WHERE (q."order_id", q.id) > (f.outbox_key, f.outbox_id)
            AND (q."order_id", q.id) <= (f.outbox_key, 9223372036854775807) AND q.status <> 'SENT' AND q.status <> 'DEAD'
        ORDER BY q."order_id", q.id LIMIT 1) AS q
    WHERE true AND q.status = 'READY' AND q.next_attempt_at > statement_timestamp()
), woken AS (
    UPDATE "lenient_order_events" AS w SET next_attempt_at = statement_timestamp()
    WHERE w.id = ANY(ARRAY(SELECT id FROM next))
        AND w.status || '' = 'READY' AND w.next_attempt_at > statement_timestamp())
SELECT id FROM done;

-- record
WITH done AS (
UPDATE "lenient_order_events" AS o SET
    status = CASE u.outcome
        WHEN 'SENT' THEN 'SENT'
        WHEN 'RELEASE' THEN 'READY'
        WHEN 'RETRY' THEN CASE WHEN o.attempts >= 1 THEN 'DEAD' ELSE 'READY' END
        ELSE 'DEAD' END,
    lease_until = NULL,
    attempts = CASE u.outcome WHEN 'RELEASE' THEN o.attempts - 1 ELSE o.attempts END,
    next_attempt_at = CASE u.outcome
        WHEN 'RETRY' THEN statement_timestamp() + u.delay
        WHEN 'RELEASE' THEN statement_timestamp()
        WHEN 'SENT' THEN statement_timestamp()
        ELSE o.next_attempt_at END,
    last_error = CASE
        WHEN u.outcome = 'RETRY' AND o.attempts >= 1
            THEN 'attempt budget exhausted after ' || o.attempts || ' of 1 claims' || coalesce(': ' || u.error, '')
        WHEN u.outcome IN ('RETRY', 'DEAD', 'RELEASE') THEN coalesce(u.error, o.last_error)
        ELSE o.last_error END
FROM unnest($1::bigint[], $2::bigint[], $3::text[], $4::interval[], $5::text[])
    AS u(id, generation, outcome, delay, error)
WHERE o.id = u.id AND o.status || '' = 'INPROGRESS' AND o.generation = u.generation AND o.lease_until > clock_timestamp()
    RETURNING o.id, o.status, o.id AS outbox_id, o."order_id" AS outbox_key),
next AS (
    SELECT q.id FROM (SELECT DISTINCT ON (f.outbox_key) * FROM done AS f WHERE f.status IN ('SENT', 'DEAD') ORDER BY f.outbox_key, f.outbox_id DESC) AS f CROSS JOIN LATERAL (
        SELECT q.id, q.status, q.next_attempt_at FROM "lenient_order_events" AS q
        WHERE (q."order_id", q.id) > (f.outbox_key, f.outbox_id)
            AND (q."order_id", q.id) <= (f.outbox_key, 9223372036854775807) AND q.status <> 'SENT' AND q.status <> 'DEAD'
        ORDER BY q."order_id", q.id LIMIT 1) AS q
    WHERE f.status IN ('SENT', 'DEAD') AND q.status = 'READY' AND q.next_attempt_at > statement_timestamp()
), woken AS (
    UPDATE "lenient_order_events" AS w SET next_attempt_at = statement_timestamp()
    WHERE w.id = ANY(ARRAY(SELECT id FROM next))
        AND w.status || '' = 'READY' AND w.next_attempt_at > statement_timestamp())
SELECT id, status FROM done;

-- renew_batch
UPDATE "lenient_order_events" AS o SET lease_until = statement_timestamp() + interval '30 seconds'
FROM unnest($1::bigint[], $2::bigint[]) AS u(id, generation)
WHERE o.id = u.id AND o.status || '' = 'INPROGRESS' AND o.generation = u.generation AND o.lease_until > clock_timestamp()
RETURNING o.id, o.lease_until;

-- requeue_dead
UPDATE "lenient_order_events" SET status = 'READY', attempts = 0, next_attempt_at = statement_timestamp() WHERE status = 'DEAD' AND event_id = ANY($1::text[]) RETURNING event_id;

-- requeue_all_dead
WITH requeued AS (UPDATE "lenient_order_events" SET status = 'READY', attempts = 0, next_attempt_at = statement_timestamp() WHERE status = 'DEAD' RETURNING 1)
SELECT count(*) AS requeued FROM requeued;

-- discard_dead
DELETE FROM "lenient_order_events" WHERE status = 'DEAD' AND event_id = ANY($1::text[]) RETURNING event_id;

-- prune_sent
WITH doomed AS (
    SELECT id FROM "lenient_order_events"
    WHERE status = 'SENT' AND next_attempt_at < statement_timestamp() - $1::interval
    ORDER BY id LIMIT $2 FOR UPDATE SKIP LOCKED)
DELETE FROM "lenient_order_events" AS o USING doomed AS d WHERE o.id = d.id;

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
    FROM "lenient_order_events") AS s
LEFT JOIN LATERAL (SELECT
    statement_timestamp() - greatest(created_at, statement_timestamp() - interval '31557600000 seconds') AS oldest_waiting_age,
    last_error AS oldest_waiting_error
    FROM "lenient_order_events" WHERE id = s.first_waiting) AS w ON true;
