//! The outbox end to end through a real broker under chaos, long form: business
//! transactions commit orders and their events; relay processes publish them through the
//! broker's sink; consumer processes apply each event's effect with its inbox row in one
//! PostgreSQL transaction, then acknowledge it. Meanwhile this program SIGKILLs and
//! SIGSTOPs relays and consumers, terminates their database sessions, and takes the
//! broker away; at the end it audits every event: applied exactly once, at the broker at
//! least once, delivered at least once, and every duplicate counted and explained.
//!
//! ```text
//! cargo run --release --features nats,rabbitmq,kafka --example broker_chaos -- --broker nats --duration 120
//! cargo run --release --features nats,rabbitmq,kafka --example broker_chaos -- --broker rabbitmq --events 20000 --consumers 3
//! cargo run --release --features nats,rabbitmq,kafka --example broker_chaos -- --broker kafka --events 5000
//! ```
//!
//! - **NATS**: a `nats-server -js` of the run's own (the `nats-server` binary, a free port,
//!   file storage), SIGKILLed or SIGTERMed and restarted every few seconds.
//! - **RabbitMQ**: the service on 127.0.0.1:5672 (guest/guest, or `OUTBOX_AMQP_URL`). It
//!   is shared, so it is not restarted: every relay's and consumer's connection goes
//!   through a proxy that this program cuts instead.
//! - **Kafka**: a tansu of the run's own (`OUTBOX_TANSU`, by default
//!   `~/.cache/outbox/tansu-venv/bin/tansu`, where `.ci/run` installs it), in memory, one
//!   partition per consumer. A restart would lose its topic, so, as for RabbitMQ, every
//!   connection goes through a proxy (tansu advertises it) that this program cuts. Consumer
//!   `n` is assigned partition `n` and commits each record's offset after the effect's
//!   transaction; a successor resumes from the committed offset. Kafka keeps every
//!   publication as a record, so the audit reads the topic back and counts them all.
//!
//! Another broker plugs in as an implementation of `ChaosBroker` in a module beside
//! `outbox-testkit/src/chaos/broker/nats.rs`, and a variant of [`Broker`] here.
//! `tests/broker_chaos.rs` is the short form, run by CI.

use std::process::ExitCode;
use std::time::Duration;

use clap::builder::RangedU64ValueParser;
use clap::{Parser as _, ValueEnum as _};
use outbox_testkit::chaos::broker::{self, BrokerConfig, BrokerReport, Kafka, Nats, RabbitMq};
use outbox_testkit::child::{self, ChildCommand};

/// The outbox end to end through a real broker under chaos: relays and consumers killed
/// and paused, the broker taken away; then every event is audited (applied exactly once,
/// at the broker and delivered at least once, every duplicate explained).
#[derive(clap::Parser, Debug)]
#[command(name = "broker_chaos")]
struct Args {
    /// The broker: `nats` (restarted), `rabbitmq` or `kafka` (connections cut).
    #[arg(long, value_name = "BROKER", value_enum, default_value_t = Broker::Nats)]
    broker: Broker,
    /// The chaos lasts at least this many seconds (and until every event is enqueued).
    #[arg(long, value_name = "SECS", default_value_t = 60)]
    duration: u64,
    /// Events enqueued in all.
    #[arg(long, value_name = "N", default_value_t = 10_000, value_parser = at_least_one())]
    events: usize,
    /// Relay processes.
    #[arg(long, value_name = "N", default_value_t = 4, value_parser = at_least_one())]
    relays: usize,
    /// Consumer processes.
    #[arg(long, value_name = "N", default_value_t = 2, value_parser = at_least_one())]
    consumers: usize,
    /// Events per second enqueued while the relays run (the rest, 40%, before they start)
    /// [default: the events spread over the duration, at least 150/s].
    #[arg(long, value_name = "EVENTS_PER_SEC")]
    rate: Option<f64>,
    /// Broker outages, at least (more follow every few seconds while the chaos lasts).
    #[arg(long, value_name = "N", default_value_t = 3)]
    outages: u32,
    /// JetStream's duplicate window, in seconds: a copy published within it of the first
    /// is stored once. The default keeps every reclaimed redelivery out of the stream;
    /// one shorter than the lease (2 s), e.g. 1, lets copies in for the inbox to absorb.
    #[arg(long, value_name = "SECS", default_value_t = 120.0)]
    duplicate_window: f64,
    /// Seed of the driver's choices [default: random, printed].
    #[arg(long, value_name = "N")]
    seed: Option<u64>,
    /// Echo every line the relays and consumers log.
    #[arg(long)]
    verbose: bool,
}

impl Args {
    fn config(self) -> Result<BrokerConfig, String> {
        let mut config = BrokerConfig::new(self.events);
        config.consumers = self.consumers;
        config.outages = self.outages;
        config.duration = Duration::from_secs(self.duration);
        config.duplicate_window = Duration::try_from_secs_f64(self.duplicate_window)
            .map_err(|e| format!("--duplicate-window: {e}"))?;
        let run = &mut config.run;
        run.relays = self.relays;
        #[allow(clippy::cast_precision_loss)]
        let spread = self.events as f64 * 0.6 / self.duration.max(1) as f64;
        run.rate = self.rate.unwrap_or(spread.max(150.0));
        if !(run.rate > 0.0 && run.rate.is_finite()) {
            return Err("--rate must be positive".into());
        }
        if let Some(seed) = self.seed {
            run.seed = seed;
        }
        run.verbose = self.verbose;
        run.drain_timeout = Duration::from_mins(3);
        Ok(config)
    }
}

/// The broker a run goes through; its children (relays and consumers) are told its name
/// (`BROKER`).
#[derive(clap::ValueEnum, Clone, Copy, Debug)]
enum Broker {
    /// NATS JetStream: a `nats-server -js` of the run's own, restarted.
    Nats,
    /// RabbitMQ on 127.0.0.1:5672 (or `OUTBOX_AMQP_URL`), its connections cut.
    #[value(name = "rabbitmq")]
    RabbitMq,
    /// Kafka: a tansu of the run's own (in memory), its connections cut.
    Kafka,
}

impl Broker {
    /// In a relay or consumer child: runs it through the broker its parent named, until
    /// SIGTERM. Returns at once in any other process.
    fn child_main_if_requested() {
        let named = child::param("BROKER").and_then(|name| Self::from_str(&name, false).ok());
        match named {
            Some(Self::Nats) => broker::child_main_if_requested::<Nats>(),
            Some(Self::RabbitMq) => broker::child_main_if_requested::<RabbitMq>(),
            Some(Self::Kafka) => broker::child_main_if_requested::<Kafka>(),
            None => {}
        }
    }

    async fn run(
        self,
        config: &BrokerConfig,
        command: &ChildCommand,
    ) -> Result<BrokerReport, String> {
        match self {
            Self::Nats => broker::run::<Nats>(config, command).await,
            Self::RabbitMq => broker::run::<RabbitMq>(config, command).await,
            Self::Kafka => broker::run::<Kafka>(config, command).await,
        }
    }
}

fn at_least_one() -> RangedU64ValueParser<usize> {
    RangedU64ValueParser::new().range(1..)
}

fn main() -> ExitCode {
    // The relays and consumers are this binary, re-executed with the chaos environment.
    Broker::child_main_if_requested();
    let args = Args::parse();
    let broker = args.broker;
    let config = match args.config() {
        Ok(config) => config,
        Err(error) => {
            eprintln!("broker_chaos: {error}");
            return ExitCode::FAILURE;
        }
    };
    println!(
        "broker chaos: {} events through {}, {} relays, {} consumers, {}/s while they run, \
         at least {:?} of chaos, seed {}",
        config.run.events,
        broker
            .to_possible_value()
            .expect("no variant is skipped")
            .get_name(),
        config.run.relays,
        config.consumers,
        config.run.rate,
        config.duration,
        config.run.seed
    );
    let runtime = tokio::runtime::Runtime::new().expect("a tokio runtime");
    // Ctrl-C drops the run: its relays, consumers and nats-server are stopped with it.
    let command = ChildCommand::binary();
    let run = runtime.block_on(async {
        tokio::select! {
            run = broker.run(&config, &command) => Some(run),
            _ = tokio::signal::ctrl_c() => None,
        }
    });
    let Some(run) = run else {
        eprintln!("broker_chaos: interrupted; the relays, consumers and broker are stopped");
        return ExitCode::FAILURE;
    };
    match run {
        Ok(report) => {
            println!("{report}");
            if report.failures.is_empty() {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            }
        }
        Err(error) => {
            eprintln!("broker_chaos: the run could not run: {error}");
            ExitCode::FAILURE
        }
    }
}
