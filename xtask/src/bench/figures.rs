//! Reading the daemon's figures: what a run of heapprofd counted, wrote and built, from
//! the file it writes at exit with `--stats-json` (allocations, the final profile,
//! drops, how a `--pid` target was joined, BPF run time, single-stepped probes, map
//! memory, its unwind tables), and what its profile holds (frames per allocation).

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use anyhow::{Context as _, Result};
use serde::Deserialize;
use serde_json::{Value, json};

use super::process::{Daemon, interrupt};

/// What a heapprofd run wrote with `--stats-json` at its exit (the daemon's
/// `stats_file.rs`): only the figures the benchmark reads.
#[derive(Debug, Deserialize)]
pub(super) struct DaemonStats {
    /// The final profile.
    pub(super) final_profile: FinalProfile,
    /// Events dropped, by the reason's stable name.
    pub(super) dropped: BTreeMap<String, u64>,
    /// `--pid`: how the target was joined.
    pub(super) joined: Option<Joined>,
    /// The BPF maps' kernel memory at start.
    pub(super) kernel_memory: KernelMemory,
    /// Probes the kernel single-steps.
    pub(super) single_stepped_probes: usize,
    /// `--bpf-stats`: the programs' run time.
    pub(super) bpf_run_time: Option<BpfRunTime>,
    /// User mode: the unwind tables at the end.
    pub(super) unwind_tables: Option<UnwindTables>,
}

/// The unwind tables as the daemon counts them (its `TableUsage`).
#[derive(Debug, Clone, Copy, Deserialize)]
pub(super) struct UnwindTables {
    pub(super) objects: u64,
    pub(super) rows: u64,
    pub(super) rules: u64,
    pub(super) without_cfi: u64,
    pub(super) not_fitting: u64,
    pub(super) bytes: u64,
    pub(super) build_ms: u64,
}

/// The final profile's path and totals.
#[derive(Debug, Deserialize)]
pub(super) struct FinalProfile {
    pub(super) path: PathBuf,
    pub(super) allocated_blocks: u64,
    pub(super) allocated_bytes: u64,
    pub(super) inuse_blocks: u64,
}

/// How a `--pid` target was joined: `how` is `injected` or `probes`.
#[derive(Debug, Deserialize)]
pub(super) struct Joined {
    pub(super) how: String,
    pub(super) reason: Option<String>,
}

/// The BPF maps' kernel memory, in bytes: all of it and by table.
#[derive(Debug, Deserialize)]
pub(super) struct KernelMemory {
    pub(super) total_bytes: u64,
    pub(super) tables: BTreeMap<String, u64>,
}

/// The BPF programs' run time (`--bpf-stats`).
#[derive(Debug, Deserialize)]
pub(super) struct BpfRunTime {
    pub(super) total_ns: u64,
    pub(super) programs: Vec<ProgramRunTime>,
}

/// One program's runs and run time.
#[derive(Debug, Deserialize)]
pub(super) struct ProgramRunTime {
    pub(super) name: String,
    pub(super) runs: u64,
    pub(super) run_time_ns: u64,
}

impl DaemonStats {
    /// Stops `daemon` with SIGINT, as a person would, and reads what it wrote at exit.
    pub(super) fn at_stop(daemon: Daemon) -> Result<Self> {
        interrupt(&daemon.child);
        let mut child = daemon.child;
        child.wait()?;
        Self::read(&daemon.stats)
    }

    /// Reads the file heapprofd wrote at `path` (it exists once heapprofd has exited).
    pub(super) fn read(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("heapprofd wrote no --stats-json {}", path.display()))?;
        serde_json::from_str(&text).with_context(|| format!("reading {}", path.display()))
    }

    /// Events dropped for the reason named `name` (`live_table_full`, ...).
    pub(super) fn dropped(&self, name: &str) -> u64 {
        self.dropped.get(name).copied().unwrap_or(0)
    }
}

/// How a `--pid` mode's passes joined their target (each pass's `joined`: `how` and why
/// not injected): `injected` or `probes` when all passes agree, `mixed` when not,
/// `unknown` without a pass; and the first reason a pass gave for not injecting.
pub(super) fn joined_answer<'a>(
    joins: impl IntoIterator<Item = &'a Option<(String, Option<String>)>>,
) -> (&'static str, Option<String>) {
    let joins: Vec<&(String, Option<String>)> = joins.into_iter().flatten().collect();
    let how = match joins.as_slice() {
        [] => "unknown",
        [(first, _), ..] if joins.iter().any(|(how, _)| how != first) => "mixed",
        [(how, _), ..] if how == "injected" => "injected",
        [(how, _), ..] if how == "probes" => "probes",
        _ => "unknown",
    };
    let reason = joins.iter().find_map(|(_, reason)| reason.clone());
    (how, reason)
}

impl KernelMemory {
    /// One line, as the start-up log words it: the total, then each table.
    pub(super) fn describe(&self) -> String {
        let mib = |bytes: u64| bytes as f64 / f64::from(1 << 20);
        let tables: Vec<String> = self
            .tables
            .iter()
            .filter(|(_, bytes)| **bytes > 0)
            .map(|(table, bytes)| format!("{table} {:.1} MiB", mib(*bytes)))
            .collect();
        format!(
            "BPF maps hold {:.1} MiB of kernel memory: {}",
            mib(self.total_bytes),
            tables.join(", ")
        )
    }
}

impl BpfRunTime {
    /// One line: the total, then each program's runs and nanoseconds per run.
    pub(super) fn describe(&self) -> String {
        let programs: Vec<String> = self
            .programs
            .iter()
            .map(|p| {
                format!(
                    "{} {} runs {} ns/run",
                    p.name,
                    p.runs,
                    p.run_time_ns / p.runs.max(1)
                )
            })
            .collect();
        format!(
            "BPF run time {:.3} ms: {}",
            self.total_ns as f64 / 1e6,
            if programs.is_empty() {
                "no runs yet".to_owned()
            } else {
                programs.join(", ")
            }
        )
    }
}

/// The figures of the unwind tables the summary shows.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Tables {
    pub(super) objects: u64,
    pub(super) rows: u64,
    pub(super) rules: u64,
    pub(super) kib: u64,
    pub(super) build_ms: u64,
    pub(super) not_fitting: u64,
}

impl UnwindTables {
    /// The figures the summary shows.
    pub(super) fn tables(&self) -> Tables {
        Tables {
            objects: self.objects,
            rows: self.rows,
            rules: self.rules,
            kib: self.bytes.div_ceil(1024),
            build_ms: self.build_ms,
            not_fitting: self.not_fitting,
        }
    }

    /// One line, in the words of the daemon's log (the summary's `unwind_tables_line`).
    pub(super) fn line(&self) -> String {
        format!(
            "unwind tables: {} objects, {} rows, {} rules, {} KiB of BPF map memory in use, \
             built in {} ms; {} objects without CFI, {} that did not fit",
            self.objects,
            self.rows,
            self.rules,
            self.bytes.div_ceil(1024),
            self.build_ms,
            self.without_cfi,
            self.not_fitting
        )
    }
}

impl Tables {
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A file as heapprofd's `stats_file.rs` writes it (its own tests check its keys).
    const WRITTEN: &str = r#"{
  "final_profile": {"path": "/tmp/p/heap-1.pb.gz", "samples": 87,
    "allocated_blocks": 22144066, "allocated_bytes": 594233862,
    "inuse_blocks": 2979936, "inuse_bytes": 73053015},
  "dropped": {"live_table_full": 28, "site_table_full": 0},
  "joined": {"pid": 42, "how": "probes", "reason": "--inject off"},
  "kernel_memory": {"total_bytes": 46137344,
    "tables": {"live_blocks": 45088768, "other": 1048576, "sites": 0}},
  "single_stepped_probes": 1,
  "bpf_run_time": {"total_ns": 2500000, "programs": [
    {"name": "alloc_entry", "runs": 1000, "run_time_ns": 2000000},
    {"name": "alloc_return", "runs": 1000, "run_time_ns": 500000}]}
}"#;

    #[test]
    fn figures_come_from_the_stats_file() {
        let stats: DaemonStats = serde_json::from_str(WRITTEN).expect("the daemon's form");
        assert_eq!(stats.final_profile.allocated_blocks, 22_144_066);
        assert_eq!(stats.final_profile.inuse_blocks, 2_979_936);
        assert_eq!(stats.dropped("live_table_full"), 28);
        assert_eq!(stats.dropped("in_flight_full"), 0);
        assert_eq!(stats.single_stepped_probes, 1);
        let joined = stats.joined.as_ref().expect("joined");
        assert_eq!(
            (joined.how.as_str(), joined.reason.as_deref()),
            ("probes", Some("--inject off"))
        );
        assert_eq!(
            stats.kernel_memory.describe(),
            "BPF maps hold 44.0 MiB of kernel memory: live_blocks 43.0 MiB, other 1.0 MiB"
        );
        let run_time = stats.bpf_run_time.expect("--bpf-stats");
        assert_eq!(
            run_time.describe(),
            "BPF run time 2.500 ms: alloc_entry 1000 runs 2000 ns/run, alloc_return 1000 runs 500 ns/run"
        );
    }
}
