ALTER TABLE "customer_events" ADD COLUMN "referrer" text;
