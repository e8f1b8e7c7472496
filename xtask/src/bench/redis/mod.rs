//! The real-service section: Debian's redis-server (linked with jemalloc) under
//! `redis-benchmark`, bare against `heapprofd --pid` attached to it with the allocator's
//! probes (`--inject off`: exact, sampled, the trap floor with `--empty-programs` and the
//! least cost with `--stacks-only`), against `heapprofd --pid` joined in-process (the
//! default `--inject auto`: exact and sampled), and against redis-server launched by
//! heapprofd (`heapprofd -- taskset -c 0 redis-server ...`, exact and sampled; launch mode
//! uses the LD_PRELOAD interposer by default). How heapprofd joined each `--pid` run
//! (`injected` or `probes`) is read from its `--stats-json`. The sampled launch's
//! profile is read back to check that its stacks go through redis's `zmalloc`.
//!
//! redis runs on CPU 0 and the client on CPU 1, so that redis, not the client, is what
//! limits the throughput; heapprofd runs beside the client. Each run starts a fresh
//! redis on a loopback port, warms it, attaches heapprofd (waiting for its probes),
//! then times one `redis-benchmark` pass. Figures per mode: requests per second over the
//! whole pass, redis's own CPU per request, and ratios to bare of the medians.
//! After the timed rounds, one pass each of the sampled floor and sampled on the probes
//! under `--bpf-stats` gives the entry program's time per call (`program_time`).

pub(super) mod fleet;
mod keys;
mod program_time;
mod server;

use std::{
    fmt::Write as _,
    path::Path,
    process::{Command, Stdio},
    time::Instant,
};

use anyhow::{Context as _, Result, bail};
use serde_json::{Map, Value, json};

use self::server::{PORT, Redis};
use crate::{
    bench::{
        Bench,
        figures::{DaemonStats, joined_answer},
        process::{cpu_seconds, rotated_rounds},
        summary::{Spread, number, spread},
    },
    step,
};

/// The commands timed, as the issue measured them.
const TESTS: &str = "set,get,lpush,lpop,sadd,hset";
/// The goal of the sampled launch: at least this fraction of bare redis's requests/s.
const LAUNCH_SAMPLED_GOAL: f64 = 0.95;

#[derive(Clone, Copy, PartialEq, Eq)]
enum RedisMode {
    Bare,
    Floor,
    /// `--empty-programs --sample-rate 524288`: one trap per allocator call (uprobe
    /// session links skip every return), the least any sampler on the probes pays.
    SampledFloor,
    /// `--pid --stacks-only`: every allocation's stack found, nothing counted.
    StacksOnly,
    Exact,
    Sampled,
    /// `--pid` joined in-process (`--inject auto`), exact.
    JoinedExact,
    /// `--pid` joined in-process, `--sample-rate 524288`.
    JoinedSampled,
    /// redis-server launched by heapprofd, exact.
    LaunchExact,
    /// redis-server launched by heapprofd, `--sample-rate 524288`.
    LaunchSampled,
}

impl RedisMode {
    const ALL: [RedisMode; 10] = [
        RedisMode::Bare,
        RedisMode::Floor,
        RedisMode::SampledFloor,
        RedisMode::StacksOnly,
        RedisMode::Exact,
        RedisMode::Sampled,
        RedisMode::JoinedExact,
        RedisMode::JoinedSampled,
        RedisMode::LaunchExact,
        RedisMode::LaunchSampled,
    ];

    fn name(self) -> &'static str {
        match self {
            RedisMode::Bare => "bare",
            RedisMode::Floor => "trap floor (--empty-programs)",
            RedisMode::SampledFloor => "sampled trap floor (one trap per call)",
            RedisMode::StacksOnly => "stacks only (--stacks-only)",
            RedisMode::Exact => "heapprofd --pid exact",
            RedisMode::Sampled => "heapprofd --pid sampled 512KiB",
            RedisMode::JoinedExact => "heapprofd --pid joined exact",
            RedisMode::JoinedSampled => "heapprofd --pid joined 512KiB",
            RedisMode::LaunchExact => "heapprofd launch exact",
            RedisMode::LaunchSampled => "heapprofd launch sampled 512KiB",
        }
    }

    fn key(self) -> &'static str {
        match self {
            RedisMode::Bare => "bare",
            RedisMode::Floor => "heapprofd_empty_programs",
            RedisMode::SampledFloor => "heapprofd_empty_programs_sampled",
            RedisMode::StacksOnly => "heapprofd_stacks_only",
            RedisMode::Exact => "heapprofd_exact",
            RedisMode::Sampled => "heapprofd_sampled",
            RedisMode::JoinedExact => "heapprofd_joined_exact",
            RedisMode::JoinedSampled => "heapprofd_joined_sampled",
            RedisMode::LaunchExact => "heapprofd_launch_exact",
            RedisMode::LaunchSampled => "heapprofd_launch_sampled",
        }
    }

    /// heapprofd's flags for `--pid` on a running redis; `None` for the other modes.
    /// The probe modes say `--inject off`, so that their figures keep meaning the
    /// allocator's probes whatever `--pid` does by default.
    fn flags(self) -> Option<&'static [&'static str]> {
        match self {
            RedisMode::Bare | RedisMode::LaunchExact | RedisMode::LaunchSampled => None,
            RedisMode::Floor => Some(&["--interval", "1h", "--inject", "off", "--empty-programs"]),
            RedisMode::SampledFloor => Some(&[
                "--interval",
                "1h",
                "--inject",
                "off",
                "--empty-programs",
                "--sample-rate",
                "512KiB",
            ]),
            RedisMode::StacksOnly => {
                Some(&["--interval", "1h", "--inject", "off", "--stacks-only"])
            }
            RedisMode::Exact => Some(&["--interval", "1h", "--inject", "off"]),
            RedisMode::Sampled => Some(&[
                "--interval",
                "1h",
                "--inject",
                "off",
                "--sample-rate",
                "512KiB",
            ]),
            RedisMode::JoinedExact => Some(&["--interval", "1h", "--inject", "auto"]),
            RedisMode::JoinedSampled => Some(&[
                "--interval",
                "1h",
                "--inject",
                "auto",
                "--sample-rate",
                "524288",
            ]),
        }
    }

    /// heapprofd's flags when it launches redis; `None` for the other modes.
    fn launch_flags(self) -> Option<&'static [&'static str]> {
        match self {
            RedisMode::LaunchExact => Some(&["--interval", "1h"]),
            RedisMode::LaunchSampled => Some(&["--interval", "1h", "--sample-rate", "524288"]),
            _ => None,
        }
    }

    /// Its index in [`RedisMode::ALL`].
    fn index(self) -> usize {
        RedisMode::ALL
            .iter()
            .position(|m| *m == self)
            .unwrap_or_default()
    }
}

/// One timed pass.
struct Pass {
    requests_per_second: f64,
    /// redis-server's CPU time (user + system) per request, microseconds.
    cpu_us_per_request: f64,
    /// Probes heapprofd placed where the kernel single-steps them.
    single_stepped: Option<usize>,
    /// `--pid` modes: how heapprofd joined redis (`injected` or `probes`, with why not
    /// injected).
    joined: Option<(String, Option<String>)>,
    /// Launch modes: whether the profile's stacks go through `zmalloc` (`None`: no
    /// profile read).
    through_zmalloc: Option<bool>,
}

/// Whether a profile's stacks go through redis's `zmalloc` (any frame naming it), from
/// `go tool pprof -traces`; `None` when go cannot read it.
fn through_zmalloc(profile: &Path) -> Option<bool> {
    let output = Command::new("go")
        .args(["tool", "pprof", "-traces"])
        .arg(profile)
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()
        .ok()
        .filter(|o| o.status.success())?;
    let text = String::from_utf8_lossy(&output.stdout);
    Some(
        text.lines()
            .filter(|l| !l.contains(':'))
            .any(|l| l.contains("zmalloc")),
    )
}

/// `redis-benchmark` on CPU 1: `requests` of each of [`TESTS`] (or `tests`).
fn client(tests: &str, requests: u32) -> Result<()> {
    client_with(Command::new("taskset"), tests, requests)
}

/// [`client`] run by `command` (`taskset` itself, or `nsenter ... -- taskset`).
fn client_with(mut command: Command, tests: &str, requests: u32) -> Result<()> {
    let status = command
        .args([
            "-c",
            "1",
            "redis-benchmark",
            "-p",
            PORT,
            "-c",
            "20",
            "-d",
            "256",
        ])
        .args(["-t", tests, "-n", &requests.to_string(), "-q"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .context("running redis-benchmark")?;
    if !status.success() {
        bail!("redis-benchmark failed: {status}");
    }
    Ok(())
}

/// One pass in `mode`: a fresh redis (bare, attached to or launched), warmed, then timed.
fn pass(bench: &Bench, mode: RedisMode, requests: u32) -> Result<Pass> {
    let mut redis = match mode.launch_flags() {
        Some(flags) => Redis::launch(bench, flags)?,
        None => Redis::start()?,
    };
    client("set,get", requests / 5)?;
    let daemon = match mode.flags() {
        Some(flags) => Some(bench.start_heapprofd(flags, redis.pid())?),
        None => None,
    };
    let cpu_before = cpu_seconds(redis.pid())?;
    let started = Instant::now();
    client(TESTS, requests)?;
    let wall = started.elapsed().as_secs_f64();
    let cpu = cpu_seconds(redis.pid())? - cpu_before;
    let (single_stepped, through_zmalloc, joined) = match daemon {
        Some(daemon) => {
            let stats = DaemonStats::at_stop(daemon)?;
            let joined = stats.joined.map(|j| (j.how, j.reason));
            (Some(stats.single_stepped_probes), None, joined)
        }
        None => match (redis.stop()?, redis.stats()) {
            ((Some(status), _), _) if !status.success() => {
                bail!("heapprofd -- redis-server ended with {status}")
            }
            ((Some(_), _), Some(stats)) => {
                let stats = DaemonStats::read(stats)?;
                let profile = stats.final_profile.path;
                (
                    Some(stats.single_stepped_probes),
                    through_zmalloc(&profile),
                    None,
                )
            }
            _ => (None, None, None),
        },
    };
    let total = f64::from(requests) * TESTS.split(',').count() as f64;
    Ok(Pass {
        requests_per_second: total / wall,
        cpu_us_per_request: cpu / total * 1e6,
        single_stepped,
        through_zmalloc,
        joined,
    })
}

/// The passes of every mode (index of [`RedisMode::ALL`]), and why a mode failed when it
/// did: a failing mode is reported and left out of the later rounds.
struct Passes {
    passes: Vec<Vec<Pass>>,
    failures: Vec<Option<String>>,
}

/// Runs `runs` rounds of every mode, interleaved in rotated order.
fn run_passes(bench: &Bench, runs: usize, requests: u32) -> Passes {
    let (passes, failures) = rotated_rounds(
        "redis",
        &RedisMode::ALL,
        runs,
        RedisMode::name,
        |p: &Pass| p.requests_per_second,
        |mode| pass(bench, mode, requests),
    );
    Passes { passes, failures }
}

/// Checks that the section can run: redis's tools, taskset and two CPUs.
fn check_tools() -> Result<()> {
    for tool in ["redis-server", "redis-benchmark", "redis-cli", "taskset"] {
        if !Path::new("/usr/bin").join(tool).exists() {
            bail!(
                "the redis section needs /usr/bin/{tool} (cargo xtask setup installs redis-server and redis-tools)"
            );
        }
    }
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    if cpus < 2 {
        bail!(
            "the redis section pins redis-server and its client to CPUs 0 and 1: it needs 2 CPUs, this machine has {cpus}"
        );
    }
    Ok(())
}

/// The requests of each of [`TESTS`] in one timed pass (a fifth of them warm redis
/// first): the redis and fleet sections time the same client.
fn requests_per_test(quick: bool) -> u32 {
    if quick { 20_000 } else { 100_000 }
}

/// The spread of `figure` over one mode's passes (the redis and fleet sections both
/// take medians and ranges of their passes this way).
fn spread_of<P>(passes: &[P], figure: impl Fn(&P) -> f64) -> Spread {
    spread(&passes.iter().map(figure).collect::<Vec<_>>())
}

/// The medians of every mode's passes, against bare's: what the lines under the table
/// compare.
struct Medians<'a> {
    passes: &'a [Vec<Pass>],
    bare_rps: f64,
    bare_cpu: f64,
}

impl<'a> Medians<'a> {
    fn new(passes: &'a [Vec<Pass>]) -> Medians<'a> {
        let median = |f: fn(&Pass) -> f64| spread_of(&passes[RedisMode::Bare.index()], f).median;
        Medians {
            passes,
            bare_rps: median(|p| p.requests_per_second),
            bare_cpu: median(|p| p.cpu_us_per_request),
        }
    }

    /// The median of `f` over `mode`'s passes.
    fn median(&self, mode: RedisMode, f: fn(&Pass) -> f64) -> f64 {
        spread_of(&self.passes[mode.index()], f).median
    }

    /// redis's CPU per request that `mode` adds to bare's, microseconds.
    fn added(&self, mode: RedisMode) -> f64 {
        self.median(mode, |p| p.cpu_us_per_request) - self.bare_cpu
    }

    /// `mode`'s requests/s as a fraction of bare's.
    fn rate(&self, mode: RedisMode) -> f64 {
        self.median(mode, |p| p.requests_per_second) / self.bare_rps
    }
}

/// Runs the section; appends its table to `text` and returns its JSON object.
pub fn section(bench: &Bench, runs: usize, quick: bool, text: &mut String) -> Result<Value> {
    check_tools()?;
    let requests = requests_per_test(quick);
    step(&format!(
        "redis: redis-benchmark -t {TESTS} -n {requests}, {runs} runs x {} modes",
        RedisMode::ALL.len()
    ));
    let Passes { passes, failures } = run_passes(bench, runs, requests);
    let medians = Medians::new(&passes);
    write_table_heading(text, requests, runs);
    let mut json = Map::new();
    for (index, mode) in RedisMode::ALL.iter().enumerate() {
        let (line, mode_json) = mode_row(
            *mode,
            &passes[index],
            failures[index].as_deref(),
            medians.bare_rps,
        );
        let _ = writeln!(text, "{line}");
        json.insert(mode.key().to_owned(), mode_json);
    }
    write_costs(text, &medians);
    let bpf_per_run = program_time::section(bench, requests, text);
    let _ = writeln!(text, "how --pid joined redis: {}", how_joined(&passes));
    let (goal_line, goal_json) = launch_goal(medians.rate(RedisMode::LaunchSampled));
    let _ = writeln!(text, "goal: {goal_line}");
    let zmalloc = |mode: RedisMode| zmalloc_answer(&passes[mode.index()]);
    let _ = writeln!(
        text,
        "stacks through zmalloc (final profile): sampled launch {}, exact launch {}",
        zmalloc(RedisMode::LaunchSampled),
        zmalloc(RedisMode::LaunchExact)
    );
    let million_keys = match keys::section(bench, quick, text) {
        Ok(json) => json,
        Err(err) => {
            let _ = writeln!(text, "redis filled with keys: failed: {err:#}");
            Value::Null
        }
    };
    json.insert("launch_sampled_goal".to_owned(), goal_json);
    json.insert("bpf_entry_per_run".to_owned(), bpf_per_run);
    json.insert(
        "stacks_through_zmalloc".to_owned(),
        json!({
            "heapprofd_launch_sampled": zmalloc(RedisMode::LaunchSampled),
            "heapprofd_launch_exact": zmalloc(RedisMode::LaunchExact),
        }),
    );
    json.insert("million_keys".to_owned(), million_keys);
    Ok(Value::Object(json))
}

/// Appends the section's title and its table's column heads to `text`.
fn write_table_heading(text: &mut String, requests: u32, runs: usize) {
    let _ = writeln!(
        text,
        "\n## redis-server (jemalloc) under redis-benchmark -c 20 -d 256 -t {TESTS} -n {requests}, {runs} runs\n"
    );
    let _ = writeln!(
        text,
        "{:<32} {:>12} {:>12} {:>14} {:>10} {:>15}",
        "mode", "requests/s", "min-max", "x bare", "cpu us/req", "single-stepped"
    );
}

/// Appends the lines on what each way of profiling costs redis: CPU added per request
/// (exact and stacks only against the trap floor, the launches), the sampled probes
/// against their own floor, and the in-process join.
fn write_costs(text: &mut String, medians: &Medians) {
    let added = |mode: RedisMode| medians.added(mode);
    let (floor_added, exact_added) = (added(RedisMode::Floor), added(RedisMode::Exact));
    let stacks_only_added = added(RedisMode::StacksOnly);
    let _ = writeln!(
        text,
        "redis CPU added per request: exact {exact_added:.2} us, trap floor {floor_added:.2} us: exact = {:.2}x the floor; stacks only {stacks_only_added:.2} us = {:.2}x the floor; launch exact {:.2} us, launch sampled {:.2} us",
        exact_added / floor_added,
        stacks_only_added / floor_added,
        added(RedisMode::LaunchExact),
        added(RedisMode::LaunchSampled)
    );
    let rate = |mode: RedisMode| medians.rate(mode);
    let _ = writeln!(
        text,
        "sampled on the probes: {:.3}x bare, CPU added {:.2} us per request; its trap floor (one trap per call) {:.3}x bare, {:.2} us: sampled = {:.2}x that floor",
        rate(RedisMode::Sampled),
        added(RedisMode::Sampled),
        rate(RedisMode::SampledFloor),
        added(RedisMode::SampledFloor),
        added(RedisMode::Sampled) / added(RedisMode::SampledFloor)
    );
    let _ = writeln!(
        text,
        "joined in-process (--inject auto), redis CPU added per request: exact {:.2} us, sampled {:.2} us",
        added(RedisMode::JoinedExact),
        added(RedisMode::JoinedSampled)
    );
}

/// How `--pid` joined redis in each `--pid` mode, as one line's list.
fn how_joined(passes: &[Vec<Pass>]) -> String {
    let joined: Vec<String> = RedisMode::ALL
        .iter()
        .filter(|mode| mode.flags().is_some())
        .map(|mode| {
            format!(
                "{} {}",
                mode.name(),
                joined_answer(passes[mode.index()].iter().map(|p| &p.joined)).0
            )
        })
        .collect();
    joined.join("; ")
}

/// The table row and JSON member of `mode`.
fn mode_row(
    mode: RedisMode,
    passes: &[Pass],
    failure: Option<&str>,
    bare_rps: f64,
) -> (String, Value) {
    let rates = spread_of(passes, |p| p.requests_per_second);
    let cpu = spread_of(passes, |p| p.cpu_us_per_request).median;
    let stepped = passes.iter().filter_map(|p| p.single_stepped).max();
    let line = match failure {
        Some(failure) if passes.is_empty() => format!("{:<32} failed: {failure}", mode.name()),
        _ => format!(
            "{:<32} {:>12.0} {:>5.0}-{:<6.0} {:>14.3} {:>10.2} {:>15}",
            mode.name(),
            rates.median,
            rates.min,
            rates.max,
            rates.median / bare_rps,
            cpu,
            stepped.map_or("-".into(), |n| n.to_string())
        ),
    };
    let json = json!({
        "runs": passes.len(),
        "requests_per_second": number(rates.median),
        "to_bare": number(rates.median / bare_rps),
        "cpu_us_per_request": number(cpu),
        "single_stepped": stepped,
        "failed": failure,
    });
    let json = match (json, mode.flags()) {
        (Value::Object(mut object), Some(_)) => {
            let (how, reason) = joined_answer(passes.iter().map(|p| &p.joined));
            object.insert("joined".to_owned(), json!(how));
            object.insert("not_injected_because".to_owned(), json!(reason));
            Value::Object(object)
        }
        (json, _) => json,
    };
    (line, json)
}

/// The goal of the sampled launch (at least [`LAUNCH_SAMPLED_GOAL`] of bare's
/// requests/s), as a line and a JSON object; a figure, never pass/fail.
fn launch_goal(to_bare: f64) -> (String, Value) {
    let met = to_bare
        .is_finite()
        .then_some(to_bare >= LAUNCH_SAMPLED_GOAL);
    let line = format!(
        "heapprofd launch sampled 512KiB requests/s / bare: {} (goal: at least {LAUNCH_SAMPLED_GOAL:.2}x): {}",
        if to_bare.is_finite() {
            format!("{to_bare:.3}x")
        } else {
            "-".into()
        },
        match met {
            Some(true) => "met",
            Some(false) => "not met",
            None => "no figure",
        }
    );
    let json = json!({
        "value": number(to_bare),
        "limit": LAUNCH_SAMPLED_GOAL,
        "met": met,
    });
    (line, json)
}

/// "yes" when every profile read went through zmalloc, "no" when one did not, "no
/// profile read" when none was read.
fn zmalloc_answer(passes: &[Pass]) -> &'static str {
    let answers: Vec<bool> = passes.iter().filter_map(|p| p.through_zmalloc).collect();
    match answers.as_slice() {
        [] => "no profile read",
        a if a.iter().all(|&b| b) => "yes",
        _ => "no",
    }
}
