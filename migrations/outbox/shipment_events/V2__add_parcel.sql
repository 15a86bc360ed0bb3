ALTER TABLE "shipment_events" ADD COLUMN "parcel" text;
-- Events enqueued before this version have no key (NULL): they are published
-- in no particular order, as before, and never hold back a keyed event.
-- Each key's events not yet SENT, in order: an event is claimed only when none
-- comes before it.
CREATE INDEX ON "shipment_events" ("parcel", id) WHERE status <> 'SENT';
