-- The example application's business table: orders are written in the same
-- transaction as their OrderPlaced event.
CREATE TABLE orders (
    id uuid PRIMARY KEY,
    customer text NOT NULL,
    total_cents bigint NOT NULL CHECK (total_cents >= 0),
    placed_at timestamptz NOT NULL DEFAULT now()
);
