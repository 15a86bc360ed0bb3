//! The throughput chart's data: every table's counts, sampled every few seconds into a
//! ring of the last hour, kept in memory (a restart starts an empty chart).

use std::collections::VecDeque;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde::Serialize;

use crate::status::TableStatus;

/// How far back the chart looks.
pub(super) const WINDOW: Duration = Duration::from_hours(1);

/// A bound on memory whatever `--sample-every` says.
const MAX_SAMPLES: usize = 3600;

/// Every table's counts at one moment.
#[derive(Debug, Clone)]
struct Sample {
    /// For the deltas: monotonic, unlike the wall clock.
    taken: Instant,
    /// For the chart's axis: seconds since the Unix epoch.
    at: f64,
    tables: Vec<TableCounts>,
}

#[derive(Debug, Clone)]
struct TableCounts {
    table: String,
    /// `None` for a table that deletes its sent rows.
    sent_last_minute: Option<i64>,
    due: i64,
}

/// The ring, and why the last sample could not be taken.
#[derive(Debug, Default)]
pub(super) struct Samples {
    ring: VecDeque<Sample>,
    error: Option<String>,
}

/// One table's chart.
#[derive(Debug, Serialize, PartialEq)]
pub(super) struct Series {
    pub(super) table: String,
    /// Whether the table keeps its sent rows: without them there is no throughput to
    /// count (`sent_per_minute` is always `null`).
    pub(super) counts_sent: bool,
    pub(super) points: Vec<Point>,
}

/// One sample of one table.
#[derive(Debug, Serialize, PartialEq)]
pub(super) struct Point {
    /// Seconds since the Unix epoch.
    pub(super) at: f64,
    /// The due backlog then.
    pub(super) due: i64,
    /// Events recorded SENT in the minute before the sample; `null` for a table that
    /// deletes its sent rows.
    pub(super) sent_per_minute: Option<f64>,
}

impl Samples {
    /// Records the tables' counts as of now, forgetting what fell out of the window.
    pub(super) fn record(&mut self, tables: &[TableStatus]) {
        self.record_at(Instant::now(), unix_now(), tables);
    }

    fn record_at(&mut self, taken: Instant, at: f64, tables: &[TableStatus]) {
        let tables = tables
            .iter()
            // A table whose catalog entry has a problem reads all zeros: not a sample.
            .filter(|t| t.problem.is_none())
            .map(|t| TableCounts {
                table: t.table.clone(),
                sent_last_minute: t.sent_last_minute,
                due: t.due,
            })
            .collect();
        self.ring.push_back(Sample { taken, at, tables });
        while self.ring.len() > MAX_SAMPLES
            || self
                .ring
                .front()
                .is_some_and(|s| taken.duration_since(s.taken) > WINDOW)
        {
            self.ring.pop_front();
        }
        self.error = None;
    }

    /// Remembers why the sampler could not read the counts (shown on the page); the
    /// chart has a gap there.
    pub(super) fn failed(&mut self, error: String) {
        self.error = Some(error);
    }

    pub(super) fn error(&self) -> Option<&str> {
        self.error.as_deref()
    }

    /// Every table's chart, by table name.
    ///
    /// The throughput between two samples is the growth of the table's SENT count over
    /// the time between them. A prune in between lowers that count: a negative delta
    /// falls back to the table's own "sent in the last minute" count then.
    pub(super) fn series(&self) -> Vec<Series> {
        let mut names: Vec<&str> = self
            .ring
            .iter()
            .flat_map(|s| s.tables.iter().map(|t| t.table.as_str()))
            .collect();
        names.sort_unstable();
        names.dedup();
        names.into_iter().map(|name| self.series_of(name)).collect()
    }

    fn series_of(&self, name: &str) -> Series {
        let mut points = Vec::new();
        let mut counts_sent = true;
        for sample in &self.ring {
            // A table missing from a sample (dropped, or not yet migrated) has no point.
            let Some(counts) = sample.tables.iter().find(|t| t.table == name) else {
                continue;
            };
            counts_sent = counts.sent_last_minute.is_some();
            points.push(Point {
                at: sample.at,
                due: counts.due,
                // The table's own count of the last minute, not the growth of its SENT
                // rows between samples: a prune deleting old rows meanwhile would hide
                // what was sent.
                sent_per_minute: counts.sent_last_minute.map(as_f64),
            });
        }
        Series {
            table: name.to_owned(),
            counts_sent,
            points,
        }
    }
}

/// Counts far below 2^52: exact as a float.
#[allow(clippy::cast_precision_loss)]
fn as_f64(n: i64) -> f64 {
    n as f64
}

/// Seconds since the Unix epoch (0 for a clock before it: only the axis is wrong then).
pub(super) fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs_f64()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(table: &str, sent: i64, sent_last_minute: Option<i64>, due: i64) -> TableStatus {
        TableStatus {
            table: table.to_owned(),
            schema: "public".to_owned(),
            type_name: "T".to_owned(),
            version: 1,
            lease_seconds: 30.0,
            max_attempts: 5,
            key: None,
            ready: due,
            due,
            scheduled: 0,
            in_progress: 0,
            expired_claims: 0,
            dead: 0,
            sent,
            sent_last_minute,
            oldest_waiting_age_seconds: None,
            oldest_waiting_error: None,
            held_keys: 0,
            oldest_held_age_seconds: None,
            problem: None,
        }
    }

    fn rates(series: &Series) -> Vec<Option<f64>> {
        series.points.iter().map(|p| p.sent_per_minute).collect()
    }

    #[test]
    fn throughput_is_the_tables_count_of_the_last_minute_whatever_a_prune_deleted() {
        let start = Instant::now();
        let mut samples = Samples::default();
        let at = |s: u64| start + Duration::from_secs(s);
        samples.record_at(at(0), 0.0, &[status("orders", 100, Some(0), 5)]);
        samples.record_at(at(10), 10.0, &[status("orders", 150, Some(50), 3)]);
        // A prune deleted 140 old rows while 10 more were sent.
        samples.record_at(at(20), 20.0, &[status("orders", 20, Some(60), 0)]);
        let series = samples.series();
        assert_eq!(series.len(), 1);
        assert!(series[0].counts_sent);
        assert_eq!(rates(&series[0]), [Some(0.0), Some(50.0), Some(60.0)]);
        assert_eq!(
            series[0].points.iter().map(|p| p.due).collect::<Vec<_>>(),
            [5, 3, 0]
        );
    }

    #[test]
    fn a_table_that_deletes_its_sent_rows_has_no_throughput() {
        let start = Instant::now();
        let mut samples = Samples::default();
        for s in 0..3 {
            samples.record_at(
                start + Duration::from_secs(s * 10),
                0.0,
                &[status("receipts", 0, None, 7)],
            );
        }
        let series = samples.series();
        assert!(!series[0].counts_sent);
        assert_eq!(rates(&series[0]), [None, None, None]);
    }

    #[test]
    fn samples_older_than_the_window_are_forgotten_and_a_missing_table_has_no_point_there() {
        let start = Instant::now();
        let mut samples = Samples::default();
        samples.record_at(start, 0.0, &[status("a", 0, Some(0), 0)]);
        samples.record_at(
            start + Duration::from_mins(1),
            60.0,
            &[status("b", 0, Some(0), 0)],
        );
        samples.record_at(
            start + Duration::from_mins(2),
            120.0,
            &[status("a", 60, Some(0), 0)],
        );
        // "a" was missing from the middle sample.
        let a = &samples.series()[0];
        assert_eq!(
            a.points.iter().map(|p| p.at).collect::<Vec<_>>(),
            [0.0, 120.0]
        );
        samples.record_at(
            start + WINDOW + Duration::from_secs(61),
            4000.0,
            &[status("a", 60, Some(0), 0)],
        );
        let series = samples.series();
        assert_eq!(
            series.iter().map(|s| s.table.as_str()).collect::<Vec<_>>(),
            ["a"]
        );
        assert_eq!(series[0].points.len(), 2, "{series:?}");
    }
}
