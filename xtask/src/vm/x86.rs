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
    debian::{
        PrivateApt, copy_vmlinuz, debian_archive, extract, find_deb, fresh_dir, has_member,
        kernel_release, source_line,
    },
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
    let source = |suite: &str| source_line("amd64", &archive, signed_by.as_deref(), suite);
    let sources: String = SUITES.iter().map(|suite| source(suite)).collect();
    let apt = PrivateApt::new(&base.join("apt"), "amd64", &sources)?;
    apt.update()?;
    let (kernels, bpftrace_kernel) = kernel_packages(&apt)?;
    let debs = base.join("debs");
    fresh_dir(&debs)?;
    let mut packages: Vec<&str> = kernels.iter().map(String::as_str).collect();
    packages.push(BUSYBOX);
    apt.download(&debs, &packages)?;
    let _ = std::fs::remove_dir_all(&assets);
    std::fs::create_dir_all(assets.join("bin"))?;
    let unpacked = base.join("unpacked");
    let busybox = keep_busybox(&debs, &unpacked, &assets)?;
    let unpacker = KernelUnpacker {
        apt: &apt,
        debs: &debs,
        unpacked: &unpacked,
        busybox: &busybox,
    };
    for kernel in &kernels {
        let with_disk = bpftrace_kernel.as_ref() == Some(kernel);
        unpacker.keep(kernel, with_disk, &assets)?;
    }
    if bpftrace_kernel.is_none() {
        bail!("no kernel of {BPFTRACE_KERNEL_SUITE}, the suite whose boot runs bpftrace");
    }
    step("fetching bpftrace and its libraries into a disk image for the x86-64 VM test");
    bpftrace::build_image(
        &base.join("bpftrace"),
        &source(bpftrace::SUITE),
        &assets.join(bpftrace::IMAGE),
    )?;
    let mut marker: Vec<&str> = head;
    marker.extend(kernels.iter().map(String::as_str));
    std::fs::write(&complete, marker.join("\n") + "\n")?;
    let _ = std::fs::remove_dir_all(&unpacked);
    let _ = std::fs::remove_dir_all(&debs);
    Ok(assets)
}

/// The kernel image packages of [`SUITES`], in their order, and the one of
/// [`BPFTRACE_KERNEL_SUITE`] (whose boot also mounts the bpftrace disk).
fn kernel_packages(apt: &PrivateApt) -> Result<(Vec<String>, Option<String>)> {
    let mut kernels = Vec::new();
    let mut bpftrace_kernel = None;
    for suite in SUITES {
        let kernel = apt.depends_on(&format!("linux-image-amd64/{suite}"))?;
        if suite == BPFTRACE_KERNEL_SUITE {
            bpftrace_kernel = Some(kernel.clone());
        }
        kernels.push(kernel);
    }
    Ok((kernels, bpftrace_kernel))
}

/// Unpacks busybox from its .deb in `debs` (through a fresh `unpacked`) into
/// `assets/bin/busybox`; returns that path (it also decompresses the modules).
fn keep_busybox(debs: &Path, unpacked: &Path, assets: &Path) -> Result<PathBuf> {
    let busybox_deb = find_deb(debs, "busybox-static_")?;
    fresh_dir(unpacked)?;
    extract(&busybox_deb, unpacked, &["./bin/busybox"])?;
    let busybox = assets.join("bin/busybox");
    std::fs::copy(unpacked.join("bin/busybox"), &busybox)?;
    Ok(busybox)
}

/// What unpacking the kernel packages shares: the apt that downloads the packages
/// Debian 13 splits off, where the .debs are, where they are unpacked and the busybox
/// whose unxz decompresses the modules.
struct KernelUnpacker<'a> {
    apt: &'a PrivateApt,
    debs: &'a Path,
    unpacked: &'a Path,
    busybox: &'a Path,
}

impl KernelUnpacker<'_> {
    /// Keeps the kernel package `kernel`'s vmlinuz and [`BRD`] in
    /// `assets/kernels/<release>/`, and with `with_disk` also [`DISK_MODULES`] in its
    /// `disk/`.
    fn keep(&self, kernel: &str, with_disk: bool, assets: &Path) -> Result<()> {
        let deb = find_deb(self.debs, &format!("{kernel}_"))?;
        let release = kernel_release(kernel)?;
        let dir = assets.join("kernels").join(release);
        std::fs::create_dir_all(&dir)?;
        let mut wanted = vec![BRD];
        if with_disk {
            wanted.extend(DISK_MODULES);
        }
        let (vmlinuz, modules) = self.extract_kernel(&deb, release, &wanted)?;
        copy_vmlinuz(self.unpacked, &vmlinuz, &dir, kernel)?;
        let modules = self.unpacked.join(modules);
        keep_module(&modules, BRD, &dir, self.busybox).with_context(|| kernel.to_owned())?;
        if with_disk {
            keep_disk_modules(&modules, &dir, self.busybox, kernel)?;
        }
        Ok(())
    }

    /// Unpacks the kernel image and the `wanted` modules of the kernel package `deb`
    /// (or of the packages it is split into); returns the image's member (`./...`)
    /// and the modules' directory, both as unpacked under `unpacked`.
    fn extract_kernel(
        &self,
        deb: &Path,
        release: &str,
        wanted: &[&str],
    ) -> Result<(String, String)> {
        let vmlinuz = format!("./boot/vmlinuz-{release}");
        // Debian 13's kernels (trixie and its backports) split the image package: the
        // kernel is in linux-binary-*, the modules in linux-modules-*, under /usr/lib.
        if !has_member(deb, &vmlinuz)? {
            return self.extract_split_kernel(release, wanted);
        }
        let mut patterns = vec![vmlinuz.clone()];
        patterns.extend(module_patterns("./lib/modules", release, wanted));
        let patterns: Vec<&str> = patterns.iter().map(String::as_str).collect();
        extract(deb, self.unpacked, &patterns)?;
        Ok((vmlinuz, format!("lib/modules/{release}")))
    }

    /// [`Self::extract_kernel`] for a Debian 13 kernel: downloads its
    /// linux-binary-* and linux-modules-* packages and unpacks from them.
    fn extract_split_kernel(&self, release: &str, wanted: &[&str]) -> Result<(String, String)> {
        let binary = format!("linux-binary-{release}");
        let modules = format!("linux-modules-{release}");
        self.apt.download(self.debs, &[&binary, &modules])?;
        let vmlinuz = format!("./usr/lib/modules/{release}/vmlinuz");
        extract(
            &find_deb(self.debs, &format!("{binary}_"))?,
            self.unpacked,
            &[&vmlinuz],
        )?;
        let patterns = module_patterns("./usr/lib/modules", release, wanted);
        let patterns: Vec<&str> = patterns.iter().map(String::as_str).collect();
        extract(
            &find_deb(self.debs, &format!("{modules}_"))?,
            self.unpacked,
            &patterns,
        )?;
        Ok((vmlinuz, format!("usr/lib/modules/{release}")))
    }
}

/// The tar wildcards of the `wanted` modules (each plain or compressed) of the
/// kernel `release` under the package's `root` (`./lib/modules` or `./usr/lib/modules`).
fn module_patterns(root: &str, release: &str, wanted: &[&str]) -> Vec<String> {
    wanted
        .iter()
        .map(|module| format!("{root}/{release}/{module}*"))
        .collect()
}

/// Keeps [`DISK_MODULES`] of the kernel package `kernel`'s unpacked `modules` in
/// `dir/disk/`, with the file `order` naming them in their loading order.
fn keep_disk_modules(modules: &Path, dir: &Path, busybox: &Path, kernel: &str) -> Result<()> {
    let disk = dir.join("disk");
    std::fs::create_dir_all(&disk)?;
    let mut order = String::new();
    for module in DISK_MODULES {
        let name =
            keep_module(modules, module, &disk, busybox).with_context(|| kernel.to_owned())?;
        order.push_str(&name);
        order.push('\n');
    }
    std::fs::write(disk.join("order"), order)?;
    Ok(())
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
