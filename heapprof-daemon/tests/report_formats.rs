//! `heapprofd report` on real profiles of tests/programs/stacks.c (main calls a and b,
//! a calls b): every single-profile format, a difference, and bad input.

mod common;

use std::{
    ffi::OsStr,
    path::{Path, PathBuf},
    process::{Command, Output},
};

use common::*;

/// `heapprofd report ARGS`'s output, whatever its status.
fn report(args: &[&OsStr]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_heapprofd"))
        .arg("report")
        .args(args)
        .output()
        .expect("starting heapprofd report")
}

/// Everything a command printed, for a panic message.
fn describe(what: &str, output: &Output) -> String {
    format!(
        "{what}: {}\nstdout:\n{}\nstderr:\n{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

/// The standard output of `heapprofd report ARGS`, which must succeed.
fn report_ok(args: &[&OsStr]) -> String {
    let output = report(args);
    assert!(
        output.status.success(),
        "{}",
        describe(&format!("heapprofd report {args:?}"), &output)
    );
    String::from_utf8(output.stdout).expect("the report is UTF-8")
}

/// Profiles `program` with `heapprofd -o DIR -- PROGRAM`; returns the final profile.
fn profile_run(program: &Path, out: &Path) -> PathBuf {
    run_ok(heapprofd(out).arg("--").arg(program));
    read_profiles(out)
        .pop()
        .unwrap_or_else(|| panic!("no profile in {}", out.display()))
        .0
}

/// The totals of the final profile: alloc_objects, alloc_space, inuse_objects, inuse_space.
fn totals_of(path: &Path) -> [i64; 4] {
    totals(&samples(&decode(path)), |_| true)
}

/// `(values, site)` of each row of a top table: LIVE BYTES, LIVE, TOTAL BYTES, TOTAL.
fn top_rows(table: &str) -> Vec<([i64; 4], String)> {
    table
        .lines()
        .skip(2)
        .filter_map(|line| {
            let mut fields = line.split_whitespace();
            let mut values = [0; 4];
            for value in &mut values {
                *value = fields.next()?.parse().ok()?;
            }
            let site = line
                .split_once("  malloc ")
                .map(|(_, s)| format!("malloc {s}"))?;
            Some((values, site))
        })
        .collect()
}

/// The row of the site whose description starts with `prefix` (the callers after
/// main are libc's start code).
fn row<'a>(rows: &'a [([i64; 4], String)], prefix: &str, table: &str) -> &'a [i64; 4] {
    let found: Vec<_> = rows.iter().filter(|(_, s)| s.starts_with(prefix)).collect();
    assert_eq!(found.len(), 1, "one row for {prefix:?} in:\n{table}");
    &found[0].0
}

/// The value(s) of the folded line whose stack ends in `;suffix` (or is `suffix`); the
/// frames above main are libc's start code.
fn folded_value(folded: &str, suffix: &str) -> String {
    let values: Vec<&str> = folded
        .lines()
        .filter_map(|line| {
            let (stack, values) = line.split_once(&format!("{suffix} "))?;
            (stack.is_empty() || stack.ends_with(';')).then_some(values)
        })
        .collect();
    assert_eq!(values.len(), 1, "one line for {suffix:?} in:\n{folded}");
    values[0].to_owned()
}

/// The sum of the (last) values of folded lines.
fn folded_sum(folded: &str) -> i64 {
    folded
        .lines()
        .map(|l| {
            l.rsplit(' ')
                .next()
                .and_then(|v| v.parse::<i64>().ok())
                .unwrap_or_else(|| panic!("no value at the end of {l:?}"))
        })
        .sum()
}

fn check_top(profile: &OsStr, totals: [i64; 4]) {
    let table = report_ok(&[profile]);
    assert!(
        table
            .lines()
            .nth(1)
            .is_some_and(|l| l.contains("LIVE BYTES")),
        "{table}"
    );
    let rows = top_rows(&table);
    assert_eq!(
        *row(&rows, "malloc in a <- main", &table),
        [1000, 1, 1000, 1]
    );
    assert_eq!(
        *row(&rows, "malloc in b <- a <- main", &table),
        [100, 1, 100, 1]
    );
    assert_eq!(*row(&rows, "malloc in b <- main", &table), [100, 1, 100, 1]);
    assert!(
        rows.windows(2).all(|w| w[0].0[0] >= w[1].0[0]),
        "sorted by in-use bytes:\n{table}"
    );
    assert!(rows.iter().map(|r| r.0[0]).sum::<i64>() <= totals[3]);

    let by_objects = report_ok(&[profile, "--sample-index".as_ref(), "alloc_objects".as_ref()]);
    let rows = top_rows(&by_objects);
    assert!(
        rows.windows(2).all(|w| w[0].0[3] >= w[1].0[3]),
        "sorted by allocated objects:\n{by_objects}"
    );
    let one = report_ok(&[profile, "--top".as_ref(), "1".as_ref()]);
    assert_eq!(top_rows(&one).len(), 1, "--top 1:\n{one}");
}

fn check_collapsed(profile: &OsStr, totals: [i64; 4]) {
    for (sample_type, total) in [
        ("inuse_space", totals[3]),
        ("alloc_objects", totals[0]),
        ("alloc_space", totals[1]),
    ] {
        let folded = report_ok(&[
            profile,
            "--format".as_ref(),
            "collapsed".as_ref(),
            "--sample-index".as_ref(),
            sample_type.as_ref(),
        ]);
        assert_eq!(folded_sum(&folded), total, "{sample_type}:\n{folded}");
        let lines: Vec<&str> = folded.lines().collect();
        assert!(lines.windows(2).all(|w| w[0] < w[1]), "sorted:\n{folded}");
    }
    let folded = report_ok(&[profile, "--format".as_ref(), "collapsed".as_ref()]);
    assert_eq!(folded_value(&folded, "main;a;b;malloc"), "100");
    assert_eq!(folded_value(&folded, "main;a;malloc"), "1000");
    assert_eq!(folded_value(&folded, "main;b;malloc"), "100");
}

/// Parses an SVG with a real XML parser (inferno's has a DOCTYPE), failing with the
/// parser's message and the start of the file.
fn parse_svg(svg: &str) -> Result<roxmltree::Document<'_>, String> {
    let options = roxmltree::ParsingOptions {
        allow_dtd: true,
        ..Default::default()
    };
    roxmltree::Document::parse_with_options(svg, options)
        .map_err(|e| format!("{e}; it starts {:?}", &svg[..svg.len().min(400)]))
}

fn check_flamegraph(profile: &OsStr, dir: &Path) {
    let svg_path = dir.join("flame.svg");
    let stdout = report_ok(&[
        profile,
        "--format".as_ref(),
        "flamegraph".as_ref(),
        "-o".as_ref(),
        svg_path.as_os_str(),
    ]);
    assert!(
        stdout.is_empty(),
        "-o: nothing on standard output: {stdout}"
    );
    let svg = std::fs::read_to_string(&svg_path).expect("reading the SVG");
    let document = parse_svg(&svg).unwrap_or_else(|e| panic!("the flamegraph is not XML: {e}"));
    assert_eq!(document.root_element().tag_name().name(), "svg");
    let texts: Vec<&str> = document
        .descendants()
        .filter(|n| n.has_tag_name("text"))
        .filter_map(|n| n.text())
        .collect();
    let name = Path::new(profile)
        .file_name()
        .and_then(OsStr::to_str)
        .expect("a file name");
    assert!(
        texts
            .iter()
            .any(|t| t.contains(name) && t.contains("inuse_space")),
        "the title names the file and the sample type: {texts:?}"
    );
    // Each frame is a <g> whose <title> reads "NAME (N bytes, P%)".
    let frames: Vec<&str> = document
        .descendants()
        .filter(|n| n.has_tag_name("title"))
        .filter_map(|n| n.text())
        .filter_map(|t| t.split(" (").next())
        .collect();
    for frame in ["main", "a", "b", "malloc"] {
        assert!(frames.contains(&frame), "frame {frame} missing: {frames:?}");
    }
}

/// `google-pprof --text --show_bytes [FLAGS] PROGRAM LEGACY`: the rows (flat, cum, name).
fn google_pprof(program: &Path, legacy: &Path, flags: &[&str]) -> Vec<(i64, i64, String)> {
    let output = Command::new("google-pprof")
        .args(["--text", "--show_bytes"])
        .args(flags)
        .arg(program)
        .arg(legacy)
        .output()
        .expect("running google-pprof (apt-get install google-perftools: cargo xtask setup)");
    let text = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "{}",
        describe("google-pprof", &output)
    );
    // "    1000  83.3%  83.3%     1200 100.0% a"
    let rows: Vec<(i64, i64, String)> = text
        .lines()
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            if fields.len() < 6 {
                return None;
            }
            Some((
                fields[0].parse().ok()?,
                fields[3].parse().ok()?,
                fields[5..].join(" "),
            ))
        })
        .collect();
    assert!(!rows.is_empty(), "{}", describe("google-pprof", &output));
    rows
}

fn check_legacy(profile: &OsStr, program: &Path, dir: &Path) {
    let legacy = dir.join("heap.legacy");
    report_ok(&[
        profile,
        "--format".as_ref(),
        "legacy".as_ref(),
        "-o".as_ref(),
        legacy.as_os_str(),
    ]);
    let text = std::fs::read_to_string(&legacy).expect("reading the legacy file");
    assert!(
        text.starts_with("heap profile: ") && text.contains("\nMAPPED_LIBRARIES:\n"),
        "{text}"
    );
    let program_path = program.to_str().expect("a UTF-8 path");
    assert!(
        text.lines()
            .any(|l| l.contains(" r-xp ") && l.ends_with(&format!(" {program_path}"))),
        "the program's mapping:\n{text}"
    );
    for (flags, a, b, main) in [
        // flat, cum of a; of b; cum of main: a holds 1000 bytes itself and 1100 with
        // b below it, b 200 bytes from two calls, main all 1200.
        (&[][..], (1000, 1100), (200, 200), 1200),
        (&["--inuse_objects"][..], (1, 2), (2, 2), 3),
        (&["--alloc_space"][..], (1000, 1100), (200, 200), 1200),
    ] {
        let rows = google_pprof(program, &legacy, flags);
        let find = |name: &str| {
            rows.iter()
                .find(|r| r.2 == name)
                .map(|r| (r.0, r.1))
                .unwrap_or_else(|| {
                    panic!("google-pprof {flags:?} shows no {name}: {rows:?}\n{text}")
                })
        };
        assert_eq!(find("a"), a, "a, google-pprof {flags:?}: {rows:?}");
        assert_eq!(find("b"), b, "b, google-pprof {flags:?}: {rows:?}");
        assert_eq!(
            find("main").1,
            main,
            "main, google-pprof {flags:?}: {rows:?}"
        );
        assert_eq!(find("main").0, 0, "main allocates nothing itself: {rows:?}");
    }
}

/// The session formats on a one-profile session: the timeline's rows hold the exact
/// in-use of the process and of each site; one profile makes no suspect.
fn check_session_formats(dir: &Path, totals: [i64; 4]) {
    let csv = report_ok(&[dir.as_os_str(), "--format".as_ref(), "timeline".as_ref()]);
    let rows: Vec<Vec<&str>> = csv
        .lines()
        .skip(1)
        .map(|l| l.split(',').collect())
        .collect();
    let inuse_of = |site: &str| -> Option<i64> {
        rows.iter()
            .find(|row| row[4] == site)
            .and_then(|row| row[5].parse().ok())
    };
    assert_eq!(inuse_of("*"), Some(totals[3]), "{csv}");
    assert_eq!(inuse_of("malloc in a <- main"), Some(1000), "{csv}");
    assert_eq!(inuse_of("malloc in b <- a <- main"), Some(100), "{csv}");
    assert_eq!(inuse_of("malloc in b <- main"), Some(100), "{csv}");
    let process_row = rows
        .iter()
        .find(|row| row[4] == "*")
        .expect("a process row");
    let vm_rss: i64 = process_row[7].parse().unwrap_or(0);
    assert!(vm_rss > 0, "the process row carries its RSS: {csv}");
    let suspects = report_ok(&[dir.as_os_str(), "--format".as_ref(), "suspects".as_ref()]);
    assert!(
        suspects.contains("No suspects: a trend needs at least 3 profiles"),
        "{suspects}"
    );
}

#[test]
fn every_format_of_a_real_profile() {
    require_root();
    let dir = scratch();
    let program = compile(dir.path(), "stacks", "stacks", &["-O0"]);
    let profile = profile_run(&program, &dir.path().join("profiles"));
    let totals = totals_of(&profile);
    check_top(profile.as_os_str(), totals);
    check_collapsed(profile.as_os_str(), totals);
    check_flamegraph(profile.as_os_str(), dir.path());
    check_legacy(profile.as_os_str(), &program, dir.path());
    check_session_formats(&dir.path().join("profiles"), totals);

    // A directory: its newest profile, named on standard error.
    let output = report(&[dir.path().join("profiles").as_os_str()]);
    assert!(
        output.status.success(),
        "{}",
        describe("report DIR", &output)
    );
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains(&*profile.to_string_lossy()),
        "{}",
        describe("report DIR names the newest profile", &output)
    );
}

#[test]
fn a_sampled_profile_reads_back_as_its_estimates_in_google_pprof() {
    require_root();
    let dir = scratch();
    let program = compile(dir.path(), "stacks", "stacks", &["-O0"]);
    let out = dir.path().join("profiles");
    // At one sample per 64 bytes on average every 100-byte block is likely, and the
    // chance that none of the 1200 bytes is sampled is e^-18.75.
    run_ok(
        heapprofd(&out)
            .args(["--sample-rate", "64", "--"])
            .arg(&program),
    );
    let profile = read_profiles(&out).pop().expect("a profile").0;
    let inuse = totals_of(&profile)[3];
    let legacy = dir.path().join("heap.legacy");
    report_ok(&[
        profile.as_os_str(),
        "--format".as_ref(),
        "legacy".as_ref(),
        "-o".as_ref(),
        legacy.as_os_str(),
    ]);
    let text = std::fs::read_to_string(&legacy).expect("reading the legacy file");
    assert!(
        text.lines()
            .next()
            .is_some_and(|l| l.ends_with(" @ heap_v2/64")),
        "{text}"
    );
    // google-pprof scales the sampled counts back up; the estimates, the sampled bytes
    // and google-pprof's figures are each rounded: allow two bytes per stack (three).
    let rows = google_pprof(&program, &legacy, &[]);
    let flat: i64 = rows.iter().map(|r| r.0).sum();
    assert!(
        (flat - inuse).abs() <= 6,
        "google-pprof reads {flat} bytes, the profile holds {inuse}: {rows:?}\n{text}"
    );
}

#[test]
fn base_gives_the_difference_from_a_run_that_allocated_less() {
    require_root();
    let dir = scratch();
    let program = compile(dir.path(), "stacks", "stacks", &["-O0"]);
    // stacks.c without main's call of b: the same functions, 100 bytes less.
    let less = compile(dir.path(), "stacks", "less", &["-O0", "-DWITHOUT_MAIN_B"]);
    let new = profile_run(&program, &dir.path().join("new"));
    let old = profile_run(&less, &dir.path().join("old"));
    let base = ["--base".as_ref(), old.as_os_str()];

    let folded = report_ok(
        &[
            &[new.as_os_str()][..],
            &base,
            &["--format".as_ref(), "collapsed".as_ref()],
        ]
        .concat(),
    );
    assert_eq!(folded_value(&folded, "main;b;malloc"), "0 100");
    assert_eq!(folded_value(&folded, "main;a;malloc"), "1000 1000");
    assert_eq!(folded_value(&folded, "main;a;b;malloc"), "100 100");

    let table = report_ok(&[&[new.as_os_str()][..], &base].concat());
    let rows = top_rows(&table);
    assert_eq!(*row(&rows, "malloc in b <- main", &table), [100, 1, 100, 1]);
    assert!(
        !rows
            .iter()
            .any(|(_, s)| s.starts_with("malloc in a <- main")),
        "a's site did not change:\n{table}"
    );
    assert!(
        table
            .lines()
            .skip(2)
            .all(|l| l.trim_start().starts_with(['+', '-'])),
        "signed values:\n{table}"
    );

    // The other way round, b's site shrank.
    let reverse = report_ok(&[old.as_os_str(), "--base".as_ref(), new.as_os_str()]);
    assert!(
        reverse
            .lines()
            .any(|l| l.trim_start().starts_with("-100 ") && l.contains("malloc in b <- main")),
        "{reverse}"
    );

    let svg = report_ok(
        &[
            &[new.as_os_str()][..],
            &base,
            &["--format".as_ref(), "flamegraph".as_ref()],
        ]
        .concat(),
    );
    parse_svg(&svg).unwrap_or_else(|e| panic!("the differential flamegraph is not XML: {e}"));
}

#[test]
fn bad_input_is_one_error_line_and_status_2() {
    let dir = scratch();
    let text = dir.path().join("notes.txt");
    std::fs::write(&text, "this is not a profile\n").expect("writing notes.txt");
    for args in [
        vec![text.as_os_str()],
        vec![text.as_os_str(), "--format".as_ref(), "legacy".as_ref()],
        vec![dir.path().as_os_str()],
    ] {
        let output = report(&args);
        let what = describe(&format!("heapprofd report {args:?}"), &output);
        assert_eq!(output.status.code(), Some(2), "{what}");
        let stderr = String::from_utf8_lossy(&output.stderr);
        let lines: Vec<&str> = stderr.lines().collect();
        assert_eq!(lines.len(), 1, "{what}");
        assert!(lines[0].starts_with("heapprofd: error: "), "{what}");
        assert!(output.stdout.is_empty(), "{what}");
    }
}
