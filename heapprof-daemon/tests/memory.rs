//! Memory beside the heap: every profile records each process's RSS, heap segment,
//! page faults and exact in-use peak; kernel profiles record the slab totals.

mod common;

use common::*;
use heapprof_daemon::memstats::{KernelMemory, ProcessMemory};

/// The process-memory comments of the last profile in `out`.
fn process_memory(out: &std::path::Path) -> Vec<ProcessMemory> {
    let profile = last_profile(out);
    comments(&profile)
        .iter()
        .filter_map(|c| ProcessMemory::parse_comment(c))
        .collect()
}

#[test]
fn the_peak_is_exact_and_rss_is_recorded_beside_it() {
    require_root();
    let dir = scratch();
    let program = compile(dir.path(), "peak", "peak", &["-O1", "-pthread"]);
    let out = dir.path().join("profiles");
    run_ok(heapprofd(&out).arg("--").arg(&program).arg("serial"));
    let memory = process_memory(&out);
    assert_eq!(memory.len(), 1, "one process, one line: {memory:?}");
    let memory = &memory[0];
    // 64 x 4096 held at once by burst(); nothing else had allocated by then.
    assert_eq!(memory.peak_inuse, Some(262_144), "{memory:?}");
    assert_eq!(memory.comm, "peak");
    assert!(memory.vm_rss > 0 && memory.rss_anon > 0, "{memory:?}");
    assert!(memory.rss_anon <= memory.vm_rss, "{memory:?}");
    // glibc serves these sizes from the brk heap (trimmed again after the burst).
    assert!(memory.heap > 0, "{memory:?}");
    assert!(memory.minor_faults > 0, "{memory:?}");
    // The profile's in-use is what keep() holds: the peak is not the last value.
    let samples = samples(&last_profile(&out));
    let inuse = totals(&samples, |_| true)[3];
    assert_eq!(inuse, 10_000, "{samples:?}");
}

#[test]
fn the_peak_counts_every_thread_at_once() {
    require_root();
    let dir = scratch();
    let program = compile(dir.path(), "peak", "peak", &["-O1", "-pthread"]);
    let out = dir.path().join("profiles");
    let threads = 4;
    // With the preload library (the default) the threads' allocations wait in their
    // queues until they block at the barrier (switched out) or the last one wakes the
    // others (a futex call): the programs apply the queues then, before any thread's
    // frees, so the peak counts them all at once.
    run_ok(
        heapprofd(&out)
            .arg("--")
            .arg(&program)
            .args(["threads", &threads.to_string()]),
    );
    let memory = process_memory(&out);
    let peak = memory[0].peak_inuse.expect("exact mode records the peak");
    let samples = samples(&last_profile(&out));
    let held = i64::from(threads) * 16 * 4096;
    // Every thread held its blocks at the barrier at once; besides them only the
    // threads' own bookkeeping (allocated by libc, counted too) can add to the peak.
    let others = totals(&samples, |s| !s.stack.iter().any(|f| f == "hold"))[1];
    let hold = totals(&samples, |s| s.stack.iter().any(|f| f == "hold"));
    assert_eq!(hold[1], held, "every block of hold() counted: {hold:?}");
    assert!(
        peak as i64 >= held && peak as i64 <= held + others,
        "peak {peak} outside [{held}, {}]",
        held + others
    );
}

#[test]
fn sampled_profiles_record_rss_but_no_peak() {
    require_root();
    let dir = scratch();
    let program = compile(dir.path(), "peak", "peak", &["-O1", "-pthread"]);
    let out = dir.path().join("profiles");
    run_ok(
        heapprofd(&out)
            .args(["--sample-rate", "4096", "--"])
            .arg(&program)
            .arg("serial"),
    );
    let memory = process_memory(&out);
    assert_eq!(memory.len(), 1, "{memory:?}");
    assert_eq!(
        memory[0].peak_inuse, None,
        "a sampled peak would not be the process's"
    );
    assert!(memory[0].vm_rss > 0);
}

#[test]
fn kernel_profiles_record_the_slab_totals() {
    require_root();
    let dir = scratch();
    let out = dir.path().join("profiles");
    run_ok(heapprofd(&out).args(["--kernel", "--duration", "500ms"]));
    let profile = last_profile(&out);
    let memory = comments(&profile)
        .iter()
        .find_map(|c| KernelMemory::parse_comment(c))
        .unwrap_or_else(|| panic!("no kernel-memory comment: {:?}", comments(&profile)));
    assert!(
        memory.slab > 0
            && memory.slab_unreclaimable > 0
            && memory.slab_unreclaimable <= memory.slab,
        "{memory:?}"
    );
}
