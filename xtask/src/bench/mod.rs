//! `cargo xtask bench`: what heapprofd costs, against baselines measured in the same run.
//!
//! Each workload waits on stdin until the tool under test has attached to it (`--pid`,
//! `bpftrace -p`), then the clock runs from "go" to the workload's exit. Modes are
//! interleaved run by run (each round in a rotated order) so that drift on a noisy
//! machine hits all of them alike; medians and ranges are reported, and ratios only
//! between medians of one run. Other tracers active between runs (a test suite's
//! `heapprofd --all` traps the bare runs too) are detected and reported as warnings.
//!
//! The trap floor is heapprofd itself with `--empty-programs`: the same probes at the
//! same spots, with BPF programs that return at once. Every mode's added time per
//! allocation is also given as a multiple of the floor's, and the goals (figures, not
//! pass/fail) are stated against it, beside the least cost: `--stacks-only`, whose
//! programs find every allocation's stack and count nothing. Two workloads have deep stacks without frame
//! pointers (C++ STL code built `g++ -O2`, Debian's python3), where only CFI unwinding
//! finds the callers; for each workload the mean frames per allocation of heapprofd's
//! profiles (CFI and frame pointers) and the unwind tables' BPF map memory are given,
//! and a last section times the unwind-table build of the machine's largest library.
//! Two more sections: a real service (redis/: redis-server attached to and launched)
//! and launch mode (launch.rs: whole commands under `heapprofd -- CMD` against
//! heaptrack, whose added time is the baseline there).

use std::{
    cell::Cell,
    fmt::Write as _,
    io::Write as _,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use anyhow::{Context as _, Result, bail};

use self::{
    figures::{BpfRunTime, DaemonStats, UnwindTables},
    process::{
        Daemon, interrupt, lines_of, load_average, note_foreign_tracers, send_go, start_workload,
        wait_until_ready, wait_with_usage,
    },
    programs::{Programs, ensure_gxx, ensure_tracefs},
    summary::{GoalFigure, SectionsJson, Summary, write_summary},
    tool::Tool,
};
use crate::{
    profiles_json::{self, Follower, Kind, Written},
    workspace_root,
};

mod baselines;
mod figures;
mod kernel;
mod launch;
mod library;
mod nginx;
mod process;
mod programs;
mod redis;
mod sections;
mod summary;
mod tool;
mod workload;

/// Settings of a benchmark run.
pub struct Options {
    /// Repetitions of each workload x mode.
    pub runs: usize,
    /// Smaller workloads and a shorter daemon-load run.
    pub quick: bool,
    /// Only the workloads with these keys (`pairs`, `churn`, ...); empty: all.
    pub only: Vec<String>,
}

#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
enum Mode {
    Bare,
    EmptyProbes,
    Bpftrace,
    /// heapprofd --empty-programs: the trap floor.
    Floor,
    /// heapprofd --stacks-only: calls matched and stacks found, nothing counted.
    StacksOnly,
    HeapprofdEntry,
    Heapprofd,
    HeapprofdNoPeak,
    HeapprofdFp,
    HeapprofdSampled,
}

impl Mode {
    const ALL: [Mode; 10] = [
        Mode::Bare,
        Mode::EmptyProbes,
        Mode::Bpftrace,
        Mode::Floor,
        Mode::StacksOnly,
        Mode::HeapprofdEntry,
        Mode::Heapprofd,
        Mode::HeapprofdNoPeak,
        Mode::HeapprofdFp,
        Mode::HeapprofdSampled,
    ];

    fn name(self) -> &'static str {
        match self {
            Mode::Bare => "bare",
            Mode::EmptyProbes => "empty entry probes (bpftrace)",
            Mode::Bpftrace => "bpftrace memleak",
            Mode::Floor => "trap floor (--empty-programs)",
            Mode::StacksOnly => "stacks only (--stacks-only)",
            Mode::HeapprofdEntry => "heapprofd exact, entry probes",
            Mode::Heapprofd => "heapprofd exact",
            Mode::HeapprofdNoPeak => "heapprofd exact --no-peak",
            Mode::HeapprofdFp => "heapprofd exact --unwind fp",
            Mode::HeapprofdSampled => "heapprofd sampled 512KiB",
        }
    }

    fn key(self) -> &'static str {
        match self {
            Mode::Bare => "bare",
            Mode::EmptyProbes => "empty_entry_probes",
            Mode::Bpftrace => "bpftrace_memleak",
            Mode::Floor => "heapprofd_empty_programs",
            Mode::StacksOnly => "heapprofd_stacks_only",
            Mode::HeapprofdEntry => "heapprofd_exact_entry",
            Mode::Heapprofd => "heapprofd_exact",
            Mode::HeapprofdNoPeak => "heapprofd_exact_no_peak",
            Mode::HeapprofdFp => "heapprofd_exact_fp",
            Mode::HeapprofdSampled => "heapprofd_sampled",
        }
    }

    /// heapprofd's flags in this mode; `None` for the modes that do not run heapprofd.
    /// Every mode says `--inject off`: they measure the allocator's probes against the
    /// trap floor (the same probes), whatever `--pid` does by default (it joins a
    /// process in-process since `--inject auto`).
    fn heapprofd_flags(self) -> Option<&'static [&'static str]> {
        match self {
            Mode::Bare | Mode::EmptyProbes | Mode::Bpftrace => None,
            Mode::Floor => Some(&["--interval", "1h", "--inject", "off", "--empty-programs"]),
            Mode::StacksOnly => Some(&["--interval", "1h", "--inject", "off", "--stacks-only"]),
            Mode::HeapprofdEntry => Some(&[
                "--interval",
                "1h",
                "--inject",
                "off",
                "--probe-placement",
                "entry",
            ]),
            Mode::Heapprofd => Some(&["--interval", "1h", "--inject", "off"]),
            Mode::HeapprofdNoPeak => Some(&["--interval", "1h", "--inject", "off", "--no-peak"]),
            Mode::HeapprofdFp => Some(&["--interval", "1h", "--inject", "off", "--unwind", "fp"]),
            Mode::HeapprofdSampled => Some(&[
                "--interval",
                "1h",
                "--inject",
                "off",
                "--sample-rate",
                "512KiB",
            ]),
        }
    }

    fn is_bpftrace(self) -> bool {
        matches!(self, Mode::EmptyProbes | Mode::Bpftrace)
    }
}

/// What a workload's figures are held against (see the goals).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Goal {
    /// No stated goal.
    None,
    /// Shallow stacks: heapprofd exact at most 1.25x the trap floor.
    Shallow,
    /// Deep stacks without frame pointers, full CFI unwinding: heapprofd exact at most
    /// 1.25x the trap floor, as shallow ones (remembered walks keep deep stacks from
    /// costing more), and cheaper than the bpftrace memleak-style script.
    Deep,
}

/// A workload: a command that reads one line on stdin before it starts.
struct Workload {
    name: &'static str,
    /// Its name in summary.json.
    key: &'static str,
    command: Vec<String>,
    goal: Goal,
}

impl Workload {
    /// Its command line, output discarded.
    fn command(&self) -> Command {
        let mut command = Command::new(&self.command[0]);
        command.args(&self.command[1..]).stdout(Stdio::null());
        command
    }
}

/// One measured run.
#[derive(Default, Clone)]
struct Run {
    wall: f64,
    /// Seconds from starting the tool to its saying it is ready (probes attached).
    start: Option<f64>,
    /// heapprofd only: its CPU seconds, peak RSS (KiB) and the allocations it counted.
    daemon_cpu: Option<f64>,
    daemon_rss_kib: Option<u64>,
    allocations: Option<u64>,
    /// heapprofd only: the profile it wrote at the end.
    profile: Option<PathBuf>,
    /// heapprofd only: its unwind tables at the end (user mode).
    unwind_tables: Option<UnwindTables>,
    /// heapprofd only: how many of its probes it said the kernel single-steps.
    single_stepped: Option<usize>,
}

/// Debian's python3 (a `python3` on PATH may be a pyenv shim or another build).
const PYTHON: &str = "/usr/bin/python3";

/// The `--ready-file` of the heapprofd run writing its figures to `stats`.
fn ready_file(stats: &Path) -> PathBuf {
    stats.with_extension("ready")
}

/// The `--profiles-json` of the heapprofd run writing its figures to `stats`.
fn profiles_file(stats: &Path) -> PathBuf {
    stats.with_extension("profiles.jsonl")
}

struct Bench {
    heapprofd: PathBuf,
    dir: PathBuf,
    /// The `--stats-json` files handed out so far.
    stats_files: Cell<u32>,
}

impl Bench {
    /// A new path for a heapprofd run's `--stats-json` (none is reused, so a run that
    /// writes none is never read as an earlier run's).
    fn stats_path(&self) -> PathBuf {
        let n = self.stats_files.get() + 1;
        self.stats_files.set(n);
        self.dir.join("stats").join(format!("{n}.json"))
    }

    /// `heapprofd --pid PID` with `extra` flags, writing its figures to `stats`, a line
    /// per profile to [`profiles_file`] of it, and creating [`ready_file`] of it once
    /// its probes are on.
    fn heapprofd_command(&self, extra: &[&str], pid: u32, stats: &Path) -> Command {
        let mut command = Command::new(&self.heapprofd);
        command
            .args(["-o"])
            .arg(self.dir.join("profiles"))
            .arg("--stats-json")
            .arg(stats)
            .arg("--ready-file")
            .arg(ready_file(stats))
            .arg("--profiles-json")
            .arg(profiles_file(stats))
            .args(extra)
            .args(["--pid", &pid.to_string()])
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        command
    }

    /// Starts heapprofd on `pid` and waits until its probes are attached.
    fn start_heapprofd(&self, extra: &[&str], pid: u32) -> Result<Daemon> {
        let stats = self.stats_path();
        let mut child = self
            .heapprofd_command(extra, pid, &stats)
            .spawn()
            .context("starting heapprofd")?;
        let lines = lines_of(child.stderr.take().context("heapprofd stderr")?);
        let mut log = Vec::new();
        wait_until_ready(&ready_file(&stats), &mut child, &lines, &mut log)?;
        Ok(Daemon {
            child,
            lines,
            log,
            profiles: profiles_file(&stats),
            stats,
        })
    }

    /// Runs `workload` once under `mode`.
    fn run(&self, workload: &Workload, mode: Mode) -> Result<Run> {
        let mut target = start_workload(&mut workload.command())
            .with_context(|| format!("starting {}", workload.name))?;
        let pid = target.id();
        let tool_started = Instant::now();
        let stats = self.stats_path();
        let tool = match Tool::spawn(self, mode, pid, &stats)? {
            Some(child) => Some(Tool::attach(child, mode, &stats, &mut target)?),
            None => None,
        };
        let start = tool.is_some().then(|| tool_started.elapsed().as_secs_f64());

        let started = Instant::now();
        send_go(&mut target)?;
        let status = target.wait()?;
        let wall = started.elapsed().as_secs_f64();
        if !status.success() {
            bail!("{} failed under {}: {status}", workload.name, mode.name());
        }
        let mut run = Run {
            wall,
            start,
            ..Run::default()
        };
        if let Some(tool) = tool {
            tool.finish(mode, &stats, &mut run)?;
        }
        Ok(run)
    }

    /// heapprofd in `mode` with --bpf-stats on one run of `workload`: its programs' run
    /// times.
    fn bpf_stats(&self, workload: &Workload, mode: Mode) -> Result<BpfRunTime> {
        let mut flags = mode
            .heapprofd_flags()
            .context("--bpf-stats is heapprofd's")?
            .to_vec();
        flags.push("--bpf-stats");
        let mut target = start_workload(&mut workload.command())?;
        let mut daemon = self.start_heapprofd(&flags, target.id())?;
        send_go(&mut target)?;
        target.wait()?;
        daemon.child.wait()?;
        DaemonStats::read(&daemon.stats)?
            .bpf_run_time
            .context("heapprofd --bpf-stats wrote no BPF run time")
    }

    /// Profile dumps with `stacks` distinct stacks: the first interval profile holding
    /// them all (cold symbolization) and the next (cached), with heapprofd's peak RSS.
    fn dump_times(&self, program: &Path, stacks: u32) -> Result<(Written, Written, u64)> {
        let mut target = start_workload(
            Command::new(program)
                .arg(stacks.to_string())
                .stdout(Stdio::piped()),
        )?;
        let capacity = (stacks * 2).max(65536).to_string();
        let Daemon {
            child,
            lines,
            mut log,
            profiles,
            ..
        } = self.start_heapprofd(
            &[
                "--interval",
                "2s",
                "--inject",
                "off",
                "--max-sites",
                &capacity,
                "--max-stacks",
                &capacity,
            ],
            target.id(),
        )?;
        // Stdin stays open until the dumps are timed: the workload exits at its end.
        let mut stdin = target.stdin.take().context("workload stdin")?;
        stdin.write_all(b"go\n")?;
        let output = lines_of(target.stdout.take().context("workload stdout")?);
        output
            .recv_timeout(Duration::from_secs(120))
            .context("the stacks workload did not finish allocating")?;
        // Two interval dumps with every stack: the first symbolizes, the second is cached.
        let mut follower = Follower::new(&profiles);
        let mut dumps = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(180);
        while dumps.len() < 2 && Instant::now() < deadline {
            dumps.extend(follower.new_lines()?.into_iter().filter(|written| {
                written.kind == Kind::Interval && written.sites >= u64::from(stacks)
            }));
            log.extend(lines.try_iter());
            std::thread::sleep(Duration::from_millis(50));
        }
        drop(stdin);
        target.wait()?;
        let (_, rss) = wait_with_usage(child.id())?;
        let mut dumps = dumps.into_iter();
        match (dumps.next(), dumps.next()) {
            (Some(first), Some(next)) => Ok((first, next, rss)),
            _ => {
                log.extend(lines.try_iter());
                bail!(
                    "heapprofd did not write two profiles with {stacks} sites:\n{}",
                    log.join("\n")
                )
            }
        }
    }

    /// Shutdown with `--attach METHOD`: (end-to-end seconds of `heapprofd -- true`,
    /// seconds from the final profile's write to heapprofd's exit after SIGINT on a
    /// `--pid` session).
    fn shutdown(&self, method: &str, waiting: &Path) -> Result<(f64, f64)> {
        let started = Instant::now();
        let status = Command::new(&self.heapprofd)
            .arg("-o")
            .arg(self.dir.join("profiles"))
            .args(["--attach", method, "--", "true"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .context("running heapprofd -- true")?;
        let end_to_end = started.elapsed().as_secs_f64();
        if !status.success() {
            bail!("heapprofd --attach {method} -- true failed: {status}");
        }
        let mut target = start_workload(Command::new(waiting).arg("1").stdout(Stdio::null()))?;
        let Daemon {
            child,
            lines,
            mut log,
            profiles,
            ..
        } = self.start_heapprofd(
            &["--interval", "1h", "--inject", "off", "--attach", method],
            target.id(),
        )?;
        interrupt(&child);
        wait_with_usage(child.id())?;
        let exited = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .context("the clock is before 1970")?
            .as_secs_f64();
        send_go(&mut target)?;
        target.wait()?;
        let written = profiles_json::read(&profiles)?;
        let Some(last) = written.iter().find(|written| written.kind == Kind::Final) else {
            log.extend(lines.try_iter());
            bail!(
                "heapprofd --attach {method} wrote no final profile:\n{}",
                log.join("\n")
            );
        };
        Ok((end_to_end, (exited - last.unix_time).max(0.0)))
    }

    /// heapprofd's own CPU share over a long churn at the default 10 s interval.
    fn daemon_load(&self, program: &Path, seconds: u32) -> Result<(f64, f64, u64)> {
        let mut target = start_workload(
            Command::new(program)
                .args(["2", "0", &seconds.to_string()])
                .stdout(Stdio::null()),
        )?;
        let Daemon { child, .. } =
            self.start_heapprofd(&["--interval", "10s", "--inject", "off"], target.id())?;
        let started = Instant::now();
        send_go(&mut target)?;
        target.wait()?;
        let (cpu, rss) = wait_with_usage(child.id())?;
        let wall = started.elapsed().as_secs_f64();
        Ok((cpu, wall, rss))
    }
}

/// Sections of the benchmark besides the workloads, which `--only` can also name
/// (`none`: no section, the workloads named alone).
const SECTIONS: [&str; 10] = [
    "library", "dumps", "shutdown", "load", "redis", "nginx", "fleet", "launch", "kernel", "none",
];

/// Runs the benchmark and writes target/bench/summary.{txt,json}.
pub fn bench(heapprofd: &Path, options: &Options) -> Result<()> {
    check_requirements(options)?;
    let dir = workspace_root().join("target/bench");
    std::fs::create_dir_all(&dir)?;
    // Profiles of earlier benchmark runs: this run's are read back (frames per allocation).
    match std::fs::remove_dir_all(dir.join("profiles")) {
        Err(err) if err.kind() != std::io::ErrorKind::NotFound => {
            return Err(err).context("removing target/bench/profiles");
        }
        _ => {}
    }
    let programs = Programs::compile(&dir)?;
    let workloads = workloads(&programs, options.quick);
    // Each heapprofd run's figures (--stats-json), numbered afresh.
    let _ = std::fs::remove_dir_all(dir.join("stats"));
    std::fs::create_dir_all(dir.join("stats")).context("creating target/bench/stats")?;
    let bench = Bench {
        heapprofd: heapprofd.to_owned(),
        dir: dir.clone(),
        stats_files: Cell::new(0),
    };
    let load_before = load_average();
    let sections = Sections {
        bench: &bench,
        programs: &programs,
        options,
        named: named_sections(options, &workloads)?,
    };
    let mut summary = Summary::default();
    let chosen = |w: &&Workload| options.only.is_empty() || options.only.iter().any(|k| k == w.key);
    for workload in workloads.iter().filter(chosen) {
        workload::measure(&bench, workload, options, &mut summary)?;
    }
    let mut json = SectionsJson::default();
    sections.run_goal_sections(&mut summary, &mut json)?;
    let _ = writeln!(
        summary.text,
        "\n## Goals (figures of this run, never pass/fail; ratios of added time per allocation, medians)\n\n{}",
        summary.goals_text
    );
    let _ = writeln!(
        summary.text,
        "## Unwind tables of heapprofd exact, per workload (BPF map memory)\n\n{}",
        summary.tables_text
    );
    sections.run_other_sections(&mut summary, &mut json)?;
    write_summary(&dir, options, &load_before, &summary, &json)
}

/// The sections a run measures besides the workloads, and what they run with.
struct Sections<'a> {
    bench: &'a Bench,
    programs: &'a Programs,
    options: &'a Options,
    /// The sections `--only` names.
    named: Vec<&'a str>,
}

impl Sections<'_> {
    /// Whether the section `key` runs: sections named, those alone (with the
    /// workloads named); none named, all.
    fn wanted(&self, key: &str) -> bool {
        self.named.is_empty() || self.named.contains(&key)
    }

    /// Runs the sections with goals of their own (launch, kernel), which the summary
    /// lists before its goals: their text into `summary`, their JSON into `json`.
    fn run_goal_sections(&self, summary: &mut Summary, json: &mut SectionsJson) -> Result<()> {
        let (bench, options) = (self.bench, self.options);
        if self.wanted("launch") {
            note_foreign_tracers("launch", &mut summary.warnings);
            let report = launch::section(
                bench,
                &self.programs.stl,
                options.runs,
                options.quick,
                &mut summary.text,
            )?;
            add_goals(summary, "launch", &report.goals);
            json.launch = report.json;
        }
        if self.wanted("kernel") {
            note_foreign_tracers("kernel", &mut summary.warnings);
            let report = kernel::section(bench, options.runs, options.quick, &mut summary.text)?;
            add_goals(summary, "kernel", &report.goals);
            json.kernel = report.json;
        }
        Ok(())
    }

    /// Runs the sections the summary lists after its goals and unwind tables: their
    /// text into `summary`, their JSON into `json`.
    fn run_other_sections(&self, summary: &mut Summary, json: &mut SectionsJson) -> Result<()> {
        let (bench, programs, options) = (self.bench, self.programs, self.options);
        let text = &mut summary.text;
        if self.wanted("library") {
            note_foreign_tracers("largest library", &mut summary.warnings);
            json.library = sections::largest_library(bench, &programs.dlopen, options.runs, text)?;
        }
        if self.wanted("dumps") {
            note_foreign_tracers("profile dumps", &mut summary.warnings);
            json.dumps = sections::dumps(bench, &programs.stacks, options.runs, text)?;
        }
        if self.wanted("shutdown") {
            note_foreign_tracers("shutdown", &mut summary.warnings);
            json.shutdown = sections::shutdown(bench, &programs.pairs, options.runs, text)?;
        }
        if self.wanted("redis") {
            note_foreign_tracers("redis", &mut summary.warnings);
            json.redis = redis::section(bench, options.runs, options.quick, text)?;
        }
        if self.wanted("nginx") {
            note_foreign_tracers("nginx", &mut summary.warnings);
            json.nginx = nginx::section(bench, options.runs, options.quick, text)?;
        }
        if self.wanted("fleet") {
            note_foreign_tracers("fleet", &mut summary.warnings);
            json.fleet =
                redis::fleet::section(bench, &programs.stl, options.runs, options.quick, text)?;
        }
        if self.wanted("load") {
            note_foreign_tracers("daemon load", &mut summary.warnings);
            let seconds = if options.quick { 12 } else { 35 };
            json.load = sections::daemon_load(bench, &programs.churn, seconds, text)?;
        }
        Ok(())
    }
}

/// Adds a section's `goals` to the summary's list of goals (text and JSON), each
/// labelled with its workload key and the `section`.
fn add_goals(summary: &mut Summary, section: &str, goals: &[(&'static str, GoalFigure)]) {
    for (key, goal) in goals {
        let _ = writeln!(summary.goals_text, "{key} ({section}): {}", goal.describe());
        summary.json_goals.push(goal.json(key));
    }
}

/// What the benchmark needs before it compiles anything: root, a sane `--runs`,
/// tracefs, g++ and Debian's python3.
fn check_requirements(options: &Options) -> Result<()> {
    if !crate::is_root() {
        bail!("the benchmark attaches BPF programs: run it as root (sudo -E cargo xtask bench)");
    }
    if options.runs == 0 {
        bail!("--runs must be at least 1");
    }
    ensure_tracefs()?;
    ensure_gxx()?;
    let python = Path::new(PYTHON);
    if !python.exists() {
        bail!("the python workload needs Debian's {PYTHON} (apt-get install python3)");
    }
    Ok(())
}

/// The workloads timed under every mode; `quick` runs them a quarter as long.
fn workloads(programs: &Programs, quick: bool) -> Vec<Workload> {
    let scale = if quick { 1 } else { 4 };
    let perl_script = format!(
        "<STDIN>; my %h; for my $i (1..{}) {{ $h{{\"key$i\"}} = \"v\" x ($i % 200); delete $h{{\"key\" . ($i - 1000)}} if $i > 1000; }}",
        25_000 * scale
    );
    let python_script = workspace_root().join("xtask/workloads/bench_python.py");
    vec![
        Workload {
            name: "malloc/free pairs (1 thread)",
            key: "pairs",
            command: vec![
                programs.pairs.display().to_string(),
                (50_000 * scale).to_string(),
            ],
            goal: Goal::Shallow,
        },
        Workload {
            name: "family churn (2 threads)",
            key: "churn",
            command: vec![
                programs.churn.display().to_string(),
                "2".into(),
                (10_000 * scale).to_string(),
            ],
            goal: Goal::None,
        },
        Workload {
            name: "perl hash churn",
            key: "perl",
            command: vec!["perl".into(), "-e".into(), perl_script],
            goal: Goal::None,
        },
        // About 4,650 allocations a round.
        Workload {
            name: "C++ STL, g++ -O2 without frame pointers (deep stacks)",
            key: "cxx_stl",
            command: vec![programs.stl.display().to_string(), (10 * scale).to_string()],
            goal: Goal::Deep,
        },
        // About 8,800 allocations a round (blocks above pymalloc's 512 bytes).
        Workload {
            name: "Debian /usr/bin/python3 (deep stacks)",
            key: "python3",
            command: vec![
                PYTHON.into(),
                python_script.display().to_string(),
                (6 * scale).to_string(),
            ],
            goal: Goal::Deep,
        },
    ]
}

/// The sections `--only` names; an unknown workload or section is an error.
fn named_sections<'a>(options: &'a Options, workloads: &[Workload]) -> Result<Vec<&'a str>> {
    if let Some(unknown) = options
        .only
        .iter()
        .find(|k| !workloads.iter().any(|w| &w.key == k) && !SECTIONS.contains(&k.as_str()))
    {
        let keys: Vec<&str> = workloads.iter().map(|w| w.key).collect();
        bail!(
            "no workload or section {unknown:?}; the workloads are {}, the sections {}",
            keys.join(", "),
            SECTIONS.join(", ")
        );
    }
    Ok(options
        .only
        .iter()
        .map(String::as_str)
        .filter(|k| SECTIONS.contains(k))
        .collect())
}
