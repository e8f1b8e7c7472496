//! Safety of `--pid` joining a running process in-process (`--inject auto`, the
//! default): heapprofd attaches and detaches over and over on real programs under
//! load, and after every cycle the program must still work.
//!
//! Targets: Debian's redis-server under `redis-benchmark` (SET/GET checked, BGSAVE
//! forks), nginx with a configuration of its own under `ab -k` (bodies checked), a
//! multi-threaded python3, a JVM compressing with zlib and filling direct buffers, and
//! tests/programs/stress_target.c in its own mount namespace, forking and exec'ing
//! while joined, stopped inside malloc in a signal handler at the attach, and with
//! heapprofd SIGKILLed at random moments of its start-up.
//!
//! After every cycle: heapprofd exited cleanly within a bound, said in its `--stats-json`
//! whether it joined (and why not), the target answers rightly, no thread is left traced, it handles
//! the signals it handled before (SigCgt), its descriptors are those it had before (sockets at the end, once the load stopped),
//! and one copy of the library (`/memfd:heapprofd-preload`) is mapped. Each test
//! prints its tally ("inject_stress TARGET: ...").
//!
//! The suite runs a few cycles per target; `cargo xtask stress` sets
//! `HEAPPROFD_LOAD=full` for the scale (over 500 cycles in all). One target
//! at a time (`serial`): each one with its load is the machine's whole load.

mod common;

use std::{
    collections::{BTreeMap, HashSet},
    io::{Read as _, Write as _},
    net::TcpStream,
    path::{Path, PathBuf},
    process::{Child, Command, ExitStatus, Stdio},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
        mpsc,
    },
    time::{Duration, Instant},
};

use common::*;

/// Cycles for the suite, or at full scale.
fn cycles(suite: usize, full: usize) -> usize {
    if full_scale() { full } else { suite }
}

/// How long heapprofd may take to attach, or to exit after SIGINT.
const HEAPPROFD_BOUND: Duration = Duration::from_secs(90);
/// How long a target may take to answer.
const REPLY_BOUND: Duration = Duration::from_secs(20);

/// A process the test started, killed when dropped.
struct Guard(Child);

impl Guard {
    fn pid(&self) -> u32 {
        self.0.id()
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Waits up to `bound` for `child` to exit; `None` if it did not (then it is killed).
fn wait_bounded(child: &mut Child, bound: Duration) -> Option<ExitStatus> {
    let deadline = Instant::now() + bound;
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            return Some(status);
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// What the cycles over one target gave.
#[derive(Default)]
struct Tally {
    target: String,
    cycles: usize,
    joined: usize,
    /// Why heapprofd fell back to the probes, and how often.
    fell_back: BTreeMap<String, usize>,
    /// Crashes, hangs, wrong replies, leaks: one line each.
    problems: Vec<String>,
}

impl Tally {
    fn new(target: &str) -> Self {
        Self {
            target: target.to_owned(),
            ..Self::default()
        }
    }

    fn problem(&mut self, what: String) {
        eprintln!("inject_stress {}: PROBLEM {what}", self.target);
        self.problems.push(what);
    }

    fn summary(&self) -> String {
        format!(
            "inject_stress {}: {} cycles, {} joined, fell back {:?}, {} problems",
            self.target,
            self.cycles,
            self.joined,
            self.fell_back,
            self.problems.len()
        )
    }

    /// Prints the tally and fails on any problem or any cycle not joined.
    fn assert_clean(&self) {
        eprintln!("{}", self.summary());
        assert!(
            self.problems.is_empty(),
            "{}:\n{}",
            self.summary(),
            self.problems.join("\n")
        );
        assert!(self.cycles > 0, "no cycle ran");
        assert_eq!(
            self.joined,
            self.cycles,
            "{}: every cycle should have joined",
            self.summary()
        );
    }
}

/// A heapprofd session on a process.
struct Session {
    child: Child,
    log: mpsc::Receiver<String>,
    /// Its `--stats-json`, which says at its exit how it joined the process.
    stats: PathBuf,
    /// From start to its `--ready-file`.
    took: Duration,
}

impl Drop for Session {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// heapprofd on `pid`, started (not yet attached), with its `--stats-json` at
/// [`stats_file`]`(out)`.
fn spawn_heapprofd(pid: u32, out: &Path) -> Child {
    let _ = std::fs::remove_file(ready_file(out));
    heapprofd(out)
        .args([
            "--interval",
            "1h",
            "--inject",
            "auto",
            "--pid",
            &pid.to_string(),
        ])
        .arg("--stats-json")
        .arg(stats_file(out))
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .expect("starting heapprofd")
}

/// Starts heapprofd on `pid` and waits (bounded) until it is attached (its
/// `--ready-file`).
fn attach(pid: u32, out: &Path) -> Result<Session, String> {
    let started = Instant::now();
    let mut child = spawn_heapprofd(pid, out);
    let log = forward_lines(child.stderr.take().expect("stderr"));
    let failure = match wait_ready(&mut child, &ready_file(out), HEAPPROFD_BOUND) {
        Start::Ready => {
            return Ok(Session {
                child,
                log,
                stats: stats_file(out),
                took: started.elapsed(),
            });
        }
        Start::Exited(status) => format!("heapprofd exited ({status}) before attaching"),
        Start::TimedOut => {
            let _ = child.kill();
            let _ = child.wait();
            format!("heapprofd did not attach within {HEAPPROFD_BOUND:?} (hang)")
        }
    };
    // The stderr reader ends at EOF, which follows the exit.
    let lines: Vec<String> = log.iter().collect();
    Err(format!("{failure}:\n{}", lines.join("\n")))
}

impl Session {
    /// SIGINT, and a bounded wait for a clean exit; a joined session must have left.
    /// Returns how it joined the process, as its `--stats-json` says: `Ok(())` in-process,
    /// `Err(why not)` on the allocator's probes.
    fn detach(mut self) -> Result<Result<(), String>, String> {
        signal(&self.child, libc::SIGINT);
        let status = wait_bounded(&mut self.child, HEAPPROFD_BOUND);
        // The log ends with heapprofd's exit (or its kill).
        let mut lines = Vec::new();
        while let Ok(line) = self.log.recv_timeout(Duration::from_secs(5)) {
            lines.push(line);
        }
        let log = lines.join("\n");
        match status {
            None => {
                return Err(format!(
                    "heapprofd did not exit after SIGINT (hang):\n{log}"
                ));
            }
            Some(status) if !status.success() => {
                return Err(format!("heapprofd exited with {status}:\n{log}"));
            }
            Some(_) => {}
        }
        let joined = joined_in_process(&self.stats);
        // What heapprofd says to people of leaving: the message itself is checked.
        if joined.is_ok() && !lines.iter().any(|l| l.contains("left in-process")) {
            return Err(format!(
                "joined, but the log says nothing of leaving:\n{log}"
            ));
        }
        Ok(joined)
    }
}

/// The process's descriptors and what they name.
fn descriptors(pid: u32) -> BTreeMap<String, String> {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|dir| {
            // One closed between the listing and its link is not there.
            dir.flatten()
                .filter_map(|e| {
                    let target = std::fs::read_link(e.path()).ok()?;
                    Some((
                        e.file_name().to_string_lossy().into_owned(),
                        target.to_string_lossy().into_owned(),
                    ))
                })
                .collect()
        })
        .unwrap_or_default()
}

/// `pid`'s descriptors once two readings 200 ms apart agree (at most 10 s).
fn settled_descriptors(pid: u32) -> BTreeMap<String, String> {
    let mut last = descriptors(pid);
    for _ in 0..50 {
        std::thread::sleep(Duration::from_millis(200));
        let now = descriptors(pid);
        if now == last {
            return now;
        }
        last = now;
    }
    last
}

/// Those that are not sockets or files nginx serves (a server's connections, and the
/// file it is sending, come and go with the load).
fn non_sockets(pid: u32) -> BTreeMap<String, String> {
    descriptors(pid)
        .into_iter()
        .filter(|(_, target)| !target.starts_with("socket:") && !target.contains("/www/"))
        .collect()
}

/// Compares descriptors with `before`, letting them settle a bounded while.
fn same_descriptors(
    before: &BTreeMap<String, String>,
    now: impl Fn() -> BTreeMap<String, String>,
) -> Result<(), String> {
    let mut after = now();
    for _ in 0..50 {
        if after == *before {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(100));
        after = now();
    }
    let gone: Vec<_> = before.iter().filter(|e| !after.contains_key(e.0)).collect();
    let new: Vec<_> = after
        .iter()
        .filter(|e| before.get(e.0) != Some(e.1))
        .collect();
    Err(format!(
        "descriptors changed: new or changed {new:?}, gone {gone:?}"
    ))
}

/// The signals the process has handlers for (SigCgt): a join must leave them alone.
fn handled_signals(pid: u32) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("SigCgt:"))
        .unwrap_or("")
        .trim()
        .to_owned()
}

/// Distinct copies (inodes) of heapprofd's injected library in the process's maps.
fn library_copies(pid: u32) -> usize {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap_or_default();
    maps.lines()
        .filter(|l| l.contains("/memfd:heapprofd-preload"))
        .filter_map(|l| l.split_whitespace().nth(4))
        .collect::<HashSet<_>>()
        .len()
}

/// Whether the process is alive, and no thread of it traced or stopped (bounded wait).
fn alive_and_untraced(pid: u32) -> Result<(), String> {
    let mut last = String::new();
    for _ in 0..50 {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
            .map_err(|e| format!("the target is gone (crash?): {e}"))?;
        if status.contains("State:\tZ") || status.contains("State:\tX") {
            return Err(format!("the target died (crash): {status}"));
        }
        let mut stuck = Vec::new();
        for task in std::fs::read_dir(format!("/proc/{pid}/task"))
            .map_err(|e| format!("the target is gone (crash?): {e}"))?
            .flatten()
        {
            let Ok(text) = std::fs::read_to_string(task.path().join("status")) else {
                continue;
            };
            let state = text.lines().find(|l| l.starts_with("State:")).unwrap_or("");
            let tracer = text
                .lines()
                .find(|l| l.starts_with("TracerPid:"))
                .unwrap_or("");
            if state.contains("(tracing stop)")
                || state.contains("(stopped)")
                || tracer != "TracerPid:\t0"
            {
                stuck.push(format!(
                    "{}: {state} {tracer}",
                    task.file_name().to_string_lossy()
                ));
            }
        }
        if stuck.is_empty() {
            return Ok(());
        }
        last = stuck.join(", ");
        std::thread::sleep(Duration::from_millis(100));
    }
    Err(format!("threads left traced or stopped: {last}"))
}

/// Waits (bounded) until something accepts on the port.
fn wait_listening(port: u16, what: &str) {
    for _ in 0..300 {
        if TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("{what} did not listen on 127.0.0.1:{port}");
}

/// A load generator run again and again on a thread until stopped: each run bounded,
/// its failures collected.
struct LoadLoop {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<(usize, Vec<String>)>>,
}

impl LoadLoop {
    /// `command()` makes one bounded run; `check` judges its status and output.
    fn start(
        dir: &Path,
        command: impl Fn() -> Command + Send + 'static,
        check: impl Fn(ExitStatus, &str) -> Result<(), String> + Send + 'static,
    ) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let stopping = Arc::clone(&stop);
        let output = dir.join("load-output");
        let thread = std::thread::spawn(move || {
            let mut runs = 0;
            let mut problems = Vec::new();
            // Bounded: a run takes at least milliseconds, and the test stops it.
            while !stopping.load(Ordering::Relaxed) && runs < 100_000 {
                let file = std::fs::File::create(&output).expect("load output file");
                let mut child = command()
                    .stdout(file.try_clone().expect("dup"))
                    .stderr(file)
                    .stdin(Stdio::null())
                    .spawn()
                    .expect("starting the load");
                let status = wait_bounded(&mut child, Duration::from_secs(120));
                let text = std::fs::read_to_string(&output).unwrap_or_default();
                runs += 1;
                match status {
                    None => problems.push(format!("the load hung: {text}")),
                    Some(status) => {
                        if let Err(err) = check(status, &text) {
                            problems.push(err);
                        }
                    }
                }
                if problems.len() > 20 {
                    break;
                }
            }
            (runs, problems)
        });
        Self {
            stop,
            thread: Some(thread),
        }
    }

    /// Stops after the current run; its runs and problems.
    fn finish(mut self) -> (usize, Vec<String>) {
        self.stop.store(true, Ordering::Relaxed);
        self.thread
            .take()
            .expect("running")
            .join()
            .expect("the load thread")
    }
}

impl Drop for LoadLoop {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// The cycles over one process: attach, `during` (while joined), detach, then the
/// checks every target gets and `after`.
fn cycle(
    tally: &mut Tally,
    pid: u32,
    out: &Path,
    during: &mut dyn FnMut(usize) -> Result<(), String>,
    after: &mut dyn FnMut(usize) -> Result<(), String>,
) -> bool {
    let round = tally.cycles;
    tally.cycles += 1;
    let before = non_sockets(pid);
    let handlers = handled_signals(pid);
    let session = match attach(pid, &out.join(format!("c{round}"))) {
        Ok(session) => session,
        Err(err) => {
            tally.problem(format!("cycle {round} on pid {pid}: {err}"));
            return false;
        }
    };
    // Counted now, judged once heapprofd has said how it joined (at its exit).
    let copies_while_attached = library_copies(pid);
    let joined_at = session.took;
    if let Err(err) = during(round) {
        tally.problem(format!("cycle {round} while attached: {err}"));
    }
    match session.detach() {
        Ok(Ok(())) => {
            tally.joined += 1;
            if copies_while_attached != 1 {
                tally.problem(format!(
                    "cycle {round}: {copies_while_attached} copies of the library mapped while \
                     joined"
                ));
            }
        }
        Ok(Err(reason)) => *tally.fell_back.entry(reason).or_default() += 1,
        Err(err) => {
            tally.problem(format!("cycle {round} detaching: {err}"));
            return false;
        }
    }
    if let Err(err) = alive_and_untraced(pid) {
        tally.problem(format!("cycle {round}: {err}"));
        return false;
    }
    if let Err(err) = after(round) {
        tally.problem(format!("cycle {round} after detaching: {err}"));
    }
    if handled_signals(pid) != handlers {
        tally.problem(format!(
            "cycle {round}: the process's signal handlers changed: SigCgt {handlers} before, {} \
             after",
            handled_signals(pid)
        ));
    }
    if let Err(err) = same_descriptors(&before, || non_sockets(pid)) {
        tally.problem(format!("cycle {round} on pid {pid}: {err}"));
    }
    if tally.joined > 0 && library_copies(pid) != 1 {
        tally.problem(format!(
            "cycle {round}: {} copies of the library mapped",
            library_copies(pid)
        ));
    }
    if round.is_multiple_of(10) {
        eprintln!(
            "inject_stress {}: cycle {round} attached in {joined_at:?}",
            tally.target
        );
    }
    tally.problems.len() < 10
}

// ---------------------------------------------------------------------------------
// redis

/// A minimal RESP client.
struct Redis(TcpStream);

impl Redis {
    fn connect(port: u16) -> Result<Self, String> {
        let stream =
            TcpStream::connect(("127.0.0.1", port)).map_err(|e| format!("connect: {e}"))?;
        stream
            .set_read_timeout(Some(REPLY_BOUND))
            .map_err(|e| e.to_string())?;
        Ok(Self(stream))
    }

    /// Sends a command; the reply's text ("+OK", "-ERR ...", ":1", a bulk string's
    /// payload, or "(nil)").
    fn command(&mut self, args: &[&[u8]]) -> Result<Vec<u8>, String> {
        let mut request = format!("*{}\r\n", args.len()).into_bytes();
        for arg in args {
            request.extend_from_slice(format!("${}\r\n", arg.len()).as_bytes());
            request.extend_from_slice(arg);
            request.extend_from_slice(b"\r\n");
        }
        self.0
            .write_all(&request)
            .map_err(|e| format!("writing to redis: {e}"))?;
        let line = self.line()?;
        if let Some(length) = line.strip_prefix(b"$") {
            let length: i64 = std::str::from_utf8(length)
                .ok()
                .and_then(|l| l.parse().ok())
                .ok_or_else(|| format!("bad bulk header {line:?}"))?;
            if length < 0 {
                return Ok(b"(nil)".to_vec());
            }
            let mut payload = vec![0u8; length as usize + 2];
            self.0
                .read_exact(&mut payload)
                .map_err(|e| format!("reading redis's reply (hang?): {e}"))?;
            payload.truncate(length as usize);
            return Ok(payload);
        }
        Ok(line)
    }

    fn line(&mut self) -> Result<Vec<u8>, String> {
        let mut line = Vec::new();
        let mut byte = [0u8];
        while !line.ends_with(b"\r\n") {
            self.0
                .read_exact(&mut byte)
                .map_err(|e| format!("reading redis's reply (hang?): {e}"))?;
            line.push(byte[0]);
        }
        line.truncate(line.len() - 2);
        Ok(line)
    }
}

/// The value SET for key `i` of cycle `round`.
fn redis_value(round: usize, i: usize) -> Vec<u8> {
    let size = 1 + (round * 131 + i * 977) % 5000;
    (0..size)
        .map(|j| b'a' + ((round + i + j) % 26) as u8)
        .collect()
}

/// SET keys `round`/0..20 and GET them back.
fn redis_set_get(port: u16, round: usize) -> Result<(), String> {
    let mut redis = Redis::connect(port)?;
    for i in 0..20 {
        let key = format!("stress:{round}:{i}");
        let value = redis_value(round, i);
        let reply = redis.command(&[b"SET", key.as_bytes(), &value])?;
        if reply != b"+OK" {
            return Err(format!(
                "SET {key}: {:?} (wrong reply)",
                String::from_utf8_lossy(&reply)
            ));
        }
    }
    redis_get_all(&mut redis, round)
}

fn redis_get_all(redis: &mut Redis, round: usize) -> Result<(), String> {
    for i in 0..20 {
        let key = format!("stress:{round}:{i}");
        let reply = redis.command(&[b"GET", key.as_bytes()])?;
        if reply != redis_value(round, i) {
            return Err(format!(
                "GET {key}: {} bytes, not the {} SET (wrong reply)",
                reply.len(),
                redis_value(round, i).len()
            ));
        }
    }
    Ok(())
}

/// A field of INFO persistence.
fn redis_info(redis: &mut Redis, field: &str) -> Result<String, String> {
    let info = redis.command(&[b"INFO", b"persistence"])?;
    String::from_utf8_lossy(&info)
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{field}:")).map(str::to_owned))
        .ok_or_else(|| format!("INFO has no {field}"))
}

#[test]
fn redis_under_redis_benchmark_stays_right_over_attach_detach_cycles() {
    require_root();
    let _serial = serial();
    let dir = scratch();
    let port = free_port();
    let server = Guard(
        outside_system_preload(&mut Command::new("redis-server"))
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no", "--daemonize", "no"])
            .arg("--dir")
            .arg(dir.path())
            .stdout(Stdio::null())
            .spawn()
            .expect("starting redis-server (apt-get install redis-server: cargo xtask setup)"),
    );
    wait_listening(port, "redis-server");
    let pid = server.pid();
    // Read once settled: wait_listening's own connection may still be open in redis.
    let fds_at_start = settled_descriptors(pid);
    let load = LoadLoop::start(
        dir.path(),
        move || {
            let mut cmd = Command::new("redis-benchmark");
            cmd.args(["-h", "127.0.0.1", "-p", &port.to_string()])
                .args(["-n", "4000", "-c", "10", "-d", "256", "-q"])
                .args(["-t", "set,get,lpush,lpop,sadd,hset"]);
            cmd
        },
        |status, output| {
            if !status.success() || output.to_lowercase().contains("error") {
                Err(format!("redis-benchmark: {status}: {output}"))
            } else {
                Ok(())
            }
        },
    );
    let mut tally = Tally::new("redis");
    let out = dir.path().join("profiles");
    for _ in 0..cycles(10, 130) {
        let keep_going = cycle(
            &mut tally,
            pid,
            &out,
            &mut |round| {
                redis_set_get(port, round)?;
                // A fork while joined: the child writes the dump and exits.
                if round.is_multiple_of(3) {
                    let mut redis = Redis::connect(port)?;
                    let reply = redis.command(&[b"BGSAVE"])?;
                    if !reply.starts_with(b"+") && !reply.starts_with(b"-ERR Background save") {
                        return Err(format!(
                            "BGSAVE: {} (wrong reply)",
                            String::from_utf8_lossy(&reply)
                        ));
                    }
                }
                Ok(())
            },
            &mut |round| {
                let mut redis = Redis::connect(port)?;
                redis_get_all(&mut redis, round)?;
                if round > 0 {
                    redis_get_all(&mut redis, round - 1)?;
                }
                Ok(())
            },
        );
        if !keep_going {
            break;
        }
    }
    let (runs, problems) = load.finish();
    eprintln!("inject_stress redis: {runs} redis-benchmark runs");
    for problem in problems {
        tally.problem(problem);
    }
    // Every BGSAVE child exited well, every key of every cycle is still right.
    let ended = (|| {
        let mut redis = Redis::connect(port)?;
        for _ in 0..300 {
            if redis_info(&mut redis, "rdb_bgsave_in_progress")? == "0" {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let status = redis_info(&mut redis, "rdb_last_bgsave_status")?;
        if status != "ok" {
            return Err(format!("the last BGSAVE: {status}"));
        }
        for round in 0..tally.cycles {
            redis_get_all(&mut redis, round)?;
        }
        Ok(())
    })();
    if let Err(err) = ended {
        tally.problem(format!("at the end: {err}"));
    }
    if let Err(err) = same_descriptors(&fds_at_start, || descriptors(pid)) {
        tally.problem(format!("at the end: {err}"));
    }
    tally.assert_clean();
}

// ---------------------------------------------------------------------------------
// nginx

/// The body of index.html: 20 KB nobody would mistake.
fn nginx_body() -> Vec<u8> {
    (0..20_000u32)
        .map(|i| b"0123456789abcdefghijklmnopqrstuvwxyz\n"[(i % 37) as usize])
        .collect()
}

/// GETs /index.html on a new connection; checks status and body.
fn http_get(port: u16) -> Result<(), String> {
    let mut stream =
        TcpStream::connect(("127.0.0.1", port)).map_err(|e| format!("connect to nginx: {e}"))?;
    stream
        .set_read_timeout(Some(REPLY_BOUND))
        .map_err(|e| e.to_string())?;
    stream
        .write_all(b"GET /index.html HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        .map_err(|e| format!("writing to nginx: {e}"))?;
    let mut reply = Vec::new();
    stream
        .read_to_end(&mut reply)
        .map_err(|e| format!("reading nginx's reply (hang?): {e}"))?;
    let split = reply
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or("no header end in nginx's reply (wrong reply)")?;
    let head = String::from_utf8_lossy(&reply[..split]);
    if !head.starts_with("HTTP/1.1 200") {
        return Err(format!("nginx answered {head:?} (wrong reply)"));
    }
    if reply[split + 4..] != nginx_body()[..] {
        return Err(format!(
            "nginx's body: {} bytes, not index.html's (wrong reply)",
            reply.len() - split - 4
        ));
    }
    Ok(())
}

/// Children of a process.
fn children(pid: u32) -> Vec<u32> {
    std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|c| c.parse().ok())
        .collect()
}

/// Stops nginx when dropped: SIGTERM to the master, which ends its workers; any
/// worker still there after a bounded wait is killed.
struct NginxStop {
    master: u32,
    workers: Vec<u32>,
}

impl Drop for NginxStop {
    fn drop(&mut self) {
        // SAFETY: kill(2) on processes this test started.
        unsafe { libc::kill(self.master as libc::pid_t, libc::SIGTERM) };
        let running = |pid: u32| {
            std::fs::read_to_string(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|c| c.starts_with("nginx"))
        };
        for _ in 0..100 {
            if !self.workers.iter().any(|&w| running(w)) {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        for &worker in self.workers.iter().filter(|&&w| running(w)) {
            // SAFETY: as above.
            unsafe { libc::kill(worker as libc::pid_t, libc::SIGKILL) };
        }
    }
}

#[test]
fn nginx_under_ab_stays_right_over_attach_detach_cycles() {
    require_root();
    let _serial = serial();
    let dir = scratch();
    let root = dir.path();
    let port = free_port();
    std::fs::create_dir_all(root.join("www")).expect("www");
    std::fs::create_dir_all(root.join("temp")).expect("temp");
    std::fs::write(root.join("www/index.html"), nginx_body()).expect("index.html");
    let r = root.display();
    // Its own configuration: nothing of the system's nginx is read or touched.
    let config = format!(
        "daemon off;\nmaster_process on;\nworker_processes 2;\nuser root;\n\
         pid {r}/nginx.pid;\nerror_log {r}/error.log;\n\
         events {{ worker_connections 256; }}\n\
         http {{\n  access_log off;\n  client_body_temp_path {r}/temp/body;\n\
           proxy_temp_path {r}/temp/proxy;\n  fastcgi_temp_path {r}/temp/fastcgi;\n\
           uwsgi_temp_path {r}/temp/uwsgi;\n  scgi_temp_path {r}/temp/scgi;\n\
           server {{ listen 127.0.0.1:{port}; root {r}/www; location / {{ }} }}\n}}\n"
    );
    std::fs::write(root.join("nginx.conf"), config).expect("nginx.conf");
    let master = Guard(
        outside_system_preload(&mut Command::new("nginx"))
            .arg("-p")
            .arg(root)
            .arg("-c")
            .arg(root.join("nginx.conf"))
            .arg("-e")
            .arg(root.join("error.log"))
            .stdout(Stdio::null())
            .spawn()
            .expect("starting nginx (apt-get install nginx: cargo xtask setup)"),
    );
    wait_listening(port, "nginx");
    let mut workers = Vec::new();
    for _ in 0..100 {
        workers = children(master.pid());
        if workers.len() == 2 {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(workers.len(), 2, "nginx's workers: {workers:?}");
    // Dropped before `master`: its workers end with it, none is left orphaned.
    let _stop = NginxStop {
        master: master.pid(),
        workers: workers.clone(),
    };
    let mut targets = workers.clone();
    targets.push(master.pid());
    // A worker seen right after its fork is still setting up (its epoll and eventfd,
    // closing the other workers' channels): the descriptors heapprofd must leave as
    // they are are those of a worker that has settled.
    let fds_at_start: Vec<_> = targets.iter().map(|&p| settled_descriptors(p)).collect();
    let url = format!("http://127.0.0.1:{port}/index.html");
    let load = LoadLoop::start(
        root,
        move || {
            let mut cmd = Command::new("ab");
            cmd.args(["-k", "-q", "-n", "3000", "-c", "8", "-s", "30", &url]);
            cmd
        },
        |status, output| {
            let failed = output
                .lines()
                .find(|l| l.starts_with("Failed requests:"))
                .and_then(|l| l.split_whitespace().nth(2))
                .and_then(|n| n.parse::<u64>().ok());
            if !status.success() || failed != Some(0) || output.contains("Non-2xx") {
                Err(format!("ab: {status}: {output}"))
            } else {
                Ok(())
            }
        },
    );
    let mut tally = Tally::new("nginx");
    let out = root.join("profiles");
    for round in 0..cycles(10, 130) {
        // The workers serve the load; the master, every fifth cycle, waits for signals.
        let pid = if round % 5 == 4 {
            master.pid()
        } else {
            workers[round % 2]
        };
        let check = &mut |_| {
            for _ in 0..6 {
                http_get(port)?;
            }
            Ok(())
        };
        let keep_going = cycle(&mut tally, pid, &out, &mut |_| Ok(()), check);
        if !keep_going {
            break;
        }
    }
    let (runs, problems) = load.finish();
    eprintln!("inject_stress nginx: {runs} ab runs");
    for problem in problems {
        tally.problem(problem);
    }
    if children(master.pid()) != workers {
        tally.problem(format!(
            "nginx's workers changed (one died?): {workers:?} then {:?}",
            children(master.pid())
        ));
    }
    for (pid, before) in targets.iter().zip(&fds_at_start) {
        if let Err(err) = same_descriptors(before, || descriptors(*pid)) {
            tally.problem(format!("at the end, pid {pid}: {err}"));
        }
    }
    if let Err(err) = http_get(port) {
        tally.problem(format!("at the end: {err}"));
    }
    let errors = std::fs::read_to_string(root.join("error.log")).unwrap_or_default();
    if errors.contains("[alert]") || errors.contains("[emerg]") || errors.contains("[crit]") {
        tally.problem(format!("nginx's error log: {errors}"));
    }
    tally.assert_clean();
}

// ---------------------------------------------------------------------------------
// Programs that print "progress ROUNDS ERRORS": python3 and a JVM

/// A program printing "ready", then "progress ROUNDS ERRORS" lines.
struct Progressing {
    guard: Guard,
    lines: mpsc::Receiver<String>,
    _stdin: std::process::ChildStdin,
    last: u64,
}

impl Progressing {
    fn start(command: &mut Command) -> Self {
        let mut child = outside_system_preload(command)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("starting the target");
        let stdin = child.stdin.take().expect("stdin");
        let lines = forward_lines(child.stdout.take().expect("stdout"));
        let guard = Guard(child);
        let first = lines
            .recv_timeout(Duration::from_secs(60))
            .expect("the target did not start");
        assert_eq!(first, "ready");
        Self {
            guard,
            lines,
            _stdin: stdin,
            last: 0,
        }
    }

    /// Its latest count must have advanced, with no error.
    fn advanced(&mut self) -> Result<(), String> {
        let deadline = Instant::now() + REPLY_BOUND;
        let mut latest = None;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    let mut fields = line.split(' ');
                    let parsed = (fields.next(), fields.next(), fields.next());
                    let (Some("progress"), Some(rounds), Some(errors)) = parsed else {
                        return Err(format!("the target printed {line:?} (wrong reply)"));
                    };
                    let rounds: u64 = rounds.parse().map_err(|_| format!("bad line {line:?}"))?;
                    if errors != "0" {
                        return Err(format!("the target found wrong results: {line}"));
                    }
                    latest = Some(rounds);
                    if rounds > self.last {
                        // Drain what is already there, then stop.
                        while let Ok(more) = self.lines.try_recv() {
                            if more.ends_with(" 0") && more.starts_with("progress ") {
                                continue;
                            }
                            return Err(format!("the target printed {more:?}"));
                        }
                        self.last = rounds;
                        return Ok(());
                    }
                }
                Err(_) => {
                    return Err(format!(
                        "no progress within {REPLY_BOUND:?} (hang): last count {}, latest {latest:?}",
                        self.last
                    ));
                }
            }
        }
    }
}

/// Cycles over a progressing program.
fn progressing_cycles(target: &str, mut program: Progressing, dir: &Path, count: usize) {
    let pid = program.guard.pid();
    program
        .advanced()
        .expect("the target works before any heapprofd");
    let fds_at_start = descriptors(pid);
    let mut tally = Tally::new(target);
    let out = dir.join("profiles");
    for _ in 0..count {
        let keep_going = cycle(&mut tally, pid, &out, &mut |_| Ok(()), &mut |_| {
            program.advanced()
        });
        if !keep_going {
            break;
        }
    }
    if let Err(err) = program.advanced() {
        tally.problem(format!("at the end: {err}"));
    }
    if let Err(err) = same_descriptors(&fds_at_start, || descriptors(pid)) {
        tally.problem(format!("at the end: {err}"));
    }
    tally.assert_clean();
}

#[test]
fn a_multithreaded_python3_keeps_counting_over_attach_detach_cycles() {
    require_root();
    let _serial = serial();
    let dir = scratch();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/programs/stress_threads.py");
    // Debian's python3 (not one a version manager put first in PATH).
    let program = Progressing::start(Command::new("/usr/bin/python3").arg(&script).arg("4"));
    progressing_cycles("python3", program, dir.path(), cycles(8, 90));
}

#[test]
fn a_jvm_allocating_natively_keeps_counting_over_attach_detach_cycles() {
    require_root();
    let _serial = serial();
    let dir = scratch();
    let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/programs/StressAlloc.java");
    let status = Command::new("javac")
        .arg("-d")
        .arg(dir.path())
        .arg(&source)
        .status()
        .expect("running javac (the JDK)");
    assert!(status.success(), "javac failed");
    let program = Progressing::start(
        Command::new("java")
            .args(["-Xmx256m", "-XX:MaxDirectMemorySize=128m", "-cp"])
            .arg(dir.path())
            .args(["StressAlloc", "4"]),
    );
    progressing_cycles("jvm", program, dir.path(), cycles(6, 70));
}

// ---------------------------------------------------------------------------------
// tests/programs/stress_target.c

/// stress_target.c, driven by commands.
struct Target {
    guard: Guard,
    stdin: std::process::ChildStdin,
    lines: mpsc::Receiver<String>,
    rounds: u64,
    forks: u64,
    /// Children gone wrong so far.
    fork_errors: i64,
}

fn build_target(dir: &Path) -> PathBuf {
    compile(dir, "stress_target", "stress_target", &["-O2", "-ldl"])
}

impl Target {
    fn start(command: &mut Command) -> Self {
        let mut child = outside_system_preload(command)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("starting stress_target");
        let stdin = child.stdin.take().expect("stdin");
        let lines = forward_lines(child.stdout.take().expect("stdout"));
        let guard = Guard(child);
        let first = lines
            .recv_timeout(Duration::from_secs(30))
            .expect("stress_target did not start");
        assert_eq!(first, "ready");
        Self {
            guard,
            stdin,
            lines,
            rounds: 0,
            forks: 0,
            fork_errors: 0,
        }
    }

    fn pid(&self) -> u32 {
        self.guard.pid()
    }

    /// Sends a command, returns its answer (bounded).
    fn ask(&mut self, command: &str) -> Result<String, String> {
        writeln!(self.stdin, "{command}").map_err(|e| format!("writing {command:?}: {e}"))?;
        self.stdin.flush().map_err(|e| e.to_string())?;
        self.lines
            .recv_timeout(REPLY_BOUND)
            .map_err(|e| format!("no answer to {command:?} within {REPLY_BOUND:?} (hang): {e}"))
    }

    fn expect(&mut self, command: &str, wanted: &str) -> Result<(), String> {
        let answer = self.ask(command)?;
        if answer == wanted {
            Ok(())
        } else {
            Err(format!(
                "{command:?}: {answer:?}, not {wanted:?} (wrong reply)"
            ))
        }
    }

    /// Rounds must advance (within a bound), no block found corrupted, no fork gone
    /// wrong.
    fn check(&mut self) -> Result<(), String> {
        let deadline = Instant::now() + REPLY_BOUND;
        loop {
            let answer = self.ask("check")?;
            let numbers: Vec<i64> = answer
                .strip_prefix("ok ")
                .map(|rest| rest.split(' ').filter_map(|n| n.parse().ok()).collect())
                .unwrap_or_default();
            let [rounds, errors, forks, fork_errors, bad_status] = numbers[..] else {
                return Err(format!("check: {answer:?} (wrong reply)"));
            };
            let (rounds, forks) = (rounds as u64, forks as u64);
            // Each check reports what went wrong since the last one.
            let seen = std::mem::replace(&mut self.fork_errors, fork_errors);
            if errors != 0 || fork_errors != seen {
                return Err(format!(
                    "check: {answer}: {errors} corrupted blocks, {} more children gone \
                     wrong (the last one's wait status {bad_status:#x}: {})",
                    fork_errors - seen,
                    describe_status(bad_status)
                ));
            }
            self.forks = forks;
            if rounds > self.rounds {
                self.rounds = rounds;
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(format!(
                    "check: {answer}: no progress since {} within {REPLY_BOUND:?} (hang)",
                    self.rounds
                ));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The allocation works and the loader is free (a dlopen in the process).
    fn works(&mut self) -> Result<(), String> {
        self.check()?;
        self.expect("dlopen", "dlopened")?;
        self.expect("got", "got same")
    }
}

/// A wait status in words.
fn describe_status(status: i64) -> String {
    let status = status as i32;
    if status == -1 {
        "fork or waitpid failed".to_owned()
    } else if libc::WIFSIGNALED(status) {
        format!("killed by signal {}", libc::WTERMSIG(status))
    } else if libc::WIFEXITED(status) {
        format!("exited {}", libc::WEXITSTATUS(status))
    } else {
        "?".to_owned()
    }
}

/// Cycles over a stress_target, each also running `during` and `after`.
fn target_cycles(
    tally: &mut Tally,
    target: &mut Target,
    out: &Path,
    count: usize,
    during: &dyn Fn(&mut Target) -> Result<(), String>,
) {
    let pid = target.pid();
    let cell = std::cell::RefCell::new(target);
    for _ in 0..count {
        let keep_going = cycle(
            tally,
            pid,
            out,
            &mut |_| {
                let mut target = cell.borrow_mut();
                target.expect("got", "got moved")?;
                during(&mut target)?;
                target.check()
            },
            &mut |_| cell.borrow_mut().works(),
        );
        if !keep_going {
            break;
        }
    }
}

#[test]
fn a_process_in_its_own_mount_namespace_is_joined_over_and_over() {
    require_root();
    let _serial = serial();
    let dir = scratch();
    let binary = build_target(dir.path());
    // A private tmpfs over /tmp and /run: heapprofd's files and this test's scratch
    // directory are out of its sight. The binary is opened before and run from its fd.
    let script = "exec 3<\"$1\"; mount -t tmpfs heapprofd-test /tmp && \
                  mount -t tmpfs heapprofd-test /run && exec /proc/self/fd/3 3";
    let mut target = Target::start(
        Command::new("unshare")
            .args(["--mount", "--propagation", "private", "/bin/sh", "-c"])
            .arg(script)
            .arg("sh")
            .arg(&binary),
    );
    let pid = target.pid();
    assert!(
        !Path::new(&format!("/proc/{pid}/root{}", binary.display())).exists(),
        "the target sees the test's files: not its own mount namespace"
    );
    assert_ne!(
        std::fs::read_link(format!("/proc/{pid}/ns/mnt")).expect("ns"),
        std::fs::read_link("/proc/self/ns/mnt").expect("ns"),
        "the target shares the test's mount namespace"
    );
    target
        .works()
        .expect("the target works before any heapprofd");
    let fds_at_start = descriptors(pid);
    let mut tally = Tally::new("mount-namespace");
    target_cycles(
        &mut tally,
        &mut target,
        &dir.path().join("profiles"),
        cycles(8, 70),
        &|_| Ok(()),
    );
    if let Err(err) = target.works() {
        tally.problem(format!("at the end: {err}"));
    }
    if let Err(err) = same_descriptors(&fds_at_start, || descriptors(pid)) {
        tally.problem(format!("at the end: {err}"));
    }
    tally.assert_clean();
}

#[test]
fn a_process_forking_and_execing_while_joined_stays_right() {
    require_root();
    let _serial = serial();
    let dir = scratch();
    let binary = build_target(dir.path());
    let mut target = Target::start(&mut Command::new(&binary));
    let pid = target.pid();
    target
        .works()
        .expect("the target works before any heapprofd");
    let fds_at_start = descriptors(pid);
    let mut tally = Tally::new("fork-exec");
    let forks_before = target.forks;
    target_cycles(
        &mut tally,
        &mut target,
        &dir.path().join("profiles"),
        cycles(6, 50),
        &|target| {
            target.expect("forks on", "forking")?;
            // Children fork from the joined process, allocate through its redirected
            // slots and exec, until some have.
            let forked = target.forks;
            let mut checked = Ok(());
            for _ in 0..100 {
                std::thread::sleep(Duration::from_millis(20));
                checked = target.check();
                if checked.is_err() || target.forks >= forked + 5 {
                    break;
                }
            }
            // Stopped whatever the checks found: the next cycle starts it again.
            target.expect("forks off", "not forking")?;
            checked
        },
    );
    if let Err(err) = target.works() {
        tally.problem(format!("at the end: {err}"));
    }
    if target.forks <= forks_before {
        tally.problem("no child was forked while joined".to_owned());
    }
    eprintln!(
        "inject_stress fork-exec: {} children forked and exec'd",
        target.forks
    );
    if let Err(err) = same_descriptors(&fds_at_start, || descriptors(pid)) {
        tally.problem(format!("at the end: {err}"));
    }
    tally.assert_clean();
}

#[test]
fn a_thread_stopped_inside_malloc_at_the_attach_does_no_harm() {
    // The main thread is interrupted inside the C library's malloc or free by a signal
    // whose handler then waits in read(): /proc shows it waiting in a system call, but
    // it may hold malloc's lock. heapprofd must neither deadlock the process nor leave
    // its loader locked.
    require_root();
    let _serial = serial();
    let dir = scratch();
    let binary = build_target(dir.path());
    let mut target = Target::start(&mut Command::new(&binary));
    let pid = target.pid();
    target
        .works()
        .expect("the target works before any heapprofd");
    let fds_at_start = descriptors(pid);
    let mut tally = Tally::new("stopped-in-malloc");
    let out = dir.path().join("profiles");
    for _ in 0..cycles(4, 40) {
        let answer = target.ask("trap");
        match answer {
            Ok(answer) if answer.starts_with("trapped") => {}
            other => {
                tally.problem(format!("trap: {other:?}"));
                break;
            }
        }
        let cell = std::cell::RefCell::new(&mut target);
        let keep_going = cycle(
            &mut tally,
            pid,
            &out,
            &mut |_| {
                let mut target = cell.borrow_mut();
                target.check()?;
                target.expect("release", "released")
            },
            &mut |_| cell.borrow_mut().works(),
        );
        if !keep_going {
            break;
        }
    }
    if let Err(err) = target.works() {
        tally.problem(format!("at the end: {err}"));
    }
    if let Err(err) = same_descriptors(&fds_at_start, || descriptors(pid)) {
        tally.problem(format!("at the end: {err}"));
    }
    tally.assert_clean();
}

#[test]
fn heapprofd_sigkilled_mid_attach_leaves_the_process_working() {
    require_root();
    let _serial = serial();
    let dir = scratch();
    let binary = build_target(dir.path());
    let mut target = Target::start(&mut Command::new(&binary));
    let pid = target.pid();
    target
        .works()
        .expect("the target works before any heapprofd");
    let fds_at_start = descriptors(pid);
    let out = dir.path().join("profiles");
    let mut tally = Tally::new("sigkill");
    // How long a start-up takes here: the kills fall within it, and a bit after.
    let first = attach(pid, &out.join("first")).expect("a first session");
    let startup = first.took;
    let joined = first.detach().expect("the first session ends");
    assert!(joined.is_ok(), "not joined: {joined:?}");
    tally.cycles += 1;
    tally.joined += 1;
    let kills = cycles(12, 110);
    let mut seed = 0x2545_f491_u64 ^ u64::from(pid);
    let mut killed_ready = 0;
    for kill in 0..kills {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let delay = startup.mul_f64(1.2 * ((seed >> 33) as f64 / (1u64 << 31) as f64));
        let killed_out = out.join(format!("k{kill}"));
        let mut child = spawn_heapprofd(pid, &killed_out);
        let log = forward_lines(child.stderr.take().expect("stderr"));
        std::thread::sleep(delay);
        // SIGKILL: nothing of heapprofd runs after it.
        let _ = child.kill();
        let _ = child.wait();
        let lines: Vec<String> = log.iter().collect();
        // Ready: it had joined (or, where it could not, attached its probes).
        let was_ready = ready_file(&killed_out).exists();
        killed_ready += usize::from(was_ready);
        let result = (|| {
            alive_and_untraced(pid)?;
            target.check()?;
            // A killed heapprofd's library leaves by itself, within a few hundred
            // allocations of a thread: the GOT slots hold the allocator again.
            let mut got = String::new();
            for _ in 0..100 {
                got = target.ask("got")?;
                if got == "got same" {
                    break;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            if got != "got same" {
                return Err(format!(
                    "5 s after heapprofd was killed the GOT still points at the library ({got})"
                ));
            }
            target.expect("dlopen", "dlopened")?;
            // Nothing of the killed heapprofd stays open in it: no memfd, no socket,
            // and its pidfd closed once the library left.
            same_descriptors(&fds_at_start, || descriptors(pid))?;
            target.check()
        })();
        if let Err(err) = result {
            tally.problem(format!(
                "kill {kill} after {delay:?} (ready: {was_ready}): {err}\nheapprofd's log:\n{}",
                lines.join("\n")
            ));
            if alive_and_untraced(pid).is_err() {
                break;
            }
        }
        // Every tenth kill, a normal session: it must join and leave.
        if kill % 10 == 9 || kill + 1 == kills {
            let keep_going = cycle(
                &mut tally,
                pid,
                &out,
                &mut |_| target.expect("got", "got moved"),
                &mut |_| Ok(()),
            );
            if !keep_going {
                break;
            }
            if let Err(err) = target.works() {
                tally.problem(format!("after the session following kill {kill}: {err}"));
            }
        }
    }
    eprintln!(
        "inject_stress sigkill: {kills} heapprofd killed (start-up {startup:?}), \
         {killed_ready} of them once ready"
    );
    if let Err(err) = target.works() {
        tally.problem(format!("at the end: {err}"));
    }
    if let Err(err) = same_descriptors(&fds_at_start, || descriptors(pid)) {
        tally.problem(format!("at the end: {err}"));
    }
    tally.assert_clean();
}

/// heapprofd SIGKILLed while the joined process forks, once its probe site has run for
/// a while: the process and every child it forks keep working. On Linux 6.18 the
/// kernel has by then optimized the site's uprobe into a call, and a SIGKILL takes it
/// back out in several writes, which a fork may fall between: its child then starts
/// with half an instruction (seen with a 5-byte NOP site: children died of SIGSEGV
/// inside it).
#[test]
fn heapprofd_sigkilled_while_the_joined_process_forks_leaves_its_children_working() {
    require_root();
    let _serial = serial();
    let dir = scratch();
    let binary = build_target(dir.path());
    let mut target = Target::start(&mut Command::new(&binary));
    let pid = target.pid();
    target
        .works()
        .expect("the target works before any heapprofd");
    let fds_at_start = descriptors(pid);
    let out = dir.path().join("profiles");
    let mut tally = Tally::new("sigkill-forking");
    target
        .expect("forks on", "forking")
        .expect("the target forks");
    let forks_before = target.forks;
    let kills = cycles(6, 60);
    for kill in 0..kills {
        tally.cycles += 1;
        let mut session = match attach(pid, &out.join(format!("k{kill}"))) {
            Ok(session) => session,
            Err(err) => {
                tally.problem(format!("kill {kill}: {err}"));
                break;
            }
        };
        tally.joined += 1;
        // Long enough for many reports through the site, so for the kernel to
        // optimize its probe.
        std::thread::sleep(Duration::from_millis(700));
        let _ = session.child.kill();
        let _ = session.child.wait();
        // The children forked around the kill have run and been reaped by the next
        // round of checks.
        let result = (|| {
            alive_and_untraced(pid)?;
            std::thread::sleep(Duration::from_millis(300));
            target.check()?;
            target.check()
        })();
        if let Err(err) = result {
            let lines: Vec<String> = session.log.iter().collect();
            tally.problem(format!(
                "kill {kill}: {err}\nheapprofd's log:\n{}",
                lines.join("\n")
            ));
            if alive_and_untraced(pid).is_err() {
                break;
            }
        }
    }
    if let Err(err) = target.expect("forks off", "not forking") {
        tally.problem(format!("at the end: {err}"));
    }
    if target.forks <= forks_before {
        tally.problem("no child was forked while joined".to_owned());
    }
    eprintln!(
        "inject_stress sigkill-forking: {kills} heapprofd killed while joined, {} children \
         forked",
        target.forks - forks_before
    );
    if let Err(err) = target.works() {
        tally.problem(format!("at the end: {err}"));
    }
    // A killed heapprofd's library leaves by itself (see the test above): by now
    // nothing of the killed sessions stays open.
    if let Err(err) = same_descriptors(&fds_at_start, || descriptors(pid)) {
        tally.problem(format!("at the end: {err}"));
    }
    tally.assert_clean();
}
