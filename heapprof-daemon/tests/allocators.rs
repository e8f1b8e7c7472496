//! Allocators other than the system glibc's dynamic malloc: heapprofd finds the
//! allocator that serves each process and probes its whole API.
//!
//! Each case runs a program that counts what it allocates itself and prints the counts
//! (tests/programs/alloc_abc.c, pool.c, rust_jemalloc/): the profile's totals for its
//! pid, and its main/a/b stacks with their four values, must equal them exactly.
//! - jemalloc, tcmalloc and mimalloc, preloaded (`env LD_PRELOAD=... ./prog` under
//!   launch mode, as users run it: heapprofd follows the exec) and linked;
//! - musl, dynamic and static (`musl-gcc`); static glibc (`gcc -static`);
//! - a Rust program on tikv-jemallocator (its `_rjem_*` functions), counted by a
//!   wrapping global allocator over the whole process, std's own allocations included;
//! - a C program with its own pool, profiled through `--allocator`, and bad specs;
//! - a stripped static binary: heapprofd cannot see its allocator and says so;
//! - `--all` with a musl process and a glibc process side by side.
//!
//! The C programs' own counts agree with valgrind's on the glibc build (see
//! [`alloc_abc_counts_like_valgrind`]).

mod common;

use std::{
    ffi::OsString,
    path::{Path, PathBuf},
    process::{Command, Output},
    time::Duration,
};

use common::{counted::*, *};

/// The host's multiarch library directory, where Debian installs the allocators.
fn lib_dir() -> PathBuf {
    PathBuf::from(format!("/usr/lib/{}-linux-gnu", std::env::consts::ARCH))
}
const JEMALLOC: &str = "libjemalloc.so.2";
const TCMALLOC: &str = "libtcmalloc_minimal.so.4";
const MIMALLOC: &str = "libmimalloc.so.2";

/// Held by the `--all` test and the valgrind test: valgrind's run breaks while an
/// `--all` session probes the dynamic loader it runs on (the tests of one file run
/// in parallel).
static ALL_MODE_OR_VALGRIND: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// A run of heapprofd in launch mode: its log, the command's output, the final profile.
struct Run {
    log: String,
    stdout: String,
    samples: Vec<Sample>,
    comments: Vec<String>,
}

/// `heapprofd -o DIR/profiles HEAPPROFD_ARGS -- COMMAND`; the run must succeed.
fn launch(dir: &Path, heapprofd_args: &[&str], command: &[OsString]) -> Run {
    let out = dir.join("profiles");
    let mut cmd = heapprofd(&out);
    cmd.args(heapprofd_args).arg("--").args(command);
    let output: Output = cmd.output().expect("starting heapprofd");
    let log = String::from_utf8_lossy(&output.stderr).into_owned();
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "{cmd:?} failed ({}):\nstdout:\n{stdout}\nheapprofd's log:\n{log}",
        output.status
    );
    let profile = last_profile(&out);
    Run {
        log,
        stdout,
        samples: samples(&profile),
        comments: comments(&profile).into_iter().map(str::to_owned).collect(),
    }
}

/// `env [LD_PRELOAD=LIB] PROGRAM [ARGS]`.
fn env_command(preload: Option<&str>, program: &Path, args: &[&str]) -> Vec<OsString> {
    let mut command = vec![OsString::from("env")];
    if let Some(lib) = preload {
        command.push(format!("LD_PRELOAD={}", lib_dir().join(lib).display()).into());
    }
    command.push(program.into());
    command.extend(args.iter().map(OsString::from));
    command
}

/// Launches `command` under heapprofd and checks alloc_abc's counts.
fn check_launch(what: &str, heapprofd_args: &[&str], command: &[OsString]) -> Run {
    let dir = scratch();
    let run = launch(dir.path(), heapprofd_args, command);
    check_c_program(what, &run.log, &run.stdout, &run.samples);
    run
}

/// The C flags of every build of alloc_abc.c (those [`compile`] adds, and -O2).
const C_FLAGS: &[&str] = &[
    "-g",
    "-O2",
    "-fno-builtin",
    "-fno-omit-frame-pointer",
    "-pthread",
];

/// alloc_abc.c built by gcc against the system glibc and linked with `lib` (a file
/// name in the library directory, `-l:LIB` after the source as a user links it).
fn linked_with(dir: &Path, lib: &str) -> PathBuf {
    let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/programs/alloc_abc.c");
    let binary = dir.join(format!("alloc_abc-{lib}"));
    let status = Command::new("gcc")
        .args(C_FLAGS)
        .arg("-o")
        .arg(&binary)
        .arg(&source)
        .arg(format!("-l:{lib}"))
        .status()
        .expect("running gcc");
    assert!(status.success(), "linking alloc_abc.c with {lib}");
    assert!(
        lib_dir().join(lib).exists(),
        "{} is missing: cargo xtask setup installs it",
        lib_dir().join(lib).display()
    );
    binary
}

fn preloaded(lib: &str) {
    require_root();
    let dir = scratch();
    let library = lib_dir().join(lib);
    assert!(
        library.exists(),
        "{} is missing: cargo xtask setup installs it",
        library.display()
    );
    let program = compile(dir.path(), "alloc_abc", "alloc_abc", &["-O2"]);
    check_launch(
        &format!("{lib} preloaded"),
        &[],
        &env_command(Some(lib), &program, &[]),
    );
}

fn linked(lib: &str) {
    require_root();
    let dir = scratch();
    let program = linked_with(dir.path(), lib);
    check_launch(
        &format!("{lib} linked"),
        &[],
        &env_command(None, &program, &[]),
    );
}

/// The harness on the allocator heapprofd always probed: glibc's, dynamic.
#[test]
fn glibc_dynamic_baseline() {
    require_root();
    let dir = scratch();
    let program = compile(dir.path(), "alloc_abc", "alloc_abc", &["-O2"]);
    check_launch("glibc (dynamic)", &[], &env_command(None, &program, &[]));
    // And without `env` in between.
    check_launch("glibc (dynamic), launched directly", &[], &[program.into()]);
}

/// A command that drops heapprofd's `LD_PRELOAD` before it execs the program: the
/// program is counted by the allocator's probes instead, exactly, and the log says so.
#[test]
fn a_program_started_without_the_preload_library_is_counted_by_the_probes() {
    require_root();
    let dir = scratch();
    let program = compile(dir.path(), "alloc_abc", "alloc_abc", &["-O2"]);
    let command: Vec<OsString> = vec![
        "env".into(),
        "-u".into(),
        "LD_PRELOAD".into(),
        program.into(),
    ];
    let run = check_launch("glibc, LD_PRELOAD dropped by env -u", &[], &command);
    assert!(
        run.log
            .contains("preload library does not serve it (the library is not loaded"),
        "no log line names the fallback to the probes:\n{}",
        run.log
    );
}

#[test]
fn jemalloc_preloaded() {
    preloaded(JEMALLOC);
}

#[test]
fn jemalloc_linked() {
    linked(JEMALLOC);
}

#[test]
fn tcmalloc_preloaded() {
    preloaded(TCMALLOC);
}

#[test]
fn tcmalloc_linked() {
    linked(TCMALLOC);
}

#[test]
fn mimalloc_preloaded() {
    preloaded(MIMALLOC);
}

#[test]
fn mimalloc_linked() {
    linked(MIMALLOC);
}

/// cxx_abc.cpp built by g++ against the system glibc, linked with `lib` if given.
fn cxx_program(dir: &Path, lib: Option<&str>) -> PathBuf {
    let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/programs/cxx_abc.cpp");
    let binary = dir.join(format!("cxx_abc-{}", lib.unwrap_or("glibc")));
    let mut cmd = Command::new("g++");
    cmd.args(["-g", "-O2", "-fno-omit-frame-pointer", "-o"])
        .arg(&binary)
        .arg(&source);
    if let Some(lib) = lib {
        cmd.arg(format!("-l:{lib}"));
    }
    let status = cmd.status().expect("running g++ (cargo xtask setup)");
    assert!(status.success(), "building cxx_abc.cpp ({lib:?})");
    binary
}

/// C++ through operator new/delete: libstdc++'s (which call glibc's malloc).
#[test]
fn cxx_glibc_baseline() {
    require_root();
    let dir = scratch();
    let program = cxx_program(dir.path(), None);
    check_launch("C++ on glibc", &[], &[program.into()]);
}

/// tcmalloc's own operators new/delete (they do not call its malloc).
#[test]
fn cxx_tcmalloc_linked() {
    require_root();
    let dir = scratch();
    let program = cxx_program(dir.path(), Some(TCMALLOC));
    check_launch("C++ on tcmalloc, linked", &[], &[program.into()]);
}

/// jemalloc's own operators new/delete, preloaded.
#[test]
fn cxx_jemalloc_preloaded() {
    require_root();
    let dir = scratch();
    let program = cxx_program(dir.path(), None);
    check_launch(
        "C++ on jemalloc, preloaded",
        &[],
        &env_command(Some(JEMALLOC), &program, &[]),
    );
}

/// mimalloc's own operators new/delete, preloaded.
#[test]
fn cxx_mimalloc_preloaded() {
    require_root();
    let dir = scratch();
    let program = cxx_program(dir.path(), None);
    check_launch(
        "C++ on mimalloc, preloaded",
        &[],
        &env_command(Some(MIMALLOC), &program, &[]),
    );
}

#[test]
fn musl_dynamic() {
    require_root();
    let dir = scratch();
    let program = compile_with(
        "musl-gcc",
        dir.path(),
        "alloc_abc",
        "alloc_abc-musl",
        &["-O2"],
    );
    check_launch("musl (dynamic)", &[], &[program.into()]);
}

#[test]
fn musl_static() {
    require_root();
    let dir = scratch();
    let program = compile_with(
        "musl-gcc",
        dir.path(),
        "alloc_abc",
        "alloc_abc-musl-static",
        &["-O2", "-static"],
    );
    check_launch("musl (static)", &[], &[program.into()]);
}

#[test]
fn glibc_static() {
    require_root();
    let dir = scratch();
    let program = compile(
        dir.path(),
        "alloc_abc",
        "alloc_abc-static",
        &["-O2", "-static"],
    );
    check_launch("glibc (static)", &[], &[program.into()]);
}

/// `pid N` in `line`, N not followed by another digit.
fn names_pid(line: &str, pid: &str) -> bool {
    let needle = format!("pid {pid}");
    line.match_indices(&needle).any(|(at, _)| {
        !line[at + needle.len()..]
            .chars()
            .next()
            .is_some_and(|c| c.is_ascii_digit())
    })
}

#[test]
fn a_stripped_static_binary_is_reported_not_silently_missed() {
    require_root();
    let dir = scratch();
    let program = compile(
        dir.path(),
        "alloc_abc",
        "alloc_abc-stripped",
        &["-O2", "-static"],
    );
    let status = Command::new("strip")
        .arg(&program)
        .status()
        .expect("running strip (binutils: cargo xtask setup)");
    assert!(status.success(), "strip failed");
    let run = launch(dir.path(), &[], &[program.into()]);
    let printed = parse_printed(&run.stdout);
    assert!(
        run.log
            .lines()
            .any(|l| l.contains("warn") && names_pid(l, &printed.pid) && l.contains("--allocator")),
        "no warning naming pid {} and --allocator in heapprofd's log:\n{}",
        printed.pid,
        run.log
    );
    assert!(
        run.comments.iter().any(|c| c.contains("--allocator")),
        "no comment naming --allocator in the profile: {:#?}",
        run.comments
    );
}

/// pool.c's allocation functions (the samples' leaves) and free functions.
const POOL_ALLOCATORS: [&str; 4] = ["pool_alloc", "pool_calloc", "pool_realloc", "node_new"];
const POOL_FUNCTIONS: [&str; 6] = [
    "pool_alloc",
    "pool_calloc",
    "pool_realloc",
    "node_new",
    "pool_free",
    "node_delete",
];

/// The pool's API, split between `--allocator` items and a spec file (`@FILE`).
const POOL_SPEC_FILE: &str = "\
# the rest of pool.c's API, as a user keeps it in a file

alloc=pool_calloc(count=arg2,size=arg3,ret)
# the old block, the new size
realloc=pool_realloc(ptr=arg2,size=arg3,ret)
alloc=node_new(size=48,ret)   free=node_delete(ptr=arg2)
";

#[test]
fn a_custom_pool_through_allocator_specs() {
    require_root();
    let dir = scratch();
    let program = compile(dir.path(), "pool", "pool", &["-O2"]);
    let spec_file = dir.path().join("pool.spec");
    std::fs::write(&spec_file, POOL_SPEC_FILE).expect("writing the spec file");
    let at_file = format!("@{}", spec_file.display());
    let run = launch(
        dir.path(),
        &[
            "--allocator",
            "alloc=pool_alloc(size=arg2,ret) free=pool_free(ptr=arg2)",
            "--allocator",
            &at_file,
        ],
        &[program.into()],
    );
    let printed = parse_printed(&run.stdout);
    let ours = of_pid(&run.samples, &printed.pid);
    let explain =
        |problem: &str| context(&format!("pool: {problem}"), &run.stdout, &run.log, &ours);

    // The pool's blocks: samples whose leaf is one of its allocation functions.
    let pool_samples: Vec<&Sample> = ours
        .iter()
        .copied()
        .filter(|s| POOL_ALLOCATORS.contains(&leaf(s)))
        .collect();
    let (stacks, _) = main_stacks(&pool_samples);
    let mut total = [0; 4];
    for values in stacks.values() {
        add(&mut total, *values);
    }
    assert_eq!(
        total,
        printed.total,
        "{}",
        explain("the pool's totals differ from its own count")
    );
    assert_eq!(
        stacks,
        printed.stacks,
        "{}",
        explain("the pool's main/a/b stacks differ from its own count")
    );

    // The mallocs and frees inside the pool (chunks, large blocks) and the pool's calls
    // nested in its own functions are counted as the call the program made: no sample
    // has a pool function below its leaf.
    for sample in &ours {
        assert!(
            !sample
                .stack
                .iter()
                .skip(1)
                .any(|f| POOL_FUNCTIONS.contains(&f.as_str())),
            "{}",
            explain("a call nested in a pool function is a sample of its own")
        );
    }
    // Every sample through a, b or scratch_work is a pool allocation.
    for sample in &ours {
        if sample
            .up_to_main()
            .iter()
            .any(|f| ["a", "b", "scratch_work"].contains(f))
        {
            assert!(
                POOL_ALLOCATORS.contains(&leaf(sample))
                    || (leaf(sample) == "malloc"
                        && sample.stack.get(1).is_some_and(|f| f == "pool_create")),
                "{}",
                explain("a sample through a/b/scratch_work is not the pool's")
            );
        }
    }
    // The other allocations of main: the two pools' own headers (malloc in
    // pool_create), one of them destroyed.
    let headers: Vec<&Sample> = ours
        .iter()
        .copied()
        .filter(|s| !POOL_ALLOCATORS.contains(&leaf(s)) && s.up_to_main().last() == Some(&"main"))
        .collect();
    let (header_stacks, _) = main_stacks(&headers);
    assert_eq!(
        header_stacks.keys().collect::<Vec<_>>(),
        ["pool_create<-main", "pool_create<-scratch_work<-main"],
        "{}",
        explain("main's allocations besides the pool's")
    );
    assert_eq!(
        header_stacks["pool_create<-main"][2],
        1,
        "{}",
        explain("the main pool's header is in use at exit")
    );
    assert_eq!(
        header_stacks["pool_create<-scratch_work<-main"][2],
        0,
        "{}",
        explain("the scratch pool's header was freed by pool_destroy")
    );
}

#[test]
fn a_bad_allocator_spec_is_one_error_line_and_status_2() {
    require_root();
    let dir = scratch();
    // A good spec is taken (so the bad ones below are refused for what they say,
    // not because the flag is unknown).
    let program = compile(dir.path(), "pool", "pool", &["-O2"]);
    launch(
        dir.path(),
        &[
            "--allocator",
            "alloc=pool_alloc(size=arg2,ret) free=pool_free(ptr=arg2)",
        ],
        &[program.into()],
    );
    let out = dir.path().join("bad-profiles");
    let missing = dir.path().join("no-such.spec");
    let missing = format!("@{}", missing.display());
    let cases = [
        "alloc=pool_alloc(size=arg2",                  // unclosed
        "alloc=pool_alloc(size=arg0,ret)",             // arguments count from 1
        "grab=pool_alloc(size=arg2,ret)",              // no such role
        "alloc=pool_alloc(ret)",                       // an allocation needs a size
        "free=pool_free(size=arg2)",                   // a free needs the block
        "alloc=pool_alloc(size=arg2,weight=arg3,ret)", // no such field
        "alloc=(size=arg2,ret)",                       // no function
        "alloc=pool_alloc(size=argx,ret)",             // not an argument
        &missing,                                      // no such file
    ];
    for spec in cases {
        let output = heapprofd(&out)
            .args(["--allocator", spec, "--", "true"])
            .output()
            .expect("starting heapprofd");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{spec:?}: {stderr}");
        assert_eq!(
            stderr.trim().lines().count(),
            1,
            "{spec:?}: one line, got {stderr:?}"
        );
        assert!(stderr.contains("--allocator"), "{spec:?}: {stderr}");
        assert!(
            !stderr.contains("unexpected argument"),
            "{spec:?}: the flag itself is refused: {stderr}"
        );
    }
    assert!(!out.exists(), "nothing started");
}

/// tikv-jemallocator's `_rjem_*` functions. Linked by GNU ld: Rust's default linker
/// (LLD) has its own test, [`rust_linked_by_lld_unwinds_its_stacks`].
#[test]
fn rust_with_tikv_jemallocator() {
    check_rust("Rust on tikv-jemallocator", true, Linker::GnuLd);
}

/// The Rust harness on the allocator heapprofd always probed: glibc's malloc (the
/// program without its `jemalloc` feature), linked by GNU ld.
#[test]
fn rust_system_allocator_baseline() {
    check_rust(
        "Rust on glibc's malloc, linked by GNU ld",
        false,
        Linker::GnuLd,
    );
}

/// The same, linked as Rust links by default on x86_64-unknown-linux-gnu since 1.90:
/// by LLD, whose text segment's virtual addresses differ from its file offsets (the
/// CFI of such a binary must be looked up by virtual address).
#[test]
fn rust_linked_by_lld_unwinds_its_stacks() {
    check_rust("Rust on glibc's malloc, linked by LLD", false, Linker::Lld);
}

fn check_rust(what: &str, jemalloc: bool, linker: Linker) {
    require_root();
    let program = rust_program(jemalloc, None, linker);
    let dir = scratch();
    let run = launch(dir.path(), &[], &[program.into()]);
    check_rust_program(what, &run.log, &run.stdout, &run.samples);
}

#[test]
fn all_mode_with_a_musl_and_a_glibc_process_side_by_side() {
    require_root();
    let _alone = ALL_MODE_OR_VALGRIND
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let dir = scratch();
    let glibc = compile(dir.path(), "alloc_abc", "abc_glibc", &["-O2"]);
    let musl = compile_with("musl-gcc", dir.path(), "alloc_abc", "abc_musl", &["-O2"]);
    let out = dir.path().join("profiles");
    // Both wait for a line on stdin, then allocate, report, and wait for its end.
    let mut programs = [
        ("glibc", Driven::start(&glibc, &["wait"])),
        ("musl", Driven::start(&musl, &["wait"])),
    ];
    let (mut heapprofd, log) =
        start_heapprofd(heapprofd(&out).args(["--interval", "500ms", "--all"]));
    let mut reports = Vec::new();
    for (name, program) in &mut programs {
        let mut report = program.step_reading();
        loop {
            let line = program.next_line(Duration::from_secs(30));
            report.push('\n');
            report.push_str(&line);
            if line == "done" {
                break;
            }
        }
        assert_eq!(
            parse_printed(&report).pid,
            program.pid(),
            "{name}: the report's pid"
        );
        reports.push((name.to_owned(), report));
    }
    // The final profile is taken while both still hold their blocks.
    signal(&heapprofd, libc::SIGINT);
    let status = heapprofd.wait().expect("waiting for heapprofd");
    // The log reader ends at heapprofd's exit (the programs write elsewhere).
    let heapprofd_log: Vec<String> = log.iter().collect();
    let heapprofd_log = heapprofd_log.join("\n");
    assert!(
        status.success(),
        "heapprofd --all exited with {status}:\n{heapprofd_log}"
    );
    for (_, program) in &mut programs {
        program.finish();
    }
    let samples = samples(&last_profile(&out));
    for (name, report) in &reports {
        check_c_program(
            &format!("--all, the {name} process"),
            &format!("(after attaching)\n{heapprofd_log}"),
            report,
            &samples,
        );
    }
}

/// alloc_abc.c's own counts against valgrind's on the glibc build, where valgrind
/// replaces the allocator: what the other cases compare with is right.
#[test]
fn alloc_abc_counts_like_valgrind() {
    let _alone = ALL_MODE_OR_VALGRIND
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let dir = scratch();
    let program = compile(dir.path(), "alloc_abc", "alloc_abc", &["-O2"]);
    let output = common::valgrind::command()
        .arg("--run-libc-freeres=no")
        .arg(&program)
        .output()
        .expect("running valgrind (install it: cargo xtask setup)");
    assert!(output.status.success(), "valgrind run failed: {output:?}");
    let printed = parse_printed(&String::from_utf8_lossy(&output.stdout));
    let stderr = String::from_utf8_lossy(&output.stderr);
    let [
        allocated_objects,
        allocated_bytes,
        inuse_objects,
        inuse_bytes,
    ] = printed.total;
    let number = |s: &str| s.replace(',', "");
    let usage = stderr
        .lines()
        .find_map(|l| l.split("total heap usage: ").nth(1))
        .unwrap_or_else(|| panic!("no 'total heap usage' in:\n{stderr}"));
    let w: Vec<String> = usage.split_whitespace().map(number).collect();
    assert_eq!(
        (w[0].as_str(), w[2].as_str(), w[4].as_str()),
        (
            allocated_objects.to_string().as_str(),
            (allocated_objects - inuse_objects).to_string().as_str(),
            allocated_bytes.to_string().as_str()
        ),
        "valgrind's allocs, frees, bytes against the program's count:\n{stderr}"
    );
    let in_use = stderr
        .lines()
        .find_map(|l| l.split("in use at exit: ").nth(1))
        .unwrap_or_else(|| panic!("no 'in use at exit' in:\n{stderr}"));
    let w: Vec<String> = in_use.split_whitespace().map(number).collect();
    assert_eq!(
        (w[0].as_str(), w[3].as_str()),
        (
            inuse_bytes.to_string().as_str(),
            inuse_objects.to_string().as_str()
        ),
        "valgrind's bytes and blocks in use at exit against the program's count:\n{stderr}"
    );
}
