//! Samples carry the cgroup (and container) of their process: a program started in a
//! cgroup the test creates is labelled with it.

mod common;

use std::path::PathBuf;

use common::*;

/// Where the cgroup v2 hierarchy is mounted (`/sys/fs/cgroup`, or
/// `/sys/fs/cgroup/unified` on a hybrid system).
fn cgroup2_mount() -> PathBuf {
    let mounts = std::fs::read_to_string("/proc/self/mounts").expect("reading /proc/self/mounts");
    mounts
        .lines()
        .find_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            (fields.get(2) == Some(&"cgroup2")).then(|| PathBuf::from(fields[1]))
        })
        .unwrap_or_else(|| panic!("no cgroup2 hierarchy mounted: {mounts}"))
}

/// A cgroup removed when dropped (once its processes have exited).
struct TestCgroup(PathBuf);

impl Drop for TestCgroup {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir(&self.0);
    }
}

#[test]
fn samples_carry_the_cgroup_of_their_process() {
    require_root();
    let dir = scratch();
    let program = compile(dir.path(), "stacks", "stacks", &["-O0"]);
    let name = format!("heapprofd-test-{}", std::process::id());
    let cgroup = TestCgroup(cgroup2_mount().join(&name));
    std::fs::create_dir(&cgroup.0)
        .unwrap_or_else(|err| panic!("creating the cgroup {}: {err}", cgroup.0.display()));
    let out = dir.path().join("profiles");
    // The shell moves itself into the cgroup, then becomes the program.
    let script = format!(
        "echo $$ > {}/cgroup.procs && exec {}",
        cgroup.0.display(),
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
            Some(format!("/{name}").as_str()),
            "{sample:?}"
        );
        assert!(
            !sample.labels.contains_key("container"),
            "no container runtime named this cgroup: {sample:?}"
        );
    }
}
