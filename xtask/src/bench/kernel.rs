//! The kernel section (`--only kernel`): what `heapprofd --kernel` adds to a loop of
//! slab allocations and frees, against the tracers that see the same events.
//!
//! The workload (xtask/workloads/bench_pipes.c) runs `pipe2()` and two `close()`s per
//! cycle, about 9 slab allocations and as many frees, and prints the loop's own time:
//! the figure excludes each tool's start-up and exit. Modes, interleaved run by run in
//! a rotated order:
//! - bare;
//! - the tracepoint floor: bpftrace with empty programs on the four kmem tracepoints
//!   heapprofd uses (`kmalloc`, `kmem_cache_alloc`, `kfree`, `kmem_cache_free`);
//! - bpftrace `@[kstack] = count()` on the two allocation tracepoints, for the
//!   workload's command (the stack walk and a map update: the yardstick of an exact
//!   event);
//! - `heapprofd --kernel -- CMD`, exact and `--sample-rate 512KiB`;
//! - `perf record -g` on the four tracepoints, for the command.
//!
//! Besides the times: the sampled runs' scaled totals against the exact runs', with
//! the standard error Poisson sampling by bytes implies (`sqrt(rate / total bytes)`),
//! and one exact run with `--bpf-stats`, its programs' time per run.

use std::{
    fmt::Write as _,
    io::{BufRead as _, BufReader},
    path::Path,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};
use serde_json::{Map, Value, json};

use super::{
    Bench,
    figures::DaemonStats,
    programs::compile,
    summary::{GoalFigure, number, spread},
};
use crate::step;

/// Cycles of the loop (a quarter with `--quick`).
const CYCLES: u32 = 300_000;
/// The sampled mode's `--sample-rate` (512 KiB).
const SAMPLE_RATE: u64 = 512 * 1024;
/// Goal: exact `--kernel`'s added time at most this multiple of bpftrace kstack's.
const KSTACK_GOAL: f64 = 1.0;
/// Goal: sampled `--kernel`'s added time at most this multiple of the floor's.
const FLOOR_GOAL: f64 = 1.25;
/// Goal: the sampled totals within this fraction of the exact ones.
const TOTALS_GOAL: f64 = 0.05;
/// The tracepoints of the floor and of `perf record`.
const TRACEPOINTS: [&str; 4] = ["kmalloc", "kmem_cache_alloc", "kfree", "kmem_cache_free"];

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum KernelMode {
    Bare,
    Floor,
    Kstack,
    Exact,
    Sampled,
    Perf,
}

impl KernelMode {
    const ALL: [KernelMode; 6] = [
        KernelMode::Bare,
        KernelMode::Floor,
        KernelMode::Kstack,
        KernelMode::Exact,
        KernelMode::Sampled,
        KernelMode::Perf,
    ];

    fn name(self) -> &'static str {
        match self {
            KernelMode::Bare => "bare",
            KernelMode::Floor => "tracepoint floor (bpftrace, empty)",
            KernelMode::Kstack => "bpftrace @[kstack] = count()",
            KernelMode::Exact => "heapprofd --kernel exact",
            KernelMode::Sampled => "heapprofd --kernel sampled 512KiB",
            KernelMode::Perf => "perf record -g (4 kmem tracepoints)",
        }
    }

    fn key(self) -> &'static str {
        match self {
            KernelMode::Bare => "bare",
            KernelMode::Floor => "tracepoint_floor",
            KernelMode::Kstack => "bpftrace_kstack",
            KernelMode::Exact => "heapprofd_kernel_exact",
            KernelMode::Sampled => "heapprofd_kernel_sampled",
            KernelMode::Perf => "perf_record",
        }
    }
}

/// The runs of one mode.
#[derive(Default)]
struct ModeRuns {
    /// The loop's own seconds.
    loops: Vec<f64>,
    /// heapprofd: (objects, bytes) allocated in each run's final profile.
    totals: Vec<(u64, u64)>,
    failure: Option<String>,
}

/// The bpftrace script of `mode` for a command named `comm`.
fn bpftrace_script(mode: KernelMode, comm: &str) -> String {
    match mode {
        KernelMode::Floor => {
            let probes: Vec<String> = TRACEPOINTS
                .iter()
                .map(|t| format!("tracepoint:kmem:{t}"))
                .collect();
            format!("{} {{ }}", probes.join(","))
        }
        _ => format!(
            "tracepoint:kmem:kmalloc,tracepoint:kmem:kmem_cache_alloc /comm == \"{comm}\"/ {{ @[kstack] = count(); }}"
        ),
    }
}

/// Starts bpftrace with `script` and waits until its probes are attached.
fn start_bpftrace(script: &str) -> Result<Child> {
    let mut child = Command::new("bpftrace")
        .args(["-e", script])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("starting bpftrace")?;
    let stdout = child.stdout.take().context("bpftrace stdout")?;
    let mut lines = BufReader::new(stdout).lines();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match lines.next() {
            Some(Ok(line)) if line.starts_with("Attaching") => break,
            Some(Ok(_)) if Instant::now() < deadline => {}
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                bail!("bpftrace did not attach its probes");
            }
        }
    }
    // The rest of its output (the map at exit) is drained and dropped.
    std::thread::spawn(move || lines.for_each(drop));
    Ok(child)
}

/// The loop's seconds from the workload's "loop S" line in `output`.
fn loop_seconds(output: &str) -> Option<f64> {
    output
        .lines()
        .find_map(|l| l.strip_prefix("loop "))
        .and_then(|s| s.trim().parse().ok())
}

/// Runs the workload once in `mode`: the loop's seconds, and heapprofd's figures.
fn run_once(
    bench: &Bench,
    dir: &Path,
    program: &Path,
    cycles: u32,
    mode: KernelMode,
    extra: &[&str],
) -> Result<(f64, Option<DaemonStats>)> {
    let workload = [program.display().to_string(), cycles.to_string()];
    let comm = program
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let stats = bench.stats_path();
    let perf_data = dir.join("perf.data");
    let mut tracer = None;
    let mut command = match mode {
        KernelMode::Bare => Command::new(&workload[0]),
        KernelMode::Floor | KernelMode::Kstack => {
            tracer = Some(start_bpftrace(&bpftrace_script(mode, &comm))?);
            Command::new(&workload[0])
        }
        KernelMode::Exact | KernelMode::Sampled => {
            let mut c = Command::new(&bench.heapprofd);
            c.args(["--kernel", "--interval", "1h"]);
            if mode == KernelMode::Sampled {
                c.args(["--sample-rate", &SAMPLE_RATE.to_string()]);
            }
            c.args(extra)
                .arg("-o")
                .arg(dir.join("profiles"))
                .arg("--stats-json")
                .arg(&stats)
                .arg("--")
                .arg(&workload[0]);
            c
        }
        KernelMode::Perf => {
            let mut c = Command::new("perf");
            c.args(["record", "-q", "-g", "-o"]).arg(&perf_data);
            for t in TRACEPOINTS {
                c.args(["-e", &format!("kmem:{t}")]);
            }
            c.arg("--").arg(&workload[0]);
            c
        }
    };
    command.args(&workload[1..]);
    let output = command
        .stdin(Stdio::null())
        .stderr(Stdio::piped())
        .output()
        .with_context(|| format!("running {}", mode.name()));
    if let Some(child) = tracer {
        super::process::interrupt(&child);
        let _ = super::process::wait_with_usage(child.id());
    }
    let _ = std::fs::remove_file(&perf_data);
    let output = output?;
    if !output.status.success() {
        let err = String::from_utf8_lossy(&output.stderr);
        let tail: Vec<&str> = err.lines().rev().take(3).collect();
        bail!("exited with {}: {}", output.status, tail.join(" | "));
    }
    let seconds = loop_seconds(&String::from_utf8_lossy(&output.stdout))
        .context("the workload printed no loop time")?;
    let figures = match mode {
        KernelMode::Exact | KernelMode::Sampled => Some(DaemonStats::read(&stats)?),
        _ => None,
    };
    Ok((seconds, figures))
}

/// What the section reports besides its text.
pub(super) struct KernelReport {
    pub(super) json: Value,
    pub(super) goals: Vec<(&'static str, GoalFigure)>,
}

/// Runs the section and appends its part of summary.txt to `text`.
pub(super) fn section(
    bench: &Bench,
    runs: usize,
    quick: bool,
    text: &mut String,
) -> Result<KernelReport> {
    let dir = bench.dir.join("kernel");
    std::fs::create_dir_all(&dir).context("creating target/bench/kernel")?;
    let program = dir.join("bench_pipes");
    compile("bench_pipes.c", &program, &["-O2"])?;
    let cycles = if quick { CYCLES / 4 } else { CYCLES };
    step(&format!(
        "kernel mode: {cycles} pipe2/close cycles, {runs} runs of each mode, interleaved"
    ));
    let count = KernelMode::ALL.len();
    let mut results: Vec<ModeRuns> = KernelMode::ALL
        .iter()
        .map(|_| ModeRuns::default())
        .collect();
    for round in 0..runs {
        for i in 0..count {
            let index = (i + round) % count;
            let mode = KernelMode::ALL[index];
            let result = &mut results[index];
            if result.failure.is_some() {
                continue;
            }
            match run_once(bench, &dir, &program, cycles, mode, &[]) {
                Ok((seconds, figures)) => {
                    eprintln!(
                        "xtask:   round {} {:<38} {:8.3} s",
                        round + 1,
                        mode.name(),
                        seconds
                    );
                    result.loops.push(seconds);
                    result.totals.extend(figures.map(|f| {
                        (
                            f.final_profile.allocated_blocks,
                            f.final_profile.allocated_bytes,
                        )
                    }));
                }
                Err(err) => {
                    eprintln!("xtask:   {} failed: {err:#}", mode.name());
                    result.failure = Some(format!("{err:#}"));
                }
            }
        }
    }
    step("kernel mode: one more exact run with --bpf-stats (its programs' time per run)");
    let bpf_stats = run_once(
        bench,
        &dir,
        &program,
        cycles,
        KernelMode::Exact,
        &["--bpf-stats"],
    )
    .ok()
    .and_then(|(_, figures)| figures?.bpf_run_time);
    Ok(report(&results, runs, cycles, bpf_stats.as_ref(), text))
}

/// The section's text and JSON from its runs.
fn report(
    results: &[ModeRuns],
    runs: usize,
    cycles: u32,
    bpf_stats: Option<&super::figures::BpfRunTime>,
    text: &mut String,
) -> KernelReport {
    let median = |mode: KernelMode| spread(&results[mode as usize].loops).median;
    let bare = median(KernelMode::Bare);
    let added = |mode: KernelMode| median(mode) - bare;
    let floor = added(KernelMode::Floor);
    let kstack = added(KernelMode::Kstack);
    let _ = writeln!(
        text,
        "\n## Kernel mode: {cycles} pipe2/close cycles ({runs} runs; the loop's own time, median, min-max; added over bare; x kstack, x floor = added / their added)\n"
    );
    let modes = mode_lines(results, bare, kstack, floor, text);
    let totals = SampledTotals::of(results);
    totals.write(text);
    if let Some(stats) = bpf_stats {
        let _ = writeln!(text, "heapprofd --kernel exact, {}", stats.describe());
    }
    let goals = goals(
        added(KernelMode::Exact) / kstack,
        added(KernelMode::Sampled) / floor,
        totals.worst(),
    );
    KernelReport {
        json: json!({
            "cycles": cycles,
            "modes": modes,
            "exact_bytes": number(totals.exact_bytes),
            "exact_objects": number(totals.exact_objects),
            "sampled_bytes_error": totals.errors.iter().map(|&e| number(e)).collect::<Vec<_>>(),
            "sampled_objects_error": totals.object_errors.iter().map(|&e| number(e)).collect::<Vec<_>>(),
            "expected_standard_error": number(totals.standard_error),
        }),
        goals,
    }
}

/// Writes each mode's line (its loop time, added time over `bare` and that as a
/// multiple of `kstack`'s and `floor`'s added time, or its failure) to `text`;
/// returns the modes' JSON, by key.
fn mode_lines(
    results: &[ModeRuns],
    bare: f64,
    kstack: f64,
    floor: f64,
    text: &mut String,
) -> Map<String, Value> {
    let mut modes = Map::new();
    for mode in KernelMode::ALL {
        let r = &results[mode as usize];
        if r.loops.is_empty() {
            let failure = r.failure.as_deref().unwrap_or("no runs");
            let _ = writeln!(text, "{:<38} failed: {failure}", mode.name());
            modes.insert(mode.key().into(), json!({"failure": failure}));
            continue;
        }
        let s = spread(&r.loops);
        let add = s.median - bare;
        let _ = writeln!(
            text,
            "{:<38} {:>7.3} s ({:.3}-{:.3}), +{:.3} s, x kstack {:.2}, x floor {:.2}",
            mode.name(),
            s.median,
            s.min,
            s.max,
            add,
            add / kstack,
            add / floor
        );
        modes.insert(
            mode.key().into(),
            json!({
                "loop_s": r.loops.iter().map(|&v| number(v)).collect::<Vec<_>>(),
                "median_s": number(s.median),
                "added_s": number(add),
                "x_kstack": number(add / kstack),
                "x_floor": number(add / floor),
            }),
        );
    }
    modes
}

/// Sampled totals against the exact runs' median.
struct SampledTotals {
    /// The exact runs' median bytes allocated.
    exact_bytes: f64,
    /// The exact runs' median objects allocated.
    exact_objects: f64,
    /// Each sampled run's bytes as a relative error against `exact_bytes`.
    errors: Vec<f64>,
    /// Each sampled run's objects as a relative error against `exact_objects`.
    object_errors: Vec<f64>,
    /// The bytes' expected relative standard error, `sqrt(rate / total)`.
    standard_error: f64,
}

impl SampledTotals {
    /// The sampled runs' totals of `results` against the exact runs'.
    fn of(results: &[ModeRuns]) -> Self {
        let exact = &results[KernelMode::Exact as usize].totals;
        let sampled = &results[KernelMode::Sampled as usize].totals;
        let exact_bytes = spread(&exact.iter().map(|t| t.1 as f64).collect::<Vec<_>>()).median;
        let exact_objects = spread(&exact.iter().map(|t| t.0 as f64).collect::<Vec<_>>()).median;
        let errors: Vec<f64> = sampled
            .iter()
            .map(|t| t.1 as f64 / exact_bytes - 1.0)
            .collect();
        let object_errors: Vec<f64> = sampled
            .iter()
            .map(|t| t.0 as f64 / exact_objects - 1.0)
            .collect();
        let standard_error = (SAMPLE_RATE as f64 / exact_bytes).sqrt();
        Self {
            exact_bytes,
            exact_objects,
            errors,
            object_errors,
            standard_error,
        }
    }

    /// The largest bytes error, in either direction.
    fn worst(&self) -> f64 {
        self.errors.iter().fold(0.0f64, |w, e| w.max(e.abs()))
    }

    /// Writes the comparison's line to `text`.
    fn write(&self, text: &mut String) {
        let _ = writeln!(
            text,
            "\nsampled totals vs exact ({:.0} objects, {:.1} MB allocated): bytes {}, objects {}; expected standard error of the bytes sqrt(rate / total) = {:.1}%",
            self.exact_objects,
            self.exact_bytes / 1e6,
            percents(&self.errors),
            percents(&self.object_errors),
            self.standard_error * 100.0
        );
    }
}

/// Relative errors as signed percentages, space-separated (`+1.2% -0.4%`).
fn percents(errors: &[f64]) -> String {
    errors
        .iter()
        .map(|e| format!("{:+.1}%", e * 100.0))
        .collect::<Vec<_>>()
        .join(" ")
}

/// The section's goals: exact's added time as a multiple of bpftrace kstack's
/// (`x_kstack`), sampled's as a multiple of the floor's (`x_floor`), and the sampled
/// bytes' `worst` error.
fn goals(x_kstack: f64, x_floor: f64, worst: f64) -> Vec<(&'static str, GoalFigure)> {
    vec![
        (
            "pipes",
            GoalFigure {
                text: "kernel exact added / bpftrace kstack added".into(),
                value: x_kstack,
                limit: KSTACK_GOAL,
                relation: "at most",
                unit: "x",
            },
        ),
        (
            "pipes",
            GoalFigure {
                text: "kernel sampled 512KiB added / tracepoint floor added".into(),
                value: x_floor,
                limit: FLOOR_GOAL,
                relation: "at most",
                unit: "x",
            },
        ),
        (
            "pipes",
            GoalFigure {
                text: "kernel sampled 512KiB bytes, worst error vs exact".into(),
                value: worst * 100.0,
                limit: TOTALS_GOAL * 100.0,
                relation: "at most",
                unit: "%",
            },
        ),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_loop_line() {
        assert_eq!(loop_seconds("loop 1.2500\n"), Some(1.25));
        assert_eq!(loop_seconds("other\n"), None);
    }

    #[test]
    fn scripts_name_the_tracepoints_and_the_command() {
        let floor = bpftrace_script(KernelMode::Floor, "x");
        assert!(floor.contains("tracepoint:kmem:kmem_cache_free"));
        assert!(floor.ends_with("{ }"));
        let kstack = bpftrace_script(KernelMode::Kstack, "bench_pipes");
        assert!(kstack.contains("comm == \"bench_pipes\""));
        assert!(kstack.contains("@[kstack] = count()"));
    }
}
