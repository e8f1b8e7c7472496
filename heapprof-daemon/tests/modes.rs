//! Targets: attaching to a running process, launching, and tracing every process.

mod common;

use std::{collections::BTreeMap, process::Command, time::Duration};

use common::*;
use heapprof_daemon::profiles_file::{ImageRead, Line};

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
    // Stripped: its allocator cannot be found (an unstripped one is probed).
    let static_waiter = Driven::start(
        &compile(
            dir.path(),
            "waiter",
            "static-waiter",
            &["-O0", "-static", "-s"],
        ),
        &["1", "16"],
    );
    let static_pid = static_waiter.pid();
    let libm = format!("/lib/{}-linux-gnu/libm.so.6", std::env::consts::ARCH);
    let out_arg = out.display().to_string();
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["--pid", "2"], "is a kernel thread"),
        (vec!["--pid", &static_pid], "without a symbol table"),
        (vec!["--libc", &libm, "--all"], "has no malloc/free symbols"),
        (
            vec!["--interval", "0s", "--all"],
            "must be greater than zero",
        ),
        (vec!["--interval", "1000h", "--all"], "out of range"),
        (vec!["--max-sites", "lots", "--all"], "not a whole number"),
        (vec!["--pages", "--all"], "--kernel"),
        // (--kernel --sample-rate is valid since kernel mode samples.)
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

/// heapprofd with `args` in a private mount namespace where `hidden` is covered by an
/// empty tmpfs: what a kernel without that interface looks like from user space.
fn heapprofd_without(hidden: &str, out: &std::path::Path, args: &[&str]) -> Command {
    let mut cmd = Command::new("unshare");
    cmd.args(["--mount", "--propagation", "private", "sh", "-c"])
        .arg(r#"mount -t tmpfs heapprofd-test "$1" && shift && exec "$@""#)
        .args(["sh", hidden, env!("CARGO_BIN_EXE_heapprofd"), "-o"])
        .arg(out)
        .arg("--ready-file")
        .arg(ready_file(out))
        .args(args)
        .env("RUST_LOG", "info");
    cmd
}

#[test]
fn a_kernel_without_uprobes_or_tracefs_is_named() {
    require_root();
    let dir = scratch();
    let out = dir.path().join("profiles");
    let run = |cmd: &mut Command| cmd.output().expect("running unshare (util-linux)");
    // The uprobe event type lives under /sys/bus/event_source/devices/uprobe.
    let output = run(&mut heapprofd_without(
        "/sys/bus/event_source/devices",
        &out,
        &["--all"],
    ));
    assert_usage_error(
        &output,
        "no uprobes",
        "no uprobe events (/sys/bus/event_source/devices/uprobe is missing)",
    );
    // Kernel mode does not need uprobes...
    let output = run(&mut heapprofd_without(
        "/sys/bus/event_source/devices",
        &out,
        &["--kernel", "--duration", "1s"],
    ));
    assert!(
        output.status.success(),
        "kernel mode without uprobes: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    // ...but tracefs, which lives under /sys/kernel (also as /sys/kernel/debug/tracing).
    let output = run(&mut heapprofd_without("/sys/kernel", &out, &["--kernel"]));
    assert_usage_error(&output, "no tracefs", "tracefs is not available");
    assert!(String::from_utf8_lossy(&output.stderr).contains("CONFIG_TRACING"));

    // User mode needs no tracefs (its exec tracepoint is a raw one) and still counts.
    let mut waiter = Driven::start(
        &compile(dir.path(), "waiter", "waiter", &["-O0"]),
        &["10", "16"],
    );
    let user_out = dir.path().join("user-profiles");
    let (mut heapprofd, log) = start_heapprofd(&mut heapprofd_without(
        "/sys/kernel",
        &user_out,
        &["--pid", &waiter.pid()],
    ));
    waiter.step("done");
    waiter.finish();
    wait_success(&mut heapprofd, &log, "user mode without tracefs");
    let samples = samples(&last_profile(&user_out));
    assert_eq!(by_caller(&samples, "work"), [10, 160, 5, 80]);
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

/// Waits for a line of heapprofd's log containing `start` and `rest`; returns it.
fn wait_for_line(log: &std::sync::mpsc::Receiver<String>, start: &str, rest: &str) -> String {
    loop {
        let line = log
            .recv_timeout(Duration::from_secs(30))
            .unwrap_or_else(|e| panic!("heapprofd did not log {start:?} ... {rest:?}: {e}"));
        if line.contains(start) && line.contains(rest) {
            return line;
        }
    }
}

/// Sums of the samples whose allocator caller is `function`.
fn by_caller(samples: &[Sample], function: &str) -> [i64; 4] {
    totals(samples, |s| s.stack.get(1).is_some_and(|f| f == function))
}

#[test]
fn pid_mode_keeps_tracing_through_fork_and_exec() {
    traces_through_fork_and_exec("off");
}

/// Joined in-process, the exec takes heapprofd's library along into the new image
/// (preloaded from a descriptor), which removes every trace of it from its environment;
/// the forked child passes its calls on unreported, and heapprofd's exit calls nothing
/// into the new image.
#[test]
fn joined_pid_mode_follows_fork_and_exec() {
    traces_through_fork_and_exec("auto");
}

fn traces_through_fork_and_exec(inject: &str) {
    require_root();
    let dir = scratch();
    let binary = compile(dir.path(), "execer", "execer", &["-O0"]);
    let out = dir.path().join("profiles");
    let (profiles, stats) = (profiles_json(&out), stats_file(&out));
    let mut execer =
        Driven::start_for_pid(&binary, &["parent", binary.to_str().expect("utf-8 path")]);
    let (mut heapprofd, log) = start_heapprofd(
        heapprofd(&out)
            .arg("--profiles-json")
            .arg(&profiles)
            .arg("--stats-json")
            .arg(&stats)
            .args(["--interval", "1h", "--inject", inject, "--pid"])
            .arg(execer.pid()),
    );
    // parent_work, a forked child, then the exec into image2_work, which prints "done".
    execer.step("done");
    // The new image is read in the background; an image that exits first (faster
    // than heapprofd can react) is still counted, with its frames as addresses.
    let pid: u32 = execer.pid().parse().expect("a pid");
    wait_for_profiles_line(&profiles, 0, "read of the exec'd image", |line| {
        *line
            == Line::ImageRead(ImageRead {
                pid,
                exec_generation: 1,
                probed_allocator: true,
            })
    });
    if inject == "auto" {
        execer.command("env", "LD_PRELOAD=- HEAPPROFD_FOLLOW=-");
        signal(&heapprofd, libc::SIGINT);
        wait_success(&mut heapprofd, &log, "--pid through exec");
        // The image joined is gone, so heapprofd called nothing at its addresses.
        let left = &read_stats(&stats)["left"];
        assert_eq!(left["how"], "replaced", "how heapprofd left: {left}");
        // Still running, and answering, after heapprofd left.
        execer.command("env", "LD_PRELOAD=- HEAPPROFD_FOLLOW=-");
        execer.finish();
    } else {
        execer.finish();
        wait_success(&mut heapprofd, &log, "--pid through exec");
    }

    let samples = samples(&last_profile(&out));
    // Counted and named although the image that made them was gone before the
    // profile was written; their memory went with it, so none is in use.
    assert_eq!(
        by_caller(&samples, "parent_work"),
        [100, 6400, 0, 0],
        "parent_work (before the exec): {samples:#?}"
    );
    assert_eq!(
        by_caller(&samples, "image2_work"),
        [50, 1600, 30, 960],
        "image2_work (after the exec): {samples:#?}"
    );
    assert_eq!(
        by_caller(&samples, "child_work"),
        [0; 4],
        "the forked child is not traced"
    );
    for function in ["parent_work", "image2_work"] {
        let sample = samples
            .iter()
            .find(|s| s.stack.get(1).is_some_and(|f| f == function))
            .expect("sample");
        assert_eq!(sample.up_to_main(), [function, "main"], "{sample:?}");
        assert_eq!(sample.labels["pid"], execer.pid());
    }
}

/// A fork that allocates and execs at once (a shell's, a build tool's) leaves records
/// in its queue that no context switch has applied yet: they are applied at the
/// exec's entry, while its image is still there; after an exec that fails, the queue
/// is used again. Every block counted, nothing counted as lost.
#[test]
fn launch_mode_counts_what_forks_allocate_right_before_their_exec() {
    require_root();
    let dir = scratch();
    let binary = compile(dir.path(), "fork_exec", "fork_exec", &["-O0"]);
    let out = dir.path().join("profiles");
    let stats = stats_file(&out);
    let (children, allocs) = (100, 20);
    let output = heapprofd(&out)
        .arg("--stats-json")
        .arg(&stats)
        .arg("--")
        .arg(&binary)
        .args([children.to_string(), allocs.to_string()])
        .output()
        .expect("starting heapprofd");
    assert!(output.status.success(), "{output:?}");
    let samples = samples(&last_profile(&out));
    let blocks = children * allocs;
    // Their images are gone, and with them what they kept.
    assert_eq!(
        by_caller(&samples, "before_exec"),
        [blocks, blocks * 777, 0, 0],
        "before_exec: allocated, in use: {samples:#?}"
    );
    assert_eq!(
        by_caller(&samples, "after_failed_exec"),
        [blocks, blocks * 555, 0, 0],
        "after_failed_exec: allocated, in use: {samples:#?}"
    );
    let dropped = &read_stats(&stats)["dropped"];
    let lost: Vec<_> = dropped
        .as_object()
        .expect("dropped: an object")
        .iter()
        .filter(|(_, count)| count.as_u64() != Some(0))
        .collect();
    assert!(lost.is_empty(), "events counted as lost: {lost:?}");
}

/// Launch mode follows the command's children that its library cannot serve (a
/// static program; every child with `--preload off`) with their allocator's probes,
/// attached for each child alone once its new program is read: the command's own
/// probes are filtered to its pid, which the kernel applies by thread group.
#[test]
fn launch_mode_probes_a_static_child_for_itself() {
    launched_child_is_probed(&["-static"], &[]);
}

#[test]
fn launch_mode_without_its_library_probes_each_child_for_itself() {
    launched_child_is_probed(&[], &["--preload", "off"]);
}

fn launched_child_is_probed(cflags: &[&str], options: &[&str]) {
    require_root();
    let dir = scratch();
    let mut flags = vec!["-O0"];
    flags.extend_from_slice(cflags);
    let binary = compile(dir.path(), "late_child", "late_child", &flags);
    let out = dir.path().join("profiles");
    let profiles = profiles_json(&out);
    let (pid_file, go_file) = (dir.path().join("pid"), dir.path().join("go"));
    let count: i64 = 300;
    // A script's child: the shell forks, the child execs the program.
    let (mut heapprofd, log) = start_heapprofd(
        heapprofd(&out)
            .arg("--profiles-json")
            .arg(&profiles)
            .args(["--interval", "1h"])
            .args(options)
            .args(["--", "sh", "-c", r#""$0" "$@"; exit $?"#])
            .arg(&binary)
            .arg(&pid_file)
            .arg(&go_file)
            .arg(count.to_string()),
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let child: u32 = loop {
        if let Ok(text) = std::fs::read_to_string(&pid_file) {
            break text.trim().parse().expect("a pid");
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the child wrote no pid"
        );
        std::thread::sleep(Duration::from_millis(10));
    };
    // Read, and its allocator probed for it, while it waits.
    wait_for_profiles_line(&profiles, 0, "the child's new program read", |line| {
        *line
            == Line::ImageRead(ImageRead {
                pid: child,
                exec_generation: 1,
                probed_allocator: true,
            })
    });
    std::fs::write(&go_file, b"").expect("releasing the child");
    wait_success(&mut heapprofd, &log, "launch mode with a probed child");

    let samples = samples(&last_profile(&out));
    // COUNT blocks of 48 bytes and the array of their addresses (8 bytes each); the
    // array and a third of the blocks are freed.
    let kept = count - count / 3;
    assert_eq!(
        by_caller(&samples, "child_work"),
        [count + 1, count * 48 + count * 8, kept, kept * 48],
        "child_work, in the script's child: {samples:#?}"
    );
    let sample = samples
        .iter()
        .find(|s| s.stack.get(1).is_some_and(|f| f == "child_work"))
        .expect("a child_work sample");
    assert_eq!(sample.up_to_main(), ["child_work", "main"], "{sample:?}");
    assert_eq!(sample.labels["pid"], child.to_string());
}

#[test]
fn pid_mode_says_when_an_exec_leaves_every_allocator_it_can_see() {
    require_root();
    let dir = scratch();
    let binary = compile(dir.path(), "execer", "execer", &["-O0"]);
    // Stripped: no symbol says where its allocator is.
    let static_binary = compile(
        dir.path(),
        "execer",
        "execer-static",
        &["-O0", "-static", "-s"],
    );
    let static_path = static_binary.to_str().expect("utf-8 path");
    let out = dir.path().join("profiles");
    let mut execer = Driven::start(&binary, &["parent", static_path]);
    let (mut heapprofd, log) = start_heapprofd(
        heapprofd(&out)
            .args(["--interval", "1h", "--pid"])
            .arg(execer.pid()),
    );
    execer.step("done");
    let warning = wait_for_line(&log, "pid", "without a symbol table");
    assert!(
        warning.contains(static_path) && warning.contains("--allocator"),
        "the warning names the program and the way out: {warning}"
    );
    // heapprofd keeps going until the target exits.
    execer.finish();
    wait_success(&mut heapprofd, &log, "--pid through an exec out of libc");
    let profile = last_profile(&out);
    let samples = samples(&profile);
    assert_eq!(by_caller(&samples, "parent_work"), [100, 6400, 0, 0]);
    assert_eq!(by_caller(&samples, "image2_work"), [0; 4]);
    let comments = comments(&profile);
    assert!(
        comments
            .iter()
            .any(|c| c.contains(static_path) && c.contains("--allocator")),
        "the profile says so too: {comments:?}"
    );
}

/// A probe the kernel single-steps (~10x an emulated one) is a warning naming the
/// function: `--probe-placement entry` keeps glibc's `free` on `test %rdi,%rdi`;
/// the default placement leaves none on the C library.
#[test]
fn a_single_stepped_probe_is_a_warning_naming_its_function() {
    require_root();
    let dir = scratch();
    let out = dir.path().join("profiles");
    let warnings = |placement: &str| -> Vec<String> {
        let output = run_ok(heapprofd(&out).args([
            // The allocator's probes, not the preload library.
            "--preload",
            "off",
            "--probe-placement",
            placement,
            "--",
            "/bin/true",
        ]));
        String::from_utf8_lossy(&output.stderr)
            .lines()
            .filter(|line| line.contains("is single-stepped by the kernel"))
            .map(str::to_owned)
            .collect()
    };
    let at_entry = warnings("entry");
    assert!(
        at_entry
            .iter()
            .any(|line| line.contains("free in ") && line.contains("libc.so.6")),
        "no warning names glibc's free: {at_entry:#?}"
    );
    let auto = warnings("auto");
    assert!(
        auto.is_empty(),
        "single-stepped at the default placement: {auto:#?}"
    );
}
