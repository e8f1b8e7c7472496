//! What heapprofd's BPF work adds to each trap on redis's probes, sampled, in the
//! kernel's own accounting: one pass of the sampled trap floor and one of sampled on
//! the probes, each under `--bpf-stats`, and the entry program's nanoseconds per run.
//! The throughput ratios cannot tell a few nanoseconds per call apart from a sitting's
//! noise; this figure can. The accounting slows every run, so these passes are not
//! among the timed ones.

use std::fmt::Write as _;

use anyhow::{Context as _, Result};
use serde_json::{Value, json};

use super::{RedisMode, TESTS, client, server::Redis};
use crate::bench::{
    Bench,
    figures::{DaemonStats, ProgramRunTime},
    summary::number,
};

/// The entry program's runs in one pass and its time per run, nanoseconds.
struct PerRun {
    runs: u64,
    ns: f64,
}

/// Appends the line of the entry program's time per run, floor and sampled, to `text`;
/// returns their JSON object (a failed pass is said and left null).
pub(super) fn section(bench: &Bench, requests: u32, text: &mut String) -> Value {
    let measure = |mode| per_run(bench, mode, requests);
    let (floor, sampled) = (
        measure(RedisMode::SampledFloor),
        measure(RedisMode::Sampled),
    );
    let said = |measured: &Result<PerRun>| match measured {
        Ok(per_run) => format!("{:.1} ns per run ({} runs)", per_run.ns, per_run.runs),
        Err(err) => format!("failed: {err:#}"),
    };
    let _ = writeln!(
        text,
        "BPF entry program per allocator call on the probes (--bpf-stats, one pass each): sampled {}; its floor {}",
        said(&sampled),
        said(&floor)
    );
    let json_of = |measured: &Result<PerRun>| match measured {
        Ok(per_run) => json!({ "runs": per_run.runs, "ns_per_run": number(per_run.ns) }),
        Err(_) => Value::Null,
    };
    json!({
        RedisMode::Sampled.key(): json_of(&sampled),
        RedisMode::SampledFloor.key(): json_of(&floor),
    })
}

/// One pass of `mode` (a `--pid` mode) under `--bpf-stats`: the entry program's time.
fn per_run(bench: &Bench, mode: RedisMode, requests: u32) -> Result<PerRun> {
    let redis = Redis::start()?;
    client("set,get", requests / 5)?;
    let mut flags = mode.flags().context("a --pid mode")?.to_vec();
    flags.push("--bpf-stats");
    let daemon = bench.start_heapprofd(&flags, redis.pid())?;
    client(TESTS, requests)?;
    let run_time = DaemonStats::at_stop(daemon)?
        .bpf_run_time
        .context("heapprofd --bpf-stats wrote no BPF run time")?;
    entry_program(&run_time.programs)
        .map(|program| PerRun {
            runs: program.runs,
            ns: program.run_time_ns as f64 / program.runs as f64,
        })
        .context("no allocator entry program ran")
}

/// The allocator entry program that ran most: the session program, or the classic
/// entry where the kernel has no session links.
fn entry_program(programs: &[ProgramRunTime]) -> Option<&ProgramRunTime> {
    programs
        .iter()
        .filter(|program| program.name.starts_with("entry") && program.runs > 0)
        .max_by_key(|program| program.runs)
}
