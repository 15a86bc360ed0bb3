//! `outbox serve`: one page with every outbox table's state, and the JSON API behind it.
//!
//! Reads are open to whoever reaches the address (127.0.0.1 by default), unless
//! `--basic-auth-file` names a login that every request must give (HTTP Basic). Writes
//! (requeue, prune) exist only with `--allow-writes`, and then need the per-process
//! token the page embeds: another site's page can neither read that token nor send the
//! custom header without a CORS preflight, which this server never grants. That token
//! stops other sites, not people: whoever loads the page has it. So writes on an
//! address other machines reach need the login too. The Host check keeps a DNS-rebound
//! name from reading the page (and its token) as if it were this origin; the Origin
//! check is a second line for writes.

mod samples;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::{get, post};
use outbox::OutboxError;
use outbox::catalog::{self, CatalogEntry};
use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use sqlx::PgPool;

use crate::{Failure, fail};
use crate::{events, status};
use samples::{Samples, WINDOW, unix_now};

/// The page: inline CSS and JavaScript, no build step. `{{NONCE}}` and `{{CONFIG}}` are
/// filled in per response.
const PAGE: &str = include_str!("page.html");

/// The header a write carries the per-process token in. A custom header: a cross-site
/// request cannot set it without a preflight.
const TOKEN_HEADER: &str = "x-outbox-token";

/// Rows per transaction of a prune.
const PRUNE_BATCH: u32 = 1_000;

/// The most event ids one requeue takes, and the most dead rows one read lists per
/// table.
const MAX_ROWS: usize = 1_000;

#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// Where to listen.
    #[arg(long, default_value = "127.0.0.1:8080")]
    bind: SocketAddr,
    /// Show the requeue and prune buttons (protected by a per-process token). On an
    /// address other machines can reach, only with --basic-auth-file.
    #[arg(long)]
    allow_writes: bool,
    /// A file holding `user:password`: every request must give this login (HTTP Basic;
    /// put TLS in front of the dashboard, as the password crosses the network).
    #[arg(long, value_name = "FILE")]
    basic_auth_file: Option<std::path::PathBuf>,
    /// Also answer requests for this host name (a proxy in front, a DNS name), as
    /// `name` or `name:port`; repeatable. Without it only the address it listens on
    /// (and `localhost` for a loopback address) is served.
    #[arg(long, value_name = "HOST")]
    allow_host: Vec<String>,
    /// How often to read every table's counts for the throughput chart.
    #[arg(long, default_value = "10s", value_name = "INTERVAL",
          value_parser = crate::parse_every)]
    sample_every: Duration,
}

/// What every handler shares.
struct Dashboard {
    pool: PgPool,
    /// `Some` exactly when writes are enabled.
    token: Option<String>,
    /// The `Authorization` header every request must carry, if a login is required.
    login: Option<String>,
    hosts: Hosts,
    sample_every: Duration,
    samples: Mutex<Samples>,
}

impl Dashboard {
    fn samples(&self) -> std::sync::MutexGuard<'_, Samples> {
        // A panic while it was held left whole samples behind: the ring is still usable.
        self.samples.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

pub(crate) async fn run(pool: PgPool, args: Args) -> Result<(), Failure> {
    let listener = tokio::net::TcpListener::bind(args.bind)
        .await
        .map_err(|e| fail(format!("cannot listen on {}: {e}", args.bind)))?;
    let address = listener.local_addr()?;
    let login = args
        .basic_auth_file
        .as_deref()
        .map(read_login)
        .transpose()?;
    if args.allow_writes && login.is_none() && !address.ip().is_loopback() {
        return Err(fail(format!(
            "--allow-writes on {}, an address other machines can reach, needs \
             --basic-auth-file: the page hands its write token to whoever loads it",
            address.ip()
        )));
    }
    let dashboard = Arc::new(Dashboard {
        pool,
        token: args.allow_writes.then(random_hex),
        login,
        hosts: Hosts::new(address, &args.allow_host),
        sample_every: args.sample_every,
        samples: Mutex::new(Samples::default()),
    });
    let app = Router::new()
        .route("/", get(page))
        .route("/api/status", get(api_status))
        .route("/api/dead", get(api_dead))
        .route("/api/requeue", post(api_requeue))
        .route("/api/prune", post(api_prune))
        .fallback(|| async { ApiError::new(StatusCode::NOT_FOUND, "no such page") })
        .layer(middleware::from_fn_with_state(
            dashboard.clone(),
            check_login,
        ))
        .layer(middleware::from_fn_with_state(
            dashboard.clone(),
            check_host,
        ))
        .with_state(dashboard.clone());
    let sampler = tokio::spawn(sample(dashboard.clone()));
    eprintln!(
        "outbox serve: listening on http://{address}/ ({})",
        if args.allow_writes {
            "writes enabled: requeue and prune, guarded by a per-process token"
        } else {
            "read-only; --allow-writes enables requeue and prune"
        }
    );
    if args.allow_writes && dashboard.login.is_none() && !args.allow_host.is_empty() {
        eprintln!(
            "outbox serve: warning: writes are enabled for {} without a login: unless the \
             proxy in front authenticates, whoever reaches it can requeue and prune \
             (--basic-auth-file)",
            args.allow_host.join(", ")
        );
    }
    if !address.ip().is_loopback() {
        eprintln!(
            "outbox serve: warning: {} is reachable from other machines, without TLS{}",
            address.ip(),
            if dashboard.login.is_some() {
                " (the login crosses the network in the clear unless a proxy adds it)"
            } else {
                " and without a login: anyone who reaches it reads every table's state"
            }
        );
    }
    let served = axum::serve(listener, app)
        .with_graceful_shutdown(shutdown())
        .await;
    sampler.abort();
    served?;
    eprintln!("outbox serve: stopped");
    Ok(())
}

/// Ctrl-C, or SIGTERM where there is one.
async fn shutdown() {
    #[cfg(unix)]
    {
        let terminate = async {
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(mut signal) => {
                    signal.recv().await;
                }
                Err(_) => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            () = terminate => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// Reads every table's counts every `sample_every`, for the throughput chart. A failure
/// leaves a gap in the chart and a message on the page; the next tick tries again.
async fn sample(dashboard: Arc<Dashboard>) {
    let mut ticks = tokio::time::interval(dashboard.sample_every);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        match status::collect(&dashboard.pool).await {
            Ok(tables) => dashboard.samples().record(&tables),
            Err(failure) => dashboard.samples().failed(ApiError::from(failure).message),
        }
    }
}

/// 122 random bits (a v4 UUID), as hex: the write token, and the page's CSP nonce.
fn random_hex() -> String {
    uuid::Uuid::new_v4().simple().to_string()
}

// ---------------------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------------------

/// An answer other than success: its status, and `{"error": message}`.
#[derive(Debug)]
struct ApiError {
    status: StatusCode,
    message: String,
}

impl ApiError {
    fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
        }
    }

    fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message)
    }

    fn forbidden(message: impl Into<String>) -> Self {
        Self::new(StatusCode::FORBIDDEN, message)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response =
            (self.status, axum::Json(json!({ "error": self.message }))).into_response();
        no_store(response.headers_mut());
        response
    }
}

impl From<OutboxError> for ApiError {
    fn from(error: OutboxError) -> Self {
        let status = match &error {
            OutboxError::UnknownTable { .. } => StatusCode::NOT_FOUND,
            OutboxError::CatalogEntryInvalid { .. } => StatusCode::CONFLICT,
            OutboxError::InvalidEventId { .. } | OutboxError::IntervalOutOfRange { .. } => {
                StatusCode::BAD_REQUEST
            }
            // The database is down or restarting: the page says so and tries again.
            OutboxError::Connect { .. } => StatusCode::SERVICE_UNAVAILABLE,
            error if error.is_transient() => StatusCode::SERVICE_UNAVAILABLE,
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        };
        Self::new(status, error.to_string())
    }
}

impl From<Failure> for ApiError {
    fn from(failure: Failure) -> Self {
        match failure {
            Failure::Error(error) => match error.downcast::<OutboxError>() {
                Ok(error) => Self::from(*error),
                Err(error) => Self::new(StatusCode::INTERNAL_SERVER_ERROR, error.to_string()),
            },
            Failure::Attention => {
                Self::new(StatusCode::INTERNAL_SERVER_ERROR, "a table needs attention")
            }
        }
    }
}

impl From<sqlx::Error> for ApiError {
    fn from(error: sqlx::Error) -> Self {
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("database: {error}"),
        )
    }
}

type ApiResult = Result<Response, ApiError>;

fn json_response(value: &Value) -> Response {
    let mut response = axum::Json(value).into_response();
    no_store(response.headers_mut());
    response
}

fn no_store(headers: &mut HeaderMap) {
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
}

// ---------------------------------------------------------------------------------------
// Where requests may come from
// ---------------------------------------------------------------------------------------

/// The Host headers this server answers: its own address, `localhost` when that is a
/// loopback address, any IP literal when it listens on every address, and the
/// `--allow-host` names. A DNS-rebinding page reaches it under a name of its own, which
/// none of these match.
#[derive(Debug)]
struct Hosts {
    port: u16,
    names: Vec<(String, Option<u16>)>,
    any_ip: bool,
}

impl Hosts {
    fn new(address: SocketAddr, allowed: &[String]) -> Self {
        let port = address.port();
        let ip = address.ip();
        let mut names = vec![(bracketed(&ip.to_string()), Some(port))];
        if ip.is_loopback() {
            names.push(("localhost".to_owned(), Some(port)));
        }
        names.extend(allowed.iter().map(|h| split_host(h)));
        Self {
            port,
            names,
            any_ip: ip.is_unspecified(),
        }
    }

    fn allows(&self, host: &str) -> bool {
        let (name, port) = split_host(host);
        let same_port = port.unwrap_or(80) == self.port;
        self.names
            .iter()
            .any(|(n, p)| *n == name && p.is_none_or(|p| port.unwrap_or(80) == p))
            || (self.any_ip
                && same_port
                && name
                    .trim_start_matches('[')
                    .trim_end_matches(']')
                    .parse::<std::net::IpAddr>()
                    .is_ok())
    }
}

fn bracketed(ip: &str) -> String {
    if ip.contains(':') {
        format!("[{ip}]")
    } else {
        ip.to_owned()
    }
}

/// `host[:port]`, lowercased; `[v6]:port` keeps its brackets.
fn split_host(host: &str) -> (String, Option<u16>) {
    let host = host.trim().to_ascii_lowercase();
    if let Some((name, port)) = host.rsplit_once(':')
        && (!name.starts_with('[') || name.ends_with(']'))
        && let Ok(port) = port.parse::<u16>()
    {
        return (name.to_owned(), Some(port));
    }
    (host, None)
}

async fn check_host(
    State(dashboard): State<Arc<Dashboard>>,
    request: Request,
    next: Next,
) -> Response {
    let host = request
        .headers()
        .get(header::HOST)
        .and_then(|h| h.to_str().ok());
    match host {
        Some(host) if dashboard.hosts.allows(host) => next.run(request).await,
        Some(host) => ApiError::forbidden(format!(
            "this dashboard does not answer for host `{host}` (start it with --allow-host {host})"
        ))
        .into_response(),
        None => ApiError::bad_request("no Host header").into_response(),
    }
}

/// The `Authorization` header of the login in `path` (`user:password`, one line).
fn read_login(path: &std::path::Path) -> Result<String, Failure> {
    use base64::Engine as _;
    let text = std::fs::read_to_string(path)
        .map_err(|e| fail(format!("cannot read {}: {e}", path.display())))?;
    let login = text.trim_end_matches(['\r', '\n']);
    match login.split_once(':') {
        Some((user, password)) if !user.is_empty() && !password.is_empty() => Ok(format!(
            "Basic {}",
            base64::engine::general_purpose::STANDARD.encode(login)
        )),
        _ => Err(fail(format!(
            "{} must hold one line `user:password`, both non-empty",
            path.display()
        ))),
    }
}

/// Every request gives the login, when the dashboard has one.
async fn check_login(
    State(dashboard): State<Arc<Dashboard>>,
    request: Request,
    next: Next,
) -> Response {
    let Some(login) = &dashboard.login else {
        return next.run(request).await;
    };
    let given = request
        .headers()
        .get(header::AUTHORIZATION)
        .map(HeaderValue::as_bytes);
    if given.is_some_and(|given| same_bytes(given, login.as_bytes())) {
        return next.run(request).await;
    }
    let mut refused =
        ApiError::new(StatusCode::UNAUTHORIZED, "this dashboard needs its login").into_response();
    refused.headers_mut().insert(
        header::WWW_AUTHENTICATE,
        HeaderValue::from_static("Basic realm=\"outbox\", charset=\"UTF-8\""),
    );
    refused
}

/// What a write must show: writes enabled, the token, a same-origin request, JSON.
fn check_write(dashboard: &Dashboard, headers: &HeaderMap) -> Result<(), ApiError> {
    let Some(token) = &dashboard.token else {
        return Err(ApiError::forbidden(
            "writes are disabled: this dashboard was started without --allow-writes",
        ));
    };
    let given = headers.get(TOKEN_HEADER).map(HeaderValue::as_bytes);
    if !given.is_some_and(|given| same_bytes(given, token.as_bytes())) {
        return Err(ApiError::forbidden(
            "missing or wrong X-Outbox-Token header: writes need the token of this \
             dashboard's page",
        ));
    }
    // A browser names the page a request comes from; it must be this server's, served
    // as it is or through a proxy that terminates TLS in front of it.
    if let Some(origin) = headers.get(header::ORIGIN) {
        let host = headers.get(header::HOST).map(HeaderValue::as_bytes);
        let same = host.is_some_and(|host| {
            [b"http://".as_slice(), b"https://"].iter().any(|scheme| {
                origin
                    .as_bytes()
                    .eq_ignore_ascii_case(&[*scheme, host].concat())
            })
        });
        if !same {
            return Err(ApiError::forbidden("cross-site request refused"));
        }
    }
    if let Some(site) = headers.get("sec-fetch-site")
        && !matches!(site.as_bytes(), b"same-origin" | b"none")
    {
        return Err(ApiError::forbidden("cross-site request refused"));
    }
    let json = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|v| v.trim().eq_ignore_ascii_case("application/json"));
    if !json {
        return Err(ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "writes take a JSON body (Content-Type: application/json)",
        ));
    }
    Ok(())
}

/// Compares in time independent of where the bytes differ.
fn same_bytes(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn parse_body<T: DeserializeOwned>(body: &Bytes) -> Result<T, ApiError> {
    serde_json::from_slice(body).map_err(|e| ApiError::bad_request(format!("invalid body: {e}")))
}

/// The catalog entry of `table`, refused (409) when it does not match its table.
async fn entry(pool: &PgPool, table: &str) -> Result<CatalogEntry, ApiError> {
    let entry = catalog::table(pool, table).await?;
    if let Some(problem) = entry.problem() {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            format!("`{table}`: {problem}"),
        ));
    }
    Ok(entry)
}

// ---------------------------------------------------------------------------------------
// Handlers
// ---------------------------------------------------------------------------------------

async fn page(State(dashboard): State<Arc<Dashboard>>) -> Response {
    let nonce = random_hex();
    let config = json!({
        "writes": dashboard.token.is_some(),
        "token": dashboard.token,
        "sample_every_seconds": dashboard.sample_every.as_secs_f64(),
    });
    // JSON inside <script>: only `<` could end the element early.
    let config = config.to_string().replace('<', "\\u003c");
    let html = PAGE
        .replace("{{NONCE}}", &nonce)
        .replace("{{CONFIG}}", &config);
    let mut response = Html(html).into_response();
    let headers = response.headers_mut();
    no_store(headers);
    let csp = format!(
        "default-src 'none'; script-src 'nonce-{nonce}'; style-src 'nonce-{nonce}'; \
         connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'; \
         frame-ancestors 'none'"
    );
    if let Ok(csp) = HeaderValue::from_str(&csp) {
        headers.insert(header::CONTENT_SECURITY_POLICY, csp);
    }
    headers.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    headers.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    headers.insert(
        "cross-origin-resource-policy",
        HeaderValue::from_static("same-origin"),
    );
    response
}

/// `GET /api/status`: every table's status, the throughput samples, the sampler's
/// last error.
async fn api_status(State(dashboard): State<Arc<Dashboard>>) -> ApiResult {
    let tables = status::collect(&dashboard.pool).await?;
    let (throughput, sampler_error) = {
        let samples = dashboard.samples();
        (samples.series(), samples.error().map(str::to_owned))
    };
    Ok(json_response(&json!({
        "now": unix_now(),
        "writes": dashboard.token.is_some(),
        "sample_every_seconds": dashboard.sample_every.as_secs_f64(),
        "window_seconds": WINDOW.as_secs(),
        "tables": tables,
        "throughput": throughput,
        "sampler_error": sampler_error,
    })))
}

#[derive(Debug, Deserialize)]
struct DeadQuery {
    table: Option<String>,
    limit: Option<usize>,
}

/// `GET /api/dead?table=T&limit=N`: up to N dead events (default 50, at most 1000) of
/// table T, or of every table, oldest first; `skipped` says why a table was not read.
async fn api_dead(
    State(dashboard): State<Arc<Dashboard>>,
    query: Result<Query<DeadQuery>, QueryRejection>,
) -> ApiResult {
    let Query(query) = query.map_err(|e| ApiError::bad_request(e.body_text()))?;
    let limit = u32::try_from(query.limit.unwrap_or(50).min(MAX_ROWS)).unwrap_or(50);
    let (events, skipped) =
        events::dead_rows(&dashboard.pool, query.table.as_deref(), limit).await?;
    Ok(json_response(
        &json!({ "events": events, "skipped": skipped }),
    ))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RequeueBody {
    table: String,
    #[serde(default)]
    event_ids: Vec<String>,
    #[serde(default)]
    all: bool,
    /// With `all`: how many dead events the operator confirmed.
    expected: Option<u64>,
}

/// `POST /api/requeue` `{"table": T, "event_ids": [...]}` or `{"table": T, "all": true,
/// "expected": N}` (refused, and nothing changed, unless N events are dead):
/// dead events back to READY with a fresh attempt budget, through the catalog's guarded
/// statement (an event that is no longer DEAD is left alone, and listed).
async fn api_requeue(
    State(dashboard): State<Arc<Dashboard>>,
    headers: HeaderMap,
    body: Bytes,
) -> ApiResult {
    check_write(&dashboard, &headers)?;
    let body: RequeueBody = parse_body(&body)?;
    let by_ids = !body.event_ids.is_empty();
    if body.all == by_ids {
        return Err(ApiError::bad_request(
            "name the dead events in `event_ids`, or set `all`: one of the two",
        ));
    }
    if body.event_ids.len() > MAX_ROWS {
        return Err(ApiError::bad_request(format!(
            "at most {MAX_ROWS} event ids per request"
        )));
    }
    let entry = entry(&dashboard.pool, &body.table).await?;
    if body.all {
        let Some(expected) = body.expected else {
            return Err(ApiError::bad_request(
                "with `all`, say in `expected` how many dead events were confirmed",
            ));
        };
        // All or nothing: what was confirmed, not what died since.
        let requeued = entry
            .requeue_all_dead_confirmed(&dashboard.pool, expected)
            .await?;
        if requeued != expected {
            return Err(ApiError::new(
                StatusCode::CONFLICT,
                format!(
                    "{requeued} events of `{}` are DEAD now, not the {expected} confirmed: \
                     nothing was requeued",
                    entry.table()
                ),
            ));
        }
        return Ok(json_response(
            &json!({ "table": entry.table(), "requeued": requeued }),
        ));
    }
    let changed = entry.requeue_dead(&dashboard.pool, &body.event_ids).await?;
    let changed: Vec<&str> = changed.iter().map(outbox::EventId::as_str).collect();
    let left_alone: Vec<&String> = body
        .event_ids
        .iter()
        .filter(|id| !changed.contains(&id.as_str()))
        .collect();
    Ok(json_response(&json!({
        "table": entry.table(),
        "requeued": changed.len(),
        "event_ids": changed,
        "left_alone": left_alone,
    })))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PruneBody {
    table: String,
    /// An age, as `7d` or `12h`.
    older_than: String,
    #[serde(default)]
    dry_run: bool,
}

/// `POST /api/prune` `{"table": T, "older_than": "7d", "dry_run": false}`: deletes the
/// SENT events published longer ago than that, in batches (`dry_run` counts them).
async fn api_prune(
    State(dashboard): State<Arc<Dashboard>>,
    headers: HeaderMap,
    body: Bytes,
) -> ApiResult {
    check_write(&dashboard, &headers)?;
    let body: PruneBody = parse_body(&body)?;
    let older_than = humantime::parse_duration(body.older_than.trim()).map_err(|e| {
        ApiError::bad_request(format!("`older_than` is an age such as 7d or 12h: {e}"))
    })?;
    let entry = entry(&dashboard.pool, &body.table).await?;
    if body.dry_run {
        let count = entry.count_prunable(&dashboard.pool, older_than).await?;
        return Ok(json_response(
            &json!({ "table": entry.table(), "would_delete": count }),
        ));
    }
    let mut deleted = 0;
    loop {
        let pruned = entry
            .prune_sent(&dashboard.pool, older_than, PRUNE_BATCH)
            .await?;
        deleted += pruned;
        // A short batch ends it (under steady traffic, rows keep coming of age: waiting
        // for an empty one might never end); rows another prune held are left to it.
        if pruned < u64::from(PRUNE_BATCH) {
            break;
        }
    }
    Ok(json_response(
        &json!({ "table": entry.table(), "deleted": deleted }),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_loopback_dashboard_answers_its_address_and_localhost_only() {
        let hosts = Hosts::new("127.0.0.1:8080".parse().unwrap(), &[]);
        assert!(hosts.allows("127.0.0.1:8080"));
        assert!(hosts.allows("LOCALHOST:8080"));
        assert!(!hosts.allows("localhost:8081"));
        assert!(!hosts.allows("evil.example:8080"));
        assert!(!hosts.allows("127.0.0.2:8080"));
        let v6 = Hosts::new("[::1]:80".parse().unwrap(), &["dash.internal".to_owned()]);
        assert!(v6.allows("[::1]"));
        assert!(v6.allows("localhost"));
        assert!(v6.allows("dash.internal:443"));
        assert!(!v6.allows("[::2]"));
    }

    #[test]
    fn a_dashboard_on_every_address_answers_any_ip_literal_but_no_other_name() {
        let hosts = Hosts::new(
            "0.0.0.0:9000".parse().unwrap(),
            &["ops.example:9000".to_owned()],
        );
        assert!(hosts.allows("10.1.2.3:9000"));
        assert!(hosts.allows("[fe80::1]:9000"));
        assert!(hosts.allows("ops.example:9000"));
        assert!(!hosts.allows("ops.example:9001"));
        assert!(!hosts.allows("rebound.attacker.example:9000"));
    }
}
