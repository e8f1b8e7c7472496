//! Faults: signals, SIGKILL of the daemon, a full output filesystem. heapprofd must
//! never leave the system worse than it found it nor lose a profile it wrote.
//!
//! These tests look at system-wide state (loaded BPF programs), so they run one at a
//! time (`SERIAL`); other test binaries run after this one, never beside it. They judge
//! only the programs their own daemon loaded (those of heapprofd's names that were
//! not loaded before it started): other BPF tools, another heapprofd among them, may
//! run on the machine.

mod common;

use std::{
    io::Write as _,
    path::Path,
    process::Command,
    sync::Mutex,
    time::{Duration, Instant},
};

use common::*;

static SERIAL: Mutex<()> = Mutex::new(());

/// Names of heapprofd's BPF programs as the kernel lists them (truncated to 15 characters).
const PROGRAM_NAMES: [&str; 14] = [
    "entry",
    "thread_switch",
    "thread_futex",
    "preload_report",
    "entry_multi",
    "alloc_return",
    "alloc_return_mu",
    "loader_state",
    "loader_state_mu",
    "process_exec",
    "thread_exit",
    "kmalloc",
    "kmem_cache_allo",
    "kfree",
];

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

/// The IDs of the BPF programs loaded now.
fn loaded_ids() -> Vec<u32> {
    loaded_programs().into_iter().map(|(id, _)| id).collect()
}

/// The programs of heapprofd's names loaded since `before` (the IDs loaded then):
/// the daemon's own, whatever other BPF tools run on the machine.
fn programs_since(before: &[u32]) -> Vec<u32> {
    loaded_programs()
        .into_iter()
        .filter(|(id, name)| !before.contains(id) && PROGRAM_NAMES.contains(&name.as_str()))
        .map(|(id, _)| id)
        .collect()
}

/// The programs of `ids` that links still use (`ID: TYPE  prog PROG_ID`).
fn linked(ids: &[u32]) -> Vec<u32> {
    bpftool("link")
        .lines()
        .filter_map(|line| {
            let words: Vec<&str> = line.split_whitespace().collect();
            let at = words.iter().position(|w| *w == "prog")?;
            words.get(at + 1)?.parse().ok()
        })
        .filter(|id| ids.contains(id))
        .collect()
}

/// Waits (up to 20 s: program teardown is asynchronous) until none of the programs
/// `ids` is loaded; returns those left.
fn wait_unloaded(ids: &[u32]) -> Vec<u32> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let loaded: Vec<u32> = loaded_ids();
        let left: Vec<u32> = ids
            .iter()
            .copied()
            .filter(|id| loaded.contains(id))
            .collect();
        if left.is_empty() || Instant::now() > deadline {
            return left;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn uprobe_events() -> String {
    std::fs::read_to_string("/sys/kernel/tracing/uprobe_events").unwrap_or_default()
}

/// The waiter program (tests/programs/waiter.c), ended when dropped.
fn start_waiter(dir: &Path) -> Driven {
    let binary = compile(dir, "waiter", "waiter", &["-O0"]);
    Driven::start(&binary, &["1000", "48"])
}

fn sigkill_leaves_nothing_behind(mode: &[&str]) {
    require_root();
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let before: Vec<u32> = loaded_ids();
    let events_before = uprobe_events();
    let dir = scratch();
    let waiter = start_waiter(dir.path());
    let out = dir.path().join("profiles");
    let (mut heapprofd, _log) =
        start_heapprofd(heapprofd(&out).args(mode).args(["--pid", &waiter.pid()]));
    // The checks can fail: while heapprofd runs, its programs are listed, and linked.
    let ours = programs_since(&before);
    assert!(
        !ours.is_empty(),
        "bpftool does not list heapprofd's programs"
    );
    assert!(
        !linked(&ours).is_empty(),
        "bpftool does not list heapprofd's links"
    );
    signal(&heapprofd, libc::SIGKILL);
    let _ = heapprofd.wait();
    assert_eq!(
        wait_unloaded(&ours),
        Vec::<u32>::new(),
        "BPF programs left after SIGKILL"
    );
    assert_eq!(linked(&ours), Vec::<u32>::new(), "links left after SIGKILL");
    assert_eq!(uprobe_events(), events_before, "uprobe_events changed");
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
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let before: Vec<u32> = loaded_ids();
    let dir = scratch();
    let mut waiter = start_waiter(dir.path());
    let out = dir.path().join("profiles");
    let (mut heapprofd, log) = start_heapprofd(
        heapprofd(&out)
            .args(["--interval", "1h", "--pid"])
            .arg(waiter.pid()),
    );
    let ours = programs_since(&before);
    assert!(
        !ours.is_empty(),
        "bpftool does not list heapprofd's programs"
    );
    waiter.step("done");
    signal(&heapprofd, libc::SIGTERM);
    wait_success(&mut heapprofd, &log, "SIGTERM");
    let profile = last_profile(&out);
    let work = totals(&samples(&profile), |s| {
        s.stack.get(1).is_some_and(|f| f == "work")
    });
    assert_eq!(work, [1000, 48_000, 500, 24_000], "the final profile");
    assert_eq!(
        wait_unloaded(&ours),
        Vec::<u32>::new(),
        "programs left after SIGTERM"
    );
}

#[test]
fn a_target_killed_while_traced_gets_its_final_profile() {
    require_root();
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
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
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = scratch();
    let mut waiter = start_waiter(dir.path());
    let out = dir.path().join("small");
    let _fs = SmallFs::mount(&out, "512k");
    let (mut heapprofd, log) = start_heapprofd(
        heapprofd(&out)
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
    let mut errors = 0;
    wait_until("an error about the full disk", || {
        while let Ok(line) = log.try_recv() {
            if line.contains("cannot write a profile") {
                errors += 1;
            }
        }
        errors > 0
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
    let count = before.len();
    wait_until("a profile after space returned", || {
        profile_count(&out) > count
    });
    signal(&heapprofd, libc::SIGINT);
    wait_success(&mut heapprofd, &log, "full disk");
    let work = totals(&samples(&last_profile(&out)), |s| {
        s.stack.get(1).is_some_and(|f| f == "work")
    });
    assert_eq!(
        work,
        [1000, 48_000, 500, 24_000],
        "the profile after recovery"
    );
}
