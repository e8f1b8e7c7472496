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

use crate::{
    CmdExt as _, step,
    vm::{PrivateApt, debian_archive},
    workspace_root,
};

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

/// The assets directory, fetched and unpacked if it is not complete yet: it holds
/// `bin/busybox` and, for each suite, `kernels/<release>/vmlinuz` and
/// `kernels/<release>/brd.ko` (`<release>` as `uname -r` gives it).
///
/// `.complete` lists [`SUITES`] and then the kernel packages: assets fetched for
/// other suites are fetched again (a newer kernel in a suite is fetched when the
/// assets are removed).
pub fn ensure_assets() -> Result<PathBuf> {
    let base = workspace_root().join("target/x86-vm");
    let assets = base.join("assets");
    let complete = assets.join(".complete");
    if std::fs::read_to_string(&complete)
        .is_ok_and(|marker| marker.lines().take(SUITES.len()).eq(SUITES))
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
    for suite in SUITES {
        kernels.push(apt.depends_on(&format!("linux-image-amd64/{suite}"))?);
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
        let (vmlinuz, modules) = if has_member(&deb, &vmlinuz)? {
            extract(
                &deb,
                &unpacked,
                &[&vmlinuz, &format!("./lib/modules/{release}/{BRD}*")],
            )?;
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
            extract(
                &find_deb(&debs, &format!("{modules}_"))?,
                &unpacked,
                &[&format!("./usr/lib/modules/{release}/{BRD}*")],
            )?;
            (vmlinuz, format!("usr/lib/modules/{release}"))
        };
        std::fs::copy(
            unpacked.join(vmlinuz.trim_start_matches("./")),
            dir.join("vmlinuz"),
        )
        .with_context(|| format!("{kernel} has no {vmlinuz}"))?;
        let plain = unpacked.join(format!("{modules}/{BRD}"));
        let compressed = plain.with_extension("ko.xz");
        if plain.exists() {
            std::fs::copy(&plain, dir.join("brd.ko"))?;
        } else if compressed.exists() {
            // busybox's unxz: the host needs no xz of its own.
            let out = std::fs::File::create(dir.join("brd.ko"))?;
            let status = Command::new(&busybox)
                .args(["unxz", "-c"])
                .arg(&compressed)
                .stdout(Stdio::from(out))
                .status()
                .context("running busybox unxz")?;
            if !status.success() {
                bail!("busybox unxz {} failed: {status}", compressed.display());
            }
        } else {
            bail!("{kernel} has no {BRD} (or .ko.xz)");
        }
    }
    let mut marker: Vec<&str> = SUITES.to_vec();
    marker.extend(kernels.iter().map(String::as_str));
    std::fs::write(&complete, marker.join("\n") + "\n")?;
    let _ = std::fs::remove_dir_all(&unpacked);
    let _ = std::fs::remove_dir_all(&debs);
    Ok(assets)
}

/// The .deb in `dir` whose file name starts with `prefix`.
fn find_deb(dir: &Path, prefix: &str) -> Result<PathBuf> {
    std::fs::read_dir(dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(prefix) && n.ends_with(".deb"))
        })
        .with_context(|| format!("apt downloaded no {prefix}*.deb into {}", dir.display()))
}

/// Whether `deb` holds the file `member` (`./path`).
fn has_member(deb: &Path, member: &str) -> Result<bool> {
    let output = Command::new("dpkg-deb")
        .arg("--contents")
        .arg(deb)
        .output()
        .with_context(|| format!("listing {}", deb.display()))?;
    if !output.status.success() {
        bail!("dpkg-deb --contents {} failed", deb.display());
    }
    Ok(String::from_utf8_lossy(&output.stdout)
        .lines()
        .any(|line| line.split_whitespace().nth(5) == Some(member)))
}

/// Unpacks the members of `deb` matching `patterns` (tar wildcards) into `into`:
/// only what the VM needs, not a kernel package's hundreds of MiB of modules.
fn extract(deb: &Path, into: &Path, patterns: &[&str]) -> Result<()> {
    Command::new("sh")
        .arg("-c")
        .arg(r#"deb=$0; into=$1; shift; dpkg-deb --fsys-tarfile "$deb" | tar -x -C "$into" --wildcards "$@""#)
        .arg(deb)
        .arg(into)
        .args(patterns)
        .run()
}
