//! The relay under chaos, long form: relay processes publish while this program
//! SIGKILLs and restarts them, SIGSTOPs them past their lease, terminates their database
//! sessions and restarts PostgreSQL once; then it checks that every event ended `SENT`
//! exactly once, was delivered, and was recorded by the generation that held it.
//!
//! ```text
//! cargo run --release --example chaos -- --events 10000
//! cargo run --release --example chaos -- --events 5000 --relays 6 --rate 300 --seed 42 --verbose
//! ```
//!
//! It owns a throwaway PostgreSQL cluster (from the local server binaries); without
//! them it uses `DATABASE_URL` and skips the restart. `tests/chaos.rs` is the short form.

use std::process::ExitCode;
use std::time::Duration;

use clap::Parser as _;
use clap::builder::RangedU64ValueParser;
use outbox_testkit::chaos;
use outbox_testkit::child::ChildCommand;

/// Relay processes publish while this program SIGKILLs and restarts them, SIGSTOPs them
/// past their lease, terminates their database sessions and restarts PostgreSQL once;
/// then it checks that every event ended SENT exactly once, was delivered, and was
/// recorded by the generation that held it.
#[derive(clap::Parser, Debug)]
#[command(name = "chaos")]
struct Args {
    /// Events enqueued in all.
    #[arg(long, value_name = "N", default_value_t = 10_000, value_parser = at_least_one())]
    events: usize,
    /// Relay processes.
    #[arg(long, value_name = "N", default_value_t = defaults().relays, value_parser = at_least_one())]
    relays: usize,
    /// Events per second enqueued while the relays run (the rest is enqueued before they
    /// start).
    #[arg(long, value_name = "EVENTS_PER_SEC", default_value_t = defaults().rate, value_parser = rate)]
    rate: f64,
    /// Rows per claim of each relay.
    #[arg(long, value_name = "N", default_value_t = defaults().batch_size, value_parser = clap::value_parser!(u32).range(1..))]
    batch: u32,
    /// Workers per relay.
    #[arg(long, value_name = "N", default_value_t = defaults().concurrency, value_parser = at_least_one())]
    concurrency: usize,
    /// Share of the events enqueued before the relays start.
    #[arg(long, value_name = "FRACTION", default_value_t = defaults().prefill, value_parser = fraction)]
    prefill: f64,
    /// Seed of the driver's choices (which relay, which action, how long) [default:
    /// random, printed].
    #[arg(long, value_name = "N")]
    seed: Option<u64>,
    /// Skip the PostgreSQL restart.
    #[arg(long)]
    no_restart: bool,
    /// Echo every line the relays log.
    #[arg(long)]
    verbose: bool,
}

/// The driver's defaults, which the flags override.
fn defaults() -> chaos::Config {
    chaos::Config::new(0)
}

impl Args {
    fn config(self) -> chaos::Config {
        let mut config = chaos::Config::new(self.events);
        config.relays = self.relays;
        config.rate = self.rate;
        config.batch_size = self.batch;
        config.concurrency = self.concurrency;
        config.prefill = self.prefill;
        if let Some(seed) = self.seed {
            config.seed = seed;
        }
        config.restart_postgres = !self.no_restart;
        config.verbose = self.verbose;
        config.drain_timeout = Duration::from_mins(2);
        config
    }
}

fn at_least_one() -> RangedU64ValueParser<usize> {
    RangedU64ValueParser::new().range(1..)
}

fn rate(value: &str) -> Result<f64, String> {
    let rate: f64 = value.parse().map_err(|e| format!("{e}"))?;
    if rate > 0.0 && rate.is_finite() {
        Ok(rate)
    } else {
        Err("the rate must be positive".to_owned())
    }
}

fn fraction(value: &str) -> Result<f64, String> {
    let fraction: f64 = value.parse().map_err(|e| format!("{e}"))?;
    if (0.0..=1.0).contains(&fraction) {
        Ok(fraction)
    } else {
        Err("a fraction is in 0..=1".to_owned())
    }
}

fn main() -> ExitCode {
    // The relays are this binary, re-executed with the chaos environment.
    chaos::child_main_if_requested();
    let config = Args::parse().config();
    println!(
        "chaos: {} events, {} relays (batch {}, {} workers each), {}/s while they run, seed {}",
        config.events,
        config.relays,
        config.batch_size,
        config.concurrency,
        config.rate,
        config.seed
    );
    let runtime = tokio::runtime::Runtime::new().expect("a tokio runtime");
    match runtime.block_on(chaos::run(&config, &ChildCommand::binary())) {
        Ok(report) => {
            println!("{report}");
            if report.failures.is_empty() {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            }
        }
        Err(error) => {
            eprintln!("chaos: the run could not run: {error}");
            ExitCode::FAILURE
        }
    }
}
