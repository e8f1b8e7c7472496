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
//! Two more sections: a real service (redis.rs: redis-server attached to and launched)
//! and launch mode (launch.rs: whole commands under `heapprofd -- CMD` against
//! heaptrack, whose added time is the baseline there).

use std::{
    fmt::Write as _,
    io::{BufRead as _, BufReader, Write as _},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::mpsc,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};

use crate::{step, workspace_root};

mod launch;
mod redis;
mod redis_keys;
mod sections;
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
    fn heapprofd_flags(self) -> Option<&'static [&'static str]> {
        match self {
            Mode::Bare | Mode::EmptyProbes | Mode::Bpftrace => None,
            Mode::Floor => Some(&["--interval", "1h", "--empty-programs"]),
            Mode::StacksOnly => Some(&["--interval", "1h", "--stacks-only"]),
            Mode::HeapprofdEntry => Some(&["--interval", "1h", "--probe-placement", "entry"]),
            Mode::Heapprofd => Some(&["--interval", "1h"]),
            Mode::HeapprofdNoPeak => Some(&["--interval", "1h", "--no-peak"]),
            Mode::HeapprofdFp => Some(&["--interval", "1h", "--unwind", "fp"]),
            Mode::HeapprofdSampled => Some(&["--interval", "1h", "--sample-rate", "512KiB"]),
        }
    }

    fn is_bpftrace(self) -> bool {
        matches!(self, Mode::EmptyProbes | Mode::Bpftrace)
    }
}

/// What a workload's figures are held against (see the issue's goals).
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
    /// heapprofd only: its last `unwind tables:` log line.
    unwind_tables: Option<String>,
    /// heapprofd only: how many of its probes it said the kernel single-steps.
    single_stepped: Option<usize>,
}

/// Debian's python3 (a `python3` on PATH may be a pyenv shim or another build).
const PYTHON: &str = "/usr/bin/python3";

/// A goal of the issue and this run's figure for it.
struct GoalFigure {
    text: String,
    value: f64,
    limit: f64,
    /// How `value` must relate to `limit`, as said: "at most", "below ...".
    relation: &'static str,
    unit: &'static str,
}

impl GoalFigure {
    fn met(&self) -> Option<bool> {
        (self.value.is_finite() && self.limit.is_finite()).then_some(self.value <= self.limit)
    }

    fn describe(&self) -> String {
        let unit = self.unit;
        format!(
            "{}: {:.2}{unit} (goal: {} {:.2}{unit}): {}",
            self.text,
            self.value,
            self.relation,
            self.limit,
            match self.met() {
                Some(true) => "met",
                Some(false) => "not met",
                None => "no figure",
            }
        )
    }

    fn json(&self, workload: &str) -> String {
        format!(
            "{{\"workload\": {}, \"goal\": {}, \"value\": {}, \"limit\": {}, \"met\": {}}}",
            json_string(workload),
            json_string(&format!(
                "{} {} {}{}",
                self.text, self.relation, self.limit, self.unit
            )),
            json_number(self.value),
            json_number(self.limit),
            self.met().map_or("null".into(), |m| m.to_string())
        )
    }
}

/// The allocator functions heapprofd probes, for the baselines.
const FAMILY: [&str; 10] = [
    "malloc",
    "calloc",
    "realloc",
    "reallocarray",
    "posix_memalign",
    "aligned_alloc",
    "memalign",
    "valloc",
    "pvalloc",
    "free",
];

fn compile(source: &str, output: &Path, flags: &[&str]) -> Result<()> {
    compile_with("gcc", source, output, flags)
}

fn compile_with(compiler: &str, source: &str, output: &Path, flags: &[&str]) -> Result<()> {
    let root = workspace_root();
    let status = Command::new(compiler)
        .args(flags)
        .arg("-o")
        .arg(output)
        .arg(root.join("xtask/workloads").join(source))
        .status()
        .with_context(|| format!("running {compiler}"))?;
    if !status.success() {
        bail!("compiling {source} failed");
    }
    Ok(())
}

/// Waits until a just-started workload is blocked reading stdin: its libc is mapped and
/// tracers can attach.
fn wait_until_waiting(pid: u32) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        let state = stat
            .rsplit(')')
            .next()
            .and_then(|r| r.split_whitespace().next());
        if state == Some("S") && libc_of(pid).is_ok() {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    bail!("workload {pid} never started waiting on its input")
}

/// The libc a process maps, from its /proc/PID/maps.
fn libc_of(pid: u32) -> Result<String> {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps"))?;
    maps.lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .find(|p| {
            p.rsplit('/')
                .next()
                .is_some_and(|n| n.starts_with("libc.so"))
        })
        .map(str::to_owned)
        .context("the workload maps no libc.so")
}

fn empty_probes_script(libc: &str) -> String {
    let probes: Vec<String> = FAMILY
        .iter()
        .map(|f| format!("uprobe:{libc}:{f}"))
        .collect();
    format!(
        "{} {{ }}\nBEGIN {{ printf(\"ready\\n\"); }}\n",
        probes.join(",\n")
    )
}

/// A memleak-style bpftrace script: size at entry, pointer at return, a stack per live
/// block, deleted on free; for malloc, calloc, realloc, and free.
fn memleak_script(libc: &str) -> String {
    format!(
        r#"uprobe:{libc}:malloc {{ @size[tid] = arg0; }}
uprobe:{libc}:calloc {{ @size[tid] = arg0 * arg1; }}
uprobe:{libc}:realloc {{ delete(@sizes[arg0]); delete(@stacks[arg0]); @size[tid] = arg1; }}
uretprobe:{libc}:malloc, uretprobe:{libc}:calloc, uretprobe:{libc}:realloc /@size[tid]/ {{
  if (retval != 0) {{ @sizes[retval] = @size[tid]; @stacks[retval] = ustack; }}
  delete(@size[tid]);
}}
uprobe:{libc}:free {{ delete(@sizes[arg0]); delete(@stacks[arg0]); }}
BEGIN {{ printf("ready\n"); }}
END {{ clear(@size); clear(@sizes); clear(@stacks); }}
"#
    )
}

/// Lines a child prints (stdout or stderr), as they come.
fn lines_of(stream: impl std::io::Read + Send + 'static) -> mpsc::Receiver<String> {
    let (sender, receiver) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stream).lines().map_while(Result::ok) {
            if sender.send(line).is_err() {
                break;
            }
        }
    });
    receiver
}

fn wait_for_line(
    lines: &mpsc::Receiver<String>,
    needle: &str,
    seen: &mut Vec<String>,
) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match lines.recv_timeout(left) {
            Ok(line) => {
                let found = line.contains(needle);
                seen.push(line);
                if found {
                    return Ok(());
                }
            }
            Err(_) => bail!(
                "the tool never printed `{needle}`; its output:\n{}",
                seen.join("\n")
            ),
        }
    }
}

/// Waits for `pid`, returning its CPU seconds and peak RSS (KiB).
fn wait_with_usage(pid: u32) -> Result<(f64, u64)> {
    let mut status = 0;
    // SAFETY: zeroed rusage is a valid out-parameter.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: wait4 on our own child with valid pointers.
    let waited = unsafe { libc::wait4(pid as libc::pid_t, &mut status, 0, &mut usage) };
    if waited < 0 {
        bail!("wait4({pid}): {}", std::io::Error::last_os_error());
    }
    let seconds = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    Ok((
        seconds(usage.ru_utime) + seconds(usage.ru_stime),
        usage.ru_maxrss as u64,
    ))
}

fn interrupt(child: &Child) {
    // SAFETY: plain kill(2) of our own child.
    unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGINT) };
}

/// Parses heapprofd's "N blocks / B bytes allocated" from its last "wrote" line.
fn counted_allocations(log: &[String]) -> Option<u64> {
    let line = log.iter().rev().find(|l| l.contains(" wrote "))?;
    let before = line.split(" blocks / ").next()?;
    before.rsplit(' ').next()?.parse().ok()
}

/// The profile named by heapprofd's last "wrote PATH: ..." line.
fn written_profile(log: &[String]) -> Option<PathBuf> {
    let line = log.iter().rev().find(|l| l.contains(" wrote "))?;
    let rest = line.split(" wrote ").nth(1)?;
    Some(PathBuf::from(rest.split(": ").next()?))
}

/// heapprofd's last `unwind tables: ...` log line, from "unwind tables" on.
fn unwind_tables_line(log: &[String]) -> Option<String> {
    log.iter()
        .rev()
        .find_map(|l| l.split_once("unwind tables: "))
        .map(|(_, rest)| format!("unwind tables: {rest}"))
}

/// The figures of an `unwind tables:` line: `7 objects, 72345 rows, 812 rules, 600 KiB
/// of BPF map memory in use, built in 30 ms; 0 objects without CFI, 0 that did not fit`.
#[derive(Clone, Copy, Debug, Default)]
struct Tables {
    objects: u64,
    rows: u64,
    rules: u64,
    kib: u64,
    build_ms: u64,
    not_fitting: u64,
}

impl Tables {
    fn parse(line: &str) -> Option<Tables> {
        // The number just before `label`.
        let before = |label: &str| -> Option<u64> {
            let head = line.split(label).next().filter(|h| h.len() < line.len())?;
            head.rsplit(' ').next()?.parse().ok()
        };
        let build_ms = line
            .split("built in ")
            .nth(1)?
            .split(' ')
            .next()?
            .parse()
            .ok()?;
        Some(Tables {
            objects: before(" objects,")?,
            rows: before(" rows,")?,
            rules: before(" rules,")?,
            kib: before(" KiB of BPF map memory")?,
            build_ms,
            not_fitting: before(" that did not fit").unwrap_or(0),
        })
    }

    fn json(&self) -> String {
        format!(
            "{{\"objects\": {}, \"rows\": {}, \"rules\": {}, \"bpf_map_kib\": {}, \"build_ms\": {}, \"not_fitting\": {}}}",
            self.objects, self.rows, self.rules, self.kib, self.build_ms, self.not_fitting
        )
    }
}

/// The mean number of frames (locations, the allocator's own included) per allocation of
/// a profile, weighted by `alloc_objects`; from `go tool pprof -raw`. `None` when go is
/// missing or the profile has no allocations.
fn frames_per_allocation(profile: &Path) -> Option<f64> {
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

/// The total of a `BPF run time X ms: ...` line, in nanoseconds.
fn bpf_total_ns(stats: &str) -> Option<f64> {
    let ms: f64 = stats
        .split("BPF run time ")
        .nth(1)?
        .split(' ')
        .next()?
        .parse()
        .ok()?;
    Some(ms * 1e6)
}

/// Other users of uprobes on the machine, checked between runs (when none of this
/// benchmark's tools is running): heapprofd and bpftrace processes, uprobe_multi BPF
/// links, perf-event uprobes (per bpftool, when installed). A tracer on the C library
/// (a test suite's `heapprofd --all`) traps the workloads' allocator calls too, bare runs
/// included, and makes the figures meaningless. Empty when there are none.
fn foreign_tracers() -> Vec<String> {
    let mut found = Vec::new();
    let me = std::process::id();
    for entry in std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .filter_map(Result::ok)
    {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let comm = std::fs::read_to_string(entry.path().join("comm")).unwrap_or_default();
        let comm = comm.trim();
        if pid != me && (comm == "heapprofd" || comm == "bpftrace") {
            found.push(format!("{comm} (pid {pid})"));
        }
    }
    let bpftool = |object: &str| -> Option<String> {
        let output = Command::new("bpftool")
            .args(["-j", object, "show"])
            .stdin(Stdio::null())
            .stderr(Stdio::null())
            .output()
            .ok()
            .filter(|o| o.status.success())?;
        Some(String::from_utf8_lossy(&output.stdout).into_owned())
    };
    if let Some(links) = bpftool("link") {
        // Older bpftools print the link type as a number: 12 is BPF_LINK_TYPE_UPROBE_MULTI.
        let numeric = links
            .match_indices("\"type\":12")
            .filter(|(at, m)| !links[at + m.len()..].starts_with(|c: char| c.is_ascii_digit()))
            .count();
        let multi = numeric + links.matches("\"type\":\"uprobe_multi\"").count();
        if multi > 0 {
            found.push(format!("{multi} uprobe_multi BPF links"));
        }
    }
    if let Some(perf) = bpftool("perf") {
        let uprobes = perf.matches("uprobe\"").count();
        if uprobes > 0 {
            found.push(format!("{uprobes} perf-event uprobes with BPF programs"));
        }
    }
    found
}

/// Adds a warning to `warnings` when other tracers are active before a section.
fn note_foreign_tracers(section: &str, warnings: &mut Vec<String>) {
    let foreign = foreign_tracers();
    if !foreign.is_empty() {
        eprintln!(
            "xtask:   warning: other tracers are active: {}",
            foreign.join(", ")
        );
        warnings.push(format!(
            "{section}: WARNING: other tracers were active at its start ({})",
            foreign.join(", ")
        ));
    }
}

/// The 1-minute load average.
fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|l| l.split_whitespace().next().map(str::to_owned))
        .unwrap_or_else(|| "?".into())
}

/// Starts a workload and waits until it blocks on its "go" line.
fn start_workload(command: &mut Command) -> Result<Child> {
    let target = command
        .stdin(Stdio::piped())
        .spawn()
        .context("starting a workload")?;
    wait_until_waiting(target.id())?;
    Ok(target)
}

/// Lets a waiting workload start.
fn send_go(target: &mut Child) -> Result<()> {
    let mut stdin = target.stdin.take().context("workload stdin")?;
    stdin.write_all(b"go\n")?;
    Ok(())
}

/// A running heapprofd with its log so far and the rest to come.
struct Daemon {
    child: Child,
    lines: mpsc::Receiver<String>,
    log: Vec<String>,
}

struct Bench {
    heapprofd: PathBuf,
    dir: PathBuf,
}

impl Bench {
    fn heapprofd_command(&self, extra: &[&str], pid: u32) -> Command {
        let mut command = Command::new(&self.heapprofd);
        command
            .args(["-o"])
            .arg(self.dir.join("profiles"))
            .args(extra)
            .args(["--pid", &pid.to_string()])
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        command
    }

    /// Starts heapprofd on `pid` and waits until its probes are attached.
    fn start_heapprofd(&self, extra: &[&str], pid: u32) -> Result<Daemon> {
        let mut child = self
            .heapprofd_command(extra, pid)
            .spawn()
            .context("starting heapprofd")?;
        let lines = lines_of(child.stderr.take().context("heapprofd stderr")?);
        let mut log = Vec::new();
        wait_for_line(&lines, "probes on", &mut log)?;
        Ok(Daemon { child, lines, log })
    }

    /// Runs `workload` once under `mode`.
    fn run(&self, workload: &Workload, mode: Mode) -> Result<Run> {
        let mut target = start_workload(&mut workload.command())
            .with_context(|| format!("starting {}", workload.name))?;
        let pid = target.id();
        let tool_started = Instant::now();
        let mut tool = match mode.heapprofd_flags() {
            None if mode == Mode::Bare => None,
            None => {
                let libc = libc_of(pid)?;
                let script = if mode == Mode::EmptyProbes {
                    empty_probes_script(&libc)
                } else {
                    memleak_script(&libc)
                };
                let child = Command::new("bpftrace")
                    .args(["-p", &pid.to_string(), "-e", &script])
                    .env("BPFTRACE_MAP_KEYS_MAX", "1048576")
                    .stdout(Stdio::piped())
                    .stderr(Stdio::null())
                    .spawn()
                    .context("starting bpftrace")?;
                Some(child)
            }
            Some(flags) => {
                let child = self
                    .heapprofd_command(flags, pid)
                    .spawn()
                    .context("starting heapprofd")?;
                Some(child)
            }
        };
        let mut log = Vec::new();
        let lines = match tool.as_mut() {
            Some(child) => {
                let lines = match (child.stdout.take(), child.stderr.take()) {
                    (Some(out), _) => lines_of(out),
                    (None, Some(err)) => lines_of(err),
                    (None, None) => bail!("no output from the tool"),
                };
                let ready = if mode.is_bpftrace() {
                    "ready"
                } else {
                    "probes on"
                };
                if let Err(err) = wait_for_line(&lines, ready, &mut log) {
                    let _ = target.kill();
                    let _ = target.wait();
                    return Err(err);
                }
                Some(lines)
            }
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
        if let Some(child) = tool {
            if mode.is_bpftrace() {
                interrupt(&child);
            }
            let (cpu, rss) = wait_with_usage(child.id())?;
            if let Some(lines) = lines {
                log.extend(lines.try_iter());
            }
            if !mode.is_bpftrace() {
                run.daemon_cpu = Some(cpu);
                run.daemon_rss_kib = Some(rss);
                run.allocations = counted_allocations(&log);
                run.profile = written_profile(&log);
                run.unwind_tables = unwind_tables_line(&log);
                run.single_stepped = Some(redis::single_stepped(&log));
            }
        }
        Ok(run)
    }

    /// heapprofd in `mode` with --bpf-stats on one run of `workload`: its log line of run
    /// times.
    fn bpf_stats(&self, workload: &Workload, mode: Mode) -> Result<String> {
        let mut flags = mode
            .heapprofd_flags()
            .context("--bpf-stats is heapprofd's")?
            .to_vec();
        flags.push("--bpf-stats");
        let mut target = start_workload(&mut workload.command())?;
        let Daemon {
            mut child,
            lines,
            mut log,
        } = self.start_heapprofd(&flags, target.id())?;
        send_go(&mut target)?;
        target.wait()?;
        child.wait()?;
        log.extend(lines.try_iter());
        Ok(log
            .iter()
            .rev()
            .find_map(|l| l.split("BPF run time ").nth(1))
            .map(|s| format!("BPF run time {s}"))
            .unwrap_or_else(|| "no BPF statistics logged".into()))
    }

    /// Profile dumps with `stacks` distinct stacks: the first (cold symbolization) and
    /// a later one (cached), with heapprofd's peak RSS.
    fn dump_times(&self, program: &Path, stacks: u32) -> Result<(String, String, u64)> {
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
        } = self.start_heapprofd(
            &[
                "--interval",
                "2s",
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
        let sites_of = |line: &str| -> Option<u32> {
            let before = line.split(" sites,").next()?;
            before.rsplit(' ').next()?.parse().ok()
        };
        let mut dumps = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(180);
        while dumps.len() < 2 && Instant::now() < deadline {
            if let Ok(line) = lines.recv_timeout(Duration::from_secs(1)) {
                if line.contains(" wrote ") && sites_of(&line).is_some_and(|n| n >= stacks) {
                    dumps.push(line.clone());
                }
                log.push(line);
            }
        }
        drop(stdin);
        target.wait()?;
        let (_, rss) = wait_with_usage(child.id())?;
        if dumps.len() < 2 {
            bail!(
                "heapprofd did not write two profiles with {stacks} sites:\n{}",
                log.join("\n")
            );
        }
        let timing = |line: &str| line.rsplit("; ").next().unwrap_or(line).to_owned();
        Ok((timing(&dumps[0]), timing(&dumps[1]), rss))
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
        } = self.start_heapprofd(&["--interval", "1h", "--attach", method], target.id())?;
        interrupt(&child);
        wait_for_line(&lines, " wrote ", &mut log)?;
        let written = Instant::now();
        wait_with_usage(child.id())?;
        let after_write = written.elapsed().as_secs_f64();
        send_go(&mut target)?;
        target.wait()?;
        Ok((end_to_end, after_write))
    }

    /// heapprofd's own CPU share over a long churn at the default 10 s interval.
    fn daemon_load(&self, program: &Path, seconds: u32) -> Result<(f64, f64, u64)> {
        let mut target = start_workload(
            Command::new(program)
                .args(["2", "0", &seconds.to_string()])
                .stdout(Stdio::null()),
        )?;
        let Daemon { child, .. } = self.start_heapprofd(&["--interval", "10s"], target.id())?;
        let started = Instant::now();
        send_go(&mut target)?;
        target.wait()?;
        let (cpu, rss) = wait_with_usage(child.id())?;
        let wall = started.elapsed().as_secs_f64();
        Ok((cpu, wall, rss))
    }

    /// One launch-mode run of `heapprofd -- bench_dlopen LIBRARIES...`: its unwind tables.
    fn dlopen_tables(&self, program: &Path, libraries: &[String]) -> Result<Tables> {
        let output = Command::new(&self.heapprofd)
            .arg("-o")
            .arg(self.dir.join("profiles"))
            .args([
                "--interval",
                "1h",
                "--max-unwind-rows",
                &LIBRARY_ROWS.to_string(),
            ])
            .arg("--")
            .arg(program)
            .args(libraries)
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .output()
            .context("running heapprofd -- bench_dlopen")?;
        let log: Vec<String> = String::from_utf8_lossy(&output.stderr)
            .lines()
            .map(str::to_owned)
            .collect();
        if !output.status.success() {
            bail!(
                "heapprofd -- bench_dlopen failed ({}):\n{}",
                output.status,
                log.join("\n")
            );
        }
        let line = unwind_tables_line(&log).with_context(|| {
            format!(
                "heapprofd logged no `unwind tables:` line:\n{}",
                log.join("\n")
            )
        })?;
        Tables::parse(&line).with_context(|| format!("cannot read the figures of `{line}`"))
    }

    /// The unwind-table build of the largest library that dlopen() loads, isolated: runs
    /// that load only its dependencies against runs that load them and it, interleaved.
    fn largest_library(&self, program: &Path, runs: usize) -> Result<LibraryBuild> {
        let mut skipped = Vec::new();
        for (path, size) in libraries_by_size().into_iter().take(5) {
            let library = path.display().to_string();
            let listed = Command::new(program)
                .args(["--new-objects", &library])
                .stdin(Stdio::null())
                .output()
                .context("running bench_dlopen --new-objects")?;
            if !listed.status.success() {
                skipped.push(format!(
                    "{library} ({} MiB): dlopen failed: {}",
                    size >> 20,
                    String::from_utf8_lossy(&listed.stderr).trim()
                ));
                continue;
            }
            let dependencies: Vec<String> = String::from_utf8_lossy(&listed.stdout)
                .lines()
                .map(str::to_owned)
                .collect();
            let mut all = dependencies.clone();
            all.push(library.clone());
            let (mut without, mut with) = (Vec::new(), Vec::new());
            for _ in 0..runs {
                without.push(self.dlopen_tables(program, &dependencies)?);
                with.push(self.dlopen_tables(program, &all)?);
            }
            return Ok(LibraryBuild {
                library,
                size,
                dependencies: dependencies.len(),
                without,
                with,
                skipped,
            });
        }
        bail!(
            "no library of the machine could be dlopen()ed: {}",
            skipped.join("; ")
        )
    }
}

/// Unwind-row capacity of the largest-library runs (64 MiB of map; the default is 2^21).
const LIBRARY_ROWS: u32 = 1 << 23;
/// heapprofd's default `--max-unwind-rows`.
const DEFAULT_ROWS: u64 = 1 << 21;

/// The largest library's table build (see `Bench::largest_library`).
struct LibraryBuild {
    library: String,
    size: u64,
    dependencies: usize,
    without: Vec<Tables>,
    with: Vec<Tables>,
    /// Larger libraries that could not be loaded, and why.
    skipped: Vec<String>,
}

impl LibraryBuild {
    /// The summary's section and the JSON object.
    fn report(&self, runs: usize) -> (String, String) {
        let median = |tables: &[Tables], field: fn(&Tables) -> u64| {
            spread(&tables.iter().map(|t| field(t) as f64).collect::<Vec<_>>())
        };
        let build_with = median(&self.with, |t| t.build_ms);
        let build_without = median(&self.without, |t| t.build_ms);
        let build = build_with.median - build_without.median;
        let more = |field: fn(&Tables) -> u64| {
            median(&self.with, field).median - median(&self.without, field).median
        };
        let (rows, rules, kib) = (more(|t| t.rows), more(|t| t.rules), more(|t| t.kib));
        let rows_with = median(&self.with, |t| t.rows).median;
        let not_fitting = self.with.iter().map(|t| t.not_fitting).max().unwrap_or(0);
        let objects = (
            median(&self.without, |t| t.objects).median,
            median(&self.with, |t| t.objects).median,
        );
        let mut text = String::new();
        let _ = writeln!(
            text,
            "## Unwind-table build of the largest library ({runs} runs with it, {runs} without, interleaved)\n"
        );
        for skipped in &self.skipped {
            let _ = writeln!(text, "skipped (larger, not loadable): {skipped}");
        }
        let _ = writeln!(
            text,
            "{} ({} MiB, the largest {}*.so* of {}), dlopen()ed by bench_dlopen under heapprofd (launch mode) after its {} dependencies; the baseline runs load the dependencies only",
            self.library,
            self.size >> 20,
            if self.skipped.is_empty() {
                ""
            } else {
                "loadable "
            },
            Path::new(&self.library)
                .parent()
                .map_or("?".into(), |p| p.display().to_string()),
            self.dependencies
        );
        let _ = writeln!(
            text,
            "its table: {rows:.0} rows, {rules:.0} more rules, {kib:.0} KiB more BPF map memory (objects {:.0} -> {:.0}; {rows_with:.0} rows in all, {} the default --max-unwind-rows {DEFAULT_ROWS}{})",
            objects.0,
            objects.1,
            if rows_with <= DEFAULT_ROWS as f64 {
                "within"
            } else {
                "beyond"
            },
            if not_fitting > 0 {
                format!("; {not_fitting} objects did not fit")
            } else {
                String::new()
            }
        );
        let _ = writeln!(
            text,
            "build and load of its table: {build:.0} ms = {:.0} ms with it ({:.0}-{:.0}) - {:.0} ms without it ({:.0}-{:.0}), medians of heapprofd's `built in` figure",
            build_with.median,
            build_with.min,
            build_with.max,
            build_without.median,
            build_without.min,
            build_without.max
        );
        let list = |tables: &[Tables]| {
            tables
                .iter()
                .map(Tables::json)
                .collect::<Vec<_>>()
                .join(", ")
        };
        let json = format!(
            "{{\"library\": {}, \"size_bytes\": {}, \"dependencies\": {}, \"rows\": {}, \"rules\": {}, \"bpf_map_kib\": {}, \"build_ms\": {}, \"build_ms_with\": {}, \"build_ms_without\": {}, \"with\": [{}], \"without\": [{}], \"skipped\": [{}]}}",
            json_string(&self.library),
            self.size,
            self.dependencies,
            json_number(rows),
            json_number(rules),
            json_number(kib),
            json_number(build),
            json_number(build_with.median),
            json_number(build_without.median),
            list(&self.with),
            list(&self.without),
            self.skipped
                .iter()
                .map(|s| json_string(s))
                .collect::<Vec<_>>()
                .join(", ")
        );
        (text, json)
    }
}

/// The shared objects (`*.so*`) of the machine's library directory, largest first;
/// symbolic links are left out.
fn libraries_by_size() -> Vec<(PathBuf, u64)> {
    let dir = format!("/usr/lib/{}-linux-gnu", std::env::consts::ARCH);
    let mut found: Vec<(PathBuf, u64)> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .filter_map(Result::ok)
        .filter(|e| e.file_name().to_string_lossy().contains(".so"))
        .filter_map(|e| {
            let meta = std::fs::symlink_metadata(e.path()).ok()?;
            meta.is_file().then(|| (e.path(), meta.len()))
        })
        .collect();
    found.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    found
}

#[derive(Clone, Copy)]
struct Spread {
    median: f64,
    min: f64,
    max: f64,
}

fn spread(values: &[f64]) -> Spread {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let n = sorted.len();
    let median = if n == 0 {
        f64::NAN
    } else if n % 2 == 1 {
        sorted[n / 2]
    } else {
        (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0
    };
    Spread {
        median,
        min: sorted.first().copied().unwrap_or(f64::NAN),
        max: sorted.last().copied().unwrap_or(f64::NAN),
    }
}

fn json_number(value: f64) -> String {
    if value.is_finite() {
        format!("{value:.6}")
    } else {
        "null".into()
    }
}

fn json_string(text: &str) -> String {
    let mut out = String::from("\"");
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// Sections of the benchmark besides the workloads, which `--only` can also name
/// (`none`: no section, the workloads named alone).
const SECTIONS: [&str; 7] = [
    "library", "dumps", "shutdown", "load", "redis", "launch", "none",
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
    let bench = Bench {
        heapprofd: heapprofd.to_owned(),
        dir: dir.clone(),
    };
    let load_before = load_average();
    let named_sections = named_sections(options, &workloads)?;
    // Sections named: those alone (with the workloads named); none named: all.
    let section = |key: &str| named_sections.is_empty() || named_sections.contains(&key);
    let mut summary = Summary::default();
    let chosen = |w: &&Workload| options.only.is_empty() || options.only.iter().any(|k| k == w.key);
    for workload in workloads.iter().filter(chosen) {
        workload::measure(&bench, workload, options, &mut summary)?;
    }
    let mut json = SectionsJson::default();
    if section("launch") {
        note_foreign_tracers("launch", &mut summary.warnings);
        let report = launch::section(
            &bench,
            &programs.stl,
            options.runs,
            options.quick,
            &mut summary.text,
        )?;
        for (key, goal) in &report.goals {
            let _ = writeln!(summary.goals_text, "{key} (launch): {}", goal.describe());
            summary.json_goals.push(goal.json(key));
        }
        json.launch = report.json;
    }
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
    if section("library") {
        note_foreign_tracers("largest library", &mut summary.warnings);
        json.library =
            sections::largest_library(&bench, &programs.dlopen, options.runs, &mut summary.text)?;
    }
    if section("dumps") {
        note_foreign_tracers("profile dumps", &mut summary.warnings);
        json.dumps = sections::dumps(&bench, &programs.stacks, options.runs, &mut summary.text)?;
    }
    if section("shutdown") {
        note_foreign_tracers("shutdown", &mut summary.warnings);
        json.shutdown =
            sections::shutdown(&bench, &programs.pairs, options.runs, &mut summary.text)?;
    }
    if section("redis") {
        note_foreign_tracers("redis", &mut summary.warnings);
        json.redis = redis::section(&bench, options.runs, options.quick, &mut summary.text)?;
    }
    if section("load") {
        note_foreign_tracers("daemon load", &mut summary.warnings);
        let seconds = if options.quick { 12 } else { 35 };
        json.load = sections::daemon_load(&bench, &programs.churn, seconds, &mut summary.text)?;
    }
    write_summary(&dir, options, &load_before, &summary, &json)
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

/// The benchmark's programs, compiled into target/bench from xtask/workloads/bench_*.
struct Programs {
    pairs: PathBuf,
    churn: PathBuf,
    stacks: PathBuf,
    stl: PathBuf,
    dlopen: PathBuf,
}

impl Programs {
    fn compile(dir: &Path) -> Result<Self> {
        step("compiling the benchmark workloads (xtask/workloads/bench_*)");
        let programs = Programs {
            pairs: dir.join("bench_pairs"),
            churn: dir.join("bench_churn"),
            stacks: dir.join("bench_stacks"),
            stl: dir.join("bench_stl"),
            dlopen: dir.join("bench_dlopen"),
        };
        compile("bench_pairs.c", &programs.pairs, &["-O2"])?;
        compile("bench_churn.c", &programs.churn, &["-O2", "-pthread"])?;
        compile(
            "bench_stacks.c",
            &programs.stacks,
            &[
                "-O2",
                "-fno-omit-frame-pointer",
                "-fno-optimize-sibling-calls",
            ],
        )?;
        // Plain -O2: no frame pointers (the x86-64 default), as the true-stacks test builds it.
        compile_with("g++", "bench_stl.cpp", &programs.stl, &["-O2"])?;
        compile("bench_dlopen.c", &programs.dlopen, &["-O2"])?;
        Ok(programs)
    }
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

/// What the workloads and sections write to summary.txt and summary.json, gathered as
/// they run.
#[derive(Default)]
struct Summary {
    /// The body of summary.txt, after its heading.
    text: String,
    /// The goals, one line each, for the summary's list of them.
    goals_text: String,
    /// Each workload's unwind tables, one line each.
    tables_text: String,
    /// Warnings of other tracers, also in the heading.
    warnings: Vec<String>,
    json_workloads: Vec<String>,
    json_goals: Vec<String>,
}

/// The sections' parts of summary.json: `null` (or empty) for a section not run.
struct SectionsJson {
    launch: String,
    library: String,
    dumps: Vec<String>,
    shutdown: Vec<String>,
    redis: String,
    /// The daemon-load section's CPU s, wall s and peak RSS (KiB).
    load: (f64, f64, u64),
}

impl Default for SectionsJson {
    fn default() -> Self {
        SectionsJson {
            launch: "null".to_owned(),
            library: "null".to_owned(),
            dumps: Vec::new(),
            shutdown: Vec::new(),
            redis: "null".to_owned(),
            load: (f64::NAN, f64::NAN, 0),
        }
    }
}

/// Writes target/bench/summary.{txt,json} and prints the text.
fn write_summary(
    dir: &Path,
    options: &Options,
    load_before: &str,
    summary: &Summary,
    sections: &SectionsJson,
) -> Result<()> {
    let (cpu, wall, rss) = sections.load;
    let json = format!(
        "{{\n  \"load_average\": {{\"start\": {}, \"end\": {}}},\n  \"warnings\": [{}],\n  \"workloads\": [\n    {}\n  ],\n  \"goals\": [\n    {}\n  ],\n  \"largest_library\": {},\n  \"dumps\": [{}],\n  \"shutdown\": {{{}}},\n  \"redis\": {},\n  \"launch\": {},\n  \"daemon_load\": {{\"seconds\": {}, \"cpu_s\": {}, \"cpu_percent_of_core\": {}, \"peak_rss_kib\": {rss}}}\n}}\n",
        json_string(load_before),
        json_string(&load_average()),
        summary
            .warnings
            .iter()
            .map(|w| json_string(w))
            .collect::<Vec<_>>()
            .join(", "),
        summary.json_workloads.join(",\n    "),
        summary.json_goals.join(",\n    "),
        sections.library,
        sections.dumps.join(", "),
        sections.shutdown.join(", "),
        sections.redis,
        sections.launch,
        json_number(wall),
        json_number(cpu),
        json_number(cpu / wall * 100.0),
    );
    let mut heading = format!(
        "# heapprofd benchmark ({} runs per mode{}; load average {load_before} at the start, {} at the end)\n# added us/alloc = (median - bare median) / allocations counted by heapprofd exact\n# x floor = added / added of the trap floor (heapprofd --empty-programs: same probes, programs that do nothing)\n",
        options.runs,
        if options.quick { ", --quick" } else { "" },
        load_average()
    );
    for warning in &summary.warnings {
        let _ = writeln!(heading, "# {warning}");
    }
    let text = &summary.text;
    std::fs::write(dir.join("summary.txt"), format!("{heading}{text}"))?;
    std::fs::write(dir.join("summary.json"), json)?;
    println!("{heading}{text}");
    println!(
        "Written: {} and {}",
        dir.join("summary.txt").display(),
        dir.join("summary.json").display()
    );
    Ok(())
}

/// The C++ workload needs g++ (the `gcc` package has no C++ compiler).
fn ensure_gxx() -> Result<()> {
    let works = || {
        Command::new("g++")
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    if works() {
        return Ok(());
    }
    step("installing g++ (the C++ workload) with apt-get");
    let install = || {
        Command::new("apt-get")
            .args(["install", "-y", "--no-install-recommends", "g++"])
            .env("DEBIAN_FRONTEND", "noninteractive")
            .status()
            .is_ok_and(|s| s.success())
    };
    if !install() {
        let _ = Command::new("apt-get").arg("update").status();
        if !install() {
            bail!("cannot install g++ with apt-get; install it and run again");
        }
    }
    Ok(())
}

/// bpftrace needs tracefs (it detaches uprobes through it).
fn ensure_tracefs() -> Result<()> {
    if Path::new("/sys/kernel/tracing/uprobe_events").exists() {
        return Ok(());
    }
    step("mounting tracefs at /sys/kernel/tracing (bpftrace needs it)");
    let status = Command::new("mount")
        .args(["-t", "tracefs", "tracefs", "/sys/kernel/tracing"])
        .status()
        .context("running mount")?;
    if !status.success() {
        bail!("cannot mount tracefs at /sys/kernel/tracing");
    }
    Ok(())
}
