//! Human output: aligned tables and short durations.

use std::fmt::Write as _;
use std::time::Duration;

/// A table of text cells, printed with each column as wide as its widest cell.
pub(crate) struct Table {
    rows: Vec<Vec<String>>,
}

impl Table {
    pub(crate) fn new(header: &[&str]) -> Self {
        Self {
            rows: vec![header.iter().map(|&h| h.to_owned()).collect()],
        }
    }

    pub(crate) fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    pub(crate) fn render(&self) -> String {
        let columns = self.rows.iter().map(Vec::len).max().unwrap_or(0);
        let widths: Vec<usize> = (0..columns)
            .map(|c| {
                self.rows
                    .iter()
                    .filter_map(|r| r.get(c))
                    .map(|cell| cell.chars().count())
                    .max()
                    .unwrap_or(0)
            })
            .collect();
        let mut out = String::new();
        for row in &self.rows {
            let mut line = String::new();
            for (cell, width) in row.iter().zip(&widths) {
                let _ = write!(line, "{cell:<width$}  ");
            }
            out.push_str(line.trim_end());
            out.push('\n');
        }
        out
    }
}

/// `d` to the nearest useful unit: `850ms`, `12s`, `3m 20s`, `5h 02m`, `3d 4h`.
pub(crate) fn age(d: Duration) -> String {
    let secs = d.as_secs();
    match secs {
        0 => format!("{}ms", d.as_millis()),
        1..60 => format!("{secs}s"),
        60..3_600 => format!("{}m {:02}s", secs / 60, secs % 60),
        3_600..86_400 => format!("{}h {:02}m", secs / 3_600, secs % 3_600 / 60),
        _ => format!("{}d {}h", secs / 86_400, secs % 86_400 / 3_600),
    }
}

/// An optional age, `-` when there is none.
pub(crate) fn maybe_age(d: Option<Duration>) -> String {
    d.map_or_else(|| "-".to_owned(), age)
}

/// `text` cut to `max` characters, on one line.
pub(crate) fn clip(text: &str, max: usize) -> String {
    let line: String = text
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    if line.chars().count() <= max {
        line
    } else {
        let mut cut: String = line.chars().take(max.saturating_sub(3)).collect();
        cut.push_str("...");
        cut
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ages_read_at_a_glance() {
        assert_eq!(age(Duration::from_millis(850)), "850ms");
        assert_eq!(age(Duration::from_secs(12)), "12s");
        assert_eq!(age(Duration::from_secs(200)), "3m 20s");
        assert_eq!(
            age(Duration::from_hours(5) + Duration::from_mins(2)),
            "5h 02m"
        );
        assert_eq!(age(Duration::from_hours(3 * 24 + 4)), "3d 4h");
    }

    #[test]
    fn columns_align_and_long_text_is_clipped() {
        let mut table = Table::new(&["TABLE", "DEAD"]);
        table.row(vec!["order_events".to_owned(), "2".to_owned()]);
        assert_eq!(table.render(), "TABLE         DEAD\norder_events  2\n");
        assert_eq!(clip("line one\nline two", 12), "line one ...");
    }
}
