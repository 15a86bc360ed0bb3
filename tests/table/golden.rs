//! The SQL the derive generates for the example event types is checked in under
//! `migrations/outbox/<table>/`, its migrations and its statements (`statements.sql`):
//! a change to the derive's output shows up in review as a diff of SQL, and this test
//! fails until the files are regenerated with `OUTBOX_BLESS=1 cargo test --test table golden`.
//! (Once released, a table's applied migrations must never change: refinery would
//! report them as edited.)

// Only the tests' event types, not the rest of the harness.

use std::path::{Path, PathBuf};

use outbox::__private::Statement;
use outbox::schema::TableMigrations;

/// Every statement of `table`, as the runtime runs it (the claims with a limit of 100),
/// and on a keyed table the claim made by hand (one event per key) after the relay's.
fn statements(table: TableMigrations) -> String {
    let sql = table.spec().sql();
    let keyed = table.spec().key().is_some();
    Statement::ALL
        .into_iter()
        .flat_map(|statement| {
            let (name, text) = (statement.name(), sql.get(statement).to_owned());
            match statement {
                Statement::Claim if keyed => vec![
                    (name.to_owned(), sql.claim_limited(100, true)),
                    (
                        format!("{name} (one event per key)"),
                        sql.claim_limited(100, false),
                    ),
                ],
                Statement::Claim => vec![(name.to_owned(), sql.claim_limited(100, true))],
                Statement::ClaimFrom => vec![(name.to_owned(), sql.claim_from_limited(100))],
                _ => vec![(name.to_owned(), text)],
            }
        })
        .map(|(name, text)| format!("-- {name}\n{text};\n"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Records `path` as stale unless it holds `generated`; with `OUTBOX_BLESS`, writes it.
fn compare(path: &Path, generated: &str, stale: &mut Vec<String>) {
    if std::env::var_os("OUTBOX_BLESS").is_some() {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, generated).unwrap();
    } else if std::fs::read_to_string(path).ok().as_deref() != Some(generated) {
        stale.push(format!(
            "{}\n--- the derive generates:\n{generated}",
            path.display()
        ));
    }
}

fn check(tables: &[TableMigrations]) {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("migrations/outbox");
    let mut stale = Vec::new();
    for table in tables {
        let dir = root.join(table.table());
        for step in table.spec().migrations() {
            compare(
                &dir.join(format!("{}.sql", step.name)),
                step.sql,
                &mut stale,
            );
        }
        compare(&dir.join("statements.sql"), &statements(*table), &mut stale);
    }
    assert!(
        stale.is_empty(),
        "golden files differ (regenerate with OUTBOX_BLESS=1):\n{}",
        stale.join("\n")
    );
}

/// Every event type in this repository: the `checked` build applies their files to
/// the schema it compiles against.
fn every_table() -> [TableMigrations; 28] {
    [
        outbox_testkit::app::OrderPlaced::migrations(),
        outbox_testkit::app::EmailChanged::migrations(),
        outbox_testkit::app::PaymentCaptured::migrations(),
        outbox_testkit::app::BenchEvent::migrations(),
        outbox_testkit::app::BenchDeletedEvent::migrations(),
        outbox_testkit::app::BenchOrderedEvent::migrations(),
        outbox_testkit::app::BenchKeyedEvent::migrations(),
        outbox_testkit::app::BenchTracedEvent::migrations(),
        outbox_testkit::app::BenchUnindexedEvent::migrations(),
        outbox_testkit::app::BenchUnindexedDeletedEvent::migrations(),
        outbox_testkit::events::LabEvent::migrations(),
        outbox_testkit::events::ChaosEvent::migrations(),
        outbox_testkit::events::EveryType::migrations(),
        outbox_testkit::events::Tick::migrations(),
        outbox_testkit::events::Budgeted::migrations(),
        outbox_testkit::events::Receipt::migrations(),
        outbox_testkit::events::OrderStep::migrations(),
        outbox_testkit::events::LenientStep::migrations(),
        outbox_testkit::events::Shipment::migrations(),
        outbox_testkit::events::OrderedChaosEvent::migrations(),
        outbox_testkit::events::KeyedNote::migrations(),
        outbox_testkit::events::ParcelSentChanged::migrations(),
        outbox_testkit::events::LongSend::migrations(),
        outbox_testkit::events::Reminder::migrations(),
        outbox_testkit::events::KeyedReminder::migrations(),
        outbox_testkit::events::Notice::migrations(),
        outbox_testkit::events::TracedOrder::migrations(),
        outbox_testkit::events::Pulse::migrations(),
    ]
}

#[test]
fn generated_migrations_match_the_golden_files() {
    check(&every_table());
}

/// The names the statements give their steps (`WITH ready AS (..)`) are the ones the
/// derive refuses as table names: one would stand for the table inside a statement.
#[test]
fn every_step_of_the_statements_has_a_name_no_table_may_take() {
    for table in every_table() {
        let text = statements(table);
        for (at, _) in text.match_indices(" AS (") {
            let step = text[..at]
                .rsplit(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .next()
                .unwrap_or_default();
            assert!(
                outbox::__private::STATEMENT_STEPS.contains(&step),
                "{}: the step `{step}` is not in STATEMENT_STEPS",
                table.table()
            );
        }
    }
}

#[test]
fn a_field_added_later_is_its_own_migration_version() {
    let steps = outbox_testkit::app::EmailChanged::migrations()
        .spec()
        .migrations();
    let names: Vec<(u32, &str)> = steps.iter().map(|s| (s.version, s.name)).collect();
    assert_eq!(
        names,
        [(1, "V1__create_customer_events"), (2, "V2__add_referrer")]
    );
    assert!(!steps[0].sql.contains("referrer"));
    assert_eq!(
        steps[1].sql,
        "ALTER TABLE \"customer_events\" ADD COLUMN \"referrer\" text;\n"
    );
}
