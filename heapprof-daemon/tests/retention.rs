//! Retention: the output directory bounded by `--keep` and `--keep-for`, and exited
//! processes forgotten with `--all --retain-exited`.

mod common;

use std::{
    path::{Path, PathBuf},
    process::Output,
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use common::*;
use heapprof_daemon::pprof::{
    proto::Profile,
    writer::{parse_profile_file_name, profile_file_name},
};

/// The paths heapprofd wrote into `out`, in order, as its `--profiles-json` lists them.
fn written(out: &Path) -> Vec<PathBuf> {
    heapprof_daemon::profiles_file::read(&profiles_json(out))
        .unwrap_or_else(|e| panic!("heapprofd's --profiles-json: {e:#}"))
        .iter()
        .filter_map(|line| Some(line.written()?.path.clone()))
        .collect()
}

/// The names in `dir`, sorted.
fn names_in(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

fn file_name(path: &Path) -> String {
    path.file_name()
        .expect("a file name")
        .to_string_lossy()
        .into_owned()
}

/// Runs heapprofd on a waiting test program with `args` for `duration`, writing to `out`.
fn run_on_waiter(dir: &Path, out: &Path, duration: &str, args: &[&str]) -> Output {
    let binary = compile(dir, "waiter", "waiter", &["-O0"]);
    let waiter = Driven::start(&binary, &["100", "32"]);
    let output = run_ok(
        heapprofd(out)
            .arg("--profiles-json")
            .arg(profiles_json(out))
            .args(["--interval", "100ms", "--duration", duration, "--pid"])
            .arg(waiter.pid())
            .args(args),
    );
    drop(waiter);
    output
}

#[test]
fn keep_leaves_exactly_the_newest_profiles() {
    require_root();
    let dir = scratch();
    let out = dir.path().join("profiles");
    std::fs::create_dir(&out).expect("mkdir");
    std::fs::write(out.join("notes.txt"), "not a profile").expect("write");

    let output = run_on_waiter(dir.path(), &out, "2500ms", &["--keep", "3"]);
    let written = written(&out);
    assert!(
        written.len() >= 11,
        "10 intervals and the final profile, got {}: {}",
        written.len(),
        String::from_utf8_lossy(&output.stderr)
    );
    let newest: Vec<String> = written[written.len() - 3..]
        .iter()
        .map(|p| file_name(p))
        .collect();
    let mut expected = newest.clone();
    expected.push("notes.txt".to_owned());
    expected.sort();
    assert_eq!(
        names_in(&out),
        expected,
        "the 3 newest profiles and the foreign file, no temp file"
    );
    for name in &newest {
        decode(&out.join(name));
    }
    assert_eq!(
        std::fs::read_to_string(out.join("notes.txt")).expect("read"),
        "not a profile"
    );
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(
        stderr.matches("old profile(s) from").count(),
        1,
        "pruning is announced once: {stderr}"
    );
    assert!(!stderr.contains("warning"), "{stderr}");
}

#[test]
fn keep_for_deletes_old_profiles_and_never_the_newest() {
    require_root();
    let dir = scratch();
    let out = dir.path().join("profiles");
    std::fs::create_dir(&out).expect("mkdir");
    // Profiles of an earlier run: two from 2020, one from a minute ago.
    let old_time = UNIX_EPOCH + Duration::from_secs(1_577_836_800);
    let old: Vec<String> = (1..=2).map(|n| profile_file_name(old_time, n)).collect();
    let recent = profile_file_name(SystemTime::now() - Duration::from_secs(60), 1);
    for name in old.iter().chain([&recent]) {
        std::fs::write(out.join(name), "earlier run").expect("write");
    }
    // A symlink with an old profile's name, to a file outside: never followed.
    let victim = dir.path().join("victim");
    std::fs::write(&victim, "precious").expect("write");
    let link = profile_file_name(old_time, 3);
    std::os::unix::fs::symlink(&victim, out.join(&link)).expect("symlink");

    run_on_waiter(dir.path(), &out, "600ms", &["--keep-for", "1h"]);
    let mut expected: Vec<String> = written(&out).iter().map(|p| file_name(p)).collect();
    assert!(!expected.is_empty());
    expected.push(recent.clone());
    expected.push(link.clone());
    expected.sort();
    assert_eq!(
        names_in(&out),
        expected,
        "the 2020 profiles deleted, the others kept"
    );
    assert_eq!(std::fs::read_to_string(&victim).expect("read"), "precious");

    // A tiny --keep-for: only the newest profile is left.
    run_on_waiter(dir.path(), &out, "500ms", &["--keep-for", "1ms"]);
    let last = file_name(written(&out).last().expect("a profile written"));
    let mut expected = vec![last.clone(), link];
    expected.sort();
    assert_eq!(names_in(&out), expected);
    decode(&out.join(last));
}

#[test]
fn bad_retention_flags_get_one_clear_line_and_status_2() {
    require_root();
    let dir = scratch();
    let out = dir.path().join("profiles");
    let cases: [(&[&str], &str); 6] = [
        (&["--all", "--keep", "0"], "give 1 or more"),
        (&["--all", "--keep", "many"], "not a number of profiles"),
        (&["--all", "--keep-for", "3y"], "use ms, s, m, h or d"),
        (
            &["--all", "--retain-exited", "0s"],
            "must be greater than zero",
        ),
        (
            &["--pid", "1", "--retain-exited", "1h"],
            "--retain-exited applies to --all only",
        ),
        (
            &["--retain-exited", "1h", "--", "true"],
            "drop it, or trace with --all",
        ),
    ];
    for (args, message) in cases {
        let output = heapprofd(&out)
            .args(args)
            .output()
            .expect("starting heapprofd");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{args:?}: {stderr}");
        assert_eq!(stderr.lines().count(), 1, "{args:?}: one line: {stderr}");
        assert!(stderr.contains(message), "{args:?}: {stderr}");
    }
    assert!(!out.exists(), "nothing started");
}

/// Runs heapprofd --all (with `extra` flags) while a process allocates in `function`
/// (waiter.c's `work`, renamed) and exits; heapprofd stops once `enough` is true of
/// the profiles written after the exit. Returns those profiles and the process's pid.
fn exited_process_run(
    function: &str,
    extra: &[&str],
    enough: impl Fn(&[(PathBuf, Profile)], &str) -> bool,
) -> (Vec<(PathBuf, Profile)>, String) {
    let dir = scratch();
    let binary = compile(
        dir.path(),
        "waiter",
        "short_lived",
        &["-O0", &format!("-Dwork={function}")],
    );
    let out = dir.path().join("profiles");
    let mut waiter = Driven::start(&binary, &["100", "64"]);
    let pid = waiter.pid();
    let (mut heapprofd, log) = start_heapprofd(
        heapprofd(&out)
            .args(["--all", "--interval", "200ms"])
            .args(extra),
    );
    waiter.step("done");
    waiter.finish();
    let exited = SystemTime::now();
    // Polled rather than slept: with other tests' processes coming and going, a
    // dump of every process can take seconds.
    let deadline = std::time::Instant::now() + Duration::from_secs(300);
    let mut after: Vec<(PathBuf, Profile)> = Vec::new();
    while !enough(&after, &pid) {
        assert!(
            std::time::Instant::now() < deadline,
            "gave up after {} profiles",
            after.len()
        );
        std::thread::sleep(Duration::from_millis(200));
        after = written_after(&out, exited, after);
    }
    signal(&heapprofd, libc::SIGINT);
    wait_success(&mut heapprofd, &log, "--all");
    (written_after(&out, exited, after), pid)
}

/// The profiles in `out` written after `time`, in order: those of `known` and the
/// new ones, decoded.
fn written_after(
    out: &Path,
    time: SystemTime,
    mut known: Vec<(PathBuf, Profile)>,
) -> Vec<(PathBuf, Profile)> {
    let mut new: Vec<PathBuf> = std::fs::read_dir(out)
        .map(|dir| dir.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    new.retain(|path| {
        parse_profile_file_name(&file_name(path)).is_some_and(|(written, _)| written > time)
            && !known.iter().any(|(p, _)| p == path)
    });
    new.sort();
    known.extend(new.into_iter().map(|path| {
        let profile = decode(&path);
        (path, profile)
    }));
    known
}

/// Allocated objects and bytes of `function` in process `pid`, if it has samples.
fn allocated_in(profile: &Profile, pid: &str, function: &str) -> Option<[i64; 2]> {
    let samples = samples(profile);
    let mine: Vec<&Sample> = samples
        .iter()
        .filter(|s| s.labels.get("pid").is_some_and(|p| p == pid))
        .filter(|s| s.stack.iter().any(|f| f == function))
        .collect();
    (!mine.is_empty()).then(|| {
        mine.iter().fold([0, 0], |acc, s| {
            [acc[0] + s.values[0], acc[1] + s.values[1]]
        })
    })
}

#[test]
fn retain_exited_forgets_processes_gone_long_enough() {
    require_root();
    let function = "retention_forgotten_work";
    let (after, pid) = exited_process_run(function, &["--retain-exited", "1s"], |after, pid| {
        after
            .last()
            .is_some_and(|(_, p)| allocated_in(p, pid, function).is_none())
    });
    // Found gone at the interval after its exit, forgotten 1 s later: the profiles
    // written in between still show it.
    assert_eq!(
        allocated_in(&after[0].1, &pid, function),
        Some([100, 6400]),
        "{} (the first profile after the exit) shows the exited process",
        after[0].0.display()
    );
    let (last_path, last) = after.last().expect("a profile");
    assert_eq!(
        allocated_in(last, &pid, function),
        None,
        "{} (the final one) no longer does",
        last_path.display()
    );
    let pid_field = format!(" pid={pid} ");
    assert!(
        !comments(last).iter().any(|c| c.contains(&pid_field)),
        "its memory figures are gone too: {:?}",
        comments(last)
    );
    // Once gone, gone for good.
    let shown: Vec<bool> = after
        .iter()
        .map(|(_, p)| allocated_in(p, &pid, function).is_some())
        .collect();
    assert!(
        shown.windows(2).all(|w| w[0] || !w[1]),
        "shown in each profile after the exit: {shown:?}"
    );
}

#[test]
fn without_retain_exited_exited_processes_stay() {
    require_root();
    let function = "retention_kept_work";
    let (after, pid) = exited_process_run(function, &[], |after, _| {
        // Well past when --retain-exited 1s would have forgotten it.
        let first = after
            .first()
            .and_then(|(p, _)| parse_profile_file_name(&file_name(p)));
        let last = after
            .last()
            .and_then(|(p, _)| parse_profile_file_name(&file_name(p)));
        matches!((first, last), (Some((first, _)), Some((last, _)))
            if after.len() >= 4 && last.duration_since(first).unwrap_or_default() >= Duration::from_secs(3))
    });
    for (path, profile) in &after {
        assert_eq!(
            allocated_in(profile, &pid, function),
            Some([100, 6400]),
            "{}",
            path.display()
        );
    }
}
