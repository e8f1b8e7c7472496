//! Targets: attaching to a running process, launching, and tracing every process.

mod common;

use std::{collections::BTreeMap, process::Command, time::Duration};

use common::*;

#[test]
fn attaches_to_a_running_process_and_ends_with_it() {
    require_root();
    let dir = scratch();
    let binary = compile(dir.path(), "waiter", "waiter", &["-O0"]);
    let out = dir.path().join("profiles");
    let mut waiter = Driven::start(&binary, &["1000", "48"]);
    let (mut heapprofd, log) = start_heapprofd(
        heapprofd(&out)
            .args(["--interval", "200ms", "--pid"])
            .arg(waiter.child.id().to_string()),
    );
    waiter.step("done");
    waiter.finish();
    // The target's exit ends --pid mode with a final profile.
    wait_success(&mut heapprofd, &log, "--pid");

    let profiles = read_profiles(&out);
    assert!(!profiles.is_empty());
    let samples = samples(&profiles.last().expect("a profile").1);
    let work = totals(&samples, |s| s.stack.get(1).is_some_and(|f| f == "work"));
    assert_eq!(
        work,
        [1000, 48_000, 500, 24_000],
        "work(): allocated, in use at exit"
    );
    // Interval profiles: each valid (checked on decoding), counts never go backwards.
    let allocated: Vec<i64> = profiles
        .iter()
        .map(|(_, p)| totals(&common::samples(p), |_| true)[0])
        .collect();
    assert!(
        allocated.windows(2).all(|w| w[0] <= w[1]),
        "alloc counts are cumulative: {allocated:?}"
    );
}

#[test]
fn launch_mode_returns_the_command_status() {
    require_root();
    let dir = scratch();
    let out = dir.path().join("profiles");
    let output = heapprofd(&out)
        .args(["--", "sh", "-c", "exit 7"])
        .output()
        .expect("starting heapprofd");
    assert_eq!(output.status.code(), Some(7), "{output:?}");
    assert!(
        !read_profiles(&out).is_empty(),
        "a final profile is written"
    );
}

#[test]
fn all_mode_tells_processes_apart_by_labels() {
    require_root();
    let dir = scratch();
    let one = compile(dir.path(), "waiter", "proc_one", &["-O0"]);
    let two = compile(dir.path(), "waiter", "proc_two", &["-O0"]);
    let out = dir.path().join("profiles");
    let mut first = Driven::start(&one, &["300", "32"]);
    let mut second = Driven::start(&two, &["700", "16"]);
    let pids = [first.child.id().to_string(), second.child.id().to_string()];
    let (mut heapprofd, log) =
        start_heapprofd(heapprofd(&out).args(["--interval", "300ms", "--all"]));
    first.step("done");
    first.finish();
    second.step("done");
    second.finish();
    std::thread::sleep(Duration::from_millis(500));
    // SAFETY: plain kill(2) of our own child.
    unsafe { libc::kill(heapprofd.id() as i32, libc::SIGINT) };
    wait_success(&mut heapprofd, &log, "--all");

    let samples = samples(&last_profile(&out));
    let mut by_process: BTreeMap<(String, String), [i64; 2]> = BTreeMap::new();
    // --all sees every process, including other tests' waiters running in parallel:
    // only our two pids are checked.
    for sample in samples.iter().filter(|s| {
        s.stack.get(1).is_some_and(|f| f == "work")
            && s.labels.get("pid").is_some_and(|pid| pids.contains(pid))
    }) {
        let key = (sample.labels["comm"].clone(), sample.labels["pid"].clone());
        let entry = by_process.entry(key).or_default();
        entry[0] += sample.values[0];
        entry[1] += sample.values[1];
    }
    let expected: BTreeMap<(String, String), [i64; 2]> = [
        (("proc_one".to_owned(), pids[0].clone()), [300, 300 * 32]),
        (("proc_two".to_owned(), pids[1].clone()), [700, 700 * 16]),
    ]
    .into_iter()
    .collect();
    assert_eq!(
        by_process, expected,
        "allocations of work() per (comm, pid)"
    );
}

#[test]
fn bad_targets_get_one_clear_line_and_status_2() {
    require_root();
    let dir = scratch();
    let out = dir.path().join("profiles");
    let cases: [(&[&str], &str); 4] = [
        (&["--pid", "999999999"], "no process with pid 999999999"),
        (&[], "no target"),
        (
            &["--", "/nonexistent/program"],
            "cannot run `/nonexistent/program`",
        ),
        (&["--libc", "/etc/hostname", "--all"], "is not an ELF file"),
    ];
    for (args, message) in cases {
        let output = heapprofd(&out)
            .args(args)
            .output()
            .expect("starting heapprofd");
        assert_usage_error(&output, &format!("{args:?}"), message);
    }
}

#[test]
fn more_bad_input_gets_one_clear_line_and_status_2() {
    require_root();
    let dir = scratch();
    let out = dir.path().join("profiles");
    // Ended when dropped.
    let static_waiter = Driven::start(
        &compile(dir.path(), "waiter", "static-waiter", &["-O0", "-static"]),
        &["1", "16"],
    );
    let static_pid = static_waiter.pid();
    let libm = format!("/lib/{}-linux-gnu/libm.so.6", std::env::consts::ARCH);
    let out_arg = out.display().to_string();
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["--pid", "2"], "is a kernel thread"),
        (vec!["--pid", &static_pid], "maps no C library"),
        (vec!["--libc", &libm, "--all"], "has no malloc/free symbols"),
        (
            vec!["--interval", "0s", "--all"],
            "must be greater than zero",
        ),
        (vec!["--interval", "1000h", "--all"], "out of range"),
        (vec!["--max-sites", "lots", "--all"], "not a whole number"),
        (vec!["--pages", "--all"], "--kernel"),
        (
            vec!["--kernel", "--sample-rate", "4k"],
            "cannot be used with",
        ),
        (
            vec!["-o", "/proc/heapprofd/profiles", "--all"],
            "cannot create output directory",
        ),
        (vec!["-o", "/etc/hostname", "--all"], "is not a directory"),
    ];
    for (args, message) in cases {
        // The scratch output directory unless the case names its own.
        let mut command = Command::new(env!("CARGO_BIN_EXE_heapprofd"));
        if !args.contains(&"-o") {
            command.args(["-o", &out_arg]);
        }
        let output = command.args(&args).output().expect("starting heapprofd");
        assert_usage_error(&output, &format!("{args:?}"), message);
    }
}

#[test]
fn without_privileges_heapprofd_names_the_missing_capabilities() {
    require_root();
    let dir = scratch();
    // As nobody, with every capability dropped (setpriv, from util-linux).
    let output = Command::new("setpriv")
        .args([
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "--inh-caps=-all",
        ])
        .arg(env!("CARGO_BIN_EXE_heapprofd"))
        .args(["--all", "-o"])
        .arg(dir.path().join("profiles"))
        .output()
        .expect("running setpriv");
    assert_usage_error(&output, "no privileges", "missing CAP_BPF and CAP_PERFMON");
    assert!(String::from_utf8_lossy(&output.stderr).contains("run heapprofd as root"));
}

/// Bad input: status 2 and one line on stderr that contains `message`.
fn assert_usage_error(output: &std::process::Output, case: &str, message: &str) {
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{case}: {stderr}");
    assert!(
        stderr.contains(message),
        "{case}: expected {message:?} in {stderr:?}"
    );
    assert_eq!(
        stderr.trim().lines().count(),
        1,
        "{case}: one line, got {stderr:?}"
    );
}
