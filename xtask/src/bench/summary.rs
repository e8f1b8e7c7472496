//! The summary: summary.txt and summary.json as the workloads and sections fill
//! them, the goals' figures, and medians with their ranges.

use std::{fmt::Write as _, path::Path};

use anyhow::{Context as _, Result};
use serde_json::{Map, Value, json};

use super::{Options, process::load_average};

/// A goal of the issue and this run's figure for it.
pub(super) struct GoalFigure {
    pub(super) text: String,
    pub(super) value: f64,
    pub(super) limit: f64,
    /// How `value` must relate to `limit`, as said: "at most", "below ...".
    pub(super) relation: &'static str,
    pub(super) unit: &'static str,
}

impl GoalFigure {
    pub(super) fn met(&self) -> Option<bool> {
        (self.value.is_finite() && self.limit.is_finite()).then_some(self.value <= self.limit)
    }

    pub(super) fn describe(&self) -> String {
        let unit = self.unit;
        format!(
            "{}: {:.2}{unit} (goal: {} {:.2}{unit}): {}",
            self.text,
            self.value,
            self.relation,
            self.limit,
            match self.met() {
                Some(true) => "met",
                Some(false) => "not met",
                None => "no figure",
            }
        )
    }

    /// Its entry of summary.json's `goals`.
    pub(super) fn json(&self, workload: &str) -> Value {
        json!({
            "workload": workload,
            "goal": format!("{} {} {}{}", self.text, self.relation, self.limit, self.unit),
            "value": number(self.value),
            "limit": number(self.limit),
            "met": self.met(),
        })
    }
}

#[derive(Clone, Copy)]
pub(super) struct Spread {
    pub(super) median: f64,
    pub(super) min: f64,
    pub(super) max: f64,
}

pub(super) fn spread(values: &[f64]) -> Spread {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let n = sorted.len();
    let median = if n == 0 {
        f64::NAN
    } else if n % 2 == 1 {
        sorted[n / 2]
    } else {
        (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0
    };
    Spread {
        median,
        min: sorted.first().copied().unwrap_or(f64::NAN),
        max: sorted.last().copied().unwrap_or(f64::NAN),
    }
}

/// A figure for summary.json: rounded to 6 decimals (as the tables print fewer), `null`
/// when it is not a number (a mode without runs, a ratio to zero).
pub(super) fn number(value: f64) -> Value {
    if value.is_finite() {
        json!((value * 1e6).round() / 1e6)
    } else {
        Value::Null
    }
}

/// What the workloads and sections write to summary.txt and summary.json, gathered as
/// they run.
#[derive(Default)]
pub(super) struct Summary {
    /// The body of summary.txt, after its heading.
    pub(super) text: String,
    /// The goals, one line each, for the summary's list of them.
    pub(super) goals_text: String,
    /// Each workload's unwind tables, one line each.
    pub(super) tables_text: String,
    /// Warnings of other tracers, also in the heading.
    pub(super) warnings: Vec<String>,
    /// summary.json's `workloads`.
    pub(super) json_workloads: Vec<Value>,
    /// summary.json's `goals`.
    pub(super) json_goals: Vec<Value>,
}

/// The sections' parts of summary.json: `null` (or empty) for a section not run.
pub(super) struct SectionsJson {
    pub(super) launch: Value,
    pub(super) library: Value,
    pub(super) dumps: Vec<Value>,
    /// By attach method.
    pub(super) shutdown: Map<String, Value>,
    pub(super) redis: Value,
    /// The fleet section (`--all` under the unit's flags, with and without the
    /// system-wide preload).
    pub(super) fleet: Value,
    /// The nginx section's modes and goal.
    pub(super) nginx: Value,
    /// The kernel section's modes and sampled totals.
    pub(super) kernel: Value,
    /// The daemon-load section's CPU s, wall s and peak RSS (KiB).
    pub(super) load: (f64, f64, u64),
}

impl Default for SectionsJson {
    fn default() -> Self {
        SectionsJson {
            launch: Value::Null,
            library: Value::Null,
            dumps: Vec::new(),
            shutdown: Map::new(),
            redis: Value::Null,
            fleet: Value::Null,
            nginx: Value::Null,
            kernel: Value::Null,
            load: (f64::NAN, f64::NAN, 0),
        }
    }
}

/// Writes target/bench/summary.{txt,json} and prints the text.
pub(super) fn write_summary(
    dir: &Path,
    options: &Options,
    load_before: &str,
    summary: &Summary,
    sections: &SectionsJson,
) -> Result<()> {
    let (cpu, wall, rss) = sections.load;
    let json = json!({
        "load_average": {"start": load_before, "end": load_average()},
        "warnings": summary.warnings,
        "workloads": summary.json_workloads,
        "goals": summary.json_goals,
        "largest_library": sections.library,
        "dumps": sections.dumps,
        "shutdown": sections.shutdown,
        "redis": sections.redis,
        "fleet": sections.fleet,
        "nginx": sections.nginx,
        "launch": sections.launch,
        "kernel": sections.kernel,
        "daemon_load": {
            "seconds": number(wall),
            "cpu_s": number(cpu),
            "cpu_percent_of_core": number(cpu / wall * 100.0),
            "peak_rss_kib": rss,
        },
    });
    let json = serde_json::to_string_pretty(&json).context("writing summary.json")? + "\n";
    let mut heading = format!(
        "# heapprofd benchmark ({} runs per mode{}; load average {load_before} at the start, {} at the end)\n# added us/alloc = (median - bare median) / allocations counted by heapprofd exact\n# x floor = added / added of the trap floor (heapprofd --empty-programs: same probes, programs that do nothing)\n",
        options.runs,
        if options.quick { ", --quick" } else { "" },
        load_average()
    );
    for warning in &summary.warnings {
        let _ = writeln!(heading, "# {warning}");
    }
    let text = &summary.text;
    std::fs::write(dir.join("summary.txt"), format!("{heading}{text}"))?;
    std::fs::write(dir.join("summary.json"), json)?;
    println!("{heading}{text}");
    println!(
        "Written: {} and {}",
        dir.join("summary.txt").display(),
        dir.join("summary.json").display()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn figures_are_rounded_and_non_numbers_are_null() {
        assert_eq!(number(1.234_567_89), json!(1.234_568));
        assert_eq!(number(f64::NAN), Value::Null);
        assert_eq!(number(f64::INFINITY), Value::Null);
        let goal = GoalFigure {
            text: "exact / floor".into(),
            value: f64::NAN,
            limit: 1.25,
            relation: "at most",
            unit: "x",
        };
        assert_eq!(
            goal.json("pairs"),
            json!({"workload": "pairs", "goal": "exact / floor at most 1.25x",
                   "value": null, "limit": 1.25, "met": null})
        );
    }
}
