//! Call stacks: the allocator's immediate caller is present and every stack is the true one.

mod common;

use common::*;

fn check_stacks(optimization: &str) {
    require_root();
    let dir = scratch();
    let program = compile(dir.path(), "stacks", "stacks", &[optimization]);
    let out = dir.path().join("profiles");
    run_ok(heapprofd(&out).arg("--").arg(&program));

    let (stacks, leaves) = abc_stacks(&samples(&last_profile(&out)));
    for leaf in &leaves {
        assert_eq!(leaf, "malloc", "leaf of a stack through a or b");
    }
    assert_eq!(
        stacks,
        expected_abc_stacks(),
        "stacks at {optimization} (objects, bytes)"
    );
}

#[test]
fn three_stacks_at_o0() {
    check_stacks("-O0");
}

#[test]
fn three_stacks_at_o2_with_frame_pointers() {
    check_stacks("-O2");
}

/// stacks.c built `-O2 -fomit-frame-pointer` with debug information, in `dir`.
fn without_frame_pointers(dir: &std::path::Path) -> std::path::PathBuf {
    compile_exact(
        "gcc",
        dir,
        "stacks.c",
        "stacks-nofp",
        &["-g", "-O2", "-fomit-frame-pointer", "-fno-builtin"],
    )
}

/// The main/a/b stacks (objects, bytes) of a run of `program` with heapprofd `args`.
fn stacks_of(
    program: &std::path::Path,
    args: &[&str],
) -> std::collections::BTreeMap<String, (i64, i64)> {
    let dir = scratch();
    let out = dir.path().join("profiles");
    run_ok(heapprofd(&out).args(args).arg("--").arg(program));
    abc_stacks(&samples(&last_profile(&out))).0
}

#[test]
fn three_stacks_at_o2_without_frame_pointers_from_cfi() {
    require_root();
    let dir = scratch();
    let program = without_frame_pointers(dir.path());
    for unwind in ["auto", "cfi"] {
        assert_eq!(
            stacks_of(&program, &["--unwind", unwind]),
            expected_abc_stacks(),
            "--unwind {unwind}: the true stacks of code without frame pointers"
        );
    }
    // Frame pointers alone cannot: the flag really selects the method.
    assert_ne!(
        stacks_of(&program, &["--unwind", "fp"]),
        expected_abc_stacks(),
        "--unwind fp on code without frame pointers"
    );
}

/// Forks that allocate and exit at once are gone before their own mappings could be
/// read: their stacks still reach main, unwound with their parent's (and a fork of a
/// fork with the first parent's). Without frame pointers and with `--unwind cfi`, so
/// that nothing but the tables can take them there.
#[test]
fn short_lived_forks_stacks_reach_main_through_their_parents_mappings() {
    require_root();
    let dir = scratch();
    let program = compile_exact(
        "gcc",
        dir.path(),
        "forks.c",
        "forks",
        &["-g", "-O2", "-fomit-frame-pointer", "-fno-builtin"],
    );
    let out = dir.path().join("profiles");
    let (children, allocs) = (20, 30);
    let output = run_ok(
        heapprofd(&out)
            .args(["--unwind", "cfi", "--"])
            .arg(&program)
            .args([children.to_string(), allocs.to_string()]),
    );
    let mut objects: std::collections::BTreeMap<String, i64> = Default::default();
    for sample in samples(&last_profile(&out)) {
        if sample
            .stack
            .iter()
            .any(|f| f == "child_work" || f == "grandchild_work")
        {
            *objects.entry(sample.up_to_main().join("<-")).or_default() += sample.values[0];
        }
    }
    let expected: std::collections::BTreeMap<String, i64> = [
        ("child_work<-child_main<-main", children * allocs),
        ("grandchild_work<-child_main<-main", children * allocs),
    ]
    .into_iter()
    .map(|(chain, count)| (chain.to_owned(), count))
    .collect();
    assert_eq!(
        objects,
        expected,
        "allocated objects per stack of the forks (caller first, up to main)\nheapprofd's log:\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
}

/// Runs `cmd`, which must succeed.
fn run_tool(cmd: &mut std::process::Command) -> String {
    let output = cmd
        .output()
        .unwrap_or_else(|e| panic!("running {cmd:?}: {e} (binutils: cargo xtask setup)"));
    assert!(output.status.success(), "{cmd:?} failed: {output:?}");
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// The GNU build-id of an ELF file, as hex, from `readelf -n`.
fn build_id(path: &std::path::Path) -> String {
    let notes = run_tool(std::process::Command::new("readelf").arg("-n").arg(path));
    notes
        .lines()
        .find_map(|l| l.trim().strip_prefix("Build ID: "))
        .unwrap_or_else(|| panic!("no build-id in {}:\n{notes}", path.display()))
        .trim()
        .to_owned()
}

/// Removes a file when dropped (a debug file installed for a test).
struct Installed(std::path::PathBuf);

impl Drop for Installed {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

#[test]
fn separate_debug_files_name_the_functions_of_a_stripped_program() {
    require_root();
    let dir = scratch();
    let program = without_frame_pointers(dir.path());
    let debug = dir.path().join("stacks-nofp.debug");
    run_tool(
        std::process::Command::new("objcopy")
            .arg("--only-keep-debug")
            .arg(&program)
            .arg(&debug),
    );
    run_tool(
        std::process::Command::new("strip")
            .arg("--strip-all")
            .arg(&program),
    );
    // Stripped and nothing installed: the functions have no names.
    assert!(
        stacks_of(&program, &[]).is_empty(),
        "a stripped program without debug files shows no a/b frames"
    );

    // Installed by build-id, as Debian's -dbg/-dbgsym packages do.
    let id = build_id(&program);
    let by_id = std::path::Path::new("/usr/lib/debug/.build-id")
        .join(&id[..2])
        .join(format!("{}.debug", &id[2..]));
    std::fs::create_dir_all(by_id.parent().expect("a directory")).expect("mkdir");
    std::fs::copy(&debug, &by_id).expect("installing the debug file");
    let installed = Installed(by_id);
    assert_eq!(
        stacks_of(&program, &[]),
        expected_abc_stacks(),
        "names from /usr/lib/debug/.build-id"
    );
    drop(installed);

    // Named by .gnu_debuglink, next to the program.
    let linked = dir.path().join("stacks-linked");
    std::fs::copy(&program, &linked).expect("copy");
    run_tool(
        std::process::Command::new("objcopy")
            .arg(format!("--add-gnu-debuglink={}", debug.display()))
            .arg(&linked),
    );
    assert_eq!(
        stacks_of(&linked, &[]),
        expected_abc_stacks(),
        "names from the .gnu_debuglink file beside the program"
    );
}
