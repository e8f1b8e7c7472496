//! The redis section's table-sizing case: `heapprofd --pid` with its default flags on
//! a fresh redis-server that `redis-benchmark -t set -r 1000000` then fills with about
//! a million keys. It reports the keys, the blocks heapprofd holds in its live-block
//! table, the blocks it dropped (the goal: none) and the kernel memory of its tables,
//! as its `--stats-json` states them.

use std::{fmt::Write as _, process::Command};

use anyhow::{Context as _, Result, bail};
use serde_json::{Value, json};

use super::server::{PORT, Redis};
use crate::bench::{Bench, figures::DaemonStats, summary::number};

/// What one filling of redis gave.
struct Filled {
    keys: u64,
    live_blocks: u64,
    dropped: u64,
    kernel_memory: String,
}

/// Fills a fresh redis with `keys` random keys under `heapprofd --pid` (default flags).
fn fill(bench: &Bench, keys: u32) -> Result<Filled> {
    let redis = Redis::start()?;
    let daemon = bench.start_heapprofd(&["--interval", "1h"], redis.pid())?;
    let status = Command::new("taskset")
        .args(["-c", "1", "redis-benchmark", "-p", PORT])
        .args(["-t", "set", "-P", "32", "-q"])
        .args(["-r", &keys.to_string(), "-n", &(keys * 5).to_string()])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .context("running redis-benchmark")?;
    if !status.success() {
        bail!("redis-benchmark failed: {status}");
    }
    let dbsize = Command::new("redis-cli")
        .args(["-p", PORT, "dbsize"])
        .output()
        .context("running redis-cli dbsize")?;
    let keys = String::from_utf8_lossy(&dbsize.stdout)
        .trim()
        .parse()
        .context("redis-cli dbsize gave no number")?;
    let stats = DaemonStats::at_stop(daemon)?;
    Ok(Filled {
        keys,
        live_blocks: stats.final_profile.inuse_blocks,
        dropped: stats.dropped("live_table_full"),
        kernel_memory: stats.kernel_memory.describe(),
    })
}

/// Runs the case; appends its lines to `text` and returns its JSON object.
pub fn section(bench: &Bench, quick: bool, text: &mut String) -> Result<Value> {
    let keys = if quick { 100_000 } else { 1_000_000 };
    crate::step(&format!(
        "redis: {keys} random keys under heapprofd --pid with default flags"
    ));
    let filled = fill(bench, keys)?;
    let _ = writeln!(
        text,
        "\n## redis-server filled with redis-benchmark -t set -r {keys} under heapprofd --pid (default flags)\n\n\
         {} keys, {} blocks in use in heapprofd's live-block table, {} dropped (goal: 0)\n{}",
        filled.keys, filled.live_blocks, filled.dropped, filled.kernel_memory
    );
    Ok(json!({
        "keys": number(filled.keys as f64),
        "live_blocks": number(filled.live_blocks as f64),
        "dropped": number(filled.dropped as f64),
        "kernel_memory": filled.kernel_memory,
    }))
}
