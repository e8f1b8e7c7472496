//! Probe placement on the real allocators heapprofd probes by default: no probe may sit
//! on an instruction the kernel single-steps (~10 µs per call against ~0.6-1 µs for an
//! emulated one), and the registers the programs read there must hold the values the
//! function's signature names.
//!
//! Root-free: the objects are scanned as files, as the daemon scans them. The objects
//! are Debian's builds for the host (glibc, jemalloc, tcmalloc, mimalloc, musl) and for
//! arm64 (from the VM test's assets), a static glibc program and
//! the Rust program on tikv-jemallocator (its `_rjem_` names), all installed by
//! `cargo xtask setup`: a missing one fails the test.

mod common;

use std::path::{Path, PathBuf};

use common::{compile, counted, scratch};
use heapprof_daemon::{
    allocators::{api::Family, scan},
    placement::PlacementMode,
};

/// Scans `path` as the daemon would and returns `(function, placement)` for every
/// function it would probe there that the kernel single-steps.
fn single_stepped(path: &Path, executable: bool) -> (usize, Vec<String>) {
    assert!(
        path.exists(),
        "{} is missing: `cargo xtask setup` installs it",
        path.display()
    );
    let scan = scan::scan(
        path,
        &path.display().to_string(),
        executable,
        &[],
        PlacementMode::Auto,
    )
    .unwrap_or_else(|err| panic!("scanning {}: {err}", path.display()));
    let probed: Vec<_> = scan
        .of_families(&[Family::Standard, Family::Vendor])
        .collect();
    let stepped = probed
        .iter()
        .filter(|f| !f.placement.emulated)
        .map(|f| format!("{} at {}", f.name, f.placement))
        .collect();
    (probed.len(), stepped)
}

fn assert_none_single_stepped(path: &Path, executable: bool, at_least: usize) {
    let (probed, stepped) = single_stepped(path, executable);
    assert!(
        probed >= at_least,
        "{}: {probed} allocator functions found, expected at least {at_least}",
        path.display()
    );
    assert!(
        stepped.is_empty(),
        "{}: {} of {probed} probes single-stepped:\n{}",
        path.display(),
        stepped.len(),
        stepped.join("\n")
    );
}

/// The host's own build of `library`, in its multiarch directory (`/usr/lib/TRIPLET`,
/// the triplet's C library part being `gnu` or `musl`).
fn native(libc: &str, library: &str) -> PathBuf {
    Path::new(&format!("/usr/lib/{}-linux-{libc}", std::env::consts::ARCH)).join(library)
}

#[test]
fn glibc_probes_are_all_emulated() {
    assert_none_single_stepped(&native("gnu", "libc.so.6"), false, 9);
}

#[test]
fn jemalloc_probes_are_all_emulated() {
    assert_none_single_stepped(&native("gnu", "libjemalloc.so.2"), false, 20);
}

#[test]
fn tcmalloc_probes_are_all_emulated() {
    assert_none_single_stepped(&native("gnu", "libtcmalloc_minimal.so.4"), false, 15);
}

#[test]
fn mimalloc_probes_are_all_emulated() {
    assert_none_single_stepped(&native("gnu", "libmimalloc.so.2"), false, 20);
}

#[test]
fn musl_probes_are_all_emulated() {
    assert_none_single_stepped(&native("musl", "libc.so"), false, 5);
}

#[test]
fn static_glibc_probes_are_all_emulated() {
    let dir = scratch();
    let program = compile(
        dir.path(),
        "alloc_abc",
        "alloc_abc-static",
        &["-O2", "-static"],
    );
    assert_none_single_stepped(&program, true, 8);
}

#[test]
fn rust_jemalloc_probes_are_all_emulated() {
    let program = counted::rust_program(true, None, counted::Linker::Lld);
    assert_none_single_stepped(&program, true, 6);
}

/// Debian's arm64 build of an allocator, from the arm64 VM test's assets (fetched by
/// `cargo xtask test` and `cargo xtask vm-test`, which name them).
fn arm64(library: &str) -> std::path::PathBuf {
    let assets = std::env::var_os("HEAPPROFD_ARM64_VM_ASSETS").unwrap_or_else(|| {
        panic!(
            "HEAPPROFD_ARM64_VM_ASSETS is not set: the arm64 libraries come with the VM \
             test's assets; run this test through `cargo xtask test`"
        )
    });
    Path::new(&assets).join(library)
}

#[test]
fn arm64_glibc_probes_are_all_simulated() {
    let libc = arm64("lib/aarch64-linux-gnu/libc.so.6");
    assert_none_single_stepped(&libc, false, 9);
    // glibc's malloc saves its frame record first: its probe is past the push, and
    // its return probes on its exits.
    let scan = scan::scan(&libc, "libc.so.6", false, &[], PlacementMode::Auto)
        .expect("scanning the arm64 C library");
    let malloc = scan
        .of_families(&[Family::Standard])
        .find(|f| f.name == "malloc")
        .expect("malloc");
    assert!(
        malloc.placement.sp_adjust > 0 && !malloc.placement.exits.is_empty(),
        "{}",
        malloc.placement
    );
}

#[test]
fn arm64_jemalloc_probes_are_all_simulated() {
    assert_none_single_stepped(&arm64("allocators/libjemalloc.so.2"), false, 20);
}

#[test]
fn arm64_tcmalloc_probes_are_all_simulated() {
    assert_none_single_stepped(&arm64("allocators/libtcmalloc_minimal.so.4"), false, 15);
}

#[test]
fn arm64_mimalloc_probes_are_all_simulated() {
    assert_none_single_stepped(&arm64("allocators/libmimalloc.so.2.0"), false, 20);
}

#[test]
fn arm64_musl_probes_are_all_simulated() {
    assert_none_single_stepped(&arm64("allocators/libc.so"), false, 5);
}
