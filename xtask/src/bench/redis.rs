//! The real-service section: Debian's redis-server (linked with jemalloc) under
//! `redis-benchmark`, bare against `heapprofd --pid` attached to it (exact, sampled, and
//! the trap floor with `--empty-programs`).
//!
//! redis runs on CPU 0 and the client on CPU 1, so that redis, not the client, is what
//! limits the throughput; heapprofd runs beside the client. Each run starts a fresh
//! redis on a loopback port, warms it, attaches heapprofd (waiting for its probes),
//! then times one `redis-benchmark` pass. Figures per mode: requests per second over the
//! whole pass, redis's own CPU per request, and ratios to bare of the medians.

use std::{
    fmt::Write as _,
    path::Path,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};

use super::{Bench, json_number, json_string, spread};
use crate::step;

/// Loopback port of the benchmark's redis (outside redis's default 6379).
const PORT: &str = "16399";
/// The commands timed, as the issue measured them.
const TESTS: &str = "set,get,lpush,lpop,sadd,hset";

#[derive(Clone, Copy, PartialEq, Eq)]
enum RedisMode {
    Bare,
    Floor,
    Exact,
    Sampled,
}

impl RedisMode {
    const ALL: [RedisMode; 4] = [
        RedisMode::Bare,
        RedisMode::Floor,
        RedisMode::Exact,
        RedisMode::Sampled,
    ];

    fn name(self) -> &'static str {
        match self {
            RedisMode::Bare => "bare",
            RedisMode::Floor => "trap floor (--empty-programs)",
            RedisMode::Exact => "heapprofd --pid exact",
            RedisMode::Sampled => "heapprofd --pid sampled 512KiB",
        }
    }

    fn key(self) -> &'static str {
        match self {
            RedisMode::Bare => "bare",
            RedisMode::Floor => "heapprofd_empty_programs",
            RedisMode::Exact => "heapprofd_exact",
            RedisMode::Sampled => "heapprofd_sampled",
        }
    }

    fn flags(self) -> Option<&'static [&'static str]> {
        match self {
            RedisMode::Bare => None,
            RedisMode::Floor => Some(&["--interval", "1h", "--empty-programs"]),
            RedisMode::Exact => Some(&["--interval", "1h"]),
            RedisMode::Sampled => Some(&["--interval", "1h", "--sample-rate", "512KiB"]),
        }
    }
}

/// One timed pass.
struct Pass {
    requests_per_second: f64,
    /// redis-server's CPU time (user + system) per request, microseconds.
    cpu_us_per_request: f64,
    /// heapprofd's warnings about single-stepped probes.
    single_stepped: Option<usize>,
}

/// Lines of heapprofd's log that report a single-stepped probe.
pub fn single_stepped(log: &[String]) -> usize {
    log.iter()
        .filter(|line| line.contains("is single-stepped by the kernel"))
        .count()
}

/// CPU seconds (user + system) of process `pid` so far.
fn cpu_seconds(pid: u32) -> Result<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // Fields after the command name, which may hold spaces: utime and stime are the
    // 14th and 15th fields, the 12th and 13th after it.
    let rest = stat.rsplit_once(')').context("malformed stat")?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| -> Result<f64> {
        Ok(fields.get(i).context("short stat")?.parse::<u64>()? as f64)
    };
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    Ok((ticks(11)? + ticks(12)?) / hz)
}

/// A redis-server on [`PORT`], pinned to CPU 0, without persistence.
struct Redis {
    child: Child,
}

impl Redis {
    fn start() -> Result<Redis> {
        let child = Command::new("taskset")
            .args([
                "-c",
                "0",
                "redis-server",
                "--port",
                PORT,
                "--bind",
                "127.0.0.1",
            ])
            .args(["--save", "", "--appendonly", "no", "--loglevel", "warning"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("starting redis-server")?;
        let redis = Redis { child };
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            let pong = Command::new("redis-cli")
                .args(["-p", PORT, "ping"])
                .output()
                .is_ok_and(|o| o.stdout.starts_with(b"PONG"));
            if pong {
                return Ok(redis);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        bail!("redis-server did not answer on port {PORT} within 10 s (is the port taken?)")
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `redis-benchmark` on CPU 1: `requests` of each of [`TESTS`] (or `tests`).
fn client(tests: &str, requests: u32) -> Result<()> {
    let status = Command::new("taskset")
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

fn pass(bench: &Bench, mode: RedisMode, requests: u32) -> Result<Pass> {
    let redis = Redis::start()?;
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
    let single_stepped = match daemon {
        Some(mut daemon) => {
            super::interrupt(&daemon.child);
            daemon.child.wait()?;
            daemon.log.extend(daemon.lines.try_iter());
            Some(single_stepped(&daemon.log))
        }
        None => None,
    };
    let total = f64::from(requests) * TESTS.split(',').count() as f64;
    Ok(Pass {
        requests_per_second: total / wall,
        cpu_us_per_request: cpu / total * 1e6,
        single_stepped,
    })
}

/// Runs the section; appends its table to `text` and returns its JSON object.
pub fn section(bench: &Bench, runs: usize, quick: bool, text: &mut String) -> Result<String> {
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
    let requests = if quick { 20_000 } else { 100_000 };
    step(&format!(
        "redis: redis-benchmark -t {TESTS} -n {requests}, {runs} runs x {} modes",
        RedisMode::ALL.len()
    ));
    let mut passes: Vec<Vec<Pass>> = RedisMode::ALL.iter().map(|_| Vec::new()).collect();
    for round in 0..runs {
        for i in 0..RedisMode::ALL.len() {
            let index = (i + round) % RedisMode::ALL.len();
            let mode = RedisMode::ALL[index];
            let pass =
                pass(bench, mode, requests).with_context(|| format!("redis, {}", mode.name()))?;
            eprintln!(
                "xtask:   round {} {:<32} {:9.0} requests/s",
                round + 1,
                mode.name(),
                pass.requests_per_second
            );
            passes[index].push(pass);
        }
    }
    let median = |index: usize, f: fn(&Pass) -> f64| {
        spread(&passes[index].iter().map(f).collect::<Vec<_>>()).median
    };
    let bare_rps = median(0, |p| p.requests_per_second);
    let bare_cpu = median(0, |p| p.cpu_us_per_request);
    let _ = writeln!(
        text,
        "\n## redis-server (jemalloc) under redis-benchmark -c 20 -d 256 -t {TESTS} -n {requests}, {runs} runs\n"
    );
    let _ = writeln!(
        text,
        "{:<32} {:>12} {:>12} {:>14} {:>10} {:>15}",
        "mode", "requests/s", "min-max", "x bare", "cpu us/req", "single-stepped"
    );
    let mut json_modes = Vec::new();
    for (index, mode) in RedisMode::ALL.iter().enumerate() {
        let rates = spread(
            &passes[index]
                .iter()
                .map(|p| p.requests_per_second)
                .collect::<Vec<_>>(),
        );
        let cpu = median(index, |p| p.cpu_us_per_request);
        let stepped = passes[index].iter().filter_map(|p| p.single_stepped).max();
        let _ = writeln!(
            text,
            "{:<32} {:>12.0} {:>5.0}-{:<6.0} {:>14.3} {:>10.2} {:>15}",
            mode.name(),
            rates.median,
            rates.min,
            rates.max,
            rates.median / bare_rps,
            cpu,
            stepped.map_or("-".into(), |n| n.to_string())
        );
        json_modes.push(format!(
            "{}: {{\"requests_per_second\": {}, \"to_bare\": {}, \"cpu_us_per_request\": {}, \"single_stepped\": {}}}",
            json_string(mode.key()),
            json_number(rates.median),
            json_number(rates.median / bare_rps),
            json_number(cpu),
            stepped.map_or("null".into(), |n| n.to_string())
        ));
    }
    let floor_added = median(1, |p| p.cpu_us_per_request) - bare_cpu;
    let exact_added = median(2, |p| p.cpu_us_per_request) - bare_cpu;
    let _ = writeln!(
        text,
        "redis CPU added per request: exact {exact_added:.2} us, trap floor {floor_added:.2} us: exact = {:.2}x the floor",
        exact_added / floor_added
    );
    Ok(format!("{{{}}}", json_modes.join(", ")))
}
