//! Reading the daemon's figures: what a run of heapprofd counted, wrote and built
//! (allocations, the final profile, unwind tables, BPF run time, single-stepped
//! probes), and what its profile holds (frames per allocation).

use serde_json::{Value, json};
use std::{
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

/// Parses heapprofd's "N blocks / B bytes allocated" from its last "wrote" line.
pub(super) fn counted_allocations(log: &[String]) -> Option<u64> {
    let line = log.iter().rev().find(|l| l.contains(" wrote "))?;
    let before = line.split(" blocks / ").next()?;
    before.rsplit(' ').next()?.parse().ok()
}

/// The profile named by heapprofd's last "wrote PATH: ..." line.
pub(super) fn written_profile(log: &[String]) -> Option<PathBuf> {
    let line = log.iter().rev().find(|l| l.contains(" wrote "))?;
    let rest = line.split(" wrote ").nth(1)?;
    Some(PathBuf::from(rest.split(": ").next()?))
}

/// heapprofd's last `unwind tables: ...` log line, from "unwind tables" on.
pub(super) fn unwind_tables_line(log: &[String]) -> Option<String> {
    log.iter()
        .rev()
        .find_map(|l| l.split_once("unwind tables: "))
        .map(|(_, rest)| format!("unwind tables: {rest}"))
}

/// The figures of an `unwind tables:` line: `7 objects, 72345 rows, 812 rules, 600 KiB
/// of BPF map memory in use, built in 30 ms; 0 objects without CFI, 0 that did not fit`.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Tables {
    pub(super) objects: u64,
    pub(super) rows: u64,
    pub(super) rules: u64,
    pub(super) kib: u64,
    pub(super) build_ms: u64,
    pub(super) not_fitting: u64,
}

impl Tables {
    pub(super) fn parse(line: &str) -> Option<Tables> {
        // The number just before `label`.
        let before = |label: &str| -> Option<u64> {
            let head = line.split(label).next().filter(|h| h.len() < line.len())?;
            head.rsplit(' ').next()?.parse().ok()
        };
        let build_ms = line
            .split("built in ")
            .nth(1)?
            .split(' ')
            .next()?
            .parse()
            .ok()?;
        Some(Tables {
            objects: before(" objects,")?,
            rows: before(" rows,")?,
            rules: before(" rules,")?,
            kib: before(" KiB of BPF map memory")?,
            build_ms,
            not_fitting: before(" that did not fit").unwrap_or(0),
        })
    }

    /// Its object in summary.json.
    pub(super) fn json(&self) -> Value {
        json!({
            "objects": self.objects,
            "rows": self.rows,
            "rules": self.rules,
            "bpf_map_kib": self.kib,
            "build_ms": self.build_ms,
            "not_fitting": self.not_fitting,
        })
    }
}

/// The mean number of frames (locations, the allocator's own included) per allocation of
/// a profile, weighted by `alloc_objects`; from `go tool pprof -raw`. `None` when go is
/// missing or the profile has no allocations.
pub(super) fn frames_per_allocation(profile: &Path) -> Option<f64> {
    let output = Command::new("go")
        .args(["tool", "pprof", "-raw"])
        .arg(profile)
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()
        .ok()?;
    if !output.status.success() {
        return None;
    }
    let text = String::from_utf8_lossy(&output.stdout);
    let (mut objects, mut frames) = (0u64, 0u64);
    // Sample lines: `alloc_objects alloc_space inuse_objects inuse_space: LOC LOC ...`,
    // each followed by label lines (`comm:[...]`), whose key is not a number.
    let samples = text
        .lines()
        .skip_while(|l| !l.starts_with("Samples:"))
        .take_while(|l| !l.starts_with("Locations"));
    for line in samples {
        let Some((values, locations)) = line.split_once(':') else {
            continue;
        };
        let Some(Ok(count)) = values.split_whitespace().next().map(str::parse::<u64>) else {
            continue;
        };
        objects += count;
        frames += count * locations.split_whitespace().count() as u64;
    }
    (objects > 0).then(|| frames as f64 / objects as f64)
}

/// The total of a `BPF run time X ms: ...` line, in nanoseconds.
pub(super) fn bpf_total_ns(stats: &str) -> Option<f64> {
    let ms: f64 = stats
        .split("BPF run time ")
        .nth(1)?
        .split(' ')
        .next()?
        .parse()
        .ok()?;
    Some(ms * 1e6)
}

/// Lines of heapprofd's log that report a single-stepped probe.
pub(super) fn single_stepped(log: &[String]) -> usize {
    log.iter()
        .filter(|line| line.contains("is single-stepped by the kernel"))
        .count()
}
