//! heapprofd's kernel-mode counts against bpftrace's inside the VM, in the kernel whose
//! boot attaches the bpftrace disk (xtask/src/vm/bpftrace.rs: bookworm's bpftrace 0.17
//! and its libraries on an ext4 image, with the modules that read it): the pipe
//! workload of tests/kernel.rs, both tools attached while it waits, counted by the
//! same script (tests/common/bpftrace.rs).

use std::collections::BTreeMap;

use heapprof_daemon::pprof::proto::Profile;

use crate::common::{
    bpftrace::{IndependentCount, counted_by_heapprofd},
    samples,
    vm::last,
};

/// Pipes the workload opens: each allocates a pipe_inode_info, a buffer array, an
/// inode, a dentry, two files and (after a one-byte write) a page.
pub const PIPES: i64 = 400;

/// The VM's part of it, inserted into its script: the disk's modules loaded and the
/// disk mounted, `pipes` started waiting for its first line, heapprofd `--kernel --pid`
/// and bpftrace attached, the pipes opened and closed, bpftrace stopped, then heapprofd
/// (its final profile), then the workload; bpftrace's output between `==BPFTRACE` and
/// `==BPFTRACE-END`.
pub const SCRIPT: &str = r#"
if [ -e /modules/disk/order ]; then
    echo "==UPTIME agreement $(cut -d' ' -f1 /proc/uptime)"
    for m in $(cat /modules/disk/order); do insmod /modules/disk/$m.ko || echo "==INSMOD $m failed"; done
    tries=0
    until [ -b /dev/vda ] || [ $tries -ge 100 ]; do sleep 0.1; tries=$((tries + 1)); done
    mount -t ext4 -o ro /dev/vda /mnt
    echo "==MOUNT bpftrace $?"
    rm -f /tmp/pipes.in && mkfifo /tmp/pipes.in
    /t/pipes PIPES < /tmp/pipes.in > /tmp/pipes.out &
    pipes=$!
    exec 4> /tmp/pipes.in
    tries=0
    until grep -q ready /tmp/pipes.out || [ $tries -ge 600 ]; do sleep 0.1; tries=$((tries + 1)); done
    echo "==STEP workload ready $(cut -d' ' -f1 /proc/uptime)"
    /heapprofd --kernel --pages --pid $pipes --ready-file /tmp/agree.ready -o $out/agree > /tmp/agree.log 2>&1 4>&- &
    heapprofd=$!
    tries=0
    until [ -e /tmp/agree.ready ] || [ $tries -ge 600 ]; do sleep 0.1; tries=$((tries + 1)); done
    echo "==STEP heapprofd ready $(cut -d' ' -f1 /proc/uptime)"
    # Run by the disk's own loader and libraries: the initramfs has no C library of
    # its own but the host's, for user mode.
    /mnt/lib/ld-linux-x86-64.so.2 --library-path /mnt/lib /mnt/bin/bpftrace /t/count.bt $pipes > /tmp/bpftrace.out 2> /tmp/bpftrace.err 4>&- &
    bpftrace=$!
    tries=0
    until grep -q counting /tmp/bpftrace.out || [ $tries -ge 1200 ]; do sleep 0.1; tries=$((tries + 1)); done
    echo "==STEP bpftrace counting $(cut -d' ' -f1 /proc/uptime)"
    echo >&4
    tries=0
    until grep -q opened /tmp/pipes.out || [ $tries -ge 600 ]; do sleep 0.1; tries=$((tries + 1)); done
    echo >&4
    tries=0
    until grep -q closed /tmp/pipes.out || [ $tries -ge 600 ]; do sleep 0.1; tries=$((tries + 1)); done
    echo "==STEP workload done $(cut -d' ' -f1 /proc/uptime)"
    kill -INT $bpftrace
    wait $bpftrace
    echo "==STATUS bpftrace $?"
    kill -INT $heapprofd
    wait $heapprofd
    echo "==STATUS agree $?"
    exec 4>&-
    wait $pipes
    echo "==AGREE pid $pipes"
    echo "==BPFTRACE"
    cat /tmp/bpftrace.out
    echo "==BPFTRACE-END"
    cat /tmp/bpftrace.err /tmp/agree.log
    echo "==UPTIME agreement-end $(cut -d' ' -f1 /proc/uptime)"
fi
"#;

/// What the agreement found: bpftrace's count (which heapprofd's equals) and the
/// seconds the VM spent on it (for the summary: a figure, never judged).
pub struct Agreement {
    pub counts: IndependentCount,
    pub seconds: Option<f64>,
}

/// Checks that bpftrace ran and that heapprofd's final profile counts, for the
/// workload's pid, what bpftrace counted: allocations by kind, pages by order, slab
/// objects by size.
pub fn check(release: &str, console: &str, profiles: &BTreeMap<String, Profile>) -> Agreement {
    for (what, line) in [
        ("the bpftrace disk was not mounted", "==MOUNT bpftrace 0"),
        ("bpftrace failed", "==STATUS bpftrace 0"),
        ("heapprofd failed beside bpftrace", "==STATUS agree 0"),
    ] {
        assert!(
            console.contains(line),
            "{release}: {what}; console:\n{console}"
        );
    }
    let pid = console
        .lines()
        .find_map(|l| l.trim_end_matches('\r').strip_prefix("==AGREE pid "))
        .unwrap_or_else(|| panic!("{release}: no pid of the pipe workload:\n{console}"));
    let output = console
        .split_once("==BPFTRACE\n")
        .or_else(|| console.split_once("==BPFTRACE\r\n"))
        .and_then(|(_, after)| after.split_once("==BPFTRACE-END"))
        .map(|(output, _)| output)
        .unwrap_or_else(|| panic!("{release}: the VM printed no bpftrace output:\n{console}"));
    let independent = IndependentCount::parse(output.lines());
    let [kmalloc, cache, _] = independent.kinds;
    assert!(
        kmalloc + cache >= 6 * PIPES,
        "{release}: bpftrace counted {kmalloc} kmalloc and {cache} kmem_cache_alloc \
         allocations for {PIPES} pipes:\n{output}"
    );
    let ours = counted_by_heapprofd(&samples(last(profiles, "agree")), pid);
    assert_eq!(
        ours, independent,
        "{release}: heapprofd's counts (left) against bpftrace's (right) for pid {pid}"
    );
    let uptime = |mark: &str| {
        console
            .lines()
            .find_map(|l| l.trim_end_matches('\r').strip_prefix(mark))
            .and_then(|t| t.trim().parse::<f64>().ok())
    };
    let seconds = uptime("==UPTIME agreement-end ")
        .zip(uptime("==UPTIME agreement "))
        .map(|(end, start)| end - start);
    Agreement {
        counts: independent,
        seconds,
    }
}
