//! The README's first program is this package: its `[dependencies]` and `src/main.rs`
//! are the README's code blocks marked `<!-- newcomer: ... -->`, byte for byte, and the
//! program does what the README says when it runs.

use std::error::Error;
use std::process::Output;
use std::time::Duration;

use outbox::testing::TestSchema;

const README: &str = include_str!("../../../README.md");
const MAIN_RS: &str = include_str!("../src/main.rs");
const CARGO_TOML: &str = include_str!("../Cargo.toml");
const WORKSPACE_TOML: &str = include_str!("../../../Cargo.toml");

/// The code block that follows `<!-- newcomer: {what} -->` in the README.
fn readme_block(what: &str) -> &'static str {
    let marker = format!("<!-- newcomer: {what} -->\n");
    let mut found = README.match_indices(&marker);
    let (at, _) = found
        .next()
        .unwrap_or_else(|| panic!("README.md has no `{}` marker", marker.trim_end()));
    assert!(
        found.next().is_none(),
        "README.md has two `{}` markers",
        marker.trim_end()
    );
    let after = &README[at + marker.len()..];
    let fence = after
        .strip_prefix("```")
        .unwrap_or_else(|| panic!("`{}` must be followed by a code block", marker.trim_end()));
    let body = &fence[fence.find('\n').expect("a fence line") + 1..];
    &body[..=body.find("\n```\n").expect("a closing fence")]
}

/// The `[dependencies]` table of this package's manifest, as written.
fn manifest_dependencies() -> &'static str {
    let start = CARGO_TOML
        .find("\n[dependencies]\n")
        .expect("a [dependencies] table")
        + 1;
    let rest = &CARGO_TOML[start..];
    let end = rest[1..].find("\n[").map_or(rest.len(), |end| end + 2);
    rest[..end].trim_end_matches('\n')
}

/// `0.1` for version `0.1.0` of the workspace.
fn outbox_requirement() -> String {
    let version = WORKSPACE_TOML
        .lines()
        .find_map(|line| line.strip_prefix("version = \""))
        .and_then(|rest| rest.strip_suffix('"'))
        .expect("the workspace version");
    let mut parts = version.split('.');
    format!("{}.{}", parts.next().unwrap(), parts.next().unwrap())
}

#[test]
fn the_readme_shows_this_program() {
    assert_eq!(
        readme_block("src/main.rs"),
        MAIN_RS,
        "README.md's first program differs from examples/newcomer/src/main.rs"
    );
}

#[test]
fn the_readme_shows_these_dependencies() {
    let here = manifest_dependencies();
    let path_line = "outbox = { path = \"../..\" }";
    assert!(
        here.lines().any(|line| line == path_line),
        "examples/newcomer/Cargo.toml depends on outbox by `{path_line}`"
    );
    let published = here.replace(path_line, &format!("outbox = \"{}\"", outbox_requirement()));
    assert_eq!(
        readme_block("Cargo.toml"),
        format!("{published}\n"),
        "README.md's [dependencies] differ from examples/newcomer/Cargo.toml's"
    );
}

/// Runs the program with `DATABASE_URL` (or without it, when `None`).
async fn run(database_url: Option<&str>) -> Output {
    let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_newcomer"));
    command.env_remove("DATABASE_URL").kill_on_drop(true);
    if let Some(url) = database_url {
        command.env("DATABASE_URL", url);
    }
    tokio::time::timeout(Duration::from_mins(2), command.output())
        .await
        .expect("the program finishes within 2 minutes")
        .expect("the program runs")
}

fn describe(output: &Output) -> String {
    format!(
        "{}\n--- stdout:\n{}--- stderr:\n{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

/// What one successful run printed: the event id it enqueued, after checking that
/// the sink printed that event and that the relay shut down.
fn published_event_id(output: &Output) -> String {
    assert!(
        output.status.success(),
        "the program failed: {}",
        describe(output)
    );
    let stdout = String::from_utf8_lossy(&output.stdout);
    let id = stdout
        .lines()
        .find_map(|line| line.strip_prefix("enqueued "))
        .unwrap_or_else(|| panic!("no `enqueued <id>` line: {}", describe(output)))
        .to_owned();
    // StdoutSink: `event_id generation attempt event`.
    let published = stdout.lines().any(|line| {
        line.strip_prefix(&format!("{id} "))
            .is_some_and(|rest| rest.contains(" 1 OrderPlaced { order_id: "))
    });
    assert!(
        published,
        "the sink did not print event {id}: {}",
        describe(output)
    );
    assert_eq!(
        stdout.lines().last(),
        Some("published; the relay has shut down"),
        "{}",
        describe(output)
    );
    id
}

#[tokio::test]
async fn the_first_program_publishes_its_event() -> Result<(), Box<dyn Error>> {
    let schema = TestSchema::new().await?;
    let first = published_event_id(&run(Some(&schema.url())).await);
    // Run again on the same database: `migrate` finds its table, a new order is placed.
    let second = published_event_id(&run(Some(&schema.url())).await);
    assert_ne!(first, second);

    let mut rows: Vec<(String, String)> =
        sqlx::query_as("SELECT event_id, status FROM order_events ORDER BY id")
            .fetch_all(schema.pool())
            .await?;
    let sent = |id: &str| (id.to_owned(), "SENT".to_owned());
    assert_eq!(rows, [sent(&first), sent(&second)]);
    // And the business rows, committed with their events.
    rows = sqlx::query_as("SELECT id::text, customer FROM orders ORDER BY id")
        .fetch_all(schema.pool())
        .await?;
    let order = |id: &str| (id.to_owned(), "ada@example.com".to_owned());
    assert_eq!(rows, [order(&first), order(&second)]);

    schema.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn without_database_url_it_says_so() {
    let output = run(None).await;
    assert!(!output.status.success(), "{}", describe(&output));
    assert!(
        String::from_utf8_lossy(&output.stderr).contains("set DATABASE_URL"),
        "{}",
        describe(&output)
    );
}

/// A wrong port: the program says at once where it tried and why it failed, in one
/// readable line (not sqlx's "pool timed out" after 30 s, nor an error's `Debug` form).
#[tokio::test]
async fn a_wrong_port_says_where_and_why() -> Result<(), Box<dyn Error>> {
    // A port nothing listens on: one just freed.
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let output = run(Some(&format!("postgres://ada@127.0.0.1:{port}/shop"))).await;
    assert!(!output.status.success(), "{}", describe(&output));
    let stderr = String::from_utf8_lossy(&output.stderr);
    let expected = format!(
        "Error: cannot connect to PostgreSQL at 127.0.0.1:{port}/shop as ada: \
         error communicating with database: Connection refused"
    );
    assert!(
        stderr.starts_with(&expected) && stderr.lines().count() == 1,
        "{}",
        describe(&output)
    );
    Ok(())
}
