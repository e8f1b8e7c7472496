//! Kernel mode's deferred-free programs as fentry programs on arm64: the static
//! aarch64 heapprofd under Debian's arm64 6.12 kernel (bookworm-backports), booted
//! under qemu-system-aarch64 from an initramfs holding busybox and static test
//! programs. Its arm64 build has ftrace's direct calls (arm64 has them from 6.4), so
//! fentry loads there; the arm64 VM test's 6.1 kernel (arm64_vm.rs) has none and sees
//! the same frees through kprobes.
//!
//! heapprofd --kernel profiles, as in the x86-64 VM test (x86_vm.rs):
//! - tests/programs/deferred_frees.c: timerfd contexts freed with kfree_rcu() (through
//!   kvfree_call_rcu), and maple-tree nodes of exiting children freed with
//!   kmem_cache_free_bulk: both programs attached as fentry, each freeing objects by
//!   its own count, and the timerfd stacks holding at most 5% of what they allocated;
//! - tests/programs/release_all.c: epoll items and tmpfs files made and released:
//!   do_epoll_ctl's stacks hold at most 5%.
//!
//! `cargo xtask test` and `cargo xtask vm-test` provide the static binary and the
//! kernel (HEAPPROFD_AARCH64_BINARY, HEAPPROFD_ARM64_VM_ASSETS). Without them, qemu or
//! the kernel, the test fails: it never skips.

mod common;

use std::{
    path::{Path, PathBuf},
    process::Command,
    time::Duration,
};

use common::{
    kernel_vm::{expected_watches, freed_by, in_use, version, watches},
    vm::{copy, env_path, last, profiles_from, run_to_end},
    *,
};

/// What the test needs of the environment.
const NEEDS: &str = "the arm64 fentry VM test needs the static aarch64 build and Debian's arm64 \
                     6.12 kernel";

/// The kernel this test is written for: bookworm-backports' (on 6.18+ eventpoll's
/// items go through kfree_rcu's sheaves, which x86_vm.rs accounts for).
const KERNEL_VERSION: (u32, u32) = (6, 12);

/// The timerfds deferred_frees makes and closes, and the children it forks.
const TIMERFDS: i64 = 2000;
const CHILDREN: i64 = 100;

/// The epoll items release_all registers and removes.
const EPOLL_ITEMS: i64 = 500;

/// The VM's script: the two scenarios, each profile printed as base64, then power off.
const INIT: &str = r#"#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
mount -t tmpfs tmp /tmp
mount -t tracefs tracefs /sys/kernel/tracing
mount -t bpf bpf /sys/fs/bpf
mkdir -p /dev/shm && mount -t tmpfs shm /dev/shm
# busybox's default of 1024 descriptors is too few for 2000 timerfds.
ulimit -n 65536
echo "==KERNEL $(uname -r) $(uname -m)"
# Whatever hangs, the VM ends and the host sees how far it got.
(sleep 240; echo "==WATCHDOG: the scenarios took too long"; poweroff -f) &
out=/tmp/out
mkdir -p $out
/heapprofd --kernel -o $out/deferred -- /t/deferred_frees TIMERFDS CHILDREN 2>&1
echo "==STATUS deferred $?"
/heapprofd --kernel -o $out/release -- /t/release_all EPOLL_ITEMS 3 2>&1
echo "==STATUS release $?"
for f in $(find $out -name '*.pb.gz' | sort); do
    echo "==FILE $f"
    base64 $f
    echo "==END"
done
echo "==DONE"
poweroff -f
"#;

/// The one kernel of the assets' `kernels/`: its release and directory.
fn kernel(assets: &Path) -> (String, PathBuf) {
    let dir = assets.join("kernels");
    let kernels: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| {
            panic!(
                "reading {}: {e}; `cargo xtask vm-test` fetches it",
                dir.display()
            )
        })
        .map(|e| e.expect("dir entry").path())
        .collect();
    let [kernel] = kernels.as_slice() else {
        panic!("{} holds {kernels:?}, not one kernel", dir.display());
    };
    let release = kernel
        .file_name()
        .expect("a name")
        .to_string_lossy()
        .into_owned();
    (release, kernel.clone())
}

/// The initramfs: busybox, heapprofd, the static test programs, /init.
fn initramfs(dir: &Path, heapprofd: &Path, assets: &Path) -> PathBuf {
    let root = dir.join("root");
    for sub in ["bin", "t", "proc", "sys", "dev", "tmp"] {
        std::fs::create_dir_all(root.join(sub)).expect("mkdir");
    }
    copy(&assets.join("bin/busybox"), &root.join("bin/busybox"));
    copy(heapprofd, &root.join("heapprofd"));
    for name in ["deferred_frees", "release_all"] {
        let binary = compile_with(
            "aarch64-linux-gnu-gcc",
            dir,
            name,
            name,
            &["-O1", "-static"],
        );
        copy(&binary, &root.join("t").join(name));
    }
    let init = root.join("init");
    let script = INIT
        .replace("TIMERFDS", &TIMERFDS.to_string())
        .replace("CHILDREN", &CHILDREN.to_string())
        .replace("EPOLL_ITEMS", &EPOLL_ITEMS.to_string());
    std::fs::write(&init, script).expect("/init");
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

/// Boots `kernel` with `initramfs` (as arm64_vm.rs does) and returns its console output.
fn boot(kernel: &Path, initramfs: &Path) -> String {
    // The VM's own watchdog powers it off at 240 s; this bound only covers a VM that
    // does not boot at all.
    let bound = Duration::from_secs(300);
    run_to_end(
        Command::new("qemu-system-aarch64")
            // `pauth-impdef`: Debian's kernel signs return addresses, and TCG's emulation of
            // the architected QARMA algorithm makes every kernel call several times slower.
            .args(["-M", "virt", "-cpu", "max,pauth-impdef=on"])
            .args(["-smp", "2", "-m", "2048"])
            .args(["-nographic", "-no-reboot", "-nic", "none"])
            .arg("-kernel")
            .arg(kernel)
            .arg("-initrd")
            .arg(initramfs)
            .args(["-append", "console=ttyAMA0 rdinit=/init panic=-1 quiet"]),
        "qemu-system-arm",
        bound,
    )
}

#[test]
fn arm64_vm_deferred_frees_through_fentry() {
    let heapprofd = env_path("HEAPPROFD_AARCH64_BINARY", NEEDS);
    let assets = env_path("HEAPPROFD_ARM64_VM_ASSETS", NEEDS);
    let (release, kernel) = kernel(&assets);
    let kernel_version = version(&release);
    assert_eq!(
        kernel_version, KERNEL_VERSION,
        "{release}: the arm64 fentry kernel; `cargo xtask vm-test` fetches bookworm-backports'"
    );
    let dir = scratch();
    let image = initramfs(dir.path(), &heapprofd, &assets);
    let console = boot(&kernel.join("vmlinuz"), &image);
    assert!(
        console.contains(&format!("==KERNEL {release} aarch64")),
        "{release} did not boot:\n{console}"
    );
    for scenario in ["deferred", "release"] {
        assert!(
            console.contains(&format!("==STATUS {scenario} 0")),
            "{release}: scenario {scenario} failed; console:\n{console}"
        );
    }
    let profiles = profiles_from(&console, dir.path(), "");

    let deferred = last(&profiles, "deferred");
    let notes = comments(deferred);
    assert_eq!(
        watches(deferred),
        expected_watches(kernel_version, true),
        "{release}: how the deferred frees are seen, as the profile's keyed comments say: \
         {notes:?}\nconsole:\n{console}"
    );
    let freed = freed_by(deferred);
    let rcu_freed = freed.get("kvfree_call_rcu").copied().unwrap_or(0);
    assert!(
        rcu_freed >= TIMERFDS,
        "{release}: kvfree_call_rcu freed {rcu_freed} objects, expected the {TIMERFDS} \
         timerfd contexts at least: {notes:?}"
    );
    // 6.8+ copies the maple tree on fork; each child's exit frees it in bulk.
    let bulk_freed = freed.get("kmem_cache_free_bulk").copied().unwrap_or(0);
    assert!(
        bulk_freed > 0,
        "{release}: kmem_cache_free_bulk freed no object: {notes:?}"
    );
    let timerfd = in_use(deferred, |s| {
        s.stack.iter().any(|f| f.contains("timerfd_create"))
    });
    assert!(
        timerfd.0 >= TIMERFDS && timerfd.2 * 20 <= timerfd.1,
        "{release}: timerfd_create stacks: {} objects, {} of {} bytes in use after every \
         timerfd was closed",
        timerfd.0,
        timerfd.2,
        timerfd.1
    );

    let epoll = in_use(last(&profiles, "release"), |s| {
        s.stack.iter().any(|f| f == "do_epoll_ctl")
    });
    assert!(
        epoll.0 >= EPOLL_ITEMS && epoll.2 * 20 <= epoll.1,
        "{release}: do_epoll_ctl: {} allocations, {} of {} bytes in use after everything \
         was freed",
        epoll.0,
        epoll.2,
        epoll.1
    );
    eprintln!(
        "arm64 VM {release}: fentry on kvfree_call_rcu freed {rcu_freed} objects, on \
         kmem_cache_free_bulk {bulk_freed}; timerfd_create stacks {} objects / {} bytes, {} \
         in use; do_epoll_ctl {} objects / {} bytes, {} in use",
        timerfd.0, timerfd.1, timerfd.2, epoll.0, epoll.1, epoll.2
    );
}
