//! Sampling: scaled estimates stay close to the exact counts.

mod common;

use common::*;
use heapprof_common::names;

/// Totals of the `exercise` sites of family.c, exact and at `rate` bytes per sample,
/// with heapprofd's `flags`.
fn totals_at(rate: Option<&str>, flags: &[&str]) -> [i64; 4] {
    let dir = scratch();
    let program = compile(dir.path(), "family", "family", &["-O0"]);
    let out = dir.path().join("profiles");
    let mut command = heapprofd(&out);
    if let Some(rate) = rate {
        command.args(["--sample-rate", rate]);
    }
    run_ok(
        command
            .args(flags)
            .arg("--")
            .arg(&program)
            .args(["4", "1500"]),
    );
    let samples = samples(&last_profile(&out));
    totals(&samples, |s| s.stack.iter().any(|f| f == "exercise"))
}

/// About 13,500 samples are taken at 4 KiB (55 MB allocated), so the statistical error
/// of the byte totals is about 1%: 5% is five standard deviations. Object counts are
/// estimated from each site's average sampled size, as Go does; sites whose sizes vary
/// (family.c's malloc/calloc/realloc grow with the iteration) are undercounted by a few
/// percent (7% measured), hence 15%.
#[test]
fn sampled_totals_are_close_to_exact_ones() {
    require_root();
    assert_sampled_totals_close(&[]);
}

/// The same on the allocator's probes, where frees go through the live table's filter
/// (`LIVE_FILTER`): a free it wrongly let skip the table would leave its sampled block
/// in use, and in-use bytes would drift far above the exact ones.
#[test]
fn sampled_totals_on_the_probes_are_close_to_exact_ones() {
    require_root();
    assert_sampled_totals_close(&["--preload", "off"]);
}

/// Compares family.c's totals at 4 KiB with the exact ones, both with `flags`.
fn assert_sampled_totals_close(flags: &[&str]) {
    let exact = totals_at(None, flags);
    let sampled = totals_at(Some("4KiB"), flags);
    let names = [
        "alloc_objects",
        "alloc_space",
        "inuse_objects",
        "inuse_space",
    ];
    let tolerances = [0.15, 0.05, 0.15, 0.05];
    for ((name, tolerance), (exact, sampled)) in names
        .iter()
        .zip(tolerances)
        .zip(exact.into_iter().zip(sampled))
    {
        let error = (sampled - exact).abs() as f64 / exact as f64;
        assert!(
            error <= tolerance,
            "{name}: sampled estimate {sampled} is {:.1}% from the exact {exact} (tolerance {:.0}%)",
            error * 100.0,
            tolerance * 100.0
        );
    }
    assert_ne!(
        exact, sampled,
        "sampling at 4 KiB cannot be exact by chance"
    );
}

/// heapprofd writing to `out` on the allocator's probes (`--preload off`), exact or at
/// `rate`.
fn on_the_probes(out: &std::path::Path, rate: Option<&str>) -> std::process::Command {
    let mut command = heapprofd(out);
    command.args(["--preload", "off"]);
    if let Some(rate) = rate {
        command.args(["--sample-rate", rate]);
    }
    command
}

/// Allocated bytes of relay.c's sites (`relay` in the stack) on the allocator's probes
/// (`--preload off`), exact and at `rate`, and the run's `session_links`.
fn relayed_bytes(rate: Option<&str>) -> (i64, serde_json::Value) {
    let dir = scratch();
    let program = compile(dir.path(), "relay", "relay", &["-O1"]);
    let out = dir.path().join("profiles");
    let stats = dir.path().join("stats.json");
    run_ok(
        on_the_probes(&out, rate)
            .arg("--stats-json")
            .arg(&stats)
            .arg("--")
            .arg(&program)
            .arg("20000"),
    );
    let samples = samples(&last_profile(&out));
    let [_, bytes, _, _] = totals(&samples, |s| s.stack.iter().any(|f| f == "relay"));
    let text = std::fs::read_to_string(&stats).expect("heapprofd wrote no --stats-json");
    let json: serde_json::Value = serde_json::from_str(&text).expect("--stats-json is JSON");
    (bytes, json["session_links"].clone())
}

/// Whether this kernel has uprobe session links (6.13+) and heapprofd uses them here.
fn session_links_expected() -> bool {
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let mut parts = release
        .trim()
        .split(['.', '-'])
        .map(|p| p.parse::<u32>().unwrap_or(0));
    let version = (parts.next().unwrap_or(0), parts.next().unwrap_or(0));
    cfg!(target_arch = "x86_64") && version >= (6, 13)
}

/// On the probes, sampled: an unsampled call's return is skipped through a session
/// link, and the calls its function forwards to (glibc's memalign jumping to malloc)
/// must not be drawn a second time, nor strdup's malloc be missed. 22.9 MB are
/// allocated, about 22,000 samples at 1 KiB: 5% is several standard deviations.
#[test]
fn sampled_bytes_on_the_probes_count_forwarded_calls_once() {
    require_root();
    let (exact, _) = relayed_bytes(None);
    assert_eq!(exact, RELAYED_BYTES, "exact bytes");
    let session_links = assert_relayed_bytes_sampled_within_5_percent();
    if session_links_expected() {
        assert_eq!(session_links, true, "this kernel has uprobe session links");
    } else {
        assert_ne!(
            session_links, true,
            "session links on a kernel without them"
        );
    }
}

/// Another session's return probe on the same functions puts the kernel's trampoline
/// in place of the return address of every call that hits it, unsampled ones
/// included: here a second heapprofd's, on the C library, whose links are filtered
/// to another process (the kernel still takes the return of a session link's calls
/// in every process where the function has its breakpoint). The tail and nested
/// calls of an unsampled call must still not be drawn a second time.
#[test]
fn sampled_bytes_on_the_probes_count_forwarded_calls_once_beside_another_session() {
    require_root();
    let dir = scratch();
    let waiter = compile(dir.path(), "waiter", "waiter", &["-O1"]);
    // Waits for input all along: its process has the other session's breakpoints.
    let other = Driven::start(&waiter, &["10", "100"]);
    let out = dir.path().join("other");
    let (mut beside, log) = start_heapprofd(heapprofd(&out).args([
        "--pid",
        &other.pid(),
        "--inject",
        "off",
        "--sample-rate",
        "512KiB",
        "--interval",
        "1h",
    ]));
    assert_relayed_bytes_sampled_within_5_percent();
    signal(&beside, libc::SIGINT);
    wait_success(&mut beside, &log, "the other session");
    drop(other);
}

/// The bytes relay.c allocates at its `relay` sites with 20,000 iterations.
const RELAYED_BYTES: i64 = 20_000 * (200 + 300 + 500 + 44 + 100);

/// Checks relay.c's sampled bytes at 1 KiB: 22.9 MB are allocated, about 22,000
/// samples, so 5% is several standard deviations. Returns the run's `session_links`.
fn assert_relayed_bytes_sampled_within_5_percent() -> serde_json::Value {
    let (sampled, session_links) = relayed_bytes(Some("1KiB"));
    let exact = RELAYED_BYTES;
    let error = (sampled - exact).abs() as f64 / exact as f64;
    assert!(
        error <= 0.05,
        "sampled estimate {sampled} is {:.1}% from the exact {exact}",
        error * 100.0
    );
    session_links
}

/// Allocated bytes at the sites of nesting.cpp's functions `news` and `siblings` on the
/// allocator's probes (`--preload off`), exact or at `rate`.
fn nesting_bytes(program: &std::path::Path, rate: Option<&str>) -> (i64, i64) {
    let dir = scratch();
    let out = dir.path().join("profiles");
    run_ok(
        on_the_probes(&out, rate)
            .arg("--")
            .arg(program)
            .arg(NESTING_ITERATIONS.to_string()),
    );
    let samples = samples(&last_profile(&out));
    let of = |function: &str| totals(&samples, |s| s.stack.iter().any(|f| f.contains(function)))[1];
    (of("news"), of("siblings"))
}

/// Iterations of nesting.cpp: 24 MB through `news`, 18 MB through `siblings`, about
/// 41,000 samples at 1 KiB.
const NESTING_ITERATIONS: i64 = 20_000;

/// On the probes, sampled: a call made inside an unsampled one (jemalloc's aligned
/// `new` calling `aligned_alloc`, its nothrow `new[]` jumping to nothrow `new`) is not
/// drawn a second time, and
/// calls that follow one another from one frame with the same size and registers
/// (`malloc`, `aligned_alloc`, `calloc`) are each drawn, not taken for one call's tail
/// calls. A second draw would show about twice the bytes; a lost one, a third less.
#[test]
fn sampled_bytes_on_the_probes_count_nested_and_sibling_calls_once() {
    require_root();
    let dir = scratch();
    let program = compile_exact(
        "g++",
        dir.path(),
        "nesting.cpp",
        "nesting",
        &[
            "-g",
            "-O2",
            "-fno-builtin",
            "-fno-omit-frame-pointer",
            // Before the source, so kept whether or not the program uses it.
            "-Wl,--no-as-needed",
            "-l:libjemalloc.so.2",
        ],
    );
    let exact = nesting_bytes(&program, None);
    assert_eq!(
        exact,
        (
            NESTING_ITERATIONS * (200 + 400 + 600),
            NESTING_ITERATIONS * 3 * 300
        ),
        "exact bytes of news and siblings"
    );
    let sampled = nesting_bytes(&program, Some("1KiB"));
    for (name, exact, sampled) in [
        ("news", exact.0, sampled.0),
        ("siblings", exact.1, sampled.1),
    ] {
        let error = (sampled - exact).abs() as f64 / exact as f64;
        assert!(
            error <= 0.05,
            "{name}: sampled estimate {sampled} is {:.1}% from the exact {exact}",
            error * 100.0
        );
    }
}

/// On the probes, sampled: a resize the entry does not sample skips its return only
/// when the live table does not hold its old block. shrink.c, on jemalloc, moves 200
/// sampled blocks of 1 MiB with unsampled resizes; were their returns skipped, the
/// blocks would stay in use (200 MiB) after the program freed them.
/// Two probed functions whose probes share their page offset (page_twins.c: each
/// begins a page, and both probes sit on their first instruction, the same push): the
/// session program's table of slots by page offset names neither, and it
/// takes their slots from the attach cookie. Sampled at 1 byte every block is drawn, so
/// the estimates are the program's own counts. An `--allocator` function's call always
/// asks for its return, so the thread's count of awaited returns rises and falls at
/// every call.
#[test]
fn probes_that_share_a_page_offset_count_every_sampled_call() {
    require_root();
    let dir = scratch();
    let program = compile(dir.path(), "page_twins", "page_twins", &["-O2"]);
    let out = dir.path().join("profiles");
    let stats = dir.path().join("stats.json");
    let run = run_ok(
        on_the_probes(&out, Some("1"))
            .args([
                "--allocator",
                "alloc=twin_alloc(size=arg1,ret) free=twin_free(ptr=arg1)",
                "--stats-json",
            ])
            .arg(&stats)
            .arg("--")
            .arg(&program),
    );
    let printed = counted::parse_printed(&String::from_utf8_lossy(&run.stdout));
    let samples = samples(&last_profile(&out));
    let twins = totals(&samples, |s| counted::leaf(s) == "twin_alloc");
    assert_eq!(
        twins, printed.total,
        "twin_alloc's blocks (allocated objects, bytes, in use objects, bytes)"
    );
    let text = std::fs::read_to_string(&stats).expect("heapprofd wrote no --stats-json");
    let json: serde_json::Value = serde_json::from_str(&text).expect("--stats-json is JSON");
    if session_links_expected() {
        assert_eq!(
            json["session_links"], true,
            "this kernel has uprobe session links"
        );
    }
}

#[test]
fn a_sampled_resize_on_the_probes_releases_the_block_it_moved() {
    require_root();
    let dir = scratch();
    let program = compile(
        dir.path(),
        "shrink",
        "shrink",
        &["-O1", "-Wl,--no-as-needed", "-l:libjemalloc.so.2"],
    );
    let out = dir.path().join("profiles");
    run_ok(
        heapprofd(&out)
            .args(["--preload", "off", "--sample-rate", "64KiB", "--"])
            .arg(&program)
            .arg("200"),
    );
    let samples = samples(&last_profile(&out));
    let [_, allocated, _, in_use] = totals(&samples, |s| s.stack.iter().any(|f| f == "shrink"));
    assert!(
        allocated >= 200 << 20,
        "the 200 blocks of 1 MiB were sampled: {allocated} bytes allocated"
    );
    assert_eq!(in_use, 0, "bytes still in use after every block was freed");
}

/// The programs that ran in a launched run of family.c (4 threads, each waking the
/// others through futexes), from `--stats-json` with `--bpf-stats`: name to runs.
fn programs_that_ran(rate: Option<&str>) -> std::collections::BTreeMap<String, u64> {
    let dir = scratch();
    let program = compile(dir.path(), "family", "family", &["-O2"]);
    let out = dir.path().join("profiles");
    let stats = dir.path().join("stats.json");
    let mut command = heapprofd(&out);
    if let Some(rate) = rate {
        command.args(["--sample-rate", rate]);
    }
    run_ok(
        command
            .arg("--bpf-stats")
            .arg("--stats-json")
            .arg(&stats)
            .arg("--")
            .arg(&program)
            .args(["4", "1500"]),
    );
    let text = std::fs::read_to_string(&stats).expect("heapprofd wrote no --stats-json");
    let json: serde_json::Value = serde_json::from_str(&text).expect("--stats-json is JSON");
    json["bpf_run_time"]["programs"]
        .as_array()
        .unwrap_or_else(|| panic!("no bpf_run_time.programs in {text}"))
        .iter()
        .map(|p| {
            let name = p["name"].as_str().unwrap_or_default().to_owned();
            (name, p["runs"].as_u64().unwrap_or_default())
        })
        .collect()
}

/// Sampled, the preload library reports its few records at once, so heapprofd runs no
/// program on every context switch and system call of the host to apply queued ones;
/// exact, it must (queued records are applied before a thread sleeps or wakes another),
/// and where the kernel has `futex`'s own tracepoint the host's other system calls run
/// no program.
#[test]
fn a_sampled_session_runs_nothing_at_each_context_switch_or_system_call() {
    require_root();
    let per_thread = [
        names::PROG_SWITCH,
        names::PROG_SYSCALL,
        names::PROG_FUTEX_ENTRY,
        names::PROG_EXEC_ENTRY,
    ];
    let exact = programs_that_ran(None);
    let ran = |name: &str| exact.get(name).is_some_and(|runs| *runs > 0);
    assert!(
        ran(names::PROG_SWITCH),
        "exact: {} never ran: {exact:?}",
        names::PROG_SWITCH
    );
    // One of the two futex programs: the tracepoint's where the kernel has it.
    let futex_tracepoint =
        std::path::Path::new("/sys/kernel/tracing/events/syscalls/sys_enter_futex").exists();
    let (futex, other) = if futex_tracepoint {
        (names::PROG_FUTEX_ENTRY, names::PROG_SYSCALL)
    } else {
        (names::PROG_SYSCALL, names::PROG_FUTEX_ENTRY)
    };
    assert!(ran(futex), "exact: {futex} never ran: {exact:?}");
    assert_eq!(exact.get(other), None, "exact: {other} ran too: {exact:?}");
    let sampled = programs_that_ran(Some("4KiB"));
    assert!(
        sampled
            .get(names::PROG_PRELOAD)
            .is_some_and(|runs| *runs > 0),
        "sampled: the library reported nothing: {sampled:?}"
    );
    for name in per_thread {
        assert_eq!(sampled.get(name), None, "sampled: {name} ran: {sampled:?}");
    }
}
