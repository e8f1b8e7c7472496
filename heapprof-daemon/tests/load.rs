//! Load: many threads and many live blocks, counted exactly.
//!
//! The scale is small enough for the suite by default; `cargo xtask stress` sets
//! `HEAPPROFD_LOAD=full` for the full scale (8 threads x 1M allocations, 1M
//! live blocks) and shows the figures printed here (`--nocapture`).

mod common;

use std::{sync::Mutex, time::Instant};

use common::*;

/// One load test at a time: each one alone is already the machine's whole load.
static SERIAL: Mutex<()> = Mutex::new(());

fn full_scale() -> bool {
    std::env::var("HEAPPROFD_LOAD").is_ok_and(|v| v == "full")
}

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

/// Runs `load ARGS` under `heapprofd --pid` with `flags`; returns the profile's totals
/// over the samples allocated in `function`, and the program's own count.
fn run_load(args: &[&str], flags: &[&str], function: &str) -> ([i64; 4], [i64; 4]) {
    require_root();
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
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
    let rss = peak_rss_kib(heapprofd.id());
    load.finish();
    wait_success(&mut heapprofd, &log, "load");
    let profile = last_profile(&out);
    let samples = samples(&profile);
    let counted = totals(&samples, |s| s.stack.get(1).is_some_and(|f| f == function));
    let comments: Vec<&str> = profile
        .comment
        .iter()
        .map(|&i| profile.string_table[i as usize].as_str())
        .collect();
    let drops: Vec<&&str> = comments
        .iter()
        .filter(|c| c.starts_with("dropped:") && !c.ends_with("= 0"))
        .collect();
    assert!(drops.is_empty(), "nothing may be dropped: {drops:?}");
    println!(
        "load {}: {} allocations counted in {function}(), exact; work took {:.2} s under \
         heapprofd; heapprofd peak RSS {:.1} MiB",
        args.join(" "),
        counted[0],
        worked.as_secs_f64(),
        rss as f64 / 1024.0
    );
    (counted, expected)
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
