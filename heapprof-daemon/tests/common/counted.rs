//! Programs that count their own allocations (tests/programs/alloc_abc.c, cxx_abc.cpp,
//! pool.c, rust_jemalloc/): parsing what they print, and reducing a profile's samples
//! to the same figures (tests/allocators.rs, tests/arm64_vm.rs).

use std::{
    collections::{BTreeMap, BTreeSet},
    path::{Path, PathBuf},
    process::Command,
};

use super::Sample;

/// The four values of a sample: allocated objects and bytes, in-use objects and bytes.
pub type Values = [i64; 4];

/// What a test program printed about itself.
#[derive(Debug)]
pub struct Printed {
    pub pid: String,
    pub total: Values,
    /// Per stack of its own functions, leaf first: "b<-a<-main".
    pub stacks: BTreeMap<String, Values>,
    /// Its other `key=value` lines (pool.c: "chunks=N large=N").
    pub extra: Vec<String>,
}

/// `allocated_objects=N allocated_bytes=N inuse_objects=N inuse_bytes=N` in `words`.
pub fn parse_values(line: &str, words: &[&str]) -> Values {
    let mut values = [None; 4];
    for word in words {
        let (key, value) = word
            .split_once('=')
            .unwrap_or_else(|| panic!("not key=value: {word:?} in {line:?}"));
        let index = match key {
            "allocated_objects" => 0,
            "allocated_bytes" => 1,
            "inuse_objects" => 2,
            "inuse_bytes" => 3,
            _ => panic!("unknown key {key:?} in {line:?}"),
        };
        values[index] = Some(
            value
                .parse::<i64>()
                .unwrap_or_else(|_| panic!("not a number: {word:?} in {line:?}")),
        );
    }
    values.map(|v| v.unwrap_or_else(|| panic!("a count is missing in {line:?}")))
}

/// Parses the program's report (see alloc_abc.c); panics unless it ends with `done`.
pub fn parse_printed(stdout: &str) -> Printed {
    let lines: Vec<&str> = stdout.lines().collect();
    assert!(
        lines.contains(&"done"),
        "the test program did not finish its report:\n{stdout}"
    );
    let mut printed = Printed {
        pid: String::new(),
        total: [0; 4],
        stacks: BTreeMap::new(),
        extra: Vec::new(),
    };
    for line in lines {
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.first() {
            Some(first) if first.starts_with("pid=") => {
                printed.pid = first["pid=".len()..].to_owned();
                printed.total = parse_values(line, &words[1..]);
            }
            Some(first) if first.starts_with("stack=") => {
                printed.stacks.insert(
                    first["stack=".len()..].to_owned(),
                    parse_values(line, &words[1..]),
                );
            }
            Some(first) if first.starts_with("error") => panic!("the test program: {line}"),
            Some(&"done") | Some(&"ready") | None => {}
            Some(_) => printed.extra.push(line.to_owned()),
        }
    }
    assert!(!printed.pid.is_empty(), "no pid= line in:\n{stdout}");
    printed
}

/// A sample's leaf: the allocator function ("" for an empty stack).
pub fn leaf(sample: &Sample) -> &str {
    sample.stack.first().map_or("", String::as_str)
}

/// The samples of process `pid`.
pub fn of_pid<'a>(samples: &'a [Sample], pid: &str) -> Vec<&'a Sample> {
    samples
        .iter()
        .filter(|s| s.labels.get("pid").is_some_and(|p| p == pid))
        .collect()
}

/// Samples, one per line: values, labels pid/comm, stack leaf first.
pub fn render(samples: &[&Sample]) -> String {
    let mut text = String::new();
    for sample in samples.iter().take(300) {
        text.push_str(&format!(
            "  {:?} pid={} comm={}: {}\n",
            sample.values,
            sample.labels.get("pid").map_or("?", String::as_str),
            sample.labels.get("comm").map_or("?", String::as_str),
            sample.stack.join(" <- ")
        ));
    }
    if samples.len() > 300 {
        text.push_str(&format!("  ... and {} more\n", samples.len() - 300));
    }
    if samples.is_empty() {
        text.push_str("  (no samples)\n");
    }
    text
}

/// The context of a failure: the program's report, heapprofd's log, the samples.
pub fn context(what: &str, printed: &str, log: &str, samples: &[&Sample]) -> String {
    format!(
        "{what}\nthe program printed:\n{printed}\nheapprofd's log:\n{log}\nthe profile's samples \
         of the program's pid:\n{}",
        render(samples)
    )
}

pub fn add(acc: &mut Values, values: Values) {
    for (a, v) in acc.iter_mut().zip(values) {
        *a += v;
    }
}

/// A C program's samples reduced to its own stacks: per chain from the allocator's
/// caller up to `main` ("b<-a<-main"), the summed values; only the samples whose stack
/// reaches `main` (not the loader's, `env`'s or the runtime's before `main`). Also
/// the leaves of those samples. C++'s operators new and delete are left out of the
/// chain: libstdc++'s call malloc (so they are callers on glibc), other allocators'
/// are allocator functions themselves (leaves).
pub fn main_stacks(samples: &[&Sample]) -> (BTreeMap<String, Values>, Vec<String>) {
    let mut stacks: BTreeMap<String, Values> = BTreeMap::new();
    let mut leaves = Vec::new();
    for sample in samples {
        let mut frames = sample.up_to_main();
        frames.retain(|f| !f.starts_with("operator new") && !f.starts_with("operator delete"));
        if frames.last() != Some(&"main") {
            continue;
        }
        add(stacks.entry(frames.join("<-")).or_default(), sample.values);
        leaves.push(sample.stack[0].clone());
    }
    (stacks, leaves)
}

/// Checks a run of alloc_abc.c: totals and main/a/b stacks equal its own counts.
pub fn check_c_program(what: &str, log: &str, stdout: &str, samples: &[Sample]) {
    let printed = parse_printed(stdout);
    let ours = of_pid(samples, &printed.pid);
    let explain = |problem: &str| context(&format!("{what}: {problem}"), stdout, log, &ours);
    // Only the program's own chains: a shell that forks it allocates in the same pid
    // before its exec (redirections), and those blocks are the shell's, up to the
    // shell's own `main`. A sample of the program's put on a wrong chain still fails
    // below, through the totals.
    let own_names: BTreeSet<&str> = printed.stacks.keys().flat_map(|k| k.split("<-")).collect();
    let (mut stacks, leaves) = main_stacks(&ours);
    stacks.retain(|chain, _| chain.split("<-").all(|f| own_names.contains(f)));
    assert!(
        !stacks.is_empty(),
        "{}",
        explain("no sample of the program's pid reaches main (was its allocator probed?)")
    );
    for leaf in &leaves {
        assert!(
            !leaf.is_empty(),
            "{}",
            explain("a sample without the allocator function as its leaf")
        );
    }
    let mut total = [0; 4];
    for values in stacks.values() {
        add(&mut total, *values);
    }
    assert_eq!(
        total,
        printed.total,
        "{}",
        explain(
            "totals [allocated objects, bytes, in-use objects, bytes] differ from the program's"
        )
    );
    assert_eq!(
        stacks,
        printed.stacks,
        "{}",
        explain("the main/a/b stacks differ from the program's counts")
    );
}

/// The Rust program's frame names reduced: `rust_jemalloc::a` (with or without a hash)
/// is `a`; other frames are not the program's.
pub fn rust_own_frame(name: &str) -> Option<&str> {
    let rest = name.strip_prefix("rust_jemalloc::")?;
    let rest = match rest.rsplit_once("::h") {
        Some((base, hash)) if hash.len() == 16 && hash.chars().all(|c| c.is_ascii_hexdigit()) => {
            base
        }
        _ => rest,
    };
    ["main", "a", "b"].contains(&rest).then_some(rest)
}

/// The Rust program's calls of its global allocator, by chain of its own functions
/// ("b<-a<-main"; "other" for std's, before and after `main`): the samples through its
/// counting wrapper (not the C library's own mallocs that std's calls into libc make).
/// Returns the chains and the total; panics (with `explain`) on a sample without a leaf.
pub fn rust_stacks(
    samples: &[&Sample],
    explain: impl Fn(&str) -> String,
) -> (BTreeMap<String, Values>, Values) {
    let through_global = |s: &Sample| {
        s.stack
            .iter()
            .any(|f| f.starts_with("<rust_jemalloc::Counting as core::alloc::global::GlobalAlloc>"))
    };
    let mut stacks: BTreeMap<String, Values> = BTreeMap::new();
    let mut total = [0; 4];
    for sample in samples.iter().filter(|s| through_global(s)) {
        assert!(
            !leaf(sample).is_empty(),
            "{}",
            explain("a sample without the allocator function as its leaf")
        );
        let chain: Vec<&str> = sample
            .stack
            .iter()
            .skip(1)
            .filter_map(|f| rust_own_frame(f))
            .collect();
        let key = if chain.is_empty() {
            "other".to_owned()
        } else {
            chain.join("<-")
        };
        add(stacks.entry(key).or_default(), sample.values);
        add(&mut total, sample.values);
    }
    (stacks, total)
}

/// Checks a run of the Rust program: its calls of the global allocator, in total and
/// per main/a/b stack, equal its own counts.
pub fn check_rust_program(what: &str, log: &str, stdout: &str, samples: &[Sample]) {
    let printed = parse_printed(stdout);
    let ours = of_pid(samples, &printed.pid);
    let explain = |problem: &str| context(&format!("{what}: {problem}"), stdout, log, &ours);
    let (stacks, total) = rust_stacks(&ours, explain);
    assert_eq!(
        total,
        printed.total,
        "{}",
        explain("totals through the global allocator differ from the program's count")
    );
    // A chain the program printed with nothing on it (std allocating nothing outside
    // main, as on a static musl build) has no sample to match.
    let mut expected = printed.stacks.clone();
    expected.retain(|_, values| *values != [0; 4]);
    assert_eq!(
        stacks,
        expected,
        "{}",
        explain("the main/a/b stacks differ from the program's count")
    );
}

/// Which linker links the Rust program.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Linker {
    /// Rust's default: LLD (rust-lld for the musl targets, and since Rust 1.90 for
    /// x86_64-unknown-linux-gnu too), whose layout puts the text segment at a virtual
    /// address that differs from its file offset.
    Lld,
    /// GNU ld, through gcc (`-Clinker-features=-lld` on the host, the cross gcc
    /// `aarch64-linux-gnu-gcc` for the aarch64 musl target).
    GnuLd,
}

/// Builds tests/programs/rust_jemalloc with the cargo running the tests, into the
/// target directory's tmp/ (kept: compiling jemalloc takes a minute or two, later runs
/// reuse it); returns the binary. `jemalloc`: on tikv-jemallocator (its default
/// feature), else on the C library's malloc; `target`: a Rust target (a musl one
/// brings its own C library), or the host.
pub fn rust_program(jemalloc: bool, target: Option<&str>, linker: Linker) -> PathBuf {
    let project = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/programs/rust_jemalloc");
    let target_dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!(
        "rust_jemalloc-{}-{}",
        if jemalloc { "jemalloc" } else { "libc" },
        match linker {
            Linker::Lld => "lld",
            Linker::GnuLd => "gnu-ld",
        }
    ));
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| env!("CARGO").into());
    let mut cmd = Command::new(cargo);
    cmd.args(["build", "--release", "--locked", "--manifest-path"])
        .arg(project.join("Cargo.toml"))
        .arg("--target-dir")
        .arg(&target_dir);
    if !jemalloc {
        cmd.arg("--no-default-features");
    }
    match (target, linker) {
        (Some(target), _) => {
            let gcc = format!("{}-linux-gnu-gcc", target.split('-').next().unwrap_or(""));
            cmd.args(["--target", target]).env(
                format!(
                    "CARGO_TARGET_{}_LINKER",
                    target.to_uppercase().replace('-', "_")
                ),
                if linker == Linker::Lld {
                    "rust-lld"
                } else {
                    &gcc
                },
            );
        }
        (None, Linker::GnuLd) => {
            cmd.env("RUSTFLAGS", "-Clinker-features=-lld");
        }
        (None, Linker::Lld) => {
            cmd.env_remove("RUSTFLAGS");
        }
    }
    let output = cmd.output().expect("running cargo");
    assert!(
        output.status.success(),
        "building {} ({cmd:?}): {}",
        project.display(),
        String::from_utf8_lossy(&output.stderr)
    );
    let binary = match target {
        Some(target) => target_dir.join(target).join("release/rust_jemalloc"),
        None => target_dir.join("release/rust_jemalloc"),
    };
    // The linker is the one asked for (LLD names itself in .comment).
    let bytes =
        std::fs::read(&binary).unwrap_or_else(|e| panic!("reading {}: {e}", binary.display()));
    let by_lld = bytes
        .windows(b"Linker: LLD".len())
        .any(|w| w == b"Linker: LLD");
    assert_eq!(
        by_lld,
        linker == Linker::Lld,
        "{} was linked by the wrong linker (expected {linker:?})",
        binary.display()
    );
    binary
}
