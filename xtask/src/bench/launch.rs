//! The launch-mode section: `heapprofd [flags] -- CMD` against heaptrack (Debian's,
//! `heaptrack -o FILE CMD`) on the same commands, timed as a user sees them.
//!
//! Each run times the whole command, from starting the tool (or the bare command) to its
//! exit: heapprofd's and heaptrack's start-up and final write are part of it. Their fixed
//! costs are measured apart, on `true`, so that added times can also be given without
//! them. Modes are interleaved run by run in a rotated order, as in the other sections;
//! a mode that fails (heaptrack missing, a flag this heapprofd does not know) is reported
//! in the section and left out of the later rounds, never fatal to the benchmark.
//!
//! Workloads: the benchmark's C++ STL program (`g++ -O2`, no frame pointers), its "go"
//! line fed from a file at once, and Debian's sqlite3 inserting rows in one transaction
//! into an in-memory table with text columns, from a generated SQL script on stdin.

use std::{
    fmt::Write as _,
    fs::File,
    io::Read as _,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::Instant,
};

use anyhow::{Context as _, Result, bail};
use serde_json::{Map, Value, json};

use super::{
    Bench,
    figures::DaemonStats,
    summary::{GoalFigure, number, spread},
};
use crate::step;

/// Batches of the STL program (about 4,650 allocations each).
const STL_BATCHES: u32 = 400;
/// Rows sqlite3 inserts (about 23.5 allocations each).
const SQLITE_ROWS: u32 = 200_000;
/// The sampled mode's `--sample-rate` (512 KiB).
const SAMPLE_RATE: &str = "524288";
/// The goal: heapprofd exact launch's added time at most this multiple of heaptrack's.
const HEAPTRACK_GOAL: f64 = 1.5;

/// How a command is run.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum LaunchMode {
    Bare,
    Heaptrack,
    /// `heapprofd -- CMD`, the default `--preload auto` (the interposer).
    Exact,
    /// `heapprofd --preload off -- CMD`: uprobes on the allocator.
    PreloadOff,
    Sampled,
}

impl LaunchMode {
    const ALL: [LaunchMode; 5] = [
        LaunchMode::Bare,
        LaunchMode::Heaptrack,
        LaunchMode::Exact,
        LaunchMode::PreloadOff,
        LaunchMode::Sampled,
    ];

    fn name(self) -> &'static str {
        match self {
            LaunchMode::Bare => "bare",
            LaunchMode::Heaptrack => "heaptrack",
            LaunchMode::Exact => "heapprofd launch exact",
            LaunchMode::PreloadOff => "heapprofd launch --preload off",
            LaunchMode::Sampled => "heapprofd launch sampled 512KiB",
        }
    }

    /// Its name in summary.json, and its output directory's.
    fn key(self) -> &'static str {
        match self {
            LaunchMode::Bare => "bare",
            LaunchMode::Heaptrack => "heaptrack",
            LaunchMode::Exact => "heapprofd_launch_exact",
            LaunchMode::PreloadOff => "heapprofd_launch_preload_off",
            LaunchMode::Sampled => "heapprofd_launch_sampled",
        }
    }

    /// heapprofd's flags in this mode (before `-o DIR -- CMD`); `None`: not heapprofd.
    fn heapprofd_flags(self) -> Option<&'static [&'static str]> {
        match self {
            LaunchMode::Bare | LaunchMode::Heaptrack => None,
            LaunchMode::Exact => Some(&["--interval", "1h"]),
            LaunchMode::PreloadOff => Some(&["--interval", "1h", "--preload", "off"]),
            LaunchMode::Sampled => Some(&["--interval", "1h", "--sample-rate", SAMPLE_RATE]),
        }
    }

    /// Whether its profile counts every allocation.
    fn is_exact(self) -> bool {
        matches!(self, LaunchMode::Exact | LaunchMode::PreloadOff)
    }
}

/// A command run in every mode, its stdin read from a file.
struct LaunchWorkload {
    name: String,
    /// Its name in summary.json.
    key: &'static str,
    argv: Vec<String>,
    stdin: PathBuf,
}

/// The runs of one workload in one mode.
#[derive(Default)]
struct ModeRuns {
    walls: Vec<f64>,
    /// The largest allocation count heapprofd logged (exact modes only).
    allocations: Option<u64>,
    /// Why the mode failed, when it did (its later rounds are skipped).
    failure: Option<String>,
}

impl ModeRuns {
    fn median(&self) -> f64 {
        spread(&self.walls).median
    }
}

/// The section's workloads; writes their input files into `dir`.
fn workloads(dir: &Path, stl: &Path, quick: bool) -> Result<Vec<LaunchWorkload>> {
    let scale = if quick { 4 } else { 1 };
    let (batches, rows) = (STL_BATCHES / scale, SQLITE_ROWS / scale);
    let go = dir.join("go.txt");
    std::fs::write(&go, "go\n").context("writing the STL program's go line")?;
    let script = dir.join("inserts.sql");
    std::fs::write(&script, sql_script(rows)).context("writing the sqlite3 script")?;
    Ok(vec![
        LaunchWorkload {
            name: format!("C++ STL, g++ -O2 without frame pointers, {batches} batches"),
            key: "cxx_stl",
            argv: vec![stl.display().to_string(), batches.to_string()],
            stdin: go,
        },
        LaunchWorkload {
            name: format!("Debian sqlite3 :memory:, {rows} INSERTs in one transaction"),
            key: "sqlite3",
            argv: vec!["/usr/bin/sqlite3".into(), ":memory:".into()],
            stdin: script,
        },
    ])
}

/// One transaction of `rows` INSERTs of text rows of varied lengths, then a check query.
fn sql_script(rows: u32) -> String {
    let mut sql = String::from(
        "CREATE TABLE t(id INTEGER PRIMARY KEY, name TEXT NOT NULL, body TEXT);\nBEGIN;\n",
    );
    for i in 1..=rows {
        let body = "x".repeat((i % 97 + 3) as usize);
        let _ = writeln!(
            sql,
            "INSERT INTO t(name, body) VALUES('name-{i}', '{body}');"
        );
    }
    sql.push_str("COMMIT;\nSELECT count(*), sum(length(body)) FROM t;\n");
    sql
}

/// The command line of `argv` in `mode`, its tool writing into `out` (heapprofd its
/// figures into `stats`).
fn command(bench: &Bench, mode: LaunchMode, argv: &[String], out: &Path, stats: &Path) -> Command {
    let mut command = match (mode, mode.heapprofd_flags()) {
        (LaunchMode::Heaptrack, _) => {
            let mut c = Command::new("heaptrack");
            c.arg("-o").arg(out.join("x"));
            c
        }
        (_, Some(flags)) => {
            let mut c = Command::new(&bench.heapprofd);
            c.args(flags).arg("-o").arg(out);
            c.arg("--stats-json").arg(stats).arg("--");
            c.env("RUST_LOG", "info");
            c
        }
        (_, None) => Command::new(&argv[0]),
    };
    let skip = usize::from(mode == LaunchMode::Bare);
    command.args(&argv[skip..]);
    command
}

/// Runs `argv` once in `mode`: wall seconds, and the allocations heapprofd logged.
fn run_once(
    bench: &Bench,
    dir: &Path,
    workload: &LaunchWorkload,
    mode: LaunchMode,
) -> Result<(f64, Option<u64>)> {
    let out = dir.join(format!("{}-{}", workload.key, mode.key()));
    let _ = std::fs::remove_dir_all(&out);
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    let stdin = File::open(&workload.stdin)
        .with_context(|| format!("opening {}", workload.stdin.display()))?;
    let stats = bench.stats_path();
    let started = Instant::now();
    let mut child = command(bench, mode, &workload.argv, &out, &stats)
        .stdin(stdin)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting {}", mode.name()))?;
    let mut stderr = child.stderr.take().context("stderr of the run")?;
    let reader = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = stderr.read_to_string(&mut text);
        text
    });
    let status = child.wait()?;
    let wall = started.elapsed().as_secs_f64();
    let log: Vec<String> = reader
        .join()
        .unwrap_or_default()
        .lines()
        .map(str::to_owned)
        .collect();
    if !status.success() {
        let tail = log[log.len().saturating_sub(4)..].join(" | ");
        bail!("exited with {status}: {tail}");
    }
    if mode == LaunchMode::Heaptrack && heaptrack_output(&out).is_none() {
        bail!("heaptrack wrote no output file in {}", out.display());
    }
    let allocations = match mode.heapprofd_flags() {
        Some(_) => Some(DaemonStats::read(&stats)?.final_profile.allocated_blocks),
        None => None,
    };
    Ok((wall, allocations))
}

/// The file heaptrack wrote in `out` (`x.zst` or `x.gz`).
fn heaptrack_output(out: &Path) -> Option<PathBuf> {
    std::fs::read_dir(out)
        .ok()?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("x."))
        })
}

/// heaptrack's "calls to allocation functions" of its last run of `workload`.
fn heaptrack_count(dir: &Path, workload: &LaunchWorkload) -> Option<u64> {
    let out = dir.join(format!("{}-{}", workload.key, LaunchMode::Heaptrack.key()));
    let output = Command::new("heaptrack_print")
        .arg(heaptrack_output(&out)?)
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()
        .ok()?;
    let text = String::from_utf8_lossy(&output.stdout);
    text.lines()
        .find_map(|l| l.strip_prefix("calls to allocation functions: "))?
        .split(' ')
        .next()?
        .parse()
        .ok()
}

/// Runs `workload` `runs` times in every mode, interleaved in rotated order.
fn measure(bench: &Bench, dir: &Path, workload: &LaunchWorkload, runs: usize) -> Vec<ModeRuns> {
    let count = LaunchMode::ALL.len();
    let mut results: Vec<ModeRuns> = LaunchMode::ALL
        .iter()
        .map(|_| ModeRuns::default())
        .collect();
    for round in 0..runs {
        for i in 0..count {
            let index = (i + round) % count;
            let mode = LaunchMode::ALL[index];
            let result = &mut results[index];
            if result.failure.is_some() {
                continue;
            }
            match run_once(bench, dir, workload, mode) {
                Ok((wall, allocations)) => {
                    eprintln!(
                        "xtask:   round {} {:<34} {:8.3} s",
                        round + 1,
                        mode.name(),
                        wall
                    );
                    result.walls.push(wall);
                    result.allocations = result.allocations.max(allocations);
                }
                Err(err) => {
                    eprintln!("xtask:   {} failed: {err:#}", mode.name());
                    result.failure = Some(format!("{err:#}"));
                }
            }
        }
    }
    results
}

/// Each mode's fixed cost: its median on `true` minus bare `true`'s (0 for bare).
fn start_costs(startup: &[ModeRuns]) -> Vec<f64> {
    let bare = startup[0].median();
    startup.iter().map(|r| r.median() - bare).collect()
}

/// Appends the start-up table to `text`; returns its JSON object.
fn report_startup(startup: &[ModeRuns], runs: usize, text: &mut String) -> Value {
    let costs = start_costs(startup);
    let _ = writeln!(
        text,
        "\n## Launch mode: fixed start-up and exit cost, on `true` ({runs} runs; median, min-max, and over bare `true`)\n"
    );
    let mut json = Map::new();
    for (index, mode) in LaunchMode::ALL.iter().enumerate() {
        let s = spread(&startup[index].walls);
        match &startup[index].failure {
            Some(failure) if startup[index].walls.is_empty() => {
                let _ = writeln!(text, "{:<34} failed: {failure}", mode.name());
            }
            _ => {
                let _ = writeln!(
                    text,
                    "{:<34} {:>8.3} s ({:.3}-{:.3}), +{:.3} s",
                    mode.name(),
                    s.median,
                    s.min,
                    s.max,
                    costs[index]
                );
            }
        }
        json.insert(
            mode.key().to_owned(),
            json!({
                "median_s": number(s.median),
                "added_s": number(costs[index]),
                "failed": startup[index].failure,
            }),
        );
    }
    Value::Object(json)
}

/// The figures of one mode of a workload.
struct Figures {
    added_s: f64,
    per_alloc: f64,
    per_alloc_without_start: f64,
    to_heaptrack: f64,
    to_heaptrack_without_start: f64,
}

/// Figures of every mode from the medians, the allocation count and the start costs.
fn figures(results: &[ModeRuns], allocations: u64, costs: &[f64]) -> Vec<Figures> {
    let bare = results[0].median();
    let heaptrack = LaunchMode::ALL
        .iter()
        .position(|m| *m == LaunchMode::Heaptrack)
        .unwrap_or(1);
    let added = |i: usize| results[i].median() - bare;
    let without = |i: usize| added(i) - costs.get(i).copied().unwrap_or(f64::NAN);
    let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { f64::NAN };
    (0..results.len())
        .map(|i| Figures {
            added_s: added(i),
            per_alloc: added(i) / allocations as f64 * 1e6,
            per_alloc_without_start: without(i) / allocations as f64 * 1e6,
            // Bare has no ratio: its added time is zero by definition.
            to_heaptrack: if i == 0 {
                f64::NAN
            } else {
                ratio(added(i), added(heaptrack))
            },
            to_heaptrack_without_start: if i == 0 {
                f64::NAN
            } else {
                ratio(without(i), without(heaptrack))
            },
        })
        .collect()
}

/// A figure, or `-` when there is none.
fn shown(value: f64, precision: usize, suffix: &str) -> String {
    if value.is_finite() {
        format!("{value:.precision$}{suffix}")
    } else {
        "-".into()
    }
}

/// Appends one workload's table to `text`; returns its JSON object and its goal.
fn report_workload(
    workload: &LaunchWorkload,
    results: &[ModeRuns],
    allocations: (Option<u64>, Option<u64>),
    costs: &[f64],
    text: &mut String,
) -> (Value, GoalFigure) {
    let (counted, by_heaptrack) = allocations;
    let count = counted.or(by_heaptrack).unwrap_or(0);
    write_workload_heading(text, workload, counted, by_heaptrack);
    let figures = figures(results, count, costs);
    let mut json = Map::new();
    for (index, mode) in LaunchMode::ALL.iter().enumerate() {
        let (runs, f) = (&results[index], &figures[index]);
        let _ = writeln!(text, "{}", mode_line(*mode, runs, f));
        json.insert(mode.key().to_owned(), mode_json(runs, f));
    }
    let goal = write_goal(text, &figures);
    let object = json!({
        "name": workload.name,
        "key": workload.key,
        "allocations": counted,
        "allocations_heaptrack": by_heaptrack,
        "modes": json,
        "goal": goal.json(workload.key),
    });
    (object, goal)
}

/// Appends a workload's heading (with the allocations heapprofd and heaptrack
/// counted), what its columns mean and their heads to `text`.
fn write_workload_heading(
    text: &mut String,
    workload: &LaunchWorkload,
    counted: Option<u64>,
    by_heaptrack: Option<u64>,
) {
    let show_count = |n: Option<u64>| n.map_or("-".into(), |n| n.to_string());
    let _ = writeln!(
        text,
        "\n## Launch mode: {} ({} allocations counted by heapprofd exact, {} calls to allocation functions by heaptrack_print)\n",
        workload.name,
        show_count(counted),
        show_count(by_heaptrack)
    );
    let _ = writeln!(
        text,
        "added s: median - bare's median, whole command (tool start-up and final write included); us/alloc: added / allocations; x heaptrack: added / heaptrack's added; w/o start: the same less each mode's fixed cost on `true`\n"
    );
    let _ = writeln!(
        text,
        "{:<34} {:>9} {:>9} {:>9} {:>9} {:>9} {:>11} {:>13} {:>13}",
        "mode",
        "median s",
        "min s",
        "max s",
        "added s",
        "us/alloc",
        "x heaptrack",
        "w/o start us",
        "w/o start x ht"
    );
}

/// One mode's table row (or why it failed, when it has no run).
fn mode_line(mode: LaunchMode, runs: &ModeRuns, f: &Figures) -> String {
    if runs.walls.is_empty() {
        let failure = runs.failure.as_deref().unwrap_or("no run");
        return format!("{:<34} failed: {failure}", mode.name());
    }
    let s = spread(&runs.walls);
    format!(
        "{:<34} {:>9.3} {:>9.3} {:>9.3} {:>9} {:>9} {:>11} {:>13} {:>13}",
        mode.name(),
        s.median,
        s.min,
        s.max,
        shown(f.added_s, 3, ""),
        shown(f.per_alloc, 3, ""),
        shown(f.to_heaptrack, 2, "x"),
        shown(f.per_alloc_without_start, 3, ""),
        shown(f.to_heaptrack_without_start, 2, "x")
    )
}

/// Appends the goal's lines (heapprofd exact's added time against heaptrack's, with
/// and without the start-up costs) to `text`; returns the goal.
fn write_goal(text: &mut String, figures: &[Figures]) -> GoalFigure {
    let exact = LaunchMode::ALL
        .iter()
        .position(|m| *m == LaunchMode::Exact)
        .unwrap_or(2);
    let goal = GoalFigure {
        text: "launch mode, heapprofd exact added time (start-up included) / heaptrack's".into(),
        value: figures[exact].to_heaptrack,
        limit: HEAPTRACK_GOAL,
        relation: "at most",
        unit: "x",
    };
    let _ = writeln!(text, "\ngoal: {}", goal.describe());
    let _ = writeln!(
        text,
        "without the fixed start-up costs (the `true` table): exact / heaptrack {}",
        shown(figures[exact].to_heaptrack_without_start, 2, "x")
    );
    goal
}

/// One mode's object in summary.json.
fn mode_json(runs: &ModeRuns, f: &Figures) -> Value {
    let s = spread(&runs.walls);
    json!({
        "runs": runs.walls.len(),
        "median_s": number(s.median),
        "min_s": number(s.min),
        "max_s": number(s.max),
        "added_s": number(f.added_s),
        "added_us_per_alloc": number(f.per_alloc),
        "ratio_to_heaptrack": number(f.to_heaptrack),
        "added_us_per_alloc_without_start": number(f.per_alloc_without_start),
        "ratio_to_heaptrack_without_start": number(f.to_heaptrack_without_start),
        "failed": runs.failure,
    })
}

/// What the section gives the summary.
pub struct LaunchReport {
    /// Its JSON object.
    pub json: Value,
    /// Its goals, with the workloads' keys.
    pub goals: Vec<(&'static str, GoalFigure)>,
}

/// Runs the section; appends its tables to `text`.
pub fn section(
    bench: &Bench,
    stl: &Path,
    runs: usize,
    quick: bool,
    text: &mut String,
) -> Result<LaunchReport> {
    let dir = bench.dir.join("launch");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let workloads = workloads(&dir, stl, quick)?;
    let startup_workload = LaunchWorkload {
        name: "true".into(),
        key: "true",
        argv: vec!["/bin/true".into()],
        stdin: workloads[0].stdin.clone(),
    };
    step(&format!(
        "launch mode: start-up cost on `true`, {runs} runs x {} modes",
        LaunchMode::ALL.len()
    ));
    let startup = measure(bench, &dir, &startup_workload, runs);
    let startup_json = report_startup(&startup, runs, text);
    let costs = start_costs(&startup);
    let (mut json, mut goals) = (Vec::new(), Vec::new());
    for workload in &workloads {
        step(&format!(
            "launch mode: {}, {runs} runs x {} modes",
            workload.name,
            LaunchMode::ALL.len()
        ));
        let results = measure(bench, &dir, workload, runs);
        let counted = LaunchMode::ALL
            .iter()
            .zip(&results)
            .filter(|(mode, _)| mode.is_exact())
            .filter_map(|(_, r)| r.allocations)
            .max();
        let allocations = (counted, heaptrack_count(&dir, workload));
        let (object, goal) = report_workload(workload, &results, allocations, &costs, text);
        json.push(object);
        goals.push((workload.key, goal));
    }
    Ok(LaunchReport {
        json: json!({"start_up": startup_json, "workloads": json}),
        goals,
    })
}
