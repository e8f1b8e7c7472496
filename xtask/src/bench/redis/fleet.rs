//! The fleet section: redis-server under the packaged unit's flags (`--all
//! --sample-rate 512KiB`), each mode against bare redis in the same rounds:
//!
//! - `after`: `--preload system`, redis started after heapprofd (it joins in-process
//!   from its start);
//! - `before`: `--preload system`, redis started before heapprofd (joined through the
//!   library heapprofd loads into it at its start);
//! - `probes`: the unit's flags alone, redis on the allocator's probes;
//! - `entry left`: the system-wide preload's entry and library left by a heapprofd
//!   killed with SIGKILL, no heapprofd running (the library loaded, inert).
//!
//! And the inert entry under a C++ allocation workload: the launch section's STL
//! program (`bench_stl`) in a namespace with the entry left, in turns with the same in
//! a namespace without it.
//!
//! The client, `redis-benchmark`, runs beside redis and is traced too, as on a host
//! of the fleet (joined when it starts under the system-wide preload).
//!
//! The system-wide preload changes how every program starts, so those modes run
//! heapprofd, redis and the client in a private mount namespace (a holder process made by
//! `unshare -m`, entered with `nsenter`) whose `/etc` and `/var/lib` are overlays and
//! whose `/run/heapprofd` is its own: the machine's `/etc/ld.so.preload` is never
//! touched.

use std::{
    fmt::Write as _,
    io::Write as _,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};
use serde_json::{Map, Value, json};

use super::{TESTS, client_with, requests_per_test, server::Redis, spread_of};
use crate::{
    bench::{
        Bench,
        process::{cpu_seconds, interrupt, rotated_rounds},
        summary::{number, spread},
    },
    step,
};

/// The unit's flags that matter here (its output directory and retention aside).
const UNIT_FLAGS: [&str; 5] = ["--all", "--interval", "60s", "--sample-rate", "512KiB"];

/// The unit's flags with the system-wide preload.
fn system_flags() -> Vec<&'static str> {
    UNIT_FLAGS
        .iter()
        .copied()
        .chain(["--preload", "system"])
        .collect()
}

/// The goal for a redis joined by the system-wide preload (after or before the
/// daemon), as a fraction of bare's requests/s.
const JOINED_GOAL: f64 = 0.95;

#[derive(Clone, Copy, PartialEq, Eq)]
enum FleetMode {
    Bare,
    After,
    Before,
    Probes,
    EntryLeft,
}

impl FleetMode {
    const ALL: [FleetMode; 5] = [
        FleetMode::Bare,
        FleetMode::After,
        FleetMode::Before,
        FleetMode::Probes,
        FleetMode::EntryLeft,
    ];

    fn name(self) -> &'static str {
        match self {
            FleetMode::Bare => "bare",
            FleetMode::After => "--preload system, redis after",
            FleetMode::Before => "--preload system, redis before",
            FleetMode::Probes => "unit flags, probes",
            FleetMode::EntryLeft => "entry left, no heapprofd",
        }
    }

    fn key(self) -> &'static str {
        match self {
            FleetMode::Bare => "bare",
            FleetMode::After => "system_preload_started_after",
            FleetMode::Before => "system_preload_started_before",
            FleetMode::Probes => "unit_flags_probes",
            FleetMode::EntryLeft => "entry_left_inert",
        }
    }

    fn index(self) -> usize {
        FleetMode::ALL
            .iter()
            .position(|m| *m == self)
            .unwrap_or_default()
    }
}

/// A private mount namespace, held by a `sleep` that `unshare` started.
struct Namespace {
    holder: Child,
}

impl Namespace {
    /// Makes one under `dir` (overlays' upper layers there).
    fn new(dir: &Path) -> Result<Namespace> {
        let _ = std::fs::remove_dir_all(dir);
        for sub in ["etc-up", "etc-work", "var-up", "var-work"] {
            std::fs::create_dir_all(dir.join(sub))
                .with_context(|| format!("creating {}", dir.join(sub).display()))?;
        }
        let ready = dir.join("ready");
        let d = dir.display();
        let script = format!(
            "mount -t overlay overlay -o lowerdir=/etc,upperdir={d}/etc-up,workdir={d}/etc-work /etc && \
             mount -t overlay overlay -o lowerdir=/var/lib,upperdir={d}/var-up,workdir={d}/var-work /var/lib && \
             mkdir -p /run/heapprofd && mount -t tmpfs tmpfs /run/heapprofd && \
             touch {ready} && exec sleep infinity",
            ready = ready.display()
        );
        let holder = Command::new("unshare")
            .args(["-m", "--propagation", "private", "sh", "-c", &script])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("running unshare -m (util-linux)")?;
        let mut namespace = Namespace { holder };
        let deadline = Instant::now() + Duration::from_secs(10);
        while !ready.exists() {
            if Instant::now() > deadline || namespace.holder.try_wait()?.is_some() {
                bail!("the private mount namespace could not be set up (overlayfs, tmpfs)");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(namespace)
    }

    /// `program` run inside the namespace.
    fn command(&self, program: &str) -> Command {
        let mut command = Command::new("nsenter");
        command
            .args(["-t", &self.holder.id().to_string(), "-m", "--"])
            .arg(program);
        command
    }
}

impl Drop for Namespace {
    fn drop(&mut self) {
        let _ = self.holder.kill();
        let _ = self.holder.wait();
    }
}

/// A heapprofd of the section, ready.
struct Daemon {
    child: Child,
    stats: PathBuf,
}

impl Daemon {
    /// Starts `heapprofd FLAGS` (in `namespace` if given) and waits until it is ready.
    fn start(bench: &Bench, namespace: Option<&Namespace>, flags: &[&str]) -> Result<Daemon> {
        let stats = bench.stats_path();
        let ready = stats.with_extension("ready");
        let _ = std::fs::remove_file(&ready);
        let heapprofd = bench.heapprofd.display().to_string();
        let mut command = match namespace {
            Some(namespace) => namespace.command(&heapprofd),
            None => Command::new(&heapprofd),
        };
        let mut child = command
            .args(flags)
            .arg("-o")
            .arg(bench.dir.join("profiles").join("fleet"))
            .arg("--stats-json")
            .arg(&stats)
            .arg("--ready-file")
            .arg(&ready)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("starting heapprofd")?;
        // --all reads every process's tables at start: give it time.
        let deadline = Instant::now() + Duration::from_secs(180);
        while !ready.exists() {
            if let Some(status) = child.try_wait()? {
                bail!(
                    "heapprofd {} ended before it was ready: {status}",
                    flags.join(" ")
                );
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                bail!("heapprofd {} was not ready within 180 s", flags.join(" "));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(Daemon { child, stats })
    }

    /// SIGINT, then its `system_preload.joined` figure (`None` without one).
    fn stop(mut self) -> Result<Option<u64>> {
        interrupt(&self.child);
        let status = self.child.wait()?;
        if !status.success() {
            bail!("heapprofd ended with {status}");
        }
        let text = std::fs::read_to_string(&self.stats)
            .with_context(|| format!("reading {}", self.stats.display()))?;
        let stats: Value = serde_json::from_str(&text).context("reading --stats-json")?;
        Ok(stats["system_preload"]["joined"].as_u64())
    }

    /// SIGKILL: what a crash leaves behind.
    fn kill(mut self) -> Result<()> {
        self.child.kill()?;
        self.child.wait()?;
        Ok(())
    }
}

/// One timed pass.
struct Pass {
    requests_per_second: f64,
    cpu_us_per_request: f64,
    /// `--preload system` modes: processes the library joined over the run.
    joined: Option<u64>,
}

/// One pass in `mode`.
fn pass(bench: &Bench, mode: FleetMode, requests: u32) -> Result<Pass> {
    let system = system_flags();
    let namespace = match mode {
        FleetMode::After | FleetMode::Before | FleetMode::EntryLeft => {
            Some(Namespace::new(&bench.dir.join("fleet-namespace"))?)
        }
        FleetMode::Bare | FleetMode::Probes => None,
    };
    let taskset = || match &namespace {
        Some(namespace) => namespace.command("taskset"),
        None => Command::new("taskset"),
    };
    let (redis, daemon) = match mode {
        FleetMode::Bare => (Redis::start()?, None),
        FleetMode::After => {
            let daemon = Daemon::start(bench, namespace.as_ref(), &system)?;
            (Redis::start_with(taskset())?, Some(daemon))
        }
        FleetMode::Before => {
            let redis = Redis::start_with(taskset())?;
            (
                redis,
                Some(Daemon::start(bench, namespace.as_ref(), &system)?),
            )
        }
        FleetMode::Probes => {
            let redis = Redis::start()?;
            (redis, Some(Daemon::start(bench, None, &UNIT_FLAGS)?))
        }
        FleetMode::EntryLeft => {
            Daemon::start(bench, namespace.as_ref(), &system)?.kill()?;
            (Redis::start_with(taskset())?, None)
        }
    };
    // The client runs where redis runs: in the namespace it is a program started
    // after heapprofd too (joined, with the preload), as on a host of the fleet.
    client_with(taskset(), "set,get", requests / 5)?;
    let cpu_before = cpu_seconds(redis.pid())?;
    let started = Instant::now();
    client_with(taskset(), TESTS, requests)?;
    let wall = started.elapsed().as_secs_f64();
    let cpu = cpu_seconds(redis.pid())? - cpu_before;
    drop(redis);
    let joined = match daemon {
        Some(daemon) => daemon.stop()?,
        None => None,
    };
    let total = f64::from(requests) * TESTS.split(',').count() as f64;
    Ok(Pass {
        requests_per_second: total / wall,
        cpu_us_per_request: cpu / total * 1e6,
        joined,
    })
}

/// One run of `stl ROUNDS` in `namespace`: its wall seconds.
fn stl_run(namespace: &Namespace, stl: &Path, rounds: u32) -> Result<f64> {
    let started = Instant::now();
    let mut child = namespace
        .command(&stl.display().to_string())
        .arg(rounds.to_string())
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("starting bench_stl")?;
    // It waits for a line (so that a tracer can attach first); dropped, stdin closes.
    child
        .stdin
        .take()
        .context("bench_stl's stdin")?
        .write_all(b"go\n")
        .context("starting bench_stl's work")?;
    let status = child.wait()?;
    if !status.success() {
        bail!("bench_stl ended with {status}");
    }
    Ok(started.elapsed().as_secs_f64())
}

/// The inert entry under the C++ workload `stl`: wall time with the entry (left by a
/// SIGKILLed heapprofd) against without, pair by pair in alternating order; appends
/// its lines to `text` and returns its JSON object.
fn cxx_entry_left(
    bench: &Bench,
    stl: &Path,
    runs: usize,
    quick: bool,
    text: &mut String,
) -> Result<Value> {
    let rounds = if quick { 3_000 } else { 10_000 };
    step(&format!(
        "fleet: bench_stl {rounds} (C++ STL workload) with the entry left and without, {runs} pairs"
    ));
    let bare = Namespace::new(&bench.dir.join("fleet-cxx-bare"))?;
    let entry = Namespace::new(&bench.dir.join("fleet-cxx-entry"))?;
    let system = system_flags();
    Daemon::start(bench, Some(&entry), &system)?.kill()?;
    let list = format!("/proc/{}/root/etc/ld.so.preload", entry.holder.id());
    let listed = std::fs::read_to_string(&list).with_context(|| format!("reading {list}"))?;
    if !listed.contains("heapprofd") {
        bail!("the killed heapprofd left no entry in the namespace's /etc/ld.so.preload");
    }
    // Warm-up: page cache and CPU frequency alike for both.
    stl_run(&bare, stl, rounds)?;
    stl_run(&entry, stl, rounds)?;
    let (mut bare_times, mut entry_times, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    for pair in 0..runs.max(3) {
        let (without, with) = if pair % 2 == 0 {
            let without = stl_run(&bare, stl, rounds)?;
            (without, stl_run(&entry, stl, rounds)?)
        } else {
            let with = stl_run(&entry, stl, rounds)?;
            (stl_run(&bare, stl, rounds)?, with)
        };
        eprintln!(
            "xtask:   pair {} bench_stl {without:.3} s bare, {with:.3} s entry left",
            pair + 1
        );
        bare_times.push(without);
        entry_times.push(with);
        ratios.push(without / with);
    }
    let (bare_s, entry_s, ratio) = (spread(&bare_times), spread(&entry_times), spread(&ratios));
    let _ = writeln!(
        text,
        "\nC++ STL workload (bench_stl {rounds}), {} pairs: bare {:.3} s, entry left {:.3} s (median); \
         entry left {:.3}x bare's speed (pairs {:.3}-{:.3}; goal >= 0.99x)",
        ratios.len(),
        bare_s.median,
        entry_s.median,
        ratio.median,
        ratio.min,
        ratio.max
    );
    Ok(json!({
        "rounds": rounds,
        "pairs": ratios.len(),
        "bare_seconds": number(bare_s.median),
        "entry_left_seconds": number(entry_s.median),
        "to_bare": number(ratio.median),
        "goal_met": ratio.median.is_finite().then_some(ratio.median >= 0.99),
    }))
}

/// Runs the section; appends its table to `text` and returns its JSON object. `stl`:
/// the C++ workload the inert entry is measured under too.
pub fn section(
    bench: &Bench,
    stl: &Path,
    runs: usize,
    quick: bool,
    text: &mut String,
) -> Result<Value> {
    let requests = requests_per_test(quick);
    step(&format!(
        "fleet: redis-benchmark -t {TESTS} -n {requests} under the unit's flags, {runs} runs x {} modes",
        FleetMode::ALL.len()
    ));
    let (passes, failures) = rotated_rounds(
        "fleet",
        &FleetMode::ALL,
        runs,
        FleetMode::name,
        |p: &Pass| p.requests_per_second,
        |mode| pass(bench, mode, requests),
    );
    let rate = |mode: FleetMode| spread_of(&passes[mode.index()], |p| p.requests_per_second).median;
    let bare_rps = rate(FleetMode::Bare);
    write_table_heading(text, runs);
    let mut json = Map::new();
    for mode in FleetMode::ALL {
        let (line, mode_json) = mode_row(
            mode,
            &passes[mode.index()],
            failures[mode.index()].as_deref(),
            bare_rps,
        );
        let _ = writeln!(text, "{line}");
        json.insert(mode.key().to_owned(), mode_json);
    }
    let goals = write_goals(text, |mode| rate(mode) / bare_rps);
    json.insert("goals".to_owned(), goals);
    let cxx = cxx_entry_left(bench, stl, runs, quick, text).unwrap_or_else(|err| {
        eprintln!("xtask:   fleet, the C++ workload with the entry left failed: {err:#}");
        json!({ "failed": format!("{err:#}") })
    });
    json.insert("cxx_entry_left".to_owned(), cxx);
    Ok(Value::Object(json))
}

/// Appends the section's title and its table's column heads to `text`.
fn write_table_heading(text: &mut String, runs: usize) {
    let _ = writeln!(
        text,
        "\n## The fleet daemon: redis-server under `heapprofd {}` ({runs} runs)\n",
        UNIT_FLAGS.join(" ")
    );
    let _ = writeln!(
        text,
        "{:<34} {:>12} {:>14} {:>10} {:>10} {:>8}",
        "mode", "requests/s", "min-max", "x bare", "cpu us/req", "joined"
    );
}

/// The table row and JSON member of `mode` (its passes, and why it failed if it did).
fn mode_row(
    mode: FleetMode,
    passes: &[Pass],
    failure: Option<&str>,
    bare_rps: f64,
) -> (String, Value) {
    let rates = spread_of(passes, |p| p.requests_per_second);
    let cpu = spread_of(passes, |p| p.cpu_us_per_request).median;
    let joined = passes.iter().filter_map(|p| p.joined).min();
    let line = match failure {
        Some(failure) if passes.is_empty() => {
            format!("{:<34} failed: {failure}", mode.name())
        }
        _ => format!(
            "{:<34} {:>12.0} {:>6.0}-{:<7.0} {:>10.3} {:>10.2} {:>8}",
            mode.name(),
            rates.median,
            rates.min,
            rates.max,
            rates.median / bare_rps,
            cpu,
            joined.map_or("-".into(), |n| n.to_string())
        ),
    };
    let json = json!({
        "runs": passes.len(),
        "requests_per_second": number(rates.median),
        "to_bare": number(rates.median / bare_rps),
        "cpu_us_per_request": number(cpu),
        "processes_joined": joined,
        "failed": failure,
    });
    (line, json)
}

/// Appends the goals' line (each mode's requests/s by `ratio`, a fraction of bare's)
/// and returns their JSON object; figures, never pass/fail.
fn write_goals(text: &mut String, ratio: impl Fn(FleetMode) -> f64) -> Value {
    let goal = |value: f64| value.is_finite().then_some(value >= JOINED_GOAL);
    let _ = writeln!(
        text,
        "goals (figures, not pass/fail): started after {:.3}x, started before {:.3}x (goal >= {JOINED_GOAL:.2}x each); probes {:.3}x; entry left {:.3}x (goal >= 0.99x)",
        ratio(FleetMode::After),
        ratio(FleetMode::Before),
        ratio(FleetMode::Probes),
        ratio(FleetMode::EntryLeft)
    );
    json!({
        "started_after_met": goal(ratio(FleetMode::After)),
        "started_before_met": goal(ratio(FleetMode::Before)),
        "entry_left_met": ratio(FleetMode::EntryLeft).is_finite().then(|| ratio(FleetMode::EntryLeft) >= 0.99),
    })
}
