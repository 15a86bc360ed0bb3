//! The SQL the derive generates for the example event types is checked in under
//! `migrations/outbox/<table>/`: a change to the derive's output shows up in review as
//! a diff, and this test fails until the files are regenerated with
//! `OUTBOX_BLESS=1 cargo test --test golden`. (Once released, a table's applied
//! migrations must never change: refinery would report them as edited.)

#[path = "../examples/common/mod.rs"]
mod common;
// Only the tests' event types, not the rest of the harness.
#[path = "support/events.rs"]
mod events;

use std::path::PathBuf;

use outbox::TableMigrations;

fn check(tables: &[TableMigrations]) {
    let bless = std::env::var_os("OUTBOX_BLESS").is_some();
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("migrations/outbox");
    let mut stale = Vec::new();
    for table in tables {
        let dir = root.join(table.table());
        for step in table.spec().migrations() {
            let path = dir.join(format!("{}.sql", step.name));
            if bless {
                std::fs::create_dir_all(&dir).unwrap();
                std::fs::write(&path, step.sql).unwrap();
            } else if std::fs::read_to_string(&path).ok().as_deref() != Some(step.sql) {
                stale.push(format!(
                    "{}\n--- the derive generates:\n{}",
                    path.display(),
                    step.sql
                ));
            }
        }
    }
    assert!(
        stale.is_empty(),
        "golden migrations differ (regenerate with OUTBOX_BLESS=1):\n{}",
        stale.join("\n")
    );
}

#[test]
fn generated_migrations_match_the_golden_files() {
    // Every event type in this repository: the `checked` build applies these files to
    // the schema it compiles against.
    check(&[
        common::OrderPlaced::migrations(),
        common::EmailChanged::migrations(),
        common::PaymentCaptured::migrations(),
        common::BenchEvent::migrations(),
        events::LabEvent::migrations(),
        events::ChaosEvent::migrations(),
        events::EveryType::migrations(),
        events::Tick::migrations(),
        events::Budgeted::migrations(),
    ]);
}

#[test]
fn a_field_added_later_is_its_own_migration_version() {
    let steps = common::EmailChanged::migrations().spec().migrations();
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
