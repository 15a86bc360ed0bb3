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

#[path = "../tests/chaos/mod.rs"]
mod chaos;

use std::process::ExitCode;
use std::time::Duration;

const USAGE: &str = "usage: chaos [--events N] [--relays N] [--rate EVENTS_PER_SEC] [--batch N] \
     [--concurrency N] [--prefill FRACTION] [--seed N] [--no-restart] [--verbose]";

fn parse(args: impl Iterator<Item = String>) -> Result<chaos::Config, String> {
    let mut config = chaos::Config::new(10_000);
    let mut args = args.peekable();
    while let Some(flag) = args.next() {
        let mut value = || {
            args.next()
                .ok_or_else(|| format!("{flag} needs a value\n{USAGE}"))
        };
        let number = |v: String| v.parse::<u64>().map_err(|e| format!("{flag} {v}: {e}"));
        match flag.as_str() {
            "--events" => config.events = usize::try_from(number(value()?)?).unwrap_or(usize::MAX),
            "--relays" => config.relays = usize::try_from(number(value()?)?).unwrap_or(1).max(1),
            "--batch" => config.batch_size = u32::try_from(number(value()?)?).unwrap_or(50),
            "--concurrency" => {
                config.concurrency = usize::try_from(number(value()?)?).unwrap_or(1).max(1);
            }
            "--rate" => {
                let v = value()?;
                config.rate = v.parse().map_err(|e| format!("--rate {v}: {e}"))?;
                if config.rate <= 0.0 || !config.rate.is_finite() {
                    return Err(format!("--rate must be positive\n{USAGE}"));
                }
            }
            "--prefill" => {
                let v = value()?;
                config.prefill = v.parse().map_err(|e| format!("--prefill {v}: {e}"))?;
                if !(0.0..=1.0).contains(&config.prefill) {
                    return Err(format!("--prefill is a fraction in 0..=1\n{USAGE}"));
                }
            }
            "--seed" => config.seed = number(value()?)?,
            "--no-restart" => config.restart_postgres = false,
            "--verbose" => config.verbose = true,
            "--help" | "-h" => return Err(USAGE.to_owned()),
            other => return Err(format!("unknown argument {other:?}\n{USAGE}")),
        }
    }
    if config.events == 0 {
        return Err(format!("--events must be at least 1\n{USAGE}"));
    }
    config.drain_timeout = Duration::from_mins(2);
    Ok(config)
}

fn main() -> ExitCode {
    // The relays are this binary, re-executed with the chaos environment.
    chaos::child_main_if_requested();
    let config = match parse(std::env::args().skip(1)) {
        Ok(config) => config,
        Err(message) => {
            eprintln!("{message}");
            return ExitCode::from(2);
        }
    };
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
    let child = chaos::ChildCommand { args: Vec::new() };
    match runtime.block_on(chaos::run(&config, &child)) {
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
