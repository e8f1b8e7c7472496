//! Kernel mode on the kernels people run: the static x86-64 heapprofd under Debian's
//! own amd64 kernels (bullseye's 5.10, bookworm's 6.1, bookworm-backports' 6.12,
//! and trixie-backports' newest, 6.18 or later),
//! each booted under qemu-system-x86_64 (TCG) from an initramfs holding heapprofd,
//! busybox, the kernel's `brd.ko` and static test programs.
//!
//! In each kernel, heapprofd --kernel profiles:
//! - tests/programs/deferred_frees.c: timerfd contexts freed with kfree_rcu()
//!   (through kvfree_call_rcu) and, on 6.1+, maple-tree nodes of exiting processes
//!   freed with kmem_cache_free_bulk. The fentry programs must have loaded (their
//!   reason is named where one cannot: bpf_loop on 5.10), must have freed objects
//!   (their own per-CPU count, from the profile's comments keyed by stable names),
//!   and the timerfd sites
//!   must hold at most 5% of what they allocated;
//! - the same program at `--kernel --sample-rate 4096`: its scaled total within 10%
//!   of the exact run's, its sampled timerfd objects freed;
//! - tests/programs/release_all.c: epoll items and tmpfs files made and released
//!   (through call_rcu + kmem_cache_free, which the tracepoint sees, before 6.18;
//!   from 6.18 through kfree_rcu, whose sheaves path starts in kvfree_call_rcu,
//!   whose program must count the items): do_epoll_ctl holds at most 5%, less the
//!   slab allocator's own sheaves, which it allocates on that path and keeps;
//! - a write to the RAM disk (`insmod brd.ko` from busybox), attributed to `[brd]`;
//! - deferred_frees again with `/sys/kernel/btf/vmlinux` hidden (an empty file
//!   bind-mounted over it): the kprobe programs must free what fentry did.
//!
//! In 6.12 alone, the boot that attaches the bpftrace disk, heapprofd's counts of a
//! pipe workload against bpftrace's (x86_vm/bpftrace_agreement.rs).
//!
//! In 6.12 alone (the arm64 VM test covers 6.1), user mode too, on the host's C library
//! copied into the initramfs: tests/programs/family.c launched (the preload library),
//! its exact totals, the same sampled at one byte on the probes (`--preload off`: 6.12
//! refuses uprobe session links, which heapprofd learns from the errno), and `--pid` on
//! tests/programs/waiter.c, joined in-process, its exact counts.
//!
//! `cargo xtask test` and `cargo xtask vm-test` provide the static binary and the
//! kernels (HEAPPROFD_X86_64_BINARY, HEAPPROFD_X86_VM_ASSETS). Without them, qemu
//! or a kernel, the test fails: it never skips.

// A crate root looks for its modules beside it: this one lives in x86_vm/.
#[path = "x86_vm/bpftrace_agreement.rs"]
mod bpftrace_agreement;
mod common;

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    process::Command,
    time::Duration,
};

use common::{
    bpftrace,
    kernel_vm::{expected_watches, freed_by, in_use, version, watches},
    vm::{copy, env_path, last, profiles_from, run_to_end},
    *,
};
use heapprof_daemon::{pprof::proto::Profile, report::losses};

/// What the test needs of the environment.
const NEEDS: &str = "the x86-64 VM test needs the static x86-64 build and Debian's amd64 kernels";

/// The timerfds deferred_frees makes and closes.
const TIMERFDS: i64 = 2000;
/// The processes it forks, each mapping 256 pages and exiting. From 6.8 a fork
/// copies the maple tree of the VMAs (`__mt_dup`), one node of it from
/// kmem_cache_alloc, and the child's exit frees the tree with kmem_cache_free_bulk:
/// 6.12 frees about one tracked object per child that way (110 for 100 children).
/// On 6.1 such frees are rare and vary (0 to 29 per run): most of the tree's nodes
/// come from kmem_cache_alloc_bulk, which has no tracepoint, so the test only
/// requires the program to be attached there.
const CHILDREN: i64 = 100;

/// The first kernel whose `kfree_rcu()` fills per-CPU RCU sheaves (`__kfree_rcu_sheaf`,
/// called by `kvfree_call_rcu`), and whose eventpoll frees its items with it.
const SHEAVES: (u32, u32) = (6, 18);

/// Whether a frame is the slab allocator's own sheaf work (it allocates sheaves, kept
/// in its per-CPU and per-node caches, while objects are allocated and freed).
fn sheaf_frame(frame: &str) -> bool {
    frame.contains("sheaf") || frame.starts_with("__pcs_")
}

/// The first kernel whose fork copies the maple tree (`__mt_dup`).
const TREE_COPIED_ON_FORK: (u32, u32) = (6, 8);

/// `--kernel --sample-rate` of the sampled run of deferred_frees: about 2500 samples
/// of its 10-12 MB, so its scaled total is within 10% of the exact run's (five
/// standard deviations of the sampling error).
const SAMPLE_RATE: i64 = 4096;

/// The kernel whose boot attaches the bpftrace disk (its modules come with the assets).
const BPFTRACE_VERSION: (u32, u32) = (6, 12);

/// The kernel (`uname -r` prefix) whose boot also runs the user-mode scenarios.
const USER_MODE_KERNEL: &str = "6.12";
/// Its (major, minor).
const USER_MODE_VERSION: (u32, u32) = (6, 12);

/// The VM's script: the scenarios, each profile printed as base64, then power off.
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
insmod /modules/brd.ko rd_nr=1 rd_size=8192
echo "==INSMOD brd $?"
# Whatever hangs, the VM ends and the host sees how far it got.
(sleep 240; echo "==WATCHDOG: the scenarios took too long"; ps; cat /tmp/agree.log /tmp/bpftrace.err 2>/dev/null; poweroff -f) &
out=/tmp/out
mkdir -p $out
/heapprofd --kernel -o $out/deferred -- /t/deferred_frees TIMERFDS CHILDREN 2>&1
echo "==STATUS deferred $?"
/heapprofd --kernel --sample-rate SAMPLE_RATE -o $out/sampled -- /t/deferred_frees TIMERFDS CHILDREN 2>&1
echo "==STATUS sampled $?"
/heapprofd --kernel -o $out/release -- /t/release_all 500 3 2>&1
echo "==STATUS release $?"
/heapprofd --kernel --pages -o $out/brd -- dd if=/dev/urandom of=/dev/ram0 bs=64k count=32 conv=fsync 2>&1
echo "==STATUS brd $?"
# User mode, in one kernel (the arm64 VM test covers 6.1): a launched program through
# the preload library, and --pid on a waiting one.
case "$(uname -r)" in
USER_MODE_KERNEL*)
    /heapprofd -o $out/family -- /t/family 2 100 2>&1
    echo "==STATUS family $?"
    # Sampled on the probes (every allocation is sampled at one byte): 6.12 has no
    # uprobe session links (6.13+); heapprofd must learn it from the kernel's errno
    # and use the entry and return links.
    /heapprofd --sample-rate 1 --preload off -o $out/probes --stats-json /tmp/probes.json -- /t/family 2 100 2>&1
    echo "==STATUS probes $?"
    echo "==PROBESSTATS"
    cat /tmp/probes.json
    echo "==PROBESSTATS-END"
    rm -f /tmp/fifo && mkfifo /tmp/fifo
    /t/waiter 1000 48 < /tmp/fifo > /tmp/waiter.out &
    waiter=$!
    exec 3> /tmp/fifo
    # (without fd 3: holding the fifo open would keep the waiter from ever seeing its end)
    rm -f /tmp/pid.ready
    /heapprofd -o $out/pid --interval 200ms --inject auto --ready-file /tmp/pid.ready --stats-json /tmp/pid.json --pid $waiter > /tmp/pid.log 2>&1 3>&- &
    heapprofd=$!
    tries=0
    until [ -e /tmp/pid.ready ] || [ $tries -ge 600 ]; do sleep 0.1; tries=$((tries + 1)); done
    echo go >&3
    tries=0
    until grep -q done /tmp/waiter.out || [ $tries -ge 600 ]; do sleep 0.1; tries=$((tries + 1)); done
    exec 3>&-
    wait $heapprofd
    echo "==STATUS pid $?"
    echo "==PIDLOG"
    cat /tmp/pid.log
    echo "==PIDLOG-END"
    echo "==PIDSTATS"
    cat /tmp/pid.json
    echo "==PIDSTATS-END"
    ;;
esac
# heapprofd's counts against bpftrace's (x86_vm/bpftrace_agreement.rs).
BPFTRACE_AGREEMENT
# Without BTF (an empty file over it): the deferred frees through kprobes.
: > /tmp/empty
mount --bind /tmp/empty /sys/kernel/btf/vmlinux
echo "==BTF hidden: $(wc -c < /sys/kernel/btf/vmlinux) bytes"
/heapprofd --kernel -o $out/nobtf -- /t/deferred_frees TIMERFDS CHILDREN 2>&1
echo "==STATUS nobtf $?"
for f in $(find $out -name '*.pb.gz' | sort); do
    echo "==FILE $f"
    base64 $f
    echo "==END"
done
echo "==DONE"
poweroff -f
"#;

/// The kernels of the assets, by release (`uname -r`), oldest first.
fn kernels(assets: &Path) -> Vec<(String, PathBuf)> {
    let dir = assets.join("kernels");
    let mut kernels: Vec<(String, PathBuf)> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
        .map(|e| e.expect("dir entry").path())
        .map(|p| {
            (
                p.file_name().expect("name").to_string_lossy().into_owned(),
                p,
            )
        })
        .collect();
    kernels.sort_by_key(|(release, _)| version(release));
    kernels
}

/// The initramfs shared by every kernel but for its `brd.ko`: the root without the
/// module, whose programs are built once.
fn root(dir: &Path, heapprofd: &Path, assets: &Path) -> PathBuf {
    let root = dir.join("root");
    for sub in ["bin", "t", "modules", "proc", "sys", "dev", "tmp", "mnt"] {
        std::fs::create_dir_all(root.join(sub)).expect("mkdir");
    }
    copy(&assets.join("bin/busybox"), &root.join("bin/busybox"));
    copy(heapprofd, &root.join("heapprofd"));
    // Static: the VM has no C library.
    for name in ["deferred_frees", "release_all", "pipes"] {
        let binary = compile(dir, name, name, &["-O1", "-static"]);
        copy(&binary, &root.join("t").join(name));
    }
    // User mode: dynamically linked programs (the preload library needs a loader),
    // with the host's C library (Debian's, as on the machines the static build runs on).
    for (source, name, flags) in [
        ("family", "family", &["-O0", "-pthread"][..]),
        ("waiter", "waiter", &["-O0"][..]),
    ] {
        let binary = compile(dir, source, name, flags);
        copy_libraries(&binary, &root);
        copy(&binary, &root.join("t").join(name));
    }
    std::fs::write(root.join("t/count.bt"), bpftrace::SCRIPT).expect("t/count.bt");
    let init = root.join("init");
    let agreement =
        bpftrace_agreement::SCRIPT.replace("PIPES", &bpftrace_agreement::PIPES.to_string());
    let script = INIT
        .replace("BPFTRACE_AGREEMENT", &agreement)
        .replace("USER_MODE_KERNEL", USER_MODE_KERNEL)
        .replace("TIMERFDS", &TIMERFDS.to_string())
        .replace("CHILDREN", &CHILDREN.to_string())
        .replace("SAMPLE_RATE", &SAMPLE_RATE.to_string());
    std::fs::write(&init, script).expect("/init");
    let status = Command::new("chmod")
        .arg("755")
        .arg(&init)
        .status()
        .expect("chmod");
    assert!(status.success());
    root
}

/// Copies the shared libraries `binary` needs (`ldd`), its loader included, into
/// `root` at their own paths.
fn copy_libraries(binary: &Path, root: &Path) {
    let output = Command::new("ldd")
        .arg(binary)
        .output()
        .expect("running ldd");
    assert!(output.status.success(), "ldd {}", binary.display());
    for line in String::from_utf8_lossy(&output.stdout).lines() {
        let path = match line.split_once("=>") {
            Some((_, right)) => right.split_whitespace().next(),
            None => line.split_whitespace().next(),
        };
        let Some(path) = path.filter(|p| p.starts_with('/')) else {
            continue;
        };
        let to = root.join(path.trim_start_matches('/'));
        std::fs::create_dir_all(to.parent().expect("a library's directory")).expect("mkdir");
        copy(Path::new(path), &to);
    }
}

/// The root with `kernel`'s modules, packed as a gzipped cpio archive: its `brd.ko`
/// and, for the kernel that reads the bpftrace disk, the modules that read it (in
/// `modules/disk/`, with the file `order` naming them).
fn initramfs(dir: &Path, root: &Path, kernel: &Path, release: &str) -> PathBuf {
    copy(&kernel.join("brd.ko"), &root.join("modules/brd.ko"));
    let disk_modules = root.join("modules/disk");
    let _ = std::fs::remove_dir_all(&disk_modules);
    if let Ok(entries) = std::fs::read_dir(kernel.join("disk")) {
        std::fs::create_dir_all(&disk_modules).expect("mkdir");
        for entry in entries {
            let from = entry.expect("dir entry").path();
            copy(&from, &disk_modules.join(from.file_name().expect("a name")));
        }
    }
    let image = dir.join(format!("initramfs-{release}.cpio.gz"));
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

/// Boots `kernel` with `initramfs` (and `disk` attached read-only as virtio-blk) and
/// returns its console output.
fn boot(kernel: &Path, initramfs: &Path, disk: Option<&Path>) -> String {
    let mut qemu = Command::new("qemu-system-x86_64");
    if let Some(image) = disk {
        qemu.arg("-drive").arg(format!(
            "file={},if=virtio,format=raw,readonly=on",
            image.display()
        ));
    }
    // The VM's own watchdog powers it off at 240 s; this bound only covers a VM that
    // does not boot at all.
    let bound = Duration::from_secs(300);
    run_to_end(
        qemu
            // KVM is not used: TCG runs Debian's kernels everywhere, CI's machines included.
            // One host thread for both vCPUs (`thread=single`): with a thread each, a vCPU
            // can run code another one has just live-patched (the kernel rewrites static
            // keys and static calls when heapprofd attaches to or detaches from the kmem
            // tracepoints), and 6.12 and 7.3 then die of an `int3` Oops in kfree or
            // __schedule, in about one boot of five here and within a few attaches under
            // load. One thread sees every write at once.
            .args(["-accel", "tcg,thread=single", "-cpu", "max"])
            .args(["-m", "2048", "-smp", "2"])
            .args(["-nographic", "-no-reboot", "-nic", "none"])
            .arg("-kernel")
            .arg(kernel)
            .arg("-initrd")
            .arg(initramfs)
            .args(["-append", "console=ttyS0 rdinit=/init panic=-1 quiet"]),
        "qemu-system-x86",
        bound,
    )
}

/// The figures of one kernel, for the test's summary.
struct Figures {
    release: String,
    rcu_freed: i64,
    bulk_freed: Option<i64>,
    timerfd: (i64, i64, i64),
    children: (i64, i64, i64),
    epoll: (i64, i64, i64),
    sampled: (i64, i64),
    kprobes: (i64, Option<i64>),
    brd_samples: usize,
}

/// Checks the profiles of one kernel.
fn check_kernel(release: &str, console: &str, profiles: &BTreeMap<String, Profile>) -> Figures {
    let (major, minor) = version(release);
    let new_enough = (major, minor) >= (5, 17);
    let deferred = last(profiles, "deferred");
    let notes = comments(deferred);
    assert_eq!(
        watches(deferred),
        expected_watches((major, minor), true),
        "{release}: how the deferred frees are seen, as the profile's keyed comments \
         say: {notes:?}\nconsole:\n{console}"
    );
    // Where the bulk program is missing (it needs bpf_loop), the profile says its
    // frees are undercounted (where every path is seen, the watches above say so).
    if !new_enough {
        assert!(
            losses::frees_undercounted(&notes),
            "{release}: the missing bulk program is not said: {notes:?}"
        );
    }
    let freed = freed_by(deferred);
    let rcu_freed = freed.get("kvfree_call_rcu").copied().unwrap_or(0);
    assert!(
        rcu_freed >= TIMERFDS,
        "{release}: kvfree_call_rcu freed {rcu_freed} objects, expected the {TIMERFDS} \
         timerfd contexts at least: {notes:?}"
    );
    let bulk_freed = freed.get("kmem_cache_free_bulk").copied();
    if (major, minor) >= TREE_COPIED_ON_FORK {
        assert!(
            bulk_freed.is_some_and(|n| n > 0),
            "{release}: kmem_cache_free_bulk freed no object: {notes:?}"
        );
    }
    // Every timerfd context was released: at most 5% of its site's bytes in use.
    let timerfd = in_use(deferred, |s| {
        s.stack.iter().any(|f| f.contains("timerfd_create"))
    });
    assert!(
        timerfd.0 >= TIMERFDS,
        "{release}: {} allocations in timerfd_create stacks",
        timerfd.0
    );
    assert!(
        timerfd.2 * 20 <= timerfd.1,
        "{release}: timerfd_create stacks hold {} of {} bytes after every timerfd was closed",
        timerfd.2,
        timerfd.1
    );

    let release_profile = last(profiles, "release");
    let epoll = in_use(release_profile, |s| {
        s.stack.iter().any(|f| f == "do_epoll_ctl") && !s.stack.iter().any(|f| sheaf_frame(f))
    });
    if (major, minor) >= SHEAVES {
        // The items went through kfree_rcu's sheaves: kvfree_call_rcu freed them.
        let rcu = freed_by(release_profile)
            .get("kvfree_call_rcu")
            .copied()
            .unwrap_or(0);
        assert!(
            rcu >= 500,
            "{release}: kvfree_call_rcu freed {rcu} of release_all's objects, expected its \
             500 epoll items at least: {:?}",
            comments(release_profile)
        );
    }
    assert!(epoll.0 >= 500, "{release}: epoll allocations {}", epoll.0);
    assert!(
        epoll.2 * 20 <= epoll.1,
        "{release}: do_epoll_ctl holds {} of {} bytes after everything was freed",
        epoll.2,
        epoll.1
    );

    // The children's own allocations (their mappings' VMAs and maple-tree nodes):
    // every child has exited.
    let parent = console
        .lines()
        .find_map(|l| l.trim_end_matches('\r').strip_prefix("parent "))
        .unwrap_or_else(|| panic!("{release}: deferred_frees printed no pid:\n{console}"))
        .to_owned();
    let children = in_use(deferred, |s| {
        s.labels.get("pid").is_some_and(|pid| *pid != parent)
    });
    assert!(
        children.0 > 0 && children.2 * 20 <= children.1,
        "{release}: the exited children hold {} of {} bytes",
        children.2,
        children.1
    );
    let sampled = check_sampled(deferred, last(profiles, "sampled"), release);
    let kprobes = check_kprobes(last(profiles, "nobtf"), release);

    let brd_samples = check_module(last(profiles, "brd"), release);
    Figures {
        release: release.to_owned(),
        rcu_freed,
        bulk_freed,
        timerfd,
        children,
        epoll,
        sampled,
        kprobes,
        brd_samples,
    }
}

/// The deferred_frees run with BTF hidden: the kprobe programs in place of fentry
/// freed the timerfd contexts (and, on 6.8+, objects in bulk). Returns their counts.
fn check_kprobes(profile: &Profile, release: &str) -> (i64, Option<i64>) {
    let (major, minor) = version(release);
    let notes = comments(profile);
    assert_eq!(
        watches(profile),
        expected_watches((major, minor), false),
        "{release}, BTF hidden: {notes:?}"
    );
    let freed = freed_by(profile);
    let rcu = freed.get("kvfree_call_rcu").copied().unwrap_or(0);
    assert!(
        rcu >= TIMERFDS,
        "{release}, BTF hidden: the kvfree_call_rcu kprobe freed {rcu} objects: {notes:?}"
    );
    let bulk = freed.get("kmem_cache_free_bulk").copied();
    if (major, minor) >= TREE_COPIED_ON_FORK {
        assert!(
            bulk.is_some_and(|n| n > 0),
            "{release}, BTF hidden: the kmem_cache_free_bulk kprobe freed nothing: {notes:?}"
        );
    }
    let (objects, bytes, inuse) = in_use(profile, |s| {
        s.stack.iter().any(|f| f.contains("timerfd_create"))
    });
    assert!(
        objects >= TIMERFDS && inuse * 20 <= bytes,
        "{release}, BTF hidden: timerfd_create stacks hold {inuse} of {bytes} bytes"
    );
    (rcu, bulk)
}

/// The sampled run of deferred_frees against the exact one: a scaled total within
/// 10% of the exact total, sampled timerfd objects freed as the exact ones were, and
/// the profile saying it is sampled. Returns the two totals.
fn check_sampled(exact: &Profile, sampled: &Profile, release: &str) -> (i64, i64) {
    // The profile says it is sampled, and at what rate, in pprof's own field.
    assert_eq!(
        sampled.period, SAMPLE_RATE,
        "{release}: the sampled profile's period"
    );
    assert_eq!(
        exact.period, 1,
        "{release}: the exact profile's period (every allocation)"
    );
    let all = |_: &Sample| true;
    let exact_total = in_use(exact, all).1;
    let sampled_total = in_use(sampled, all).1;
    assert!(
        (sampled_total - exact_total).abs() * 10 <= exact_total,
        "{release}: sampled at {SAMPLE_RATE} bytes, {sampled_total} bytes allocated \
         against {exact_total} exact"
    );
    let (objects, bytes, inuse) = in_use(sampled, |s| {
        s.stack.iter().any(|f| f.contains("timerfd_create"))
    });
    assert!(
        objects > 0 && inuse * 20 <= bytes,
        "{release}: sampled timerfd_create stacks hold {inuse} of {bytes} bytes"
    );
    (exact_total, sampled_total)
}

/// User mode (in the kernel named by [`USER_MODE_VERSION`]): the launched malloc-family
/// program's exact totals through the preload library, and `--pid` joining a waiting
/// program in-process with its exact counts.
fn check_user_mode(release: &str, console: &str, profiles: &BTreeMap<String, Profile>) {
    for scenario in ["family", "probes", "pid"] {
        assert!(
            console.contains(&format!("==STATUS {scenario} 0")),
            "{release}: user-mode scenario {scenario} failed; console:\n{console}"
        );
    }
    let family = samples(last(profiles, "family"));
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
        "{release}: family totals (allocated objects/bytes, in use objects/bytes)"
    );
    // Sampled at one byte on the probes: every allocation is picked, each scaled by
    // 1 / (1 - e^-size), which is 1 to within 1e-6 here. 6.12 refuses the session
    // link (EINVAL), which heapprofd must say once and then work without.
    let probes_stats = json_section(console, "PROBESSTATS");
    assert!(
        probes_stats["session_links"].is_boolean(),
        "{release}: the probes' run did not try session links: {probes_stats}"
    );
    let probes = samples(last(profiles, "probes"));
    let sampled = totals(&probes, ours);
    let exact = totals(&family, ours);
    for (name, (sampled, exact)) in [
        "alloc objects",
        "alloc bytes",
        "in-use objects",
        "in-use bytes",
    ]
    .iter()
    .zip(sampled.iter().zip(exact.iter()))
    {
        assert!(
            (sampled - exact).abs() * 100 <= *exact,
            "{release}: sampled at one byte on the probes, {name} {sampled} against {exact}"
        );
    }
    let pid_log = console
        .split_once("==PIDLOG")
        .and_then(|(_, after)| after.split_once("==PIDLOG-END"))
        .map(|(log, _)| log)
        .unwrap_or_default();
    // How it joined, as its --stats-json says.
    let pid_stats = json_section(console, "PIDSTATS");
    assert_eq!(
        pid_stats["joined"]["how"], "injected",
        "{release}: --pid did not join the waiter in-process:\n{pid_stats}\n{pid_log}"
    );
    // work() made 1000 allocations of 48 bytes and freed every other one.
    let pid = samples(last(profiles, "pid"));
    assert_eq!(
        totals(&pid, |s| s.stack.get(1).is_some_and(|f| f == "work")),
        [1000, 48_000, 500, 24_000],
        "{release}: --pid on the waiter"
    );
}

/// The JSON the VM printed between `==NAME` and `==NAME-END` (a `--stats-json`).
fn json_section(console: &str, name: &str) -> serde_json::Value {
    let text = console
        .split_once(&format!("=={name}\n"))
        .or_else(|| console.split_once(&format!("=={name}\r\n")))
        .and_then(|(_, after)| after.split_once(&format!("=={name}-END")))
        .map(|(section, _)| section)
        .unwrap_or_else(|| panic!("the VM printed no {name}:\n{console}"));
    serde_json::from_str(text).unwrap_or_else(|e| panic!("{name} is not JSON ({e}): {text}"))
}

/// Writes to the RAM disk: page samples whose stacks pass through the brd module,
/// named as its frames (`brd_*`) and labelled `module=[brd]`; returns how many.
fn check_module(profile: &Profile, release: &str) -> usize {
    let through_brd: Vec<Sample> = samples(profile)
        .into_iter()
        .filter(|s| s.labels.get("module").is_some_and(|m| m == "[brd]"))
        .collect();
    assert!(
        !through_brd.is_empty(),
        "{release}: no sample labelled module=[brd]"
    );
    for sample in &through_brd {
        assert!(
            sample.stack.iter().any(|f| f.starts_with("brd_")),
            "{release}: a [brd] sample without a brd frame: {:?}",
            sample.stack
        );
    }
    assert!(
        through_brd
            .iter()
            .any(|s| s.stack.first().is_some_and(|f| f == "alloc_pages")),
        "{release}: brd allocated no pages: {through_brd:?}"
    );
    through_brd.len()
}

#[test]
fn x86_vm_kernel_mode_on_debian_kernels() {
    let heapprofd = env_path("HEAPPROFD_X86_64_BINARY", NEEDS);
    let assets = env_path("HEAPPROFD_X86_VM_ASSETS", NEEDS);
    let kernels = kernels(&assets);
    let versions: Vec<(u32, u32)> = kernels.iter().map(|(r, _)| version(r)).collect();
    assert!(
        versions.len() == 4
            && versions[..3] == [(5, 10), (6, 1), (6, 12)]
            && versions[3] >= SHEAVES,
        "the VM's kernels ({}: {versions:?}); `cargo xtask vm-test` fetches them",
        assets.display()
    );
    let dir = scratch();
    let root = root(dir.path(), &heapprofd, &assets);
    let mut figures = Vec::new();
    let bpftrace_disk = assets.join("bpftrace.ext4");
    let mut bpftrace_counts = Vec::new();
    for (release, kernel) in &kernels {
        let image = initramfs(dir.path(), &root, kernel, release);
        let booted = format!("==KERNEL {release} x86_64");
        // The bpftrace disk, with the modules that read it, in one kernel's boot.
        let runs_bpftrace = version(release) == BPFTRACE_VERSION;
        let disk = runs_bpftrace.then_some(bpftrace_disk.as_path());
        if runs_bpftrace {
            assert!(
                bpftrace_disk.is_file() && kernel.join("disk/order").is_file(),
                "{release}: no bpftrace disk ({}) or no modules to read it in {}; \
                 `cargo xtask vm-test` fetches them",
                bpftrace_disk.display(),
                kernel.join("disk").display()
            );
        }
        let mut console = boot(&kernel.join("vmlinuz"), &image, disk);
        if !console.contains(&booted) {
            // A kernel that fails before the VM's init runs (TCG has oopsed in early boot
            // once in many runs) has not run heapprofd yet: boot it once more.
            let tail: Vec<&str> = console.lines().rev().take(30).collect();
            eprintln!(
                "{release} did not reach init; booting again. Its last lines, newest first:\n{}",
                tail.join("\n")
            );
            console = boot(&kernel.join("vmlinuz"), &image, disk);
        }
        assert!(
            console.contains(&booted),
            "{release} did not boot:\n{console}"
        );
        assert!(
            console.contains("==INSMOD brd 0"),
            "{release}: the RAM disk module did not load:\n{console}"
        );
        assert!(
            console.contains("==BTF hidden: 0 bytes"),
            "{release}: BTF was not hidden:\n{console}"
        );
        for scenario in ["deferred", "sampled", "release", "brd", "nobtf"] {
            assert!(
                console.contains(&format!("==STATUS {scenario} 0")),
                "{release}: scenario {scenario} failed; console:\n{console}"
            );
        }
        let profiles = profiles_from(&console, dir.path(), release);
        if version(release) == USER_MODE_VERSION {
            check_user_mode(release, &console, &profiles);
        }
        if runs_bpftrace {
            let counts = bpftrace_agreement::check(release, &console, &profiles);
            bpftrace_counts.push((release.clone(), counts));
        }
        figures.push(check_kernel(release, &console, &profiles));
    }
    for f in &figures {
        eprintln!(
            "x86-64 VM {}: kvfree_call_rcu freed {} objects, kmem_cache_free_bulk {}; \
             timerfd_create stacks {} objects / {} bytes, {} bytes in use; the children \
             {} objects / {} bytes, {} in use; do_epoll_ctl {} objects / {} bytes, {} in use; \
             sampled at {SAMPLE_RATE} bytes {} bytes allocated against {} exact; \
             BTF hidden, the kprobes freed {} and {:?} objects; {} [brd] samples",
            f.release,
            f.rcu_freed,
            f.bulk_freed
                .map_or_else(|| "not attached".to_owned(), |n| format!("{n} objects")),
            f.timerfd.0,
            f.timerfd.1,
            f.timerfd.2,
            f.children.0,
            f.children.1,
            f.children.2,
            f.epoll.0,
            f.epoll.1,
            f.epoll.2,
            f.sampled.1,
            f.sampled.0,
            f.kprobes.0,
            f.kprobes.1,
            f.brd_samples,
        );
    }
    for (release, agreement) in &bpftrace_counts {
        let kinds = agreement.counts.kinds;
        eprintln!(
            "x86-64 VM {release}: heapprofd and bpftrace agree on the pipe workload: \
             {} kmalloc, {} kmem_cache_alloc, {} page allocations (disk mounted, both \
             attached, run and stopped in {} s)",
            kinds[0],
            kinds[1],
            kinds[2],
            agreement
                .seconds
                .map_or_else(|| "?".to_owned(), |s| format!("{s:.1}"))
        );
    }
}
