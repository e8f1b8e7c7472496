//! The unwind-table build of the machine's largest library: `dlopen()` under
//! heapprofd (launch mode), runs with it against runs with its dependencies only.

use std::{
    fmt::Write as _,
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use anyhow::{Context as _, Result, bail};
use serde_json::{Value, json};

use super::{
    Bench,
    figures::{DaemonStats, Tables},
    summary::{Spread, number, spread},
};

impl Bench {
    /// One launch-mode run of `heapprofd -- bench_dlopen LIBRARIES...`: its unwind tables.
    pub(super) fn dlopen_tables(&self, program: &Path, libraries: &[String]) -> Result<Tables> {
        let stats = self.stats_path();
        let output = Command::new(&self.heapprofd)
            .arg("-o")
            .arg(self.dir.join("profiles"))
            .arg("--stats-json")
            .arg(&stats)
            .args([
                "--interval",
                "1h",
                "--max-unwind-rows",
                &LIBRARY_ROWS.to_string(),
            ])
            .arg("--")
            .arg(program)
            .args(libraries)
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .output()
            .context("running heapprofd -- bench_dlopen")?;
        let log: Vec<String> = String::from_utf8_lossy(&output.stderr)
            .lines()
            .map(str::to_owned)
            .collect();
        if !output.status.success() {
            bail!(
                "heapprofd -- bench_dlopen failed ({}):\n{}",
                output.status,
                log.join("\n")
            );
        }
        let tables = DaemonStats::read(&stats)?.unwind_tables.with_context(|| {
            format!(
                "heapprofd counted no unwind tables ({}):\n{}",
                stats.display(),
                log.join("\n")
            )
        })?;
        Ok(tables.tables())
    }

    /// The unwind-table build of the largest library that dlopen() loads, isolated: runs
    /// that load only its dependencies against runs that load them and it, interleaved.
    pub(super) fn largest_library(&self, program: &Path, runs: usize) -> Result<LibraryBuild> {
        let mut skipped = Vec::new();
        for (path, size) in libraries_by_size().into_iter().take(5) {
            let library = path.display().to_string();
            let listed = Command::new(program)
                .args(["--new-objects", &library])
                .stdin(Stdio::null())
                .output()
                .context("running bench_dlopen --new-objects")?;
            if !listed.status.success() {
                skipped.push(format!(
                    "{library} ({} MiB): dlopen failed: {}",
                    size >> 20,
                    String::from_utf8_lossy(&listed.stderr).trim()
                ));
                continue;
            }
            let dependencies: Vec<String> = String::from_utf8_lossy(&listed.stdout)
                .lines()
                .map(str::to_owned)
                .collect();
            let mut all = dependencies.clone();
            all.push(library.clone());
            let (mut without, mut with) = (Vec::new(), Vec::new());
            for _ in 0..runs {
                without.push(self.dlopen_tables(program, &dependencies)?);
                with.push(self.dlopen_tables(program, &all)?);
            }
            return Ok(LibraryBuild {
                library,
                size,
                dependencies: dependencies.len(),
                without,
                with,
                skipped,
            });
        }
        bail!(
            "no library of the machine could be dlopen()ed: {}",
            skipped.join("; ")
        )
    }
}

/// Unwind-row capacity of the largest-library runs (64 MiB of map; the default is 2^21).
pub(super) const LIBRARY_ROWS: u32 = 1 << 23;
/// heapprofd's default `--max-unwind-rows`.
pub(super) const DEFAULT_ROWS: u64 = 1 << 21;

/// The largest library's table build (see `Bench::largest_library`).
pub(super) struct LibraryBuild {
    library: String,
    size: u64,
    dependencies: usize,
    without: Vec<Tables>,
    with: Vec<Tables>,
    /// Larger libraries that could not be loaded, and why.
    skipped: Vec<String>,
}

/// What the library's table adds, from the medians of the runs with it and without.
struct Growth {
    build_with: Spread,
    build_without: Spread,
    /// Build and load of its table, ms: the medians' difference.
    build: f64,
    rows: f64,
    rules: f64,
    kib: f64,
    /// Rows in all with it.
    rows_with: f64,
    /// Objects whose table did not fit, the most of a run with it.
    not_fitting: u64,
    /// Objects without it and with it.
    objects: (f64, f64),
}

impl LibraryBuild {
    /// The summary's section and the JSON object.
    pub(super) fn report(&self, runs: usize) -> (String, Value) {
        let growth = self.growth();
        let mut text = String::new();
        self.write_heading(&mut text, runs);
        growth.write(&mut text);
        let list = |tables: &[Tables]| tables.iter().map(Tables::json).collect::<Vec<_>>();
        let json = json!({
            "library": self.library,
            "size_bytes": self.size,
            "dependencies": self.dependencies,
            "rows": number(growth.rows),
            "rules": number(growth.rules),
            "bpf_map_kib": number(growth.kib),
            "build_ms": number(growth.build),
            "build_ms_with": number(growth.build_with.median),
            "build_ms_without": number(growth.build_without.median),
            "with": list(&self.with),
            "without": list(&self.without),
            "skipped": self.skipped,
        });
        (text, json)
    }

    /// What the library's table adds: the runs with it against the runs without.
    fn growth(&self) -> Growth {
        let median = |tables: &[Tables], field: fn(&Tables) -> u64| {
            spread(&tables.iter().map(|t| field(t) as f64).collect::<Vec<_>>())
        };
        let build_with = median(&self.with, |t| t.build_ms);
        let build_without = median(&self.without, |t| t.build_ms);
        let more = |field: fn(&Tables) -> u64| {
            median(&self.with, field).median - median(&self.without, field).median
        };
        Growth {
            build_with,
            build_without,
            build: build_with.median - build_without.median,
            rows: more(|t| t.rows),
            rules: more(|t| t.rules),
            kib: more(|t| t.kib),
            rows_with: median(&self.with, |t| t.rows).median,
            not_fitting: self.with.iter().map(|t| t.not_fitting).max().unwrap_or(0),
            objects: (
                median(&self.without, |t| t.objects).median,
                median(&self.with, |t| t.objects).median,
            ),
        }
    }

    /// Appends the section's title, the larger libraries skipped and which library was
    /// measured, how, to `text`.
    fn write_heading(&self, text: &mut String, runs: usize) {
        let _ = writeln!(
            text,
            "## Unwind-table build of the largest library ({runs} runs with it, {runs} without, interleaved)\n"
        );
        for skipped in &self.skipped {
            let _ = writeln!(text, "skipped (larger, not loadable): {skipped}");
        }
        let _ = writeln!(
            text,
            "{} ({} MiB, the largest {}*.so* of {}), dlopen()ed by bench_dlopen under heapprofd (launch mode) after its {} dependencies; the baseline runs load the dependencies only",
            self.library,
            self.size >> 20,
            if self.skipped.is_empty() {
                ""
            } else {
                "loadable "
            },
            Path::new(&self.library)
                .parent()
                .map_or("?".into(), |p| p.display().to_string()),
            self.dependencies
        );
    }
}

impl Growth {
    /// Appends the lines on the library's table (its size, against the default
    /// `--max-unwind-rows`) and on its build time to `text`.
    fn write(&self, text: &mut String) {
        let Growth {
            rows,
            rules,
            kib,
            rows_with,
            not_fitting,
            build,
            ..
        } = *self;
        let _ = writeln!(
            text,
            "its table: {rows:.0} rows, {rules:.0} more rules, {kib:.0} KiB more BPF map memory (objects {:.0} -> {:.0}; {rows_with:.0} rows in all, {} the default --max-unwind-rows {DEFAULT_ROWS}{})",
            self.objects.0,
            self.objects.1,
            if rows_with <= DEFAULT_ROWS as f64 {
                "within"
            } else {
                "beyond"
            },
            if not_fitting > 0 {
                format!("; {not_fitting} objects did not fit")
            } else {
                String::new()
            }
        );
        let (with, without) = (self.build_with, self.build_without);
        let _ = writeln!(
            text,
            "build and load of its table: {build:.0} ms = {:.0} ms with it ({:.0}-{:.0}) - {:.0} ms without it ({:.0}-{:.0}), medians of heapprofd's `built in` figure",
            with.median, with.min, with.max, without.median, without.min, without.max
        );
    }
}

/// The shared objects (`*.so*`) of the machine's library directory, largest first;
/// symbolic links are left out.
pub(super) fn libraries_by_size() -> Vec<(PathBuf, u64)> {
    let dir = format!("/usr/lib/{}-linux-gnu", std::env::consts::ARCH);
    let mut found: Vec<(PathBuf, u64)> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .filter_map(Result::ok)
        .filter(|e| e.file_name().to_string_lossy().contains(".so"))
        .filter_map(|e| {
            let meta = std::fs::symlink_metadata(e.path()).ok()?;
            meta.is_file().then(|| (e.path(), meta.len()))
        })
        .collect();
    found.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    found
}
