//! What the arm64 VM test boots: Debian's arm64 6.1 kernel (the Rock 5B BSP line),
//! busybox and the arm64 C and C++ libraries, fetched as .debs under a private apt
//! configuration (the host needs no foreign architecture) and unpacked into
//! `target/arm64-vm/assets`.
//!
//! The test itself (heapprof-daemon/tests/arm64_vm.rs) builds the initramfs from these
//! and the static aarch64 heapprofd, boots it under qemu-system-aarch64 and checks
//! the profiles the VM prints.

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, Result, bail};

use super::debian::{
    PrivateApt, arm64_sources, copy_vmlinuz, debian_archive, extract, find_deb, fresh_dir,
    kernel_release, source_line,
};
use crate::{CmdExt as _, step, workspace_root};

/// The kernel's metapackage: its dependency names the current 6.1 image.
const KERNEL_METAPACKAGE: &str = "linux-image-arm64";

/// The suite of the second kernel, 6.12, whose arm64 build has fentry (direct calls
/// from ftrace): the deferred-free programs load there as fentry programs.
const FENTRY_KERNEL_SUITE: &str = "bookworm-backports";
/// Packages unpacked next to the kernel image: libc6 brings libm, libstdc++6 is what
/// the C++ test program links (with libgcc_s); the allocators' arm64 builds are for the
/// probe-placement test (tests/placement.rs), which scans them as files.
const PACKAGES: [&str; 8] = [
    "busybox-static",
    "libc6",
    "libgcc-s1",
    "libstdc++6",
    "libjemalloc2",
    "libtcmalloc-minimal4",
    "libmimalloc2.0",
    "musl",
];

/// The allocators' libraries, from the unpacked packages into `allocators/` of the
/// assets (outside `lib/`, which the VM boots with).
const ALLOCATORS: [&str; 4] = [
    "usr/lib/aarch64-linux-gnu/libjemalloc.so.2",
    "usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4",
    "usr/lib/aarch64-linux-gnu/libmimalloc.so.2.0",
    "lib/aarch64-linux-musl/libc.so",
];

/// Modules of the kernel package kept in `modules/` of the assets (the VM's kernel
/// mode test loads the RAM disk driver: no dependencies, no signature needed).
const MODULES: [&str; 1] = ["kernel/drivers/block/brd.ko"];

/// The assets directory, fetched and unpacked if it is not complete yet: it holds
/// `vmlinuz`, `bin/busybox`, the C and C++ libraries under `lib/` and [`MODULES`]
/// under `modules/`, and the [`FENTRY_KERNEL_SUITE`]'s kernel as
/// `kernels/<release>/vmlinuz` (`<release>` as `uname -r` gives it).
///
/// `.complete` names the kernel package and then [`PACKAGES`], [`MODULES`] and
/// [`FENTRY_KERNEL_SUITE`]: assets fetched for other lists are fetched again.
pub fn ensure_assets() -> Result<PathBuf> {
    let base = workspace_root().join("target/arm64-vm");
    let assets = base.join("assets");
    let complete = assets.join(".complete");
    if std::fs::read_to_string(&complete)
        .is_ok_and(|marker| marker.lines().skip(1).eq(marked_lists()))
    {
        return Ok(assets);
    }
    step("fetching Debian's arm64 kernel, busybox and C and C++ libraries for the VM test");
    let (archive, signed_by) = debian_archive()?;
    let sources = arm64_sources()?
        + &source_line("arm64", &archive, signed_by.as_deref(), FENTRY_KERNEL_SUITE);
    let apt = PrivateApt::new(&base.join("apt"), "arm64", &sources)?;
    apt.update()?;
    let kernel = apt.depends_on(KERNEL_METAPACKAGE)?;
    let fentry_kernel = apt.depends_on(&format!("{KERNEL_METAPACKAGE}/{FENTRY_KERNEL_SUITE}"))?;
    let debs = base.join("debs");
    fresh_dir(&debs)?;
    let mut packages = vec![kernel.as_str()];
    packages.extend(PACKAGES);
    apt.download(&debs, &packages)?;
    // Apart from the others: only its vmlinuz is unpacked, not over the 6.1 kernel's.
    let fentry_debs = base.join("fentry-debs");
    fresh_dir(&fentry_debs)?;
    apt.download(&fentry_debs, &[&fentry_kernel])?;
    let unpacked = base.join("unpacked");
    fresh_dir(&unpacked)?;
    unpack_all(&debs, &unpacked)?;
    let _ = std::fs::remove_dir_all(&assets);
    std::fs::create_dir_all(assets.join("bin"))?;
    keep_vmlinuz(&unpacked, &assets)?;
    std::fs::copy(unpacked.join("bin/busybox"), assets.join("bin/busybox"))?;
    // The C library with its loader: lib/ld-linux-aarch64.so.1 and lib/aarch64-linux-gnu/.
    Command::new("cp")
        .arg("-a")
        .arg(unpacked.join("lib"))
        .arg(&assets)
        .run()?;
    keep_modules(&unpacked, &assets)?;
    let _ = std::fs::remove_dir_all(assets.join("lib/modules"));
    keep_libstdcxx(&unpacked, &assets)?;
    keep_allocators(&unpacked, &assets)?;
    keep_fentry_kernel(
        &fentry_debs,
        &fentry_kernel,
        &base.join("unpacked-fentry"),
        &assets,
    )?;
    let _ = std::fs::remove_dir_all(&fentry_debs);
    let mut marker = kernel;
    for package in marked_lists() {
        marker.push('\n');
        marker.push_str(package);
    }
    std::fs::write(&complete, marker)?;
    let _ = std::fs::remove_dir_all(&unpacked);
    Ok(assets)
}

/// What `.complete` lists after the kernel package: [`PACKAGES`], [`MODULES`] and
/// [`FENTRY_KERNEL_SUITE`].
fn marked_lists() -> impl Iterator<Item = &'static str> {
    PACKAGES
        .iter()
        .chain(MODULES.iter())
        .chain([&FENTRY_KERNEL_SUITE])
        .copied()
}

/// Unpacks every .deb in `debs`, whole, into `unpacked`.
fn unpack_all(debs: &Path, unpacked: &Path) -> Result<()> {
    for deb in std::fs::read_dir(debs)? {
        let deb = deb?.path();
        Command::new("dpkg-deb")
            .arg("-x")
            .arg(&deb)
            .arg(unpacked)
            .run()?;
    }
    Ok(())
}

/// Copies the unpacked kernel package's `/boot/vmlinuz-*` to `assets/vmlinuz`.
fn keep_vmlinuz(unpacked: &Path, assets: &Path) -> Result<()> {
    let vmlinuz = std::fs::read_dir(unpacked.join("boot"))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("vmlinuz-"))
        })
        .context("the kernel package has no /boot/vmlinuz-*")?;
    std::fs::copy(&vmlinuz, assets.join("vmlinuz"))?;
    Ok(())
}

/// Copies the unpacked libstdc++6's `libstdc++.so.6*` into `lib/aarch64-linux-gnu/`
/// of the assets.
fn keep_libstdcxx(unpacked: &Path, assets: &Path) -> Result<()> {
    // libstdc++ is under /usr/lib/aarch64-linux-gnu: next to the C library, where the
    // dynamic loader looks first (the VM has no ld.so.cache), it needs no other path.
    let usr_lib = unpacked.join("usr/lib/aarch64-linux-gnu");
    let libstdcxx: Vec<PathBuf> = std::fs::read_dir(&usr_lib)
        .with_context(|| format!("reading {}", usr_lib.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("libstdc++.so.6"))
        })
        .collect();
    if libstdcxx.is_empty() {
        bail!(
            "libstdc++6 unpacked no {}/libstdc++.so.6*",
            usr_lib.display()
        );
    }
    Command::new("cp")
        .arg("-a")
        .args(&libstdcxx)
        .arg(assets.join("lib/aarch64-linux-gnu"))
        .run()
}

/// Copies [`ALLOCATORS`] of the unpacked packages into `allocators/` of the assets.
fn keep_allocators(unpacked: &Path, assets: &Path) -> Result<()> {
    std::fs::create_dir_all(assets.join("allocators"))?;
    for library in ALLOCATORS {
        let from = unpacked.join(library);
        // Links resolved: libjemalloc.so.2 and its kind are symbolic links.
        let from = std::fs::canonicalize(&from)
            .with_context(|| format!("the allocator packages unpacked no {}", from.display()))?;
        let name = Path::new(library)
            .file_name()
            .context("an allocator library without a file name")?;
        std::fs::copy(&from, assets.join("allocators").join(name))?;
    }
    Ok(())
}

/// Unpacks the vmlinuz of the kernel package `kernel` (downloaded into `debs`) into
/// `assets/kernels/<release>/`.
fn keep_fentry_kernel(debs: &Path, kernel: &str, unpacked: &Path, assets: &Path) -> Result<()> {
    let release = kernel_release(kernel)?;
    let deb = find_deb(debs, &format!("{kernel}_"))?;
    fresh_dir(unpacked)?;
    let vmlinuz = format!("./boot/vmlinuz-{release}");
    extract(&deb, unpacked, &[&vmlinuz])?;
    let dir = assets.join("kernels").join(release);
    std::fs::create_dir_all(&dir)?;
    copy_vmlinuz(unpacked, &vmlinuz, &dir, kernel)?;
    let _ = std::fs::remove_dir_all(unpacked);
    Ok(())
}

/// Copies [`MODULES`] of the unpacked kernel package (`lib/modules/<version>/...`)
/// into `modules/` of the assets, by file name.
fn keep_modules(unpacked: &Path, assets: &Path) -> Result<()> {
    let modules = unpacked.join("lib/modules");
    let version = std::fs::read_dir(&modules)
        .with_context(|| format!("reading {}", modules.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.is_dir())
        .with_context(|| format!("the kernel package has no {}/<version>", modules.display()))?;
    std::fs::create_dir_all(assets.join("modules"))?;
    for module in MODULES {
        let from = version.join(module);
        let name = Path::new(module)
            .file_name()
            .context("a module without a file name")?;
        std::fs::copy(&from, assets.join("modules").join(name))
            .with_context(|| format!("the kernel package has no {}", from.display()))?;
    }
    Ok(())
}
