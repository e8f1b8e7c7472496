//! Samples carry the cgroup (and container) of their process: a program started in a
//! cgroup the test creates is labelled with it; `--all --cgroup` and `--kernel
//! --cgroup` see the processes of that cgroup only.

mod common;

use std::{
    path::PathBuf,
    process::{Command, Stdio},
    time::Duration,
};

use common::*;

/// Where the cgroup v2 hierarchy is mounted.
fn cgroup2_mount() -> PathBuf {
    heapprof_daemon::cgroup::cgroup2_mount().expect("a cgroup v2 hierarchy mounted")
}

/// A cgroup of the v2 hierarchy, removed when dropped (once its processes are gone).
struct TestCgroup {
    /// Its directory.
    dir: PathBuf,
    /// Its path in the hierarchy, as `/proc/PID/cgroup` shows it.
    path: String,
}

impl TestCgroup {
    fn create(what: &str) -> Self {
        let name = format!("heapprofd-test-{what}-{}", std::process::id());
        let dir = cgroup2_mount().join(&name);
        std::fs::create_dir(&dir)
            .unwrap_or_else(|err| panic!("creating the cgroup {}: {err}", dir.display()));
        Self {
            dir,
            path: format!("/{name}"),
        }
    }

    /// Moves process `pid` into the cgroup.
    fn adopt(&self, pid: &str) {
        std::fs::write(self.dir.join("cgroup.procs"), pid)
            .unwrap_or_else(|err| panic!("moving {pid} into {}: {err}", self.dir.display()));
    }
}

impl Drop for TestCgroup {
    fn drop(&mut self) {
        // Its last processes may take a moment to be reaped.
        for _ in 0..50 {
            if std::fs::remove_dir(&self.dir).is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

#[test]
fn samples_carry_the_cgroup_of_their_process() {
    require_root();
    let dir = scratch();
    let program = compile(dir.path(), "stacks", "stacks", &["-O0"]);
    let cgroup = TestCgroup::create("labels");
    let out = dir.path().join("profiles");
    // The shell moves itself into the cgroup, then becomes the program.
    let script = format!(
        "echo $$ > {}/cgroup.procs && exec {}",
        cgroup.dir.display(),
        program.display()
    );
    run_ok(heapprofd(&out).args(["--", "sh", "-c", &script]));
    let samples = samples(&last_profile(&out));
    let (stacks, _) = abc_stacks(&samples);
    assert_eq!(stacks, expected_abc_stacks(), "{samples:?}");
    let ours: Vec<&Sample> = samples
        .iter()
        .filter(|s| s.stack.iter().any(|f| f == "a" || f == "b"))
        .collect();
    for sample in &ours {
        assert_eq!(
            sample.labels.get("cgroup").map(String::as_str),
            Some(cgroup.path.as_str()),
            "{sample:?}"
        );
        assert!(
            !sample.labels.contains_key("container"),
            "no container runtime named this cgroup: {sample:?}"
        );
    }
}

#[test]
fn all_with_cgroup_sees_that_cgroup_only() {
    require_root();
    let dir = scratch();
    let inside = compile(
        dir.path(),
        "waiter",
        "inside",
        &["-O0", "-Dwork=work_inside"],
    );
    let outside = compile(
        dir.path(),
        "waiter",
        "outside",
        &["-O0", "-Dwork=work_outside"],
    );
    let cgroup = TestCgroup::create("all");
    let mut inside = Driven::start(&inside, &["100", "32"]);
    cgroup.adopt(&inside.pid());
    let mut outside = Driven::start(&outside, &["100", "32"]);
    let out = dir.path().join("profiles");
    let (mut daemon, log) = start_heapprofd(heapprofd(&out).args([
        "--all",
        "--cgroup",
        &cgroup.path,
        "--interval",
        "1h",
    ]));
    inside.step("done");
    outside.step("done");
    signal(&daemon, libc::SIGINT);
    wait_success(&mut daemon, &log, "--all --cgroup");
    let samples = samples(&last_profile(&out));
    let of = |function: &str| totals(&samples, |s| s.stack.iter().any(|f| f == function));
    // 100 blocks of 32 bytes, every other one freed.
    assert_eq!(of("work_inside"), [100, 3200, 50, 1600], "{samples:?}");
    assert_eq!(
        of("work_outside"),
        [0; 4],
        "outside the cgroup: {samples:?}"
    );
    let pids: std::collections::BTreeSet<&str> = samples
        .iter()
        .filter_map(|s| s.labels.get("pid").map(String::as_str))
        .collect();
    assert_eq!(
        pids.into_iter().collect::<Vec<_>>(),
        [inside.pid().as_str()],
        "only the cgroup's process"
    );
    inside.finish();
    outside.finish();
}

#[test]
fn kernel_with_cgroup_counts_that_cgroup_only() {
    require_root();
    let dir = scratch();
    let cgroup = TestCgroup::create("kernel");
    // A shell in the cgroup keeps the kernel allocating (every cat is a fork, an
    // exec and an open), in its children too: they inherit the cgroup.
    let script = format!(
        "echo $$ > {}/cgroup.procs && while :; do cat /proc/self/status > /dev/null; done",
        cgroup.dir.display()
    );
    let mut load = Command::new("sh")
        .args(["-c", &script])
        .stdout(Stdio::null())
        .spawn()
        .expect("starting the shell");
    let out = dir.path().join("profiles");
    let output = heapprofd(&out)
        .args(["--kernel", "--cgroup", &cgroup.path, "--duration", "2s"])
        .output()
        .expect("running heapprofd");
    let _ = load.kill();
    let _ = load.wait();
    assert!(
        output.status.success(),
        "heapprofd --kernel --cgroup failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let profile = last_profile(&out);
    let string = |i: i64| profile.string_table[i as usize].as_str();
    let mut comms = std::collections::BTreeSet::new();
    for sample in &profile.sample {
        for label in &sample.label {
            if string(label.key) == "comm" {
                comms.insert(string(label.str).to_owned());
            }
        }
    }
    assert!(!profile.sample.is_empty(), "nothing counted in the cgroup");
    assert!(
        comms.iter().all(|c| c == "sh" || c == "cat"),
        "only the cgroup's shell and its children: {comms:?}"
    );
}

#[test]
fn cgroup_needs_all_or_kernel_and_an_existing_cgroup() {
    let dir = scratch();
    let out = dir.path().join("profiles");
    for (args, message) in [
        (
            vec!["--cgroup", "/", "--pid", "1"],
            "--cgroup restricts --all or --kernel",
        ),
        (
            vec!["--all", "--cgroup", "/no/such/heapprofd/cgroup"],
            "no such cgroup",
        ),
    ] {
        let output = heapprofd(&out)
            .args(&args)
            .output()
            .expect("running heapprofd");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(message), "{args:?}: {stderr}");
        assert_eq!(stderr.lines().count(), 1, "{args:?}: one line: {stderr}");
    }
}

/// Two processes taking turns on one CPU (cpu_share.c) under `--all --cgroup`, on the
/// probes and sampled at 1 byte (every block drawn): each process's blocks are its
/// own. The session program keeps the current thread's id per CPU until a context
/// switch clears it; kept across one, one process's blocks would be counted under the
/// other.
#[test]
fn processes_taking_turns_on_one_cpu_keep_their_own_blocks() {
    require_root();
    let dir = scratch();
    let program = compile(dir.path(), "cpu_share", "cpu_share", &["-O2"]);
    let cgroup = TestCgroup::create("turns");
    let out = dir.path().join("profiles");
    let (mut daemon, log) = start_heapprofd(heapprofd(&out).args([
        "--all",
        "--cgroup",
        &cgroup.path,
        "--inject",
        "off",
        "--sample-rate",
        "1",
        "--interval",
        "1h",
    ]));
    // The program joins the cgroup before it starts: a shell moves itself, then execs.
    let procs = cgroup.dir.join("cgroup.procs");
    let run = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "echo $$ > {} && exec {}",
            procs.display(),
            program.display()
        ))
        .output()
        .expect("running cpu_share");
    signal(&daemon, libc::SIGINT);
    wait_success(&mut daemon, &log, "--all --cgroup --sample-rate 1");
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(
        run.status.success() && stdout.lines().any(|l| l == "done"),
        "cpu_share failed ({}):\n{stdout}{}",
        run.status,
        String::from_utf8_lossy(&run.stderr)
    );
    let samples = samples(&last_profile(&out));
    let mut processes = 0;
    for line in stdout.lines().filter(|l| l.starts_with("pid=")) {
        let mut words = line.split_whitespace();
        let pid = words
            .next()
            .and_then(|w| w.strip_prefix("pid="))
            .unwrap_or("");
        let printed: Vec<i64> = words
            .filter_map(|w| w.split_once('=').and_then(|(_, v)| v.parse().ok()))
            .collect();
        let counted = totals(&samples, |s| {
            s.labels.get("pid").is_some_and(|p| p == pid)
                && s.stack.iter().any(|f| f == "allocate_round")
        });
        assert_eq!(
            counted.to_vec(),
            printed,
            "pid {pid}'s blocks (allocated objects, bytes, in use objects, bytes): {samples:?}"
        );
        processes += 1;
    }
    assert_eq!(processes, 2, "two processes' counts in:\n{stdout}");
}
