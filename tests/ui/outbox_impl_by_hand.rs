// A hand-written `Outbox` impl could supply SQL without the lease and generation guards
// (here, a `complete` that marks any row SENT). Only `#[derive(Outbox)]` may implement
// the trait: its hidden required item is missing, and a `TableSpec` cannot be built
// outside the derive.
use outbox::__private::{PgQuery, PgRow, sqlx};
use outbox::{EventId, schema::TableSpec};

struct OrderPlaced {
    customer: String,
}

impl outbox::Outbox for OrderPlaced {
    const SPEC: &'static TableSpec = &TableSpec {
        table: "order_events",
        sql: outbox::Statements {
            complete: "UPDATE order_events SET status = 'SENT' WHERE id = $1",
        },
    };

    fn event_id(&self) -> Option<EventId> {
        None
    }

    fn bind<'q>(&'q self, query: PgQuery<'q>) -> PgQuery<'q> {
        query.bind(&self.customer)
    }

    fn bind_all<'q>(events: &'q [Self], query: PgQuery<'q>) -> PgQuery<'q> {
        query.bind(events.iter().map(|e| &e.customer).collect::<Vec<_>>())
    }

    fn decode(row: &PgRow, _event_id: &str) -> Result<Self, sqlx::Error> {
        Ok(Self {
            customer: sqlx::Row::try_get(row, "customer")?,
        })
    }
}

fn main() {}
