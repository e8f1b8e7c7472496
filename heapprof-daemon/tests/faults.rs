//! Faults: signals, SIGKILL of the daemon, a full output filesystem. heapprofd must
//! never leave the system worse than it found it nor lose a profile it wrote.
//!
//! These tests look at system-wide state (loaded BPF programs, links, uprobe events),
//! so they run one at a time (`serial`). They judge only what their own daemon
//! created, by id: the programs and links whose descriptors its process holds. Other
//! BPF tools, another heapprofd among them, may load and unload programs of the same
//! names on the machine meanwhile.

mod common;

use std::{
    io::Write as _,
    path::Path,
    process::{Child, Command},
    time::{Duration, Instant},
};

use common::*;
use heapprof_common::{kernel::KernelEvent, kernel::names as kernel_names, names};
use heapprof_daemon::profiles_file::Line;

/// Longest program name the kernel keeps (`BPF_OBJ_NAME_LEN` less the terminating 0).
const KERNEL_NAME_LEN: usize = 15;

/// Names of heapprofd's BPF programs, user and kernel mode.
fn program_names() -> Vec<&'static str> {
    let user = [
        names::PROG_ENTRY,
        names::PROG_ENTRY_MULTI,
        names::PROG_ALLOC_RETURN,
        names::PROG_ALLOC_RETURN_MULTI,
        names::PROG_ENTRY_SESSION,
        names::PROG_LOADER_STATE,
        names::PROG_LOADER_STATE_MULTI,
        names::PROG_EXEC,
        names::PROG_THREAD_EXIT,
        names::PROG_SWITCH,
        names::PROG_SYSCALL,
        names::PROG_FUTEX_ENTRY,
        names::PROG_EXEC_ENTRY,
        names::PROG_PRELOAD,
    ];
    let kernel = [
        kernel_names::PROG_RCU_FREE,
        kernel_names::PROG_BULK_FREE,
        kernel_names::PROG_RCU_FREE_KPROBE,
        kernel_names::PROG_BULK_FREE_KPROBE,
        kernel_names::PROG_KFREE_RAW,
        kernel_names::PROG_KFREE_RAW_NESTED,
        kernel_names::PROG_KMEM_CACHE_FREE_RAW,
        kernel_names::PROG_KMEM_CACHE_FREE_RAW_NESTED,
    ];
    let tracepoints = KernelEvent::ALL.map(KernelEvent::name);
    user.iter()
        .chain(&kernel)
        .chain(&tracepoints)
        .copied()
        .collect()
}

/// Whether bpftool's `listed` name is `name`: bpftool shows the full name when the
/// program has BTF, else the kernel's, cut to [`KERNEL_NAME_LEN`].
fn is_listed_as(listed: &str, name: &str) -> bool {
    listed == name || name.get(..KERNEL_NAME_LEN) == Some(listed)
}

fn bpftool(what: &str) -> String {
    let output = Command::new("bpftool")
        .args([what, "show"])
        .output()
        .expect("running bpftool (install it: cargo xtask setup)");
    assert!(output.status.success(), "bpftool {what} show failed");
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// The BPF programs loaded now, as `(id, name)` (`ID: TYPE  name NAME  tag ...`).
fn loaded_programs() -> Vec<(u32, String)> {
    bpftool("prog")
        .lines()
        .filter_map(|line| {
            let (id, rest) = line.split_once(':')?;
            let name = rest
                .split_whitespace()
                .skip_while(|w| *w != "name")
                .nth(1)?;
            Some((id.trim().parse().ok()?, name.to_owned()))
        })
        .collect()
}

/// The BPF links that exist now, as `(link id, program id)` (`ID: TYPE  prog PROG_ID`).
fn existing_links() -> Vec<(u32, u32)> {
    bpftool("link")
        .lines()
        .filter_map(|line| {
            let (id, rest) = line.split_once(':')?;
            let words: Vec<&str> = rest.split_whitespace().collect();
            let at = words.iter().position(|w| *w == "prog")?;
            Some((id.trim().parse().ok()?, words.get(at + 1)?.parse().ok()?))
        })
        .collect()
}

/// The BPF programs and links a process holds descriptors of, by id.
#[derive(Debug, Default)]
struct HeldObjects {
    programs: Vec<u32>,
    links: Vec<u32>,
}

/// What process `pid` holds, from the `prog_id:` and `link_id:` lines of its
/// `/proc/PID/fdinfo` (a link's descriptor also names its program).
fn held_by(pid: u32) -> HeldObjects {
    let mut held = HeldObjects::default();
    let dir = std::fs::read_dir(format!("/proc/{pid}/fdinfo")).expect("reading fdinfo");
    for entry in dir.flatten() {
        // A descriptor closed since the listing has no fdinfo any more.
        let Ok(info) = std::fs::read_to_string(entry.path()) else {
            continue;
        };
        for line in info.lines() {
            let Some((key, value)) = line.split_once(':') else {
                continue;
            };
            let Ok(id) = value.trim().parse::<u32>() else {
                continue;
            };
            let list = match key {
                "prog_id" => &mut held.programs,
                "link_id" => &mut held.links,
                _ => continue,
            };
            if !list.contains(&id) {
                list.push(id);
            }
        }
    }
    held
}

/// The programs and links the running daemon created, checked to be heapprofd's: each
/// program it holds is listed by the kernel under one of heapprofd's names.
fn daemon_objects(daemon: &Child) -> HeldObjects {
    let held = held_by(daemon.id());
    let loaded = loaded_programs();
    let known = program_names();
    for id in &held.programs {
        let name = loaded
            .iter()
            .find(|(loaded_id, _)| loaded_id == id)
            .map(|(_, name)| name.as_str());
        assert!(
            name.is_some_and(|listed| known.iter().any(|name| is_listed_as(listed, name))),
            "the daemon holds program {id}, {name:?}, not one of heapprofd's {known:?}"
        );
    }
    held
}

/// Waits (up to 20 s: teardown is asynchronous) until none of `ours` exists any more:
/// no program of its ids loaded, no link of its ids, nor any link to its programs.
/// Returns what is left.
fn wait_released(ours: &HeldObjects) -> HeldObjects {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let loaded = loaded_programs();
        let links = existing_links();
        let left = HeldObjects {
            programs: ours
                .programs
                .iter()
                .copied()
                .filter(|id| loaded.iter().any(|(loaded_id, _)| loaded_id == id))
                .collect(),
            links: links
                .iter()
                .filter(|(link, program)| {
                    ours.links.contains(link) || ours.programs.contains(program)
                })
                .map(|(link, _)| *link)
                .collect(),
        };
        if (left.programs.is_empty() && left.links.is_empty()) || Instant::now() > deadline {
            return left;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The lines of `uprobe_events` (kernels without perf-event uprobes) that aya made for
/// process `pid`: it names its events `aya_PID_...`.
fn uprobe_events_of(pid: u32) -> Vec<String> {
    let prefix = format!("aya_{pid}_");
    std::fs::read_to_string("/sys/kernel/tracing/uprobe_events")
        .unwrap_or_default()
        .lines()
        .filter(|line| line.contains(&prefix))
        .map(str::to_owned)
        .collect()
}

/// The waiter program (tests/programs/waiter.c), ended when dropped.
fn start_waiter(dir: &Path) -> Driven {
    let binary = compile(dir, "waiter", "waiter", &["-O0"]);
    Driven::start(&binary, &["1000", "48"])
}

fn sigkill_leaves_nothing_behind(mode: &[&str]) {
    require_root();
    let _serial = serial();
    let dir = scratch();
    let waiter = start_waiter(dir.path());
    let out = dir.path().join("profiles");
    let (mut heapprofd, _log) =
        start_heapprofd(heapprofd(&out).args(mode).args(["--pid", &waiter.pid()]));
    // The checks can fail: while heapprofd runs, its programs and links are found.
    let ours = daemon_objects(&heapprofd);
    assert!(
        !ours.programs.is_empty(),
        "no BPF program found in the daemon's fdinfo"
    );
    assert!(
        !ours.links.is_empty(),
        "no BPF link found in the daemon's fdinfo"
    );
    let daemon_pid = heapprofd.id();
    signal(&heapprofd, libc::SIGKILL);
    let _ = heapprofd.wait();
    let left = wait_released(&ours);
    assert_eq!(
        left.programs,
        Vec::<u32>::new(),
        "BPF programs left after SIGKILL"
    );
    assert_eq!(
        left.links,
        Vec::<u32>::new(),
        "BPF links left after SIGKILL"
    );
    assert_eq!(
        uprobe_events_of(daemon_pid),
        Vec::<String>::new(),
        "uprobe events left after SIGKILL"
    );
}

#[test]
fn sigkill_of_the_daemon_leaves_no_probe_behind() {
    sigkill_leaves_nothing_behind(&[]);
}

#[test]
fn sigkill_in_kernel_mode_leaves_no_program_behind() {
    sigkill_leaves_nothing_behind(&["--kernel"]);
}

#[test]
fn sigterm_writes_a_final_profile_detaches_and_exits_0() {
    require_root();
    let _serial = serial();
    let dir = scratch();
    let mut waiter = start_waiter(dir.path());
    let out = dir.path().join("profiles");
    let (mut heapprofd, log) = start_heapprofd(
        heapprofd(&out)
            .args(["--interval", "1h", "--pid"])
            .arg(waiter.pid()),
    );
    let ours = daemon_objects(&heapprofd);
    assert!(
        !ours.programs.is_empty(),
        "no BPF program found in the daemon's fdinfo"
    );
    waiter.step("done");
    signal(&heapprofd, libc::SIGTERM);
    wait_success(&mut heapprofd, &log, "SIGTERM");
    let profile = last_profile(&out);
    let work = totals(&samples(&profile), |s| {
        s.stack.get(1).is_some_and(|f| f == "work")
    });
    assert_eq!(work, [1000, 48_000, 500, 24_000], "the final profile");
    let left = wait_released(&ours);
    assert_eq!(
        left.programs,
        Vec::<u32>::new(),
        "programs left after SIGTERM"
    );
    assert_eq!(left.links, Vec::<u32>::new(), "links left after SIGTERM");
}

#[test]
fn a_target_killed_while_traced_gets_its_final_profile() {
    require_root();
    let _serial = serial();
    let dir = scratch();
    // --pid: the target's death ends heapprofd with status 0.
    let mut waiter = start_waiter(dir.path());
    let out = dir.path().join("pid-profiles");
    let (mut heapprofd, log) = start_heapprofd(
        heapprofd(&out)
            .args(["--interval", "1h", "--pid"])
            .arg(waiter.pid()),
    );
    waiter.step("done");
    signal(&waiter.child, libc::SIGKILL);
    wait_success(&mut heapprofd, &log, "--pid, target killed");
    let work = |out: &Path| {
        totals(&samples(&last_profile(out)), |s| {
            s.stack.get(1).is_some_and(|f| f == "work")
        })
    };
    assert_eq!(
        work(&out),
        [1000, 48_000, 500, 24_000],
        "in use when it was killed"
    );

    // Launch mode: the same, and heapprofd exits as a shell would report it (128 + 9).
    let binary = compile(dir.path(), "waiter", "waiter", &["-O0"]);
    let out = dir.path().join("launch-profiles");
    let (mut heapprofd, log) = start_heapprofd(
        common::heapprofd(&out)
            .args(["--interval", "1h", "--"])
            .arg(&binary)
            .args(["1000", "48"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped()),
    );
    let command_output = forward_lines(heapprofd.stdout.take().expect("stdout"));
    let mut stdin = heapprofd.stdin.take().expect("stdin");
    let next = || {
        command_output
            .recv_timeout(Duration::from_secs(30))
            .expect("the command's output")
    };
    assert_eq!(next(), "ready");
    stdin.write_all(b"go\n").expect("write");
    assert_eq!(next(), "done");
    // The binary's path is unique to this test: the process running it is the command.
    let pid = process_running(&binary).expect("the launched command's pid");
    // SAFETY: plain kill(2) of the launched command.
    unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
    let status = heapprofd.wait().expect("waiting for heapprofd");
    let lines: Vec<String> = log.try_iter().collect();
    assert_eq!(status.code(), Some(137), "{lines:?}");
    assert_eq!(
        work(&out),
        [1000, 48_000, 500, 24_000],
        "the final profile of the killed command"
    );
    drop(stdin);
}

/// The pid of the process whose first argument is `binary`.
fn process_running(binary: &Path) -> Option<u32> {
    std::fs::read_dir("/proc").ok()?.find_map(|entry| {
        let pid: u32 = entry.ok()?.file_name().to_str()?.parse().ok()?;
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
        let first = cmdline.split(|&b| b == 0).next()?;
        (first == binary.as_os_str().as_encoded_bytes()).then_some(pid)
    })
}

/// A small tmpfs, unmounted when dropped.
struct SmallFs(std::path::PathBuf);

impl SmallFs {
    fn mount(at: &Path, size: &str) -> Self {
        std::fs::create_dir_all(at).expect("mkdir");
        let status = Command::new("mount")
            .args([
                "-t",
                "tmpfs",
                "-o",
                &format!("size={size},mode=0700"),
                "tmpfs",
            ])
            .arg(at)
            .status()
            .expect("mount");
        assert!(status.success(), "mounting a tmpfs on {}", at.display());
        Self(at.to_path_buf())
    }
}

impl Drop for SmallFs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

fn profile_count(dir: &Path) -> usize {
    std::fs::read_dir(dir)
        .map(|d| {
            d.filter_map(|e| e.ok())
                .filter(|e| e.file_name().to_string_lossy().ends_with(".pb.gz"))
                .count()
        })
        .unwrap_or(0)
}

/// Waits up to a minute for `done`.
fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_full_disk_keeps_earlier_profiles_and_writing_resumes() {
    require_root();
    let _serial = serial();
    let dir = scratch();
    let mut waiter = start_waiter(dir.path());
    let out = dir.path().join("small");
    let _fs = SmallFs::mount(&out, "512k");
    // Both files beside the small filesystem, so that they can be written when it is
    // full.
    let profiles = profiles_json(&dir.path().join("small"));
    let stats = stats_file(&dir.path().join("small"));
    let (mut heapprofd, log) = start_heapprofd(
        heapprofd(&out)
            .arg("--profiles-json")
            .arg(&profiles)
            .arg("--stats-json")
            .arg(&stats)
            .args(["--interval", "200ms", "--pid"])
            .arg(waiter.pid()),
    );
    waiter.step("done");
    wait_until("a first profile", || profile_count(&out) >= 1);

    // Fill the filesystem to the last byte.
    let filler = out.join("filler");
    {
        let mut file = std::fs::File::create(&filler).expect("filler");
        let block = vec![0u8; 4096];
        while file.write_all(&block).is_ok() {}
        let _ = file.sync_all();
    }
    let (_, failed_at) = wait_for_profiles_line(&profiles, 0, "failed write", |line| {
        matches!(line, Line::WriteFailed(_))
    });
    // Every profile written before is intact, and no temp file is left behind.
    let before = read_profiles(&out);
    assert!(!before.is_empty());
    let leftovers: Vec<String> = std::fs::read_dir(&out)
        .expect("read dir")
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".tmp"))
        .collect();
    assert!(
        leftovers.is_empty(),
        "temp files left on the full disk: {leftovers:?}"
    );

    // Space returns: profiles are written again; the daemon never stopped.
    std::fs::remove_file(&filler).expect("removing the filler");
    wait_for_profiles_line(&profiles, failed_at, "profile after the failure", |line| {
        matches!(line, Line::Interval(_))
    });
    assert!(profile_count(&out) > before.len(), "no new profile on disk");
    signal(&heapprofd, libc::SIGINT);
    wait_success(&mut heapprofd, &log, "full disk");
    let failures = heapprof_daemon::profiles_file::read(&profiles)
        .expect("--profiles-json")
        .iter()
        .filter(|line| matches!(line, Line::WriteFailed(_)))
        .count();
    assert_eq!(
        read_stats(&stats)["failed_profile_writes"],
        failures,
        "the failed writes the --stats-json counts, against the --profiles-json's lines"
    );
    let work = totals(&samples(&last_profile(&out)), |s| {
        s.stack.get(1).is_some_and(|f| f == "work")
    });
    assert_eq!(
        work,
        [1000, 48_000, 500, 24_000],
        "the profile after recovery"
    );
}
