//! What the x86-64 VM test boots: Debian's own amd64 kernels (bullseye's 5.10,
//! bookworm's 6.1, bookworm-backports' 6.12, and trixie-backports' newest, 6.18 or
//! later: the `kfree_rcu` sheaves), each with its `brd.ko`, and busybox,
//! fetched as .debs under a private apt configuration (the machine's own sources
//! list and state are neither read for suites nor changed) and unpacked into
//! `target/x86-vm/assets`.
//!
//! The test itself (heapprof-daemon/tests/x86_vm.rs) builds an initramfs from these,
//! the static x86-64 heapprofd and its test programs, boots each kernel under
//! qemu-system-x86_64 (TCG) and checks the profiles the VM prints.

use std::{
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use anyhow::{Context as _, Result, bail};

use super::{
    bpftrace,
    debian::{PrivateApt, debian_archive, extract, find_deb, has_member},
};
use crate::{step, workspace_root};

/// The suites whose kernel the VM boots, oldest first: each suite's
/// `linux-image-amd64` names the kernel image package.
const SUITES: [&str; 4] = [
    "bullseye",
    "bookworm",
    "bookworm-backports",
    "trixie-backports",
];

/// Where busybox comes from.
const BUSYBOX: &str = "busybox-static/bookworm";

/// The RAM disk driver in each kernel package (no dependencies, no signature
/// needed); 6.12's is xz-compressed.
const BRD: &str = "kernel/drivers/block/brd.ko";

/// The suite whose kernel also mounts the bpftrace disk ([`bpftrace`]).
const BPFTRACE_KERNEL_SUITE: &str = "bookworm-backports";

/// The modules that kernel needs to read the disk, in the order they load (each after
/// those it needs): Debian builds ext4 and virtio-blk as modules, and ext4 asks for
/// crc32c whatever the file system's features.
const DISK_MODULES: [&str; 6] = [
    "kernel/crypto/crc32c_generic.ko",
    "kernel/lib/crc16.ko",
    "kernel/fs/mbcache.ko",
    "kernel/fs/jbd2/jbd2.ko",
    "kernel/fs/ext4/ext4.ko",
    "kernel/drivers/block/virtio_blk.ko",
];

/// Names the bpftrace disk in `.complete`: assets fetched before it existed are
/// fetched again.
const BPFTRACE_MARK: &str = "bpftrace-disk";

/// The assets directory, fetched and unpacked if it is not complete yet: it holds
/// `bin/busybox`, for each suite `kernels/<release>/vmlinuz` and
/// `kernels/<release>/brd.ko` (`<release>` as `uname -r` gives it), for the
/// bookworm-backports kernel also [`DISK_MODULES`] in `kernels/<release>/disk/`
/// and a file `order` naming them in their loading order, and the bpftrace disk
/// image [`bpftrace::IMAGE`].
///
/// `.complete` lists [`SUITES`], [`BPFTRACE_MARK`] and then the kernel packages:
/// assets fetched for other suites are fetched again (a newer kernel in a suite is
/// fetched when the assets are removed).
pub fn ensure_assets() -> Result<PathBuf> {
    let base = workspace_root().join("target/x86-vm");
    let assets = base.join("assets");
    let complete = assets.join(".complete");
    let head: Vec<&str> = SUITES.iter().copied().chain([BPFTRACE_MARK]).collect();
    if std::fs::read_to_string(&complete)
        .is_ok_and(|marker| marker.lines().take(head.len()).eq(head.iter().copied()))
    {
        return Ok(assets);
    }
    step(
        "fetching Debian's amd64 kernels (5.10, 6.1, 6.12, trixie-backports') and busybox for \
         the x86-64 VM test",
    );
    let (archive, signed_by) = debian_archive()?;
    let options = match &signed_by {
        Some(signed) => format!("[arch=amd64 {signed}]"),
        None => "[arch=amd64]".to_owned(),
    };
    let sources: String = SUITES
        .iter()
        .map(|suite| format!("deb {options} {archive} {suite} main\n"))
        .collect();
    let apt = PrivateApt::new(&base.join("apt"), "amd64", &sources)?;
    apt.update()?;
    let mut kernels = Vec::new();
    let mut bpftrace_kernel = None;
    for suite in SUITES {
        let kernel = apt.depends_on(&format!("linux-image-amd64/{suite}"))?;
        if suite == BPFTRACE_KERNEL_SUITE {
            bpftrace_kernel = Some(kernel.clone());
        }
        kernels.push(kernel);
    }
    let debs = base.join("debs");
    let _ = std::fs::remove_dir_all(&debs);
    std::fs::create_dir_all(&debs)?;
    let mut packages: Vec<&str> = kernels.iter().map(String::as_str).collect();
    packages.push(BUSYBOX);
    apt.download(&debs, &packages)?;
    let _ = std::fs::remove_dir_all(&assets);
    std::fs::create_dir_all(assets.join("bin"))?;
    let busybox_deb = find_deb(&debs, "busybox-static_")?;
    let unpacked = base.join("unpacked");
    let _ = std::fs::remove_dir_all(&unpacked);
    std::fs::create_dir_all(&unpacked)?;
    extract(&busybox_deb, &unpacked, &["./bin/busybox"])?;
    let busybox = assets.join("bin/busybox");
    std::fs::copy(unpacked.join("bin/busybox"), &busybox)?;
    for kernel in &kernels {
        let deb = find_deb(&debs, &format!("{kernel}_"))?;
        let release = kernel
            .strip_prefix("linux-image-")
            .context("a kernel package not named linux-image-*")?;
        let dir = assets.join("kernels").join(release);
        std::fs::create_dir_all(&dir)?;
        let vmlinuz = format!("./boot/vmlinuz-{release}");
        // Debian 13's kernels (trixie and its backports) split the image package: the
        // kernel is in linux-binary-*, the modules in linux-modules-*, under /usr/lib.
        let with_disk = bpftrace_kernel.as_ref() == Some(kernel);
        let mut wanted = vec![BRD];
        if with_disk {
            wanted.extend(DISK_MODULES);
        }
        let (vmlinuz, modules) = if has_member(&deb, &vmlinuz)? {
            let mut patterns = vec![vmlinuz.clone()];
            patterns.extend(
                wanted
                    .iter()
                    .map(|module| format!("./lib/modules/{release}/{module}*")),
            );
            let patterns: Vec<&str> = patterns.iter().map(String::as_str).collect();
            extract(&deb, &unpacked, &patterns)?;
            (vmlinuz, format!("lib/modules/{release}"))
        } else {
            let binary = format!("linux-binary-{release}");
            let modules = format!("linux-modules-{release}");
            apt.download(&debs, &[&binary, &modules])?;
            let vmlinuz = format!("./usr/lib/modules/{release}/vmlinuz");
            extract(
                &find_deb(&debs, &format!("{binary}_"))?,
                &unpacked,
                &[&vmlinuz],
            )?;
            let patterns: Vec<String> = wanted
                .iter()
                .map(|module| format!("./usr/lib/modules/{release}/{module}*"))
                .collect();
            let patterns: Vec<&str> = patterns.iter().map(String::as_str).collect();
            extract(
                &find_deb(&debs, &format!("{modules}_"))?,
                &unpacked,
                &patterns,
            )?;
            (vmlinuz, format!("usr/lib/modules/{release}"))
        };
        std::fs::copy(
            unpacked.join(vmlinuz.trim_start_matches("./")),
            dir.join("vmlinuz"),
        )
        .with_context(|| format!("{kernel} has no {vmlinuz}"))?;
        let modules = unpacked.join(modules);
        keep_module(&modules, BRD, &dir, &busybox).with_context(|| kernel.clone())?;
        if with_disk {
            let disk = dir.join("disk");
            std::fs::create_dir_all(&disk)?;
            let mut order = String::new();
            for module in DISK_MODULES {
                let name = keep_module(&modules, module, &disk, &busybox)
                    .with_context(|| kernel.clone())?;
                order.push_str(&name);
                order.push('\n');
            }
            std::fs::write(disk.join("order"), order)?;
        }
    }
    if bpftrace_kernel.is_none() {
        bail!("no kernel of {BPFTRACE_KERNEL_SUITE}, the suite whose boot runs bpftrace");
    }
    step("fetching bpftrace and its libraries into a disk image for the x86-64 VM test");
    let bpftrace_sources = format!("deb {options} {archive} {} main\n", bpftrace::SUITE);
    bpftrace::build_image(
        &base.join("bpftrace"),
        &bpftrace_sources,
        &assets.join(bpftrace::IMAGE),
    )?;
    let mut marker: Vec<&str> = head;
    marker.extend(kernels.iter().map(String::as_str));
    std::fs::write(&complete, marker.join("\n") + "\n")?;
    let _ = std::fs::remove_dir_all(&unpacked);
    let _ = std::fs::remove_dir_all(&debs);
    Ok(assets)
}

/// Copies the module `module` (`kernel/.../name.ko`, or its `.ko.xz`, unpacked) of
/// the kernel's unpacked `modules` directory into `dir`, as `name.ko`; returns `name`.
fn keep_module(modules: &Path, module: &str, dir: &Path, busybox: &Path) -> Result<String> {
    let plain = modules.join(module);
    let file = plain
        .file_name()
        .and_then(|n| n.to_str())
        .context("a module without a file name")?
        .to_owned();
    let compressed = plain.with_extension("ko.xz");
    if plain.exists() {
        std::fs::copy(&plain, dir.join(&file))?;
    } else if compressed.exists() {
        // busybox's unxz: the host needs no xz of its own.
        let out = std::fs::File::create(dir.join(&file))?;
        let status = Command::new(busybox)
            .args(["unxz", "-c"])
            .arg(&compressed)
            .stdout(Stdio::from(out))
            .status()
            .context("running busybox unxz")?;
        if !status.success() {
            bail!("busybox unxz {} failed: {status}", compressed.display());
        }
    } else {
        bail!("no {module} (or .ko.xz) in the kernel package");
    }
    Ok(file.trim_end_matches(".ko").to_owned())
}
