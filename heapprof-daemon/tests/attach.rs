//! Attaching at any moment: to processes whose threads allocate without pause, after a
//! thread left an allocator call without returning, two sessions on one process at
//! once; and launch mode ended by a signal sent to heapprofd alone.
//!
//! The target is tests/programs/busy.c: busy threads (busy_0..busy_3) allocate and free
//! all the time, and the main thread does an exact piece of work when told to. The
//! busy threads keep both cores busy: the tests run one at a time (`serial`).

mod common;

use std::{
    collections::BTreeMap,
    path::Path,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use common::*;

const BUSY_THREADS: usize = 3;
const WORK: i64 = 200;
const SIZE: i64 = 24;
/// How long a session stays attached after the exact work, so that every busy thread
/// gets the CPU while traced (three threads share two cores with the tests).
const BUSY_WINDOW: Duration = Duration::from_millis(500);

/// busy.c, built as the tests build their programs (-O2 here: optimized code).
fn start_busy(dir: &Path) -> Driven {
    let binary = compile(dir, "busy", "busy", &["-O2"]);
    Driven::start(&binary, &[&BUSY_THREADS.to_string()])
}

/// What `exact_work(n, SIZE)` allocates, per allocator function (busy.c's header).
fn expected_work(n: i64) -> BTreeMap<String, [i64; 4]> {
    [
        ("calloc", [n, 2 * n * SIZE, n, 2 * n * SIZE]),
        ("malloc", [n, n * SIZE, 0, 0]),
        // realloc(NULL, SIZE), then that block grown to 4 * SIZE and freed.
        ("realloc", [2 * n, 5 * n * SIZE, 0, 0]),
    ]
    .into_iter()
    .map(|(kind, values)| (kind.to_owned(), values))
    .collect()
}

/// Totals per allocator function of the samples allocated by `function` in process `pid`.
fn by_kind(samples: &[Sample], pid: u32, function: &str) -> BTreeMap<String, [i64; 4]> {
    let pid = pid.to_string();
    let mut kinds: BTreeMap<String, [i64; 4]> = BTreeMap::new();
    for sample in samples.iter().filter(|s| {
        s.stack.get(1).is_some_and(|f| f == function)
            && s.labels.get("pid").is_some_and(|p| *p == pid)
    }) {
        let entry = kinds.entry(sample.stack[0].clone()).or_default();
        for (total, value) in entry.iter_mut().zip(sample.values) {
            *total += value;
        }
    }
    kinds
}

/// Checks a profile of busy.c: `exact_work` is exact, and every busy thread was counted.
fn check_busy_profile(profile_dir: &Path, pid: u32, work: i64, what: &str) {
    let samples = samples(&last_profile(profile_dir));
    assert_eq!(
        by_kind(&samples, pid, "exact_work"),
        expected_work(work),
        "{what}: exact_work per allocator function [allocated objects, bytes, in use objects, bytes]"
    );
    for thread in 0..BUSY_THREADS {
        let function = format!("busy_{thread}");
        let allocated: i64 = by_kind(&samples, pid, &function)
            .values()
            .map(|v| v[0])
            .sum();
        assert!(allocated > 0, "{what}: {function} was not counted");
    }
}

/// Attaches `rounds` times in a row to one busy process with `args`, each time doing
/// the exact work once heapprofd is ready, and checks every final profile.
fn attach_repeatedly(args: &[&str], rounds: usize) {
    require_root();
    let _serial = serial();
    let dir = scratch();
    let mut busy = start_busy(dir.path());
    let pid = busy.child.id();
    for round in 0..rounds {
        let out = dir.path().join(format!("profiles-{round}"));
        let (mut heapprofd, log) = start_heapprofd(
            heapprofd(&out)
                .args(["--interval", "1h"])
                .args(args.iter().map(|a| a.replace("PID", &pid.to_string()))),
        );
        busy.command(&format!("work {WORK} {SIZE}"), "done");
        // Long enough for every busy thread to be scheduled while traced.
        std::thread::sleep(BUSY_WINDOW);
        signal(&heapprofd, libc::SIGINT);
        wait_success(&mut heapprofd, &log, &format!("{args:?}, round {round}"));
        check_busy_profile(&out, pid, WORK, &format!("{args:?}, attach {round}"));
    }
}

#[test]
fn pid_attach_to_a_busy_process_counts_exactly_ten_times_in_a_row() {
    attach_repeatedly(&["--pid", "PID"], 10);
}

#[test]
fn all_attach_with_a_busy_process_counts_exactly_ten_times_in_a_row() {
    attach_repeatedly(&["--all"], 10);
}

#[test]
fn pid_attach_with_one_perf_event_per_probe_counts_exactly() {
    // The method of kernels without multi-uprobe links (the 6.1 board kernels).
    attach_repeatedly(&["--attach", "perf-events", "--pid", "PID"], 3);
}

#[test]
fn a_thread_that_never_returned_from_an_allocator_call_is_still_counted() {
    require_root();
    let _serial = serial();
    let dir = scratch();
    let mut busy = start_busy(dir.path());
    let pid = busy.child.id();
    let out = dir.path().join("profiles");
    let (mut heapprofd, log) = start_heapprofd(
        heapprofd(&out)
            .args(["--interval", "1h", "--pid"])
            .arg(pid.to_string()),
    );
    // realloc() entered, never returned: glibc aborts on the bogus pointer and the
    // SIGABRT handler longjmps out. A depth count would now see every later call of
    // this thread as nested in it.
    busy.command("abandon", "abandoned");
    // Calls that start below the abandoned one on the stack, then from main's level.
    busy.command(&format!("deep {WORK} {SIZE} 30"), "done");
    busy.command(&format!("work {WORK} {SIZE}"), "done");
    std::thread::sleep(BUSY_WINDOW);
    signal(&heapprofd, libc::SIGINT);
    wait_success(&mut heapprofd, &log, "--pid after a missed return");
    check_busy_profile(&out, pid, 2 * WORK, "after a missed return");
}

#[test]
fn two_sessions_on_one_process_each_count_exactly() {
    require_root();
    let _serial = serial();
    let dir = scratch();
    let mut busy = start_busy(dir.path());
    let pid = busy.child.id();
    let pid_out = dir.path().join("pid-profiles");
    let all_out = dir.path().join("all-profiles");
    let (mut pid_session, pid_log) = start_heapprofd(
        heapprofd(&pid_out)
            .args(["--interval", "1h", "--pid"])
            .arg(pid.to_string()),
    );
    let (mut all_session, all_log) =
        start_heapprofd(heapprofd(&all_out).args(["--interval", "1h", "--all"]));
    busy.command(&format!("work {WORK} {SIZE}"), "done");
    std::thread::sleep(BUSY_WINDOW);
    signal(&pid_session, libc::SIGINT);
    signal(&all_session, libc::SIGINT);
    wait_success(&mut pid_session, &pid_log, "the --pid session");
    wait_success(&mut all_session, &all_log, "the --all session");
    check_busy_profile(&pid_out, pid, WORK, "the --pid session");
    check_busy_profile(&all_out, pid, WORK, "the --all session");
}

/// Waits up to `limit` for `child` to exit. A heapprofd that does not exit is a hang:
/// it is killed and the test fails. (Not a timing check: the limit is far above the
/// time it takes.)
fn wait_exit(child: &mut Child, limit: Duration, what: &str) -> std::process::ExitStatus {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(status) = child.try_wait().expect("waiting for heapprofd") {
            return status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{what}: heapprofd did not exit within {limit:?} of the signal (hung)");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `timeout [--foreground] -s SIGNAL 2 heapprofd -o DIR -- busy 2 forever`: heapprofd
/// passes the signal on, and exits with the command's status and a final profile.
fn timeout_ends_launch_mode(signal_name: &str, status: i32, foreground: bool) {
    require_root();
    let _serial = serial();
    let dir = scratch();
    let binary = compile(dir.path(), "busy", "busy", &["-O2"]);
    let out = dir.path().join("profiles");
    let mut timeout = Command::new("timeout");
    if foreground {
        // The signal goes to heapprofd alone (otherwise to its whole process group,
        // followed by SIGCONT).
        timeout.arg("--foreground");
    }
    let mut child = timeout
        .args(["--preserve-status", "-s", signal_name, "2"])
        .arg(env!("CARGO_BIN_EXE_heapprofd"))
        .arg("-o")
        .arg(&out)
        .arg("--")
        .arg(&binary)
        .args(["2", "forever"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting timeout");
    let log = forward_lines(child.stderr.take().expect("stderr"));
    let what = format!("timeout -s {signal_name} (foreground: {foreground})");
    let exit = wait_exit(&mut child, Duration::from_secs(30), &what);
    let lines: Vec<String> = log.try_iter().collect();
    assert_eq!(
        exit.code(),
        Some(status),
        "{what}: heapprofd exits with the command's status; its log:\n{}",
        lines.join("\n")
    );
    let samples = samples(&last_profile(&out));
    for function in ["busy_0", "busy_1"] {
        assert!(
            samples
                .iter()
                .any(|s| s.stack.get(1).is_some_and(|f| f == function) && s.values[0] > 0),
            "{what}: the final profile counts {function}"
        );
    }
}

#[test]
fn sigint_to_heapprofd_alone_ends_launch_mode() {
    timeout_ends_launch_mode("INT", 128 + libc::SIGINT, true);
}

#[test]
fn sigterm_to_heapprofd_alone_ends_launch_mode() {
    timeout_ends_launch_mode("TERM", 128 + libc::SIGTERM, true);
}

#[test]
fn sigint_to_the_process_group_and_sigcont_end_launch_mode() {
    timeout_ends_launch_mode("INT", 128 + libc::SIGINT, false);
}

#[test]
fn sigterm_to_the_process_group_and_sigcont_end_launch_mode() {
    timeout_ends_launch_mode("TERM", 128 + libc::SIGTERM, false);
}

/// Launch mode while another session profiles every process (`--all`): the other
/// session leaves this one's preload library alone. Its return probes on the
/// library's functions put the kernel's return trampoline where this session's
/// unwinder reads their return addresses, and cut every stack there from the moment
/// the other session saw the command.
#[test]
fn launch_mode_beside_an_all_session_keeps_its_stacks() {
    require_root();
    let _serial = serial();
    let dir = scratch();
    let binary = compile(dir.path(), "busy", "busy", &["-O2"]);
    let (all_session, all_log) =
        start_heapprofd(heapprofd(&dir.path().join("all-profiles")).args([
            "--interval",
            "1h",
            "--all",
        ]));
    let mut all_session = common::KillOnDrop(all_session);
    let out = dir.path().join("profiles");
    let (mut launched, launched_log) = start_heapprofd(
        heapprofd(&out)
            .args(["--interval", "1h", "--"])
            .arg(&binary)
            .args(["2", "forever"])
            .stdin(Stdio::null())
            .stdout(Stdio::null()),
    );
    // Long enough for the --all session, which reads every process's mappings and
    // builds their unwind tables first, to turn to the command and probe it: a pause
    // in the setup, not a measured time (with the other session slower, the test
    // checks less, never wrongly).
    std::thread::sleep(Duration::from_secs(10));
    signal(&launched, libc::SIGINT);
    let exit = wait_exit(&mut launched, Duration::from_secs(30), "launch mode");
    let lines: Vec<String> = launched_log.try_iter().collect();
    assert_eq!(
        exit.code(),
        Some(128 + libc::SIGINT),
        "heapprofd exits with the command's status; its log:\n{}",
        lines.join("\n")
    );
    signal(&all_session.0, libc::SIGINT);
    wait_success(&mut all_session.0, &all_log, "the --all session");
    let profile = last_profile(&out);
    let samples = samples(&profile);
    for function in ["busy_0", "busy_1"] {
        assert!(
            samples
                .iter()
                .any(|s| s.stack.get(1).is_some_and(|f| f == function) && s.values[0] > 0),
            "the final profile counts {function}; heapprofd's log:\n{}",
            lines.join("\n")
        );
    }
    assert_eq!(
        drop_count(&profile, heapprof_common::DropReason::StackIncomplete),
        0,
        "no stack cut short beside the --all session; heapprofd's log:\n{}",
        lines.join("\n")
    );
}

#[test]
fn sigterm_ends_launch_mode_while_the_command_is_stopped() {
    require_root();
    let _serial = serial();
    let dir = scratch();
    let binary = compile(dir.path(), "busy", "busy", &["-O2"]);
    let out = dir.path().join("profiles");
    let (mut heapprofd, log) = start_heapprofd(
        heapprofd(&out)
            .arg("--")
            .arg(&binary)
            .args(["2", "forever"])
            .stdin(Stdio::null())
            .stdout(Stdio::piped()),
    );
    // The command's "ready" (its threads run), and a moment of allocating, before it
    // is stopped: on a loaded machine (beside an --all session) the command could be
    // stopped before its first allocation, leaving nothing to profile.
    let output = forward_lines(heapprofd.stdout.take().expect("stdout"));
    let first = output.recv_timeout(Duration::from_secs(30));
    assert_eq!(
        first.as_deref().ok(),
        Some("ready"),
        "the launched command's output"
    );
    std::thread::sleep(Duration::from_millis(200));
    let pid = (0..50)
        .find_map(|_| {
            std::thread::sleep(Duration::from_millis(100));
            child_pid(heapprofd.id())
        })
        .expect("the launched command runs");
    // SAFETY: plain kill(2) of the launched command.
    unsafe { libc::kill(pid as libc::pid_t, libc::SIGSTOP) };
    std::thread::sleep(Duration::from_millis(200));
    signal(&heapprofd, libc::SIGTERM);
    let exit = wait_exit(&mut heapprofd, Duration::from_secs(30), "a stopped command");
    let lines: Vec<String> = log.try_iter().collect();
    assert_eq!(
        exit.code(),
        Some(128 + libc::SIGTERM),
        "the stopped command got SIGTERM (and SIGCONT); heapprofd's log:\n{}",
        lines.join("\n")
    );
    assert!(!samples(&last_profile(&out)).is_empty(), "a final profile");
}

/// Launch mode is transparent to the command's signal dispositions: started with
/// SIGINT ignored (a background job of a script), heapprofd's command inherits that
/// as it would without heapprofd, but not the SIGPIPE that Rust ignores in heapprofd.
/// A SIGINT passed on then cannot end the command; a second one stops heapprofd with
/// a valid final profile, and the command runs on.
#[test]
fn an_ignored_sigint_stays_the_commands_and_a_second_one_stops_heapprofd() {
    require_root();
    let _serial = serial();
    let dir = scratch();
    let binary = compile(dir.path(), "busy", "busy", &["-O2"]);
    let out = dir.path().join("profiles");
    let mut cmd = heapprofd(&out);
    cmd.arg("--")
        .arg(&binary)
        .args(["2", "forever"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped());
    with_signal_disposition(&mut cmd, libc::SIG_IGN);
    let (mut heapprofd, log) = start_heapprofd(&mut cmd);
    let output = forward_lines(heapprofd.stdout.take().expect("stdout"));
    assert_eq!(
        output.recv_timeout(Duration::from_secs(30)).as_deref().ok(),
        Some("ready"),
        "the launched command's output"
    );
    let pid = child_pid(heapprofd.id()).expect("the launched command runs");
    // Outlives heapprofd by design: killed whatever the outcome, so that it does not
    // hold the tests' lock.
    let _command = KillPidOnDrop(pid);
    let bit = |signal: i32| 1u64 << (signal - 1);
    let ignored = ignored_signals(pid);
    assert_ne!(
        ignored & bit(libc::SIGINT),
        0,
        "the command inherits SIGINT ignored"
    );
    assert_eq!(
        ignored & bit(libc::SIGPIPE),
        0,
        "the command gets SIGPIPE at its default"
    );

    signal(&heapprofd, libc::SIGINT);
    // Well past the repeat window, so that the next one is a second request.
    std::thread::sleep(heapprof_daemon::launch::REPEAT_WINDOW * 4);
    assert!(
        heapprofd.try_wait().expect("waiting").is_none(),
        "heapprofd waits for the command after the first SIGINT"
    );
    signal(&heapprofd, libc::SIGINT);
    let status = wait_exit(&mut heapprofd, Duration::from_secs(30), "a second SIGINT");
    let lines: Vec<String> = log.try_iter().collect();
    let still_running = std::path::Path::new(&format!("/proc/{pid}")).exists();
    assert!(
        status.success(),
        "heapprofd stops cleanly: {status}; its log:\n{}",
        lines.join("\n")
    );
    assert!(
        still_running,
        "the command keeps running after heapprofd stops"
    );
    let samples = samples(&last_profile(&out));
    assert!(
        samples
            .iter()
            .any(|s| s.stack.get(1).is_some_and(|f| f == "busy_0") && s.values[0] > 0),
        "the final profile counts busy_0; heapprofd's log:\n{}",
        lines.join("\n")
    );
}

/// Kills process `pid` when dropped.
struct KillPidOnDrop(u32);

impl Drop for KillPidOnDrop {
    fn drop(&mut self) {
        // SAFETY: plain kill(2); the pid is the test's own command, left running.
        unsafe { libc::kill(self.0 as libc::pid_t, libc::SIGKILL) };
    }
}

/// The first child process of `parent`, from /proc.
fn child_pid(parent: u32) -> Option<u32> {
    let children =
        std::fs::read_to_string(format!("/proc/{parent}/task/{parent}/children")).ok()?;
    children.split_whitespace().next()?.parse().ok()
}
