//! The second real service: Debian's nginx (glibc's malloc) serving a static page
//! under `ab -k`, bare against `heapprofd --pid` on its worker: with the allocator's
//! probes (`--inject off`, exact), and joined in-process (the default `--inject auto`:
//! exact and sampled at 512 KiB). How heapprofd joined each `--pid` run is read from its
//! `--stats-json`.
//!
//! nginx (master and its one worker) runs on CPU 0 and `ab` on CPU 1, so that the
//! worker, not the client, limits the throughput; heapprofd runs beside the client.
//! Each run starts a fresh nginx with a configuration of its own on a loopback port
//! (nothing of the system's nginx is read or touched), warms it, attaches heapprofd to
//! the worker (waiting for its probes), then times one `ab` pass. Figures per mode:
//! requests per second, the worker's CPU per request, and ratios to bare of the
//! medians. nginx allocates a pool per request (`posix_memalign`) and its buffers with
//! `malloc`, so every request makes allocator calls.

use std::{
    fmt::Write as _,
    net::TcpStream,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};
use serde_json::{Map, Value, json};

use crate::{
    bench::{
        Bench,
        figures::{DaemonStats, joined_answer},
        process::{cpu_seconds, interrupt, rotated_rounds},
        summary::{number, spread},
    },
    step,
};

/// Loopback port of the benchmark's nginx (beside the redis section's).
const PORT: u16 = 16398;
/// The page served: 4 KiB, so that a request is more than its headers.
const PAGE_BYTES: usize = 4096;
/// `ab`'s concurrent connections (kept alive).
const CONNECTIONS: &str = "16";
/// The goal of `--pid` joined exact: at least this fraction of bare nginx's requests/s.
const JOINED_EXACT_GOAL: f64 = 0.85;

#[derive(Clone, Copy, PartialEq, Eq)]
enum NginxMode {
    Bare,
    /// `--pid --inject off`: the allocator's probes, exact.
    Probes,
    /// `--pid` joined in-process, exact.
    JoinedExact,
    /// `--pid` joined in-process, `--sample-rate 524288`.
    JoinedSampled,
}

impl NginxMode {
    const ALL: [NginxMode; 4] = [
        NginxMode::Bare,
        NginxMode::Probes,
        NginxMode::JoinedExact,
        NginxMode::JoinedSampled,
    ];

    fn name(self) -> &'static str {
        match self {
            NginxMode::Bare => "bare",
            NginxMode::Probes => "heapprofd --pid probes exact",
            NginxMode::JoinedExact => "heapprofd --pid joined exact",
            NginxMode::JoinedSampled => "heapprofd --pid joined 512KiB",
        }
    }

    fn key(self) -> &'static str {
        match self {
            NginxMode::Bare => "bare",
            NginxMode::Probes => "heapprofd_probes_exact",
            NginxMode::JoinedExact => "heapprofd_joined_exact",
            NginxMode::JoinedSampled => "heapprofd_joined_sampled",
        }
    }

    /// heapprofd's flags for `--pid` on the worker; `None` for bare.
    fn flags(self) -> Option<&'static [&'static str]> {
        match self {
            NginxMode::Bare => None,
            NginxMode::Probes => Some(&["--interval", "1h", "--inject", "off"]),
            NginxMode::JoinedExact => Some(&["--interval", "1h", "--inject", "auto"]),
            NginxMode::JoinedSampled => Some(&[
                "--interval",
                "1h",
                "--inject",
                "auto",
                "--sample-rate",
                "524288",
            ]),
        }
    }
}

/// One timed pass.
struct Pass {
    requests_per_second: f64,
    /// The worker's CPU time (user + system) per request, microseconds.
    cpu_us_per_request: f64,
    /// `--pid` modes: how heapprofd joined the worker, with why not injected.
    joined: Option<(String, Option<String>)>,
}

/// An nginx of the benchmark (master and one worker, pinned to CPU 0), stopped when
/// dropped.
struct Nginx {
    master: Child,
    worker: u32,
}

impl Nginx {
    /// Writes the configuration and page under `root` and starts nginx there.
    fn start(root: &Path) -> Result<Nginx> {
        let r = root.display();
        let config = format!(
            "daemon off;\nmaster_process on;\nworker_processes 1;\nuser root;\n\
             pid {r}/nginx.pid;\nerror_log {r}/error.log;\n\
             events {{ worker_connections 256; }}\n\
             http {{\n  access_log off;\n  client_body_temp_path {r}/temp/body;\n\
               proxy_temp_path {r}/temp/proxy;\n  fastcgi_temp_path {r}/temp/fastcgi;\n\
               uwsgi_temp_path {r}/temp/uwsgi;\n  scgi_temp_path {r}/temp/scgi;\n\
               server {{ listen 127.0.0.1:{PORT}; root {r}/www; location / {{ }} }}\n}}\n"
        );
        std::fs::create_dir_all(root.join("www"))?;
        std::fs::create_dir_all(root.join("temp"))?;
        std::fs::write(root.join("www/index.html"), vec![b'x'; PAGE_BYTES])?;
        std::fs::write(root.join("nginx.conf"), config)?;
        let master = Command::new("taskset")
            .args(["-c", "0", "nginx", "-p"])
            .arg(root)
            .arg("-c")
            .arg(root.join("nginx.conf"))
            .arg("-e")
            .arg(root.join("error.log"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("starting nginx")?;
        // taskset execs nginx: the same pid.
        let mut nginx = Nginx { master, worker: 0 };
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let workers = children(nginx.master.id());
            if let ([worker], true) = (workers.as_slice(), listening()) {
                nginx.worker = *worker;
                return Ok(nginx);
            }
            if Instant::now() > deadline {
                bail!(
                    "nginx did not start its worker and listen on port {PORT} within 10 s (see {r}/error.log)"
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Nginx {
    fn drop(&mut self) {
        // SIGTERM: the master stops its worker and exits.
        // SAFETY: plain kill(2) of our own child.
        unsafe { libc::kill(self.master.id() as libc::pid_t, libc::SIGTERM) };
        let _ = self.master.wait();
    }
}

/// The children of `pid`, from its main thread's `children` file.
fn children(pid: u32) -> Vec<u32> {
    std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect()
}

fn listening() -> bool {
    TcpStream::connect(("127.0.0.1", PORT)).is_ok()
}

/// `ab -k` on CPU 1: `requests` requests over [`CONNECTIONS`] connections; returns
/// requests per second over the pass, by the clock here.
fn client(requests: u32) -> Result<f64> {
    let url = format!("http://127.0.0.1:{PORT}/index.html");
    let started = Instant::now();
    let output = Command::new("taskset")
        .args([
            "-c",
            "1",
            "ab",
            "-k",
            "-q",
            "-s",
            "30",
            "-c",
            CONNECTIONS,
            "-n",
        ])
        .arg(requests.to_string())
        .arg(&url)
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()
        .context("running ab")?;
    let seconds = started.elapsed().as_secs_f64();
    let text = String::from_utf8_lossy(&output.stdout);
    // ab's own summary: a wrong or missing answer is an error, never a figure.
    let failed = text
        .lines()
        .find(|l| l.starts_with("Failed requests:"))
        .and_then(|l| l.split_whitespace().nth(2))
        .and_then(|n| n.parse::<u64>().ok());
    if !output.status.success() || failed != Some(0) || text.contains("Non-2xx") {
        bail!("ab failed ({}): {text}", output.status);
    }
    Ok(f64::from(requests) / seconds)
}

/// One pass in `mode`: a fresh nginx, warmed, heapprofd attached to its worker (unless
/// bare), then timed.
fn pass(bench: &Bench, root: &Path, mode: NginxMode, requests: u32) -> Result<Pass> {
    let _ = std::fs::remove_dir_all(root);
    let nginx = Nginx::start(root)?;
    client(requests / 5)?;
    let daemon = match mode.flags() {
        Some(flags) => Some(bench.start_heapprofd(flags, nginx.worker)?),
        None => None,
    };
    let cpu_before = cpu_seconds(nginx.worker)?;
    let rate = client(requests);
    let cpu = cpu_seconds(nginx.worker)? - cpu_before;
    let joined = match daemon {
        Some(daemon) => {
            interrupt(&daemon.child);
            let mut child = daemon.child;
            let status = child.wait()?;
            if !status.success() {
                bail!("heapprofd --pid ended with {status}");
            }
            let stats = DaemonStats::read(&daemon.stats)?;
            stats.joined.map(|j| (j.how, j.reason))
        }
        None => None,
    };
    Ok(Pass {
        requests_per_second: rate?,
        cpu_us_per_request: cpu / f64::from(requests) * 1e6,
        joined,
    })
}

/// Checks that the section can run: nginx, ab, taskset and two CPUs.
fn check_tools() -> Result<()> {
    for (tool, package) in [
        ("/usr/sbin/nginx", "nginx"),
        ("/usr/bin/ab", "apache2-utils"),
        ("/usr/bin/taskset", "util-linux"),
    ] {
        if !Path::new(tool).exists() {
            bail!("the nginx section needs {tool} (cargo xtask setup installs {package})");
        }
    }
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    if cpus < 2 {
        bail!(
            "the nginx section pins nginx and its client to CPUs 0 and 1: it needs 2 CPUs, this machine has {cpus}"
        );
    }
    Ok(())
}

/// Runs the section; appends its table to `text` and returns its JSON object.
pub(super) fn section(bench: &Bench, runs: usize, quick: bool, text: &mut String) -> Result<Value> {
    check_tools()?;
    let requests: u32 = if quick { 40_000 } else { 200_000 };
    step(&format!(
        "nginx: ab -k -c {CONNECTIONS} -n {requests}, {runs} runs x {} modes",
        NginxMode::ALL.len()
    ));
    let root: PathBuf = bench.dir.join("nginx");
    let (passes, failures) = rotated_rounds(
        "nginx",
        &NginxMode::ALL,
        runs,
        NginxMode::name,
        |p: &Pass| p.requests_per_second,
        |mode| pass(bench, &root, mode, requests),
    );
    let median = |index: usize, f: fn(&Pass) -> f64| {
        spread(&passes[index].iter().map(f).collect::<Vec<_>>()).median
    };
    let bare = Bare {
        rps: median(0, |p| p.requests_per_second),
        cpu: median(0, |p| p.cpu_us_per_request),
    };
    write_table_heading(text, requests, runs);
    let mut json = Map::new();
    for (index, mode) in NginxMode::ALL.iter().enumerate() {
        let (line, row) = mode_row(*mode, &passes[index], failures[index].as_deref(), &bare);
        let _ = writeln!(text, "{line}");
        json.insert(mode.key().to_owned(), row);
    }
    let joined = median(2, |p| p.requests_per_second) / bare.rps;
    let goal = write_goal(text, joined);
    json.insert("joined_exact_goal".to_owned(), goal);
    Ok(Value::Object(json))
}

/// Bare nginx's medians, what the other modes are compared with.
struct Bare {
    /// Requests per second.
    rps: f64,
    /// The worker's CPU per request, microseconds.
    cpu: f64,
}

/// Appends the section's title and its table's column heads to `text`.
fn write_table_heading(text: &mut String, requests: u32, runs: usize) {
    let _ = writeln!(
        text,
        "\n## nginx (one worker) serving {PAGE_BYTES} bytes under ab -k -c {CONNECTIONS} -n {requests}, {runs} runs\n"
    );
    let _ = writeln!(
        text,
        "{:<32} {:>12} {:>13} {:>8} {:>11} {:>10} joined",
        "mode", "requests/s", "min-max", "x bare", "cpu us/req", "added us"
    );
}

/// The table row and JSON member of `mode` (its passes, and why it failed if it did);
/// the `--pid` modes say how heapprofd joined the worker.
fn mode_row(
    mode: NginxMode,
    passes: &[Pass],
    failure: Option<&str>,
    bare: &Bare,
) -> (String, Value) {
    let rates = spread(
        &passes
            .iter()
            .map(|p| p.requests_per_second)
            .collect::<Vec<_>>(),
    );
    let cpu = spread(
        &passes
            .iter()
            .map(|p| p.cpu_us_per_request)
            .collect::<Vec<_>>(),
    )
    .median;
    let (how, reason) = joined_answer(passes.iter().map(|p| &p.joined));
    let line = match failure {
        Some(failure) if passes.is_empty() => {
            format!("{:<32} failed: {failure}", mode.name())
        }
        _ => format!(
            "{:<32} {:>12.0} {:>6.0}-{:<6.0} {:>8.3} {:>11.2} {:>10.2} {}",
            mode.name(),
            rates.median,
            rates.min,
            rates.max,
            rates.median / bare.rps,
            cpu,
            cpu - bare.cpu,
            if mode.flags().is_some() { how } else { "-" }
        ),
    };
    let mut row = json!({
        "runs": passes.len(),
        "requests_per_second": number(rates.median),
        "to_bare": number(rates.median / bare.rps),
        "cpu_us_per_request": number(cpu),
        "failed": failure,
    });
    if let (Some(_), Value::Object(object)) = (mode.flags(), &mut row) {
        object.insert("joined".to_owned(), json!(how));
        object.insert("not_injected_because".to_owned(), json!(reason));
    }
    (line, row)
}

/// Appends the goal's line for `joined`, `--pid` joined exact's requests/s as a fraction
/// of bare's, and returns its JSON object; a figure, never pass/fail.
fn write_goal(text: &mut String, joined: f64) -> Value {
    let met = joined.is_finite().then_some(joined >= JOINED_EXACT_GOAL);
    let _ = writeln!(
        text,
        "goal: heapprofd --pid joined exact requests/s / bare: {joined:.3}x (goal: at least {JOINED_EXACT_GOAL:.2}x): {}",
        match met {
            Some(true) => "met",
            Some(false) => "not met",
            None => "no figure",
        }
    );
    json!({ "value": number(joined), "limit": JOINED_EXACT_GOAL, "met": met })
}
