//! `--metrics`: a real Prometheus server (Debian's `prometheus`) scrapes heapprofd,
//! and what it stores equals the profile of the same interval.

mod common;

use std::{
    io::{Read as _, Write as _},
    net::{TcpListener, TcpStream},
    path::Path,
    process::{Child, ChildStdin, Command, Stdio},
    sync::mpsc,
    time::{Duration, Instant},
};

use common::*;
use heapprof_common::DropReason;
use heapprof_daemon::memstats::ProcessMemory;

/// Where Debian's package installs the server.
const PROMETHEUS: &str = "/usr/bin/prometheus";

/// Kills and reaps a server the test started, when it ends or panics.
struct Reaper(Child);

impl Drop for Reaper {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `GET path` on 127.0.0.1:port: (status line, body), or `None` if nothing answers.
/// HTTP/1.0, so that the answer is neither chunked nor kept alive.
fn get(port: u16, path: &str) -> Option<(String, String)> {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).ok()?;
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .ok()?;
    write!(
        stream,
        "GET {path} HTTP/1.0\r\nHost: 127.0.0.1:{port}\r\n\r\n"
    )
    .ok()?;
    let mut reply = Vec::new();
    stream.read_to_end(&mut reply).ok()?;
    let reply = String::from_utf8_lossy(&reply).into_owned();
    let (head, body) = reply.split_once("\r\n\r\n")?;
    Some((head.lines().next()?.to_owned(), body.to_owned()))
}

/// Polls `check` every 200 ms until it gives a value, or panics after `limit`.
fn wait_for<T>(limit: Duration, what: &str, mut check: impl FnMut() -> Option<T>) -> T {
    let start = Instant::now();
    loop {
        if let Some(value) = check() {
            return value;
        }
        assert!(start.elapsed() < limit, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Prometheus's value of an instant query that selects one series, if it has one.
fn query(port: u16, promql: &str) -> Option<f64> {
    let encoded: String = promql
        .bytes()
        .map(|b| match b {
            b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'_' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect();
    let (status, body) = get(port, &format!("/api/v1/query?query={encoded}"))?;
    assert!(status.contains(" 200 "), "{promql}: {status}: {body}");
    let reply: serde_json::Value = serde_json::from_str(&body).expect("Prometheus's JSON");
    let result = reply["data"]["result"].as_array()?;
    assert!(result.len() <= 1, "{promql} selects one series: {body}");
    result.first()?["value"][1].as_str()?.parse().ok()
}

/// The bytes in use of process `pid` in a profile: its samples' inuse_space.
fn inuse_bytes(profile: &heapprof_daemon::pprof::proto::Profile, pid: u32) -> i64 {
    totals(&samples(profile), |s| {
        s.labels.get("pid") == Some(&pid.to_string())
    })[3]
}

/// heapprofd launching a program, with its stdin and stdout (the program's) piped;
/// killed if the test ends before it exits.
struct Launched {
    child: Child,
    program_in: Option<ChildStdin>,
    program_out: mpsc::Receiver<String>,
    log: mpsc::Receiver<String>,
    pid: u32,
}

impl Drop for Launched {
    fn drop(&mut self) {
        self.program_in = None;
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `heapprofd ARGS -- COMMAND` and waits until it is attached (its
/// `--ready-file`); the pid of the command is heapprofd's child's.
fn launch(cmd: &mut Command) -> Launched {
    let ready = ready_file_of(cmd);
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting heapprofd");
    let log = forward_lines(child.stderr.take().expect("stderr"));
    let program_out = forward_lines(child.stdout.take().expect("stdout"));
    let program_in = child.stdin.take();
    let started = wait_ready(&mut child, &ready, Duration::from_secs(60));
    let mut launched = Launched {
        pid: children_of(child.id()).first().copied().unwrap_or(0),
        child,
        program_in,
        program_out,
        log,
    };
    if !matches!(started, Start::Ready) || launched.pid == 0 {
        let _ = launched.child.kill();
        let _ = launched.child.wait();
        let seen: Vec<String> = launched.log.iter().collect();
        panic!("heapprofd did not attach to a command of its own ({started:?}): {seen:#?}");
    }
    launched
}

/// The children of process `pid` (of any of its threads).
fn children_of(pid: u32) -> Vec<u32> {
    let mut children = Vec::new();
    for task in std::fs::read_dir(format!("/proc/{pid}/task"))
        .into_iter()
        .flatten()
        .flatten()
    {
        let listed = std::fs::read_to_string(task.path().join("children")).unwrap_or_default();
        children.extend(
            listed
                .split_whitespace()
                .filter_map(|c| c.parse::<u32>().ok()),
        );
    }
    children
}

impl Launched {
    /// Sends a line to the program and waits for it to print `reply`.
    fn step(&mut self, reply: &str) {
        let stdin = self.program_in.as_mut().expect("stdin open");
        stdin.write_all(b"go\n").expect("writing to the program");
        stdin.flush().expect("flush");
        let line = self
            .program_out
            .recv_timeout(Duration::from_secs(30))
            .unwrap_or_else(|e| panic!("the program did not print {reply:?}: {e}"));
        assert_eq!(line, reply);
    }
}

/// Starts Prometheus scraping 127.0.0.1:`target` every second, on a port of its own
/// with its database in `dir`; returns it and its port once it is ready.
fn start_prometheus(dir: &Path, target: u16) -> (Reaper, u16) {
    assert!(
        Path::new(PROMETHEUS).exists(),
        "{PROMETHEUS} is missing: install Debian's prometheus package (cargo xtask setup)"
    );
    let config = dir.join("prometheus.yml");
    std::fs::write(
        &config,
        format!(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n\
             scrape_configs:\n  - job_name: heapprofd\n    static_configs:\n      \
             - targets: ['127.0.0.1:{target}']\n"
        ),
    )
    .expect("writing the Prometheus config");
    let port = free_port();
    let log = std::fs::File::create(dir.join("prometheus.log")).expect("log file");
    let child = Command::new(PROMETHEUS)
        .arg(format!("--config.file={}", config.display()))
        .arg(format!(
            "--storage.tsdb.path={}",
            dir.join("tsdb").display()
        ))
        .arg(format!("--web.listen-address=127.0.0.1:{port}"))
        .stdin(Stdio::null())
        .stdout(log.try_clone().expect("log file"))
        .stderr(log)
        .spawn()
        .expect("starting prometheus");
    let reaper = Reaper(child);
    wait_for(Duration::from_secs(60), "Prometheus to be ready", || {
        get(port, "/-/ready").filter(|(status, _)| status.contains(" 200 "))
    });
    (reaper, port)
}

/// The value of the sample `line_start` (name and labels) in a scrape.
fn sample(scrape: &str, line_start: &str) -> Option<String> {
    scrape
        .lines()
        .find_map(|l| l.strip_prefix(line_start)?.strip_prefix(' '))
        .map(str::to_owned)
}

#[test]
fn prometheus_scrapes_what_the_profile_of_the_interval_holds() {
    require_root();
    let dir = scratch();
    let program = compile(dir.path(), "waiter", "waiter", &["-O1"]);
    let out = dir.path().join("profiles");
    let metrics_port = free_port();
    let mut launched = launch(
        heapprofd(&out)
            .args(["--interval", "1s", "--metrics"])
            .arg(format!("127.0.0.1:{metrics_port}"))
            .arg("--")
            .arg(&program)
            .args(["10", "64"]),
    );
    let pid = launched.pid;
    let (_prometheus, prometheus) = start_prometheus(dir.path(), metrics_port);
    let series = format!("heapprofd_inuse_bytes{{pid=\"{pid}\"}}");
    wait_for(
        Duration::from_secs(60),
        "a first sample in Prometheus",
        || query(prometheus, &series),
    );

    // work(): 10 blocks of 64 bytes, every other one freed; then the figures stay.
    launched
        .program_out
        .recv_timeout(Duration::from_secs(30))
        .expect("ready");
    launched.step("done");
    let written_before = read_profiles(&out).len();
    let profile = wait_for(Duration::from_secs(30), "a profile after work()", || {
        let mut profiles = read_profiles(&out);
        (profiles.len() > written_before).then(|| profiles.pop().expect("one").1)
    });
    let work = totals(&samples(&profile), |s| s.stack.iter().any(|f| f == "work"));
    assert_eq!(work, [10, 640, 5, 320], "work()'s blocks in the profile");
    let expected = inuse_bytes(&profile, pid);
    let stored = wait_for(
        Duration::from_secs(30),
        "Prometheus to store the in-use bytes of the profile after work()",
        || query(prometheus, &series).filter(|&v| v == expected as f64),
    );
    assert_eq!(stored, expected as f64);
    assert_eq!(
        query(prometheus, "up{job=\"heapprofd\"}"),
        Some(1.0),
        "Prometheus scrapes heapprofd without errors"
    );

    // Scraped directly, the exposition has every family and the same figures.
    let (status, scrape) = get(metrics_port, "/metrics").expect("heapprofd answers");
    assert!(status.contains(" 200 "), "{status}");
    for (family, kind) in [
        ("heapprofd_inuse_bytes", "gauge"),
        ("heapprofd_inuse_objects", "gauge"),
        ("heapprofd_allocated_bytes", "counter"),
        ("heapprofd_allocated_objects", "counter"),
        ("heapprofd_peak_inuse_bytes", "gauge"),
        ("heapprofd_dropped", "counter"),
        ("heapprofd_table_entries", "gauge"),
        ("heapprofd_table_capacity", "gauge"),
        ("heapprofd_bpf_run_seconds", "counter"),
        ("heapprofd_profile_write_seconds", "histogram"),
        ("heapprofd_resident_memory_bytes", "gauge"),
    ] {
        let help = format!("# HELP {family} ");
        let kind_line = format!("# TYPE {family} {kind}");
        assert!(
            scrape.lines().any(|l| l.starts_with(&help)) && scrape.lines().any(|l| l == kind_line),
            "no HELP/TYPE lines for {family} ({kind}):\n{scrape}"
        );
    }
    let reasons: Vec<&str> = scrape
        .lines()
        .filter_map(|l| l.strip_prefix("heapprofd_dropped_total{reason=\""))
        .filter_map(|rest| rest.split('"').next())
        .collect();
    assert_eq!(
        reasons.len(),
        DropReason::COUNT as usize,
        "one sample per drop reason: {reasons:?}"
    );
    let labels = format!("{{pid=\"{pid}\",comm=\"waiter\",container=\"\"}}");
    let last = read_profiles(&out).pop().expect("a profile").1;
    assert_eq!(inuse_bytes(&last, pid), expected, "the figures stay");
    assert_eq!(
        sample(&scrape, &format!("heapprofd_inuse_bytes{labels}")),
        Some(expected.to_string()),
        "{scrape}"
    );
    let all = totals(&samples(&last), |s| {
        s.labels.get("pid") == Some(&pid.to_string())
    });
    assert_eq!(
        sample(&scrape, &format!("heapprofd_allocated_bytes_total{labels}")),
        Some(all[1].to_string())
    );
    let peak = comments(&last)
        .iter()
        .find_map(|c| ProcessMemory::parse_comment(c))
        .and_then(|m| m.peak_inuse)
        .expect("the profile records the peak");
    assert_eq!(
        sample(&scrape, &format!("heapprofd_peak_inuse_bytes{labels}")),
        Some(peak.to_string())
    );
    assert!(
        scrape
            .lines()
            .any(|l| l.starts_with("heapprofd_bpf_run_seconds_total{program=\"")),
        "BPF run time is on with --metrics:\n{scrape}"
    );
    for table in ["live_blocks", "sites", "stacks", "unwind_rows"] {
        assert!(
            sample(
                &scrape,
                &format!("heapprofd_table_entries{{table=\"{table}\"}}")
            )
            .is_some()
                && sample(
                    &scrape,
                    &format!("heapprofd_table_capacity{{table=\"{table}\"}}")
                )
                .is_some(),
            "table {table}:\n{scrape}"
        );
    }
    let rss: u64 = sample(&scrape, "heapprofd_resident_memory_bytes")
        .and_then(|v| v.parse().ok())
        .expect("heapprofd's RSS");
    assert!(rss > 1 << 20, "{rss}");

    // End of input ends the program, and heapprofd with it.
    launched.program_in = None;
    let status = wait_for(Duration::from_secs(60), "heapprofd to exit", || {
        launched.child.try_wait().expect("waiting for heapprofd")
    });
    if !status.success() {
        let lines: Vec<String> = launched.log.try_iter().collect();
        panic!("heapprofd exited with {status}: {}", lines.join("\n"));
    }
}

#[test]
fn a_bad_metrics_address_is_one_clear_line() {
    let output = Command::new(env!("CARGO_BIN_EXE_heapprofd"))
        .args(["--metrics", "notanaddress", "--", "true"])
        .output()
        .expect("running heapprofd");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.starts_with("heapprofd: error: ")
            && stderr.contains("notanaddress")
            && stderr.contains("127.0.0.1:9464"),
        "{stderr}"
    );
}

#[test]
fn a_metrics_port_in_use_stops_heapprofd_before_it_profiles() {
    require_root();
    let taken = TcpListener::bind("127.0.0.1:0").expect("a port");
    let addr = taken.local_addr().expect("its address");
    let dir = scratch();
    let output = heapprofd(&dir.path().join("profiles"))
        .arg("--metrics")
        .arg(addr.to_string())
        .args(["--", "true"])
        .output()
        .expect("running heapprofd");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    let errors: Vec<&str> = stderr.lines().filter(|l| l.contains("error")).collect();
    assert_eq!(errors.len(), 1, "{stderr}");
    assert!(
        errors[0].starts_with(&format!(
            "heapprofd: error: cannot serve metrics on {addr}: "
        )) && errors[0].contains("choose another address or port"),
        "{stderr}"
    );
    assert!(
        !ready_file(&dir.path().join("profiles")).exists(),
        "it got ready: {stderr}"
    );
    assert!(
        !dir.path().join("profiles").exists()
            || read_profiles(&dir.path().join("profiles")).is_empty(),
        "no profile written"
    );
}
