//! The summary: summary.txt and summary.json as the workloads and sections fill
//! them, the goals' figures, and medians with their ranges.

use std::{fmt::Write as _, path::Path};

use anyhow::Result;

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

    pub(super) fn json(&self, workload: &str) -> String {
        format!(
            "{{\"workload\": {}, \"goal\": {}, \"value\": {}, \"limit\": {}, \"met\": {}}}",
            json_string(workload),
            json_string(&format!(
                "{} {} {}{}",
                self.text, self.relation, self.limit, self.unit
            )),
            json_number(self.value),
            json_number(self.limit),
            self.met().map_or("null".into(), |m| m.to_string())
        )
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

pub(super) fn json_number(value: f64) -> String {
    if value.is_finite() {
        format!("{value:.6}")
    } else {
        "null".into()
    }
}

pub(super) fn json_string(text: &str) -> String {
    let mut out = String::from("\"");
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
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
    pub(super) json_workloads: Vec<String>,
    pub(super) json_goals: Vec<String>,
}

/// The sections' parts of summary.json: `null` (or empty) for a section not run.
pub(super) struct SectionsJson {
    pub(super) launch: String,
    pub(super) library: String,
    pub(super) dumps: Vec<String>,
    pub(super) shutdown: Vec<String>,
    pub(super) redis: String,
    /// The daemon-load section's CPU s, wall s and peak RSS (KiB).
    pub(super) load: (f64, f64, u64),
}

impl Default for SectionsJson {
    fn default() -> Self {
        SectionsJson {
            launch: "null".to_owned(),
            library: "null".to_owned(),
            dumps: Vec::new(),
            shutdown: Vec::new(),
            redis: "null".to_owned(),
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
    let json = format!(
        "{{\n  \"load_average\": {{\"start\": {}, \"end\": {}}},\n  \"warnings\": [{}],\n  \"workloads\": [\n    {}\n  ],\n  \"goals\": [\n    {}\n  ],\n  \"largest_library\": {},\n  \"dumps\": [{}],\n  \"shutdown\": {{{}}},\n  \"redis\": {},\n  \"launch\": {},\n  \"daemon_load\": {{\"seconds\": {}, \"cpu_s\": {}, \"cpu_percent_of_core\": {}, \"peak_rss_kib\": {rss}}}\n}}\n",
        json_string(load_before),
        json_string(&load_average()),
        summary
            .warnings
            .iter()
            .map(|w| json_string(w))
            .collect::<Vec<_>>()
            .join(", "),
        summary.json_workloads.join(",\n    "),
        summary.json_goals.join(",\n    "),
        sections.library,
        sections.dumps.join(", "),
        sections.shutdown.join(", "),
        sections.redis,
        sections.launch,
        json_number(wall),
        json_number(cpu),
        json_number(cpu / wall * 100.0),
    );
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
