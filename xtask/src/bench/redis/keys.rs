//! The redis section's table-sizing case: `heapprofd --pid` with its default flags on
//! a fresh redis-server that `redis-benchmark -t set -r 1000000` then fills with about
//! a million keys. It reports the keys, the blocks heapprofd holds in its live-block
//! table, the blocks it dropped (the goal: none) and the kernel memory of its tables,
//! as its start-up log states it.

use std::{fmt::Write as _, process::Command};

use anyhow::{Context as _, Result, bail};
use serde_json::{Value, json};

use super::server::{PORT, Redis};
use crate::bench::{Bench, process::interrupt, summary::number};

/// What one filling of redis gave.
struct Filled {
    keys: u64,
    live_blocks: u64,
    dropped: u64,
    kernel_memory: String,
}

/// `N blocks / M bytes in use` of heapprofd's last `wrote` log line: N.
fn live_blocks(log: &[String]) -> Option<u64> {
    let line = log.iter().rev().find(|l| l.contains(" wrote "))?;
    line.split(", ")
        .find(|part| part.contains("bytes in use"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// The live-block table drops heapprofd's log warned about, summed.
fn dropped(log: &[String]) -> u64 {
    log.iter()
        .filter(|l| l.contains("events: live-block table full"))
        .filter_map(|l| {
            l.split("warn: ")
                .nth(1)?
                .split_whitespace()
                .next()?
                .parse::<u64>()
                .ok()
        })
        .sum()
}

/// Fills a fresh redis with `keys` random keys under `heapprofd --pid` (default flags).
fn fill(bench: &Bench, keys: u32) -> Result<Filled> {
    let redis = Redis::start()?;
    let mut daemon = bench.start_heapprofd(&["--interval", "1h"], redis.pid())?;
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
    interrupt(&daemon.child);
    daemon.child.wait()?;
    daemon.log.extend(daemon.lines.try_iter());
    let kernel_memory = daemon
        .log
        .iter()
        .find_map(|l| l.split_once("BPF maps hold "))
        .map(|(_, rest)| format!("BPF maps hold {rest}"))
        .unwrap_or_else(|| "(not logged)".to_owned());
    Ok(Filled {
        keys,
        live_blocks: live_blocks(&daemon.log).context("heapprofd wrote no profile")?,
        dropped: dropped(&daemon.log),
        kernel_memory,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn figures_come_from_the_log() {
        let log: Vec<String> = [
            "heapprofd: warn: 23 events: live-block table full (counted as allocated, not as in use) (raise --max-live-blocks)",
            "heapprofd: wrote /tmp/p/heap-1.pb.gz: 87 sites, 22144066 blocks / 594233862 bytes allocated, 2979936 blocks / 73053015 bytes in use; 159.1 ms (read+symbolize 8.0)",
            "heapprofd: warn: 5 events: live-block table full (counted as allocated, not as in use) (raise --max-live-blocks)",
        ]
        .map(str::to_owned)
        .to_vec();
        assert_eq!(live_blocks(&log), Some(2_979_936));
        assert_eq!(dropped(&log), 28);
    }
}
