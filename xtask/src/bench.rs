//! `cargo xtask bench`: what heapprofd costs, against baselines measured in the same run.
//!
//! Each workload waits on stdin until the tool under test has attached to it (`--pid`,
//! `bpftrace -p`), then the clock runs from "go" to the workload's exit. Modes are
//! interleaved run by run so that drift on a noisy machine hits all of them alike;
//! medians and ranges are reported, and ratios only between medians of one run.

use std::{
    collections::BTreeMap,
    fmt::Write as _,
    io::{BufRead as _, BufReader, Write as _},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::mpsc,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};

use crate::{step, workspace_root};

/// Settings of a benchmark run.
pub struct Options {
    /// Repetitions of each workload x mode.
    pub runs: usize,
    /// Smaller workloads and a shorter daemon-load run.
    pub quick: bool,
}

#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
enum Mode {
    Bare,
    EmptyProbes,
    Bpftrace,
    HeapprofdEntry,
    Heapprofd,
    HeapprofdSampled,
}

impl Mode {
    const ALL: [Mode; 6] = [
        Mode::Bare,
        Mode::EmptyProbes,
        Mode::Bpftrace,
        Mode::HeapprofdEntry,
        Mode::Heapprofd,
        Mode::HeapprofdSampled,
    ];

    fn name(self) -> &'static str {
        match self {
            Mode::Bare => "bare",
            Mode::EmptyProbes => "empty entry probes",
            Mode::Bpftrace => "bpftrace memleak",
            Mode::HeapprofdEntry => "heapprofd exact, entry probes",
            Mode::Heapprofd => "heapprofd exact",
            Mode::HeapprofdSampled => "heapprofd sampled 512KiB",
        }
    }

    fn key(self) -> &'static str {
        match self {
            Mode::Bare => "bare",
            Mode::EmptyProbes => "empty_entry_probes",
            Mode::Bpftrace => "bpftrace_memleak",
            Mode::HeapprofdEntry => "heapprofd_exact_entry",
            Mode::Heapprofd => "heapprofd_exact",
            Mode::HeapprofdSampled => "heapprofd_sampled",
        }
    }
}

/// A workload: a command that reads one line on stdin before it starts.
struct Workload {
    name: &'static str,
    command: Vec<String>,
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
    /// heapprofd only: its CPU seconds, peak RSS (KiB) and the allocations it counted.
    daemon_cpu: Option<f64>,
    daemon_rss_kib: Option<u64>,
    allocations: Option<u64>,
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
    let root = workspace_root();
    let status = Command::new("gcc")
        .args(flags)
        .arg("-o")
        .arg(output)
        .arg(root.join("xtask/workloads").join(source))
        .status()
        .context("running gcc")?;
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
        let mut tool = match mode {
            Mode::Bare => None,
            Mode::EmptyProbes | Mode::Bpftrace => {
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
            Mode::HeapprofdEntry | Mode::Heapprofd | Mode::HeapprofdSampled => {
                let extra: &[&str] = match mode {
                    Mode::HeapprofdEntry => &["--interval", "1h", "--probe-placement", "entry"],
                    Mode::HeapprofdSampled => &["--interval", "1h", "--sample-rate", "512KiB"],
                    _ => &["--interval", "1h"],
                };
                let child = self
                    .heapprofd_command(extra, pid)
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
                let ready = if mode == Mode::EmptyProbes || mode == Mode::Bpftrace {
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

        let started = Instant::now();
        send_go(&mut target)?;
        let status = target.wait()?;
        let wall = started.elapsed().as_secs_f64();
        if !status.success() {
            bail!("{} failed under {}: {status}", workload.name, mode.name());
        }
        let mut run = Run {
            wall,
            ..Run::default()
        };
        if let Some(child) = tool {
            if matches!(mode, Mode::EmptyProbes | Mode::Bpftrace) {
                interrupt(&child);
            }
            let (cpu, rss) = wait_with_usage(child.id())?;
            if let Some(lines) = lines {
                log.extend(lines.try_iter());
            }
            if !matches!(mode, Mode::EmptyProbes | Mode::Bpftrace) {
                run.daemon_cpu = Some(cpu);
                run.daemon_rss_kib = Some(rss);
                run.allocations = counted_allocations(&log);
            }
        }
        Ok(run)
    }

    /// heapprofd with --bpf-stats on one run of `workload`: its log line of run times.
    fn bpf_stats(&self, workload: &Workload) -> Result<String> {
        let mut target = start_workload(&mut workload.command())?;
        let Daemon {
            mut child,
            lines,
            mut log,
        } = self.start_heapprofd(&["--interval", "1h", "--bpf-stats"], target.id())?;
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

/// Runs the benchmark and writes target/bench/summary.{txt,json}.
pub fn bench(heapprofd: &Path, options: &Options) -> Result<()> {
    if !crate::is_root() {
        bail!("the benchmark attaches BPF programs: run it as root (sudo -E cargo xtask bench)");
    }
    if options.runs == 0 {
        bail!("--runs must be at least 1");
    }
    ensure_tracefs()?;
    let dir = workspace_root().join("target/bench");
    std::fs::create_dir_all(&dir)?;
    step("compiling the benchmark workloads (xtask/workloads/bench_*.c)");
    let pairs = dir.join("bench_pairs");
    let churn = dir.join("bench_churn");
    let stacks = dir.join("bench_stacks");
    compile("bench_pairs.c", &pairs, &["-O2"])?;
    compile("bench_churn.c", &churn, &["-O2", "-pthread"])?;
    compile(
        "bench_stacks.c",
        &stacks,
        &[
            "-O2",
            "-fno-omit-frame-pointer",
            "-fno-optimize-sibling-calls",
        ],
    )?;
    let scale = if options.quick { 1 } else { 4 };
    let perl_script = format!(
        "<STDIN>; my %h; for my $i (1..{}) {{ $h{{\"key$i\"}} = \"v\" x ($i % 200); delete $h{{\"key\" . ($i - 1000)}} if $i > 1000; }}",
        25_000 * scale
    );
    let workloads = [
        Workload {
            name: "malloc/free pairs (1 thread)",
            command: vec![pairs.display().to_string(), (50_000 * scale).to_string()],
        },
        Workload {
            name: "family churn (2 threads)",
            command: vec![
                churn.display().to_string(),
                "2".into(),
                (10_000 * scale).to_string(),
            ],
        },
        Workload {
            name: "perl hash churn",
            command: vec!["perl".into(), "-e".into(), perl_script],
        },
    ];
    let bench = Bench {
        heapprofd: heapprofd.to_owned(),
        dir: dir.clone(),
    };

    let mut text = String::new();
    let mut json_workloads = Vec::new();
    for workload in &workloads {
        step(&format!(
            "{}: {} runs x {} modes",
            workload.name,
            options.runs,
            Mode::ALL.len()
        ));
        let mut runs: BTreeMap<Mode, Vec<Run>> = BTreeMap::new();
        for round in 0..options.runs {
            for mode in Mode::ALL {
                let run = bench
                    .run(workload, mode)
                    .with_context(|| format!("{} under {}", workload.name, mode.name()))?;
                eprintln!(
                    "xtask:   round {} {:<30} {:8.3} s",
                    round + 1,
                    mode.name(),
                    run.wall
                );
                runs.entry(mode).or_default().push(run);
            }
        }
        let walls = |mode: Mode| -> Vec<f64> { runs[&mode].iter().map(|r| r.wall).collect() };
        let allocations = runs[&Mode::Heapprofd]
            .iter()
            .filter_map(|r| r.allocations)
            .max()
            .context("heapprofd did not report its allocation count")?;
        let bare = spread(&walls(Mode::Bare)).median;
        let added = |mode: Mode| (spread(&walls(mode)).median - bare) / allocations as f64 * 1e6;
        let _ = writeln!(
            text,
            "\n## {} ({allocations} allocations counted by heapprofd)\n",
            workload.name
        );
        let _ = writeln!(
            text,
            "{:<32} {:>9} {:>9} {:>9} {:>13} {:>10} {:>9}",
            "mode", "median s", "min s", "max s", "added us/pair", "daemon cpu", "peak RSS"
        );
        let mut json_modes = Vec::new();
        for mode in Mode::ALL {
            let s = spread(&walls(mode));
            let cpu: Vec<f64> = runs[&mode].iter().filter_map(|r| r.daemon_cpu).collect();
            let rss = runs[&mode].iter().filter_map(|r| r.daemon_rss_kib).max();
            let cpu_median = spread(&cpu).median;
            let _ = writeln!(
                text,
                "{:<32} {:>9.3} {:>9.3} {:>9.3} {:>13.3} {:>10} {:>9}",
                mode.name(),
                s.median,
                s.min,
                s.max,
                added(mode),
                if cpu.is_empty() {
                    "-".into()
                } else {
                    format!("{cpu_median:.3} s")
                },
                rss.map_or("-".into(), |r| format!("{} MiB", r / 1024)),
            );
            json_modes.push(format!(
                "{}: {{\"median_s\": {}, \"min_s\": {}, \"max_s\": {}, \"added_us_per_pair\": {}, \"daemon_cpu_s\": {}, \"daemon_peak_rss_kib\": {}}}",
                json_string(mode.key()),
                json_number(s.median),
                json_number(s.min),
                json_number(s.max),
                json_number(added(mode)),
                json_number(cpu_median),
                rss.map_or("null".into(), |r| r.to_string())
            ));
        }
        let exact = added(Mode::Heapprofd);
        let ratio_bpftrace = exact / added(Mode::Bpftrace);
        let ratio_empty = exact / added(Mode::EmptyProbes);
        let ratio_sampled_empty = added(Mode::HeapprofdSampled) / added(Mode::EmptyProbes);
        let stats = bench.bpf_stats(workload)?;
        let _ = writeln!(
            text,
            "\nheapprofd exact / bpftrace memleak: {ratio_bpftrace:.3}x   heapprofd exact / empty entry probes: {ratio_empty:.3}x   sampled / empty entry probes: {ratio_sampled_empty:.3}x\nheapprofd --bpf-stats: {stats}"
        );
        json_workloads.push(format!(
            "{{\"name\": {}, \"allocations\": {allocations}, \"runs\": {}, \"modes\": {{{}}}, \"ratio_exact_to_bpftrace\": {}, \"ratio_exact_to_empty_probes\": {}, \"ratio_sampled_to_empty_probes\": {}, \"bpf_stats\": {}}}",
            json_string(workload.name),
            options.runs,
            json_modes.join(", "),
            json_number(ratio_bpftrace),
            json_number(ratio_empty),
            json_number(ratio_sampled_empty),
            json_string(&stats)
        ));
    }

    let mut json_dumps = Vec::new();
    let stack_counts: &[u32] = if options.quick {
        &[10_000]
    } else {
        &[10_000, 100_000]
    };
    let _ = writeln!(text, "\n## Profile dumps (read maps, symbolize, encode)\n");
    for &count in stack_counts {
        step(&format!("profile dump with {count} distinct stacks"));
        let (first, cached, rss) = bench.dump_times(&stacks, count)?;
        let _ = writeln!(
            text,
            "{count:>7} stacks: first dump {first}; next dump {cached}; heapprofd peak RSS {} MiB",
            rss / 1024
        );
        json_dumps.push(format!(
            "{{\"stacks\": {count}, \"first_dump\": {}, \"cached_dump\": {}, \"daemon_peak_rss_kib\": {rss}}}",
            json_string(&first),
            json_string(&cached)
        ));
    }

    step("shutdown: heapprofd -- true, and final profile to exit after SIGINT");
    let _ = writeln!(
        text,
        "\n## Shutdown ({} runs each; median, min-max)\n",
        options.runs
    );
    let mut json_shutdown = Vec::new();
    for method in ["auto", "perf-events"] {
        let mut end_to_end = Vec::new();
        let mut after_write = Vec::new();
        for _ in 0..options.runs {
            let (total, tail) = bench.shutdown(method, &pairs)?;
            end_to_end.push(total);
            after_write.push(tail);
        }
        let (total, tail) = (spread(&end_to_end), spread(&after_write));
        let _ = writeln!(
            text,
            "--attach {method:<12} heapprofd -- true: {:.3} s ({:.3}-{:.3}); final profile written to exit: {:.3} s ({:.3}-{:.3})",
            total.median, total.min, total.max, tail.median, tail.min, tail.max
        );
        json_shutdown.push(format!(
            "{}: {{\"end_to_end_true_s\": {}, \"write_to_exit_s\": {}}}",
            json_string(method),
            json_number(total.median),
            json_number(tail.median)
        ));
    }

    let seconds = if options.quick { 12 } else { 35 };
    step(&format!(
        "daemon load: {seconds} s of churn, profiles every 10 s (exact)"
    ));
    let (cpu, wall, rss) = bench.daemon_load(&churn, seconds)?;
    let _ = writeln!(
        text,
        "\n## Daemon load\n\n{seconds} s churn (2 threads), --interval 10s, exact: heapprofd used {cpu:.3} s CPU in {wall:.1} s = {:.2}% of a core, peak RSS {} MiB",
        cpu / wall * 100.0,
        rss / 1024
    );
    let json = format!(
        "{{\n  \"workloads\": [\n    {}\n  ],\n  \"dumps\": [{}],\n  \"shutdown\": {{{}}},\n  \"daemon_load\": {{\"seconds\": {}, \"cpu_s\": {}, \"cpu_percent_of_core\": {}, \"peak_rss_kib\": {rss}}}\n}}\n",
        json_workloads.join(",\n    "),
        json_dumps.join(", "),
        json_shutdown.join(", "),
        json_number(wall),
        json_number(cpu),
        json_number(cpu / wall * 100.0),
    );
    let heading = format!(
        "# heapprofd benchmark ({} runs per mode; added time per pair = (median - bare median) / allocations)\n",
        options.runs
    );
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
