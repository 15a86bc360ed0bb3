-- Events enqueued before this version were due at their enqueue (NULL).
ALTER TABLE "notice_events" ADD COLUMN publish_at timestamptz;
ALTER TABLE "notice_events" ADD COLUMN "audience" text;
