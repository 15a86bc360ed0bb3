//! `outbox serve`, the real binary against a seeded schema: its JSON API over plain
//! HTTP (what it reports, and the guards on its writes), then its page in a real
//! headless Chromium (what it shows, and its Requeue button).
//!
//! The browser test needs Debian's `chromium` and `chromium-driver` (CI installs them);
//! without them it fails saying so (to leave it out, `cargo test --features cli --test
//! dashboard -- --skip the_page_in_a_browser`, which reports it filtered out, not passed).

use std::fmt::Write as _;
use std::io::{BufRead as _, BufReader};
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use fantoccini::{ClientBuilder, Locator};
use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use outbox::testing::TestSchema;
use outbox_testkit::events::{Budgeted, Receipt};
use outbox_testkit::rows::{enqueue, status};
use outbox_testkit::schema::schema_with;
use outbox_testkit::{TestResult, wait_until};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;
use tokio::time::sleep;

/// Why the seeded dead event died: markup, which the page must show as text.
const BROKER_ERROR: &str =
    "<b>rejected</b> by the broker: message too large & <img src=x onerror=alert(1)>";

fn budgeted(name: &str) -> Budgeted {
    Budgeted { name: name.into() }
}

/// Two tables: `budget_events` keeps its sent rows (3 SENT, 2 READY, and `doomed`
/// DEAD with [`BROKER_ERROR`]); `receipt_events` deletes them (1 READY).
async fn seeded() -> TestResult<TestSchema> {
    let db = schema_with(&[Budgeted::migrations(), Receipt::migrations()]).await?;
    let pool = db.pool();
    enqueue(pool, &[budgeted("doomed")]).await;
    let claim = Budgeted::claim(pool).await?.expect("doomed is due");
    claim.fail(pool, BROKER_ERROR).await?;
    enqueue(
        pool,
        &[budgeted("sent-1"), budgeted("sent-2"), budgeted("sent-3")],
    )
    .await;
    for claim in Budgeted::claim_batch(pool, 3).await? {
        claim.complete(pool).await?;
    }
    enqueue(pool, &[budgeted("waiting-1"), budgeted("waiting-2")]).await;
    enqueue(
        pool,
        &[Receipt {
            name: "receipt-1".into(),
        }],
    )
    .await;
    Ok(db)
}

/// Publishes `n` more events of `budget_events` (enqueued, claimed, recorded SENT).
async fn publish(db: &TestSchema, n: usize) -> TestResult {
    let events: Vec<Budgeted> = (0..n)
        .map(|_| budgeted(&format!("traffic-{}", uuid::Uuid::now_v7())))
        .collect();
    enqueue(db.pool(), &events).await;
    for claim in Budgeted::claim_batch(db.pool(), u32::try_from(n)?).await? {
        claim.complete(db.pool()).await?;
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// The dashboard process, and a small HTTP client for it
// ---------------------------------------------------------------------------------------

/// `outbox serve` running as a child process; killed when dropped, even by a panic.
struct Dashboard {
    child: Child,
    /// `127.0.0.1:<port>`, from its startup line.
    address: String,
    /// Its startup line.
    startup: String,
}

impl Dashboard {
    /// Starts `outbox --database-url <url> serve --bind 127.0.0.1:0 <args>` and waits
    /// for the line saying where it listens.
    fn start(database_url: &str, args: &[&str]) -> TestResult<Self> {
        Self::start_on(database_url, "127.0.0.1:0", args)
    }

    /// [`start`](Self::start), listening on `bind`.
    fn start_on(database_url: &str, bind: &str, args: &[&str]) -> TestResult<Self> {
        let mut child = Command::new(env!("CARGO_BIN_EXE_outbox"))
            .args(["--database-url", database_url, "serve", "--bind", bind])
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()?;
        let stderr = child.stderr.take().expect("piped");
        let (lines, received) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                eprintln!("[outbox serve] {line}");
                if lines.send(line).is_err() {
                    // Nobody waits for lines any more: keep draining the pipe.
                }
            }
        });
        let mut dashboard = Self {
            child,
            address: String::new(),
            startup: String::new(),
        };
        let startup = loop {
            let line = received.recv_timeout(Duration::from_mins(1)).map_err(|_| {
                "outbox serve did not say where it listens (see its stderr above)".to_owned()
            })?;
            if line.contains("listening on http://") {
                break line;
            }
        };
        let address = startup
            .split("listening on http://")
            .nth(1)
            .and_then(|rest| rest.split('/').next())
            .unwrap_or_default()
            .to_owned();
        dashboard.address = address;
        dashboard.startup = startup;
        Ok(dashboard)
    }

    fn url(&self) -> String {
        format!("http://{}/", self.address)
    }

    fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    async fn get(&self, path: &str) -> TestResult<Reply> {
        self.request("GET", path, &[], None).await
    }

    /// A JSON POST with `headers` (a write's token among them, or not).
    async fn post(&self, path: &str, headers: &[(&str, &str)], body: &Value) -> TestResult<Reply> {
        let mut all = vec![("Content-Type", "application/json")];
        all.extend_from_slice(headers);
        self.request("POST", path, &all, Some(&body.to_string()))
            .await
    }

    /// One HTTP/1.1 request on a fresh connection; `Host` is this server's unless
    /// `headers` names another.
    async fn request(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: Option<&str>,
    ) -> TestResult<Reply> {
        let mut stream = TcpStream::connect(&self.address).await?;
        let mut head = format!("{method} {path} HTTP/1.1\r\nConnection: close\r\n");
        if !headers
            .iter()
            .any(|(name, _)| name.eq_ignore_ascii_case("host"))
        {
            write!(head, "Host: {}\r\n", self.address)?;
        }
        for (name, value) in headers {
            write!(head, "{name}: {value}\r\n")?;
        }
        let body = body.unwrap_or_default();
        write!(head, "Content-Length: {}\r\n\r\n{body}", body.len())?;
        stream.write_all(head.as_bytes()).await?;
        let mut raw = Vec::new();
        stream.read_to_end(&mut raw).await?;
        Reply::parse(&raw)
    }
}

impl Drop for Dashboard {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A response: status, headers (names lowercased), body.
#[derive(Debug)]
struct Reply {
    status: u16,
    headers: Vec<(String, String)>,
    body: String,
}

impl Reply {
    fn parse(raw: &[u8]) -> TestResult<Self> {
        let text = String::from_utf8(raw.to_vec())?;
        let (head, body) = text
            .split_once("\r\n\r\n")
            .ok_or("a response without a blank line after its head")?;
        let mut lines = head.lines();
        let status = lines
            .next()
            .and_then(|l| l.split(' ').nth(1))
            .ok_or("no status line")?
            .parse()?;
        let headers: Vec<(String, String)> = lines
            .filter_map(|l| l.split_once(':'))
            .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_owned()))
            .collect();
        let chunked = headers
            .iter()
            .any(|(n, v)| n == "transfer-encoding" && v.contains("chunked"));
        let body = if chunked {
            dechunk(body)?
        } else {
            body.to_owned()
        };
        Ok(Self {
            status,
            headers,
            body,
        })
    }

    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.body))
    }

    /// The `error` of a JSON error answer.
    fn error(&self) -> String {
        self.json()["error"]
            .as_str()
            .unwrap_or_else(|| panic!("no error message: {}", self.body))
            .to_owned()
    }
}

fn dechunk(mut body: &str) -> TestResult<String> {
    let mut out = String::new();
    loop {
        let (size, rest) = body.split_once("\r\n").ok_or("a chunk without its size")?;
        let size = usize::from_str_radix(size.trim(), 16)?;
        if size == 0 {
            return Ok(out);
        }
        out += rest.get(..size).ok_or("a chunk shorter than its size")?;
        body = rest.get(size + 2..).ok_or("a chunk without its CRLF")?;
    }
}

/// The write token a page embeds (`null` when writes are disabled).
fn token_of(page: &str) -> Option<String> {
    let config = page
        .split(r#"<script id="config" type="application/json">"#)
        .nth(1)?
        .split("</script>")
        .next()?;
    let config: Value = serde_json::from_str(config).ok()?;
    config["token"].as_str().map(str::to_owned)
}

fn table<'a>(status: &'a Value, name: &str) -> &'a Value {
    status["tables"]
        .as_array()
        .and_then(|tables| tables.iter().find(|t| t["table"] == name))
        .unwrap_or_else(|| panic!("no table {name} in {status}"))
}

fn series<'a>(status: &'a Value, name: &str) -> Option<&'a Value> {
    status["throughput"]
        .as_array()?
        .iter()
        .find(|s| s["table"] == name)
}

// ---------------------------------------------------------------------------------------
// The JSON API
// ---------------------------------------------------------------------------------------

#[tokio::test]
async fn the_status_api_reports_every_table_and_the_throughput_it_sampled() -> TestResult {
    let db = seeded().await?;
    let dashboard = Dashboard::start(&db.url(), &["--sample-every", "200ms"])?;
    assert!(
        dashboard.startup.contains("read-only"),
        "the startup line says writes are off: {}",
        dashboard.startup
    );

    // The counts, per table, as `outbox status --json` has them.
    let reply = dashboard.get("/api/status").await?;
    assert_eq!(reply.status, 200, "{}", reply.body);
    let status = reply.json();
    assert_eq!(status["writes"], false);
    let budget = table(&status, "budget_events");
    assert_eq!(
        (
            &budget["ready"],
            &budget["due"],
            &budget["dead"],
            &budget["sent"],
            &budget["sent_last_minute"]
        ),
        (&json!(2), &json!(2), &json!(1), &json!(3), &json!(3))
    );
    let receipts = table(&status, "receipt_events");
    assert_eq!(receipts["ready"], 1);
    assert_eq!(
        receipts["sent_last_minute"],
        Value::Null,
        "a table that deletes its sent rows has no sent count"
    );

    // Events published while the sampler runs show as throughput; the table that
    // deletes its sent rows has none to show.
    publish(&db, 6).await?;
    let mut sampled = Value::Null;
    wait_until(
        "the samples show the published events",
        Duration::from_secs(30),
        async || {
            sampled = dashboard.get("/api/status").await.unwrap().json();
            series(&sampled, "budget_events").is_some_and(|s| {
                s["points"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .any(|p| p["sent_per_minute"].as_f64().is_some_and(|r| r > 0.0))
            })
        },
    )
    .await;
    let receipts = series(&sampled, "receipt_events").expect("receipt_events is sampled");
    assert_eq!(receipts["counts_sent"], false);
    assert!(
        receipts["points"]
            .as_array()
            .unwrap()
            .iter()
            .all(|p| p["sent_per_minute"].is_null() && p["due"] == 1),
        "{receipts}"
    );

    // The dead events, with their errors as they are.
    let dead = dashboard.get("/api/dead?table=budget_events").await?.json();
    let events = dead["events"].as_array().unwrap();
    assert_eq!(events.len(), 1, "{dead}");
    assert_eq!(events[0]["event_id"], "doomed");
    assert_eq!(events[0]["last_error"], BROKER_ERROR);
    assert_eq!(events[0]["attempts"], 1);
    // Without a table: every table's, each named (receipt_events has none).
    let every_table = dashboard.get("/api/dead").await?.json();
    let listed: Vec<(&Value, &Value)> = every_table["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| (&e["table"], &e["event_id"]))
        .collect();
    assert_eq!(listed, [(&json!("budget_events"), &json!("doomed"))]);

    let unknown = dashboard.get("/api/dead?table=nope").await?;
    assert_eq!(unknown.status, 404);
    assert!(unknown.error().contains("nope"), "{}", unknown.body);
    let bad_limit = dashboard.get("/api/dead?limit=many").await?;
    assert_eq!(bad_limit.status, 400, "{}", bad_limit.body);

    // The page: served with a strict policy, and without a token when read-only.
    let page = dashboard.get("/").await?;
    assert_eq!(page.status, 200);
    assert!(
        page.header("content-type")
            .unwrap()
            .starts_with("text/html")
    );
    assert!(
        page.header("content-security-policy")
            .is_some_and(|csp| csp.contains("default-src 'none'")),
        "{:?}",
        page.headers
    );
    assert_eq!(token_of(&page.body), None);

    drop(dashboard);
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn writes_on_an_address_other_machines_reach_need_a_login() -> TestResult {
    let db = seeded().await?;
    // The page hands its write token to whoever loads it: on every address, anyone.
    let refused = Command::new(env!("CARGO_BIN_EXE_outbox"))
        .args(["--database-url", &db.url(), "serve", "--bind", "0.0.0.0:0"])
        .arg("--allow-writes")
        .output()?;
    let said = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success(), "{said}");
    assert!(said.contains("needs --basic-auth-file"), "{said}");

    let login = std::env::temp_dir().join(format!("outbox-login-{}", db.name()));
    std::fs::write(&login, "ops:s3cret\n")?;
    let dashboard = Dashboard::start_on(
        &db.url(),
        "0.0.0.0:0",
        &[
            "--allow-writes",
            "--basic-auth-file",
            &login.to_string_lossy(),
        ],
    )?;
    let anonymous = dashboard.get("/").await?;
    assert_eq!(anonymous.status, 401, "{}", anonymous.body);
    assert!(
        anonymous
            .header("www-authenticate")
            .is_some_and(|h| h.starts_with("Basic")),
        "{anonymous:?}"
    );
    // ops:wrong, then ops:s3cret.
    let wrong = [("Authorization", "Basic b3BzOndyb25n")];
    let right = [("Authorization", "Basic b3BzOnMzY3JldA==")];
    for path in ["/", "/api/status"] {
        let reply = dashboard.request("GET", path, &wrong, None).await?;
        assert_eq!(reply.status, 401, "{path}");
        let reply = dashboard.request("GET", path, &right, None).await?;
        assert_eq!(reply.status, 200, "{path}: {}", reply.body);
    }
    let token = token_of(&dashboard.request("GET", "/", &right, None).await?.body)
        .expect("the page embeds its token");
    let prune =
        json!({ "table": "budget_events", "older_than": "0s", "dry_run": true }).to_string();
    let without_login = dashboard
        .request(
            "POST",
            "/api/prune",
            &[
                ("X-Outbox-Token", &token),
                ("Content-Type", "application/json"),
            ],
            Some(&prune),
        )
        .await?;
    assert_eq!(without_login.status, 401, "the token alone is not enough");
    let with_login = dashboard
        .request(
            "POST",
            "/api/prune",
            &[
                right[0],
                ("X-Outbox-Token", &token),
                ("Content-Type", "application/json"),
            ],
            Some(&prune),
        )
        .await?;
    assert_eq!(with_login.status, 200, "{}", with_login.body);
    drop(dashboard);
    std::fs::remove_file(&login)?;
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn requeue_all_requeues_the_count_confirmed_or_nothing() -> TestResult {
    let db = seeded().await?;
    let dashboard = Dashboard::start(&db.url(), &["--allow-writes"])?;
    let page = dashboard.get("/").await?;
    let token = token_of(&page.body).expect("a page with writes enabled embeds the token");
    let with_token = ("X-Outbox-Token", token.as_str());
    let still_dead = async || status::<Budgeted>(db.pool(), "doomed").await == "DEAD";
    // "Requeue all" requeues what the operator confirmed, or nothing: one event is
    // dead, the page said two.
    let all = |expected: Option<u64>| match expected {
        Some(n) => json!({ "table": "budget_events", "all": true, "expected": n }),
        None => json!({ "table": "budget_events", "all": true }),
    };
    let reply = dashboard
        .post("/api/requeue", &[with_token], &all(None))
        .await?;
    assert_eq!(reply.status, 400, "{}", reply.body);
    let reply = dashboard
        .post("/api/requeue", &[with_token], &all(Some(2)))
        .await?;
    assert_eq!(reply.status, 409, "{}", reply.body);
    assert!(
        reply.body.contains("nothing was requeued"),
        "{}",
        reply.body
    );
    assert!(still_dead().await);
    let reply = dashboard
        .post("/api/requeue", &[with_token], &all(Some(1)))
        .await?;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(reply.json()["requeued"], json!(1));
    assert_eq!(status::<Budgeted>(db.pool(), "doomed").await, "READY");
    drop(dashboard);
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn a_write_needs_the_token_of_the_page_a_json_body_and_the_same_origin() -> TestResult {
    let db = seeded().await?;
    let dashboard = Dashboard::start(&db.url(), &["--allow-writes"])?;
    assert!(
        dashboard.startup.contains("writes enabled"),
        "{}",
        dashboard.startup
    );
    let page = dashboard.get("/").await?;
    let token = token_of(&page.body).expect("a page with writes enabled embeds the token");
    let requeue = json!({ "table": "budget_events", "event_ids": ["doomed"] });
    let still_dead = async || status::<Budgeted>(db.pool(), "doomed").await == "DEAD";

    // Without the token, or with another one: refused, nothing changed.
    let refused = dashboard.post("/api/requeue", &[], &requeue).await?;
    assert_eq!(refused.status, 403, "{}", refused.body);
    assert!(
        refused.error().contains("X-Outbox-Token"),
        "{}",
        refused.body
    );
    let wrong = "0".repeat(token.len());
    let refused = dashboard
        .post("/api/requeue", &[("X-Outbox-Token", &wrong)], &requeue)
        .await?;
    assert_eq!(refused.status, 403, "{}", refused.body);
    assert!(still_dead().await);

    // With the token, but from another site's page, or not as JSON: refused too.
    let with_token = ("X-Outbox-Token", token.as_str());
    let refused = dashboard
        .post(
            "/api/requeue",
            &[with_token, ("Origin", "http://attacker.example")],
            &requeue,
        )
        .await?;
    assert_eq!(refused.status, 403, "{}", refused.body);
    let as_form = dashboard
        .request(
            "POST",
            "/api/requeue",
            &[with_token, ("Content-Type", "text/plain")],
            Some(&requeue.to_string()),
        )
        .await?;
    assert_eq!(as_form.status, 415, "{}", as_form.body);
    assert!(still_dead().await);

    // A page served under another name (DNS rebinding) gets neither the page nor the
    // token.
    let rebound = dashboard
        .request("GET", "/", &[("Host", "rebound.attacker.example")], None)
        .await?;
    assert_eq!(rebound.status, 403);
    assert!(!rebound.body.contains(&token));

    // Malformed writes are answered with what is wrong.
    let both = json!({ "table": "budget_events", "event_ids": ["doomed"], "all": true });
    let reply = dashboard.post("/api/requeue", &[with_token], &both).await?;
    assert_eq!(reply.status, 400, "{}", reply.body);
    let reply = dashboard
        .post(
            "/api/requeue",
            &[with_token],
            &json!({ "table": "nope", "all": true }),
        )
        .await?;
    assert_eq!(reply.status, 404, "{}", reply.body);
    assert!(still_dead().await);

    // The page's own request: the event is READY again; a second time leaves it alone.
    let same_origin = format!("http://{}", dashboard.address);
    let headers = [with_token, ("Origin", same_origin.as_str())];
    let done = dashboard.post("/api/requeue", &headers, &requeue).await?;
    assert_eq!(done.status, 200, "{}", done.body);
    assert_eq!(done.json()["event_ids"], json!(["doomed"]));
    assert_eq!(status::<Budgeted>(db.pool(), "doomed").await, "READY");
    // The same page behind a proxy that terminates TLS names an https origin.
    let behind_tls = format!("https://{}", dashboard.address);
    let tls = [with_token, ("Origin", behind_tls.as_str())];
    let again = dashboard.post("/api/requeue", &tls, &requeue).await?.json();
    assert_eq!(
        (&again["requeued"], &again["left_alone"]),
        (&json!(0), &json!(["doomed"]))
    );

    // Prune: a dry run counts, then the three SENT rows go.
    let prune = |older_than: &str, dry_run: bool| json!({ "table": "budget_events", "older_than": older_than, "dry_run": dry_run });
    let none = dashboard
        .post("/api/prune", &headers, &prune("1h", true))
        .await?;
    assert_eq!(none.json()["would_delete"], 0, "{}", none.body);
    let all = dashboard
        .post("/api/prune", &headers, &prune("0s", true))
        .await?;
    assert_eq!(all.json()["would_delete"], 3, "{}", all.body);
    let pruned = dashboard
        .post("/api/prune", &headers, &prune("0s", false))
        .await?;
    assert_eq!(pruned.json()["deleted"], 3, "{}", pruned.body);
    let status = dashboard.get("/api/status").await?.json();
    assert_eq!(table(&status, "budget_events")["sent"], 0);
    let reply = dashboard
        .post("/api/prune", &headers, &prune("soon", false))
        .await?;
    assert_eq!(reply.status, 400, "{}", reply.body);

    drop(dashboard);
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn a_read_only_dashboard_refuses_every_write() -> TestResult {
    let db = seeded().await?;
    let dashboard = Dashboard::start(&db.url(), &[])?;
    let page = dashboard.get("/").await?;
    assert_eq!(token_of(&page.body), None, "no token to find in the page");
    for (path, body) in [
        (
            "/api/requeue",
            json!({ "table": "budget_events", "event_ids": ["doomed"] }),
        ),
        (
            "/api/prune",
            json!({ "table": "budget_events", "older_than": "0s" }),
        ),
    ] {
        let reply = dashboard
            .post(path, &[("X-Outbox-Token", "guessed")], &body)
            .await?;
        assert_eq!(reply.status, 403, "{path}: {}", reply.body);
        assert!(reply.error().contains("--allow-writes"), "{}", reply.body);
    }
    assert_eq!(status::<Budgeted>(db.pool(), "doomed").await, "DEAD");
    let status = dashboard.get("/api/status").await?.json();
    assert_eq!(table(&status, "budget_events")["sent"], 3);

    drop(dashboard);
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn a_database_that_does_not_answer_is_an_error_answer_not_a_crash() -> TestResult {
    // A port nothing listens on (taken, then released).
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let url = format!("postgres://root@127.0.0.1:{port}/test");
    let mut dashboard = Dashboard::start(&url, &["--sample-every", "200ms"])?;

    let reply = dashboard.get("/api/status").await?;
    assert_eq!(reply.status, 503, "{}", reply.body);
    assert!(reply.error().contains("cannot connect"), "{}", reply.body);
    let page = dashboard.get("/").await?;
    assert_eq!(page.status, 200, "the page still loads, to show the error");
    assert!(dashboard.is_running());
    Ok(())
}

// ---------------------------------------------------------------------------------------
// The page, in a real browser
// ---------------------------------------------------------------------------------------

/// chromedriver as a child process, in a process group of its own with the browsers it
/// starts; the whole group is killed when dropped (a panic skips closing the session).
struct ChromeDriver {
    child: Child,
    port: u16,
}

impl ChromeDriver {
    async fn start(binary: &Path) -> TestResult<Self> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let child = Command::new(binary)
            .arg(format!("--port={port}"))
            .process_group(0)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?;
        let driver = Self { child, port };
        wait_until(
            "chromedriver listens",
            Duration::from_secs(30),
            async || TcpStream::connect(("127.0.0.1", port)).await.is_ok(),
        )
        .await;
        Ok(driver)
    }
}

impl Drop for ChromeDriver {
    fn drop(&mut self) {
        if let Ok(pid) = i32::try_from(self.child.id()) {
            let _ = killpg(Pid::from_raw(pid), Signal::SIGKILL);
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `name` on the PATH.
fn on_path(name: &str) -> Option<PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|dir| dir.join(name))
        .find(|path| path.is_file())
}

/// Where the screenshots go: the target directory.
fn screenshot_path(name: &str) -> PathBuf {
    let tmp = Path::new(env!("CARGO_TARGET_TMPDIR"));
    tmp.parent().unwrap_or(tmp).join(name)
}

#[tokio::test]
async fn the_page_in_a_browser_shows_the_tables_requeues_a_dead_event_and_prunes() -> TestResult {
    let (Some(chromium), Some(chromedriver)) = (on_path("chromium"), on_path("chromedriver"))
    else {
        panic!(
            "the dashboard's browser test needs Debian's headless Chromium and its WebDriver: \
             apt-get install chromium chromium-driver (CI installs them), or leave this \
             test out with `cargo test --features cli --test dashboard -- --skip \
             the_page_in_a_browser`"
        );
    };

    let db = seeded().await?;
    let dashboard = Dashboard::start(&db.url(), &["--allow-writes", "--sample-every", "250ms"])?;
    // Some traffic for the chart: a few events published every few samples.
    for burst in [2, 5, 9, 6, 3, 8, 12, 7, 4, 6] {
        publish(&db, burst).await?;
        sleep(Duration::from_millis(300)).await;
    }

    let driver = ChromeDriver::start(&chromedriver).await?;
    let mut capabilities = serde_json::Map::new();
    capabilities.insert(
        "goog:chromeOptions".to_owned(),
        json!({
            "binary": chromium,
            "args": ["--headless=new", "--no-sandbox", "--disable-gpu",
                     "--disable-dev-shm-usage", "--window-size=1280,1000"],
        }),
    );
    let browser = ClientBuilder::new(hyper_util::client::legacy::connect::HttpConnector::new())
        .capabilities(capabilities)
        .connect(&format!("http://127.0.0.1:{}", driver.port))
        .await?;
    let result = drive(&browser, &db, &dashboard).await;
    browser.close().await?;
    result?;

    drop(driver);
    drop(dashboard);
    db.drop_schema().await?;
    Ok(())
}

/// The rendered text of the element `css` selects; empty when there is none (yet).
async fn text_of(browser: &fantoccini::Client, css: &str) -> String {
    match browser.find(Locator::Css(css)).await {
        Ok(element) => element.text().await.unwrap_or_default(),
        Err(_) => String::new(),
    }
}

/// What the operator sees and does: the test proper, with the browser open (the caller
/// closes it whatever this returns).
async fn drive(browser: &fantoccini::Client, db: &TestSchema, dashboard: &Dashboard) -> TestResult {
    browser.goto(&dashboard.url()).await?;
    let budget = r#"section[data-table="budget_events"]"#;
    wait_until(
        "the page shows budget_events",
        Duration::from_secs(30),
        async || text_of(browser, &format!("{budget} .stat-dead .value")).await == "1",
    )
    .await;

    // The counts, as the API has them.
    assert_eq!(
        text_of(browser, &format!("{budget} .stat-ready .value")).await,
        "2"
    );
    assert_eq!(
        text_of(browser, &format!("{budget} .stat-due .value")).await,
        "2"
    );
    assert_eq!(
        text_of(browser, &format!("{budget} .stat-sent .value")).await,
        "65"
    );
    let receipts = r#"section[data-table="receipt_events"]"#;
    assert_eq!(
        text_of(browser, &format!("{receipts} .stat-ready .value")).await,
        "1"
    );
    assert_eq!(
        text_of(browser, &format!("{receipts} .stat-sent-per-minute .value")).await,
        "n/a"
    );

    // The dead event's error, as text: its markup made no elements.
    let row = format!(r#"{budget} tr[data-event-id="doomed"]"#);
    assert_eq!(
        text_of(browser, &format!("{row} td.error")).await,
        BROKER_ERROR
    );
    let markup = browser
        .find_all(Locator::Css(&format!("{row} td.error *")))
        .await?;
    assert!(markup.is_empty(), "the error's markup was not parsed");

    // The chart drew the published events.
    wait_until(
        "the chart shows throughput",
        Duration::from_secs(30),
        async || {
            browser
                .find(Locator::Css(&format!(
                    r#"{budget} svg.chart[aria-label$="sent/min"]"#
                )))
                .await
                .is_ok()
        },
    )
    .await;
    let screenshot = screenshot_path("dashboard.png");
    std::fs::write(&screenshot, browser.screenshot().await?)?;
    eprintln!(
        "the dashboard, before the requeue: {}",
        screenshot.display()
    );

    // Requeue: the row is READY in the database, and gone from the page.
    browser
        .find(Locator::Css(&format!("{row} button.requeue")))
        .await?
        .click()
        .await?;
    wait_until(
        "the requeued event is READY",
        Duration::from_secs(30),
        async || status::<Budgeted>(db.pool(), "doomed").await == "READY",
    )
    .await;
    wait_until(
        "the page shows no dead event",
        Duration::from_secs(30),
        async || {
            text_of(browser, &format!("{budget} .stat-dead .value")).await == "0"
                && browser.find(Locator::Css(&row)).await.is_err()
        },
    )
    .await;
    assert!(
        text_of(browser, "#notice")
            .await
            .contains("Requeued doomed"),
        "the page confirms the requeue"
    );
    let after = screenshot_path("dashboard-after-requeue.png");
    std::fs::write(&after, browser.screenshot().await?)?;
    eprintln!("the dashboard, after the requeue: {}", after.display());
    prune_through_the_form(browser, db).await
}

/// Prune through the budget_events card's form: the page asks first, saying how many
/// rows would go; accepted, they go.
async fn prune_through_the_form(browser: &fantoccini::Client, db: &TestSchema) -> TestResult {
    let budget = r#"section[data-table="budget_events"]"#;
    let age = browser
        .find(Locator::Css(&format!("{budget} form.prune input")))
        .await?;
    age.clear().await?;
    age.send_keys("0s").await?;
    browser
        .find(Locator::Css(&format!("{budget} form.prune button")))
        .await?
        .click()
        .await?;
    let mut question = String::new();
    wait_until(
        "the page asks before pruning",
        Duration::from_secs(30),
        async || match browser.get_alert_text().await {
            Ok(text) => {
                question = text;
                true
            }
            Err(_) => false,
        },
    )
    .await;
    assert!(
        question.starts_with("Delete 65 SENT event(s) of budget_events"),
        "{question}"
    );
    browser.accept_alert().await?;
    wait_until(
        "the SENT rows are pruned",
        Duration::from_secs(30),
        async || outbox_testkit::rows::count::<Budgeted>(db.pool(), "SENT").await == 0,
    )
    .await;
    wait_until(
        "the page shows the prune",
        Duration::from_secs(30),
        async || {
            text_of(browser, "#notice").await == "Deleted 65 SENT event(s) of budget_events."
                && text_of(browser, &format!("{budget} .stat-sent .value")).await == "0"
        },
    )
    .await;
    Ok(())
}
