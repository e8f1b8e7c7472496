//! Exactness: heapprofd's counts equal what a program did, and what valgrind counts.

mod common;

use std::collections::BTreeMap;

use common::*;

fn page_size() -> i64 {
    // SAFETY: sysconf has no preconditions.
    unsafe { libc::sysconf(libc::_SC_PAGESIZE) as i64 }
}

/// The preload library reports the calls.
const PRELOAD: &[&str] = &["--preload", "auto"];
/// The allocator's probes, where placement puts them.
const PROBES_AUTO: &[&str] = &["--preload", "off", "--probe-placement", "auto"];
/// The allocator's probes at the functions' entries.
const PROBES_ENTRY: &[&str] = &["--preload", "off", "--probe-placement", "entry"];

#[test]
fn every_family_function_is_counted_exactly_with_the_preload_library() {
    every_family_function_is_counted_exactly_across_threads(PRELOAD);
}

#[test]
fn every_family_function_is_counted_exactly_with_auto_placement() {
    every_family_function_is_counted_exactly_across_threads(PROBES_AUTO);
}

#[test]
fn every_family_function_is_counted_exactly_with_entry_placement() {
    every_family_function_is_counted_exactly_across_threads(PROBES_ENTRY);
}

fn every_family_function_is_counted_exactly_across_threads(flags: &[&str]) {
    require_root();
    let dir = scratch();
    let program = compile(dir.path(), "family", "family", &["-O0"]);
    let out = dir.path().join("profiles");
    let (threads, iterations): (i64, i64) = (4, 250);
    run_ok(
        heapprofd(&out)
            .args(flags)
            .arg("--")
            .arg(&program)
            .args([threads.to_string(), iterations.to_string()]),
    );

    let samples = samples(&last_profile(&out));
    let ours = |s: &Sample| s.stack.iter().any(|f| f == "exercise");
    let calls = threads * iterations;
    let page = page_size();
    // Bytes of one thread, as family.c allocates them (see its header).
    let bytes_per_thread: i64 = (0..iterations)
        .map(|i| (16 + i) + 4 * (8 + i) + 32 + (64 + i) + 30 + 100 + 128 + 48 + 200 + page)
        .sum();
    let [alloc_objects, alloc_bytes, inuse_objects, inuse_bytes] = totals(&samples, ours);
    assert_eq!(alloc_objects, 10 * calls, "allocations");
    assert_eq!(alloc_bytes, threads * bytes_per_thread, "bytes allocated");
    assert_eq!(
        inuse_objects,
        2 * calls,
        "blocks in use at exit (valloc + pvalloc)"
    );
    assert_eq!(inuse_bytes, calls * (200 + page), "bytes in use at exit");

    let mut per_function: BTreeMap<String, i64> = BTreeMap::new();
    for sample in samples.iter().filter(|s| ours(s)) {
        *per_function.entry(sample.stack[0].clone()).or_default() += sample.values[0];
    }
    // glibc's aligned_alloc and memalign are one function: one probe, reported under one name.
    let aligned = per_function.remove("aligned_alloc").unwrap_or(0)
        + per_function.remove("memalign").unwrap_or(0);
    assert_eq!(aligned, 2 * calls, "aligned_alloc + memalign");
    let expected: BTreeMap<String, i64> = [
        ("calloc", calls),
        ("malloc", calls),
        ("posix_memalign", calls),
        ("pvalloc", calls),
        ("realloc", 2 * calls), // realloc(NULL, n) is the user's realloc, not the malloc inside it
        ("reallocarray", calls),
        ("valloc", calls),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v))
    .collect();
    assert_eq!(per_function, expected, "allocations per function");
}

/// A block one thread frees while its queue waits, whose address another thread then
/// gets from the allocator: the late free must not close the second thread's block.
#[test]
fn a_queued_free_of_an_address_another_thread_took_closes_nothing() {
    require_root();
    let dir = scratch();
    let program = compile(dir.path(), "reuse", "reuse", &["-O2", "-pthread"]);
    let out = dir.path().join("profiles");
    let output = run_ok(heapprofd(&out).args(PRELOAD).arg("--").arg(&program).env(
        "GLIBC_TUNABLES",
        "glibc.malloc.arena_max=1:glibc.malloc.tcache_count=0",
    ));
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        stdout.contains("reused=1"),
        "the allocator did not hand the freed address to the other thread, so this \
         test shows nothing (glibc's tunables?): {stdout}"
    );
    let samples = samples(&last_profile(&out));
    let at = |function: &str| totals(&samples, |s: &Sample| s.stack.iter().any(|f| f == function));
    assert_eq!(at("a_allocates"), [1, 2000, 0, 0], "a_allocates: freed");
    assert_eq!(at("b_allocates"), [1, 2000, 1, 2000], "b_allocates: kept");
}

/// Signal handlers that allocate and free while the thread they interrupt is inside
/// the preload library, changing its queue: their calls are reported at once instead
/// of queued, and every one is counted.
#[test]
fn allocations_in_signal_handlers_are_counted_exactly_with_the_preload_library() {
    require_root();
    let dir = scratch();
    let program = compile(dir.path(), "signals", "signals", &["-O2", "-pthread"]);
    let out = dir.path().join("profiles");
    // At least 200 rounds and 2000 signals: the program goes on until it has both.
    let output = run_ok(
        heapprofd(&out)
            .args(PRELOAD)
            .arg("--")
            .arg(&program)
            .args(["200", "2000"]),
    );
    let stdout = String::from_utf8_lossy(&output.stdout);
    let field = |name: &str| {
        stdout
            .split_whitespace()
            .find_map(|word| word.strip_prefix(name)?.strip_prefix('='))
            .and_then(|n| n.parse::<i64>().ok())
            .unwrap_or_else(|| panic!("no {name}= in the program's output: {stdout}"))
    };
    let handled = field("handled");
    let rounds = field("rounds");
    assert!(
        handled > 1000,
        "{handled} signals handled: too few to interrupt the library"
    );
    let samples = samples(&last_profile(&out));
    let at = |function: &str| totals(&samples, |s: &Sample| s.stack.iter().any(|f| f == function));
    assert_eq!(
        at("main_allocates"),
        [rounds * 1000, rounds * 1000 * 1000, 0, 0],
        "main_allocates: all freed"
    );
    // One call before the first signal, then one per signal.
    assert_eq!(
        at("handler_allocates"),
        [handled + 1, (handled + 1) * 24, 0, 0],
        "handler_allocates ({handled} signals): all freed"
    );
}

/// With the preload library, an allocation at a stack the BPF program already walked
/// for the thread is queued, not probed: the family program allocates from the same
/// ten stacks in a loop, so nearly all of its allocations reach heapprofd without a
/// call of the probe site, and are still counted exactly (the test above).
#[test]
fn allocations_at_known_stacks_skip_the_probe() {
    require_root();
    let dir = scratch();
    let program = compile(dir.path(), "family", "family", &["-O2"]);
    let out = dir.path().join("profiles");
    let stats = dir.path().join("stats.json");
    let (threads, iterations): (i64, i64) = (2, 2000);
    let output = run_ok(
        heapprofd(&out)
            .args(PRELOAD)
            .arg("--bpf-stats")
            .arg("--stats-json")
            .arg(&stats)
            .arg("--")
            .arg(&program)
            .args([threads.to_string(), iterations.to_string()]),
    );
    let stderr = String::from_utf8_lossy(&output.stderr);
    let figures = stats_json(&stats);
    let runs = figures["bpf_run_time"]["programs"]
        .as_array()
        .and_then(|programs| {
            programs
                .iter()
                .find(|p| p["name"] == heapprof_common::names::PROG_PRELOAD)
        })
        .and_then(|p| p["runs"].as_i64())
        .unwrap_or_else(|| panic!("no run count of the preload report's program in:\n{figures}"));
    let samples = samples(&last_profile(&out));
    let [alloc_objects, ..] = totals(&samples, |s: &Sample| {
        s.stack.iter().any(|f| f == "exercise")
    });
    assert_eq!(alloc_objects, 10 * threads * iterations, "allocations");
    // Each queue report carries up to 42 allocations (or 126 frees), and only the
    // first allocation at each stack and thread is probed; without known stacks every
    // allocation would be a call.
    assert!(
        runs * 10 < alloc_objects,
        "{runs} calls of the probe site for {alloc_objects} allocations: the known stacks \
         are not used\n{stderr}"
    );
}

/// The benchmark's `--stacks-only` baseline does the stack work of every allocation
/// the exact mode counts (one lookup each: a remembered walk's check or a walk) and
/// counts nothing, so that `cargo xtask bench` holds heapprofd against a baseline that
/// really finds each stack; launched, with the preload library's default too (the
/// baseline uses the probes, since the library would count without them).
#[test]
fn stacks_only_finds_every_stack_and_counts_nothing() {
    require_root();
    let dir = scratch();
    let program = compile(dir.path(), "family", "family", &["-O2"]);
    // The log, and the stack lookups that --stats-json counted.
    let run = |out: &std::path::Path, flags: &[&str]| {
        let stats = out.with_extension("json");
        let output = run_ok(
            heapprofd(out)
                .arg("--bpf-stats")
                .arg("--stats-json")
                .arg(&stats)
                .args(flags)
                .arg("--")
                .arg(&program)
                .args(["2", "500"]),
        );
        let log = String::from_utf8_lossy(&output.stderr).into_owned();
        let lookups = stats_json(&stats)["stack_lookups"]["total"]
            .as_i64()
            .unwrap_or_else(|| panic!("no count of stack lookups; the log:\n{log}"));
        (log, lookups)
    };
    let exact_out = dir.path().join("exact");
    let (exact_log, exact_lookups) = run(&exact_out, PROBES_AUTO);
    let [allocated, ..] = totals(&samples(&last_profile(&exact_out)), |_| true);
    assert!(
        allocated >= 10 * 2 * 500,
        "exact mode counted {allocated} allocations"
    );
    assert!(
        exact_lookups >= allocated,
        "exact mode: fewer stack lookups than allocations\n{exact_log}"
    );

    let probes_flags = [PROBES_AUTO, &["--stacks-only"]].concat();
    for (name, flags) in [
        ("probes", &probes_flags[..]),
        ("default", &["--stacks-only"][..]),
    ] {
        let out = dir.path().join(format!("stacks-only-{name}"));
        let (log, lookups) = run(&out, flags);
        assert_eq!(
            lookups, allocated,
            "{flags:?}: one stack lookup per allocation of the exact run\n{log}"
        );
        let counted = totals(&samples(&last_profile(&out)), |_| true);
        assert_eq!(counted, [0; 4], "{flags:?} counts nothing\n{log}");
    }
}

/// Parses valgrind's "in use at exit: B bytes in N blocks" and
/// "total heap usage: A allocs, F frees, T bytes allocated".
fn valgrind_summary(stderr: &str) -> (i64, i64, i64, i64, i64) {
    let number = |s: &str| {
        s.replace(',', "")
            .parse::<i64>()
            .unwrap_or_else(|_| panic!("not a number: {s:?}"))
    };
    let in_use = stderr
        .lines()
        .find_map(|l| l.split("in use at exit: ").nth(1))
        .unwrap_or_else(|| panic!("no 'in use at exit' in valgrind output:\n{stderr}"));
    let w: Vec<&str> = in_use.split_whitespace().collect();
    let (inuse_bytes, inuse_blocks) = (number(w[0]), number(w[3]));
    let usage = stderr
        .lines()
        .find_map(|l| l.split("total heap usage: ").nth(1))
        .unwrap_or_else(|| panic!("no 'total heap usage' in valgrind output:\n{stderr}"));
    let w: Vec<&str> = usage.split_whitespace().collect();
    (
        number(w[0]),
        number(w[2]),
        number(w[4]),
        inuse_bytes,
        inuse_blocks,
    )
}

#[test]
fn totals_agree_with_valgrind_with_auto_placement() {
    totals_agree_with_valgrind(PROBES_AUTO);
}

#[test]
fn totals_agree_with_valgrind_with_the_preload_library() {
    totals_agree_with_valgrind(PRELOAD);
}

#[test]
fn totals_agree_with_valgrind_with_entry_placement() {
    totals_agree_with_valgrind(PROBES_ENTRY);
}

fn totals_agree_with_valgrind(flags: &[&str]) {
    require_root();
    let dir = scratch();
    let program = compile(dir.path(), "family", "family", &["-O2"]);
    // valgrind 3.19 aborts on pvalloc: the last argument swaps it for valloc.
    let args = ["3", "40", "0"];
    // --run-libc-freeres=no: by default valgrind makes glibc free its internal caches at
    // exit, frees the program itself never makes and heapprofd (rightly) does not see.
    let valgrind = common::valgrind::command()
        .arg("--run-libc-freeres=no")
        .arg(&program)
        .args(args)
        .output()
        .expect("running valgrind (install it: cargo xtask setup)");
    assert!(
        valgrind.status.success(),
        "valgrind run failed: {valgrind:?}"
    );
    let (allocs, frees, bytes, inuse_bytes, inuse_blocks) =
        valgrind_summary(&String::from_utf8_lossy(&valgrind.stderr));

    let out = dir.path().join("profiles");
    run_ok(
        heapprofd(&out)
            .args(flags)
            .arg("--")
            .arg(&program)
            .args(args),
    );
    let samples = samples(&last_profile(&out));
    let [alloc_objects, alloc_bytes, inuse_objects, inuse_space] = totals(&samples, |_| true);
    assert_eq!(
        alloc_objects, allocs,
        "allocations (valgrind: total heap usage allocs)"
    );
    assert_eq!(
        alloc_bytes, bytes,
        "bytes allocated (valgrind: total heap usage bytes)"
    );
    assert_eq!(
        alloc_objects - inuse_objects,
        frees,
        "frees (valgrind: total heap usage frees)"
    );
    assert_eq!(
        inuse_objects, inuse_blocks,
        "blocks in use at exit (valgrind)"
    );
    assert_eq!(inuse_space, inuse_bytes, "bytes in use at exit (valgrind)");
}

#[test]
fn a_full_live_table_keeps_allocations_exact_and_in_use_tracked() {
    require_root();
    let dir = scratch();
    let program = compile(dir.path(), "family", "family", &["-O0"]);
    let out = dir.path().join("profiles");
    let (threads, iterations): (i64, i64) = (2, 200);
    let output = run_ok(
        heapprofd(&out)
            .args(["--max-live-blocks", "16", "--"])
            .arg(&program)
            .args([threads.to_string(), iterations.to_string()]),
    );
    let log = String::from_utf8_lossy(&output.stderr);
    assert!(
        log.contains("live-block table full"),
        "no warning in:\n{log}"
    );
    let samples = samples(&last_profile(&out));
    let [alloc_objects, _, inuse_objects, _] =
        totals(&samples, |s| s.stack.iter().any(|f| f == "exercise"));
    // Every allocation is still counted; in use is only what the table could track:
    // its slots, provisioned with room above the 16 asked for.
    let slots =
        heapprof_common::live::buckets_for(16) as i64 * heapprof_common::live::BUCKET_SLOTS as i64;
    assert_eq!(alloc_objects, 10 * threads * iterations, "allocations");
    assert!(
        inuse_objects <= slots,
        "{inuse_objects} blocks in use with a live table of {slots} slots"
    );
}

#[test]
fn the_first_drop_of_a_kind_is_logged_once_by_the_bpf_programs() {
    require_root();
    let dir = scratch();
    let program = compile(dir.path(), "family", "family", &["-O0"]);
    let out = dir.path().join("profiles");
    // Two threads: two CPUs may meet the full table at once; still one line.
    let output = run_ok(
        heapprofd(&out)
            .args(["--max-live-blocks", "16", "--"])
            .arg(&program)
            .args(["2", "200"]),
    );
    let log = String::from_utf8_lossy(&output.stderr);
    let lines: Vec<&str> = log
        .lines()
        .filter(|line| line.contains("[bpf]") && line.contains("LIVE: live-block table full"))
        .collect();
    assert_eq!(
        lines.len(),
        1,
        "one [bpf] line for the full table in:\n{log}"
    );
    assert!(
        lines[0].starts_with("heapprofd: warn: [bpf] LIVE: live-block table full "),
        "a warning naming the table: {}",
        lines[0]
    );
    assert!(
        lines[0].contains("--max-live-blocks"),
        "the remedy: {}",
        lines[0]
    );
    // Hundreds of drops were counted, and reported by the daemon as before.
    assert!(
        drop_count(
            &last_profile(&out),
            heapprof_common::DropReason::LiveTableFull
        ) > 100,
        "drops counted"
    );
}

/// The `--stats-json` file at `path`.
fn stats_json(path: &std::path::Path) -> serde_json::Value {
    let text = std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("heapprofd wrote no --stats-json {}: {e}", path.display()));
    serde_json::from_str(&text).expect("--stats-json is JSON")
}
