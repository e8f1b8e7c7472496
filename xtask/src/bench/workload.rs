//! One workload of the benchmark: its rounds under every mode, then its section of the
//! summary (the modes' table, the goals, frames and unwind tables, where the time goes)
//! and its entry of summary.json.

use std::{collections::BTreeMap, fmt::Write as _};

use anyhow::{Context as _, Result};
use serde_json::{Map, Value, json};

use super::{
    Bench, Goal, Mode, Options, Run, Workload,
    figures::{UnwindTables, frames_per_allocation},
    process::foreign_tracers,
    summary::{GoalFigure, Summary, number, spread},
};
use crate::step;

/// The runs of one workload, by mode, and the other tracers seen before them.
struct Rounds {
    runs: BTreeMap<Mode, Vec<Run>>,
    /// Runs before which other tracers were active.
    disturbed: usize,
    /// The first other tracers seen.
    foreign_seen: Vec<String>,
}

/// The wall times of a workload's runs, as time added per allocation over the bare runs.
struct Timings<'a> {
    runs: &'a BTreeMap<Mode, Vec<Run>>,
    /// Allocations heapprofd counted (the most of its runs).
    allocations: u64,
    /// Median wall time of the bare runs.
    bare: f64,
}

impl<'a> Timings<'a> {
    fn new(runs: &'a BTreeMap<Mode, Vec<Run>>) -> Result<Self> {
        let allocations = runs[&Mode::Heapprofd]
            .iter()
            .filter_map(|r| r.allocations)
            .max()
            .context("heapprofd did not report its allocation count")?;
        let mut timings = Timings {
            runs,
            allocations,
            bare: 0.0,
        };
        timings.bare = spread(&timings.walls(Mode::Bare)).median;
        Ok(timings)
    }

    fn walls(&self, mode: Mode) -> Vec<f64> {
        self.runs[&mode].iter().map(|r| r.wall).collect()
    }

    /// Microseconds added per allocation: (median - bare median) / allocations.
    fn added(&self, mode: Mode) -> f64 {
        (spread(&self.walls(mode)).median - self.bare) / self.allocations as f64 * 1e6
    }

    /// `added` as a multiple of the trap floor's.
    fn to_floor(&self, mode: Mode) -> f64 {
        let floor = self.added(Mode::Floor);
        // A floor that noise made zero or negative gives no ratio.
        if floor > 0.0 {
            self.added(mode) / floor
        } else {
            f64::NAN
        }
    }
}

/// Runs `workload` under every mode, `options.runs` rounds, and adds its section to
/// `summary`.
pub(super) fn measure(
    bench: &Bench,
    workload: &Workload,
    options: &Options,
    summary: &mut Summary,
) -> Result<()> {
    step(&format!(
        "{}: {} runs x {} modes",
        workload.name,
        options.runs,
        Mode::ALL.len()
    ));
    let rounds = run_rounds(bench, workload, options.runs)?;
    let timings = Timings::new(&rounds.runs)?;
    let json_modes = write_mode_table(workload, options.runs, &rounds, &timings, summary);
    let exact = timings.added(Mode::Heapprofd);
    let ratio_bpftrace = exact / timings.added(Mode::Bpftrace);
    let ratio_empty = exact / timings.added(Mode::EmptyProbes);
    let ratio_sampled_empty =
        timings.added(Mode::HeapprofdSampled) / timings.added(Mode::EmptyProbes);
    let goals = goals(workload, &timings);
    write_goals(workload, &goals, summary);
    let stacks_only = timings.to_floor(Mode::StacksOnly);
    write_least_cost(
        workload,
        stacks_only,
        timings.to_floor(Mode::Heapprofd),
        summary,
    );
    let text = &mut summary.text;
    let _ = writeln!(
        text,
        "\nheapprofd exact / bpftrace memleak: {ratio_bpftrace:.3}x   heapprofd exact / empty entry probes: {ratio_empty:.3}x   sampled / empty entry probes: {ratio_sampled_empty:.3}x"
    );
    let profiles = write_profile_figures(workload, &rounds.runs, summary);
    let json_stats = write_where_time_goes(bench, workload, &timings, &mut summary.text)?;
    summary.json_workloads.push(json!({
        "name": workload.name,
        "key": workload.key,
        "allocations": timings.allocations,
        "runs": options.runs,
        "modes": json_modes,
        "ratio_exact_to_bpftrace": number(ratio_bpftrace),
        "ratio_exact_to_empty_probes": number(ratio_empty),
        "ratio_sampled_to_empty_probes": number(ratio_sampled_empty),
        "ratio_stacks_only_to_floor": number(stacks_only),
        "runs_with_other_tracers": rounds.disturbed,
        "single_stepped": profiles.single_stepped,
        "goals": goals.iter().map(|g| g.json(workload.key)).collect::<Vec<_>>(),
        "frames_per_alloc": {
            "heapprofd_exact": number(profiles.frames_cfi.unwrap_or(f64::NAN)),
            "heapprofd_exact_fp": number(profiles.frames_fp.unwrap_or(f64::NAN)),
        },
        "unwind_tables": profiles.tables.map(|t| t.tables().json()),
        "unwind_tables_line": profiles.tables.map(|t| t.line()),
        "bpf_stats": json_stats,
    }));
    Ok(())
}

/// `runs` rounds of every mode; each round starts one mode later, so that no mode
/// always follows the same one.
fn run_rounds(bench: &Bench, workload: &Workload, runs: usize) -> Result<Rounds> {
    let mut rounds = Rounds {
        runs: BTreeMap::new(),
        disturbed: 0,
        foreign_seen: Vec::new(),
    };
    for round in 0..runs {
        for i in 0..Mode::ALL.len() {
            let mode = Mode::ALL[(i + round) % Mode::ALL.len()];
            let foreign = foreign_tracers();
            if !foreign.is_empty() {
                eprintln!(
                    "xtask:   warning: other tracers are active: {}",
                    foreign.join(", ")
                );
                rounds.disturbed += 1;
                if rounds.foreign_seen.is_empty() {
                    rounds.foreign_seen = foreign;
                }
            }
            let run = bench
                .run(workload, mode)
                .with_context(|| format!("{} under {}", workload.name, mode.name()))?;
            eprintln!(
                "xtask:   round {} {:<30} {:8.3} s",
                round + 1,
                mode.name(),
                run.wall
            );
            rounds.runs.entry(mode).or_default().push(run);
        }
    }
    Ok(rounds)
}

/// The workload's heading and its table of modes (with a warning when other tracers
/// were active); returns the modes' entries of summary.json.
fn write_mode_table(
    workload: &Workload,
    runs: usize,
    rounds: &Rounds,
    timings: &Timings,
    summary: &mut Summary,
) -> Map<String, Value> {
    write_table_heading(&mut summary.text, workload, timings.allocations);
    if rounds.disturbed > 0 {
        warn_disturbed(workload, runs, rounds, summary);
    }
    let mut json_modes = Map::new();
    for mode in Mode::ALL {
        let (line, json) = mode_row(mode, &rounds.runs[&mode], timings);
        let _ = writeln!(summary.text, "{line}");
        json_modes.insert(mode.key().to_owned(), json);
    }
    json_modes
}

/// Appends the workload's heading and its table's column heads to `text`.
fn write_table_heading(text: &mut String, workload: &Workload, allocations: u64) {
    let _ = writeln!(
        text,
        "\n## {} ({allocations} allocations counted by heapprofd)\n",
        workload.name
    );
    let _ = writeln!(
        text,
        "{:<32} {:>9} {:>9} {:>9} {:>14} {:>8} {:>8} {:>10} {:>9}",
        "mode",
        "median s",
        "min s",
        "max s",
        "added us/alloc",
        "x floor",
        "start s",
        "daemon cpu",
        "peak RSS"
    );
}

/// Appends the warning that other tracers were active before some of the runs, and
/// keeps it among the summary's warnings.
fn warn_disturbed(workload: &Workload, runs: usize, rounds: &Rounds, summary: &mut Summary) {
    let warning = format!(
        "WARNING: other tracers were active before {} of {} runs (first seen: {}); they trap this workload's allocator calls too, bare runs included: these figures do not measure heapprofd alone",
        rounds.disturbed,
        runs * Mode::ALL.len(),
        rounds.foreign_seen.join(", ")
    );
    let _ = writeln!(summary.text, "{warning}\n");
    summary
        .warnings
        .push(format!("{}: {warning}", workload.key));
}

/// The table row and summary.json entry of `mode`, from its runs `mode_runs`.
fn mode_row(mode: Mode, mode_runs: &[Run], timings: &Timings) -> (String, Value) {
    let s = spread(&timings.walls(mode));
    let cpu: Vec<f64> = mode_runs.iter().filter_map(|r| r.daemon_cpu).collect();
    let rss = mode_runs.iter().filter_map(|r| r.daemon_rss_kib).max();
    let cpu_median = spread(&cpu).median;
    let start: Vec<f64> = mode_runs.iter().filter_map(|r| r.start).collect();
    let start_median = spread(&start).median;
    let ratio = if mode == Mode::Bare {
        f64::NAN
    } else {
        timings.to_floor(mode)
    };
    let line = format!(
        "{:<32} {:>9.3} {:>9.3} {:>9.3} {:>14.3} {:>8} {:>8} {:>10} {:>9}",
        mode.name(),
        s.median,
        s.min,
        s.max,
        timings.added(mode),
        if ratio.is_finite() {
            format!("{ratio:.2}x")
        } else {
            "-".into()
        },
        if start.is_empty() {
            "-".into()
        } else {
            format!("{start_median:.2}")
        },
        if cpu.is_empty() {
            "-".into()
        } else {
            format!("{cpu_median:.3} s")
        },
        rss.map_or("-".into(), |r| format!("{} MiB", r / 1024)),
    );
    let json = json!({
        "median_s": number(s.median),
        "min_s": number(s.min),
        "max_s": number(s.max),
        "added_us_per_alloc": number(timings.added(mode)),
        "ratio_to_floor": number(ratio),
        "start_s": number(start_median),
        "daemon_cpu_s": number(cpu_median),
        "daemon_peak_rss_kib": rss,
    });
    (line, json)
}

/// The goals the workload is measured against, with this run's figures.
fn goals(workload: &Workload, timings: &Timings) -> Vec<GoalFigure> {
    match workload.goal {
        Goal::None => Vec::new(),
        Goal::Shallow => vec![GoalFigure {
            text: "shallow stacks, heapprofd exact / trap floor".into(),
            value: timings.to_floor(Mode::Heapprofd),
            limit: 1.25,
            relation: "at most",
            unit: "x",
        }],
        Goal::Deep => vec![
            GoalFigure {
                text:
                    "deep stacks, full CFI unwinding (--unwind auto), heapprofd exact / trap floor"
                        .into(),
                value: timings.to_floor(Mode::Heapprofd),
                limit: 1.25,
                relation: "at most",
                unit: "x",
            },
            GoalFigure {
                text: "deep stacks, heapprofd exact added time per allocation".into(),
                value: timings.added(Mode::Heapprofd),
                limit: timings.added(Mode::Bpftrace),
                relation: "below bpftrace memleak's",
                unit: " us",
            },
        ],
    }
}

/// The goals, next to the figures, and in the summary's list of goals.
fn write_goals(workload: &Workload, goals: &[GoalFigure], summary: &mut Summary) {
    if !goals.is_empty() {
        let _ = writeln!(summary.text);
    }
    for goal in goals {
        let line = goal.describe();
        let _ = writeln!(summary.text, "goal: {line}");
        let _ = writeln!(summary.goals_text, "{}: {line}", workload.key);
        summary.json_goals.push(goal.json(workload.key));
    }
}

/// The least an exact profile of stacks costs (`--stacks-only`: calls matched and
/// stacks found, nothing counted), as a multiple of the trap floor, beside heapprofd
/// exact's: the goals' 1.25x is to be read against it.
fn write_least_cost(workload: &Workload, stacks_only: f64, exact: f64, summary: &mut Summary) {
    let line = format!(
        "stacks found, nothing counted (--stacks-only) / trap floor: {stacks_only:.2}x; \
         heapprofd exact: {exact:.2}x, its counting {:.2}x of the floor",
        exact - stacks_only
    );
    let _ = writeln!(summary.text, "least cost: {line}");
    let _ = writeln!(summary.goals_text, "{} (least cost): {line}", workload.key);
}

/// What heapprofd's own output says about a workload.
struct ProfileFigures {
    /// Mean frames per allocation of the last profile, CFI and frame pointers.
    frames_cfi: Option<f64>,
    frames_fp: Option<f64>,
    /// Most probes the kernel single-steps at the default placement, over the runs.
    single_stepped: usize,
    /// heapprofd exact's unwind tables at the end of its last run.
    tables: Option<UnwindTables>,
}

/// Frames per allocation, single-stepped probes and the unwind tables, written to the
/// workload's section (the tables also to the summary's table of them).
fn write_profile_figures(
    workload: &Workload,
    runs: &BTreeMap<Mode, Vec<Run>>,
    summary: &mut Summary,
) -> ProfileFigures {
    let text = &mut summary.text;
    // Frames per allocation, from the last profile of each unwinding method.
    let frames = |mode: Mode| {
        runs[&mode]
            .iter()
            .rev()
            .find_map(|r| r.profile.as_deref())
            .and_then(frames_per_allocation)
    };
    let (frames_cfi, frames_fp) = (frames(Mode::Heapprofd), frames(Mode::HeapprofdFp));
    let show = |f: Option<f64>| f.map_or("-".into(), |f| format!("{f:.1}"));
    let _ = writeln!(
        text,
        "mean frames per allocation (final profile, allocator frame included): exact --unwind auto {}, --unwind fp {}",
        show(frames_cfi),
        show(frames_fp)
    );

    // Probes the kernel single-steps (~10x an emulated one) at the default
    // placement: expected none (`--probe-placement entry` has them on purpose).
    let single_stepped = Mode::ALL
        .iter()
        .filter(|mode| !mode.is_bpftrace() && **mode != Mode::HeapprofdEntry)
        .flat_map(|mode| runs[mode].iter().filter_map(|r| r.single_stepped))
        .max()
        .unwrap_or(0);
    let _ = writeln!(
        text,
        "single-stepped probes at the default placement (heapprofd's warnings): {single_stepped}"
    );

    // The unwind tables heapprofd exact built for this process.
    let tables = runs[&Mode::Heapprofd]
        .iter()
        .rev()
        .find_map(|r| r.unwind_tables);
    let tables_shown = tables.map_or_else(|| "no unwind tables counted".into(), |t| t.line());
    let _ = writeln!(text, "heapprofd exact: {tables_shown}");
    let _ = writeln!(summary.tables_text, "{:<10} {tables_shown}", workload.key);
    ProfileFigures {
        frames_cfi,
        frames_fp,
        single_stepped,
        tables,
    }
}

/// Where the time goes: the BPF programs' own run time per allocation, from one more
/// run of the floor and of heapprofd exact (CFI, frame pointers) with `--bpf-stats`;
/// returns their entries of summary.json.
fn write_where_time_goes(
    bench: &Bench,
    workload: &Workload,
    timings: &Timings,
    text: &mut String,
) -> Result<Map<String, Value>> {
    let stats_modes = [Mode::Floor, Mode::Heapprofd, Mode::HeapprofdFp];
    let mut json_stats = Map::new();
    let mut bpf_ns = BTreeMap::new();
    for mode in stats_modes {
        let run_time = bench
            .bpf_stats(workload, mode)
            .with_context(|| format!("{} under {} --bpf-stats", workload.name, mode.name()))?;
        let ns = run_time.total_ns as f64 / timings.allocations as f64;
        let stats = run_time.describe();
        bpf_ns.insert(mode, ns);
        let _ = writeln!(text, "--bpf-stats, {}: {stats}", mode.name());
        json_stats.insert(
            mode.key().to_owned(),
            json!({"line": stats, "bpf_ns_per_alloc": number(ns)}),
        );
    }
    let wall_ns = |mode: Mode| timings.added(mode) * 1e3;
    let over_floor = |mode: Mode| {
        format!(
            "{} +{:.0} wall, +{:.0} BPF",
            mode.name(),
            wall_ns(mode) - wall_ns(Mode::Floor),
            bpf_ns[&mode] - bpf_ns[&Mode::Floor]
        )
    };
    let _ = writeln!(
        text,
        "where the time goes (ns per allocation; wall: medians above, BPF: the --bpf-stats runs): floor {:.0} wall, of which {:.0} BPF, so ~{:.0} in the traps; over the floor: {}; {}",
        wall_ns(Mode::Floor),
        bpf_ns[&Mode::Floor],
        wall_ns(Mode::Floor) - bpf_ns[&Mode::Floor],
        over_floor(Mode::Heapprofd),
        over_floor(Mode::HeapprofdFp)
    );
    Ok(json_stats)
}
