//! The views beside the totals, exact from BPF: temporary allocations, what each
//! stack held at the process's in-use peak, and size classes; checked on a program
//! whose answers are known (`programs/views.c`), with the preload library and with
//! the allocator probes.

mod common;

use common::*;
use heapprof_daemon::memstats::ProcessMemory;

const KIB: i64 = 1024;
const MIB: i64 = 1024 * KIB;

/// Sum of sample type `kind` over the samples whose caller is `function`.
fn total_at(samples: &[Sample], function: &str, kind: &str) -> i64 {
    samples
        .iter()
        .filter(|s| s.stack.get(1).is_some_and(|f| f == function))
        .map(|s| {
            *s.by_type
                .get(kind)
                .unwrap_or_else(|| panic!("no sample type {kind}: {s:?}"))
        })
        .sum()
}

/// Runs `views` under heapprofd with `flags` and checks every view of its final
/// profile.
fn views_are_exact(flags: &[&str]) {
    require_root();
    let dir = scratch();
    let program = compile(dir.path(), "views", "views", &["-O1"]);
    let out = dir.path().join("profiles");
    run_ok(heapprofd(&out).args(flags).arg("--").arg(&program));
    let profile = last_profile(&out);
    let samples = samples(&profile);
    let at = |function: &str, kind: &str| total_at(&samples, function, kind);

    // Temporaries: every block churn() makes is freed before the next allocation.
    // So is the last block big_b() makes: release() frees it before keep()
    // allocates again.
    assert_eq!(at("churn", "temp_objects"), 10_000, "{samples:#?}");
    assert_eq!(at("churn", "temp_space"), 640_000, "{samples:#?}");
    assert_eq!(at("big_a", "temp_objects"), 0, "{samples:#?}");
    assert_eq!(at("big_b", "temp_objects"), 1, "{samples:#?}");
    assert_eq!(at("big_b", "temp_space"), 256 * KIB, "{samples:#?}");
    assert_eq!(at("keep", "temp_objects"), 0, "{samples:#?}");

    // The peak: 10 MiB of big_a and 5 MiB of big_b; keep() came later, churn()'s
    // blocks were gone.
    assert_eq!(at("big_a", "peak_inuse_space"), 10 * MIB, "{samples:#?}");
    assert_eq!(at("big_a", "peak_inuse_objects"), 40, "{samples:#?}");
    assert_eq!(at("big_b", "peak_inuse_space"), 5 * MIB, "{samples:#?}");
    assert_eq!(at("big_b", "peak_inuse_objects"), 20, "{samples:#?}");
    assert_eq!(at("keep", "peak_inuse_space"), 0, "{samples:#?}");
    assert_eq!(at("churn", "peak_inuse_space"), 0, "{samples:#?}");
    let peak_total: i64 = samples.iter().map(|s| s.by_type["peak_inuse_space"]).sum();
    let memory: Vec<ProcessMemory> = comments(&profile)
        .iter()
        .filter_map(|c| ProcessMemory::parse_comment(c))
        .collect();
    assert_eq!(memory.len(), 1, "{memory:?}");
    assert_eq!(memory[0].peak_inuse, Some(15 * MIB as u64), "{memory:?}");
    assert_eq!(
        peak_total,
        15 * MIB,
        "the sites' values at the peak make the peak"
    );
    // What is left: keep()'s 8 MiB.
    assert_eq!(at("keep", "inuse_space"), 8 * MIB, "{samples:#?}");

    // Size classes: a label on every sample, the class's smallest size.
    let class_count = |function: &str, class: i64| -> i64 {
        samples
            .iter()
            .filter(|s| s.stack.get(1).is_some_and(|f| f == function))
            .filter(|s| s.labels.get("size_class") == Some(&class.to_string()))
            .map(|s| s.values[0])
            .sum()
    };
    assert_eq!(class_count("big_a", 256 * KIB), 40, "{samples:#?}");
    assert_eq!(class_count("big_b", 256 * KIB), 20, "{samples:#?}");
    assert_eq!(class_count("keep", MIB), 8, "{samples:#?}");
    assert_eq!(class_count("churn", 64), 10_000, "{samples:#?}");
    assert!(
        samples.iter().all(|s| s.labels.contains_key("size_class")),
        "every sample has its size class: {samples:#?}"
    );
    reports_show_the_views(&out);
}

/// `heapprofd report` shows the views of the session in `out`: the size table, the
/// top table's PEAK BYTES and TEMP, and the HTML page's tables.
fn reports_show_the_views(out: &std::path::Path) {
    let report = |args: &[&str]| {
        let output = run_ok(
            std::process::Command::new(env!("CARGO_BIN_EXE_heapprofd"))
                .arg("report")
                .arg(out)
                .args(args),
        );
        String::from_utf8(output.stdout).expect("utf8")
    };
    let sizes = report(&["--format", "sizes", "--sample-index", "alloc_objects"]);
    // The profile's classes first: 60 blocks of 256 KiB, 15 MiB.
    let first_row = |label: &str| {
        sizes
            .lines()
            .find(|l| l.starts_with(label))
            .unwrap_or_else(|| panic!("no row {label}:\n{sizes}"))
            .to_owned()
    };
    let big = first_row("256 KiB - 512 KiB");
    let fields: Vec<&str> = big.split_whitespace().collect();
    assert_eq!(fields[5..7], ["60", &(15 * MIB).to_string()], "{sizes}");
    let small = first_row("64 B - 128 B");
    assert_eq!(small.split_whitespace().nth(5), Some("10000"), "{sizes}");
    assert!(
        sizes.contains("malloc in churn"),
        "the top sites follow:\n{sizes}"
    );

    let top = report(&["--format", "top", "--sample-index", "peak_inuse_space"]);
    let header = top.lines().nth(1).unwrap_or_default();
    assert!(
        header.contains("PEAK BYTES") && header.contains("TEMP"),
        "{top}"
    );
    // Ranked by bytes at the peak: big_a, then big_b; nothing else held any.
    let rows: Vec<Vec<&str>> = top
        .lines()
        .skip(2)
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(rows.len(), 2, "{top}");
    assert_eq!(rows[0][4], (10 * MIB).to_string(), "{top}");
    assert!(rows[0].contains(&"big_a"), "{top}");
    assert_eq!(rows[1][4], (5 * MIB).to_string(), "{top}");
    assert_eq!(rows[1][5], "1", "big_b's one temporary: {top}");

    let page = out.join("report.html");
    report(&["--html", page.to_str().expect("utf8 path")]);
    let html = std::fs::read_to_string(&page).expect("the page");
    assert!(html.contains("<table id=\"peak-sites\">"), "peak holders");
    assert!(html.contains("<h2>Size classes</h2>"), "size classes");
    let peak_table = &html[html.find("peak-sites").expect("table")..];
    let peak_table = &peak_table[..peak_table.find("</table>").expect("table end")];
    let (a, b) = (peak_table.find("big_a"), peak_table.find("big_b"));
    assert!(
        a.is_some() && b.is_some() && a < b,
        "big_a held the most at the peak, then big_b: {peak_table}"
    );
}

#[test]
fn temporaries_peak_composition_and_size_classes_are_exact_with_the_preload_library() {
    views_are_exact(&[]);
}

#[test]
fn temporaries_peak_composition_and_size_classes_are_exact_with_the_allocator_probes() {
    views_are_exact(&["--preload", "off"]);
}
