//! Helpers shared by the integration tests: building the C test programs,
//! running heapprofd, decoding and checking its profiles.
#![allow(dead_code, reason = "each test binary uses a different subset")]

pub mod bpftrace;
pub mod counted;
pub mod dhat;
pub mod kernel_vm;
pub mod valgrind;
pub mod vm;

use std::{
    collections::HashMap,
    io::{BufRead as _, BufReader, Read as _},
    net::TcpListener,
    path::{Path, PathBuf},
    process::{Child, Command, Output, Stdio},
    sync::{Mutex, MutexGuard, PoisonError, mpsc},
    time::Duration,
};

use heapprof_daemon::pprof::{builder::validate, proto::Profile};
use prost::Message as _;

/// Holds the tests of one binary that take it to one at a time (each test binary
/// has its own): for tests that want the machine, or their log checks, to
/// themselves; each file says why. A test that panicked leaves it usable.
pub fn serial() -> MutexGuard<'static, ()> {
    static SERIAL: Mutex<()> = Mutex::new(());
    SERIAL.lock().unwrap_or_else(PoisonError::into_inner)
}

/// True when `cargo xtask stress` asks for the full scale (`HEAPPROFD_LOAD=full`),
/// not the suite's few rounds.
pub fn full_scale() -> bool {
    std::env::var("HEAPPROFD_LOAD").is_ok_and(|v| v == "full")
}

/// A TCP port on 127.0.0.1 that nothing listened on a moment ago.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

/// The BPF tests need root (or CAP_BPF+CAP_PERFMON). They never skip: without it they fail.
pub fn require_root() {
    // SAFETY: geteuid cannot fail.
    let euid = unsafe { libc::geteuid() };
    assert_eq!(
        euid, 0,
        "this test loads BPF programs and must run as root: use `sudo -E cargo xtask test` (CI runs as root)"
    );
}

/// A scratch directory for one test, removed when dropped.
pub fn scratch() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("heapprofd-test-")
        .tempdir()
        .expect("creating a scratch directory")
}

/// Compiles `tests/programs/NAME.c` into `dir` with the given flags; returns the binary.
pub fn compile(dir: &Path, name: &str, output_name: &str, flags: &[&str]) -> PathBuf {
    compile_with("gcc", dir, name, output_name, flags)
}

/// [`compile`] with another C compiler (a cross compiler).
pub fn compile_with(
    compiler: &str,
    dir: &Path,
    name: &str,
    output_name: &str,
    flags: &[&str],
) -> PathBuf {
    // -fno-builtin: keep every allocator call as written (gcc folds realloc(NULL, n) into malloc).
    let mut all = vec!["-g", "-fno-builtin", "-fno-omit-frame-pointer", "-pthread"];
    all.extend_from_slice(flags);
    compile_exact(compiler, dir, &format!("{name}.c"), output_name, &all)
}

/// Compiles `tests/programs/SOURCE` (file name with its extension) into `dir/OUTPUT_NAME`
/// with `compiler` and exactly `flags`: unlike [`compile_with`], nothing is added, so the
/// code is built as a distribution builds it (no `-fno-omit-frame-pointer`).
pub fn compile_exact(
    compiler: &str,
    dir: &Path,
    source: &str,
    output_name: &str,
    flags: &[&str],
) -> PathBuf {
    let source = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("tests/programs/{source}"));
    let binary = dir.join(output_name);
    let status = Command::new(compiler)
        .args(flags)
        .arg("-o")
        .arg(&binary)
        .arg(&source)
        .status()
        .unwrap_or_else(|e| panic!("running {compiler} ({e}); install it: cargo xtask setup"));
    assert!(
        status.success(),
        "{compiler} {flags:?} failed on {}",
        source.display()
    );
    binary
}

/// A heapprofd command writing into `out`, which creates [`ready_file`]`(out)` once
/// its probes are on. It starts with SIGINT and SIGQUIT at their defaults, as from a
/// terminal, whatever the harness inherited.
pub fn heapprofd(out: &Path) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_heapprofd"));
    cmd.arg("-o")
        .arg(out)
        .arg("--ready-file")
        .arg(ready_file(out))
        .env("RUST_LOG", "info");
    with_signal_disposition(&mut cmd, libc::SIG_DFL);
    cmd
}

/// Starts `cmd` with SIGINT and SIGQUIT set to `disposition` (`SIG_DFL` or `SIG_IGN`).
/// A harness started in the background by a shell without job control (a script's
/// `cargo test &`) ignores both, and launch mode's command inherits that, as it would
/// without heapprofd: a SIGINT passed on would then never end it.
pub fn with_signal_disposition(cmd: &mut Command, disposition: libc::sighandler_t) {
    use std::os::unix::process::CommandExt as _;
    // SAFETY: signal(2) is async-signal-safe, as pre_exec requires.
    unsafe {
        cmd.pre_exec(move || {
            libc::signal(libc::SIGINT, disposition);
            libc::signal(libc::SIGQUIT, disposition);
            Ok(())
        });
    }
}

/// The signals process `pid` ignores: the `SigIgn` mask of its status (bit N-1 for
/// signal N).
pub fn ignored_signals(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    let hex = status
        .lines()
        .find_map(|line| line.strip_prefix("SigIgn:"))
        .expect("a SigIgn line")
        .trim();
    u64::from_str_radix(hex, 16).expect("a hexadecimal mask")
}

/// The `--ready-file` of a heapprofd writing into `out`: beside it.
pub fn ready_file(out: &Path) -> PathBuf {
    out.with_extension("ready")
}

/// Runs heapprofd to completion and checks it succeeded.
pub fn run_ok(cmd: &mut Command) -> Output {
    let output = cmd.output().expect("starting heapprofd");
    assert!(
        output.status.success(),
        "{cmd:?} failed ({}):\nstdout: {}\nstderr: {}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    output
}

/// Every profile in `dir`, in name (= chronological) order, decoded and validated.
pub fn read_profiles(dir: &Path) -> Vec<(PathBuf, Profile)> {
    let mut paths: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
        .map(|e| e.expect("dir entry").path())
        .filter(|p| p.to_string_lossy().ends_with(".pb.gz"))
        .collect();
    paths.sort();
    paths
        .into_iter()
        .map(|path| {
            let profile = decode(&path);
            (path, profile)
        })
        .collect()
}

/// Decodes one gzip'd profile and checks the format's rules.
pub fn decode(path: &Path) -> Profile {
    let file =
        std::fs::File::open(path).unwrap_or_else(|e| panic!("opening {}: {e}", path.display()));
    let mut bytes = Vec::new();
    flate2::read::GzDecoder::new(file)
        .read_to_end(&mut bytes)
        .unwrap_or_else(|e| panic!("{} is not gzip: {e}", path.display()));
    let profile = Profile::decode(bytes.as_slice())
        .unwrap_or_else(|e| panic!("{} is not a profile: {e}", path.display()));
    validate(&profile).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    profile
}

/// The last profile written in `dir`.
pub fn last_profile(dir: &Path) -> Profile {
    read_profiles(dir)
        .pop()
        .unwrap_or_else(|| panic!("no profile in {}", dir.display()))
        .1
}

/// A sample in readable form.
#[derive(Debug, Clone)]
pub struct Sample {
    /// Function names, leaf (the allocator) first, inlined frames expanded.
    pub stack: Vec<String>,
    /// alloc_objects, alloc_space, inuse_objects, inuse_space.
    pub values: [i64; 4],
    /// Every value, by sample type name (the four above and any others).
    pub by_type: HashMap<String, i64>,
    /// String labels and numeric labels (as decimal strings).
    pub labels: HashMap<String, String>,
}

impl Sample {
    /// The stack from the allocator's caller up to and including `main` (or the whole stack).
    pub fn up_to_main(&self) -> Vec<&str> {
        let mut frames: Vec<&str> = self.stack.iter().skip(1).map(String::as_str).collect();
        if let Some(main) = frames.iter().position(|f| *f == "main") {
            frames.truncate(main + 1);
        }
        frames
    }
}

/// Every sample of a profile.
pub fn samples(profile: &Profile) -> Vec<Sample> {
    let string = |i: i64| profile.string_table[i as usize].clone();
    let functions: HashMap<u64, String> = profile
        .function
        .iter()
        .map(|f| (f.id, string(f.name)))
        .collect();
    let locations: HashMap<u64, Vec<String>> = profile
        .location
        .iter()
        .map(|l| {
            (
                l.id,
                l.line
                    .iter()
                    .map(|line| functions[&line.function_id].clone())
                    .collect(),
            )
        })
        .collect();
    profile
        .sample
        .iter()
        .map(|s| Sample {
            stack: s
                .location_id
                .iter()
                .flat_map(|id| locations[id].clone())
                .collect(),
            values: [s.value[0], s.value[1], s.value[2], s.value[3]],
            by_type: profile
                .sample_type
                .iter()
                .zip(&s.value)
                .map(|(t, &v)| (string(t.r#type), v))
                .collect(),
            labels: s
                .label
                .iter()
                .map(|l| {
                    (
                        string(l.key),
                        if l.str != 0 {
                            string(l.str)
                        } else {
                            l.num.to_string()
                        },
                    )
                })
                .collect(),
        })
        .collect()
}

/// The profile's comments.
pub fn comments(profile: &Profile) -> Vec<&str> {
    profile
        .comment
        .iter()
        .map(|&i| profile.string_table[i as usize].as_str())
        .collect()
}

/// The drop counter of `reason` as the profile's comments give it ("dropped: TEXT
/// [NAME] = N"), found by the reason's stable name, never by its wording.
pub fn drop_count(profile: &Profile, reason: heapprof_common::DropReason) -> i64 {
    let by_name = format!("[{}] = ", reason.name());
    comments(profile)
        .iter()
        .filter_map(|c| c.strip_prefix("dropped: "))
        .find_map(|c| Some(c.split_once(&by_name)?.1))
        .and_then(|count| count.trim().parse().ok())
        .unwrap_or_else(|| panic!("no drop counter for {reason:?}: {:?}", comments(profile)))
}

/// Sum of each value over the samples that pass `filter`.
pub fn totals(samples: &[Sample], filter: impl Fn(&Sample) -> bool) -> [i64; 4] {
    samples
        .iter()
        .filter(|s| filter(s))
        .fold([0; 4], |mut acc, s| {
            for (a, v) in acc.iter_mut().zip(s.values) {
                *a += v;
            }
            acc
        })
}

/// Lines of `stream`, read on a thread.
pub fn forward_lines(stream: impl std::io::Read + Send + 'static) -> mpsc::Receiver<String> {
    let (send, receive) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stream).lines().map_while(Result::ok) {
            if send.send(line).is_err() {
                break;
            }
        }
    });
    receive
}

/// How a heapprofd's start ended, as [`wait_ready`] saw it.
#[derive(Debug)]
pub enum Start {
    /// It created its `--ready-file`: its probes are attached and armed.
    Ready,
    /// It exited first.
    Exited(std::process::ExitStatus),
    /// Neither within the time given.
    TimedOut,
}

/// Waits up to `within` until heapprofd `child` creates its `--ready-file` `ready`,
/// or exits.
pub fn wait_ready(child: &mut Child, ready: &Path, within: Duration) -> Start {
    let deadline = std::time::Instant::now() + within;
    loop {
        if ready.exists() {
            return Start::Ready;
        }
        if let Ok(Some(status)) = child.try_wait() {
            // It may have got ready just before it exited.
            return if ready.exists() {
                Start::Ready
            } else {
                Start::Exited(status)
            };
        }
        if std::time::Instant::now() >= deadline {
            return Start::TimedOut;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// The `--ready-file` that `cmd` names ([`heapprofd`] names one), removed if an earlier
/// run left it.
pub fn ready_file_of(cmd: &Command) -> PathBuf {
    let ready = cmd
        .get_args()
        .skip_while(|arg| *arg != "--ready-file")
        .nth(1)
        .map(PathBuf::from)
        .expect("a heapprofd command with --ready-file (see heapprofd())");
    let _ = std::fs::remove_file(&ready);
    ready
}

/// Starts heapprofd and waits until its probes are attached: until it creates the
/// `--ready-file` its command names ([`heapprofd`] names one). The lines it logs
/// meanwhile are dropped; a heapprofd that exits first fails the test with them.
pub fn start_heapprofd(cmd: &mut Command) -> (Child, mpsc::Receiver<String>) {
    let ready = ready_file_of(cmd);
    let mut child = cmd
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting heapprofd");
    let lines = forward_lines(child.stderr.take().expect("stderr"));
    let failure = match wait_ready(&mut child, &ready, Duration::from_secs(60)) {
        Start::Ready => return (child, lines),
        Start::Exited(status) => format!("heapprofd exited ({status}) before attaching"),
        Start::TimedOut => "heapprofd did not report attaching within 60 s".to_owned(),
    };
    let _ = child.kill();
    let _ = child.wait();
    // The stderr reader ends at EOF, which follows the exit.
    let seen: Vec<String> = lines.iter().collect();
    panic!("{failure}; its log:\n{}", seen.join("\n"));
}

/// The `--stats-json` file of a heapprofd writing into `out`, beside it (a test that
/// reads it adds `--stats-json` with this path).
pub fn stats_file(out: &Path) -> PathBuf {
    out.with_extension("stats.json")
}

/// The `--profiles-json` file of a heapprofd writing into `out`, beside it (a test that
/// follows it adds `--profiles-json` with this path).
pub fn profiles_json(out: &Path) -> PathBuf {
    out.with_extension("jsonl")
}

/// Waits up to a minute for a line of the `--profiles-json` at `path` that `wanted`
/// picks, among the lines from the `from`th on (0-based); returns it and its index.
/// `what` names it in the failure, which lists every line read.
pub fn wait_for_profiles_line(
    path: &Path,
    from: usize,
    what: &str,
    wanted: impl Fn(&heapprof_daemon::profiles_file::Line) -> bool,
) -> (heapprof_daemon::profiles_file::Line, usize) {
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        // The file exists once heapprofd is ready; a line is read only when whole.
        let lines = match heapprof_daemon::profiles_file::read(path) {
            Ok(lines) => lines,
            Err(_) if !path.exists() => Vec::new(),
            Err(err) => panic!("{err:#}"),
        };
        if let Some((index, line)) = lines.iter().enumerate().skip(from).find(|(_, l)| wanted(l)) {
            return (line.clone(), index);
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no {what} in --profiles-json {} within 60 s: {lines:#?}",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The `--stats-json` file at `path`, which heapprofd writes at its exit.
pub fn read_stats(path: &Path) -> serde_json::Value {
    let text = std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("heapprofd wrote no --stats-json {}: {e}", path.display()));
    serde_json::from_str(&text).expect("--stats-json is JSON")
}

/// How the `--stats-json` at `path` says heapprofd joined its `--pid` target:
/// `Ok(())` in-process (`injected`), or `Err(why not)` on the allocator's probes.
pub fn joined_in_process(path: &Path) -> Result<(), String> {
    let stats = read_stats(path);
    let joined = &stats["joined"];
    match joined["how"].as_str() {
        Some("injected") => Ok(()),
        Some("probes") => Err(joined["reason"]
            .as_str()
            .unwrap_or("no reason given")
            .to_owned()),
        _ => panic!(
            "no `joined` in the --stats-json {}: {stats}",
            path.display()
        ),
    }
}

/// Sends `signal` to our child `child`.
pub fn signal(child: &Child, signal: i32) {
    // SAFETY: plain kill(2) on our own child.
    unsafe { libc::kill(child.id() as libc::pid_t, signal) };
}

/// Waits for heapprofd to exit successfully; on failure the panic shows its log.
pub fn wait_success(child: &mut Child, log: &mpsc::Receiver<String>, what: &str) {
    let status = child.wait().expect("waiting for heapprofd");
    if !status.success() {
        // The stderr reader ends at EOF, which follows the exit.
        let lines: Vec<String> = log.iter().collect();
        panic!(
            "heapprofd ({what}) exited with {status}; its log after attaching:\n{}",
            lines.join("\n")
        );
    }
}

/// Keeps the program `command` starts out of a system-wide preload that may be active
/// on the machine (`heapprofd --all --preload system`, a fleet host's unit): that
/// heapprofd would join it first, and `--pid` would then count it on the allocator's
/// probes (by design: system_preload.rs tests it). Tests of `--pid`'s in-process join
/// start their targets so, as a user who wants it does (`HEAPPROFD_SYSTEM_PRELOAD=off`);
/// without a system-wide preload it changes nothing.
pub fn outside_system_preload(command: &mut Command) -> &mut Command {
    use heapprof_common::preload::{SYSTEM_OPT_OUT_ENV, SYSTEM_OPT_OUT_VALUE};
    command.env(SYSTEM_OPT_OUT_ENV, SYSTEM_OPT_OUT_VALUE)
}

/// A test program driven line by line (waiter.c, pipes.c): it prints "ready", then
/// does one step per line it reads and prints what it did; it exits at end of input.
pub struct Driven {
    /// The running program.
    pub child: Child,
    stdin: Option<std::process::ChildStdin>,
    lines: mpsc::Receiver<String>,
}

impl Driven {
    /// Starts `binary` with `args` and waits for its "ready".
    pub fn start(binary: &Path, args: &[&str]) -> Self {
        let mut command = Command::new(binary);
        command.args(args);
        Self::spawn(&mut command)
    }

    /// [`Driven::start`] for a target that `--pid` is to join in-process: kept out of
    /// a system-wide preload that may be active on the machine
    /// ([`outside_system_preload`]).
    pub fn start_for_pid(binary: &Path, args: &[&str]) -> Self {
        let mut command = Command::new(binary);
        command.args(args);
        Self::spawn(outside_system_preload(&mut command))
    }

    /// Starts `command` (its stdin and stdout piped) and waits for its "ready".
    pub fn spawn(command: &mut Command) -> Self {
        let mut child = command
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("starting {command:?}: {e}"));
        let stdin = child.stdin.take();
        let lines = forward_lines(child.stdout.take().expect("stdout"));
        let driven = Self {
            child,
            stdin,
            lines,
        };
        driven.expect_line("ready");
        driven
    }

    /// The program's pid, as an argument.
    pub fn pid(&self) -> String {
        self.child.id().to_string()
    }

    /// Waits for the program to print `wanted`.
    pub fn expect_line(&self, wanted: &str) {
        let line = self
            .lines
            .recv_timeout(Duration::from_secs(30))
            .unwrap_or_else(|e| panic!("the test program did not print {wanted:?}: {e}"));
        assert_eq!(line, wanted);
    }

    /// Lets it take one step and waits for it to print `reply`.
    pub fn step(&mut self, reply: &str) {
        self.command("go", reply);
    }

    /// Sends it the line `command` and waits for it to print `reply`.
    pub fn command(&mut self, command: &str, reply: &str) {
        use std::io::Write as _;
        let stdin = self.stdin.as_mut().expect("stdin open");
        writeln!(stdin, "{command}").expect("writing to the test program");
        stdin.flush().expect("flush");
        self.expect_line(reply);
    }

    /// Lets it take one step and returns the first line it prints.
    pub fn step_reading(&mut self) -> String {
        use std::io::Write as _;
        let stdin = self.stdin.as_mut().expect("stdin open");
        stdin
            .write_all(b"go\n")
            .expect("writing to the test program");
        stdin.flush().expect("flush");
        self.next_line(Duration::from_secs(600))
    }

    /// The next line it prints, waiting up to `timeout`.
    pub fn next_line(&self, timeout: Duration) -> String {
        self.lines
            .recv_timeout(timeout)
            .unwrap_or_else(|e| panic!("the test program printed nothing more: {e}"))
    }

    /// Ends its input and waits for it to exit successfully.
    pub fn finish(&mut self) {
        self.stdin = None;
        let status = self.child.wait().expect("waiting for the test program");
        assert!(status.success(), "the test program failed: {status}");
    }
}

impl Drop for Driven {
    fn drop(&mut self) {
        self.stdin = None;
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The sites of tests/programs/stacks.c: (objects, bytes) per stack from the allocator's
/// caller up to `main`, for the samples through `a` or `b`; and those samples' leaves.
pub fn abc_stacks(
    samples: &[Sample],
) -> (std::collections::BTreeMap<String, (i64, i64)>, Vec<String>) {
    let mut stacks = std::collections::BTreeMap::new();
    let mut leaves = Vec::new();
    for sample in samples {
        let frames = sample.up_to_main();
        if frames.iter().any(|f| *f == "a" || *f == "b") {
            let entry: &mut (i64, i64) = stacks.entry(frames.join(" <- ")).or_default();
            entry.0 += sample.values[0];
            entry.1 += sample.values[1];
            leaves.push(sample.stack[0].clone());
        }
    }
    (stacks, leaves)
}

/// What stacks.c allocates, in the form [`abc_stacks`] returns.
pub fn expected_abc_stacks() -> std::collections::BTreeMap<String, (i64, i64)> {
    [
        ("a <- main", (1, 1000)),
        ("b <- a <- main", (1, 100)),
        ("b <- main", (1, 100)),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v))
    .collect()
}

/// `go tool pprof -top -sample_index=INDEX PROFILE`'s output; fails when it fails.
pub fn go_pprof_top(profile: &Path, sample_index: &str) -> String {
    let output = Command::new("go")
        .args([
            "tool",
            "pprof",
            "-top",
            &format!("-sample_index={sample_index}"),
        ])
        .arg(profile)
        .output()
        .expect("running go tool pprof (install golang-go: cargo xtask setup)");
    assert!(
        output.status.success(),
        "go tool pprof failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// A heapprofd that is killed if the test ends (or panics) while it still runs: an
/// `--all` session left behind would trap every process of the machine, and break the
/// tests that follow (valgrind's stop at its breakpoints).
pub struct KillOnDrop(pub Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        if matches!(self.0.try_wait(), Ok(None)) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}
