//! `--pid` joining a running process in-process (`--inject auto`): heapprofd's
//! library loaded into it by ptrace, its allocator calls redirected there.
//!
//! The target is tests/programs/joined.c, which allocates through the PLT, inside the
//! C library (strdup, fopen), through a dlopened plugin, and frees through a pointer to
//! free saved before any heapprofd came. The counts of a joined session are checked
//! against a session on the allocator's probes (`--inject off`) doing the same work.
//! The tests run one at a time (`serial`): each attaches to its own process, but the
//! log checks and counts are simplest alone.

mod common;

use std::{collections::BTreeMap, path::Path, process::Command};

use common::*;
use heapprof_daemon::profiles_file::{ImageRead, Line};

const ROUNDS: i64 = 300;

/// joined.c at -O2 and its plugin; the program is started with the plugin's path.
fn start_joined(dir: &Path) -> Driven {
    let plugin = dir.join("libjoined_plugin.so");
    let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/programs/joined_plugin.c");
    let status = Command::new("gcc")
        .args(["-O2", "-g", "-fno-builtin", "-shared", "-fPIC", "-o"])
        .arg(&plugin)
        .arg(&source)
        .status()
        .expect("running gcc");
    assert!(status.success(), "building the plugin");
    let binary = compile(dir, "joined", "joined", &["-O2", "-ldl"]);
    Driven::start_for_pid(&binary, &[plugin.to_str().expect("utf-8 path")])
}

/// Totals per (caller, allocator function): allocated objects, bytes, in-use objects, bytes.
type Sites = BTreeMap<(String, String), [i64; 4]>;

/// [`Sites`] of process `pid`'s samples.
fn by_site(samples: &[Sample], pid: u32) -> Sites {
    let pid = pid.to_string();
    let mut sites = Sites::new();
    for sample in samples
        .iter()
        .filter(|s| s.labels.get("pid").is_some_and(|p| *p == pid))
    {
        let caller = sample.stack.get(1).cloned().unwrap_or_default();
        let entry = sites.entry((caller, sample.stack[0].clone())).or_default();
        for (total, value) in entry.iter_mut().zip(sample.values) {
            *total += value;
        }
    }
    sites
}

/// Attaches with `args`, sends `commands` (each answered "done"), detaches; returns
/// the final profile's sites of the process, whether heapprofd joined it in-process
/// (its `--stats-json`) and its log after attaching.
fn session(
    joined: &mut Driven,
    out: &Path,
    args: &[&str],
    commands: &[&str],
) -> (Sites, bool, Vec<String>) {
    let pid = joined.child.id();
    // Joined unless the case says how.
    let join = if args.contains(&"--inject") {
        &[][..]
    } else {
        &["--inject", "auto"][..]
    };
    let stats = stats_file(out);
    let (mut heapprofd, log) = start_heapprofd(
        heapprofd(out)
            .args(["--interval", "1h", "--pid", &pid.to_string()])
            .arg("--stats-json")
            .arg(&stats)
            .args(join)
            .args(args),
    );
    for command in commands {
        joined.command(command, "done");
    }
    signal(&heapprofd, libc::SIGINT);
    let status = heapprofd.wait().expect("waiting for heapprofd");
    // The stderr reader ends at EOF, which follows the exit.
    let lines: Vec<String> = log.iter().collect();
    assert!(
        status.success(),
        "heapprofd {args:?}: {status}\n{}",
        lines.join("\n")
    );
    let in_process = joined_in_process(&stats).is_ok();
    (
        by_site(&samples(&last_profile(out)), pid),
        in_process,
        lines,
    )
}

#[test]
fn a_joined_process_counts_every_path_as_the_probes_do() {
    require_root();
    let _serial = serial();
    let dir = scratch();
    let mut joined = start_joined(dir.path());
    // The plugin is loaded before either session: both see the same objects.
    joined.command("work 1", "done");
    let work = format!("work {ROUNDS}");
    let (injected, in_process, log) =
        session(&mut joined, &dir.path().join("injected"), &[], &[&work]);
    assert!(
        in_process,
        "the process was not joined:\n{}",
        log.join("\n")
    );
    let left = &read_stats(&stats_file(&dir.path().join("injected")))["left"];
    assert_eq!(
        left["how"],
        "slots_restored",
        "the library did not leave ({left}):\n{}",
        log.join("\n")
    );
    let (probed, in_process, log) = session(
        &mut joined,
        &dir.path().join("probed"),
        &["--inject", "off"],
        &[&work],
    );
    assert!(!in_process, "--inject off joined:\n{}", log.join("\n"));
    assert_eq!(
        injected, probed,
        "per (caller, allocator) [allocated objects, bytes, in-use objects, bytes]: \
         joined in-process (left) against the allocator's probes (right)"
    );
    // Every path was seen: the PLT's, the C library's own, the plugin's.
    for (caller, function) in [
        ("plt_paths", "malloc"),
        ("plt_paths", "calloc"),
        ("plt_paths", "realloc"),
        ("plt_paths", "posix_memalign"),
        ("strdup", "malloc"),
        ("plugin_work", "malloc"),
    ] {
        // The C library's functions go by their internal names (__GI___strdup).
        let values = injected
            .iter()
            .find(|((c, f), _)| c.ends_with(caller) && f == function)
            .map(|(_, values)| values)
            .unwrap_or_else(|| panic!("{caller} -> {function} not counted: {injected:?}"));
        assert!(values[0] >= ROUNDS, "{caller} -> {function}: {values:?}");
    }
    assert!(
        injected.keys().any(|(caller, _)| caller.contains("fopen")),
        "fopen's FILE not counted: {injected:?}"
    );
    // Each round keeps one 40-byte block.
    assert_eq!(
        injected[&("plt_paths".to_owned(), "malloc".to_owned())][2..],
        [ROUNDS, ROUNDS * 40]
    );
    joined.finish();
}

/// A joined program that puts its own files at low descriptor numbers (a shell's
/// `exec 6>&1` in `configure`, a daemon's dup2 onto 3) keeps them: the descriptors
/// heapprofd hands over sit above them, so the library never takes the program's for
/// its own (a regular file always reads as "heapprofd has exited") nor closes them,
/// and the join goes on counting.
#[test]
fn a_joined_programs_own_low_descriptors_stay_its_own() {
    require_root();
    let _serial = serial();
    let dir = scratch();
    let mut joined = start_joined(dir.path());
    let (sites, in_process, log) = session(
        &mut joined,
        &dir.path().join("profiles"),
        &[],
        &["descriptors 2000"],
    );
    assert!(
        in_process,
        "the process was not joined:\n{}",
        log.join("\n")
    );
    let key = ("low_descriptors".to_owned(), "malloc".to_owned());
    assert_eq!(
        sites.get(&key).map(|values| values[0]),
        Some(2000),
        "the allocations made after the program's dup2s, per site: {sites:?}"
    );
}

/// A program that puts files of its own where the join keeps its descriptors (100
/// and up) keeps them: the library sees that its pidfd's number now holds another
/// file, takes the join for over, and leaves without polling or closing what is the
/// program's now. (Before, it polled the file as heapprofd's pidfd, read "exited",
/// and closed it.)
#[test]
fn a_joined_program_that_takes_the_joins_descriptors_keeps_its_files() {
    require_root();
    let _serial = serial();
    let dir = scratch();
    let mut joined = start_joined(dir.path());
    // `session` sends the command and waits for "done" ("lost D" otherwise).
    let (_, in_process, log) = session(
        &mut joined,
        &dir.path().join("profiles"),
        &[],
        &["high-descriptors 2000", "work 1"],
    );
    assert!(
        in_process,
        "the process was not joined:\n{}",
        log.join("\n")
    );
}

#[test]
fn a_plugin_dlopened_after_the_join_is_redirected_too() {
    require_root();
    let _serial = serial();
    let dir = scratch();
    let mut joined = start_joined(dir.path());
    // dlopen during the session: the library redirects the plugin's slots within a
    // few hundred allocations of the thread; what came before is not counted.
    let (sites, in_process, log) = session(
        &mut joined,
        &dir.path().join("profiles"),
        &[],
        &["work 1", &format!("work {ROUNDS}")],
    );
    assert!(
        in_process,
        "the process was not joined:\n{}",
        log.join("\n")
    );
    let plugin = sites
        .get(&("plugin_work".to_owned(), "malloc".to_owned()))
        .unwrap_or_else(|| panic!("the plugin's allocations were not counted: {sites:?}"));
    assert!(
        plugin[0] >= ROUNDS - 150 && plugin[0] <= ROUNDS + 1,
        "plugin allocations counted: {plugin:?} of {}",
        ROUNDS + 1
    );
    assert_eq!(plugin[2], 0, "the plugin frees every block: {plugin:?}");
    joined.finish();
}

#[test]
fn frees_through_a_pointer_saved_before_the_join_are_closed_by_reuse_and_counted() {
    // The documented limit of GOT redirection: a pointer to free taken before the
    // join calls the allocator directly, unseen. A block it freed is closed when the
    // allocator hands its address out again; the last one stays counted in use, and
    // the profile counts the frees it did not see.
    require_root();
    let _serial = serial();
    let dir = scratch();
    let mut joined = start_joined(dir.path());
    let out = dir.path().join("p");
    let (sites, in_process, log) = session(&mut joined, &out, &[], &["saved 100", "mixed 50"]);
    assert!(
        in_process,
        "the process was not joined:\n{}",
        log.join("\n")
    );
    assert_eq!(
        sites[&("saved_pointer".to_owned(), "malloc".to_owned())],
        [100, 5600, 1, 56]
    );
    // Each round's second block takes the address of the first, whose free was not
    // seen, and is freed where heapprofd sees it: that free is the second block's,
    // not the first one's arriving late, so nothing of it stays in use.
    assert_eq!(
        sites[&("mixed_pointers".to_owned(), "malloc".to_owned())],
        [100, 7200, 0, 0]
    );
    // 99 saved-pointer frees seen by reuse (the last block is still in use), then 50
    // (the first mixed block takes the last saved one's address: one more).
    let unseen = drop_count(&last_profile(&out), heapprof_common::DropReason::FreeUnseen);
    assert!(
        (149..=150).contains(&unseen),
        "frees not seen, as the profile counts them: {unseen}"
    );
    joined.finish();
}

#[test]
fn attaching_and_detaching_fifty_times_leaves_the_process_working_and_one_library() {
    require_root();
    let _serial = serial();
    let dir = scratch();
    let mut joined = start_joined(dir.path());
    let pid = joined.child.id();
    let fds_before = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .expect("fds")
        .count();
    for round in 0..50 {
        let (sites, in_process, log) = session(
            &mut joined,
            &dir.path().join(format!("p{round}")),
            &[],
            &["work 20"],
        );
        assert!(in_process, "round {round}: not joined:\n{}", log.join("\n"));
        assert_eq!(
            sites[&("plt_paths".to_owned(), "calloc".to_owned())][..2],
            [20, 20 * 48],
            "round {round}"
        );
    }
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).expect("maps");
    let copies: std::collections::HashSet<&str> = maps
        .lines()
        .filter(|l| l.contains("/memfd:heapprofd-preload"))
        .filter_map(|l| l.split_whitespace().nth(4))
        .collect();
    assert_eq!(
        copies.len(),
        1,
        "copies of the library (inodes): {copies:?}"
    );
    let fds_after = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .expect("fds")
        .count();
    assert_eq!(fds_before, fds_after, "descriptors left in the process");
    joined.command("work 5", "done");
    joined.finish();
}

/// Runs heapprofd on `pid` until it SIGKILLs itself in its `call`th call into the
/// process (HEAPPROFD_TEST_KILL_IN_REMOTE_CALL); false if it made fewer calls (it is
/// then ended with SIGINT).
fn killed_in_call(out: &Path, pid: u32, call: u32) -> bool {
    let ready = ready_file(out);
    let _ = std::fs::remove_file(&ready);
    let mut heapprofd = heapprofd(out)
        .args([
            "--interval",
            "1h",
            "--inject",
            "auto",
            "--pid",
            &pid.to_string(),
        ])
        .env("HEAPPROFD_TEST_KILL_IN_REMOTE_CALL", call.to_string())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("starting heapprofd");
    // Ready (it made all its calls) or gone: whichever comes first.
    if let Start::Ready = wait_ready(&mut heapprofd, &ready, std::time::Duration::from_secs(60)) {
        signal(&heapprofd, libc::SIGINT);
    }
    let status = heapprofd.wait().expect("waiting for heapprofd");
    std::os::unix::process::ExitStatusExt::signal(&status) == Some(libc::SIGKILL)
}

/// After heapprofd died in a call: the process still runs, works, and has its signal
/// mask back.
fn check_survived(joined: &mut Driven, call: u32, what: &str) {
    std::thread::sleep(std::time::Duration::from_millis(200));
    let exited = joined.child.try_wait().expect("try_wait");
    assert!(
        exited.is_none(),
        "{what}, call {call}: the process ended: {exited:?}"
    );
    joined.command("work 10", "done");
    let pid = joined.child.id();
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    assert!(
        status.contains("SigBlk:\t0000000000000000"),
        "{what}, call {call}: the thread's signal mask was not given back:\n{status}"
    );
    let left = leaked_descriptors(pid);
    assert!(
        left.is_empty(),
        "{what}, call {call}: heapprofd's calls left descriptors behind: {left:?}"
    );
}

/// Descriptors of `pid` that only heapprofd's calls make and close again: a socket
/// (joined.c has none) or the library's memfd open for writing. (A library joined to
/// the dead heapprofd holds the answers' map, the pidfd and a read-only descriptor of
/// itself until it sees heapprofd gone.)
fn leaked_descriptors(pid: u32) -> Vec<(String, String)> {
    let mut leaked = Vec::new();
    for entry in std::fs::read_dir(format!("/proc/{pid}/fd")).expect("fd directory") {
        let entry = entry.expect("fd entry");
        let fd = entry.file_name().to_string_lossy().into_owned();
        let Ok(target) = std::fs::read_link(entry.path()) else {
            continue;
        };
        let target = target.to_string_lossy().into_owned();
        let info = std::fs::read_to_string(format!("/proc/{pid}/fdinfo/{fd}")).unwrap_or_default();
        let writable = info
            .lines()
            .find_map(|l| l.strip_prefix("flags:"))
            .and_then(|flags| u32::from_str_radix(flags.trim(), 8).ok())
            .is_some_and(|flags| flags & 3 != 0);
        if target.starts_with("socket:") || (target.contains("memfd:heapprofd") && writable) {
            leaked.push((fd, target));
        }
    }
    leaked
}

#[test]
fn heapprofd_killed_in_the_middle_of_each_remote_call_leaves_the_process_working() {
    // heapprofd SIGKILLs itself once its Nth call into the process is running: the
    // thread returns into the return stub and resumes where it was held. The one call
    // without it is the first into a process that has no heapprofd library yet (the
    // mmap of the stub's page): from the 2nd on for a new process, from the 1st once
    // the library is there.
    require_root();
    let _serial = serial();
    let dir = scratch();
    let mut calls = 0;
    for call in 2.. {
        let mut joined = start_joined(dir.path());
        let out = dir.path().join(format!("new-{call}"));
        if !killed_in_call(&out, joined.child.id(), call) {
            break;
        }
        check_survived(&mut joined, call, "a new process");
        calls = call;
    }
    assert!(
        calls >= 4,
        "heapprofd made only {calls} calls into a new process"
    );
    let mut joined = start_joined(dir.path());
    let pid = joined.child.id();
    // A session that joins and leaves: the library stays, inert.
    let (_, in_process, log) = session(&mut joined, &dir.path().join("first"), &[], &["work 1"]);
    assert!(in_process, "not joined:\n{}", log.join("\n"));
    for call in 1.. {
        let out = dir.path().join(format!("loaded-{call}"));
        if !killed_in_call(&out, pid, call) {
            break;
        }
        check_survived(&mut joined, call, "the library loaded");
    }
    // A session killed in the join may have left the library joined to a dead
    // heapprofd: it sees the pidfd and leaves within a few hundred allocations.
    joined.command("work 200", "done");
    let (sites, in_process, log) =
        session(&mut joined, &dir.path().join("after"), &[], &["work 20"]);
    assert!(
        in_process,
        "not joined after the kills:\n{}",
        log.join("\n")
    );
    assert_eq!(
        sites[&("plt_paths".to_owned(), "calloc".to_owned())][..2],
        [20, 20 * 48]
    );
    joined.finish();
}

/// A joined process that execs through each exec function in turn (exec_chain.c):
/// every image is followed with the library preloaded from a descriptor, counted
/// exactly, and sees its environment as the program made it (its own LD_PRELOAD kept,
/// nothing of heapprofd's); an exec that fails returns its error and leaves no
/// descriptor behind; heapprofd's exit calls nothing into the last image.
#[test]
fn a_joined_process_is_followed_through_every_exec_function() {
    require_root();
    let _serial = serial();
    let dir = scratch();
    let binary = compile(dir.path(), "exec_chain", "exec_chain", &["-O1"]);
    // A preload of the program's own, which every image must still see.
    let mut chain = Driven::spawn(outside_system_preload(
        Command::new(&binary).env("LD_PRELOAD", "libm.so.6"),
    ));
    let pid = chain.child.id();
    let out = dir.path().join("profiles");
    let (profiles, stats) = (profiles_json(&out), stats_file(&out));
    let (mut heapprofd, log) = start_heapprofd(
        heapprofd(&out)
            .arg("--profiles-json")
            .arg(&profiles)
            .arg("--stats-json")
            .arg(&stats)
            .args(["--interval", "1h", "--inject", "auto", "--pid"])
            .arg(pid.to_string()),
    );
    for image in (0..=7).rev() {
        assert_eq!(
            chain.step_reading(),
            format!("image {image} LD_PRELOAD=libm.so.6 HEAPPROFD_FOLLOW=-"),
        );
        if image == 7 {
            let missing = chain.next_line(std::time::Duration::from_secs(30));
            let fields: Vec<&str> = missing.split(' ').collect();
            assert!(
                missing.starts_with("missing -1 No such file or directory "),
                "{missing}"
            );
            assert_eq!(
                fields[fields.len() - 2],
                fields[fields.len() - 1],
                "descriptors before and after a failed exec: {missing}"
            );
        }
        if image > 0 {
            assert_eq!(chain.step_reading(), format!("exec'd {}", image - 1));
            // The next image allocates once heapprofd knows its mappings, so that its
            // frames are named although it is gone when the profile is written.
            let generation = 8 - image;
            wait_for_profiles_line(
                &profiles,
                0,
                &format!("read of exec generation {generation} with its allocator"),
                |line| {
                    *line
                        == Line::ImageRead(ImageRead {
                            pid,
                            exec_generation: generation,
                            probed_allocator: true,
                        })
                },
            );
        }
    }
    signal(&heapprofd, libc::SIGINT);
    let status = heapprofd.wait().expect("waiting for heapprofd");
    let lines: Vec<String> = log.iter().collect();
    assert!(
        status.success(),
        "heapprofd: {status}\n{}",
        lines.join("\n")
    );
    // The image joined was gone: heapprofd called nothing into the last one.
    let left = &read_stats(&stats)["left"];
    assert_eq!(
        left["how"],
        "replaced",
        "heapprofd did not see the exec ({left}):\n{}",
        lines.join("\n")
    );
    let sites = by_site(&samples(&last_profile(&out)), pid);
    let image_work: Vec<[i64; 4]> = sites
        .iter()
        .filter(|((caller, _), _)| caller == "image_work")
        .map(|(_, values)| *values)
        .collect();
    let total = image_work.iter().fold([0; 4], |mut sum, v| {
        for (s, x) in sum.iter_mut().zip(v) {
            *s += x;
        }
        sum
    });
    // 10 blocks of 16*(K+1) bytes in each of the 8 images; only the last one's live.
    let bytes: i64 = (0..8).map(|k| 10 * 16 * (k + 1)).sum();
    assert_eq!(total, [80, bytes, 10, 160], "image_work: {sites:?}");
    // Still answering after heapprofd left.
    chain.finish();
}
