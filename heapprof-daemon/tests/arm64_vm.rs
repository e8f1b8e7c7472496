//! The static aarch64 heapprofd in an arm64 VM: Debian's arm64 6.1 kernel (the Rock 5B
//! BSP line) under qemu-system-aarch64, booted from an initramfs holding heapprofd,
//! busybox, the arm64 C library and the test programs built by the cross compiler.
//!
//! The VM runs every scenario twice, the second time with `/sys/kernel/btf/vmlinux`
//! hidden (an empty file bind-mounted over it), and prints each profile as base64
//! between markers; this test decodes them and checks them like the x86 tests do.
//!
//! `cargo xtask test` and `cargo xtask vm-test` provide the static binary and the VM's
//! kernel and libraries (HEAPPROFD_AARCH64_BINARY, HEAPPROFD_ARM64_VM_ASSETS).

mod common;

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    process::Command,
    time::Duration,
};

use base64::Engine as _;
use common::*;

/// The VM's script: two rounds of the scenarios, then power off.
const INIT: &str = r#"#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
mount -t tmpfs tmp /tmp
mount -t tracefs tracefs /sys/kernel/tracing
mount -t bpf bpf /sys/fs/bpf
echo "==KERNEL $(uname -r) $(uname -m)"
# Whatever hangs, the VM ends and the host sees how far it got.
(sleep 480; echo "==WATCHDOG: the scenarios took too long"; poweroff -f) &

scenarios() {
    round=$1
    out=/tmp/out/$round
    mkdir -p $out
    /heapprofd -o $out/family -- /t/family 2 100 2>&1
    echo "==STATUS $round family $?"
    /heapprofd -o $out/stacks-O0 -- /t/stacks-O0 2>&1
    echo "==STATUS $round stacks-O0 $?"
    /heapprofd -o $out/stacks-O2 -- /t/stacks-O2 2>&1
    echo "==STATUS $round stacks-O2 $?"
    # --pid: attach to a waiting process, let it work, end with it.
    rm -f /tmp/fifo && mkfifo /tmp/fifo
    /t/waiter 1000 48 < /tmp/fifo > /tmp/waiter.out &
    waiter=$!
    exec 3> /tmp/fifo
    # (without fd 3: holding the fifo open would keep the waiter from ever seeing its end)
    /heapprofd -o $out/pid --interval 200ms --pid $waiter > /tmp/pid.log 2>&1 3>&- &
    heapprofd=$!
    tries=0
    until grep -q "probes on" /tmp/pid.log || [ $tries -ge 600 ]; do sleep 0.1; tries=$((tries + 1)); done
    echo go >&3
    tries=0
    until grep -q done /tmp/waiter.out || [ $tries -ge 600 ]; do sleep 0.1; tries=$((tries + 1)); done
    exec 3>&-
    wait $heapprofd
    echo "==STATUS $round pid $?"
    cat /tmp/pid.log
    # Kernel mode, launch: the pipes workload opens 50 pipes, closes them, exits.
    printf 'open\nclose\n' | /heapprofd --kernel -o $out/kernel -- /t/pipes 50 2>&1
    echo "==STATUS $round kernel $?"
    for f in $(find $out -name '*.pb.gz' | sort); do
        echo "==FILE $f"
        base64 $f
        echo "==END"
    done
}

scenarios btf
if [ -e /sys/kernel/btf/vmlinux ]; then
    : > /tmp/empty
    mount --bind /tmp/empty /sys/kernel/btf/vmlinux
    echo "==BTF hidden: $(wc -c < /sys/kernel/btf/vmlinux) bytes"
fi
scenarios nobtf
echo "==DONE"
poweroff -f
"#;

fn env_path(name: &str) -> PathBuf {
    match std::env::var_os(name) {
        Some(path) => PathBuf::from(path),
        None => panic!(
            "{name} is not set: the arm64 VM test needs the static aarch64 build and the VM's \
             kernel; run it through `cargo xtask test` or `cargo xtask vm-test`"
        ),
    }
}

fn copy(from: &Path, to: &Path) {
    std::fs::copy(from, to)
        .unwrap_or_else(|e| panic!("copying {} to {}: {e}", from.display(), to.display()));
}

/// Builds the initramfs: busybox, the C library, heapprofd, the test programs, /init.
fn initramfs(dir: &Path, heapprofd: &Path, assets: &Path) -> PathBuf {
    let root = dir.join("root");
    for sub in ["bin", "t", "proc", "sys", "dev", "tmp"] {
        std::fs::create_dir_all(root.join(sub)).expect("mkdir");
    }
    copy(&assets.join("bin/busybox"), &root.join("bin/busybox"));
    let status = Command::new("cp")
        .arg("-a")
        .arg(assets.join("lib"))
        .arg(&root)
        .status()
        .expect("cp");
    assert!(status.success(), "copying the C library");
    copy(heapprofd, &root.join("heapprofd"));
    let cc = "aarch64-linux-gnu-gcc";
    for (source, name, flags) in [
        ("family", "family", "-O0"),
        ("stacks", "stacks-O0", "-O0"),
        ("stacks", "stacks-O2", "-O2"),
        ("waiter", "waiter", "-O0"),
        ("pipes", "pipes", "-O1"),
    ] {
        let binary = compile_with(cc, dir, source, name, &[flags]);
        copy(&binary, &root.join("t").join(name));
    }
    let init = root.join("init");
    std::fs::write(&init, INIT).expect("writing /init");
    let status = Command::new("chmod")
        .arg("755")
        .arg(&init)
        .status()
        .expect("chmod");
    assert!(status.success());
    let image = dir.join("initramfs.cpio.gz");
    let status = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "cd {} && find . | cpio -o -H newc --quiet | gzip -1 > {}",
            root.display(),
            image.display()
        ))
        .status()
        .expect("running cpio (install it: cargo xtask setup)");
    assert!(status.success(), "building the initramfs");
    image
}

/// Boots the VM and returns its console output.
fn boot(kernel: &Path, initramfs: &Path) -> String {
    let mut child = Command::new("qemu-system-aarch64")
        .args(["-M", "virt", "-cpu", "max", "-smp", "2", "-m", "2048"])
        .args(["-nographic", "-no-reboot", "-nic", "none"])
        .arg("-kernel")
        .arg(kernel)
        .arg("-initrd")
        .arg(initramfs)
        .args(["-append", "console=ttyAMA0 rdinit=/init panic=-1 quiet"])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("starting qemu-system-aarch64 (install qemu-system-arm: cargo xtask setup)");
    let stdout = child.stdout.take().expect("stdout");
    let lines = forward_lines(stdout);
    let mut console = Vec::new();
    // TCG emulation: about 20 s per round here; the VM's own watchdog powers it off at
    // 480 s, this bound only covers a VM that does not boot at all.
    let deadline = std::time::Instant::now() + Duration::from_secs(600);
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        match lines.recv_timeout(left) {
            Ok(line) => console.push(line),
            Err(_) => break,
        }
    }
    let _ = child.kill();
    let status = child.wait().expect("waiting for qemu");
    let console = console.join("\n");
    assert!(
        console.contains("==DONE"),
        "the VM did not finish (qemu {status}); its console:\n{console}"
    );
    console
}

/// Profiles printed by the VM, by path, decoded and validated.
fn profiles_from(
    console: &str,
    dir: &Path,
) -> BTreeMap<String, heapprof_daemon::pprof::proto::Profile> {
    let mut profiles = BTreeMap::new();
    let mut current: Option<(String, String)> = None;
    for line in console.lines() {
        let line = line.trim_end_matches('\r');
        if let Some(path) = line.strip_prefix("==FILE ") {
            current = Some((path.to_owned(), String::new()));
        } else if line == "==END" {
            let (path, text) = current.take().expect("==END without ==FILE");
            let bytes = base64::engine::general_purpose::STANDARD
                .decode(text.as_bytes())
                .unwrap_or_else(|e| panic!("{path}: bad base64 from the VM: {e}"));
            let local = dir.join(path.trim_start_matches('/').replace('/', "_"));
            std::fs::write(&local, bytes).expect("writing a profile");
            profiles.insert(path, decode(&local));
        } else if let Some((_, text)) = current.as_mut() {
            text.push_str(line.trim());
        }
    }
    profiles
}

/// The last profile of one scenario of one round.
fn last<'a>(
    profiles: &'a BTreeMap<String, heapprof_daemon::pprof::proto::Profile>,
    round: &str,
    scenario: &str,
) -> &'a heapprof_daemon::pprof::proto::Profile {
    let prefix = format!("/tmp/out/{round}/{scenario}/");
    profiles
        .iter()
        .rfind(|(path, _)| path.starts_with(&prefix))
        .map(|(_, p)| p)
        .unwrap_or_else(|| panic!("no profile of {round}/{scenario}"))
}

fn check_round(profiles: &BTreeMap<String, heapprof_daemon::pprof::proto::Profile>, round: &str) {
    // Exact totals of every family function (tests/exact.rs has the derivation).
    let family = samples(last(profiles, round, "family"));
    let (threads, iterations, page) = (2i64, 100i64, 4096i64);
    let calls = threads * iterations;
    let bytes_per_thread: i64 = (0..iterations)
        .map(|i| (16 + i) + 4 * (8 + i) + 32 + (64 + i) + 30 + 100 + 128 + 48 + 200 + page)
        .sum();
    let ours = |s: &Sample| s.stack.iter().any(|f| f == "exercise");
    assert_eq!(
        totals(&family, ours),
        [
            10 * calls,
            threads * bytes_per_thread,
            2 * calls,
            calls * (200 + page)
        ],
        "{round}: family totals (allocated objects/bytes, in use objects/bytes)"
    );

    // The three stacks of main/a/b, the caller frame included.
    for scenario in ["stacks-O0", "stacks-O2"] {
        let (stacks, _) = abc_stacks(&samples(last(profiles, round, scenario)));
        assert_eq!(stacks, expected_abc_stacks(), "{round}: {scenario}");
    }

    // --pid: work() made 1000 allocations of 48 bytes and freed every other one.
    let pid = samples(last(profiles, round, "pid"));
    assert_eq!(
        totals(&pid, |s| s.stack.get(1).is_some_and(|f| f == "work")),
        [1000, 48_000, 500, 24_000],
        "{round}: --pid"
    );

    // Kernel mode: the pipes' kernel stacks, named.
    let kernel = last(profiles, round, "kernel");
    let kernel_samples = samples(kernel);
    let pipe_allocations: i64 = kernel
        .sample
        .iter()
        .zip(&kernel_samples)
        .filter(|(_, s)| s.stack.iter().any(|f| f.contains("pipe")))
        .map(|(raw, _)| raw.value[0])
        .sum();
    assert!(
        pipe_allocations >= 6 * 50,
        "{round}: kernel allocations in pipe stacks: {pipe_allocations}"
    );
    assert!(
        kernel_samples
            .iter()
            .flat_map(|s| &s.stack)
            .all(|f| !f.starts_with("0x") && !f.starts_with("__traceiter_")),
        "{round}: kernel frames are named and start below the tracepoint"
    );
}

#[test]
fn arm64_vm_with_and_without_btf() {
    let heapprofd = env_path("HEAPPROFD_AARCH64_BINARY");
    let assets = env_path("HEAPPROFD_ARM64_VM_ASSETS");
    let dir = scratch();
    let image = initramfs(dir.path(), &heapprofd, &assets);
    let console = boot(&assets.join("vmlinuz"), &image);
    let statuses: Vec<&str> = console
        .lines()
        .filter(|l| l.starts_with("==STATUS"))
        .collect();
    assert_eq!(
        statuses.len(),
        10,
        "scenario statuses: {statuses:?}\n{console}"
    );
    for status in &statuses {
        assert!(
            status.trim_end().ends_with(" 0"),
            "a scenario failed in the VM: {status}; console:\n{console}"
        );
    }
    assert!(
        console.contains("==BTF hidden: 0 bytes"),
        "BTF was not hidden for the second round:\n{console}"
    );
    let profiles = profiles_from(&console, dir.path());
    for round in ["btf", "nobtf"] {
        check_round(&profiles, round);
    }
    eprintln!(
        "arm64 VM: {} profiles checked; {}",
        profiles.len(),
        console
            .lines()
            .find(|l| l.starts_with("==KERNEL"))
            .unwrap_or("")
    );
}
