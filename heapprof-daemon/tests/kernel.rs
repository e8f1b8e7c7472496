//! Kernel mode: a known kernel-allocating workload (pipes) under `--kernel --pid`,
//! checked against an independent count of the same tracepoints taken by bpftrace
//! in the same run, and against the workload's own shape (stacks, live objects).

mod common;

use std::{
    collections::BTreeMap,
    process::{Child, Command, Stdio},
    sync::mpsc,
    time::{Duration, Instant},
};

use common::{
    bpftrace::{self, IndependentCount},
    *,
};
use heapprof_common::kernel::DeferredFreePath;
use heapprof_daemon::{
    pprof::{keyed_comments, proto::Profile},
    probes::kernel::{DeferredFreeWatch, watch_key},
    report::losses,
};

/// Pipes the workload opens: each one allocates a pipe_inode_info, a buffer array,
/// an inode, a dentry, two files and (after a one-byte write) a page. Kept well under
/// the default limit of 1024 open files.
const PIPES: u64 = 400;

/// A kernel sample in readable form.
#[derive(Debug)]
struct KernelSample {
    /// Function names, leaf (the allocator kind) first.
    stack: Vec<String>,
    /// alloc_objects, alloc_space, inuse_objects, inuse_space, alloc_requested_space,
    /// inuse_requested_space.
    values: Vec<i64>,
    pid: i64,
    /// The `cache` label (slab samples).
    cache: Option<String>,
    /// The `order` label (page samples).
    order: Option<i64>,
}

fn kernel_samples(profile: &Profile) -> Vec<KernelSample> {
    let types: Vec<&str> = profile
        .sample_type
        .iter()
        .map(|t| profile.string_table[t.r#type as usize].as_str())
        .collect();
    assert_eq!(
        types,
        [
            "alloc_objects",
            "alloc_space",
            "inuse_objects",
            "inuse_space",
            "alloc_requested_space",
            "inuse_requested_space"
        ]
    );
    samples(profile)
        .into_iter()
        .zip(&profile.sample)
        .map(|(sample, raw)| KernelSample {
            stack: sample.stack,
            values: raw.value.clone(),
            pid: sample
                .labels
                .get("pid")
                .and_then(|p| p.parse().ok())
                .unwrap_or(-1),
            cache: sample.labels.get("cache").cloned(),
            order: sample.labels.get("order").and_then(|o| o.parse().ok()),
        })
        .collect()
}

fn is_pipe_stack(sample: &KernelSample) -> bool {
    sample.stack.iter().any(|f| f.contains("pipe"))
}

/// Sum of value `index` over the samples of `pid` that pass `filter`.
fn total(
    samples: &[KernelSample],
    pid: i64,
    index: usize,
    filter: impl Fn(&KernelSample) -> bool,
) -> i64 {
    samples
        .iter()
        .filter(|s| s.pid == pid && filter(s))
        .map(|s| s.values[index])
        .sum()
}

/// bpftrace counting the same tracepoints for one process, from a second, independent program.
fn start_bpftrace(pid: u32) -> (Child, mpsc::Receiver<String>) {
    let mut child = Command::new("bpftrace")
        .args(["-e", bpftrace::SCRIPT, &pid.to_string()])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("starting bpftrace (install it: cargo xtask setup)");
    let lines = forward_lines(child.stdout.take().expect("stdout"));
    loop {
        match lines.recv_timeout(Duration::from_secs(60)) {
            Ok(line) if line == "counting" => return (child, lines),
            Ok(_) => {} // "Attaching 3 probes..."
            Err(err) => {
                let _ = child.kill();
                panic!("bpftrace did not start counting: {err}");
            }
        }
    }
}

/// Stops bpftrace and reads its counters.
fn stop_bpftrace(mut child: Child, lines: mpsc::Receiver<String>) -> IndependentCount {
    // SAFETY: plain kill(2) on our own child.
    unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGINT) };
    let status = child.wait().expect("waiting for bpftrace");
    assert!(status.success(), "bpftrace failed: {status}");
    let lines: Vec<String> = lines.iter().collect();
    IndependentCount::parse(lines.iter().map(String::as_str))
}

/// Waits (up to a minute) for a profile that satisfies `done`, returning the last one read.
fn wait_for_profile(dir: &std::path::Path, mut done: impl FnMut(&Profile) -> bool) -> Profile {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Some((_, profile)) = read_profiles(dir).pop()
            && (done(&profile) || Instant::now() > deadline)
        {
            return profile;
        }
        assert!(Instant::now() < deadline, "no profile in {}", dir.display());
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn kernel_allocations_of_a_process_match_an_independent_count() {
    require_root();
    let dir = scratch();
    let binary = compile(dir.path(), "pipes", "pipes", &["-O1"]);
    let out = dir.path().join("profiles");
    let mut pipes = Driven::start(&binary, &[&PIPES.to_string()]);
    let pid = pipes.child.id();

    let (mut heapprofd, log) = start_heapprofd(
        heapprofd(&out)
            .args(["--kernel", "--pages", "--interval", "200ms", "--pid"])
            .arg(pid.to_string()),
    );
    // Both tools are attached while the workload is blocked reading stdin: neither
    // can miss an allocation the other sees.
    let (bpftrace, bpftrace_lines) = start_bpftrace(pid);

    pipes.step("opened");
    let opened_at = read_profiles(&out).len();
    // A profile written after the pipes exist, showing them in use.
    let open = wait_for_profile(&out, |_| read_profiles(&out).len() > opened_at + 1);
    let open_samples = kernel_samples(&open);
    let pipe_allocs = total(&open_samples, pid.into(), 0, is_pipe_stack);
    let pipe_inuse_open = total(&open_samples, pid.into(), 2, is_pipe_stack);
    assert!(
        pipe_allocs >= 6 * PIPES as i64,
        "allocations in pipe stacks: {pipe_allocs}, expected at least {} for {PIPES} pipes",
        6 * PIPES
    );
    assert!(
        pipe_inuse_open >= 6 * PIPES as i64,
        "objects of pipe stacks in use while the pipes are open: {pipe_inuse_open}"
    );
    let pipe_pages = total(&open_samples, pid.into(), 0, |s| {
        s.stack.first().is_some_and(|f| f == "alloc_pages")
            && s.stack.iter().any(|f| f.contains("pipe_write"))
    });
    assert!(
        pipe_pages >= PIPES as i64,
        "pages allocated by pipe_write: {pipe_pages}"
    );

    pipes.step("closed");
    // The workload is blocked again: stop the independent count, then wait for the frees
    // (some are deferred to RCU callbacks and workers, in other contexts).
    let independent = stop_bpftrace(bpftrace, bpftrace_lines);
    let [kmalloc, cache, pages] = independent.kinds;
    let closed = wait_for_profile(&out, |profile| {
        total(&kernel_samples(profile), pid.into(), 2, is_pipe_stack)
            <= pipe_inuse_open - 6 * PIPES as i64
    });
    // SAFETY: plain kill(2) on our own child.
    unsafe { libc::kill(heapprofd.id() as libc::pid_t, libc::SIGINT) };
    wait_success(&mut heapprofd, &log, "--kernel --pid");
    pipes.finish();

    let closed_samples = kernel_samples(&closed);
    let pipe_inuse_closed = total(&closed_samples, pid.into(), 2, is_pipe_stack);
    assert!(
        pipe_inuse_closed <= pipe_inuse_open - 6 * PIPES as i64,
        "objects of pipe stacks in use: {pipe_inuse_open} with the pipes open, \
         {pipe_inuse_closed} after closing them"
    );
    let bytes_open = total(&open_samples, pid.into(), 3, is_pipe_stack);
    let bytes_closed = total(&closed_samples, pid.into(), 3, is_pipe_stack);
    assert!(
        bytes_closed * 4 < bytes_open,
        "bytes of pipe stacks in use: {bytes_open} open, {bytes_closed} closed"
    );

    eprintln!(
        "pipe stacks: {pipe_allocs} allocated, {pipe_inuse_open} in use while open \
         ({bytes_open} bytes), {pipe_inuse_closed} after close ({bytes_closed} bytes); \
         bpftrace: kmalloc {kmalloc}, kmem_cache_alloc {cache}, pages {pages}"
    );
    // The final profile's totals for the process against bpftrace's, kind by kind.
    let last = kernel_samples(&read_profiles(&out).pop().expect("a final profile").1);
    let by_kind = |kind: &str| {
        total(&last, pid.into(), 0, |s| {
            s.stack.first().is_some_and(|f| f == kind)
        })
    };
    assert_eq!(
        [
            by_kind("kmalloc"),
            by_kind("kmem_cache_alloc"),
            by_kind("alloc_pages")
        ],
        [kmalloc, cache, pages],
        "heapprofd's allocation counts (kmalloc, kmem_cache_alloc, pages) against bpftrace's"
    );
    assert!(kmalloc + cache >= 6 * PIPES as i64);
    // Requested bytes never exceed the bytes handed out.
    for sample in &last {
        assert!(sample.values[4] <= sample.values[1], "{sample:?}");
    }
    check_classes(&last, pid.into(), &independent);
}

/// Page samples carry their order and kmalloc and kmem_cache_alloc samples their
/// object size, with bpftrace's counts per order and per size; named caches are the caches of
/// `/proc/slabinfo`, with its object size.
fn check_classes(samples: &[KernelSample], pid: i64, independent: &IndependentCount) {
    let ours = samples.iter().filter(|s| s.pid == pid && s.values[0] > 0);
    let mut orders: BTreeMap<i64, i64> = BTreeMap::new();
    let mut kmalloc_sizes: BTreeMap<i64, i64> = BTreeMap::new();
    let mut cache_sizes: BTreeMap<i64, i64> = BTreeMap::new();
    let slabinfo = slab_object_sizes();
    let mut named = 0;
    for sample in ours {
        let per_object = sample.values[1] / sample.values[0];
        assert_eq!(
            per_object * sample.values[0],
            sample.values[1],
            "one size per sample: {sample:?}"
        );
        match sample.stack.first().map(String::as_str) {
            Some("alloc_pages") => {
                let order = sample
                    .order
                    .unwrap_or_else(|| panic!("no order: {sample:?}"));
                assert_eq!(per_object, 4096 << order, "{sample:?}");
                *orders.entry(order).or_default() += sample.values[0];
            }
            Some("kmalloc") => {
                let cache = sample
                    .cache
                    .as_deref()
                    .unwrap_or_else(|| panic!("{sample:?}"));
                assert!(cache.starts_with("kmalloc-"), "{sample:?}");
                if let Some(&size) = slabinfo.get(cache) {
                    assert_eq!(per_object, size, "{cache}'s objects: {sample:?}");
                }
                *kmalloc_sizes.entry(per_object).or_default() += sample.values[0];
            }
            Some("kmem_cache_alloc") => {
                let cache = sample
                    .cache
                    .as_deref()
                    .unwrap_or_else(|| panic!("{sample:?}"));
                let size = slabinfo
                    .get(cache)
                    .unwrap_or_else(|| panic!("{cache} is not in /proc/slabinfo: {sample:?}"));
                assert_eq!(per_object, *size, "{cache}'s objects: {sample:?}");
                *cache_sizes.entry(per_object).or_default() += sample.values[0];
                named += 1;
            }
            _ => panic!("unexpected leaf: {sample:?}"),
        }
    }
    assert!(named > 0, "no sample of a named cache");
    assert_eq!(
        orders, independent.orders,
        "pages by order against bpftrace's"
    );
    assert_eq!(
        kmalloc_sizes, independent.kmalloc_sizes,
        "kmalloc objects by size against bpftrace's"
    );
    assert_eq!(
        cache_sizes, independent.cache_sizes,
        "kmem_cache_alloc objects by size against bpftrace's"
    );
}

/// Object size (with the allocator's per-object metadata, as the tracepoints report
/// it) of every cache in `/proc/slabinfo`.
fn slab_object_sizes() -> BTreeMap<String, i64> {
    let text = std::fs::read_to_string("/proc/slabinfo").expect("reading /proc/slabinfo");
    text.lines()
        .skip(2)
        .filter_map(|line| {
            let mut fields = line.split_whitespace();
            let name = fields.next()?.to_owned();
            let size = fields.nth(2)?.parse().ok()?;
            Some((name, size))
        })
        .collect()
}

#[test]
fn go_pprof_reads_kernel_profiles_with_symbol_names() {
    require_root();
    let dir = scratch();
    let out = dir.path().join("profiles");
    // Launch mode: a shell pipeline's children are followed.
    run_ok(heapprofd(&out).args([
        "--kernel",
        "--",
        "sh",
        "-c",
        "for i in 1 2 3 4 5 6 7 8; do cat /proc/self/status | wc -l > /dev/null; done",
    ]));
    let profiles = read_profiles(&out);
    let (path, profile) = profiles.last().expect("a profile");
    let samples = kernel_samples(profile);
    assert!(
        samples.iter().any(|s| s
            .stack
            .iter()
            .any(|f| f.contains("fork") || f.contains("clone"))),
        "no kernel stack through fork/clone in the launched shell's profile"
    );
    let pids: std::collections::HashSet<i64> = samples.iter().map(|s| s.pid).collect();
    assert!(
        pids.len() > 2,
        "children of the command are counted too: pids {pids:?}"
    );

    let stdout = go_pprof_top(path, "alloc_space");
    let rows: Vec<&str> = stdout
        .lines()
        .skip_while(|l| !l.trim_start().starts_with("flat"))
        .skip(1)
        .collect();
    assert!(rows.len() > 5, "few rows in\n{stdout}");
    for row in &rows {
        let name = row.split_whitespace().last().unwrap_or("");
        assert!(
            !name.starts_with("0x") && !name.is_empty(),
            "an address instead of a symbol name in\n{stdout}"
        );
    }
    assert!(
        stdout.contains("kmalloc") || stdout.contains("kmem_cache_alloc"),
        "{stdout}"
    );
}

#[test]
fn a_full_live_table_is_counted_and_reported() {
    require_root();
    let dir = scratch();
    let out = dir.path().join("profiles");
    let output = run_ok(heapprofd(&out).args([
        "--kernel",
        "--max-live-blocks",
        "16",
        "--",
        "sh",
        "-c",
        "for i in 1 2 3 4 5 6 7 8; do cat /proc/self/status > /dev/null; done",
    ]));
    let log = String::from_utf8_lossy(&output.stderr);
    assert!(
        log.contains("live-block table full"),
        "no warning about the full live table in:\n{log}"
    );
    let profile = read_profiles(&out).pop().expect("a profile").1;
    let dropped = drop_count(&profile, heapprof_common::DropReason::LiveTableFull);
    assert!(
        dropped > 0,
        "live-table drops in the profile comments: {dropped}"
    );
    // What was counted stays consistent: never more in use than allocated, and at most
    // the table's capacity of objects tracked as live.
    let samples = kernel_samples(&profile);
    let inuse: i64 = samples.iter().map(|s| s.values[2]).sum();
    let allocated: i64 = samples.iter().map(|s| s.values[0]).sum();
    assert!(
        allocated > 16 && inuse <= 16,
        "allocated {allocated}, in use {inuse}"
    );
}

/// A command that frees every kernel object it made (epoll items, which 6.x kernels
/// free with kfree_rcu; tmpfs files), then waits for RCU: where the session sees
/// deferred and bulk frees, the stacks it used hold at most 5% of what they allocated;
/// where it cannot, the profile says what it undercounts. The exit table is the final
/// profile's own top table, and the slab caches group as `slabtop` names them.
#[test]
fn objects_freed_after_a_grace_period_are_freed_in_the_profile() {
    require_root();
    let dir = scratch();
    let binary = compile(dir.path(), "release_all", "release_all", &["-O1"]);
    let out = dir.path().join("profiles");
    let items = 2000;
    let output = run_ok(
        heapprofd(&out)
            .args(["--kernel", "--top", "5", "--"])
            .arg(&binary)
            .args([&items.to_string(), "3"]),
    );
    let (path, profile) = read_profiles(&out).pop().expect("a final profile");
    let samples = kernel_samples(&profile);
    let epoll = |index: usize| {
        samples
            .iter()
            .filter(|s| s.stack.iter().any(|f| f == "do_epoll_ctl"))
            .map(|s| s.values[index])
            .sum::<i64>()
    };
    let (allocated, in_use) = (epoll(1), epoll(3));
    // An epitem and a poll-table entry per registered pipe.
    assert!(
        epoll(0) >= 2 * items,
        "epoll allocations: {} for {items} items",
        epoll(0)
    );
    let notes = comments(&profile);
    // Seen when the kvfree_call_rcu program is attached (the profile's keyed comment).
    let rcu_watch = keyed_comments::value(&notes, &watch_key(DeferredFreePath::Rcu))
        .and_then(DeferredFreeWatch::from_name);
    if matches!(
        rcu_watch,
        Some(DeferredFreeWatch::Fentry | DeferredFreeWatch::Kprobe)
    ) {
        assert!(
            in_use * 20 <= allocated,
            "do_epoll_ctl holds {in_use} of {allocated} bytes after everything was freed"
        );
    } else {
        // Unseen: the profile says its frees are undercounted, as the reports read it.
        assert!(
            losses::frees_undercounted(&notes),
            "neither deferred frees nor an undercount: {notes:?}"
        );
    }

    // The exit table: the rows of `heapprofd report` on the final profile.
    let stdout = String::from_utf8_lossy(&output.stdout);
    let exit_rows: Vec<&str> = stdout
        .lines()
        .skip_while(|l| !l.contains("LIVE BYTES"))
        .collect();
    let report = run_ok(
        std::process::Command::new(env!("CARGO_BIN_EXE_heapprofd"))
            .args(["report", "--top", "5"])
            .arg(&path),
    );
    let report = String::from_utf8_lossy(&report.stdout);
    let report_rows: Vec<&str> = report
        .lines()
        .skip_while(|l| !l.contains("LIVE BYTES"))
        .collect();
    assert!(exit_rows.len() > 1, "{stdout}");
    assert_eq!(exit_rows, report_rows, "the exit table against the report");
    // Sites are named after the allocator's caller, with requested bytes and waste.
    assert!(exit_rows[0].ends_with("REQUESTED  WASTE  SITE"), "{stdout}");
    for row in &exit_rows[1..] {
        let site = row.split("  ").last().unwrap_or_default();
        assert!(
            !site.contains("_noprof"),
            "an allocator wrapper names a site: {row}"
        );
    }

    // Grouped by cache: the epoll items' cache is a row.
    let by_cache = run_ok(
        std::process::Command::new(env!("CARGO_BIN_EXE_heapprofd"))
            .args([
                "report",
                "--by",
                "cache",
                "--sample-index",
                "alloc_objects",
                "--top",
                "0",
            ])
            .arg(&path),
    );
    let by_cache = String::from_utf8_lossy(&by_cache.stdout);
    assert!(
        by_cache.lines().any(|l| l.ends_with("  eventpoll_epi")),
        "{by_cache}"
    );
}
