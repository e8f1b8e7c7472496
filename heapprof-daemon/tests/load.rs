//! Load: many threads and many live blocks, counted exactly.
//!
//! The scale is small enough for the suite by default; `cargo xtask stress` sets
//! `HEAPPROFD_LOAD=full` for the full scale (8 threads x 1M allocations, 1M
//! live blocks) and shows the figures printed here (`--nocapture`). Each test alone is
//! already the machine's whole load: they run one at a time (`serial`).

mod common;

use std::time::Instant;

use common::*;

/// The program's own count: "expect A B C D" (allocated objects and bytes, in use).
fn parse_expectation(line: &str) -> [i64; 4] {
    let values: Vec<i64> = line
        .strip_prefix("expect ")
        .unwrap_or_else(|| panic!("the load program printed {line:?}, not its count"))
        .split(' ')
        .map(|v| v.parse().expect("a number"))
        .collect();
    values.try_into().expect("four numbers")
}

/// Peak resident memory of a process in KiB (VmHWM).
fn peak_rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|status| {
            status
                .lines()
                .find(|l| l.starts_with("VmHWM:"))?
                .split_whitespace()
                .nth(1)?
                .parse()
                .ok()
        })
        .unwrap_or(0)
}

/// What a run of the load program under heapprofd gave.
struct LoadRun {
    profile: heapprof_daemon::pprof::proto::Profile,
    /// heapprofd's log after attaching.
    log: Vec<String>,
    /// The program's own count.
    expected: [i64; 4],
    /// Seconds the work took under heapprofd, and heapprofd's peak RSS (KiB).
    worked: f64,
    rss_kib: u64,
    /// What `heapprofd report` wrote about the session: the top table, the suspects,
    /// the HTML page, and the timeline's standard error.
    reports: [String; 7],
}

impl LoadRun {
    /// The drop counter of a reason as the profile's comments give it.
    fn dropped(&self, reason: heapprof_common::DropReason) -> i64 {
        drop_count(&self.profile, reason)
    }
}

/// Runs `load ARGS` under `heapprofd --pid` with `flags`.
fn run(args: &[&str], flags: &[&str]) -> LoadRun {
    require_root();
    let _serial = serial();
    let dir = scratch();
    let binary = compile(dir.path(), "load", "load", &["-O2"]);
    let out = dir.path().join("profiles");
    let mut load = Driven::start(&binary, args);
    let (mut heapprofd, log) = start_heapprofd(
        heapprofd(&out)
            .args(["--interval", "1h"])
            .args(flags)
            .args(["--pid", &load.pid()]),
    );
    let started = Instant::now();
    let expected = parse_expectation(&load.step_reading());
    let worked = started.elapsed();
    load.expect_line("done");
    let rss_kib = peak_rss_kib(heapprofd.id());
    load.finish();
    wait_success(&mut heapprofd, &log, "load");
    LoadRun {
        profile: last_profile(&out),
        log: log.try_iter().collect(),
        expected,
        worked: worked.as_secs_f64(),
        rss_kib,
        reports: reports_of(&out),
    }
}

/// The reports of a session's directory (see [`LoadRun::reports`]).
fn reports_of(out: &std::path::Path) -> [String; 7] {
    let report = |args: &[&str]| {
        let output = std::process::Command::new(env!("CARGO_BIN_EXE_heapprofd"))
            .arg("report")
            .arg(out)
            .args(args)
            .output()
            .expect("running heapprofd report");
        assert!(output.status.success(), "report {args:?}: {output:?}");
        output
    };
    let page = out.with_extension("html");
    report(&["--html", page.to_str().expect("a UTF-8 path")]);
    [
        String::from_utf8_lossy(&report(&[]).stdout).into_owned(),
        String::from_utf8_lossy(&report(&["--format", "suspects"]).stdout).into_owned(),
        std::fs::read_to_string(&page).expect("the HTML page"),
        String::from_utf8_lossy(&report(&["--format", "timeline"]).stderr).into_owned(),
        String::from_utf8_lossy(&report(&["--format", "sizes"]).stdout).into_owned(),
        String::from_utf8_lossy(&report(&["--format", "collapsed"]).stderr).into_owned(),
        String::from_utf8_lossy(&report(&["--format", "legacy"]).stderr).into_owned(),
    ]
}

/// Runs `load ARGS` with `flags`, checks that nothing was dropped; returns the totals
/// over the samples allocated in `function`, and the program's own count.
fn run_load(args: &[&str], flags: &[&str], function: &str) -> ([i64; 4], [i64; 4]) {
    let run = run(args, flags);
    let samples = samples(&run.profile);
    let counted = totals(&samples, |s| s.stack.get(1).is_some_and(|f| f == function));
    let lost = heapprof_daemon::report::losses::losses(&comments(&run.profile));
    assert!(lost.is_empty(), "nothing may be dropped: {lost:?}");
    println!(
        "load {}: {} allocations counted in {function}(), exact; work took {:.2} s under \
         heapprofd; heapprofd peak RSS {:.1} MiB",
        args.join(" "),
        counted[0],
        run.worked,
        run.rss_kib as f64 / 1024.0
    );
    (counted, run.expected)
}

#[test]
fn eight_threads_allocating_at_once_are_counted_exactly() {
    let count = if full_scale() { "1000000" } else { "100000" };
    let (counted, expected) = run_load(&["threads", "8", count], &[], "thread_work");
    assert_eq!(
        counted, expected,
        "thread_work(): heapprofd's totals against the program's own count"
    );
}

#[test]
fn a_million_live_blocks_are_all_in_use() {
    let (count, capacity) = if full_scale() {
        ("1000000", "1100000")
    } else {
        ("200000", "250000")
    };
    let (counted, expected) = run_load(
        &["live", count],
        &["--max-live-blocks", capacity],
        "hold_live",
    );
    assert_eq!(
        counted, expected,
        "hold_live(): heapprofd's totals against the program's own count"
    );
}

/// Totals of the samples made in churn_leaf (with their stack or not).
fn churn_totals(run: &LoadRun) -> [i64; 4] {
    totals(&samples(&run.profile), |s| {
        s.stack.iter().any(|f| f == "churn_leaf")
            || s.stack.iter().any(|f| f.contains("not recorded"))
    })
}

#[test]
fn tiny_tables_count_what_they_drop_and_stay_consistent() {
    // 64 distinct stacks into a 16-entry site table: allocations at the sites that do
    // not fit are not counted, each one counted as a drop instead.
    let full_sites = run(&["stacks", "20000"], &["--max-sites", "16"]);
    let dropped = full_sites.dropped(heapprof_common::DropReason::SiteTableFull);
    let counted = churn_totals(&full_sites);
    assert!(dropped > 0, "a 16-entry site table overflows");
    assert_eq!(
        counted[0] + dropped,
        full_sites.expected[0],
        "counted + dropped = allocated"
    );
    assert!(counted[2] <= counted[0] && counted[3] <= counted[1]);
    assert!(
        full_sites
            .log
            .iter()
            .any(|l| l.contains("warn") && l.contains("site table full")),
        "the log warns: {:?}",
        full_sites.log
    );
    // Every report format says so, with the count and the flag that fixes it.
    let said = format!("lost: {dropped} events: site table full");
    for (format, text) in [
        "top",
        "suspects",
        "html",
        "timeline",
        "sizes",
        "collapsed",
        "legacy",
    ]
    .iter()
    .zip(&full_sites.reports)
    {
        assert!(
            text.contains(&said) && text.contains("raise --max-sites"),
            "{format} does not say what was lost:\n{text}"
        );
    }

    // Into a 16-entry stack table: every allocation is counted, exactly, some
    // under an unknown stack.
    let full_stacks = run(&["stacks", "20000"], &["--max-stacks", "16"]);
    assert!(full_stacks.dropped(heapprof_common::DropReason::StackTableFull) > 0);
    assert_eq!(churn_totals(&full_stacks), full_stacks.expected);
    let unknown = samples(&full_stacks.profile)
        .iter()
        .filter(|s| s.stack.iter().any(|f| f == "[stack not recorded]"))
        .count();
    assert!(
        unknown > 0,
        "allocations without a stored stack are shown as such"
    );

    // 64 threads at once and room for 32 threads' records (16 slots by thread id and
    // a 16-entry table for the threads whose slot is taken): calls that find no room
    // are not counted (and counted as drops); frees of blocks never counted are ignored.
    // The table pairs the probes' entry and return: a joined process needs none.
    let full_threads = run(
        &["threads", "64", "2000"],
        &["--max-threads", "16", "--inject", "off"],
    );
    assert!(full_threads.dropped(heapprof_common::DropReason::InFlightFull) > 0);
    let counted = totals(&samples(&full_threads.profile), |s| {
        s.stack.get(1).is_some_and(|f| f == "thread_work")
    });
    assert!(
        counted[0] > 0 && counted[0] < full_threads.expected[0],
        "{counted:?}"
    );
    assert!(
        counted[2] <= counted[0] && counted[3] <= counted[1],
        "{counted:?}"
    );
    assert!(
        counted[2] <= full_threads.expected[2],
        "in use never exceeds the truth"
    );
}
