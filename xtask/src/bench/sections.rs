//! The benchmark's sections after the workloads: the unwind tables of the machine's
//! largest library, profile dumps, shutdown and the daemon's own load. Each adds its
//! part of summary.txt and returns its part of summary.json.

use std::{fmt::Write as _, path::Path};

use anyhow::Result;
use serde_json::{Map, Value, json};

use super::{
    Bench,
    summary::{number, spread},
};
use crate::step;

/// The unwind tables of the machine's largest library: `dlopen()` timed under
/// heapprofd, with and without it.
pub(super) fn largest_library(
    bench: &Bench,
    dlopen: &Path,
    runs: usize,
    text: &mut String,
) -> Result<Value> {
    step(
        "unwind tables of the machine's largest library: dlopen() under heapprofd, with and without it",
    );
    let library = bench.largest_library(dlopen, runs)?;
    let (library_text, json) = library.report(runs);
    let _ = write!(text, "{library_text}");
    Ok(json)
}

/// Profile dumps of 10,000 and 100,000 distinct stacks: the first dump, the next one
/// (caches warm) and heapprofd's peak RSS.
pub(super) fn dumps(
    bench: &Bench,
    stacks: &Path,
    runs: usize,
    text: &mut String,
) -> Result<Vec<Value>> {
    let mut json_dumps = Vec::new();
    let _ = writeln!(
        text,
        "\n## Profile dumps ({} runs each; median, min-max; the breakdown is the median run's)\n",
        runs
    );
    for count in [10_000, 100_000] {
        step(&format!(
            "profile dumps with {count} distinct stacks, {} runs",
            runs
        ));
        let mut timed = Vec::new();
        for _ in 0..runs {
            timed.push(bench.dump_times(stacks, count)?);
        }
        let first = spread(&timed.iter().map(|r| r.0.dump_ms).collect::<Vec<_>>());
        let cached = spread(&timed.iter().map(|r| r.1.dump_ms).collect::<Vec<_>>());
        let rss = spread(
            &timed
                .iter()
                .map(|r| r.2 as f64 / 1024.0)
                .collect::<Vec<_>>(),
        );
        timed.sort_by(|a, b| a.0.dump_ms.total_cmp(&b.0.dump_ms));
        let median_first = timed[timed.len() / 2].0.describe_times();
        let _ = writeln!(
            text,
            "{count:>7} stacks: first dump {:.0} ms ({:.0}-{:.0}); next dump {:.0} ms ({:.0}-{:.0}); heapprofd peak RSS {:.1} MiB ({:.1}-{:.1})\n         median first dump: {}",
            first.median,
            first.min,
            first.max,
            cached.median,
            cached.min,
            cached.max,
            rss.median,
            rss.min,
            rss.max,
            median_first
        );
        json_dumps.push(json!({
            "stacks": count,
            "runs": runs,
            "first_dump_ms": number(first.median),
            "cached_dump_ms": number(cached.median),
            "daemon_peak_rss_mib": number(rss.median),
            "median_first_dump": median_first,
        }));
    }
    Ok(json_dumps)
}

/// Shutdown with each attach method: `heapprofd -- true` end to end, and from the
/// final profile written to exit after SIGINT.
pub(super) fn shutdown(
    bench: &Bench,
    pairs: &Path,
    runs: usize,
    text: &mut String,
) -> Result<Map<String, Value>> {
    step("shutdown: heapprofd -- true, and final profile to exit after SIGINT");
    let _ = writeln!(
        text,
        "\n## Shutdown ({} runs each; median, min-max)\n",
        runs
    );
    let mut json_shutdown = Map::new();
    for method in ["auto", "perf-events"] {
        let mut end_to_end = Vec::new();
        let mut after_write = Vec::new();
        for _ in 0..runs {
            let (total, tail) = bench.shutdown(method, pairs)?;
            end_to_end.push(total);
            after_write.push(tail);
        }
        let (total, tail) = (spread(&end_to_end), spread(&after_write));
        let _ = writeln!(
            text,
            "--attach {method:<12} heapprofd -- true: {:.3} s ({:.3}-{:.3}); final profile written to exit: {:.3} s ({:.3}-{:.3})",
            total.median, total.min, total.max, tail.median, tail.min, tail.max
        );
        json_shutdown.insert(
            method.to_owned(),
            json!({
                "end_to_end_true_s": number(total.median),
                "write_to_exit_s": number(tail.median),
            }),
        );
    }
    Ok(json_shutdown)
}

/// The daemon's own load: CPU seconds, wall seconds and peak RSS (KiB) of heapprofd
/// exact over `seconds` of churn, profiles every 10 s.
pub(super) fn daemon_load(
    bench: &Bench,
    churn: &Path,
    seconds: u32,
    text: &mut String,
) -> Result<(f64, f64, u64)> {
    step(&format!(
        "daemon load: {seconds} s of churn, profiles every 10 s (exact)"
    ));
    let (cpu, wall, rss) = bench.daemon_load(churn, seconds)?;
    let _ = writeln!(
        text,
        "\n## Daemon load\n\n{seconds} s churn (2 threads), --interval 10s, exact: heapprofd used {cpu:.3} s CPU in {wall:.1} s = {:.2}% of a core, peak RSS {} MiB",
        cpu / wall * 100.0,
        rss / 1024
    );
    Ok((cpu, wall, rss))
}
