//! Self-measurement: the kernel's run-time statistics of our BPF programs, and how the
//! programs looked up the stacks of the allocations they recorded.
//!
//! While the descriptor from `BPF_ENABLE_STATS` is open the kernel times every program
//! run (a few ns each, which is why this is opt-in: `--bpf-stats`).

use std::{os::fd::OwnedFd, time::Duration};

use anyhow::{Context as _, Result};
use aya::{
    Ebpf,
    maps::PerCpuArray,
    sys::{Stats, enable_stats},
};
use heapprof_common::{WalkOutcome, names};

/// Keeps the kernel's BPF run-time statistics on while alive.
pub struct RunTimeStats {
    _enabled: OwnedFd,
}

/// Runs and run time of one program since it was loaded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProgramStats {
    /// Program name.
    pub name: String,
    /// Times it ran.
    pub runs: u64,
    /// Time spent in it.
    pub run_time: Duration,
}

impl ProgramStats {
    /// Average nanoseconds per run.
    pub fn nanos_per_run(&self) -> u64 {
        (self.run_time.as_nanos() / u128::from(self.runs.max(1))) as u64
    }
}

impl RunTimeStats {
    /// Turns the statistics on (kernel 5.8 or later).
    pub fn enable() -> Result<Self> {
        let fd = enable_stats(Stats::RunTime)
            .context("enabling BPF run-time statistics (BPF_ENABLE_STATS, Linux 5.8+)")?;
        Ok(Self { _enabled: fd })
    }

    /// Statistics of every program of `ebpf` that has run, busiest first.
    pub fn read(&self, ebpf: &Ebpf) -> Vec<ProgramStats> {
        let mut stats = self.read_all(ebpf);
        stats.retain(|s| s.runs > 0);
        stats.sort_by_key(|s| std::cmp::Reverse(s.run_time));
        stats
    }

    /// Statistics of every program of `ebpf`, those that never ran included (the
    /// metrics keep one series per program from the start).
    pub fn read_all(&self, ebpf: &Ebpf) -> Vec<ProgramStats> {
        ebpf.programs()
            .filter_map(|(name, program)| {
                let info = program.info().ok()?;
                Some(ProgramStats {
                    name: name.to_owned(),
                    runs: info.run_count(),
                    run_time: info.run_time(),
                })
            })
            .collect()
    }
}

/// One log line: `name runs×ns/run`, and the total.
pub fn describe(stats: &[ProgramStats]) -> String {
    let total: Duration = stats.iter().map(|s| s.run_time).sum();
    let parts: Vec<String> = stats
        .iter()
        .map(|s| format!("{} {} runs {} ns/run", s.name, s.runs, s.nanos_per_run()))
        .collect();
    format!(
        "BPF run time {:.3} ms: {}",
        total.as_secs_f64() * 1e3,
        if parts.is_empty() {
            "no runs yet".to_owned()
        } else {
            parts.join(", ")
        }
    )
}

/// How the user-mode programs looked up the stacks of the allocations they recorded
/// (`WALK_STATS`, summed over CPUs). An allocation is one lookup, or two when a
/// remembered walk holds but its site is not yet in the table (the walk is made again
/// to store the stack). In `--stats-json` as `stack_lookups`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct StackLookups {
    /// From a walk remembered on the CPU, checked against the stack's words.
    pub remembered: u64,
    /// By a walk, remembered for the next allocation there.
    pub walked: u64,
    /// By a walk that could not be remembered.
    pub not_rememberable: u64,
}

impl StackLookups {
    /// Reads the programs' counters.
    pub fn read(ebpf: &Ebpf) -> Result<Self> {
        let map = ebpf
            .map(names::WALK_STATS)
            .with_context(|| format!("BPF map {} missing from the object", names::WALK_STATS))?;
        let counters = PerCpuArray::<_, u64>::try_from(map)
            .with_context(|| format!("BPF map {} has an unexpected type", names::WALK_STATS))?;
        let count = |outcome: WalkOutcome| -> Result<u64> {
            let per_cpu = counters
                .get(&(outcome as u32), 0)
                .with_context(|| format!("reading {}", names::WALK_STATS))?;
            Ok(per_cpu.iter().sum())
        };
        Ok(Self {
            remembered: count(WalkOutcome::Remembered)?,
            walked: count(WalkOutcome::Walked)?,
            not_rememberable: count(WalkOutcome::NotRememberable)?,
        })
    }

    /// Lookups, however made.
    pub fn total(&self) -> u64 {
        self.remembered + self.walked + self.not_rememberable
    }

    /// One log line.
    pub fn describe(&self) -> String {
        format!(
            "stack lookups: {} ({} by a remembered walk, {} walked and remembered, {} walked)",
            self.total(),
            self.remembered,
            self.walked,
            self.not_rememberable
        )
    }
}
